"""Debian's PostgreSQL as Airflow's metadata database: installed if missing, one server per deployment.

The server runs as the ``postgres`` user (it refuses to run as root) on a free loopback port with ``trust`` auth; it
is a throwaway test database, so durability is switched off for speed. Its data dir lives outside the deployment's
state dir because the state dir may sit in a tree only root can enter (pytest's ``/tmp/pytest-of-root`` is 0700);
the state dir holds a ``postgres`` symlink to it, and the server's log.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

PG_USER = "postgres"
DATABASE = "airflow"
#: Written before ``apt-get install`` so that installing the package does not create and start Debian's default
#: cluster on port 5432, a server that nothing here would ever stop.
CREATECLUSTER_CONF = Path("/etc/postgresql-common/createcluster.conf")


class PostgresError(RuntimeError):
    """PostgreSQL could not be installed, initialised or started; the message says which step and why."""


def bin_dir() -> Path | None:
    """The newest installed server's ``bin`` (``/usr/lib/postgresql/<major>/bin``), or None."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")]
    found = [d for d in found if (d / "initdb").is_file()]
    if not found:
        return None
    return max(found, key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)


def ensure_installed(log: Callable[[str], None], log_file: Path) -> Path:
    """Return the server's ``bin`` dir, installing Debian's ``postgresql`` with apt-get first if it is missing."""
    found = bin_dir()
    if found is not None and _has_user():
        return found
    if os.geteuid() != 0:
        raise PostgresError("PostgreSQL is not installed, and installing it (apt-get) needs root")
    log(f"PostgreSQL not found: installing Debian's postgresql with apt-get (about a minute; log: {log_file})")
    if not CREATECLUSTER_CONF.exists():
        CREATECLUSTER_CONF.parent.mkdir(parents=True, exist_ok=True)
        CREATECLUSTER_CONF.write_text(
            "# airflow-provider-torchelastic tests: no default cluster\ncreate_main_cluster = false\n"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # confold: keep the createcluster.conf written above instead of asking on a terminal that is not there.
    commands = [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends",
         "-o", "Dpkg::Options::=--force-confold", "-o", "Dpkg::Options::=--force-confdef", "postgresql"],
    ]  # fmt: skip
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        for cmd in commands:
            code = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            ).returncode
            if code != 0:
                raise PostgresError(
                    f"`{' '.join(cmd)}` failed (exit {code}); last lines of {log_file}:\n{tail(log_file)}"
                )
    found = bin_dir()
    if found is None or not _has_user():
        raise PostgresError("apt-get installed postgresql, but there is no /usr/lib/postgresql/*/bin/postgres or no "
                            "user postgres")  # fmt: skip
    return found


def data_dir_for(state_dir: Path) -> Path:
    """Where the server of the deployment in ``state_dir`` keeps its files: a fixed name, so ``down`` finds it."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"torchelastic-airflow-pg-{digest}"


def as_postgres(pg_dir: Path) -> dict[str, Any]:
    """``subprocess.Popen`` arguments that run a command as the postgres user, from a directory it can enter."""
    user = pwd.getpwnam(PG_USER)
    return {"cwd": pg_dir, "user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def base_env() -> dict[str, str]:
    user = pwd.getpwnam(PG_USER)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": user.pw_dir,
        "USER": PG_USER,
        "LOGNAME": PG_USER,
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
    }


def init(pg_bin: Path, pg_dir: Path, env: dict[str, str], out: IO[bytes]) -> None:
    """A fresh ``initdb`` in ``pg_dir/data``; anything in ``pg_dir`` before is removed."""
    remove(pg_dir)
    pg_dir.mkdir(mode=0o700)
    user = pwd.getpwnam(PG_USER)
    os.chown(pg_dir, user.pw_uid, user.pw_gid)
    cmd = [str(pg_bin / "initdb"), "-D", str(pg_dir / "data"), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync"]
    code = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, **as_postgres(pg_dir)
    ).returncode
    if code != 0:
        raise PostgresError(f"initdb failed (exit {code}); see the postgres log")


def server_command(pg_bin: Path, pg_dir: Path, port: int) -> list[str]:
    # The database lives as long as the deployment: durability off makes migrations and heartbeats cheaper.
    settings = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "unix_socket_directories": str(pg_dir),
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "200",
    }
    cmd = [str(pg_bin / "postgres"), "-D", str(pg_dir / "data")]
    for key, value in settings.items():
        cmd += ["-c", f"{key}={value}"]
    return cmd


def wait_ready(port: int, timeout: float, check: Callable[[], None]) -> None:
    """Wait until the server accepts connections, then create the ``airflow`` database."""
    import psycopg2

    deadline = time.monotonic() + timeout
    while True:
        check()
        try:
            conn = psycopg2.connect(host="127.0.0.1", port=port, user=PG_USER, dbname="postgres", connect_timeout=2)
            break
        except psycopg2.OperationalError as e:
            if time.monotonic() > deadline:
                raise PostgresError(
                    f"PostgreSQL did not accept connections on port {port} in {timeout:.0f}s: {e}"
                ) from e
            time.sleep(0.2)
    try:
        conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        conn.close()


def sqlalchemy_url(port: int) -> str:
    return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{port}/{DATABASE}"


def remove(pg_dir: Path) -> None:
    shutil.rmtree(pg_dir, ignore_errors=True)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _has_user() -> bool:
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        return False
    return True

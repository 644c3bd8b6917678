"""A real Airflow deployment for the tests: api-server, scheduler (LocalExecutor), dag-processor and triggerer, each
its own process, on a PostgreSQL metadata database, with the DAGs of ``tests/deployment_dags``.

Layout of a state dir (everything a deployment owns is found from it, so ``down`` works from another process)::

    state.json        ports, credentials, paths; written once the deployment is up (``up`` reads it: "already up")
    pids.json         {name: {"pid", "create_time", "cmd"}} for postgres and the four Airflow processes
    home/             AIRFLOW_HOME: airflow.cfg, the admin's password file, task and trigger logs (home/logs)
    logs/<name>.log   stdout+stderr of each process, and of ``airflow db migrate`` and apt-get
    postgres          symlink to the database's dir (outside the state dir: see tests.airflow_services.postgres)
    job_kinds/        the test-only job kind's distribution (tests.fake_kind), on every Airflow process's PYTHONPATH
    cluster/          a local cluster that ``python -m tests.airflow_services up`` started itself (``down`` stops it)

Every process is started in its own session, and carries ``TORCHELASTIC_AIRFLOW_SERVICES=<state dir>`` in its
environment; ``stop`` signals each process group and every descendant, then sweeps any process still carrying the
marker (a task runner in its own group whose parent died first), so nothing outlives ``down``.

Every deployment has the test-only ``FakeJob`` kind plugged in (``job_kinds/``), so that a test can run one through
the scheduler, the triggerer and the api-server (tests/deployment/test_plugged_kind.py). Always, not on request: one
deployment serves all the tests of a session, a process reads its entry points once, and the kind claims only
``Elastic(nproc_per_node=3)`` configs, which no other DAG here uses; where its CRD is not installed it costs one
answered 404 per sweep, per UI listing and per shared watch (every 30 s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests import fake_kind
from tests.airflow_services import postgres
from tests.cluster.control_plane import (
    ProcessRecord,
    ancestors,
    cmdline,
    free_ports,
    process_group,
    read_pids,
    signal_proc,
    wait_gone,
    write_pids,
)
from tests.cluster.pytest_plugin import airflow_connection_json
from tests.dag_support import SIM_IMAGE
from tests.deployment_dags import node_storage

REPO_ROOT = Path(__file__).resolve().parents[2]
DAGS_FOLDER = REPO_ROOT / "tests" / "deployment_dags"
#: The image of a deployment on the simulated kubelet, which runs every image as the runner env (the name only has to
#: be valid); on the real node it is the runner image built from docker/Dockerfile (``Deployment.start(image=)``).
SIM_RUNNER_IMAGE = SIM_IMAGE
MARKER_ENV = "TORCHELASTIC_AIRFLOW_SERVICES"
#: Where in the state dir the test-only job kind's distribution is written (module docstring).
JOB_KINDS_DIRNAME = "job_kinds"
USERNAME = "admin"

#: The Airflow processes, in start order, with their ``airflow`` subcommands.
SERVICES: Mapping[str, tuple[str, ...]] = {
    "dag-processor": ("dag-processor",),
    "scheduler": ("scheduler",),
    "triggerer": ("triggerer",),
    "api-server": ("api-server",),
}
#: The health endpoint's name for each process that heartbeats.
HEARTBEATS = {"scheduler": "scheduler", "triggerer": "triggerer", "dag-processor": "dag_processor"}

DEFAULT_STATE_DIR_ENV = "TORCHELASTIC_AIRFLOW_DIR"
DEFAULT_STATE_DIR = "/tmp/torchelastic-airflow"


class DeploymentError(RuntimeError):
    """The deployment could not be started or stopped; the message says which step and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeploymentInfo:
    """What a client (or ``down``, or a restart from another process) needs; persisted as ``state.json``."""

    state_dir: Path
    api_port: int
    pg_port: int
    pg_dir: Path
    worker_log_port: int
    trigger_log_port: int
    kubeconfig: Path
    namespace: str
    username: str
    password: str
    #: A cluster this deployment started for itself (``up`` without ``--kubeconfig``); ``down`` stops it.
    cluster_dir: Path | None = None
    #: ``[torch_elastic] image``: what the DAGs' pods run.
    image: str = SIM_RUNNER_IMAGE
    #: A folder that the DAGs' pods mount by hostPath at the same path (tests/deployment_dags/node_storage.py), where
    #: artifacts go: on the real node, the only storage a pod shares with the Airflow worker. None on the simulated
    #: kubelet, whose pods are processes of this machine and see the state dir.
    shared_dir: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def home(self) -> Path:
        return self.state_dir / "home"

    def log_file(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeploymentInfo:
        paths = {"state_dir", "pg_dir", "kubeconfig", "cluster_dir", "shared_dir"}
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: (Path(v) if k in paths and v is not None else v) for k, v in data.items() if k in known}
        return cls(**values)


def default_state_dir() -> Path:
    return Path(os.environ.get(DEFAULT_STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def load_info(state_dir: Path) -> DeploymentInfo | None:
    try:
        return DeploymentInfo.from_json(json.loads((Path(state_dir) / "state.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def is_up(state_dir: Path) -> bool:
    """Whether every process of the deployment in ``state_dir`` is alive and its API answers."""
    info = load_info(state_dir)
    if info is None:
        return False
    alive = {r.name for r in read_pids(state_dir) if r.process() is not None}
    if not {"postgres", *SERVICES} <= alive:
        return False
    try:
        return httpx.get(f"{info.base_url}/api/v2/monitor/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------


def airflow_cfg(info: DeploymentInfo, secrets_: Mapping[str, str]) -> str:
    """``airflow.cfg``: everything but the connection and the image, which come from the environment."""
    sections: dict[str, dict[str, Any]] = {
        "core": {
            "dags_folder": DAGS_FOLDER,
            "executor": "LocalExecutor",
            # Small: two cores run the services, the tasks and the simulated pods.
            "parallelism": 4,
            "load_examples": False,
            # Tests trigger DAGs as soon as they are parsed; a paused DAG's runs would wait forever.
            "dags_are_paused_at_creation": False,
            "fernet_key": secrets_["fernet_key"],
            "execution_api_server_url": f"{info.base_url}/execution/",
            "simple_auth_manager_users": f"{info.username}:admin",
            "simple_auth_manager_passwords_file": info.home / "passwords.json",
        },
        "database": {"sql_alchemy_conn": postgres.sqlalchemy_url(info.pg_port)},
        "api": {
            "host": "127.0.0.1",
            "port": info.api_port,
            "base_url": info.base_url,
            "workers": 1,
            "secret_key": secrets_["secret_key"],
        },
        # One secret for all processes: the scheduler signs the tasks' Execution API tokens, the api-server checks
        # them. Left to each process, every task would be refused.
        "api_auth": {"jwt_secret": secrets_["jwt_secret"]},
        "dag_processor": {"refresh_interval": 5, "min_file_process_interval": 10, "parsing_processes": 1},
        "scheduler": {"scheduler_heartbeat_sec": 2},
        # A task supervisor can take up to this long to report that a deferring task's process exited. If the
        # trigger fires first, Airflow 3.3.2's scheduler takes that late "success" for the resumed try as a task
        # killed externally and fails it (apache/airflow#67287, #72716; the guard for it covers only a TI still
        # `scheduled`). 5 s by default: shorter than most jobs here take to start, but not all.
        "workers": {"min_heartbeat_interval": 1},
        # A killed triggerer's triggers go to another one once its heartbeat is this old; 30 s by default.
        "triggerer": {"job_heartbeat_sec": 1, "triggerer_health_check_threshold": 5},
        # Their own ports: the defaults (8793, 8794) may be taken by another deployment on this machine.
        "logging": {"worker_log_server_port": info.worker_log_port, "trigger_log_server_port": info.trigger_log_port},
    }
    lines = ["# Written by tests/airflow_services (a test deployment); regenerated by every `up`."]
    for section, options in sections.items():
        lines.append(f"\n[{section}]")
        for key, value in options.items():
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def service_env(info: DeploymentInfo) -> dict[str, str]:
    """The Airflow processes' environment: this one without any Airflow setting of the caller's (pytest's
    sqlite home, unit-test mode), plus the deployment's home, the Kubernetes connection, the runner image, the
    test-only job kind and artifact storage in the state dir."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "_AIRFLOW", "PYTEST_", "TORCHELASTIC_E2E")) and k != MARKER_ENV
    }
    plugged = str(info.state_dir / JOB_KINDS_DIRNAME)
    storage = (info.shared_dir or info.state_dir) / "artifacts"
    if info.shared_dir is not None:
        env[node_storage.SHARED_DIR_ENV] = str(info.shared_dir)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (plugged, env.get("PYTHONPATH", "")) if p),
        AIRFLOW_HOME=str(info.home),
        AIRFLOW_CONN_KUBERNETES_DEFAULT=airflow_connection_json(info.kubeconfig, info.namespace),
        AIRFLOW__TORCH_ELASTIC__IMAGE=info.image,
        # As in the other tiers (tests/conftest.py): the local cluster serves TrainJob too.
        AIRFLOW__TORCH_ELASTIC__JOB_KIND="pytorchjob",
        # Rank 0's tensors go here: a folder the pods share with this machine (shared_dir).
        AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE=f"file://{storage}",
        PYTHONUNBUFFERED="1",
        # setproctitle would otherwise reuse the environment's memory for the long process titles Airflow sets,
        # and /proc/<pid>/environ, where stop() looks for the marker, would read as garbage.
        SPT_NOENV="1",
    )
    env[MARKER_ENV] = str(info.state_dir)
    return env


def _new_secrets() -> dict[str, str]:
    from cryptography.fernet import Fernet

    return {
        "fernet_key": Fernet.generate_key().decode(),
        "secret_key": secrets.token_hex(16),
        "jwt_secret": secrets.token_hex(32),
    }


# --------------------------------------------------------------------------------------------------------------
# Start, restart, stop
# --------------------------------------------------------------------------------------------------------------


class Deployment:
    """Starts, restarts and stops the deployment in ``state_dir``."""

    def __init__(self, state_dir: Path, *, log: Callable[[str], None] | None = None) -> None:
        self.state_dir = Path(state_dir).resolve()
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._records: dict[str, ProcessRecord] = {}
        self.info: DeploymentInfo | None = None

    # -- start --------------------------------------------------------------------------------------------------

    def start(
        self,
        *,
        kubeconfig: Path,
        namespace: str,
        cluster_dir: Path | None = None,
        image: str = SIM_RUNNER_IMAGE,
        shared_dir: Path | None = None,
        timeout: float = 240.0,
    ) -> DeploymentInfo:
        """Install PostgreSQL if needed, start it, migrate, start the four Airflow processes, wait until healthy."""
        started = time.monotonic()
        pg_bin = postgres.ensure_installed(self._log, self.state_dir / "logs" / "apt-get.log")
        if is_up(self.state_dir):
            raise DeploymentError(f"a deployment is already running in {self.state_dir}; stop it first")
        stop_deployment(self.state_dir, log=self._log)  # remnants of a crashed run
        self._fresh_state_dir()
        api_port, pg_port, worker_log_port, trigger_log_port = free_ports(4)
        info = DeploymentInfo(
            state_dir=self.state_dir,
            api_port=api_port,
            pg_port=pg_port,
            pg_dir=postgres.data_dir_for(self.state_dir),
            worker_log_port=worker_log_port,
            trigger_log_port=trigger_log_port,
            kubeconfig=Path(kubeconfig).resolve(),
            namespace=namespace,
            username=USERNAME,
            password=secrets.token_urlsafe(12),
            cluster_dir=cluster_dir,
            image=image,
            shared_dir=None if shared_dir is None else Path(shared_dir).resolve(),
        )
        self.info = info
        try:
            self._start(info, pg_bin, timeout)
        except BaseException:
            self.stop()
            raise
        (self.state_dir / "state.json").write_text(json.dumps(info.to_json(), indent=2) + "\n")
        self._log(f"Airflow is up at {info.base_url} ({time.monotonic() - started:.1f} s)")
        return info

    def _fresh_state_dir(self) -> None:
        # Only what we create: the dir may be a user-chosen path (and holds cluster/ when `up` started one).
        self.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.state_dir / "home", ignore_errors=True)
        for name in ("state.json", "pids.json", "postgres"):
            (self.state_dir / name).unlink(missing_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        for log in (self.state_dir / "logs").glob("*.log"):
            if log.name != "apt-get.log":
                log.unlink()
        (self.state_dir / "home").mkdir()

    def _start(self, info: DeploymentInfo, pg_bin: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        home = info.home
        (home / "airflow.cfg").write_text(airflow_cfg(info, _new_secrets()))
        # SimpleAuthManager reads the password from this file and only generates one for users missing from it.
        (home / "passwords.json").write_text(json.dumps({info.username: info.password}) + "\n")
        (home / "passwords.json").chmod(0o600)
        fake_kind.write_importable_distribution(self.state_dir / JOB_KINDS_DIRNAME)

        self._log(f"starting PostgreSQL on 127.0.0.1:{info.pg_port} (data in {info.pg_dir})")
        pg_env = {**postgres.base_env(), MARKER_ENV: str(self.state_dir)}
        with open(info.log_file("postgres"), "ab") as out:
            postgres.init(pg_bin, info.pg_dir, pg_env, out)
        (self.state_dir / "postgres").symlink_to(info.pg_dir)
        self._spawn(
            "postgres",
            postgres.server_command(pg_bin, info.pg_dir, info.pg_port),
            env=pg_env,
            **postgres.as_postgres(info.pg_dir),
        )
        postgres.wait_ready(info.pg_port, 60, self._check_alive)

        self._log("airflow db migrate")
        env = service_env(info)
        with open(info.log_file("db-migrate"), "ab") as out:
            try:
                code = subprocess.run(
                    [sys.executable, "-m", "airflow", "db", "migrate"],
                    cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    timeout=max(30.0, deadline - time.monotonic()),
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired as e:
                raise DeploymentError(f"`airflow db migrate` timed out; see {info.log_file('db-migrate')}") from e
        if code != 0:
            raise DeploymentError(
                f"`airflow db migrate` failed (exit {code}); last lines of {info.log_file('db-migrate')}:\n"
                + postgres.tail(info.log_file("db-migrate"))
            )

        self._log(f"starting {', '.join(SERVICES)}")
        for name in SERVICES:
            self._spawn_service(info, name, env)
        self._wait_healthy(info, deadline)

    def _spawn_service(self, info: DeploymentInfo, name: str, env: Mapping[str, str]) -> int:
        return self._spawn(name, [sys.executable, "-m", "airflow", *SERVICES[name]], env=env, cwd=info.home)

    def _wait_healthy(self, info: DeploymentInfo, deadline: float, *, since: dt.datetime | None = None) -> None:
        """Until the API answers and every heartbeating process is healthy (with a heartbeat after ``since``)."""
        last: Any = "no answer yet"
        while True:
            self._check_alive()
            try:
                answer = httpx.get(f"{info.base_url}/api/v2/monitor/health", timeout=5)
                last = answer.json() if answer.status_code == 200 else f"HTTP {answer.status_code}"
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if isinstance(last, dict) and _all_healthy(last, since):
                return
            if time.monotonic() > deadline:
                raise DeploymentError(f"Airflow did not become healthy in time; last health answer: {last}\n"
                                      + self.describe())  # fmt: skip
            time.sleep(0.5)

    # -- restart ------------------------------------------------------------------------------------------------

    def restart(self, name: str, sig: int = signal.SIGTERM, *, timeout: float = 120.0) -> int:
        """Stop one Airflow process with ``sig`` and start it again; returns the new pid once it is healthy.

        ``SIGKILL`` plays a lost container or node: the whole tree dies at once, nothing runs on the way out.
        Any other signal goes to the main process only, as a container runtime sends it, and Airflow shuts down
        its own children; whatever is left after 30 s is killed.
        """
        info = self._require_info()
        if name not in SERVICES:
            raise ValueError(f"{name!r} is not one of {list(SERVICES)}")
        record = self._records.get(name) or {r.name: r for r in read_pids(self.state_dir)}.get(name)
        if record is not None and (proc := record.process()) is not None:
            if sig == signal.SIGKILL:
                _kill_tree(proc, signal.SIGKILL)
            else:
                tree = _tree(proc)
                signal_proc(proc, sig)
                left = wait_gone(tree, 30)
                for p in left:
                    signal_proc(p, signal.SIGKILL)
                wait_gone(left, 5)
            popen = self._popen.get(name)
            if popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5)
        since = dt.datetime.now(dt.UTC)
        pid = self._spawn_service(info, name, service_env(info))
        self._wait_healthy(info, time.monotonic() + timeout, since=since if name in HEARTBEATS else None)
        return pid

    # -- another api-server -------------------------------------------------------------------------------------

    def start_api_server(self, name: str, overrides: Mapping[str, str], *, timeout: float = 120.0) -> str:
        """Another ``airflow api-server`` on the deployment's database, with ``AIRFLOW__...`` ``overrides`` of its
        own (another auth configuration, say) and a port of its own; returns its base URL once it answers.

        It is one of the deployment's processes: stopped by :meth:`stop_process`, or with the deployment.
        """
        info = self._require_info()
        if name in SERVICES or name == "postgres":
            raise ValueError(f"{name!r} is one of the deployment's own processes")
        (port,) = free_ports(1)
        base_url = f"http://127.0.0.1:{port}"
        env = {**service_env(info), "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": base_url, **overrides}
        self._spawn(name, [sys.executable, "-m", "airflow", *SERVICES["api-server"]], env=env, cwd=info.home)
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            self._check_alive()
            try:
                answer = httpx.get(f"{base_url}/api/v2/monitor/health", timeout=5)
                if answer.status_code == 200:
                    return base_url
                last = f"HTTP {answer.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                self.stop_process(name)
                raise DeploymentError(f"{name} did not answer in time ({last}); see {info.log_file(name)}")
            time.sleep(0.5)

    def stop_process(self, name: str, timeout: float = 20.0) -> None:
        """Stop one process this object started (its whole tree) and forget it."""
        record = self._records.pop(name, None)
        popen = self._popen.pop(name, None)
        if record is not None and (proc := record.process()) is not None:
            tree = _tree(proc)
            _signal_tree(proc, tree, signal.SIGTERM)
            for left in wait_gone(tree, timeout):
                signal_proc(left, signal.SIGKILL)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
        write_pids(self.state_dir, self._records.values())

    # -- stop ---------------------------------------------------------------------------------------------------

    def stop(self, timeout: float = 20.0) -> list[str]:
        """Stop everything; returns descriptions of processes that survived (empty on success)."""
        survivors = stop_deployment(self.state_dir, timeout=timeout, log=self._log)
        for popen in self._popen.values():  # reap our children so they do not linger as zombies
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=1)
        return survivors

    # -- processes ------------------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], *, env: Mapping[str, str], **popen_kwargs: Any) -> int:
        self.state_dir.joinpath("logs").mkdir(exist_ok=True)
        with open(self.state_dir / "logs" / f"{name}.log", "ab") as out:
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                # Own session and process group: outlives `up`, and a signal to the group reaches its children.
                start_new_session=True,
                **popen_kwargs,
            )
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            create_time = 0.0
        self._popen[name] = popen
        self._records[name] = ProcessRecord(name=name, pid=popen.pid, create_time=create_time, cmd=cmd)
        write_pids(self.state_dir, self._records.values())
        return popen.pid

    def _check_alive(self) -> None:
        for name, popen in self._popen.items():
            code = popen.poll()
            if code is not None:
                log = self.state_dir / "logs" / f"{name}.log"
                raise DeploymentError(f"{name} exited with code {code}; last lines of {log}:\n{postgres.tail(log)}")

    def _require_info(self) -> DeploymentInfo:
        if self.info is None:
            self.info = load_info(self.state_dir)
        if self.info is None:
            raise DeploymentError(f"no deployment in {self.state_dir}")
        if not self._records:
            self._records = {r.name: r for r in read_pids(self.state_dir)}
        return self.info

    def describe(self, lines: int = 15) -> str:
        """The last lines of every process log: for failure messages."""
        parts = []
        for log in sorted((self.state_dir / "logs").glob("*.log")):
            parts.append(f"--- {log} ---\n{postgres.tail(log, lines)}")
        return "\n".join(parts)


def _all_healthy(health: Mapping[str, Any], since: dt.datetime | None) -> bool:
    if health.get("metadatabase", {}).get("status") != "healthy":
        return False
    for component in HEARTBEATS.values():
        part = health.get(component) or {}
        if part.get("status") != "healthy":
            return False
        if since is not None:
            beat = part.get(f"latest_{component}_heartbeat")
            if not beat or dt.datetime.fromisoformat(beat) < since:
                return False
    return True


def stop_deployment(state_dir: Path, *, timeout: float = 20.0, log: Callable[[str], None] | None = None) -> list[str]:
    """Stop the deployment in ``state_dir`` (from any process); returns the survivors (normally none).

    The Airflow processes first (each process group and every descendant, SIGTERM then SIGKILL), then PostgreSQL
    (fast shutdown), then any process still carrying the deployment's marker. The database's files are removed.
    """
    state_dir = Path(state_dir).resolve()
    say = log or (lambda msg: None)
    records = read_pids(state_dir)
    info = load_info(state_dir)

    airflow = [(r, p) for r in records if r.name != "postgres" and (p := r.process()) is not None]
    trees = []
    for record, proc in airflow:
        say(f"stopping {record.name} (pid {record.pid})")
        tree = _tree(proc)
        trees += tree
        _signal_tree(proc, tree, signal.SIGTERM)
    left = wait_gone(trees, timeout)
    for proc in left:
        say(f"pid {proc.pid} ignored SIGTERM for {timeout:.0f}s; sending SIGKILL")
        _kill_tree(proc, signal.SIGKILL)
    wait_gone(left, 5)

    for record in records:
        if record.name == "postgres" and (proc := record.process()) is not None:
            say(f"stopping postgres (pid {record.pid})")
            tree = _tree(proc)
            signal_proc(proc, signal.SIGINT)  # fast shutdown: disconnect clients, no waiting for them
            left = wait_gone(tree, timeout)
            for p in left:
                signal_proc(p, signal.SIGKILL)
            wait_gone(left, 5)

    strays = marked_processes(state_dir)
    for proc in strays:
        say(f"stopping stray process {proc.pid} ({' '.join(cmdline(proc))[:120]})")
        signal_proc(proc, signal.SIGKILL)
    wait_gone(strays, 5)

    pg_dir = info.pg_dir if info is not None else postgres.data_dir_for(state_dir)
    postgres.remove(pg_dir)
    (state_dir / "postgres").unlink(missing_ok=True)

    survivors = [f"{r.name} (pid {r.pid})" for r in records if r.process() is not None]
    survivors += [f"pid {p.pid} ({' '.join(cmdline(p))[:120]})" for p in marked_processes(state_dir)]
    return survivors


def marked_processes(state_dir: Path) -> list[psutil.Process]:
    """Live processes whose environment names this deployment (all its processes and their descendants)."""
    want = str(Path(state_dir).resolve())
    spared = {os.getpid()} | {p.pid for p in ancestors()}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in spared:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_ENV) == want:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def _kill_tree(proc: psutil.Process, sig: int) -> None:
    # The snapshot comes first: once the parent is gone its children are reparented and no longer found from it.
    tree = _tree(proc)
    _signal_tree(proc, tree, sig)
    wait_gone(tree, 10)


def _signal_tree(proc: psutil.Process, tree: list[psutil.Process], sig: int) -> None:
    """``sig`` once to every process of the tree: to the group, then to members outside it (a task runner's own).

    Once only: Airflow's processes take a second SIGTERM as "force exit now" and skip their clean shutdown.
    """
    _signal_group(proc, sig)
    group = process_group(proc)
    for member in tree:
        if member.pid != proc.pid and (group is None or process_group(member) != group):
            signal_proc(member, sig)


def _signal_group(proc: psutil.Process, sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid and proc.pid != os.getpgrp():
            os.killpg(proc.pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass
    signal_proc(proc, sig)

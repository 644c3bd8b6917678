"""The runner image built from ``docker/Dockerfile`` itself, and the images a real node needs beside it, as OCI
archives for the node's containerd.

Everything is built with Debian's buildah in its own storage under the cache (``<cache>/buildah``; never the
machine's /var/lib/containers), with no registry:

- ``python:3.11-slim`` (also ``docker.io/library/python:3.11-slim``), the Dockerfile's base: mmdebstrap of bookworm
  from this machine's Debian mirror with python3 (3.11, the Airflow side's minor), python-is-python3 and python3-pip,
  and Debian's ``EXTERNALLY-MANAGED`` marker removed (the official image has none, and the Dockerfile pip-installs as
  root), so that ``FROM python:${PYTHON_VERSION}-slim`` resolves with ``--pull=never`` and the Dockerfile runs as it is;
- the runner, :data:`RUNNER_REF`, its ``STORAGE=1`` variant, :data:`RUNNER_STORAGE_REF`, and, only when asked
  (``ensure_images(frameworks=True)``, ``--frameworks``), its ``STORAGE=1 FRAMEWORKS=1`` variant,
  :data:`RUNNER_FRAMEWORKS_REF`: ``buildah bud --layers`` of the Dockerfile, given this machine's pip sources as
  build args (the CPU torch wheel is only there; PyPI's ``torch==2.13.0`` is the multi-GB CUDA build) with their
  local directories mounted read-only into the RUN steps. The layer cache keeps torch: a code change rebuilds the
  package layers only;
- ``docker.io/library/alpine:3.10``, which the PyTorchJob Worker's ``init-pytorch`` container runs (``sh``, ``seq``,
  ``nslookup``, ``sleep``): Debian's busybox-static, with Debian's dash as /bin/sh and an ``nslookup`` that succeeds
  when one search name resolves, as alpine 3.10's does (:data:`NSLOOKUP_WRAPPER`).

Each image is exported to ``<cache>/images/<name>.oci.tar`` (uncompressed layers: see :func:`export_archive`),
rewritten only when the image changed, and ``<cache>/images/images.json`` maps each archive to its reference
(:func:`image_archives`; ``image_id`` changes exactly when the image does, so a node re-imports only then). The
archives' index names the image with ``io.containerd.image.name``, so that ``ctr -n k8s.io images import <archive>``
tags it with the full reference and needs no ``--base-name`` (Debian's containerd 1.6.20: the runner's archive
imports and unpacks in about 50 s on two busy cores, and ``ctr run`` runs its entrypoint).

``python -m tests.cluster.image`` builds what is missing (progress on stderr, the whole output in
``<cache>/images/build.log``) and prints the reference pods should use; with everything current it takes about a
second. Heavy steps run under ``nice -n 19``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

from tests.cluster.runner_env import cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"

RUNNER_REF = "localhost/torchelastic-runner:dev"
RUNNER_STORAGE_REF = "localhost/torchelastic-runner:dev-storage"
RUNNER_FRAMEWORKS_REF = "localhost/torchelastic-runner:dev-frameworks"
ALPINE_REF = "docker.io/library/alpine:3.10"
#: The first is what buildah makes of the Dockerfile's short name; the second what other tools make of it.
BASE_REFS = ("localhost/python:3.11-slim", "docker.io/library/python:3.11-slim")

DEBIAN_SUITE = "bookworm"  # python3 3.11: the Airflow side's minor (payloads are pickled bytecode)
BASE_PACKAGES = ("ca-certificates", "python3", "python-is-python3", "python3-pip")
#: Bump when what the base or the alpine stand-in is made of changes, so that cached ones are rebuilt.
BASE_RECIPE = 1
ALPINE_RECIPE = 3
#: What docker/Dockerfile COPYs (with .dockerignore's exclusions): a change here is a change of the image.
CONTEXT_PATHS = ("pyproject.toml", "README.md", "build_ui.py", "airflow_provider_torchelastic")

RECIPE_LABEL = "io.github.airflow-provider-torchelastic.recipe"
CONTAINERD_NAME_ANNOTATION = "io.containerd.image.name"
DEBIAN_FALLBACK_MIRROR = "http://deb.debian.org/debian"
APT_PACKAGES = {"buildah": "buildah", "mmdebstrap": "mmdebstrap", "busybox": "busybox-static"}
NICE = ("nice", "-n", "19")
#: containers/image keeps a blob-info cache here for root whatever --root says, and no flag moves it.
MACHINE_BLOB_INFO_CACHE = Path("/var/lib/containers/cache/blob-info-cache-v1.boltdb")

Log = Callable[[str], None]


class ImageBuildError(RuntimeError):
    """An image could not be built or exported; the message names the step and the log."""


# --- pure pieces: what to build, from what this machine has -------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipSources:
    """This machine's pip sources (indexes, find-links, CA bundle) as the Dockerfile's build args, and the local
    paths its RUN steps must see."""

    #: ``--build-arg`` name → value; only the sources that are set.
    build_args: Mapping[str, str]
    #: Host directories to bind read-only at the same path into the build.
    mounts: tuple[str, ...]


def parse_pip_config_list(text: str) -> dict[str, str]:
    """``pip config list`` output (``section.key='value'`` lines; ``:env:`` for ``PIP_*`` variables) as a dict."""
    items: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^(?P<name>[^=\s]+\.[^=\s]+)=(?P<value>.*)$", line.strip())
        if match is None:
            continue
        raw = match.group("value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        items[match.group("name")] = str(value)
    return items


def _pip_option(items: Mapping[str, str], key: str) -> str:
    """The value ``pip install`` sees: a ``PIP_*`` variable over the ``[install]`` section over ``[global]``."""
    for section in (":env:", "install", "global"):
        value = items.get(f"{section}.{key}")
        if value is not None:
            return value.strip()
    return ""


def _local_path(location: str) -> str | None:
    """The local path of a ``file:`` URL or a bare path; None for a remote URL."""
    if location.startswith("file:"):
        return unquote(urlparse(location).path) or None
    if "://" in location:
        return None
    return location if location.startswith("/") else None


def pip_sources_to_build(items: Mapping[str, str], *, exists: Callable[[str], bool] = os.path.exists) -> PipSources:
    """The Dockerfile's ``PIP_*`` build args for pip options ``items`` (:func:`parse_pip_config_list`).

    A local index (``file:///opt/pypi/simple``) is mounted from its parent: PEP 503 trees keep the wheels beside
    ``simple/`` and link them as ``../../files/...``. A local find-links directory and the CA bundle (``cert``) are
    mounted as they are.
    ``TORCH_INDEX_URL`` is emptied so that torch comes from these sources, as the host's ``pip install torch``
    does (the default torch index is not reachable from every machine).
    """
    index = _pip_option(items, "index-url")
    extra = _pip_option(items, "extra-index-url").split()
    links = _pip_option(items, "find-links").split()
    # The CA bundle that pip trusts here: PyPI may be reached through a proxy whose CA only the host's bundle has.
    cert = _pip_option(items, "cert")
    args: dict[str, str] = {"TORCH_INDEX_URL": ""}
    if index:
        args["PIP_INDEX_URL"] = index
    if extra:
        args["PIP_EXTRA_INDEX_URL"] = " ".join(extra)
    if links:
        args["PIP_FIND_LINKS"] = " ".join(links)
    if cert:
        args["PIP_CERT"] = cert
    wanted: list[str] = []
    for location in ([index] if index else []) + extra:
        path = _local_path(location)
        if path is not None:
            wanted.append(os.path.dirname(path.rstrip("/")) or "/")
    for location in [*links, *([cert] if cert else [])]:
        path = _local_path(location)
        if path is not None:
            wanted.append(path.rstrip("/") or "/")
    mounts: list[str] = []
    for path in sorted(set(wanted), key=len):
        if exists(path) and not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts):
            mounts.append(path)
    return PipSources(build_args=args, mounts=tuple(sorted(mounts)))


def debian_mirrors(sources: str, *, suite: str = DEBIAN_SUITE) -> list[str]:
    """One-line apt sources for ``suite`` (with -updates and -security) from the host's apt sources ``sources``
    (deb822 ``.sources`` stanzas or ``deb`` lines): the same mirror the host uses, whatever suite the host runs."""
    uris: list[str] = []
    for stanza in re.split(r"\n\s*\n", sources):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
            uris.extend(fields.get("uris", "").split())
    for line in sources.splitlines():
        words = line.split()
        if words[:1] == ["deb"]:
            uris.append(next(w for w in words[1:] if not w.startswith("[")))
    main = next((u for u in uris if "security" not in u), DEBIAN_FALLBACK_MIRROR).rstrip("/")
    security = next((u for u in uris if "security" in u), None)
    lines = [f"deb {main} {suite} main", f"deb {main} {suite}-updates main"]
    if security is not None:
        lines.append(f"deb {security.rstrip('/')} {suite}-security main")
    return lines


def read_host_apt_sources() -> str:
    """The text of the host's Debian apt sources (``*.sources`` and ``*.list`` that are enabled)."""
    parts: list[str] = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.is_file() and path.suffix in (".list", ".sources"):
            parts.append(path.read_text(errors="replace"))
    return "\n\n".join(parts)


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def context_fingerprint(root: Path = REPO_ROOT) -> str:
    """A digest of what the Dockerfile COPYs from ``root``: the package layers are current when it is unchanged."""
    digest = hashlib.sha256()
    for name in CONTEXT_PATHS:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts or path.suffix == ".pyc":
                continue
            digest.update(f"{rel}\0{path.stat().st_mode & 0o111}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerVariant:
    """One image built from the Dockerfile."""

    name: str  #: the archive's name: ``<name>.oci.tar``
    ref: str
    build_args: Mapping[str, str]
    #: Built only by ``ensure_images(frameworks=True)``, for the few tests that need it: every session of the real
    #: node would otherwise export and import its frameworks layer after each code change.
    on_demand: bool = False


RUNNER_VARIANTS = (
    RunnerVariant(name="runner", ref=RUNNER_REF, build_args={}),
    RunnerVariant(name="runner-storage", ref=RUNNER_STORAGE_REF, build_args={"STORAGE": "1"}),
    # s3fs too: the frameworks' checkpoints go to s3:// as well as file://. It shares the storage variant's layers.
    RunnerVariant(
        name="runner-frameworks",
        ref=RUNNER_FRAMEWORKS_REF,
        build_args={"STORAGE": "1", "FRAMEWORKS": "1"},
        on_demand=True,
    ),
)


def runner_image_ref(*, storage: bool = False, frameworks: bool = False) -> str:
    """The reference pods use for the runner image; ``storage``: the ``STORAGE=1`` variant (s3fs and the other
    [storage] file systems); ``frameworks``: the ``STORAGE=1 FRAMEWORKS=1`` one (transformers, lightning,
    accelerate). Building it is :func:`ensure_images`; a real node imports :func:`image_archives`."""
    if frameworks:
        return RUNNER_FRAMEWORKS_REF
    return RUNNER_STORAGE_REF if storage else RUNNER_REF


# --- the cache ------------------------------------------------------------------------------------------------------


def images_dir() -> Path:
    return cache_dir() / "images"


def manifest_path() -> Path:
    return images_dir() / "images.json"


def read_manifest() -> dict[str, dict[str, str]]:
    """``images.json``: archive file name → ``{"ref", "image_id", "inputs"}``; empty when there is none yet."""
    try:
        data = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def image_archives() -> dict[Path, str]:
    """Each exported archive → the reference it carries, for ``ctr -n k8s.io images import`` (only archives that
    exist; run :func:`ensure_images` first)."""
    return {
        images_dir() / archive: record["ref"]
        for archive, record in read_manifest().items()
        if (images_dir() / archive).is_file()
    }


@dataclasses.dataclass(frozen=True)
class Buildah:
    """buildah with its storage under the cache."""

    root: Path

    def argv(self, *args: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.root / "root"),
            "--runroot",
            str(self.root / "runroot"),
            "--storage-driver",
            "overlay",
            *args,
        ]

    @property
    def env(self) -> dict[str, str]:
        # Big temporary files (layer diffs while committing and pushing) stay in the cache too.
        return {**os.environ, "TMPDIR": str(self.root / "tmp"), "BUILDAH_ISOLATION": "chroot"}

    def output(self, *args: str) -> str:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            self.argv(*args), env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise ImageBuildError(f"buildah {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def image_ids(self) -> dict[str, str]:
        """Every tagged reference in the storage → its image id."""
        if not (self.root / "root").exists():
            return {}
        found: dict[str, str] = {}
        for image in json.loads(self.output("images", "--json", "--no-trunc") or "[]"):
            for name in image.get("names") or []:
                found[name] = image["id"]
        return found

    def labels(self, ref: str) -> dict[str, str]:
        info = json.loads(self.output("inspect", "--type", "image", ref))
        return dict(info.get("OCIv1", {}).get("config", {}).get("Labels") or {})


def default_buildah() -> Buildah:
    return Buildah(cache_dir() / "buildah")


# --- the build ------------------------------------------------------------------------------------------------------


class _Run:
    """Runs the build's commands with their output in the log, and shows progress."""

    #: Lines shown as progress (everything goes to the log).
    PROGRESS = re.compile(r"^(STEP \d+/\d+|COMMIT|--> |I: )")

    def __init__(self, log_file: TextIO, log: Log, show_output: bool) -> None:
        self.log_file = log_file
        self.log = log
        self.show_output = show_output
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        line = f"[runner-image +{time.monotonic() - self.started:.0f}s] {message}"
        self.log(line)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def __call__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, what: str) -> None:
        self.log_file.write(f"$ {' '.join(argv)}\n")
        self.log_file.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env) if env is not None else None,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log_file.write(line)
            self.log_file.flush()
            if self.show_output or self.PROGRESS.match(line):
                self.log(f"  {line.rstrip()[:200]}")
        if proc.wait() != 0:
            raise ImageBuildError(f"{what} failed (exit {proc.returncode}); see {self.log_file.name}")


def ensure_debian_tools(run: _Run) -> None:
    """Install buildah, mmdebstrap and busybox-static from Debian where one is missing."""
    missing = [pkg for tool, pkg in APT_PACKAGES.items() if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ImageBuildError(f"needs {', '.join(missing)}: run `apt-get install {' '.join(missing)}` as root")
    run.say(f"installing {', '.join(missing)} from Debian")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env, what="apt-get update")
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env, what="apt-get install")


def _commit_tree(buildah: Buildah, run: _Run, tree_tar: Path, refs: Sequence[str], config: Sequence[str]) -> None:
    """A one-layer image from ``tree_tar``, tagged ``refs``."""
    container = buildah.output("from", "--name", f"torchelastic-image-{os.getpid()}", "scratch").strip()
    try:
        run([*NICE, *buildah.argv("add", container, str(tree_tar), "/")], env=buildah.env, what="buildah add")
        buildah.output("config", *config, container)
        run([*NICE, *buildah.argv("commit", "--rm", container, refs[0])], env=buildah.env, what="buildah commit")
    finally:
        with contextlib.suppress(ImageBuildError):
            if container in buildah.output("containers", "--quiet", "--notruncate", "--format", "{{.ContainerName}}"):
                buildah.output("rm", container)
    for ref in refs[1:]:
        buildah.output("tag", refs[0], ref)


def _has_recipe(buildah: Buildah, ids: Mapping[str, str], refs: Sequence[str], recipe: str) -> bool:
    return all(ref in ids for ref in refs) and buildah.labels(refs[0]).get(RECIPE_LABEL) == recipe


def build_base(buildah: Buildah, run: _Run, ids: Mapping[str, str]) -> bool:
    """``python:3.11-slim`` from mmdebstrap; False when the cached one is current."""
    mirrors = debian_mirrors(read_host_apt_sources())
    recipe = fingerprint(BASE_RECIPE, DEBIAN_SUITE, BASE_PACKAGES, mirrors)
    if _has_recipe(buildah, ids, BASE_REFS, recipe):
        return False
    run.say(f"building the base {BASE_REFS[0]} with mmdebstrap ({DEBIAN_SUITE}, {' '.join(BASE_PACKAGES)})")
    with tempfile.TemporaryDirectory(dir=buildah.root / "tmp") as tmp:
        tree = Path(tmp) / "rootfs.tar"
        run(
            [
                *NICE,
                "mmdebstrap",
                "--mode=root",
                "--variant=apt",
                "--format=tar",
                "--skip=output/dev",
                f"--include={','.join(BASE_PACKAGES)}",
                # What python:slim leaves out too.
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                # The official image has no such marker: the Dockerfile pip-installs as root.
                '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
                DEBIAN_SUITE,
                str(tree),
                *mirrors,
            ],
            what="mmdebstrap",
        )
        _commit_tree(
            buildah,
            run,
            tree,
            BASE_REFS,
            [
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env",
                "LANG=C.UTF-8",
                "--cmd",
                "python3",
                "--label",
                f"{RECIPE_LABEL}={recipe}",
            ],
        )
    return True


def _busybox() -> tuple[Path, str]:
    """The static busybox and its Debian version."""
    version = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "busybox-static"], capture_output=True, text=True, check=False
    ).stdout.strip()
    path = Path("/bin/busybox")
    if not version or not path.is_file():
        raise ImageBuildError("busybox-static is not installed: apt-get install busybox-static")
    return path, version


#: /bin/nslookup of the alpine stand-in. init-pytorch looks the master up by its short name; busybox 1.35 walks the
#: search list but exits 1 when any of the other search names is NXDOMAIN, as a cluster DNS answers them, so the
#: Worker would wait for ever. alpine 3.10's nslookup, which the training operator pins, succeeds there: so does this.
#: (It needs a /bin/sh other than busybox-static's, which runs its own applets before it looks at PATH: dash.)
NSLOOKUP_WRAPPER = b"""#!/bin/sh
out=$(/bin/busybox nslookup "$@" 2>&1); status=$?
printf '%s\\n' "$out"
[ "$status" = 0 ] || printf '%s\\n' "$out" | /bin/busybox grep -q '^Name:'
"""


def shell_files(shell: Path = Path("/bin/dash")) -> dict[str, Path]:
    """The stand-in's /bin/sh and the shared libraries it loads (``ldd``): {path in the image: file here}."""
    proc = subprocess.run(["ldd", str(shell)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not shell.is_file():
        raise ImageBuildError(f"{shell} is not a dynamic executable ldd can read: apt-get install dash")
    files = {"bin/sh": shell}
    for line in proc.stdout.splitlines():
        found = [part for part in line.split() if part.startswith("/")]
        if found:
            files[found[0].lstrip("/")] = Path(found[0]).resolve()
    return files


def alpine_tree(busybox: Path, applets: Iterable[str], out: Path, shell: Mapping[str, Path] | None = None) -> None:
    """A root file system with ``busybox`` as /bin/busybox and a /bin symlink for each applet (nslookup: the
    :data:`NSLOOKUP_WRAPPER` script; sh: ``shell``'s files, {path: file here}, where given), as a tar."""
    with tarfile.open(out, "w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

        shell = dict(shell or {})
        dirs = {"bin", "etc", "root", "proc", "sys", "dev", "usr", "usr/bin", "var"}
        for path in shell:
            parts = path.split("/")[:-1]
            dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        for name in sorted(dirs):
            add_dir(name, 0o700 if name == "root" else 0o755)
        add_dir("tmp", 0o1777)
        add_file("bin/busybox", busybox.read_bytes(), 0o755)
        add_file("bin/nslookup", NSLOOKUP_WRAPPER, 0o755)
        for path, source in sorted(shell.items()):
            add_file(path, source.read_bytes(), 0o755)
        for applet in sorted(
            set(applets) - {"busybox", "nslookup"} - {Path(p).name for p in shell if p.startswith("bin/")}
        ):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "/bin/busybox", 0o777
            tar.addfile(info)
        add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        add_file("etc/group", b"root:x:0:\nnobody:x:65534:\n")


def build_alpine(buildah: Buildah, run: _Run, ids: Mapping[str, str]) -> bool:
    """The ``alpine:3.10`` stand-in; False when the cached one is current."""
    busybox, version = _busybox()
    recipe = fingerprint(ALPINE_RECIPE, version)
    if _has_recipe(buildah, ids, [ALPINE_REF], recipe):
        return False
    run.say(f"building {ALPINE_REF} from busybox-static {version}")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
    missing = {"sh", "seq", "nslookup", "sleep"} - set(applets)
    if missing:
        raise ImageBuildError(f"busybox-static {version} lacks {sorted(missing)}, which init-pytorch runs")
    with tempfile.TemporaryDirectory(dir=buildah.root / "tmp") as tmp:
        tree = Path(tmp) / "rootfs.tar"
        alpine_tree(busybox, applets, tree, shell_files())
        _commit_tree(
            buildah,
            run,
            tree,
            [ALPINE_REF],
            [
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd",
                "/bin/sh",
                "--label",
                f"{RECIPE_LABEL}={recipe}",
            ],
        )
    return True


def read_pip_sources() -> PipSources:
    """This machine's pip sources, as ``pip config list`` of the interpreter running this reports them."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    return pip_sources_to_build(parse_pip_config_list(proc.stdout))


def bud_argv(buildah: Buildah, variant: RunnerVariant, sources: PipSources) -> list[str]:
    """``buildah bud`` of docker/Dockerfile for ``variant``: the Dockerfile as it is, the repository as context."""
    argv = [
        *NICE,
        *buildah.argv("bud", "--layers", "--pull=never", "--isolation", "chroot", "--force-rm"),
        "--file",
        str(DOCKERFILE),
        "--tag",
        variant.ref,
    ]
    for name, value in {**sources.build_args, **variant.build_args}.items():
        argv += ["--build-arg", f"{name}={value}"]
    for path in sources.mounts:
        argv += ["--volume", f"{path}:{path}:ro"]
    return [*argv, str(REPO_ROOT)]


def export_archive(buildah: Buildah, run: _Run, ref: str, archive: Path) -> None:
    """``ref`` as an OCI archive at ``archive`` whose index names it for containerd (io.containerd.image.name).

    Uncompressed: buildah's ``oci:`` transport gzips every layer at each export, which for torch's layer takes
    minutes on two busy cores, while ``dir:`` copies the layers as they are (about 25 s for the runner); the
    archive is then the OCI layout of that directory."""
    with tempfile.TemporaryDirectory(dir=buildah.root / "tmp") as tmp:
        pushed = Path(tmp) / "image"
        run(
            [*NICE, *buildah.argv("push", "--quiet", "--disable-compression", "--format", "oci", ref, f"dir:{pushed}")],
            env=buildah.env,
            what=f"buildah push {ref}",
        )
        manifest_bytes = (pushed / "manifest.json").read_bytes()
        manifest: dict[str, Any] = json.loads(manifest_bytes)
        digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": manifest["mediaType"],
                    "digest": digest,
                    "size": len(manifest_bytes),
                    "annotations": {"org.opencontainers.image.ref.name": ref, CONTAINERD_NAME_ANNOTATION: ref},
                }
            ],
        }
        tmp_archive = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
        try:
            with tarfile.open(tmp_archive, "w") as tar:
                _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
                _add_bytes(tar, "index.json", json.dumps(index, indent=1).encode())
                _add_bytes(tar, f"blobs/sha256/{digest.partition(':')[2]}", manifest_bytes)
                for blob in [manifest["config"], *manifest["layers"]]:
                    hexdigest = blob["digest"].partition(":")[2]
                    tar.add(pushed / hexdigest, f"blobs/sha256/{hexdigest}")
            tmp_archive.replace(archive)
        finally:
            tmp_archive.unlink(missing_ok=True)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


@contextlib.contextmanager
def no_machine_traces() -> Iterator[None]:
    """Remove the machine-wide blob-info cache (and its folders) afterwards if the build created them."""
    created = [p for p in (MACHINE_BLOB_INFO_CACHE, *MACHINE_BLOB_INFO_CACHE.parents[:2]) if not p.exists()]
    try:
        yield
    finally:
        for path in created:  # the file first, then its folders, each only if it is empty
            with contextlib.suppress(OSError):
                path.unlink() if path.is_file() else path.rmdir()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build at a time per cache (pytest-xdist workers, a second terminal)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_images(
    *, storage: bool = True, frameworks: bool = False, log: Log | None = None, show_output: bool = False
) -> dict[str, dict[str, str]]:
    """Build what is missing or stale and export what changed; returns ``images.json``'s content. ``frameworks``:
    the on-demand variant too (:attr:`RunnerVariant.on_demand`; cold, its pip install takes minutes).

    Current images cost a ``buildah images`` and a digest of the build context (about a second)."""
    say: Log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))
    buildah = default_buildah()
    images_dir().mkdir(parents=True, exist_ok=True)
    with _locked(images_dir() / ".lock"), no_machine_traces():
        manifest = read_manifest()
        variants = [v for v in RUNNER_VARIANTS if (storage or not v.build_args) and (frameworks or not v.on_demand)]
        with contextlib.ExitStack() as stack:
            log_file: TextIO | None = None

            def runner() -> _Run:
                nonlocal log_file
                if log_file is None:
                    log_file = stack.enter_context(open(images_dir() / "build.log", "w"))
                    say(f"[runner-image] building; the whole output goes to {log_file.name}")
                return _Run(log_file, say, show_output)

            run: _Run | None = None
            if any(shutil.which(tool) is None for tool in APT_PACKAGES):
                run = runner()
                ensure_debian_tools(run)
            (buildah.root / "tmp").mkdir(parents=True, exist_ok=True)
            ids = buildah.image_ids()
            sources = read_pip_sources()
            context = context_fingerprint()
            # .dockerignore decides what the COPY lines take.
            dockerfile = DOCKERFILE.read_text() + _read(REPO_ROOT / ".dockerignore")
            base_id = ids.get(BASE_REFS[0], "")

            def current(archive: str, ref: str, inputs: str) -> bool:
                record = manifest.get(archive, {})
                return (
                    record.get("inputs") == inputs
                    and record.get("image_id") == ids.get(ref)
                    and (images_dir() / archive).is_file()
                )

            alpine_inputs = fingerprint(ALPINE_RECIPE, _busybox()[1])
            runner_inputs = {
                v.name: fingerprint(dockerfile, context, sources.build_args, sources.mounts, v.build_args, base_id)
                for v in variants
            }
            if current("alpine.oci.tar", ALPINE_REF, alpine_inputs) and all(
                current(f"{v.name}.oci.tar", v.ref, runner_inputs[v.name]) for v in variants
            ):
                return manifest  # the fast path: nothing to build or export

            run = run or runner()
            changed_base = build_base(buildah, run, ids)
            if changed_base:
                ids = buildah.image_ids()
                base_id = ids[BASE_REFS[0]]
            build_alpine(buildah, run, ids)
            for v in variants:
                runner_inputs[v.name] = fingerprint(
                    dockerfile, context, sources.build_args, sources.mounts, v.build_args, base_id
                )
                if changed_base or not current(f"{v.name}.oci.tar", v.ref, runner_inputs[v.name]):
                    run.say(f"buildah bud --layers of docker/Dockerfile as {v.ref}")
                    run(bud_argv(buildah, v, sources), env=buildah.env, what=f"buildah bud ({v.ref})")
            ids = buildah.image_ids()
            wanted = [("alpine", ALPINE_REF, alpine_inputs)] + [
                (v.name, v.ref, runner_inputs[v.name]) for v in variants
            ]
            for name, ref, inputs in wanted:
                archive = f"{name}.oci.tar"
                record = manifest.get(archive, {})
                if record.get("image_id") != ids[ref] or not (images_dir() / archive).is_file():
                    run.say(f"exporting {ref} to {images_dir() / archive}")
                    export_archive(buildah, run, ref, images_dir() / archive)
                manifest[archive] = {"ref": ref, "image_id": ids[ref], "inputs": inputs}
                manifest_path().write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _prune_superseded(buildah)
            run.say("done: " + ", ".join(f"{r['ref']} ({a})" for a, r in sorted(manifest.items())))
        return manifest


def _prune_superseded(buildah: Buildah) -> None:
    """Remove what earlier builds left: an image without a name and without children is the end of a superseded
    chain (a code change moves the tag). The layer cache stays: its images all have children. One pass removes one
    image of each such chain, hence the loop."""
    for _ in range(len(DOCKERFILE.read_text().splitlines())):
        try:
            if not buildah.output("rmi", "--prune").strip():
                return
        except ImageBuildError:
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.image",
        description="Build (or reuse) the runner image from docker/Dockerfile, its STORAGE=1 variant (with "
        "--frameworks, its STORAGE=1 FRAMEWORKS=1 one too) and the alpine:3.10 stand-in as OCI archives in the "
        "cache; print the reference pods should use (last line).",
    )
    parser.add_argument("--storage", action="store_true", help="print the STORAGE=1 variant's reference")
    parser.add_argument(
        "--frameworks", action="store_true", help="build the STORAGE=1 FRAMEWORKS=1 variant too; print its reference"
    )
    parser.add_argument("--no-build", action="store_true", help="only print the reference")
    parser.add_argument("--archives", action="store_true", help="print 'ARCHIVE REF' lines instead")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the builds' whole output")
    args = parser.parse_args(argv)
    if not args.no_build:
        try:
            ensure_images(frameworks=args.frameworks, show_output=args.verbose)
        except ImageBuildError as e:
            print(f"runner image: {e}", file=sys.stderr)
            return 1
    if args.archives:
        for archive, ref in sorted(image_archives().items()):
            print(f"{archive} {ref}")
    else:
        print(runner_image_ref(storage=args.storage, frameworks=args.frameworks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

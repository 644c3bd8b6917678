"""A real registry for the real node: Debian's ``docker-registry`` (the CNCF distribution registry 2.8) behind a
fault-injecting proxy (tests/cluster/registry_proxy.py), both started by the real node (real_node.RealNode.start)
and stopped with it: they live in the node's cgroup, so ``down`` kills them with everything else of the node.

- The registry runs with a config of its own (:func:`registry_config`), not the package's (which listens on all
  interfaces with htpasswd auth): no auth, on the node's address (the bridge gateway) at :data:`REGISTRY_PORT`, data
  in ``<cache>/registry`` so that pushed layers are kept between runs. The package's own service is never left
  running (:func:`ensure_package`).
- The proxy listens on the node's address at :data:`PROXY_PORT`; containerd pulls from it over plain HTTP
  (``certs.d/<host:port>/hosts.toml``; the CRI config sets ``config_path``). Tests put faults on tags with
  :func:`inject` and read what was pulled with :func:`pulls`.
- ``up`` pushes the runner images to the registry (:func:`push_runner_images`) with ``buildah push --tls-verify=false
  --disable-compression`` (gzip of the 1.15 GB image takes minutes on two cores; layers already there are skipped),
  and pods name them as :func:`image_ref` says. Experiments behind every choice: ../shared/notes/registry-and-pulls.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from tests.cluster.real_node import NodeLayout

PACKAGE = "docker-registry"
BINARY = Path("/usr/bin/docker-registry")
#: The package's own config: a registry serving it is the package's service, which must not run.
PACKAGE_CONFIG = "/etc/docker/registry/config.yml"
#: Where pushes go (the registry itself) and where pulls go (the proxy in front of it), on the node's address.
REGISTRY_PORT = 5001
PROXY_PORT = 5000
REPOSITORY = "torchelastic-runner"
Log = Callable[[str], None]


class RegistryError(RuntimeError):
    pass


def cache_dir() -> Path:
    from tests.cluster.real_node import cache_dir as node_cache

    return node_cache() / "registry"


def registry_dir(layout: NodeLayout) -> Path:
    """The node's registry files: config.yml, the proxy's faults.json and pulls.jsonl."""
    return layout.node_dir / "registry"


def pull_host(layout: NodeLayout) -> str:
    return f"{layout.gateway}:{PROXY_PORT}"


def push_host(layout: NodeLayout) -> str:
    return f"{layout.gateway}:{REGISTRY_PORT}"


def image_ref(layout: NodeLayout, tag: str) -> str:
    """What a pod names to pull the runner image's ``tag`` through the proxy."""
    return f"{pull_host(layout)}/{REPOSITORY}:{tag}"


# --- the package ------------------------------------------------------------------------------------------------------


def ensure_package(log: Log) -> None:
    """Install Debian's docker-registry when it is missing, and keep its own service stopped: its postinst starts the
    service (all interfaces, htpasswd auth) where policy-rc.d allows it."""
    if not BINARY.is_file():
        if os.geteuid() != 0:
            raise RegistryError(f"{PACKAGE} is not installed, and installing it (apt-get) needs root")
        log(f"{PACKAGE} not found: installing Debian's {PACKAGE} with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", PACKAGE],
        ):
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise RegistryError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        if shutil.which("invoke-rc.d"):
            subprocess.run(["invoke-rc.d", PACKAGE, "stop"], capture_output=True, check=False)
    stop_package_service()


def stop_package_service() -> None:
    """Stop a registry serving the package's config: the service its postinst may have started."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if cmd[:1] == [str(BINARY)] and PACKAGE_CONFIG in cmd:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)


# --- configuration (pure) -----------------------------------------------------------------------------------------


def registry_config(listen: str, storage: Path) -> str:
    """The registry's config.yml: no auth, one address, layers on disk under ``storage``."""
    return f"""\
version: 0.1
log:
  level: info
  fields:
    service: torchelastic-registry
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
http:
  addr: {listen}
  headers:
    X-Content-Type-Options: [nosniff]
"""


def hosts_toml(host: str) -> str:
    """containerd 1.6's ``certs.d/<host>/hosts.toml``: pull from ``host`` over plain HTTP."""
    return f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n'


def write_config(layout: NodeLayout) -> None:
    folder = registry_dir(layout)
    folder.mkdir(parents=True, exist_ok=True)
    cache_dir().mkdir(parents=True, exist_ok=True)
    (folder / "config.yml").write_text(registry_config(push_host(layout), cache_dir()))
    certs = layout.containerd_dir / "certs.d" / pull_host(layout)
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "hosts.toml").write_text(hosts_toml(pull_host(layout)))


def registry_argv(layout: NodeLayout) -> list[str]:
    return [str(BINARY), "serve", str(registry_dir(layout) / "config.yml")]


def proxy_argv(layout: NodeLayout) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.cluster.registry_proxy",
        f"--listen={pull_host(layout)}",
        f"--backend={push_host(layout)}",
        f"--dir={registry_dir(layout)}",
    ]


def serves(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}/v2/", timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


# --- images -----------------------------------------------------------------------------------------------------------


def push_runner_images(layout: NodeLayout, refs: Mapping[str, str], log: Log) -> None:
    """Push each builder image ``ref`` to the registry as the tag ``refs[ref]``; uncompressed, so that a layer
    already stored (from an earlier run: the registry's data is cached) is skipped by digest."""
    from tests.cluster.image import default_buildah

    buildah = default_buildah()
    for ref, tag in refs.items():
        started = time.monotonic()
        target = f"docker://{push_host(layout)}/{REPOSITORY}:{tag}"
        argv = buildah.argv("push", "--quiet", "--tls-verify=false", "--disable-compression", "--format", "oci")
        proc = subprocess.run(
            ["nice", "-n", "19", *argv, ref, target],
            env=buildah.env,
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RegistryError(
                f"buildah push {ref} {target} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
            )
        log(f"pushed {ref} as {REPOSITORY}:{tag} in {time.monotonic() - started:.1f}s")


def _request(method: str, url: str, *, body: bytes | None = None, headers: Mapping[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    return urllib.request.urlopen(request, timeout=30)


def tag_image(layout: NodeLayout, source_tag: str, tag: str) -> str:
    """Give the pushed ``source_tag`` another ``tag`` (a manifest copy, straight to the registry); returns the ref
    a pod pulls it by through the proxy. A fresh tag is one the node has never pulled."""
    media = "application/vnd.oci.image.manifest.v1+json"
    base = f"http://{push_host(layout)}/v2/{REPOSITORY}/manifests"
    with _request("GET", f"{base}/{source_tag}", headers={"Accept": media}) as answer:
        manifest, content_type = answer.read(), answer.headers.get("Content-Type", media)
    with _request("PUT", f"{base}/{tag}", body=manifest, headers={"Content-Type": content_type}):
        pass
    return image_ref(layout, tag)


def inject(layout: NodeLayout, tag: str, fault: str, pulls: int) -> None:
    """The proxy answers the next ``pulls`` pulls of ``tag`` with ``fault``: ``429``, ``503`` or ``reset``."""
    if fault not in ("429", "503", "reset"):
        raise ValueError(f"fault: expected '429', '503' or 'reset', got {fault!r}")
    path = registry_dir(layout) / "faults.json"
    try:
        faults = json.loads(path.read_text())
    except (OSError, ValueError):
        faults = {}
    faults[f"{REPOSITORY}:{tag}"] = {"fault": fault, "pulls": pulls, "set": time.time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults, indent=2) + "\n")
    tmp.replace(path)


def pulls(layout: NodeLayout, tag: str) -> list[dict[str, Any]]:
    """The proxy's log of the manifest requests for ``tag``: ``{"pull": n, "fault": ..., "method": ...}`` each."""
    try:
        lines = (registry_dir(layout) / "pulls.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r.get("name") == REPOSITORY and r.get("tag") == tag]

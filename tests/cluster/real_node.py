"""A real node for the local cluster: containerd, kubelet, kube-scheduler and kube-controller-manager.

Selected with ``python -m tests.cluster up --node real`` or ``TORCHELASTIC_NODE=real`` (``kube_cluster``, the pytest
plugin's simulated cluster, reads the same variable); the default stays the simulated kubelet. The tests that run on
the real node by default use the plugin's ``real_node_cluster``. What was verified on the reference machine and why each
setting is what it is: ``../shared/notes/real-node.md``.

One node per cluster, everything derived from the cluster's state dir so that two clusters can run side by side:
node name ``te-<key>``, bridge ``te<key>``, a /24 pod subnet, the cgroup root ``/torchelastic-<key>`` in every v1
hierarchy, and the cluster DNS on the bridge gateway (``<key>``: 8 hex digits of a hash of the state dir's path).

containerd and the kubelet share one private mount namespace (``unshare -m --propagation private``), held by a
``sleep`` process, so the paths they hard-code (``HARDCODED_PATHS``) are bind mounts of folders in the state dir and
every mount they make (overlay rootfs, volumes, network namespaces, the kubelet's root-dir bind mount) vanishes
with that namespace. Inside it the kubelet's root is ``/var/lib/kubelet`` and containerd's sockets are in
``/run/containerd``, as on a real node: a unix socket path may not exceed 107 bytes, and a pytest tmp dir plus
``node/containerd/run/containerd.sock.ttrpc`` does. Host-side tools reach containerd through ``nsenter`` (:func:`ctr`).

Every process of the node (containerd and its shims, pod containers, the kubelet, scheduler, controller-manager and
DNS) lives in the node's cgroup tree, so ``down`` can kill all of them even after a SIGKILLed ``up``, with nothing
but the state dir.

Layout of ``<state dir>/node/``::

    node.json                   the derived names, subnet, paths (NodeLayout); written before anything is started
    pki/                        a CA of our own: the apiserver's --client-ca-file, kubelet client/serving certs
    kubeconfig-*                the kubelet's (client certificate), the scheduler's and controller-manager's (tokens)
    containerd/                 config.toml, root/ (a cached root bind-mounted: containerd_roots()), state/,
                                run/ (sockets, at /run/containerd), runc/
    cni/net.d/, cni/ipam/       the bridge network's config and host-local's leases
    kubelet/                    the kubelet's --root-dir (/var/lib/kubelet)
    mntns                       the mount namespace's id: `down` kills any process still in it
    hostpaths/<name>/           what is mounted at each of HARDCODED_PATHS inside the node's mount namespace
    resolv.conf                 the kubelet's --resolv-conf (nameserver: the cluster DNS)
    registry/                   the registry's config.yml, its proxy's faults.json and pulls.jsonl (registry.py);
                                the registry's data is in <cache>/registry, kept between runs

Host changes outside the state dir, all undone by ``down``: the bridge (and the veths on it), the cgroup dirs,
empty mount-point dirs for HARDCODED_PATHS where they did not exist, and the sysctls the kubelet and the bridge
plugin set. The last two are shared by all real-node clusters on the host: ``/run/torchelastic-node/registry.json``
keeps the original values and the clusters holding them; the last ``down`` restores them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import gzip
import hashlib
import io
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from tests.cluster import control_plane as cp
from tests.cluster import registry, runner_env

NODE_ENV = "TORCHELASTIC_NODE"
NODE_MODES = ("sim", "real")
NODE_BUILD_SCRIPT = cp.REPO_ROOT / "scripts" / "build-kube-node.sh"
NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-controller-manager", "pause")
DEBIAN_PACKAGES = ("containerd", "runc", "containernetworking-plugins")
CNI_BIN_DIR = Path("/usr/lib/cni")  # containernetworking-plugins

# kubelet 1.20's default --pod-infra-container-image; containerd's sandbox_image is set to it too.
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"
CLUSTER_DOMAIN = "cluster.local"
KUBELET_PORT = 10250  # on the bridge gateway, which is this cluster's own address

# Token identities of the scheduler and controller-manager. The bootstrap RBAC roles cover the scheduler's user; the
# controller-manager runs every controller under one identity (no --use-service-account-credentials), so it gets
# system:masters (control_plane._write_token_file).
SCHEDULER_USER = "system:kube-scheduler"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"

# Paths the kubelet, containerd and the CNI plugins use whatever their flags say (real-node.md), bind-mounted from the
# node dir inside its mount namespace (NodeLayout.binds). /var/lib/kubelet holds the hard-coded device-plugins dir,
# /run/containerd the hard-coded shim sockets (s/).
HARDCODED_PATHS = (
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/run/containerd",
)
# Inside the node's mount namespace.
KUBELET_ROOT = Path("/var/lib/kubelet")
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
# Set by the kubelet (setupKernelTunables) and, ip_forward, by the bridge plugin (isGateway).
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
)
REGISTRY_DIR = Path("/run/torchelastic-node")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Processes started in the node's cgroup tree, stopped in this order (clients of containerd before containerd).
NODE_PROCESSES = ("kubelet", "kube-scheduler", "kube-controller-manager", "cluster-dns", "containerd", "node-mounts")


class NodeError(cp.ClusterError):
    """The real node could not be prepared, started or stopped."""


def node_mode(explicit: str | None = None) -> str:
    """``sim`` (the default) or ``real``: ``explicit`` (the CLI's ``--node``), else ``$TORCHELASTIC_NODE``."""
    mode = explicit or os.environ.get(NODE_ENV) or "sim"
    if mode not in NODE_MODES:
        raise cp.ClusterError(f"{NODE_ENV} / --node must be one of {', '.join(NODE_MODES)}, got {mode!r}")
    return mode


def cache_dir() -> Path:
    return cp.cached_apiserver_path().parent


def node_binaries_dir() -> Path:
    return cache_dir() / f"kube-node-{cp.KUBE_VERSION}"


# --------------------------------------------------------------------------------------------------------------
# Derived names (pure)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """Everything of one cluster's node that is derived from its state dir; persisted as ``node/node.json``."""

    state_dir: Path
    key: str
    """8 hex digits of sha256(state dir path)."""
    node_name: str
    bridge: str
    """Linux interface names are at most 15 characters: ``te`` + key."""
    subnet: str
    """The pod /24; the gateway (.1) is the bridge's address, the node IP and the cluster DNS."""
    cgroup: str
    """The kubelet's --cgroup-root (``kubepods`` below it); containerd and the node's daemons: ``<cgroup>/runtime``."""

    @property
    def node_dir(self) -> Path:
        return self.state_dir / "node"

    @property
    def gateway(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def containerd_dir(self) -> Path:
        return self.node_dir / "containerd"

    @property
    def kubelet_dir(self) -> Path:
        return self.node_dir / "kubelet"

    @property
    def pki(self) -> Path:
        return self.node_dir / "pki"

    def hostpath_source(self, target: str) -> Path:
        """What is mounted at ``target`` (one of HARDCODED_PATHS) inside the node's mount namespace."""
        if target == str(KUBELET_ROOT):
            return self.kubelet_dir
        if target == str(CONTAINERD_SOCKET.parent):
            return self.containerd_dir / "run"
        return self.node_dir / "hostpaths" / target.strip("/").replace("/", "_")

    def to_json(self) -> dict[str, str]:
        return {k: str(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeLayout:
        return cls(
            state_dir=Path(data["state_dir"]),
            key=data["key"],
            node_name=data["node_name"],
            bridge=data["bridge"],
            subnet=data["subnet"],
            cgroup=data["cgroup"],
        )


def derive_layout(state_dir: Path, taken: Iterable[ipaddress.IPv4Network] = ()) -> NodeLayout:
    """The node's names and subnet for ``state_dir``; the subnet is moved on while it overlaps a ``taken`` network."""
    key = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    taken = list(taken)
    # 10.200.0.0/16 .. 10.249.255.0/24: clear of the service range (10.96.0.0/24) and of common LAN/VPN ranges.
    index = int(key, 16) % (50 * 256)
    for step in range(50 * 256):
        n = (index + step) % (50 * 256)
        subnet = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(subnet.overlaps(t) for t in taken):
            break
    else:
        raise NodeError("no free /24 in 10.200.0.0-10.249.255.255 for the pod network")
    return NodeLayout(
        state_dir=Path(state_dir).resolve(),
        key=key,
        node_name=f"te-{key}",
        bridge=f"te{key}",
        subnet=str(subnet),
        cgroup=f"torchelastic-{key}",
    )


def load_layout(state_dir: Path) -> NodeLayout | None:
    try:
        return NodeLayout.from_json(json.loads((Path(state_dir) / "node" / "node.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------------------------------------------
# Preflight: cgroup v1, Debian packages, binaries (before anything is started)
# --------------------------------------------------------------------------------------------------------------


def check_cgroup_v1() -> None:
    """Fail loudly on a cgroup v2 (unified) host: kubelet 1.20's cgroup v2 support was pre-beta."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        raise NodeError(
            f"{CGROUP_ROOT} is cgroup v2 (unified hierarchy); the real node's kubelet 1.20 needs cgroup v1. Boot with "
            "`systemd.unified_cgroup_hierarchy=0` (or use the simulated node: unset "
            f"{NODE_ENV} / drop `--node real`)"
        )
    missing = [c for c in ("cpu", "cpuacct", "cpuset", "memory", "pids") if not _hierarchy(c)]
    if missing:
        raise NodeError(f"cgroup v1 controllers not mounted under {CGROUP_ROOT}: {', '.join(missing)}")


def ensure_packages(log: Callable[[str], None]) -> None:
    missing = [p for p in DEBIAN_PACKAGES if not _dpkg_installed(p)]
    if not missing:
        return
    log(f"installing Debian packages: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise NodeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{cp._tail(proc.stderr, 20)}")


def _dpkg_installed(package: str) -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "install ok installed"


def ensure_node_binaries(*, log: Callable[[str], None], show_output: bool = False) -> Path:
    """The folder with kubelet, kube-scheduler, kube-controller-manager and pause, built on first use (~13 min)."""
    folder = node_binaries_dir()
    if all(cp._runs(folder / b) for b in NODE_BINARIES if b != "pause") and (folder / "pause").is_file():
        return folder
    build_log = cache_dir() / f"kube-node-{cp.KUBE_VERSION}.build.log"
    log(f"node binaries not cached in {folder}; building them with {NODE_BUILD_SCRIPT} (~13 min; log: {build_log})")
    cache_dir().mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CI": "true", "DEBIAN_FRONTEND": "noninteractive"}
    # The script keeps its own complete log; this copy is what the run showed.
    returncode, output = runner_env.run_script(
        ["bash", str(NODE_BUILD_SCRIPT)], build_log.with_suffix(".run.log"), env=env, show_output=show_output
    )
    lines = "".join(output).strip().splitlines()
    if returncode != 0 or not lines:
        raise NodeError(
            f"building the node binaries failed (exit {returncode}) with {NODE_BUILD_SCRIPT}; last output "
            f"(all of it in {build_log}):\n" + "".join(output[-30:])
        )
    # The script prints the folder last on stdout; its progress (stderr, through tee) may still trail it here.
    built = next((Path(line) for line in reversed(lines) if line.startswith("/") and Path(line).is_dir()), folder)
    if not all(cp._runs(built / b) for b in NODE_BINARIES if b != "pause"):
        raise NodeError(f"{NODE_BUILD_SCRIPT} succeeded, but the binaries in {built} do not run")
    return built


def preflight(*, log: Callable[[str], None], show_output: bool = False) -> Path:
    """Everything that can fail before a process is started; returns the node binaries' folder."""
    check_cgroup_v1()
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise NodeError(f"`{tool}` not found on PATH (util-linux / iproute2)")
    ensure_packages(log)
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        if shutil.which(tool) is None:
            raise NodeError(f"`{tool}` not found on PATH after installing {' '.join(DEBIAN_PACKAGES)}")
    try:
        registry.ensure_package(log)
    except registry.RegistryError as e:
        raise NodeError(str(e)) from e
    return ensure_node_binaries(log=log, show_output=show_output)


# --------------------------------------------------------------------------------------------------------------
# PKI: one CA for the apiserver's client certificates and the kubelet's serving certificate
# --------------------------------------------------------------------------------------------------------------


def write_pki(layout: NodeLayout) -> None:
    """CA, the kubelet's client cert (``system:node:<name>``), the apiserver's client cert for the kubelet, and the
    kubelet's serving cert (SAN: the gateway), in ``node/pki``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    layout.pki.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    later = now + datetime.timedelta(days=30)

    def key_pair(name: str) -> rsa.RSAPrivateKey:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        path = layout.pki / f"{name}.key"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )
        path.chmod(0o600)
        return key

    def subject(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = key_pair("ca")
    ca_name = subject(f"torchelastic-node-ca-{layout.key}")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (layout.pki / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(name: str, cn: str, org: str | None, *, server: bool) -> None:
        key = key_pair(name)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject(cn, org))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(layout.gateway)), x509.DNSName(layout.node_name)]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        (layout.pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    leaf("kubelet-client", f"system:node:{layout.node_name}", "system:nodes", server=False)
    leaf("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters", server=False)
    leaf("kubelet-serving", layout.node_name, None, server=True)


def apiserver_args(layout: NodeLayout) -> list[str]:
    """What the kube-apiserver adds for a real node: client certs (kubelet), the kubelet's address and CA."""
    return [
        f"--client-ca-file={layout.pki / 'ca.crt'}",
        f"--kubelet-client-certificate={layout.pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={layout.pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={layout.pki / 'ca.crt'}",
        # Otherwise it dials the node's host name.
        "--kubelet-preferred-address-types=InternalIP",
        "--enable-admission-plugins=NodeRestriction",
    ]


def prepare(state_dir: Path) -> NodeLayout:
    """Derive the layout (a subnet clear of the host's routes), write node.json and the PKI. Starts nothing."""
    layout = derive_layout(state_dir, _host_networks())
    layout.node_dir.mkdir(parents=True, exist_ok=True)
    (layout.node_dir / "node.json").write_text(json.dumps(layout.to_json(), indent=2) + "\n")
    write_pki(layout)
    return layout


def _host_networks() -> list[ipaddress.IPv4Network]:
    proc = subprocess.run(
        ["ip", "-4", "-j", "route", "show", "table", "all"], capture_output=True, text=True, check=False
    )
    networks = []
    with contextlib.suppress(ValueError):
        for route in json.loads(proc.stdout or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default" and route.get("type", "unicast") in ("unicast", "local"):
                with contextlib.suppress(ValueError):
                    net = ipaddress.ip_network(dst, strict=False)
                    if isinstance(net, ipaddress.IPv4Network) and net.prefixlen >= 8 and not net.is_loopback:
                        networks.append(net)
    return networks


# --------------------------------------------------------------------------------------------------------------
# Config files (pure renderers + one writer)
# --------------------------------------------------------------------------------------------------------------


def containerd_config(layout: NodeLayout) -> str:
    """containerd's config.toml: every path under the node dir (real-node.md: "containerd config")."""
    d = layout.containerd_dir
    cni = layout.node_dir / "cni"
    return f"""\
version = 2
root = "{d / "root"}"
state = "{d / "state"}"
# opt writes to /opt.
disabled_plugins = ["io.containerd.internal.v1.opt"]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[ttrpc]
  address = "{CONTAINERD_SOCKET}.ttrpc"

[debug]
  address = "{CONTAINERD_SOCKET.parent / "debug.sock"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Required here: without CAP_SYS_RESOURCE every RunPodSandbox fails with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_tls_streaming = false
  disable_tcp_service = true
  tolerate_missing_hugetlb_controller = true
  disable_hugetlb_controller = true

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni / "net.d"}"
    max_conf_num = 1

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d / "runc"}"
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{d / "certs.d"}"
"""


def cni_config(layout: NodeLayout) -> dict[str, Any]:
    """A bridge network on the pre-created bridge; no ipMasq/portmap: nothing here may touch iptables."""
    return {
        "cniVersion": "0.4.0",
        "name": f"torchelastic-{layout.key}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": layout.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": layout.subnet, "gateway": layout.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.node_dir / "cni" / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_args(layout: NodeLayout, binaries: Path) -> list[str]:
    pki = layout.pki
    return [
        str(binaries / "kubelet"),
        f"--kubeconfig={layout.node_dir / 'kubeconfig-kubelet'}",
        f"--hostname-override={layout.node_name}",
        f"--node-ip={layout.gateway}",  # not loopback ("nodeIP can't be loopback address")
        f"--address={layout.gateway}",
        f"--port={KUBELET_PORT}",
        "--read-only-port=0",
        "--healthz-port=0",
        f"--root-dir={KUBELET_ROOT}",  # layout.kubelet_dir, mounted there
        f"--cert-dir={layout.pki}",
        f"--volume-plugin-dir={layout.node_dir / 'volume-plugins'}",
        "--container-runtime=remote",  # 1.20 defaults to docker
        f"--container-runtime-endpoint=unix://{CONTAINERD_SOCKET}",
        f"--containerd={CONTAINERD_SOCKET}",  # for cadvisor
        "--runtime-request-timeout=5m",
        "--cgroup-driver=cgroupfs",
        f"--cgroup-root=/{layout.cgroup}",
        "--fail-swap-on=false",
        # Otherwise KUBE-FIREWALL chains (a DROP of non-local traffic to 127.0.0.0/8) and a MASQUERADE outlive it.
        "--make-iptables-util-chains=false",
        # Imported images cannot be pulled again.
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        "--eviction-hard=memory.available<50Mi,nodefs.available<1%,imagefs.available<1%",
        f"--cluster-dns={layout.gateway}",
        f"--cluster-domain={CLUSTER_DOMAIN}",
        f"--resolv-conf={layout.node_dir / 'resolv.conf'}",
        f"--pod-infra-container-image={PAUSE_IMAGE}",
        "--serialize-image-pulls=false",
        # Serving: client certificates of our CA only (the apiserver's), never anonymous; AlwaysAllow is safe since
        # only the apiserver holds such a certificate, and token (webhook) authentication stays off.
        "--anonymous-auth=false",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--authorization-mode=AlwaysAllow",
        f"--tls-cert-file={pki / 'kubelet-serving.crt'}",
        f"--tls-private-key-file={pki / 'kubelet-serving.key'}",
        "--v=2",
    ]


def scheduler_args(layout: NodeLayout, binaries: Path) -> list[str]:
    return [
        str(binaries / "kube-scheduler"),
        f"--kubeconfig={layout.node_dir / 'kubeconfig-scheduler'}",
        "--leader-elect=false",
        "--port=0",  # no insecure port (1.20 opens 10251 otherwise)
        "--secure-port=0",  # nor 10259: two clusters side by side would clash
        "--v=1",
    ]


def controller_manager_args(layout: NodeLayout, binaries: Path, info: cp.ClusterInfo) -> list[str]:
    return [
        str(binaries / "kube-controller-manager"),
        f"--kubeconfig={layout.node_dir / 'kubeconfig-controller-manager'}",
        "--leader-elect=false",
        "--port=0",
        "--secure-port=0",
        # The service-account token controller: a token Secret per ServiceAccount, which ServiceAccount admission
        # (on with the real node) waits for.
        f"--service-account-private-key-file={info.state_dir / 'sa.key'}",
        f"--root-ca-file={info.ca_file}",
        f"--cluster-signing-cert-file={layout.pki / 'ca.crt'}",
        f"--cluster-signing-key-file={layout.pki / 'ca.key'}",
        "--allocate-node-cidrs=false",
        # Without its job controller: a 1.20 one knows no Indexed Jobs, and tests/cluster/sim_trainer.py plays the
        # Indexed Job controller for the JobSets' Jobs (../shared/notes/real-node.md: verified so).
        "--controllers=*,-job,-cronjob",
        "--v=1",
    ]


def write_config_files(layout: NodeLayout, info: cp.ClusterInfo, tokens: Mapping[str, str]) -> None:
    nd = layout.node_dir
    for sub in ("containerd/root", "containerd/state", "containerd/run", "containerd/runc", "containerd/certs.d"):
        (nd / sub).mkdir(parents=True, exist_ok=True)
    for sub in ("cni/net.d", "cni/ipam", "kubelet", "volume-plugins", "logs"):
        (nd / sub).mkdir(parents=True, exist_ok=True)
    for target in HARDCODED_PATHS:
        layout.hostpath_source(target).mkdir(parents=True, exist_ok=True)
    (layout.containerd_dir / "config.toml").write_text(containerd_config(layout))
    (nd / "cni" / "net.d" / "10-torchelastic.conflist").write_text(json.dumps(cni_config(layout), indent=2) + "\n")
    (nd / "resolv.conf").write_text(f"nameserver {layout.gateway}\n")
    _write_cert_kubeconfig(
        nd / "kubeconfig-kubelet",
        info,
        cert=layout.pki / "kubelet-client.crt",
        key=layout.pki / "kubelet-client.key",
        user=f"system:node:{layout.node_name}",
    )
    cp.write_kubeconfig(
        nd / "kubeconfig-scheduler", server=info.api_url, ca_file=info.ca_file, token=tokens[SCHEDULER_USER],
        user="kube-scheduler",
    )  # fmt: skip
    cp.write_kubeconfig(
        nd / "kubeconfig-controller-manager", server=info.api_url, ca_file=info.ca_file,
        token=tokens[CONTROLLER_MANAGER_USER], user="kube-controller-manager",
    )  # fmt: skip
    token_file = nd / "dns-token"
    token_file.write_text(info.admin_token + "\n")
    token_file.chmod(0o600)


def _write_cert_kubeconfig(path: Path, info: cp.ClusterInfo, *, cert: Path, key: Path, user: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "torchelastic-local",
                "cluster": {"server": info.api_url, "certificate-authority": str(info.ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "node", "context": {"cluster": "torchelastic-local", "user": user}}],
        "current-context": "node",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# --------------------------------------------------------------------------------------------------------------
# OCI archives (the pause image, and test images from static binaries), written by hand
# --------------------------------------------------------------------------------------------------------------


def write_oci_archive(
    path: Path,
    image: str,
    files: Mapping[str, Path],
    *,
    entrypoint: list[str],
    symlinks: Mapping[str, str] | None = None,
) -> Path:
    """An OCI image archive (``ctr images import`` reads it) with one layer: ``files`` ({path in image: source}) at
    mode 0755 and ``symlinks`` ({path: target}). Named by the ``io.containerd.image.name`` annotation."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parent).strip("/") for p in [*files, *(symlinks or {})]} - {"", "."})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, source in sorted(files.items()):
            data = Path(source).read_bytes()
            info = tarfile.TarInfo(name.strip("/"))
            info.size, info.mode, info.mtime = len(data), 0o755, 0
            tar.addfile(info, io.BytesIO(data))
        for name, target in sorted((symlinks or {}).items()):
            info = tarfile.TarInfo(name.strip("/"))
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, 0
            tar.addfile(info)
    layer = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    layer_gz = gzip.compress(layer, mtime=0)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": blob(config, "application/vnd.oci.image.config.v1+json"),
            "layers": [blob(layer_gz, "application/vnd.oci.image.layer.v1.tar+gzip")],
        },
        sort_keys=True,
    ).encode()
    manifest_desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
    manifest_desc["annotations"] = {
        "io.containerd.image.name": image,
        "org.opencontainers.image.ref.name": image.rsplit(":", 1)[-1],
    }
    index = json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    with tarfile.open(tmp, mode="w") as tar:
        entries = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
        entries.update({f"blobs/sha256/{d.split(':', 1)[1]}": data for d, data in blobs.items()})
        for dirname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dirname)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    return path


def pause_archive(binaries: Path) -> Path:
    """The pause image's OCI archive beside the node binaries, made once from the static pause binary."""
    path = binaries / "pause.oci.tar"
    if not path.is_file() or path.stat().st_mtime < (binaries / "pause").stat().st_mtime:
        write_oci_archive(path, PAUSE_IMAGE, {"/pause": binaries / "pause"}, entrypoint=["/pause"])
    return path


def image_archives(binaries: Path) -> list[Path]:
    """What ``up`` imports: the pause image, then every ``<cache>/images/*.oci.tar`` (the runner image and friends)."""
    return [pause_archive(binaries), *sorted((cache_dir() / "images").glob("*.oci.tar"))]


ROOT_SLOTS = 8


def containerd_roots() -> Path:
    """containerd roots kept between ups (content, metadata, unpacked snapshots), one per concurrently running node:
    ``root-<n>`` is in use while some node's mount-namespace holder keeps ``root-<n>.lock`` flocked. A new node takes
    the first free one, so its images are usually imported and unpacked already (an unpack of the runner image takes
    a minute or more here, and deleting it again at ``down`` as long). containerd's own GC, at each start, drops what
    the metadata no longer references (an image replaced by a newer import)."""
    return cache_dir() / "containerd"


def archive_images(archive: Path) -> dict[str, str]:
    """``{image name: manifest digest}`` in an OCI archive's index.json (what ``ctr images import`` would create)."""
    names: dict[str, str] = {}
    with contextlib.suppress(OSError, tarfile.TarError, ValueError, KeyError), tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            return names
        for desc in json.loads(member.read()).get("manifests") or []:
            annotations = desc.get("annotations") or {}
            name = annotations.get("io.containerd.image.name") or annotations.get("org.opencontainers.image.ref.name")
            if name:
                names[name] = desc["digest"]
    return names


# --------------------------------------------------------------------------------------------------------------
# Host state shared by all real-node clusters: sysctls and created mount-point dirs
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _registry() -> Iterator[dict[str, Any]]:
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    lock_path = REGISTRY_DIR / "lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = REGISTRY_DIR / "registry.json"
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {"sysctls": {}, "created_dirs": [], "holders": []}
        yield data
        if data["holders"]:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            tmp.replace(path)
        else:
            # The last cluster is gone: put the host back as it was.
            for name, value in data["sysctls"].items():
                write_sysctl(name, value)
            for d in sorted(data["created_dirs"], key=lambda p: -p.count("/")):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            path.unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                REGISTRY_DIR.rmdir()


def read_sysctl(name: str) -> str:
    return Path("/proc/sys", name.replace(".", "/")).read_text().strip()


def write_sysctl(name: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", name.replace(".", "/")).write_text(value + "\n")


def _claim_host(layout: NodeLayout) -> None:
    """Record the sysctls' original values and create the missing mount-point dirs (first cluster only)."""
    with _registry() as reg:
        live = [h for h in reg["holders"] if h != str(layout.state_dir) and _holder_alive(Path(h))]
        # No cluster holds the host: the current values are its own. (A holder that was SIGKILLed and never downed
        # stays listed until some `down` prunes it, and its recorded originals are kept until then.)
        if not live and not reg["holders"]:
            reg["sysctls"] = {name: read_sysctl(name) for name in SYSCTLS}
        for target in HARDCODED_PATHS:
            missing = []
            p = Path(target)
            while not p.exists():
                missing.append(str(p))
                p = p.parent
            Path(target).mkdir(parents=True, exist_ok=True)
            reg["created_dirs"] = sorted(set(reg["created_dirs"]) | set(missing))
        reg["holders"] = sorted({*live, str(layout.state_dir)})


def _release_host(state_dir: Path) -> None:
    if not (REGISTRY_DIR / "registry.json").exists():
        return
    with _registry() as reg:
        reg["holders"] = [h for h in reg["holders"] if h != str(state_dir) and _holder_alive(Path(h))]


def reclaim_host() -> list[str]:
    """Give back what SIGKILLed clusters (a killed run, a restarted machine) still hold, and return the state dirs
    pruned. Their recorded originals are restored once no live cluster is left, so the host looks as it did before
    any node, not as a dead node left it: what a caller about to snapshot the host needs."""
    if not (REGISTRY_DIR / "registry.json").exists():
        return []
    with _registry() as reg:
        dead = [h for h in reg["holders"] if not _holder_alive(Path(h))]
        reg["holders"] = [h for h in reg["holders"] if h not in dead]
    return dead


def live_holders() -> list[str]:
    """The state dirs of the real-node clusters that hold this host now (whose node still runs)."""
    try:
        holders = json.loads((REGISTRY_DIR / "registry.json").read_text())["holders"]
    except (OSError, ValueError, KeyError):
        return []
    return [h for h in holders if _holder_alive(Path(h))]


def _holder_alive(state_dir: Path) -> bool:
    records = {r.name: r for r in cp.read_pids(state_dir)}
    return any(records[n].process() is not None for n in ("kubelet", "containerd", "node-mounts") if n in records)


# --------------------------------------------------------------------------------------------------------------
# cgroups and the network
# --------------------------------------------------------------------------------------------------------------


def _hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies, one folder each: v1 (cpu, memory, ..., name=systemd) and, on a hybrid host,
    the controller-less v2 one (``/sys/fs/cgroup/unified``), where runc puts every container's cgroup as well."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] in ("cgroup", "cgroup2"):
                found.append(Path(parts[1]))
    return found


def _hierarchy(controller: str) -> Path | None:
    for h in _hierarchies():
        if controller in h.name.split(","):
            return h
    return None


def create_cgroups(layout: NodeLayout) -> list[Path]:
    """``<hierarchy>/<cgroup>/runtime`` in every hierarchy; returns the ``cgroup.procs`` files to join it."""
    procs = []
    for h in _hierarchies():
        for rel in (layout.cgroup, f"{layout.cgroup}/runtime"):
            d = h / rel
            d.mkdir(exist_ok=True)
            if (d / "cpuset.cpus").exists():  # a v1 cpuset child starts empty and accepts no task until set
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / f).read_text().strip():
                        (d / f).write_text((d.parent / f).read_text())
        procs.append(h / layout.cgroup / "runtime" / "cgroup.procs")
    return procs


def cgroup_pids(layout: NodeLayout) -> set[int]:
    pids: set[int] = set()
    for h in _hierarchies():
        root = h / layout.cgroup
        if not root.is_dir():
            continue
        for procs in root.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def remove_cgroups(layout: NodeLayout, timeout: float = 10.0) -> list[str]:
    """rmdir the node's cgroup trees, deepest first; returns what could not be removed."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for h in _hierarchies():
            root = h / layout.cgroup
            if not root.is_dir():
                continue
            for d in [*sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), root]:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(str(d))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def links_on_bridge(bridge: str) -> list[str]:
    proc = _ip("-j", "link", "show", "master", bridge, check=False)
    with contextlib.suppress(ValueError):
        return [link["ifname"] for link in json.loads(proc.stdout or "[]")]
    return []


def create_bridge(layout: NodeLayout) -> None:
    if not link_exists(layout.bridge):
        _ip("link", "add", layout.bridge, "type", "bridge")
    prefix = ipaddress.ip_network(layout.subnet).prefixlen
    _ip("addr", "replace", f"{layout.gateway}/{prefix}", "dev", layout.bridge)
    _ip("link", "set", layout.bridge, "up")


def delete_network(layout: NodeLayout) -> None:
    for link in links_on_bridge(layout.bridge):
        _ip("link", "delete", link, check=False)
    if link_exists(layout.bridge):
        _ip("link", "delete", layout.bridge, check=False)


# --------------------------------------------------------------------------------------------------------------
# Start
# --------------------------------------------------------------------------------------------------------------

Spawn = Callable[[str, list[str]], None]


class RealNode:
    """Starts the node of one cluster with the control plane's ``spawn`` (so ``pids.json`` lists every process)."""

    def __init__(
        self,
        layout: NodeLayout,
        binaries: Path,
        *,
        spawn: Spawn,
        check_alive: Callable[[], None],
        log: Callable[[str], None],
    ) -> None:
        self.layout = layout
        self.binaries = binaries
        self._spawn = spawn
        self._check_alive = check_alive
        self._log = log

    def start(self, info: cp.ClusterInfo, tokens: Mapping[str, str], *, ready_timeout: float = 120.0) -> None:
        layout = self.layout
        t0 = time.monotonic()
        write_config_files(layout, info, tokens)
        _claim_host(layout)
        join = create_cgroups(layout)
        self._log(f"real node {layout.node_name}: bridge {layout.bridge} {layout.gateway}/24, cgroup /{layout.cgroup}")
        create_bridge(layout)

        # Every process of the node goes into <cgroup>/runtime first, so `down` finds it (and its children) there.
        def in_cgroup(cmd: list[str]) -> list[str]:
            script = 'for f in "$@"; do case "$f" in --) break;; esac; echo $$ > "$f"; shift; done; shift; exec "$@"'
            return ["/bin/sh", "-c", script, "sh", *map(str, join), "--", *cmd]

        # The registry on the node's address and its fault proxy (tests/cluster/registry.py): pods pull from it.
        registry.write_config(layout)
        self._spawn("registry", in_cgroup(registry.registry_argv(layout)))
        self._spawn("registry-proxy", in_cgroup(registry.proxy_argv(layout)))

        self._spawn(
            "cluster-dns",
            in_cgroup(
                [
                    sys.executable,
                    "-m",
                    "tests.cluster.cluster_dns",
                    f"--listen={layout.gateway}",
                    f"--api-url={info.api_url}",
                    f"--token-file={layout.node_dir / 'dns-token'}",
                    f"--ca-file={info.ca_file}",
                ]
            ),
        )

        # The mount namespace: take a free containerd root (its lock held by the holder's fd 9 for the node's whole
        # life), bind it and the hard-coded paths, then hold the namespace with `sleep`.
        roots = containerd_roots()
        for n in range(ROOT_SLOTS):
            (roots / f"root-{n}").mkdir(parents=True, exist_ok=True)
        ready = layout.node_dir / "mounts.ready"
        ready.unlink(missing_ok=True)
        binds = [(layout.hostpath_source(t), Path(t)) for t in HARDCODED_PATHS]
        mount_script = (
            f"for n in {' '.join(map(str, range(ROOT_SLOTS)))} none; do "
            f"[ $n = none ] && exit 75; exec 9>>'{roots}/root-'$n.lock; flock -n 9 && break; exec 9>&-; done; "
            f"set -e; mount --bind '{roots}/root-'$n '{layout.containerd_dir / 'root'}'; "
        )
        mount_script += " ".join(f"mount --bind '{s}' '{t}';" for s, t in binds)
        mount_script += f" echo $n > '{ready}'; exec sleep infinity"
        self._spawn(
            "node-mounts",
            in_cgroup(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", mount_script]),
        )
        cp._wait_for(ready.exists, 15, "the node's mount namespace", self._check_alive)
        holder = self._holder_pid()
        (layout.node_dir / "mntns").write_text(os.readlink(f"/proc/{holder}/ns/mnt") + "\n")

        def in_namespace(cmd: list[str]) -> list[str]:
            return in_cgroup(["nsenter", f"--mount=/proc/{holder}/ns/mnt", "--", *cmd])

        self._log("starting containerd")
        self._spawn(
            "containerd",
            in_namespace(["containerd", f"--config={layout.containerd_dir / 'config.toml'}", "--log-level=info"]),
        )
        cp._wait_for(self._containerd_serves, 30, "containerd", self._check_alive)
        self._import_images()
        self._push_images()

        self._log("starting kubelet, kube-scheduler, kube-controller-manager")
        self._spawn("kubelet", in_namespace(kubelet_args(layout, self.binaries)))
        self._spawn("kube-scheduler", in_cgroup(scheduler_args(layout, self.binaries)))
        self._spawn("kube-controller-manager", in_cgroup(controller_manager_args(layout, self.binaries, info)))
        cp._wait_for(lambda: node_ready(info, layout.node_name), ready_timeout, f"node {layout.node_name} Ready",
                     self._check_alive)  # fmt: skip
        # ServiceAccount admission rejects pods until the token controller wrote the account's token Secret.
        for namespace in ("default", info.namespace):
            cp._wait_for(lambda ns=namespace: default_sa_has_token(info, ns), 60,
                         f"a token for ServiceAccount {namespace}/default", self._check_alive)  # fmt: skip
        self._log(f"node {layout.node_name} Ready after {time.monotonic() - t0:.1f}s")

    def _holder_pid(self) -> int:
        pid = holder_pid(self.layout)
        if pid is None:
            raise NodeError("the node's mount namespace holder (node-mounts) is not running")
        return pid

    def _containerd_serves(self) -> bool:
        return self.ctr("version", check=False).returncode == 0

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return ctr(self.layout, *args, check=check, timeout=timeout)

    def _import_images(self) -> None:
        present = {}
        for line in self.ctr("images", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 2:
                present[fields[0]] = fields[2]
        for archive in image_archives(self.binaries):
            images = archive_images(archive)
            if images and all(present.get(name) == digest for name, digest in images.items()):
                continue  # imported (and unpacked) into this root by an earlier up
            t = time.monotonic()
            self.ctr("images", "import", str(archive))
            self._log(f"imported {archive.name} ({', '.join(images) or '?'}) in {time.monotonic() - t:.1f}s")

    def _push_images(self) -> None:
        """The runner images into the registry, and out of containerd under the registry's name: each session's
        first pod of the runner pulls it (its layers are in containerd's cached root already, from the import)."""
        from tests.cluster import image

        layout = self.layout
        cp._wait_for(lambda: registry.serves(registry.push_host(layout)), 30, "the registry", self._check_alive)
        cp._wait_for(lambda: registry.serves(registry.pull_host(layout)), 30, "the registry proxy", self._check_alive)
        built = image.default_buildah().image_ids()
        tags = {v.ref: v.ref.rpartition(":")[2] for v in image.RUNNER_VARIANTS if v.ref in built}
        registry.push_runner_images(layout, tags, self._log)
        stale = [registry.image_ref(layout, tag) for tag in tags.values()]
        self.ctr("images", "rm", *stale, check=False)


def holder_pid(layout: NodeLayout) -> int | None:
    """The pid holding the node's mount namespace (sh exec'd unshare, which exec'd sh, which exec'd sleep)."""
    record = {r.name: r for r in cp.read_pids(layout.state_dir)}.get("node-mounts")
    return record.pid if record is not None and record.process() is not None else None


def ctr(layout: NodeLayout, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``ctr`` against the node's containerd (namespace ``k8s.io``, the CRI's), run inside the node's mount namespace
    where the socket is. Host paths in ``args`` (an archive to import) are the same there."""
    holder = holder_pid(layout)
    if holder is None:
        raise NodeError(f"node {layout.node_name} is not running (no mount namespace holder)")
    cmd = ["nsenter", f"--mount=/proc/{holder}/ns/mnt", "--", "ctr", f"--address={CONTAINERD_SOCKET}"]
    cmd += ["--namespace=k8s.io", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NodeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def _api_get(info: cp.ClusterInfo, path: str) -> dict[str, Any] | None:
    import ssl
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{info.api_url}{path}", headers={"Authorization": f"Bearer {info.admin_token}"})
    try:
        tls = ssl.create_default_context(cafile=str(info.ca_file))
        with urllib.request.urlopen(request, timeout=5, context=tls) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


def node_ready(info: cp.ClusterInfo, node_name: str) -> bool:
    node = _api_get(info, f"/api/v1/nodes/{node_name}")
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def default_sa_has_token(info: cp.ClusterInfo, namespace: str) -> bool:
    sa = _api_get(info, f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
    return bool((sa or {}).get("secrets"))


# --------------------------------------------------------------------------------------------------------------
# Stop (needs only the state dir)
# --------------------------------------------------------------------------------------------------------------


def stop_node(state_dir: Path, *, timeout: float = 15.0, log: Callable[[str], None] | None = None) -> list[str]:
    """Stop the real node of the cluster in ``state_dir`` and undo its host changes; returns what is left (normally
    nothing). A no-op for a cluster without one. Order: the kubelet and the other clients, then everything in the
    node's cgroup tree (pod containers, shims, containerd, the mount namespace's holder), then cgroups, network,
    and the shared host state."""
    say = log or (lambda msg: None)
    layout = load_layout(state_dir)
    if layout is None:
        return []
    records = {r.name: r for r in cp.read_pids(layout.state_dir)}
    for name in NODE_PROCESSES[:4]:
        if name in records:
            cp._terminate([records[name]], timeout, say)
    # Pods, shims, containerd, the holder: SIGKILL for all (a container that is gone needs no grace here), until
    # the tree is empty; the freezer would stop forks in between, but none of these fork in a loop.
    victims = _node_processes(layout)
    if victims:
        say(f"killing {len(victims)} process(es) of node {layout.node_name} (containers, shims, containerd)")
    deadline = time.monotonic() + timeout
    while victims and time.monotonic() < deadline:
        for proc in victims:
            cp.signal_proc(proc, signal.SIGKILL)
        cp.wait_gone(victims, 2)
        victims = _node_processes(layout)
    left = [f"pid {p.pid} ({' '.join(cp.cmdline(p))[:100]})" for p in victims]
    left += [f"cgroup {d}" for d in remove_cgroups(layout)]
    delete_network(layout)
    if link_exists(layout.bridge):
        left.append(f"bridge {layout.bridge}")
    _release_host(layout.state_dir)
    if not victims:
        # Task state and network namespace files (the root is a cached one, containerd_roots()); the logs stay.
        shutil.rmtree(layout.containerd_dir / "state", ignore_errors=True)
    return left


_NODE_PROGRAMS = frozenset(
    {
        "containerd",
        "containerd-shim-runc-v2",
        "containerd-shim",
        "kubelet",
        "kube-scheduler",
        "kube-controller-manager",
        "docker-registry",
        "nsenter",
        "unshare",
        "sleep",
        "sh",
    }
)


def _node_processes(layout: NodeLayout) -> list[psutil.Process]:
    """Live processes of the node: its cgroup tree, plus (should a process have escaped it) any process whose command
    line names the node dir, as containerd's shims do (``-address <node>/containerd/run/containerd.sock``)."""
    spared = {os.getpid()} | {p.pid for p in cp.ancestors()}
    procs = []
    for pid in cgroup_pids(layout):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    node_dir = str(layout.node_dir)
    try:
        mntns = (layout.node_dir / "mntns").read_text().strip()
    except OSError:
        mntns = ""
    seen = {p.pid for p in procs}
    for proc in cp._all_procs():
        if proc.pid in seen:
            continue
        cmd = cp.cmdline(proc)
        program = Path(cmd[0]).name if cmd else ""
        # In the node's mount namespace (containerd's shims are, and name no path of the node dir). The program check
        # guards against a namespace id reused after the node's namespace is long gone.
        if mntns and program in _NODE_PROGRAMS:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{proc.pid}/ns/mnt") == mntns:
                    procs.append(proc)
                    continue
        # Only programs the node runs: never a user's shell or editor that merely looks at the node dir.
        ours = program in _NODE_PROGRAMS or (
            program.startswith("python")
            and any(m in cmd for m in ("tests.cluster.cluster_dns", "tests.cluster.registry_proxy"))
        )
        if ours and any(cp._mentions(arg, node_dir) for arg in cmd):
            procs.append(proc)
    return [p for p in procs if p.pid not in spared and cp.is_running(p)]


def leftovers(layout: NodeLayout) -> list[str]:
    """What of the node is still on the host (for tests): processes, cgroups, the bridge, mounts naming the state
    dir, the registry of shared host state."""
    found = [f"pid {p.pid} ({' '.join(cp.cmdline(p))[:100]})" for p in _node_processes(layout)]
    found += [str(h / layout.cgroup) for h in _hierarchies() if (h / layout.cgroup).exists()]
    if link_exists(layout.bridge):
        found.append(f"bridge {layout.bridge}")
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if str(layout.state_dir) in line:
                found.append(f"mount {line}")
    return found

"""The real node (tests/cluster/real_node.py) through `python -m tests.cluster up --node real` / `down`.

It registers Ready, runs a pod to completion with a termination message, resolves a headless Service and a
``<hostname>.<subdomain>`` name from a pod, its containerd logs lines whose times disagree with their order (the
wait's cursor prints each once), and the real scheduler reports ``Insufficient nvidia.com/gpu``. Then
`down` (also after an `up` killed with SIGKILL half-way) must leave nothing on the host: no process of the node
(containerd, its shims, pod containers, kubelet, scheduler, controller-manager, DNS), no cgroup dir, no bridge or
veth, no mount naming the state dir, no hard-coded path that did not exist before, the kubelet's sysctls at their old
values, no new iptables rules, and no shared-host registry.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import control_plane as cp
from tests.cluster import real_node as rn
from tests.cluster.pytest_plugin import REAL_NODE_GROUP

#: In the worker that owns the real node (tests/conftest.py), before the session's real-node cluster starts there:
#: the host snapshots compare the whole host, so no other real node may come or go meanwhile.
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group(REAL_NODE_GROUP)]

BUSYBOX_IMAGE = "torchelastic.test/busybox:1.35"


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.cluster", *args],
        cwd=cp.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def host_snapshot() -> dict[str, Any]:
    """What a real node may change on the host, and `down` must put back."""
    paths = {*rn.HARDCODED_PATHS, "/var/lib/kubelet", "/run/containerd", str(rn.REGISTRY_DIR), "/run/netns"}
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    snapshot: dict[str, Any] = {
        "sysctls": {name: rn.read_sysctl(name) for name in rn.SYSCTLS},
        "paths": {p: os.path.lexists(p) for p in sorted(paths)},
        "veths": sorted(line.split(":")[1].strip() for line in links.splitlines() if "veth" in line),
    }
    for tool, args in (("iptables-save", []), ("nft", ["list", "ruleset"])):
        if shutil.which(tool):
            out = subprocess.run([tool, *args], capture_output=True, text=True, check=False).stdout
            snapshot[tool] = sorted(line for line in out.splitlines() if not line.startswith("#"))
    return snapshot


def leftovers(state_dir: Path, layout: rn.NodeLayout) -> list[str]:
    found = rn.leftovers(layout)
    for proc in cp._all_procs():
        cmd = " ".join(cp.cmdline(proc))
        if str(state_dir) in cmd and proc.pid != os.getpid() and cp.is_running(proc):
            found.append(f"pid {proc.pid}: {cmd[:150]}")
    return found


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def get(kubeconfig: Path, kind: str, name: str, namespace: str = cp.TEST_NAMESPACE) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(kubectl(kubeconfig, "-n", namespace, "get", kind, name, "-o", "json"))
    return obj


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.5)


def wait_finished(kubeconfig: Path, name: str, timeout: float = 120) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        obj = get(kubeconfig, "pod", name)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    done: dict[str, Any] = wait_for(finished, timeout, f"pod {name} to finish")
    return done


def pod(name: str, command: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {})},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                    **spec.pop("container", {}),
                }
            ],
            **spec,
        },
    }


class RealCluster:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.up_seconds = 0.0
        self.down_result: subprocess.CompletedProcess[str] | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def layout(self) -> rn.NodeLayout:
        layout = rn.load_layout(self.state_dir)
        assert layout is not None
        return layout

    def down(self) -> subprocess.CompletedProcess[str]:
        if self.down_result is None:
            self.down_result = cli("down", "--state-dir", str(self.state_dir))
        return self.down_result


@pytest.fixture(scope="module")
def host_before() -> dict[str, Any]:
    # The snapshot is the whole host's: a node that another run (a second `make test`, a `make cluster-up`) keeps up
    # would be in it, and its `down` meanwhile would look like ours leaving things behind, or taking too much away.
    # A node that was SIGKILLed (a killed run, a restarted machine) left its sysctls and dirs behind; our own `down`
    # would give them back, so the snapshot is taken after they are, or it would record the dead node's host.
    rn.reclaim_host()
    others = rn.live_holders()
    assert not others, (
        f"another real node is up on this host ({', '.join(others)}): these tests compare the whole host before and "
        "after their own node, so stop it first (python -m tests.cluster down --state-dir DIR)"
    )
    return host_snapshot()


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory, host_before: dict[str, Any]) -> Iterator[RealCluster]:
    cluster = RealCluster(tmp_path_factory.mktemp("real-node") / "cluster")
    started = time.monotonic()
    up = cli("up", "--node", "real", "--state-dir", str(cluster.state_dir))
    cluster.up_seconds = time.monotonic() - started
    try:
        assert up.returncode == 0, up.stderr[-6000:]
        archive = rn.write_oci_archive(
            cluster.state_dir / "busybox.oci.tar",
            BUSYBOX_IMAGE,
            {"/bin/busybox": Path("/bin/busybox")},
            entrypoint=["/bin/sh"],
            symlinks={"/bin/sh": "busybox", "/bin/nslookup": "busybox", "/bin/sleep": "busybox"},
        )
        rn.ctr(cluster.layout, "images", "import", str(archive))
        yield cluster
    finally:
        cluster.down()


def test_node_registers_ready(real_cluster: RealCluster) -> None:
    node = json.loads(kubectl(real_cluster.kubeconfig, "get", "node", real_cluster.layout.node_name, "-o", "json"))
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == f"v{cp.KUBE_VERSION}"
    assert {"type": "InternalIP", "address": real_cluster.layout.gateway} in node["status"]["addresses"]
    print(f"\n[real node] up took {real_cluster.up_seconds:.1f}s", file=sys.__stderr__)


def test_pod_runs_to_completion_with_a_termination_message(real_cluster: RealCluster) -> None:
    started = time.monotonic()
    kubectl(
        real_cluster.kubeconfig, "-n", cp.TEST_NAMESPACE, "create", "-f", "-",
        stdin=json.dumps(pod("hello", "echo -n rank0-result > /dev/termination-log")),
    )  # fmt: skip
    done = wait_finished(real_cluster.kubeconfig, "hello")
    print(f"\n[real node] pod created -> Succeeded in {time.monotonic() - started:.1f}s", file=sys.__stderr__)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["message"] == "rank0-result"
    assert done["spec"]["nodeName"] == real_cluster.layout.node_name  # bound by the real scheduler


def test_cluster_dns_resolves_headless_services_and_pod_hostnames(real_cluster: RealCluster) -> None:
    ns = cp.TEST_NAMESPACE
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "dns-svc"},
        "spec": {"clusterIP": "None", "selector": {"app": "dns-target"}, "ports": [{"port": 80}]},
    }
    target = pod("dns-target", "sleep 3600", labels={"app": "dns-target"}, hostname="host0", subdomain="dns-svc")
    kubectl(real_cluster.kubeconfig, "-n", ns, "create", "-f", "-", stdin=json.dumps(service))
    kubectl(real_cluster.kubeconfig, "-n", ns, "create", "-f", "-", stdin=json.dumps(target))
    ip = wait_for(
        lambda: get(real_cluster.kubeconfig, "pod", "dns-target")["status"].get("podIP"), 120, "dns-target's IP"
    )
    # Ready addresses, not just subsets: a target that has its IP but is not Ready yet stands in notReadyAddresses,
    # which cluster DNS (as CoreDNS) does not serve, and a fast probe would then get NXDOMAIN.
    wait_for(
        lambda: any(
            s.get("addresses") for s in get(real_cluster.kubeconfig, "endpoints", "dns-svc").get("subsets") or []
        ),
        60,
        "dns-svc's ready Endpoints",
    )
    # busybox's nslookup does not walk the search list: full names here (glibc in the runner image does).
    fqdn = f"dns-svc.{ns}.svc.{rn.CLUSTER_DOMAIN}"
    probe = pod("dns-probe", f"nslookup {fqdn} && nslookup host0.{fqdn} && cat /etc/resolv.conf")
    kubectl(real_cluster.kubeconfig, "-n", ns, "create", "-f", "-", stdin=json.dumps(probe))
    done = wait_finished(real_cluster.kubeconfig, "dns-probe")
    logs = kubectl(real_cluster.kubeconfig, "-n", ns, "logs", "dns-probe")
    assert done["status"]["phase"] == "Succeeded", logs
    assert logs.count(f"Address: {ip}") >= 2, logs
    assert f"search {ns}.svc.{rn.CLUSTER_DOMAIN}" in logs, logs
    kubectl(real_cluster.kubeconfig, "-n", ns, "delete", "pod", "dns-target", "--wait=false")


def test_lines_written_to_both_streams_at_once_are_each_printed_once(real_cluster: RealCluster) -> None:
    """containerd stamps stdout and stderr lines in two goroutines and writes them in turn: across the streams a log's
    times need not follow its order. The wait's cursor, fed this real log in overlapping reads as the API answers
    them (from the whole second before the last line printed, as a paced read's ``sinceTime``), prints
    every line once and in the log's order."""
    from airflow_provider_torchelastic.kubernetes.status import LogCursor, new_log_lines

    ns = cp.TEST_NAMESPACE
    count = 3000
    script = f'i=0; while [ $i -lt {count} ]; do echo "out $i"; echo "err $i" >&2; i=$((i+1)); done'
    kubectl(real_cluster.kubeconfig, "-n", ns, "create", "-f", "-", stdin=json.dumps(pod("two-streams", script)))
    assert wait_finished(real_cluster.kubeconfig, "two-streams")["status"]["phase"] == "Succeeded"
    raw = kubectl(real_cluster.kubeconfig, "-n", ns, "logs", "--timestamps", "two-streams").splitlines()
    stamps = [line.split(" ", 1)[0] for line in raw]
    assert len(raw) == 2 * count, raw[-3:]
    padded = [f"{s[:19]}.{s[20:-1].ljust(9, '0')}" for s in stamps]
    inversions = sum(1 for a, b in itertools.pairwise(padded) if b < a)
    print(f"\n[real node] {inversions} of {len(raw)} lines stamped before the line written ahead of them")
    printed: list[str] = []
    cursor, end = LogCursor(), 0
    while end < len(raw):
        # A read ends anywhere; the next has the lines from the whole second before the last one read: a line
        # written after it may be stamped in the second before (a read from its own second would not bring it).
        since = (datetime.fromisoformat(stamps[end - 1][:19]) - timedelta(seconds=1)).isoformat() if end else ""
        end = min(len(raw), end + 997)
        lines, cursor = new_log_lines(cursor, "\n".join(line for line in raw[:end] if line[:19] >= since))
        printed += lines
    assert printed == [line.split(" ", 1)[1] for line in raw]
    kubectl(real_cluster.kubeconfig, "-n", ns, "delete", "pod", "two-streams", "--wait=false")


def test_scheduler_reports_insufficient_gpu(real_cluster: RealCluster) -> None:
    gpu = pod("wants-gpu", "true", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    kubectl(real_cluster.kubeconfig, "-n", cp.TEST_NAMESPACE, "create", "-f", "-", stdin=json.dumps(gpu))

    def unschedulable() -> str | None:
        conditions = get(real_cluster.kubeconfig, "pod", "wants-gpu")["status"].get("conditions") or []
        for c in conditions:
            if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
                return str(c.get("message"))
        return None

    message = wait_for(unschedulable, 60, "PodScheduled=False")
    assert "Insufficient nvidia.com/gpu" in message


def test_down_leaves_nothing_behind(real_cluster: RealCluster, host_before: dict[str, Any]) -> None:
    layout = real_cluster.layout
    down = real_cluster.down()
    assert down.returncode == 0, down.stderr
    assert leftovers(real_cluster.state_dir, layout) == []
    assert host_snapshot() == host_before


def test_down_after_a_sigkilled_up_leaves_nothing_behind(
    tmp_path: Path, real_cluster: RealCluster, host_before: dict[str, Any]
) -> None:
    # After the module's cluster is down, so that the host is back to `host_before` (the sysctls are shared).
    assert real_cluster.down().returncode == 0
    state_dir = tmp_path / "killed"
    up_log = tmp_path / "up.log"
    with open(up_log, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster", "up", "--node", "real", "--state-dir", str(state_dir)],
            cwd=cp.REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Killed once the kubelet has started: containerd, its mount namespace, the bridge and cgroups exist.
        def kubelet_started() -> bool:
            return "kubelet" in {r.name for r in cp.read_pids(state_dir)} or up.poll() is not None

        wait_for(kubelet_started, 300, "the kubelet to start")
        time.sleep(3)
        assert up.poll() is None, up_log.read_text()[-4000:]
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=10)
        layout = rn.load_layout(state_dir)
        assert layout is not None
        assert rn.link_exists(layout.bridge)  # it was really half-way
    finally:
        down = cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert leftovers(state_dir, layout) == []
    assert host_snapshot() == host_before

"""`python -m tests.cluster up/down` as a user runs it: detached processes, the kubeconfig as the last line, and no
process left behind by `down`, including pod process groups the simulated kubelet recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster import control_plane as cp

pytestmark = pytest.mark.cluster

REPO_ROOT = cp.REPO_ROOT


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.cluster", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def cluster_processes(state_dir: Path) -> list[str]:
    """etcd / kube-apiserver / simulator processes whose command line names ``state_dir``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        if any(str(state_dir) in arg for arg in cmd):
            found.append(f"{proc.pid}: {' '.join(cmd)[:150]}")
    return found


def test_up_down_leaves_nothing_behind(tmp_path: Path, kube_apiserver_binary: Path) -> None:
    # A second cluster, independent of the session's kube_cluster, driven through the CLI as a user would.
    state_dir = tmp_path / "cli-cluster"
    up = cli("up", "--state-dir", str(state_dir))
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip().splitlines()[-1]
        assert kubeconfig == str(state_dir / "kubeconfig")

        # The processes outlived the `up` command.
        records = cp.read_pids(state_dir)
        assert {"etcd", "kube-apiserver"} <= {r.name for r in records}
        assert all(r.process() is not None for r in records), [r.name for r in records if r.process() is None]

        got = subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "get", "pytorchjobs", "-A", "-o", "json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["items"] == []

        again = cli("up", "--state-dir", str(state_dir))
        assert again.returncode == 0 and "already up" in again.stderr
        assert again.stdout.strip().splitlines()[-1] == kubeconfig

        # A stand-in for a pod container: its own process group, recorded as the simulated kubelet does.
        pod = subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(state_dir / "kubelet" / "pgids", "a") as f:
            f.write(f"{pod.pid}\n")
    finally:
        down = cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr

    assert pod.wait(timeout=10) is not None  # killed by `down`, reaped here
    assert [r.name for r in records if r.process() is not None] == []
    deadline = time.monotonic() + 5
    while cluster_processes(state_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_processes(state_dir) == []
    assert cli("status", "--state-dir", str(state_dir)).returncode == 3

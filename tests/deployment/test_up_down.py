"""`python -m tests.airflow_services up/down` as a person runs it: detached processes, the API's URL as the last line,
and nothing left running after `down`, including a process of the deployment that escaped its process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.airflow_services import deployment as dep

pytestmark = pytest.mark.cluster


def cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}  # as from a plain shell
    return subprocess.run(
        [sys.executable, "-m", "tests.airflow_services", *args],
        cwd=dep.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_up_down_leaves_nothing_behind(tmp_path: Path, kube_cluster) -> None:
    state_dir = tmp_path / "airflow"
    args = ("--state-dir", str(state_dir))
    up = cli("up", *args, "--kubeconfig", str(kube_cluster.kubeconfig))
    try:
        assert up.returncode == 0, up.stderr[-5000:]
        base_url = up.stdout.strip().splitlines()[-1]
        info = dep.load_info(state_dir)
        assert info is not None and base_url == info.base_url

        # The processes outlived the `up` command, and the API (behind SimpleAuthManager) takes the admin's token.
        records = dep.read_pids(state_dir)
        assert {r.name for r in records} == {"postgres", *dep.SERVICES}
        assert all(r.process() is not None for r in records), [r.name for r in records if r.process() is None]
        token = httpx.post(
            f"{base_url}/auth/token", json={"username": info.username, "password": info.password}, timeout=30
        )
        assert token.status_code == 201, token.text
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}
        dags = httpx.get(f"{base_url}/api/v2/dags", headers=headers, timeout=30)
        assert dags.status_code == 200, dags.text
        assert httpx.get(f"{base_url}/api/v2/dags", timeout=30).status_code == 401

        again = cli("up", *args)
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        assert again.stdout.strip().splitlines()[-1] == base_url

        # A stand-in for a task runner that left its parent's process group: found by the marker in its environment.
        stray = subprocess.Popen(
            ["sleep", "300"], start_new_session=True, env={**os.environ, dep.MARKER_ENV: str(state_dir.resolve())}
        )
    finally:
        down = cli("down", *args)
    assert down.returncode == 0, down.stderr[-5000:]

    assert stray.wait(timeout=10) is not None  # killed by `down`, reaped here
    assert [r.name for r in records if r.process() is not None] == []
    assert dep.marked_processes(state_dir) == []
    assert not info.pg_dir.exists()
    assert cli("status", *args).returncode == 3

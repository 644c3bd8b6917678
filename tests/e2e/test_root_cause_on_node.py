"""The root cause of a real OOM across pods, on the real node (issue 33, item 2): cgroup v1 memory limits are the
kernel's there, and its OOM killer takes one process, the worker filling memory, not the container.

An elastic 2-pod PyTorchJob (``rc_node_oom`` in tests/dags/root_cause.py) whose pods have a real memory limit; on
try 1 one pod's worker fills memory past it while the other pod's rank waits in barriers, which then fail of the
closed connection. Once on the pod that hosts the c10d store (worker 0, where ``PET_RDZV_ENDPOINT`` points: its
agent, which holds the store, outlives its worker) and once on the other pod. Each time the task names the killed
pod, not its peer, says the rank's SIGKILL and the container's OOMKilled, and retries; containerd reports OOMKilled
with the runner's own exit code, which the simulated kubelet's default OOM shape copies (tests/e2e/test_root_cause.py).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import Cluster, run_dag, training_container_status, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image

OUT_OF_MEMORY = "airflow_provider_torchelastic.operators.OutOfMemoryError: "


def test_a_worker_over_its_real_memory_limit_is_the_root_cause_on_the_store_host_and_on_another_pod(
    cluster: Cluster, failure_dir: Path
) -> None:
    from airflow_provider_torchelastic.core.naming import job_name
    from airflow_provider_torchelastic.core.outcome import decode_outcome
    from airflow_provider_torchelastic.errors import EXIT_RECOVERABLE

    started = time.monotonic()
    result = run_dag("rc_node_oom")
    print(f"\n[real node e2e] rc_node_oom: {time.monotonic() - started:.1f} s", file=sys.__stderr__, flush=True)
    assert result.tasks == {("store_host", -1): ("success", 2), ("other_pod", -1): ("success", 2)}, result
    for task, killed_index in (("store_host", 0), ("other_pod", 1)):
        assert result.xcom(task)["try_number"] == 2, result.xcom(task)
        assert sorted(p.name for p in failure_dir.iterdir() if p.name.startswith(f"rc_node_oom.{task}.")) == [
            f"rc_node_oom.{task}.try1.txt"
        ]
        error = (failure_dir / f"rc_node_oom.{task}.try1.txt").read_text()
        first = job_name(result.identity(1, task_id=task))
        killed, peer = f"{first}-worker-{killed_index}", f"{first}-worker-{1 - killed_index}"
        assert error.startswith(OUT_OF_MEMORY), (task, error)
        # The kernel killed the worker, not the runner: it reported the rank's SIGKILL, the container says why.
        assert f"{killed}: rank " in error and "SIGKILL" in error, (task, error)
        assert "its container ended OOMKilled (out of memory" in error, (task, error)
        assert peer not in error, f"{task}: the peer that failed because of the kill is blamed"
        # Try 1's job was kept (it failed).
        killed_pod = cluster.get_pod(killed)
        assert killed_pod is not None, killed
        oom = training_container_status(killed_pod).state.terminated
        assert (oom.exit_code, oom.reason) == (EXIT_RECOVERABLE, "OOMKilled"), (task, killed_pod.status)
        peer_pod = wait_for(functools.partial(_ended, cluster, peer), 60, f"{task}: the peer's pod to end")
        ended = training_container_status(peer_pod).state.terminated
        assert peer_pod.status.phase == "Failed" and ended.exit_code != 0, (task, peer_pod.status)
        outcome = decode_outcome(ended.message)
        if outcome is not None and outcome.failure is not None:
            assert outcome.failure.is_consequence, (task, outcome.failure)


def _ended(cluster: Cluster, name: str) -> Any:
    pod = cluster.get_pod(name)
    return pod if pod is not None and pod.status.phase in ("Succeeded", "Failed") else None

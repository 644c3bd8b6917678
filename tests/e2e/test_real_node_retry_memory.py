"""``retry_resources`` on the real node (issue 37): a task whose container is OOM-killed by the kernel at its first
memory limit (cgroup v1, enforced by the real kubelet and containerd) succeeds on the next try, which runs with twice
the memory. The simulated cluster's version (tests/e2e/test_cluster_says_no.py) plays the kill with an annotation;
here the training function really needs more than the first limit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.dags import real_node_retry_memory as dags
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import Cluster, run_dag, training_container_status

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them (names, not imports: tests take them as arguments).
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image

OUT_OF_MEMORY = "airflow_provider_torchelastic.operators.OutOfMemoryError: "


def test_a_task_oom_killed_at_its_first_limit_succeeds_with_twice_the_memory(
    cluster: Cluster, failure_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_torchelastic.core.naming import job_name

    started = time.monotonic()
    result = run_dag("real_node_retry_memory")
    print(f"\n[real node retry_memory] {time.monotonic() - started:.1f} s", file=sys.__stderr__, flush=True)
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    assert result.xcom() == {"try_number": 2, "mib": dags.NEEDS_MIB}

    # Try 1: the kernel killed it at 1Gi (containerd's reason, not ours).
    error = (failure_dir / "real_node_retry_memory.train.try1.txt").read_text()
    assert error.startswith(OUT_OF_MEMORY), error
    first = cluster.get_pod(job_name(result.identity(1)))
    assert first is not None, "try 1's pod is kept"
    terminated = training_container_status(first).state.terminated
    assert terminated is not None and terminated.reason == "OOMKilled", first.status
    (container,) = [c for c in first.spec.containers if c.name == "pytorch"]
    assert container.resources.limits["memory"] == dags.FIRST_LIMIT

    # Try 2 (its pod deleted on success: on_finish_action's default): twice the memory, in the manifests it
    # submitted (XComs are try 2's), its log and its job summary.
    (pod,) = result.xcom(key="manifests")[-1:]
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "pytorch"]
    assert container["resources"] == {"requests": {"memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    note = result.xcom(key="torch_elastic_job")["retry_resources"]["note"]
    assert note == "retry_resources: try 1 ran out of memory; try 2: pod memory requests 1Gi -> 2Gi, limits 1Gi -> 2Gi"
    assert note in "".join(capfd.readouterr()), "the escalation is logged"

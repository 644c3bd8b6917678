"""Code defined in a DAG file runs in the pods, where neither the file nor Airflow exists.

``tests/dags/k8s_dag_file_code.py`` runs through ``dag.test()`` on the real node as a PyTorchJob with a Master and
a Worker. Its pods run the runner image built from docker/Dockerfile (torch, cloudpickle, this package; no Airflow,
no checkout), so the helper, the class and the closure the training function uses must all have travelled in the
payload. Every rank also reports what its pod's Python can see.
"""

from __future__ import annotations

import pytest

from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import Cluster, run_dag

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image


def test_helper_class_and_closure_of_the_dag_file_run_in_the_pods(cluster: Cluster) -> None:
    result = run_dag("k8s_dag_file_code")
    assert result.state == "success", result
    assert result.xcom(key="job_kind") == "PyTorchJob"
    value = result.xcom()
    assert value["normalised"] == [0.125, 0.25, 0.625]  # the helper
    assert value["scaled"] == [0.375, 0.75, 1.875]  # the closure (factor 3, bound when the DAG file was parsed)
    assert (value["mean"], value["mean_type"]) == (1.0, "RunningMean")  # the class
    name = result.xcom(key="job_name")
    pods = {seen["hostname"]: seen for seen in value["pods"]}
    assert sorted(pods) == [f"{name}-master-0", f"{name}-worker-0"], value["pods"]
    assert sorted(seen["rank"] for seen in pods.values()) == [0, 1]
    for seen in pods.values():
        assert seen["airflow_importable"] is False, seen
        assert seen["cwd_in_repo"] is False, seen
        assert seen["repo_paths_on_sys_path"] == [], seen

"""A sidecar (an init container with ``restartPolicy: Always``, Kubernetes 1.29+) in the pod template is rendered as
given, not refused: the provider cannot run it on the 1.20 test cluster, which would prune the field and then wait
on the init container forever, so the contract is checked against the schemas of the versions that have it."""

from __future__ import annotations

import pytest
from jsonschema import ValidationError

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, TaskConfig, Worker
from airflow_provider_torchelastic.core.pod_options import PodOptions
from tests.contract.builders import pod_specs, render, workload
from tests.contract.schemas import validate_core_v1, validate_pod, validate_pod_template

SIDECAR = {"name": "proxy", "image": "registry.example.com/envoy:1.30", "restartPolicy": "Always"}
OPTIONS = PodOptions(pod_template={"spec": {"initContainers": [SIDECAR]}})


@pytest.mark.parametrize(
    "config",
    [Elastic(), Elastic(nnodes=2), PyTorch(master=Master(), worker=Worker(replicas=1))],
    ids=["pod", "elastic", "master-worker"],
)
def test_a_sidecar_init_container_is_rendered_as_given(config: TaskConfig) -> None:
    job = workload(render(config, pod_options=OPTIONS))
    for spec in pod_specs(job).values():
        assert SIDECAR in spec["initContainers"]
    if job["kind"] == "Pod":
        validate_pod(job, "1.37")
    else:
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            validate_pod_template(replica["template"], "1.37")


def test_a_cluster_before_the_sidecar_field_refuses_it_which_the_readme_says() -> None:
    job = workload(render(Elastic(), pod_options=OPTIONS))
    with pytest.raises(ValidationError, match="restartPolicy"):
        validate_core_v1(job, "1.25")

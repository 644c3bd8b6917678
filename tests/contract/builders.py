"""Builders for render inputs: one call per test object, overridable field by field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.pod_template import RenderInputs
from airflow_provider_torchelastic.kubernetes.render import render_manifests
from tests.cluster import sim_trainer
from tests.contract.trainjob_schemas import TORCH_DISTRIBUTED, load

IMAGE = "registry.example.com/ml/train:1.0"
PAYLOAD = b"\x80\x05payload"


def identity(**overrides: Any) -> RunIdentity:
    values: dict[str, Any] = {
        "dag_id": "nightly_training",
        "task_id": "train",
        "run_id": "scheduled__2026-01-01T00:00:00+00:00",
        "map_index": -1,
        "try_number": 1,
    }
    values.update(overrides)
    return RunIdentity(**values)


def render(
    config: TaskConfig,
    *,
    pod_options: PodOptions | None = None,
    job_options: JobOptions | None = None,
    image: str | None = IMAGE,
    default_image: str | None = None,
    payload: bytes = PAYLOAD,
    renderer: Callable[[RenderInputs], dict[str, Any]] | None = None,
    **identity_overrides: Any,
) -> list[dict[str, Any]]:
    return render_manifests(
        config,
        identity=identity(**identity_overrides),
        namespace="ml",
        image=image,
        payload=payload,
        pod_options=pod_options,
        job_options=job_options,
        default_image=default_image,
        renderer=renderer,
    )


def workload(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    assert next(m["kind"] for m in manifests) == "Secret"
    return manifests[1]


def pod_specs(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Replica type (or "Pod") -> pod spec."""
    if manifest["kind"] == "Pod":
        return {"Pod": manifest["spec"]}
    return {key: r["template"]["spec"] for key, r in manifest["spec"]["pytorchReplicaSpecs"].items()}


def pytorch_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == "pytorch")


def trainjob_pods_of(config: TaskConfig, **identity: Any) -> tuple[str, list[dict[str, Any]]]:
    """The TrainJob's name and its pods as the Trainer, JobSet and Job controllers make them from the torch-distributed
    runtime (the simulators' pure steps, aligned with Trainer v2.3.0 and JobSet v0.12.0)."""
    job = workload(render(config, renderer=kinds.TRAINJOB.render, **identity))
    job["metadata"].update(uid="00000000-0000-0000-0000-000000000001", namespace="ml")
    jobset = sim_trainer.jobset_defaults(sim_trainer.build_jobset(job, load(TORCH_DISTRIBUTED)))
    jobset["metadata"]["uid"] = "00000000-0000-0000-0000-000000000002"
    pods = []
    for rjob, index, global_index, group_index, group_replicas in sim_trainer.job_indexes(jobset):
        batch = sim_trainer.render_job(jobset, rjob, index, global_index, group_index, group_replicas)
        batch["metadata"]["uid"] = f"00000000-0000-0000-0000-00000000001{global_index}"
        pods += [sim_trainer.render_indexed_pod(batch, i) for i in range(int(batch["spec"].get("completions", 1)))]
    return job["metadata"]["name"], pods

"""Builders for render inputs: one call per test object, overridable field by field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.kubernetes.pod_template import RenderInputs
from airflow_provider_torchelastic.kubernetes.render import render_manifests

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

"""Jobs whose pods run no process and end when told (the simulated kubelet's hold mode), for watch tests and the
triggerer benchmark: hundreds of "running" jobs at no CPU cost, each ending at a moment the test chooses."""

from __future__ import annotations

from typing import Any, Final

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from tests.cluster.sim_kubelet import ANN_EXIT_CODE, ANN_HOLD

GROUP: Final = "kubeflow.org"
VERSION: Final = "v1"
PLURAL: Final = "pytorchjobs"
LABELS: Final = {LABEL_MANAGED_BY: MANAGED_BY}
_CONTAINER: Final = {"name": "pytorch", "image": "local/held:0", "command": ["python", "-c", "pass"]}


def held_pod(name: str, namespace: str) -> dict[str, Any]:
    """A bare Pod job (kind ``Pod``) that stays Running until :func:`release_patch` is applied to it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(LABELS), "annotations": {ANN_HOLD: "true"}},
        "spec": {"restartPolicy": "Never", "containers": [dict(_CONTAINER)]},
    }


def held_pytorchjob(name: str, namespace: str, *, suspended: bool = False) -> dict[str, Any]:
    """A one-Master PyTorchJob whose pod is held; ``suspended`` as Kueue leaves a queued job."""
    template = {
        "metadata": {"labels": dict(LABELS), "annotations": {ANN_HOLD: "true"}},
        "spec": {"containers": [dict(_CONTAINER)]},
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(LABELS)},
        "spec": {
            "runPolicy": {"suspend": suspended},
            "pytorchReplicaSpecs": {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}},
        },
    }


def release_patch(exit_code: int = 0) -> dict[str, Any]:
    """The merge patch that ends a held pod's containers with ``exit_code``."""
    return {"metadata": {"annotations": {ANN_EXIT_CODE: str(exit_code)}}}


def master_pod(job_name: str) -> str:
    """The name the training operator gives a PyTorchJob's Master pod."""
    return f"{job_name}-master-0"

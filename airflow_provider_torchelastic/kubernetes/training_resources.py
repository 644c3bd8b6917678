"""The training container's resources in a rendered workload, by replica: read them, and put new ones in.

``retry_resources`` (:mod:`airflow_provider_torchelastic.core.retry_resources`) changes the memory of the training
container of every replica after an OOM; this module knows where that container is in each kind's manifest: a
PyTorchJob's ``pytorchReplicaSpecs.<type>.template``, a Pod's own spec, a TrainJob's ``trainer.resourcesPerNode``.
Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchelastic.core.naming import TRAINING_CONTAINER
from airflow_provider_torchelastic.core.retry_resources import MEMORY, Resources

__all__ = ["missing_memory", "training_resources", "with_training_resources"]


def _places(workload: Mapping[str, Any]) -> dict[str, Any]:
    """Each replica's training container (or, for a TrainJob, its trainer block), by replica name."""
    spec = workload.get("spec") or {}
    kind = workload.get("kind")
    if kind == "PyTorchJob":
        return {
            replica: container
            for replica, replica_spec in (spec.get("pytorchReplicaSpecs") or {}).items()
            for container in ((replica_spec.get("template") or {}).get("spec") or {}).get("containers") or []
            if container.get("name") == TRAINING_CONTAINER
        }
    if kind == "Pod":
        found = [c for c in spec.get("containers") or [] if c.get("name") == TRAINING_CONTAINER]
        return {"pod": found[0]} if found else {}
    if kind == "TrainJob":
        return {"trainer": spec["trainer"]} if isinstance(spec.get("trainer"), dict) else {}
    return {}


def _resources_of(place: Mapping[str, Any], kind: str) -> dict[str, dict[str, str]]:
    resources = place.get("resourcesPerNode" if kind == "TrainJob" else "resources") or {}
    return {part: dict(resources[part]) for part in ("requests", "limits") if resources.get(part)}


def training_resources(workload: Mapping[str, Any]) -> dict[str, dict[str, dict[str, str]]]:
    """``{replica: {"requests": {...}, "limits": {...}}}`` of the training container of every replica."""
    kind = str(workload.get("kind"))
    return {replica: _resources_of(place, kind) for replica, place in _places(workload).items()}


def missing_memory(workload: Mapping[str, Any]) -> list[str]:
    """The replicas whose training container has neither a memory request nor a memory limit."""
    return [
        replica
        for replica, resources in training_resources(workload).items()
        if not any(MEMORY in (resources.get(part) or {}) for part in ("requests", "limits"))
    ]


def with_training_resources(workload: Mapping[str, Any], resources: Mapping[str, Resources]) -> dict[str, Any]:
    """A copy of ``workload`` whose replicas' training containers have ``resources`` (by replica; others unchanged)."""
    changed = copy.deepcopy(dict(workload))
    kind = str(changed.get("kind"))
    key = "resourcesPerNode" if kind == "TrainJob" else "resources"
    for replica, place in _places(changed).items():
        if replica in resources:
            place[key] = {part: dict(values) for part, values in resources[replica].items() if values}
    return changed

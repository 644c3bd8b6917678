"""The training container's resources in a rendered workload, by replica: read them, and put new ones in.

``retry_resources`` (:mod:`airflow_provider_torchelastic.core.retry_resources`) changes the memory of the training
container of every replica after an OOM; where that container is in a manifest is the kind's to say
(:attr:`kinds.JobKind.training_containers`: a PyTorchJob's ``pytorchReplicaSpecs.<type>.template``, a Pod's own spec,
a TrainJob's ``trainer.resourcesPerNode``). Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchelastic.core.retry_resources import MEMORY, Resources
from airflow_provider_torchelastic.kubernetes import kinds

__all__ = ["missing_memory", "training_resources", "with_training_resources"]


def _places(workload: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Each replica's training container (or, for a TrainJob, its trainer block), by replica name, and the key of its
    resources there: the kind's answer (:attr:`kinds.JobKind.training_containers`); none for a kind not known."""
    try:
        kind = kinds.get(str(workload.get("kind")))
    except ValueError:
        return {}, "resources"
    return kind.training_containers(workload), kind.resources_key


def _resources_of(place: Mapping[str, Any], key: str) -> dict[str, dict[str, str]]:
    resources = place.get(key) or {}
    return {part: dict(resources[part]) for part in ("requests", "limits") if resources.get(part)}


def training_resources(workload: Mapping[str, Any]) -> dict[str, dict[str, dict[str, str]]]:
    """``{replica: {"requests": {...}, "limits": {...}}}`` of the training container of every replica."""
    places, key = _places(workload)
    return {replica: _resources_of(place, key) for replica, place in places.items()}


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
    places, key = _places(changed)
    for replica, place in places.items():
        if replica in resources:
            place[key] = {part: dict(values) for part, values in resources[replica].items() if values}
    return changed

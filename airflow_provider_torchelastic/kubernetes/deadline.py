"""The deadline a job carries: the label :data:`NOT_AFTER_LABEL`, set to its try's ``execution_timeout`` or, for a
try without one, to the end of a lease its waiter renews. Pure: the sweep (:mod:`~.sweep`) decides from it, and the
wait core (:mod:`~.wait`) renews it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.naming import LABEL_PREFIX

__all__ = ["NOT_AFTER_LABEL", "lease_due", "lease_labels", "not_after", "with_deadline"]

#: The Unix time (whole seconds) by which the try that created the job must have ended.
NOT_AFTER_LABEL: Final = f"{LABEL_PREFIX}/not-after"


def with_deadline(manifest: Mapping[str, Any], deadline: float | None) -> dict[str, Any]:
    """``manifest`` with the try's deadline as :data:`NOT_AFTER_LABEL` (unchanged without one)."""
    if deadline is None:
        return dict(manifest)
    metadata = dict(manifest.get("metadata") or {})
    metadata["labels"] = {**(metadata.get("labels") or {}), NOT_AFTER_LABEL: str(math.ceil(deadline))}
    return {**manifest, "metadata": metadata}


def not_after(obj: Mapping[str, Any]) -> float | None:
    """The deadline an object carries, or None (no label, or one that is not whole seconds)."""
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    raw = labels.get(NOT_AFTER_LABEL) if isinstance(labels, Mapping) else None
    return float(raw) if isinstance(raw, str) and raw.isdigit() and len(raw) < 16 else None


def lease_labels(until: float) -> dict[str, str]:
    """The labels that move a job's lease to ``until``."""
    return {NOT_AFTER_LABEL: str(math.ceil(until))}


def lease_due(job: Mapping[str, Any], *, lease: float, now: float) -> bool:
    """Whether the waiter renews ``job``'s lease now: past half of it, so that a renewal that fails is tried again
    many polls before the lease runs out. A job without the label has no lease (created by another version, or by
    a try with a deadline) and is left as it is."""
    until = not_after(job)
    return until is not None and until - now <= lease / 2

"""What every kind of job decides alike while its queue holds it: a suspended job waits for capacity.

A job is suspended when it was created so (Kueue's webhook does that to a job in a LocalQueue) or preempted (suspended
while it ran; its pods are deleted, and come back when it is resumed). Pure, as the decisions it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_torchelastic.kubernetes.status import (
    Observed,
    out_of_patience,
    parse_time,
    queue_name,
    true_condition,
)
from airflow_provider_torchelastic.kubernetes.wait_types import WaitDecision, WaitPolicy

__all__ = ["suspended_decision", "suspended_since"]


def suspended_since(job: Mapping[str, Any]) -> float | None:
    """When the job's ``Suspended`` condition last became true, if it has one."""
    suspended = true_condition(job, "Suspended")
    return parse_time(suspended.get("lastTransitionTime")) if suspended else None


def suspended_decision(seen: Observed, policy: WaitPolicy) -> WaitDecision:
    """A suspended job, queued or preempted: waiting for capacity, not a failure (until ``scheduling_timeout``,
    counted from its suspension, else its creation)."""
    ref, queue = seen.ref, queue_name(seen.job)
    what = f"{ref.kind} {ref.name} is suspended" + (f" (queued in Kueue LocalQueue {queue})" if queue else "")
    return out_of_patience(seen, policy, suspended_since(seen.job) or seen.created, what, None)

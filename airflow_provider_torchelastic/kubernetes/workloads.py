"""Kueue's Workload objects as the API serves them: where they are, and how a job's are found.

Kueue makes one Workload per queued job and labels it with the job's uid; :mod:`~.queue_limits` reads them to tell
an admitted job from a queued one, and :func:`~.calls.workloads` lists them.
"""

from __future__ import annotations

from typing import Final

__all__ = ["JOB_UID_LABEL", "WORKLOAD_GROUP", "WORKLOAD_PLURAL", "WORKLOAD_VERSION"]

WORKLOAD_GROUP: Final = "kueue.x-k8s.io"
WORKLOAD_VERSION: Final = "v1beta1"
WORKLOAD_PLURAL: Final = "workloads"
#: The label Kueue puts on the Workload of a job: the job's uid.
JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"

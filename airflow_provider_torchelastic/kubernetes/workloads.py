"""Kueue's Workload objects as the API serves them: where they are, and the call that lists a job's.

Kueue makes one Workload per queued job and labels it with the job's uid; :mod:`~.queue_limits` reads them to tell
an admitted job from a queued one. Apart from the wait's protocol so that :mod:`~.client` can build the call.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["JOB_UID_LABEL", "WORKLOAD_GROUP", "WORKLOAD_PLURAL", "WORKLOAD_VERSION", "workloads_call"]

WORKLOAD_GROUP: Final = "kueue.x-k8s.io"
WORKLOAD_VERSION: Final = "v1beta1"
WORKLOAD_PLURAL: Final = "workloads"
#: The label Kueue puts on the Workload of a job: the job's uid.
JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"


def workloads_call(custom: Any, namespace: str, job_uid: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The list call of the Workloads of job ``job_uid`` on a ``CustomObjectsApi`` (sync or async)."""
    path = (WORKLOAD_GROUP, WORKLOAD_VERSION, namespace, WORKLOAD_PLURAL)
    return custom.list_namespaced_custom_object, path, {"label_selector": f"{JOB_UID_LABEL}={job_uid}"}

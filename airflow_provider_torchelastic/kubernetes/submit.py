"""Creating a try's objects on the cluster, or re-attaching to the job the same try created before a worker crash.

Knows no Airflow: the operator hands in the client, the job this try remembers (from its ``task_state_store``) and
a way to remember the job before it is created, and maps what goes wrong here (a ``KubeError``, a
:class:`Refusal`) to its own exceptions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.render import payload_configmap_owner_reference
from airflow_provider_torchelastic.kubernetes.status import JobRef, is_suspended, queue_name

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = [
    "CLUSTER_SOURCES",
    "Refusal",
    "chosen_cluster_sources",
    "create_or_reattach",
    "refusal",
    "remembered_job",
    "state_record",
    "warn_if_it_may_queue_forever",
]

#: The connection's ways to reach a cluster; the cncf.kubernetes hook accepts exactly one of them.
CLUSTER_SOURCES: Final = ("in_cluster", "kube_config_path", "kube_config")

Log = Callable[..., None]


def chosen_cluster_sources(extras: Mapping[str, Any]) -> list[str]:
    """The ways to reach a cluster a connection's extras name (either spelling of each key)."""
    return [key for key in CLUSTER_SOURCES if extras.get(key) or extras.get(f"extra__kubernetes__{key}")]


def state_record(ref: JobRef, try_number: int) -> dict[str, Any]:
    """What the task state store keeps of the job a try creates."""
    return {**asdict(ref), "try_number": try_number}


def remembered_job(saved: object, try_number: int) -> JobRef | None:
    """The job the state store remembers for this try. Its values survive retries, so only the record of *this*
    try counts: a new try must get a new job."""
    if isinstance(saved, dict) and saved.get("try_number") == try_number:
        return JobRef(kind=str(saved["kind"]), name=str(saved["name"]), namespace=str(saved["namespace"]))
    return None


def create_or_reattach(
    kube: SyncKube,
    ref: JobRef,
    configmap: dict[str, Any],
    workload: dict[str, Any],
    *,
    remembered: JobRef | None,
    remember: Callable[[JobRef], None] | None,
    info: Log,
    warning: Log,
) -> JobRef:
    """Create the ConfigMap and the job, or re-attach to the job this try already created; returns the job.

    ``remembered`` is the job this try's earlier attempt recorded (its name may have been computed differently: a
    provider upgrade between a worker crash and the resumed try); the deterministic ``ref`` covers everything
    else. ``remember`` records the job before it is created, so that a crash between the two still finds it. Each
    API call is retried while the API is unavailable; what still fails raises ``KubeError``.
    """
    from airflow_provider_torchelastic.kubernetes.client import retry_sync

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return retry_sync(functools.partial(fn, *args), warning)

    for candidate in [*([remembered] if remembered is not None else []), ref]:
        if call(kube.get, candidate.kind, candidate.name, candidate.namespace) is not None:
            info(
                "Re-attaching to %s %s/%s created earlier by this try",
                candidate.kind,
                candidate.namespace,
                candidate.name,
            )
            return candidate
    if remember is not None:
        remember(ref)
    name = configmap["metadata"]["name"]
    try:
        call(kube.create, configmap)
    except KubeError as e:
        if not e.conflict:
            raise
        # Left by this try's earlier attempt that crashed before creating its job. The ConfigMap is immutable
        # and holds the same function and arguments (same try, same rendered templates): use it.
        info("Payload ConfigMap %s/%s exists already; using it", ref.namespace, name)
    try:
        created = call(kube.create, workload)
    except KubeError as e:
        if not e.conflict:
            raise
        # A retried create whose first attempt went through, or a concurrent run of the same try.
        info("%s %s/%s already exists; re-attaching", ref.kind, ref.namespace, ref.name)
        return ref
    info("Created %s %s/%s", ref.kind, ref.namespace, ref.name)
    owner = payload_configmap_owner_reference(owner_name=ref.name, owner_uid=created["metadata"]["uid"], kind=ref.kind)
    call(kube.patch_configmap, name, ref.namespace, owner)
    return ref


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """What a failed submission means: the message for the task, and whether a retry may help."""

    message: str
    recoverable: bool


def refusal(ref: JobRef, error: KubeError) -> Refusal:
    """What a failed submission means for the task: only an API that stayed unavailable is worth a retry.

    401/403 (no permission, told apart from an admission webhook's 403 denial by the Status's details), 404 (no
    such resource: the CRD is not installed), 400/422 (the API server or an admission webhook rejected the object)
    fail the same way on every retry.
    """
    where = f"Cannot create {ref.kind} {ref.namespace}/{ref.name}"
    if error.recoverable:
        return Refusal(message=f"{where}: the Kubernetes API stayed unavailable ({error})", recoverable=True)
    hint = ""
    if error.denied_by_admission:
        hint = (
            "; an admission webhook refused the object (for a PyTorchJob, the training operator's validation: see "
            "its message above); fix the task's configuration"
        )
    elif error.status in (401, 403):
        hint = "; the connection's identity lacks permission (see the Role in the README)"
    elif error.status == 404:
        descriptor = kinds.get(ref.kind)
        if not descriptor.is_core:
            hint = (
                f"; the API server has no {descriptor.plural}.{descriptor.group} resource: is the Kubeflow training "
                f"operator (its {ref.kind} CRD, {descriptor.api_version}) installed in this cluster?"
            )
        else:
            hint = f"; does namespace {ref.namespace!r} exist?"
    elif error.status in (400, 422):
        hint = "; the API server or an admission webhook rejected the object"
    return Refusal(message=f"{where}: {error}{hint} (a retry will not help)", recoverable=False)


def warn_if_it_may_queue_forever(workload: Mapping[str, Any], *, bounded: bool, warning: Log) -> None:
    """Warn about a job that a queue may hold forever: one in a Kueue LocalQueue or created suspended, of a task
    with no time bound (``bounded``: it sets a scheduling or an execution timeout)."""
    queue = queue_name(workload)
    if not (queue or is_suspended(workload)) or bounded:
        return
    held = f"in Kueue LocalQueue {queue}" if queue else "suspended"
    warning(
        "%s %s is %s and this task sets neither scheduling_timeout nor execution_timeout: it waits for as "
        "long as the queue holds the job, and a job that is never admitted keeps this task waiting forever",
        workload.get("kind"),
        workload.get("metadata", {}).get("name"),
        held,
    )

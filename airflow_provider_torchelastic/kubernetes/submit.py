"""Creating a try's objects on the cluster, or re-attaching to the job the same try created before a worker crash.

Knows no Airflow: the operator hands in the client, the job and token this try remembers (from its
``task_state_store``) and a way to remember the job before it is created, and maps what goes wrong here (a
``KubeError``, a :class:`Refusal`) to its own exceptions.
"""

from __future__ import annotations

import functools
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from airflow_provider_torchelastic.core.naming import LABEL_PREFIX
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.render import payload_secret_owner_reference
from airflow_provider_torchelastic.kubernetes.status import is_suspended, queue_name
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = [
    "TOKEN_ANNOTATION",
    "EarlierTry",
    "Refusal",
    "RememberedTry",
    "create_or_reattach",
    "earlier_try",
    "new_token",
    "ownership",
    "refusal",
    "remembered_job",
    "remembered_try",
    "state_record",
    "stop_earlier_try",
    "warn_if_it_may_queue_forever",
    "with_token",
]

#: The annotation on the payload Secret and the job that carries the token of the try that created them.
TOKEN_ANNOTATION: Final = f"{LABEL_PREFIX}/try-token"

Log = Callable[..., None]


def new_token() -> str:
    """A fresh random token for one try: what marks the objects it creates as its own (a job name is a hash that
    anyone can compute, so a name alone proves nothing)."""
    return secrets.token_hex(16)


def state_record(ref: JobRef, try_number: int, *, token: str, uid: str | None = None) -> dict[str, Any]:
    """What the task state store keeps of the job a try creates: its name, the try's token and, once created, its
    uid."""
    return {**asdict(ref), "try_number": try_number, "token": token, "uid": uid}


@dataclass(frozen=True, kw_only=True)
class RememberedTry:
    """What the state store says this try created: the job, the try's token, and the job's uid once known."""

    ref: JobRef
    token: str
    uid: str | None = None


def remembered_try(saved: object, try_number: int) -> RememberedTry | None:
    """The record of *this* try (its values survive retries: a new try gets a new job and a new token); None for
    another try's, or for a record without a token (written before tokens: nothing it names can be proven ours)."""
    if not isinstance(saved, dict) or saved.get("try_number") != try_number:
        return None
    token, uid = saved.get("token"), saved.get("uid")
    if not isinstance(token, str) or not token:
        return None
    ref = JobRef(kind=str(saved["kind"]), name=str(saved["name"]), namespace=str(saved["namespace"]))
    return RememberedTry(ref=ref, token=token, uid=uid if isinstance(uid, str) and uid else None)


@dataclass(frozen=True, kw_only=True)
class EarlierTry:
    """An earlier try's record in the state store (the store's rows are shared by every try of a task instance)."""

    try_number: int
    remembered: RememberedTry


def earlier_try(saved: object, try_number: int) -> EarlierTry | None:
    """The record of a try before ``try_number`` (with its token: nothing else can be proven that try's), else None."""
    if not isinstance(saved, dict):
        return None
    earlier = saved.get("try_number")
    if not isinstance(earlier, int) or isinstance(earlier, bool) or not 0 <= earlier < try_number:
        return None
    remembered = remembered_try(saved, earlier)
    return EarlierTry(try_number=earlier, remembered=remembered) if remembered is not None else None


def stop_earlier_try(kube: SyncKube, earlier: EarlierTry, *, info: Log, warning: Log) -> bool:
    """Delete the job an earlier try of this task instance created, if it still runs; whether it was deleted.

    A new try means the earlier one is over (Airflow runs one try at a time), yet its job can outlive it: a worker
    killed while it waited (SIGKILL, a lost node), or a deferred try that was cleared before a triggerer picked its
    trigger up (Airflow then deletes the trigger row, and nothing calls ``on_kill``). Only that try's own job is
    touched (its token or its recorded uid); a finished one stays as ``on_finish_action`` left it.
    """
    from airflow_provider_torchelastic.kubernetes.client import retry_sync

    ref, token, uid = earlier.remembered.ref, earlier.remembered.token, earlier.remembered.uid
    job = retry_sync(functools.partial(kube.get, ref.kind, ref.name, ref.namespace), warning)
    if job is None or ownership(job, token=token, uid=uid) != "ours" or kinds.get(ref.kind).is_finished(job):
        return False
    info(
        "%s %s/%s of try %d is still running, but its try is over: deleting it",
        ref.kind,
        ref.namespace,
        ref.name,
        earlier.try_number,
    )
    retry_sync(functools.partial(kube.delete_job, ref), warning)
    return True


def remembered_job(saved: object, try_number: int) -> JobRef | None:
    """The job the state store remembers for this try (:func:`remembered_try`'s)."""
    remembered = remembered_try(saved, try_number)
    return remembered.ref if remembered is not None else None


def with_token(manifest: Mapping[str, Any], token: str) -> dict[str, Any]:
    """``manifest`` with the try's token as the annotation :data:`TOKEN_ANNOTATION` (the rendered one unchanged)."""
    metadata = dict(manifest.get("metadata") or {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}), TOKEN_ANNOTATION: token}
    return {**manifest, "metadata": metadata}


Ownership = Literal["absent", "ours", "foreign"]


def ownership(existing: Mapping[str, Any] | None, *, token: str, uid: str | None) -> Ownership:
    """Whether an object found under this try's name is this try's: it carries the try's token, or it has the uid
    this try recorded when it created it. Pure: the decision every re-attach takes."""
    if existing is None:
        return "absent"
    metadata = existing.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    annotations = metadata.get("annotations")
    carried = annotations.get(TOKEN_ANNOTATION) if isinstance(annotations, Mapping) else None
    if token and isinstance(carried, str) and hmac.compare_digest(carried.encode(), token.encode()):
        return "ours"
    if uid is not None and metadata.get("uid") == uid:
        return "ours"
    return "foreign"


def _not_ours(kind: str, namespace: str, name: str, *, payload: str | None = None) -> Refusal:
    what = f"{kind} {namespace}/{name} exists but was not created by this try (it lacks this try's {TOKEN_ANNOTATION} "
    what += "annotation and uid)"
    if payload is not None:
        what = f"Secret {namespace}/{payload} exists and is not this try's, and {what}"
    return Refusal(
        message=f"{what}: refusing to re-attach to it or to run anything it holds. A job name is computed from the "
        "dag, task, run and try, so someone who can create objects in this namespace may have created it; delete it "
        "if it is stale and find out who did (a retry will not help)",
        recoverable=False,
    )


def create_or_reattach(
    kube: SyncKube,
    ref: JobRef,
    secret: dict[str, Any],
    workload: dict[str, Any],
    *,
    token: str,
    remembered: JobRef | None,
    remembered_uid: str | None = None,
    remember: Callable[[JobRef, str | None], None] | None,
    info: Log,
    warning: Log,
) -> JobRef | Refusal:
    """Create the payload Secret and the job, or re-attach to the job this try already created; returns the job, or the
    :class:`Refusal` that says which object is in the way and why.

    Only objects that carry ``token`` (this try's, from its state store) or have the uid it recorded are this try's:
    a job of the try's name that is not fails the task; a payload Secret that is not is deleted and written
    again (no job of this try can own it: that job would have been found first). ``remembered`` is the job this
    try's earlier attempt recorded (its name may have been computed differently: a provider upgrade between a
    worker crash and the resumed try); the deterministic ``ref`` covers everything else. ``remember(job, uid)``
    records the job before it is created (uid None), so that a crash between the two still finds it, and its uid
    once created. Each API call is retried while the API is unavailable; what still fails raises ``KubeError``.
    """
    from airflow_provider_torchelastic.kubernetes.client import retry_sync

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return retry_sync(functools.partial(fn, *args), warning)

    def whose(job: JobRef) -> Ownership:
        return ownership(call(kube.get, job.kind, job.name, job.namespace), token=token, uid=remembered_uid)

    for candidate in [*([remembered] if remembered is not None else []), ref]:
        found = whose(candidate)
        if found == "ours":
            info(
                "Re-attaching to %s %s/%s created earlier by this try",
                candidate.kind,
                candidate.namespace,
                candidate.name,
            )
            return candidate
        if found == "foreign":
            return _not_ours(candidate.kind, candidate.namespace, candidate.name)
    refused = _refused_pod_template(kube, ref, workload)
    if refused is not None:
        return refused
    if remember is not None:
        remember(ref, None)
    name = secret["metadata"]["name"]
    instead = _write_payload_secret(kube, call, whose, ref, secret, token=token, info=info, warning=warning)
    if instead is not None:
        return instead
    try:
        created = call(kube.create, with_token(workload, token))
    except KubeError as e:
        if not e.conflict:
            raise
        # A retried create whose first attempt went through, a concurrent run of the same try, or someone else's.
        if whose(ref) == "ours":
            info("%s %s/%s already exists; re-attaching", ref.kind, ref.namespace, ref.name)
            return ref
        call(kube.delete, "Secret", name, ref.namespace)  # this try's own, which no job of it will use
        return _not_ours(ref.kind, ref.namespace, ref.name)
    info("Created %s %s/%s", ref.kind, ref.namespace, ref.name)
    uid = created["metadata"]["uid"]
    if remember is not None:
        remember(ref, uid)
    owner = payload_secret_owner_reference(owner_name=ref.name, owner_uid=uid, kind=ref.kind)
    call(kube.patch_secret, name, ref.namespace, owner)
    return ref


def _refused_pod_template(kube: SyncKube, ref: JobRef, workload: Mapping[str, Any]) -> Refusal | None:
    """A pod template of ``workload`` that the API server refuses as a Pod (422), as the task's refusal; None when
    every one is admitted, or cannot be checked here.

    The API server checks a custom resource against its CRD's schema only; the Pod validation runs when the
    controller creates the pods, and a refusal then is only an event on the job, which would wait without pods until
    ``execution_timeout``. So each template is created first as a dry-run Pod named as the controller names the
    replica's first pod. Any other answer (no permission, a webhook that cannot take a dry run, the API unavailable)
    leaves the decision to the real create, as before; so the dry run is sent once, not retried: the create that
    follows retries an unavailable API itself."""
    descriptor = kinds.get(ref.kind)
    for replica, template in descriptor.pod_templates(workload).items():
        name = f"{ref.name}-{replica.lower()}-0"
        metadata = {**(template.get("metadata") or {}), "name": name, "namespace": ref.namespace}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template.get("spec") or {}}
        try:
            kube.create(pod, dry_run=True)
        except KubeError as e:
            if e.status != 422:
                continue
            controller = descriptor.controller or f"the controller of {ref.kind}"
            return Refusal(
                message=f"Cannot create {ref.kind} {ref.namespace}/{ref.name}: the API server refuses its {replica} "
                f"pods, so {controller} could never create them: {e}. Fix the task's pod options or pod_template; "
                "a retry would meet the same refusal",
                recoverable=False,
            )
    return None


def _write_payload_secret(
    kube: SyncKube,
    call: Callable[..., Any],
    whose: Callable[[JobRef], Ownership],
    ref: JobRef,
    secret: dict[str, Any],
    *,
    token: str,
    info: Log,
    warning: Log,
) -> JobRef | Refusal | None:
    """Create this try's payload Secret (:func:`create_or_reattach`): None once it is written, else what to return
    instead: the job a concurrent attempt of this try created meanwhile, or why this try may not run."""
    name = secret["metadata"]["name"]
    try:
        call(kube.create, with_token(secret, token))
    except KubeError as e:
        if not e.conflict:
            raise
        # Not necessarily this try's: its name is anyone's to compute. Never used as it is (this try's payload may
        # differ byte for byte, and the pods check its digest): replaced, unless a job of this name appeared.
        found = whose(ref)
        if found == "ours":  # a concurrent attempt of this try created both meanwhile
            info("%s %s/%s was created by this try meanwhile; re-attaching", ref.kind, ref.namespace, ref.name)
            return ref
        if found == "foreign":
            return _not_ours(ref.kind, ref.namespace, ref.name, payload=name)
        warning("Payload Secret %s/%s exists but is not this try's: replacing it", ref.namespace, name)
        call(kube.delete, "Secret", name, ref.namespace)
        try:
            call(kube.create, with_token(secret, token))
        except KubeError as again:
            if not again.conflict:
                raise
            return Refusal(
                message=f"Secret {ref.namespace}/{name} (this try's payload) was created again by someone else "
                "while this try replaced it: refusing to run its pods with it (a retry will not help)",
                recoverable=False,
            )
    return None


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
    descriptor = kinds.get(ref.kind)
    if error.denied_by_admission:
        checker = (
            "" if descriptor.is_core else f" (for a {ref.kind}, most often the validation of {descriptor.served_by})"
        )
        hint = (
            f"; an admission webhook refused the object{checker}: see its message above; fix the task's configuration"
            + (f" ({descriptor.refusal_hint})" if descriptor.refusal_hint else "")
        )
    elif error.status in (401, 403):
        hint = "; the connection's identity lacks permission (deploy/rbac.yaml has the Role it needs)"
    elif error.status == 404:
        if not descriptor.is_core:
            hint = (
                f"; the API server has no {descriptor.plural}.{descriptor.group} resource: is {descriptor.served_by} "
                f"(its {ref.kind} CRD, {descriptor.api_version}) installed in this cluster?"
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

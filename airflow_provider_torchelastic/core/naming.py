"""Names and labels of what a task creates on Kubernetes.

Pure (standard library only). The job name is a function of the task's run identity alone, so a worker that
restarts in the middle of a try computes the same name and finds the job it already created instead of starting a
second one; a new try gets a new name, so it never collides with the job of a failed try that is still being
cleaned up.

Label values carry the identity too, made label-safe. A value that had to be changed (too long, or with characters
such as ``+`` and ``:`` from a run id) is truncated and suffixed with a hash of the original, so two different values
never share a label value; the unchanged originals are kept in annotations (``IDENTITY_ANNOTATIONS``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LABEL_PREFIX",
    "MANAGED_BY",
    "MAX_JOB_NAME_LENGTH",
    "REPLICA_INDEX_LABEL",
    "REPLICA_ORDER",
    "REPLICA_TYPE_LABEL",
    "TRAINING_CONTAINER",
    "RunIdentity",
    "TaskInstanceRef",
    "fit_job_name",
    "identity_annotations",
    "identity_labels",
    "is_job_name_of",
    "job_name",
    "label_selector",
    "placeholder_identity",
    "replica_order",
    "safe_label_value",
]

#: Domain prefix of every label and annotation key this provider sets.
LABEL_PREFIX: Final = "torchelastic.airflow.apache.org"
LABEL_DAG_ID: Final = f"{LABEL_PREFIX}/dag-id"
LABEL_TASK_ID: Final = f"{LABEL_PREFIX}/task-id"
LABEL_RUN_ID: Final = f"{LABEL_PREFIX}/run-id"
LABEL_MAP_INDEX: Final = f"{LABEL_PREFIX}/map-index"
LABEL_TRY_NUMBER: Final = f"{LABEL_PREFIX}/try-number"
#: The full identity's hash: one exact label to select a try's objects by, whatever was truncated elsewhere.
LABEL_IDENTITY: Final = f"{LABEL_PREFIX}/identity"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "airflow-provider-torchelastic"
#: The label selector of every object the provider creates (what the UI, the shared watch and the sweep list).
MANAGED_SELECTOR: Final = f"{LABEL_MANAGED_BY}={MANAGED_BY}"

#: The container that runs the runner in every pod (its status holds the outcome; its log, the training's output).
TRAINING_CONTAINER: Final = "pytorch"
#: Labels the Kubeflow training operator puts on a PyTorchJob's pods.
REPLICA_TYPE_LABEL: Final = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL: Final = "training.kubeflow.org/replica-index"
#: A PyTorchJob's replica types (the values of ``REPLICA_TYPE_LABEL``, lower-cased) in the order its pods are listed:
#: the Master first, as it holds rank 0 when there is one, then the Workers.
REPLICA_ORDER: Final = ("master", "worker")

ANNOTATION_DAG_ID: Final = f"{LABEL_PREFIX}/dag-id"
ANNOTATION_TASK_ID: Final = f"{LABEL_PREFIX}/task-id"
ANNOTATION_RUN_ID: Final = f"{LABEL_PREFIX}/run-id"

#: The training operator names pods (and their headless Services) ``<job>-worker-<i>``; with ``i`` up to five digits
#: (``-worker-99999`` is 13 characters) the job name must stay within 63 - 13 = 50 for them to be DNS-1035 labels.
MAX_JOB_NAME_LENGTH: Final = 50
_HASH_LENGTH: Final = 10  # 40 bits: collisions need ~10^6 live jobs with the same readable prefix
_MAX_LABEL_VALUE: Final = 63
#: A label value (empty, or at most 63 of ``[-_.A-Za-z0-9]`` with alphanumeric ends), and the name part of a label
#: key (the same, not empty).
LABEL_VALUE: Final = re.compile(r"^([A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?)?\Z")
QUALIFIED_NAME: Final = re.compile(r"^[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?\Z")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
#: Kubernetes' names, defined here once: a DNS-1123 label (a namespace, a container or volume name, at most 63
#: characters) and a DNS-1123 subdomain (a pod, Secret or job name, at most 253).
DNS_1123_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
DNS_1123_SUBDOMAIN: Final = re.compile(
    r"^(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z"
)


def replica_order(replica_type: str, replica_index: int | None) -> tuple[int, int]:
    """Where a pod of ``replica_type`` (any case) and ``replica_index`` comes among its job's pods: in
    :data:`REPLICA_ORDER`, then pods of no known type; within a type, by index."""
    known = replica_type.lower()
    position = REPLICA_ORDER.index(known) if known in REPLICA_ORDER else len(REPLICA_ORDER)
    return position, replica_index or 0


#: The run id used to render a task outside a run (``render_manifests(context=None)``).
PLACEHOLDER_RUN_ID: Final = "manual__render"


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True, kw_only=True)
class TaskInstanceRef:
    """A task instance by Airflow's keys, without its try: what a checked :class:`RunIdentity` and the UI's unchecked
    claim of one (``plugin.views.Identity``, whose try may be unknown) both name."""

    dag_id: str
    task_id: str
    run_id: str
    #: ``-1`` for an unmapped task.
    map_index: int = -1

    def try_of(self, try_number: int) -> RunIdentity:
        """The identity of this task instance's try ``try_number``; raises as :class:`RunIdentity` does."""
        return RunIdentity(
            dag_id=self.dag_id,
            task_id=self.task_id,
            run_id=self.run_id,
            map_index=self.map_index,
            try_number=try_number,
        )


@dataclass(frozen=True, kw_only=True)
class RunIdentity(TaskInstanceRef):
    """Which task instance try a job belongs to."""

    #: Part of the identity, so every try gets a fresh job while a restarted worker re-attaches within its try.
    try_number: int = 1

    def __post_init__(self) -> None:
        for name in ("dag_id", "task_id", "run_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"RunIdentity.{name}: expected a non-empty str, got {value!r}")
        for name, minimum in (("map_index", -1), ("try_number", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"RunIdentity.{name}: expected an int >= {minimum}, got {value!r}")
            if value < minimum:
                raise ValueError(f"RunIdentity.{name}: expected an int >= {minimum}, got {value!r}")

    @property
    def digest(self) -> str:
        """A short stable hash of the whole identity (JSON-encoded, so ``("a-b", "c")`` and ``("a", "b-c")`` differ)."""
        encoded = json.dumps([self.dag_id, self.task_id, self.run_id, self.map_index, self.try_number])
        return _hash(encoded, _HASH_LENGTH)


def placeholder_identity(dag_id: str, task_id: str) -> RunIdentity:
    """The identity used to show what a task would create when there is no run yet."""
    return RunIdentity(dag_id=dag_id, task_id=task_id, run_id=PLACEHOLDER_RUN_ID)


def _dns_part(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", text.lower())).strip("-")


def job_name(identity: RunIdentity) -> str:
    """``<dag>-<task>-<hash>``: a DNS-1035 label of at most ``MAX_JOB_NAME_LENGTH`` characters.

    The readable part is for people (``kubectl get pytorchjobs``); the hash of the full identity makes it unique.
    """
    budget = MAX_JOB_NAME_LENGTH - _HASH_LENGTH - 1
    dag, task = _dns_part(identity.dag_id), _dns_part(identity.task_id)
    # Keep the task readable when the dag id is long: the dag gets what the task leaves, but at least half.
    dag = dag[: max(budget // 2, budget - len(task) - 1)].strip("-")
    readable = "-".join(part for part in (dag, task) if part)[:budget].strip("-")
    if not readable or not readable[0].isalpha():
        # DNS-1035 labels start with a letter; dag ids such as "2024_etl" do not.
        readable = ("te-" + readable)[:budget].strip("-")
    name = f"{readable}-{identity.digest}"
    if not _DNS_1035.match(name):  # pragma: no cover - guarded by construction; a bug if it ever fires
        raise RuntimeError(f"job_name: built an invalid DNS-1035 label {name!r} from {identity!r}")
    return name


def fit_job_name(name: str, max_length: int) -> str:
    """A :func:`job_name` cut to ``max_length`` for a kind whose controllers build longer names from it (a
    TrainJob's pods): the readable part is shortened and the identity hash kept, so the name is still unique per try
    and the same on every call. A name that fits is returned as it is."""
    if len(name) <= max_length:
        return name
    readable, _, digest = name.rpartition("-")
    if len(digest) != _HASH_LENGTH or not readable or max_length < _HASH_LENGTH + 2:
        raise ValueError(
            f"job name {name!r}: expected a job_name() (a readable part, '-', a {_HASH_LENGTH}-character hash) "
            f"and a max_length of at least {_HASH_LENGTH + 2}, got max_length={max_length}"
        )
    short = f"{readable[: max_length - _HASH_LENGTH - 1].rstrip('-')}-{digest}"
    if not _DNS_1035.match(short):
        raise ValueError(f"job name {name!r}: cut to {short!r}, which is not a DNS-1035 label")
    return short


def is_job_name_of(name: object, identity: RunIdentity) -> bool:
    """Whether ``name`` is the job name a kind gave ``identity``'s try: :func:`job_name` whole, or cut by
    :func:`fit_job_name` to the length the kind allowed (a TrainJob's runtime decides it, so any cut is accepted).

    A cut keeps the identity's hash whole, so a name still answers for one try only; and a cut is a prefix of the
    readable part with no trailing ``-`` (which never doubles), so cutting the full name to ``len(name)`` gives
    ``name`` back exactly when it is such a cut."""
    if not isinstance(name, str):
        return False
    full = job_name(identity)
    if name == full:
        return True
    if len(name) > len(full):
        return False
    try:
        return fit_job_name(full, len(name)) == name
    except ValueError:  # shorter than any cut can be
        return False


def safe_label_value(value: str) -> str:
    """``value`` if it is a valid label value, else a deterministic valid one: sanitized, truncated, hash-suffixed."""
    if len(value) <= _MAX_LABEL_VALUE and LABEL_VALUE.match(value):
        return value
    suffix = _hash(value, 8)
    cleaned = re.sub(r"[^-_.A-Za-z0-9]", "-", value)[: _MAX_LABEL_VALUE - len(suffix) - 1]
    cleaned = re.sub(r"^[-_.]+|[-_.]+$", "", cleaned)
    return f"{cleaned}-{suffix}" if cleaned else suffix


def _task_labels(identity: RunIdentity) -> dict[str, str]:
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DAG_ID: safe_label_value(identity.dag_id),
        LABEL_TASK_ID: safe_label_value(identity.task_id),
        LABEL_RUN_ID: safe_label_value(identity.run_id),
    }
    # "-1" is not a valid label value (it must start with an alphanumeric), and unmapped is the common case.
    if identity.map_index >= 0:
        labels[LABEL_MAP_INDEX] = str(identity.map_index)
    return labels


def identity_labels(identity: RunIdentity) -> dict[str, str]:
    """The labels on every object of one try."""
    return {
        **_task_labels(identity),
        LABEL_TRY_NUMBER: str(identity.try_number),
        LABEL_IDENTITY: identity.digest,
    }


def identity_annotations(identity: RunIdentity) -> dict[str, str]:
    """The unabridged identity, which labels may only carry truncated."""
    return {
        ANNOTATION_DAG_ID: identity.dag_id,
        ANNOTATION_TASK_ID: identity.task_id,
        ANNOTATION_RUN_ID: identity.run_id,
    }


def label_selector(identity: RunIdentity, *, all_tries: bool = False) -> str:
    """The label selector that finds this try's objects, or with ``all_tries`` those of every try of the task instance.

    An unmapped task cannot say "no map-index label" in an equality selector, so ``all_tries`` adds ``!map-index``.
    """
    if not all_tries:
        labels: Mapping[str, str] = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_IDENTITY: identity.digest}
        return ",".join(f"{key}={value}" for key, value in labels.items())
    terms = [f"{key}={value}" for key, value in _task_labels(identity).items()]
    if identity.map_index < 0:
        terms.append(f"!{LABEL_MAP_INDEX}")
    return ",".join(terms)


def is_reserved_key(key: str) -> bool:
    """Label/annotation keys the provider or the training operator own; a user may not set them."""
    prefix = key.split("/", 1)[0] if "/" in key else ""
    return (
        prefix == LABEL_PREFIX
        or key == LABEL_MANAGED_BY
        or prefix == "training.kubeflow.org"
        or prefix.endswith(".training.kubeflow.org")
    )

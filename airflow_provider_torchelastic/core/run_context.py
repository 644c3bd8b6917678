"""The task's side of the run context, and the locations derived from it: pure, shared by both sides.

The Airflow side builds a :class:`TaskContext` and renders it into every worker as :data:`CONTEXT_ENV`; the workers
read it back with :func:`airflow_provider_torchelastic.context.current` (:mod:`airflow_provider_torchelastic.worker.
context`). Checkpoint and result locations are computed here, from the context, on both sides alike.

What follows is the user's view of the whole context (which task instance, which try, which rank, where to
checkpoint).

Call :func:`current` from the training function::

    from airflow_provider_torchelastic import context

    ctx = context.current()
    ctx.try_number, ctx.rank, ctx.checkpoint_uri, ctx.has_checkpoint()

Standard library only: it is read in the workers, where there is no Airflow. The task's side of the context (its
identity, try, retries, logical date, checkpoint location) travels in one environment variable,
:data:`CONTEXT_ENV`, as JSON: rendered into every container of the Pod or PyTorchJob, and set the same way by local
execution, so both modes see the same thing. The worker's side comes from what torch elastic gives every worker
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``) and from the node's name (``HOSTNAME``,
which Kubernetes sets to the pod's name, else the host name).

Outside a task's workers (the DAG file, a plain Python shell, the runner's agent process) :func:`current` raises
:class:`NoRunContextError`: a training function that silently ran without its checkpoint location would start from
scratch on every retry, which is what this module exists to prevent.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Final

__all__ = [
    "CONTEXT_ENV",
    "NoRunContextError",
    "RESUME_LATEST",
    "TaskContext",
    "artifact_location",
    "checkpoint_location",
    "other_run_location",
    "result_location",
    "runs_folder",
    "safe_path_piece",
]

#: The one environment variable that carries the task's side of the context into every worker.
CONTEXT_ENV: Final = "TORCHELASTIC_CONTEXT"
#: The file name of a result written to ``[torch_elastic] result_storage``.
RESULT_FILE_NAME: Final = "result.json"
#: The folder, beside a try's result file, of the try's artifacts (``[torch_elastic] artifact_storage``).
ARTIFACTS_FOLDER: Final = "artifacts"

_SAFE_PIECE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._=-]*\Z")


class NoRunContextError(RuntimeError):
    """:func:`current` was called outside the workers of a torch_elastic task."""


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """The task instance's side of the context: what the Airflow side knows, rendered into every worker.

    Everything here is the same for every pod and every restart inside a try, so the rendered manifest of a try
    stays the same however often it is rendered (a worker that re-attaches renders it again).
    """

    dag_id: str
    task_id: str
    run_id: str
    #: ``-1`` for an unmapped task.
    map_index: int = -1
    try_number: int = 1
    #: Airflow's ``max_tries`` of the task instance (``retries``, raised when the task is cleared): a failed try
    #: whose ``try_number`` is at most this is retried, so the try with ``try_number > max_tries`` is the last.
    max_tries: int = 0
    #: The DAG run's logical date as ISO 8601, or None (a run without one, such as an asset-triggered run).
    logical_date: str | None = None
    #: Where this task instance's checkpoints go (an fsspec URL or a path), or None when none is configured.
    checkpoint_uri: str | None = None
    #: Where this try's artifacts go (tensors, state dicts, modules and arrays in rank 0's value, arguments too large
    #: for the payload), or None when ``[torch_elastic] artifact_storage`` (or ``result_storage``) is not set.
    artifact_uri: str | None = None
    #: Where a try that finds no checkpoint of its own resumes from (the operator's ``resume_from``): ``"latest"``
    #: (the newest complete checkpoint of this task in the DAG's earlier runs) or a run id; None: start over.
    resume_from: str | None = None

    def __post_init__(self) -> None:
        for name in ("dag_id", "task_id", "run_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"TaskContext.{name}: expected a non-empty str, got {value!r}")
        for name, minimum in (("map_index", -1), ("try_number", 0), ("max_tries", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise TypeError(f"TaskContext.{name}: expected an int >= {minimum}, got {value!r}")
        for name in ("logical_date", "checkpoint_uri", "artifact_uri", "resume_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"TaskContext.{name}: expected a non-empty str or None, got {value!r}")

    def to_env_value(self) -> str:
        """The value of :data:`CONTEXT_ENV`: compact JSON with sorted keys, so the same context renders the same.

        ``artifact_uri`` is left out when None: a try without artifact storage renders as it did before the field
        existed (an older runner image reads the context it always read)."""
        fields = asdict(self)
        for name in ("artifact_uri", "resume_from"):
            if fields[name] is None:
                del fields[name]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_env_value(cls, text: str) -> TaskContext:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise NoRunContextError(f"{CONTEXT_ENV}: expected a JSON object, got {text[:200]!r} ({e})") from None
        if not isinstance(data, dict):
            raise NoRunContextError(f"{CONTEXT_ENV}: expected a JSON object, got {text[:200]!r}")
        # Unknown keys are left out: a newer Airflow side may send more than an older image knows.
        known = {key: data[key] for key in cls.__dataclass_fields__ if key in data}
        try:
            return cls(**known)
        except TypeError as e:
            raise NoRunContextError(f"{CONTEXT_ENV}: {e}") from None


# --- locations (pure) ------------------------------------------------------------------------------------------------


#: What an escaped piece ends with: ``-`` and 16 hex digits of the original's hash (or only the digits).
_ESCAPED_SHAPE = re.compile(r"(?:\A|-)[0-9a-f]{16}\Z")


def safe_path_piece(value: str) -> str:
    """``value`` as one path segment that every store accepts: unchanged when it is already safe, else its unsafe
    characters (``:``, ``+``, ``/``, spaces ...) replaced by ``_`` and a hash of the original appended.

    Injective, because a run_id is anyone's to choose (a manual run, the API): two different values never share a
    segment, so no run can read or write another's checkpoints. An escaped piece always ends in ``-`` and 16 hex
    digits, so a safe value of that shape is escaped too, and can never pose as another value's escaped form; two
    escaped pieces share a segment only if their 64-bit hashes do.
    """
    if len(value) <= 200 and _SAFE_PIECE.match(value) and value not in (".", "..") and not _ESCAPED_SHAPE.search(value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9._=-]", "_", value)[:180].lstrip(".")
    digest = hashlib.sha256(value.encode()).hexdigest()[:16]
    return f"{cleaned}-{digest}" if cleaned else digest


def _join(root: str, *pieces: str) -> str:
    return "/".join([root.rstrip("/"), *(safe_path_piece(piece) for piece in pieces)])


def checkpoint_location(root: str, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    """``{root}/{dag_id}/{run_id}/{task_id}/{map_index}``: one location per task instance of a DAG run.

    No try number: every try, restart and clear of the same run's task instance sees the same checkpoints, and a
    new run starts empty.
    """
    if not isinstance(root, str) or not root.strip():
        raise ValueError(f"checkpoint root: expected a path or fsspec URL, got {root!r}")
    return _join(root, dag_id, run_id, task_id, str(map_index))


#: ``resume_from``'s value for "the newest complete checkpoint of this task in the DAG's earlier runs".
RESUME_LATEST: Final = "latest"


def other_run_location(checkpoint_uri: str, *, run_id: str, task_id: str, map_index: int) -> str:
    """The location of the same task instance in another run of the DAG, from this one's (a location that
    :func:`checkpoint_location` made: ``{root}/{dag_id}/{run_id}/{task_id}/{map_index}``)."""
    dag_folder = runs_folder(checkpoint_uri)
    return "/".join([dag_folder, *(safe_path_piece(piece) for piece in (run_id, task_id, str(map_index)))])


def runs_folder(checkpoint_uri: str) -> str:
    """``{root}/{dag_id}``: the folder of every run's locations, from one of them."""
    parts = checkpoint_uri.rstrip("/").rsplit("/", 3)
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"{checkpoint_uri!r} is not a location of [torch_elastic] checkpoint_root's layout")
    return parts[0]


def result_location(root: str, task: TaskContext) -> str:
    """``{root}/{dag_id}/{run_id}/{task_id}/{map_index}/{try_number}/result.json``: one file per try."""
    if not isinstance(root, str) or not root.strip():
        raise ValueError(f"result storage: expected an fsspec URL or a path, got {root!r}")
    folder = _join(root, task.dag_id, task.run_id, task.task_id, str(task.map_index), str(task.try_number))
    return f"{folder}/{RESULT_FILE_NAME}"


def artifact_location(root: str, task: TaskContext) -> str:
    """``{root}/{dag_id}/{run_id}/{task_id}/{map_index}/{try_number}/artifacts``: one folder per try, beside its
    result file when both storages are the same. A try's artifacts are accepted only from here."""
    if not isinstance(root, str) or not root.strip():
        raise ValueError(f"artifact storage: expected an fsspec URL or a path, got {root!r}")
    folder = _join(root, task.dag_id, task.run_id, task.task_id, str(task.map_index), str(task.try_number))
    return f"{folder}/{ARTIFACTS_FOLDER}"

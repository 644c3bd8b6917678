"""The ``[torch_elastic]`` Airflow options a task reads, in one place.

A task reads them once (:meth:`Settings.read`, at the start of ``execute``, of ``execute_complete`` and of
``render_manifests``) and passes the result down, so that one try never sees two values of one option and every
error names the option and its environment variable. The DAG-parse checks read only the options they need
(:func:`read_image`, :func:`read_execution_option`, :func:`read_job_kind_option`): a parse must stay cheap, and an
option that only a run uses must not fail the parse. The extra links read their URL templates themselves
(:func:`url_template`): they run in the API server, long after the task; so do the UI plugin
(:func:`read_ui_kubernetes_conn_id`) and the preflight (:func:`read_image_option`).

Every option is declared in :mod:`airflow_provider_torchelastic.options`, with its default; every read goes through
:func:`_get`, which refuses a name declared nowhere. Nothing here is read at import: ``airflow.sdk.configuration`` is
imported inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from airflow.sdk.exceptions import AirflowFailException

# From the core, not from kubernetes.kinds (which re-exports it): the kinds' table imports every kind's renderer and
# decisions, and the operator imports this module at every parse.
from airflow_provider_torchelastic.core.choices import BACKENDS, EXECUTIONS, JOB_KIND_CHOICES, executions_expected
from airflow_provider_torchelastic.core.validation import check_image
from airflow_provider_torchelastic.options import DECLARED, Option
from airflow_provider_torchelastic.options import SECTION as SECTION

__all__ = [
    "SECTION",
    "DEFAULT_EARLY_EVENT_HOLD",
    "DEFAULT_RESULT_MAX_BYTES",
    "EXECUTIONS",
    "ArtifactStorage",
    "ResultStorage",
    "Settings",
    "read_artifact_storage",
    "read_execution",
    "read_execution_option",
    "read_image",
    "read_image_option",
    "read_job_kind_option",
    "read_retry_memory_max",
    "read_ui_kubernetes_conn_id",
    "url_template",
]

#: ``[torch_elastic] result_storage_max_bytes`` when unset: 1 GiB, a bound on what one read may hold in memory.
DEFAULT_RESULT_MAX_BYTES: Final = int(DECLARED["result_storage_max_bytes"].default)
#: ``[torch_elastic] early_event_hold`` when unset: seconds after the deferral before the trigger may fire (see
#: :attr:`Settings.early_event_hold`).
DEFAULT_EARLY_EVENT_HOLD: Final = float(DECLARED["early_event_hold"].default)
#: ``[torch_elastic] job_lease`` when unset: seconds a job of a task without ``execution_timeout`` lives past its
#: waiter's last renewal (see :attr:`Settings.job_lease`).
DEFAULT_JOB_LEASE: Final = float(DECLARED["job_lease"].default)
#: The shortest lease: a waiter renews it at half its length, and must get to it between polls and through a
#: triggerer restart.
MIN_JOB_LEASE: Final = 300.0
#: The option with the image of tasks that name none themselves (env AIRFLOW__TORCH_ELASTIC__IMAGE).
IMAGE_OPTION: Final = "image"
#: What runs a multi-node task on Kubernetes: ``auto`` (ask the cluster), ``pytorchjob`` or ``trainjob``.
JOB_KIND_OPTION: Final = "job_kind"
JOB_KINDS: Final = JOB_KIND_CHOICES
#: ``[torch_elastic] job_kind`` when unset or empty.
DEFAULT_JOB_KIND: Final = DECLARED[JOB_KIND_OPTION].default


def _env(option: str) -> str:
    return f"AIRFLOW__{SECTION.upper()}__{option.upper()}"


def _conf() -> Any:
    # Imported when read, never at import: DAG files import the operator at every parse.
    from airflow.sdk.configuration import conf

    return conf


def _declared(name: str) -> Option:
    try:
        return DECLARED[name]
    except KeyError:
        raise KeyError(
            f"[{SECTION}] {name} is not a declared option: declare it in airflow_provider_torchelastic/options.py "
            "(type, default, description) before reading it, or read one of "
            f"{', '.join(sorted(DECLARED))}"
        ) from None


def _get(name: str) -> str:
    """The option ``name`` as configured, else its declared default; the one place an option is read.

    A name :mod:`~airflow_provider_torchelastic.options` does not declare is a ``KeyError`` naming it: Airflow
    neither documents nor defaults an undeclared option, so reading one is a bug here, not a user's mistake.
    """
    option = _declared(name)
    return str(_conf().get(SECTION, name, fallback=option.default) or "")


def _text(name: str) -> str:
    return _get(name).strip()


def _boolean(name: str) -> bool:
    raw = _get(name)
    # The spellings (and the trailing comment) Airflow's conf.getboolean accepts: a value that worked there still
    # does, and an invalid one fails the task naming the env var, which Airflow's own message does not.
    value = raw.split("#")[0].strip().lower()
    if value in ("t", "true", "1"):
        return True
    if value in ("f", "false", "0"):
        return False
    raise AirflowFailException(f"[{SECTION}] {name}: expected True or False, got {raw!r} (env {_env(name)})")


def read_image_option() -> str | None:
    """``[torch_elastic] image`` as written, unchecked; None when unset. The preflight's smoke job runs it, and
    reports an invalid one as its own failed row."""
    return _get(IMAGE_OPTION) or None


def read_image() -> str | None:
    """``[torch_elastic] image``, the image of tasks that name none themselves; read when called, never at import.

    Raises the ``ValueError`` of the image check (naming the option): the DAG-parse checks call it.
    """
    value = read_image_option()
    check_image("", f"[{SECTION}] {IMAGE_OPTION}", value)
    return value


def read_execution_option() -> str:
    """``[torch_elastic] execution`` as written, unchecked: the DAG-parse checks only ask whether it is ``local``."""
    return _get("execution")


def read_ui_kubernetes_conn_id() -> str:
    """``[torch_elastic] ui_kubernetes_conn_id``: the connection of the UI's pages (read by the api-server)."""
    return _get("ui_kubernetes_conn_id")


def read_job_kind_option() -> str:
    """``[torch_elastic] job_kind`` (``auto`` when unset), checked: the DAG-parse checks read it, since a kind known
    at parse time is checked then (``trainjob`` with a config a TrainJob cannot run is a parse error)."""
    value = _get(JOB_KIND_OPTION) or DEFAULT_JOB_KIND
    if value not in JOB_KINDS:
        expected = ", ".join(map(repr, JOB_KINDS))
        raise ValueError(
            f"[{SECTION}] {JOB_KIND_OPTION}: expected one of {expected}, got {value!r} (env {_env(JOB_KIND_OPTION)})"
        )
    return value


def read_retry_memory_max() -> int:
    """``[torch_elastic] retry_memory_max`` in bytes: the cap of ``retry_resources`` where no LimitRange sets one."""
    from airflow_provider_torchelastic.core.retry_resources import memory_bytes

    raw = _text("retry_memory_max") or _declared("retry_memory_max").default
    size = memory_bytes(raw)
    if not size:
        raise AirflowFailException(
            f"[{SECTION}] retry_memory_max: expected a memory quantity such as '64Gi', got {raw!r} "
            f"(env {_env('retry_memory_max')})"
        )
    return size


def url_template(name: str) -> str:
    """``[torch_elastic] dashboard_url_template`` or ``logs_url_template``; empty when unset."""
    return _get(name)


@dataclass(frozen=True, kw_only=True)
class ResultStorage:
    """``[torch_elastic] result_storage*``: where results too large for a termination message go. With
    ``result_storage`` unset, the artifact storage's URL and connection (:func:`read_artifact_storage`): a value whose
    artifact references alone outgrow the termination message (a state dict of a few hundred tensors) still arrives
    when only ``artifact_storage`` is set."""

    url: str
    conn_id: str | None
    keep: bool
    #: ``result_storage_max_bytes``: the most the Airflow side reads of one result (a bigger one fails the try).
    max_bytes: int = DEFAULT_RESULT_MAX_BYTES


@dataclass(frozen=True, kw_only=True)
class ArtifactStorage:
    """``[torch_elastic] artifact_storage*``: where tensors, state dicts, Modules and arrays of rank 0's value go,
    and arguments too large for the payload; each option defaults to its ``result_storage`` counterpart."""

    url: str
    #: The connection the Airflow side reads (``artifacts.load``) and writes (spilled arguments) with.
    conn_id: str | None


def read_artifact_storage() -> ArtifactStorage | None:
    """``[torch_elastic] artifact_storage`` and ``artifact_storage_conn_id``, else ``result_storage`` and
    ``result_storage_conn_id``; None when neither storage is set."""
    url = _text("artifact_storage") or _text("result_storage")
    if not url:
        return None
    return ArtifactStorage(
        url=url, conn_id=_text("artifact_storage_conn_id") or _text("result_storage_conn_id") or None
    )


def read_execution() -> str:
    """``[torch_elastic] execution``, checked: ``kubernetes`` (the default) or ``local``."""
    value = read_execution_option()
    if value not in BACKENDS:
        raise AirflowFailException(
            f"[{SECTION}] execution: expected {executions_expected()}, got {value!r} (env {_env('execution')})"
        )
    return value


def _seconds(name: str) -> float | None:
    """A ``seconds >= 0`` option; None when set empty."""
    raw = _text(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise AirflowFailException(f"[{SECTION}] {name}: expected seconds >= 0, got {raw!r} (env {_env(name)})")
    return value


def _max_bytes(name: str) -> int:
    """A ``bytes >= 1`` option; its declared default when set empty."""
    raw = _text(name) or _declared(name).default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise AirflowFailException(f"[{SECTION}] {name}: expected bytes >= 1, got {raw!r} (env {_env(name)})")
    return value


def _result_storage() -> ResultStorage | None:
    url, conn_id = _text("result_storage"), _text("result_storage_conn_id") or None
    if not url:
        # Each storage defaults to the other: rank 0's references to its artifacts are JSON like any result, and
        # may be as large (a few hundred tensors make more than 4096 bytes of references).
        artifacts = read_artifact_storage()
        if artifacts is None:
            return None
        url, conn_id = artifacts.url, artifacts.conn_id
    return ResultStorage(
        url=url,
        conn_id=conn_id,
        keep=_boolean("result_storage_keep"),
        max_bytes=_max_bytes("result_storage_max_bytes"),
    )


def _early_event_hold() -> float:
    value = _seconds("early_event_hold")
    return DEFAULT_EARLY_EVENT_HOLD if value is None else value


def _job_lease() -> float:
    value = _seconds("job_lease")
    if value is None:
        return DEFAULT_JOB_LEASE
    if value < MIN_JOB_LEASE:
        raise AirflowFailException(
            f"[{SECTION}] job_lease: expected seconds >= {MIN_JOB_LEASE:.0f}, got {_text('job_lease')!r} "
            f"(env {_env('job_lease')})"
        )
    return value


def _job_kind() -> str:
    try:
        return read_job_kind_option()
    except ValueError as e:
        raise AirflowFailException(str(e)) from e


def _configured_image() -> str | None:
    try:
        return read_image()
    except (ValueError, TypeError) as e:
        # At run time a wrong deployment option fails the task without spending its retries.
        raise AirflowFailException(f"{e} (env {_env(IMAGE_OPTION)})") from e


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every ``[torch_elastic]`` option a task reads while it runs, read once and checked."""

    #: ``execution``: ``kubernetes`` or ``local`` (the task's own, else the option).
    execution: str
    #: ``deferrable``: whether a Kubernetes task releases its worker slot while the job runs (the task's own, else
    #: the option).
    deferrable: bool
    #: ``image``: the last resort for a pod's image (Kubernetes only).
    image: str | None
    #: ``checkpoint_root``: the root of every task's checkpoint location.
    checkpoint_root: str | None
    #: ``result_storage``, ``result_storage_conn_id``, ``result_storage_keep``, ``result_storage_max_bytes``
    #: (``result_storage`` unset: ``artifact_storage`` and its connection).
    result_storage: ResultStorage | None
    #: ``artifact_storage``, ``artifact_storage_conn_id`` (defaults: the ``result_storage`` options).
    artifact_storage: ArtifactStorage | None = None
    #: ``report_interval``: seconds between rank 0's metrics lines; None: ``report()``'s default.
    report_interval: float | None
    #: ``early_event_hold``: a deferred task's trigger fires no sooner than this many seconds after the deferral.
    #: Airflow 3.3 can fail a resumed try whose trigger fired before the scheduler processed the executor's report
    #: of the deferral (apache/airflow#67287, #72716): a job that ends within seconds of its submission would lose
    #: its try. 0 turns the hold off (an Airflow with those fixed). Read for deferrable tasks only.
    early_event_hold: float = DEFAULT_EARLY_EVENT_HOLD
    #: ``job_lease``: the backstop for the job of a task without ``execution_timeout``, whose try has no deadline.
    #: The job is created with a lease this long, its waiter (worker or trigger) renews it while it waits, and the
    #: sweep deletes a job whose lease ran out (no waiter renewed it: the try is gone). Read on Kubernetes only.
    job_lease: float = DEFAULT_JOB_LEASE
    #: ``job_kind``: what runs a multi-node task (the task's own, else the option); read on Kubernetes only.
    job_kind: str = DEFAULT_JOB_KIND

    @classmethod
    def read(
        cls, *, execution: str | None = None, deferrable: bool | None = None, job_kind: str | None = None
    ) -> Settings:
        """The options as configured now; an invalid one raises ``AirflowFailException`` naming it and its env var
        (a retry reads the same configuration).

        ``execution`` and ``deferrable`` are the task's own choices: an option the task overrides is not read, and
        ``image`` is read for Kubernetes only, so that an option the task does not use cannot fail it.
        """
        execution = execution if execution is not None else read_execution()
        if deferrable is None:
            deferrable = execution == "kubernetes" and _boolean("deferrable")
        if job_kind is None:
            job_kind = _job_kind() if execution == "kubernetes" else DEFAULT_JOB_KIND
        return cls(
            execution=execution,
            deferrable=deferrable,
            image=_configured_image() if execution == "kubernetes" else None,
            checkpoint_root=_text("checkpoint_root") or None,
            result_storage=_result_storage(),
            artifact_storage=read_artifact_storage(),
            report_interval=_seconds("report_interval"),
            early_event_hold=_early_event_hold() if deferrable else DEFAULT_EARLY_EVENT_HOLD,
            job_lease=_job_lease() if execution == "kubernetes" else DEFAULT_JOB_LEASE,
            job_kind=job_kind,
        )

"""``TorchElasticOperator``: run a Python training function under torch elastic as one Airflow task.

Importing this module (what a DAG file does at every parse) imports Airflow's SDK but neither torch nor the
kubernetes client: those are imported inside ``execute``.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Final

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.definitions.mappedoperator import MappedOperator, OperatorPartial
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_torchelastic.core.config import Elastic, TaskConfig, check_task_config
from airflow_provider_torchelastic.core.launch import config_to_launch_spec
from airflow_provider_torchelastic.core.naming import RunIdentity, placeholder_identity
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.payload import dump_payload
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.core.run_context import TaskContext, checkpoint_location, result_location
from airflow_provider_torchelastic.core.validation import check_image, check_seconds, fail, is_templated
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.render import (
    check_renderable,
    elide_payload,
    render_manifests,
    summarize_for_ui,
    task_context_for,
)
from airflow_provider_torchelastic.kubernetes.status import (
    FINISH_ACTIONS,
    JobRef,
    WaitDecision,
    WaitPolicy,
    is_suspended,
    queue_name,
)

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.definitions._internal.expandinput import ExpandInput
    from airflow.sdk.types import TaskInstanceKey

    from airflow_provider_torchelastic.core.launch import LaunchSpec
    from airflow_provider_torchelastic.core.summary import JobSummary
    from airflow_provider_torchelastic.core.tap import MetricsTap
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.local.run import LocalRun

__all__ = ["TorchElasticOperator", "TrainingFailedError", "TrainingRecoverableError"]

EXECUTIONS: Final = ("kubernetes", "local")
CONFIG_SECTION: Final = "torch_elastic"
#: task_state_store key of the job this try created; survives a worker crash so the same try re-attaches.
STATE_KEY: Final = "torchelastic_job"
#: XCom keys pushed before deferring (extra links read them, so they survive deferral).
XCOM_JOB_NAME: Final = "job_name"
XCOM_JOB_NAMESPACE: Final = "job_namespace"
XCOM_JOB_KIND: Final = "job_kind"
XCOM_MANIFESTS: Final = "manifests"
#: The Airflow option with the image of tasks that name none themselves (env AIRFLOW__TORCH_ELASTIC__IMAGE).
IMAGE_OPTION: Final = "image"


class TrainingRecoverableError(AirflowException):
    """Training (or waiting for it) failed in a way a retry may fix (``RecoverableError``, out of memory, eviction,
    an unreachable API): Airflow retries. The exception tree: :mod:`airflow_provider_torchelastic.errors`."""


class TrainingFailedError(AirflowFailException):
    """Training failed in a way a retry will not fix: the task fails without using its retries."""


def _link_from_template(option: str, ti_key: TaskInstanceKey) -> str:
    from airflow.sdk.configuration import conf
    from airflow.sdk.execution_time.xcom import XCom

    template = conf.get(CONFIG_SECTION, option, fallback="")
    if not template:
        return ""
    name = XCom.get_value(key=XCOM_JOB_NAME, ti_key=ti_key)
    namespace = XCom.get_value(key=XCOM_JOB_NAMESPACE, ti_key=ti_key)
    kind = XCom.get_value(key=XCOM_JOB_KIND, ti_key=ti_key)
    if not name:
        return ""
    return str(template).format(name=name, namespace=namespace, kind=kind or "PyTorchJob")


class TorchElasticJobLink(BaseOperatorLink):
    """The job in a dashboard: ``[torch_elastic] dashboard_url_template`` with {namespace}, {name}, {kind}."""

    name = "Training job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _link_from_template("dashboard_url_template", ti_key)


class TorchElasticLogsLink(BaseOperatorLink):
    """The job's pod logs in a log system: ``[torch_elastic] logs_url_template`` with {namespace}, {name}, {kind}."""

    name = "Training logs"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _link_from_template("logs_url_template", ti_key)


def _check_execution(value: object) -> str | None:
    if value is None or value in EXECUTIONS:
        return value
    raise ValueError(
        f"execution: expected 'kubernetes' or 'local' (or None for [torch_elastic] execution), got {value!r}"
    )


# --- parse-time checks ------------------------------------------------------------------------------------------

_NAMESPACE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_NAMESPACE_EXPECTED: Final = "a namespace name (a lowercase DNS-1123 label), a template, or None for the connection's"


def configured_image() -> str | None:
    """``[torch_elastic] image``, the image of tasks that name none themselves; read when called, never at import."""
    from airflow.sdk.configuration import conf

    value = conf.get(CONFIG_SECTION, IMAGE_OPTION, fallback="") or None
    check_image("", f"[{CONFIG_SECTION}] {IMAGE_OPTION}", value)
    return value


def check_checkpoint_uri(value: object) -> str:
    """``checkpoint_uri``: a non-empty path or fsspec URL (or a template of one), without surrounding spaces."""
    expected = "a path or fsspec URL (s3://bucket/prefix, file:///mnt/ckpt, /mnt/ckpt), a template, or None"
    if not isinstance(value, str):
        raise fail("", "checkpoint_uri", value, expected, TypeError)
    if not value or value != value.strip():
        raise fail("", "checkpoint_uri", value, expected)
    return value


def configured_checkpoint_root() -> str | None:
    """``[torch_elastic] checkpoint_root``: the root of every task's checkpoint location; None when unset."""
    from airflow.sdk.configuration import conf

    return conf.get(CONFIG_SECTION, "checkpoint_root", fallback="").strip() or None


@dataclass(frozen=True, kw_only=True)
class ResultStorage:
    """``[torch_elastic] result_storage*``: where results too large for a termination message go."""

    url: str
    conn_id: str | None
    keep: bool


def configured_result_storage() -> ResultStorage | None:
    from airflow.sdk.configuration import conf

    url = conf.get(CONFIG_SECTION, "result_storage", fallback="").strip()
    if not url:
        return None
    return ResultStorage(
        url=url,
        conn_id=conf.get(CONFIG_SECTION, "result_storage_conn_id", fallback="").strip() or None,
        keep=conf.getboolean(CONFIG_SECTION, "result_storage_keep", fallback=False),
    )


def read_stored_result(url: str, storage: ResultStorage | None) -> Any:
    """Rank 0's value written to result storage: JSON, read with Airflow's ``ObjectStoragePath`` (the connection
    ``[torch_elastic] result_storage_conn_id`` holds the credentials), then deleted unless
    ``[torch_elastic] result_storage_keep``. Never unpickled."""
    from airflow.sdk import ObjectStoragePath

    from airflow_provider_torchelastic.core.outcome import decode_result

    conn_id = storage.conn_id if storage is not None else None
    path = ObjectStoragePath(url if "://" in url else f"file://{url}", conn_id=conn_id)
    value = decode_result(path.read_bytes())
    if storage is None or not storage.keep:
        path.unlink(missing_ok=True)
    return value


def configured_report_interval() -> float | None:
    """``[torch_elastic] report_interval``: seconds between rank 0's metrics lines; None when unset (the default of
    ``report()`` applies)."""
    from airflow.sdk.configuration import conf

    raw = str(conf.get(CONFIG_SECTION, "report_interval", fallback="") or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise AirflowFailException(
            f"[{CONFIG_SECTION}] report_interval: expected seconds >= 0, got {raw!r} "
            "(env AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL)"
        )
    return value


def _metrics_env() -> dict[str, str]:
    """The workers' env for local execution: the metrics interval, as rendered into pods."""
    from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV

    interval = configured_report_interval()
    return {} if interval is None else {INTERVAL_ENV: f"{interval:g}"}


def _local_summary(
    identity: RunIdentity, spec: LaunchSpec, run: LocalRun, verdict: Verdict, tap: MetricsTap, started: float
) -> JobSummary:
    import socket

    from airflow_provider_torchelastic.core.naming import job_name
    from airflow_provider_torchelastic.core.summary import local_job_summary

    nproc = str(spec.nproc_per_node)
    return local_job_summary(
        # The name the try's job would have on Kubernetes: unique per try, and the same key for the UI.
        name=job_name(identity),
        reports=run.reports,
        succeeded=verdict.succeeded,
        root_cause=verdict.detail,
        created=started,
        finished=time.time(),
        nproc_per_node=int(nproc) if nproc.isdigit() else None,
        hostname=socket.gethostname(),
        tails=tap.tails(),
        series=tap.series,
    )


def _configured_execution() -> str:
    from airflow.sdk.configuration import conf

    return str(conf.get(CONFIG_SECTION, "execution", fallback="kubernetes"))


@dataclass(frozen=True, kw_only=True)
class CheckedArguments:
    """The operator's arguments as ``check_operator_arguments`` normalized them."""

    task_config: TaskConfig
    execution: str | None
    poll_interval: float
    pending_grace_seconds: float
    scheduling_timeout: float | None


def check_operator_arguments(
    *,
    python_callable: Callable[..., Any],
    op_args: Collection[Any] | None = None,
    op_kwargs: Mapping[str, Any] | None = None,
    task_config: TaskConfig | None = None,
    execution: str | None = None,
    image: str | None = None,
    namespace: str | None = None,
    kubernetes_conn_id: str = "kubernetes_default",
    pod_options: PodOptions | None = None,
    job_options: JobOptions | None = None,
    deferrable: bool | None = None,
    poll_interval: float = 10.0,
    pending_grace_seconds: float = 120.0,
    on_finish_action: str = "delete_succeeded",
    scheduling_timeout: float | None = None,
    checkpoint_uri: str | None = None,
    dag_id: str = "dag",
    task_id: str = "task",
    known_at_run_time: Collection[str] = (),
) -> CheckedArguments:
    """Every check of ``TorchElasticOperator``'s arguments that can run while the DAG file is parsed.

    The constructor calls it, and so does the expansion of a mapped task (``TorchElasticOperator.partial(...)
    .expand(...)``, ``@task.torch_elastic`` with ``.expand``), which Airflow builds without running ``__init__``.
    ``known_at_run_time`` names the arguments whose values only the run knows (mapped ones): they are skipped here
    and checked by ``__init__`` when the mapped task is expanded at run time.

    On Kubernetes (``execution="kubernetes"``, or None with ``[torch_elastic] execution`` not ``local`` where the
    DAG is parsed) the task is rendered once with a placeholder run, so a conflicting customization or a pod with no
    image (none given to the operator, its replicas, its pod template or ``[torch_elastic] image``) fails now. A
    templated image, namespace or argument is accepted as it is: only the run can render it.
    """
    later = frozenset(known_at_run_time)

    def known(name: str) -> bool:
        return name not in later

    if known("python_callable") and not callable(python_callable):
        raise TypeError(f"python_callable: expected a callable, got {python_callable!r}")
    config = Elastic() if task_config is None or not known("task_config") else check_task_config(task_config)
    if known("execution"):
        execution = _check_execution(execution)
    if known("image"):
        check_image("", "image", image, templated_ok=True)
    if known("namespace") and namespace is not None and not is_templated(namespace):
        if not isinstance(namespace, str):
            raise fail("", "namespace", namespace, _NAMESPACE_EXPECTED, TypeError)
        if not _NAMESPACE.match(namespace):
            raise fail("", "namespace", namespace, _NAMESPACE_EXPECTED)
    if known("kubernetes_conn_id") and (not isinstance(kubernetes_conn_id, str) or not kubernetes_conn_id):
        raise fail("", "kubernetes_conn_id", kubernetes_conn_id, "a connection id (a non-empty str)", TypeError)
    if known("pod_options") and pod_options is not None and not isinstance(pod_options, PodOptions):
        raise fail("", "pod_options", pod_options, "a PodOptions(...) or None", TypeError)
    if known("job_options") and job_options is not None and not isinstance(job_options, JobOptions):
        raise fail("", "job_options", job_options, "a JobOptions(...) or None", TypeError)
    if known("deferrable") and deferrable is not None and not isinstance(deferrable, bool):
        raise fail("", "deferrable", deferrable, "True, False or None (None: [torch_elastic] deferrable)", TypeError)
    poll = check_seconds("", "poll_interval", poll_interval) if known("poll_interval") else 0.0
    grace = (
        check_seconds("", "pending_grace_seconds", pending_grace_seconds, allow_zero=True)
        if known("pending_grace_seconds")
        else 0.0
    )
    if known("on_finish_action") and on_finish_action not in FINISH_ACTIONS:
        raise fail("", "on_finish_action", on_finish_action, f"one of {', '.join(map(repr, FINISH_ACTIONS))}")
    if known("checkpoint_uri") and checkpoint_uri is not None:
        check_checkpoint_uri(checkpoint_uri)
    capacity = None
    if known("scheduling_timeout") and scheduling_timeout is not None:
        capacity = check_seconds("", "scheduling_timeout", scheduling_timeout)
    checked = CheckedArguments(
        task_config=config,
        execution=execution,
        poll_interval=poll,
        pending_grace_seconds=grace,
        scheduling_timeout=capacity,
    )

    if known("execution") and execution == "local":
        return checked  # runs on the Airflow worker: no image, nothing rendered
    if not (known("task_config") and known("pod_options") and known("job_options")):
        return checked  # what would be rendered is known only at run time
    # Whether the pods need an image from what is known here: the run's own configuration decides execution=None,
    # but a DAG parsed where Kubernetes is the default must not wait for the run to find that it names no image.
    on_kubernetes = known("execution") and (execution == "kubernetes" or _configured_execution() != "local")
    image_now = image if known("image") and not is_templated(image) else None
    check_renderable(
        config,
        image=image_now,
        pod_options=pod_options,
        job_options=job_options,
        dag_id=dag_id,
        task_id=task_id,
        default_image=configured_image(),
        # A templated or mapped image reaches every pod at run time.
        require_image=on_kubernetes and known("image") and not is_templated(image),
    )
    return checked


#: The arguments ``check_operator_arguments`` knows, in the order of ``TorchElasticOperator.__init__``.
_ARGUMENTS: Final = (
    "python_callable",
    "op_args",
    "op_kwargs",
    "task_config",
    "execution",
    "image",
    "namespace",
    "kubernetes_conn_id",
    "pod_options",
    "job_options",
    "deferrable",
    "poll_interval",
    "pending_grace_seconds",
    "on_finish_action",
    "scheduling_timeout",
    "checkpoint_uri",
)


def check_mapped_arguments(kwargs: Mapping[str, Any], *, mapped: Collection[str] | None) -> None:
    """``check_operator_arguments`` for a mapped task, from the arguments given to ``partial`` (or the decorator).

    ``mapped`` names the expanded arguments, or is None when they are not known before the run (``expand_kwargs``
    with an XCom): then every argument not given is left to run time. The DAG's and task group's ``default_args``
    fill what was not given, as they do for the operator the run creates.
    """
    from airflow.sdk.bases.operator import get_merged_defaults

    defaults, _ = get_merged_defaults(kwargs.get("dag"), kwargs.get("task_group"), None, None)
    given = {
        name: kwargs[name] if name in kwargs else defaults[name]
        for name in _ARGUMENTS
        if (name in kwargs or name in defaults) and (mapped is None or name not in mapped)
    }
    later = set(_ARGUMENTS) - set(given) if mapped is None else set(mapped) & set(_ARGUMENTS)
    task_id = kwargs.get("task_id")
    dag = kwargs.get("dag")
    check_operator_arguments(
        **{"python_callable": None, **given},
        dag_id=getattr(dag, "dag_id", None) or "dag",
        task_id=task_id if isinstance(task_id, str) and task_id else "task",
        known_at_run_time=later,
    )


def _mapped_names(expand_input: ExpandInput) -> frozenset[str] | None:
    """The argument names an expansion maps, or None when only the run knows them (an XCom of dicts)."""
    value = expand_input.value
    if isinstance(value, Mapping):
        return frozenset(value)
    if isinstance(value, list) and all(isinstance(item, Mapping) for item in value):
        return frozenset(name for item in value for name in item)
    return None


class _CheckedOperatorPartial(OperatorPartial):
    """What ``TorchElasticOperator.partial(...)`` returns: Airflow's ``OperatorPartial``, whose expansion (``expand``
    and ``expand_kwargs`` both end here) first checks every argument that is not mapped."""

    __slots__ = ()

    def _expand(self, expand_input: ExpandInput, *, strict: bool) -> MappedOperator:
        self._expand_called = True  # as Airflow's own: a failed expansion is an error, not also "never mapped"
        check_mapped_arguments(self.kwargs, mapped=_mapped_names(expand_input))
        return OperatorPartial._expand(self, expand_input, strict=strict)


# --- render_manifests() without a run ---------------------------------------------------------------------------

#: Stands in for an image that only the run can render (``.invalid`` is a reserved domain: it is never pulled).
UNRENDERED_IMAGE: Final = "image.invalid/rendered-at-run-time:placeholder"
_UNRENDERED_NAMESPACE: Final = "default"


def _placeholder_context(op: BaseOperator, identity: RunIdentity) -> dict[str, Any]:
    """A minimal template context for a task outside a run: what the placeholder identity, the DAG and the task
    know, and Variables that can be read here (environment, secrets backends). No XComs, dates or connections."""
    from airflow.sdk.execution_time.context import VariableAccessor

    ti = SimpleNamespace(
        dag_id=identity.dag_id,
        task_id=identity.task_id,
        run_id=identity.run_id,
        map_index=identity.map_index,
        try_number=identity.try_number,
    )
    params = op.params.dump() if hasattr(op.params, "dump") else dict(op.params or {})
    return {
        "dag": op.dag if op.has_dag() else None,
        "task": op,
        "ti": ti,
        "task_instance": ti,
        "run_id": identity.run_id,
        "params": params,
        "var": {"value": VariableAccessor(deserialize_json=False), "json": VariableAccessor(deserialize_json=True)},
    }


def _render_template_fields(
    op: BaseOperator, names: Sequence[str], context: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``names`` rendered with ``context``, without changing ``op``; and why each field that failed could not be."""
    import jinja2
    import jinja2.sandbox

    if op.has_dag():
        env = op.get_template_env()
    else:  # the SDK's DAG-less default renders an undefined name as "": here it must say so
        env = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined, cache_size=0)
    rendered: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name in names:
        value = getattr(op, name)
        if name not in op.template_fields or value is None:
            rendered[name] = value
            continue
        try:
            rendered[name] = op.render_template(value, context, env)  # type: ignore[arg-type]
        except Exception as e:  # any template error: the field is named, never fatal here
            failed[name] = f"{type(e).__name__}: {e}"
            rendered[name] = value
    return rendered, failed


class TorchElasticOperator(BaseOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on every worker of a torch elastic job.

    Rank 0's return value (JSON-serializable) becomes the task's ``return_value`` XCom.

    :param python_callable: the training function. It runs in fresh worker processes (and, on Kubernetes, in pods
        where the DAG file does not exist): it and the helpers defined beside it are shipped by value.
    :param op_args: positional arguments (templated).
    :param op_kwargs: keyword arguments (templated).
    :param task_config: ``Elastic(...)`` (default: one node, one worker) or ``PyTorch(...)``.
    :param execution: ``"local"`` (subprocesses on the Airflow worker) or ``"kubernetes"``; default: the Airflow
        option ``[torch_elastic] execution``, itself ``kubernetes`` by default.
    :param image: the training image on Kubernetes (Python, torch, cloudpickle and this package; see docker/);
        templated. A replica's own image wins over it; without it, the pod template's ``pytorch`` container's image,
        else the Airflow option ``[torch_elastic] image``. A Kubernetes task with none fails when the DAG is parsed.
    :param namespace: Kubernetes namespace; default: the connection's, else ``default``.
    :param kubernetes_conn_id: the cncf.kubernetes connection to the cluster.
    :param pod_options: pod customization (env, secrets, GPUs, tolerations, volumes, a full pod template...).
    :param job_options: PyTorchJob-only settings (``schedulingPolicy``, ``suspend``).
    :param deferrable: release the worker slot while the job runs; default ``[torch_elastic] deferrable`` (True).
    :param poll_interval: seconds between status polls on Kubernetes.
    :param pending_grace_seconds: fail once a pod is stuck on something that never resolves by itself (image pull,
        invalid image, container config such as a missing Secret) this long.
    :param scheduling_timeout: seconds the job may wait for capacity (pods Unschedulable before it can start, a
        suspended or Kueue-queued job) before the task fails as recoverable; default None: until
        ``execution_timeout``. Pods of an elastic job beyond its minimum never count: it runs on what it got.
    :param on_finish_action: ``delete_succeeded`` (default), ``delete`` or ``keep`` the job once it ended.
    :param checkpoint_uri: this task's checkpoint location (a path or fsspec URL; templated), in place of
        ``{[torch_elastic] checkpoint_root}/{dag_id}/{run_id}/{task_id}/{map_index}``. The workers read it from
        ``context.current().checkpoint_uri``; the ``checkpoint`` helpers use it.
    """

    operator_extra_links = (TorchElasticJobLink(), TorchElasticLogsLink())
    # The manifest is built in execute(); show it in the rendered-template view of the run, not the parse-time one.
    overwrite_rtif_after_execution = True

    template_fields: Sequence[str] = ("op_args", "op_kwargs", "image", "namespace", "checkpoint_uri", "rendered_job")
    template_fields_renderers: ClassVar[dict[str, str]] = {"op_args": "py", "op_kwargs": "py", "rendered_job": "yaml"}
    # The callable may hold objects that cannot be deep-copied (Airflow copies operators when it maps tasks).
    shallow_copy_attrs: Sequence[str] = ("python_callable",)
    ui_color = "#ee4c2c"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        task_config: TaskConfig | None = None,
        execution: str | None = None,
        image: str | None = None,
        namespace: str | None = None,
        kubernetes_conn_id: str = "kubernetes_default",
        pod_options: PodOptions | None = None,
        job_options: JobOptions | None = None,
        deferrable: bool | None = None,
        poll_interval: float = 10.0,
        pending_grace_seconds: float = 120.0,
        on_finish_action: str = "delete_succeeded",
        scheduling_timeout: float | None = None,
        checkpoint_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # One set of checks for this constructor and for mapped tasks (see partial() and the decorator's expand).
        checked = check_operator_arguments(
            python_callable=python_callable,
            task_config=task_config,
            execution=execution,
            image=image,
            namespace=namespace,
            kubernetes_conn_id=kubernetes_conn_id,
            pod_options=pod_options,
            job_options=job_options,
            deferrable=deferrable,
            poll_interval=poll_interval,
            pending_grace_seconds=pending_grace_seconds,
            on_finish_action=on_finish_action,
            scheduling_timeout=scheduling_timeout,
            checkpoint_uri=checkpoint_uri,
            dag_id=self.dag_id,
            task_id=self.task_id,
        )
        self.python_callable = python_callable
        self.op_args: Collection[Any] = list(op_args or [])
        self.op_kwargs: Mapping[str, Any] = dict(op_kwargs or {})
        self.task_config: TaskConfig = checked.task_config
        self.execution = checked.execution
        self.image = image
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.pod_options = pod_options
        self.job_options = job_options
        self.deferrable = deferrable
        self.poll_interval = checked.poll_interval
        self.pending_grace_seconds = checked.pending_grace_seconds
        self.scheduling_timeout = checked.scheduling_timeout
        self.on_finish_action = on_finish_action
        self.checkpoint_uri = checkpoint_uri
        self.rendered_job: str | None = None
        self._local_run: LocalRun | None = None
        self._job: JobRef | None = None

    @classmethod
    def partial(cls, **kwargs: Any) -> OperatorPartial:
        """Airflow's ``partial``, whose ``expand``/``expand_kwargs`` also run the constructor's parse-time checks
        (a mapped task is built without calling ``__init__`` until it runs)."""
        plain = super().partial(**kwargs)
        checked = _CheckedOperatorPartial(operator_class=plain.operator_class, kwargs=plain.kwargs, params=plain.params)
        # ``plain`` is replaced, not forgotten by the user: keep it from warning "never mapped" when collected.
        plain._expand_called = True
        return checked

    # --- execution ----------------------------------------------------------------------------------------------

    def resolve_execution(self) -> str:
        """The execution mode: the operator's own, else ``[torch_elastic] execution`` (read at run time)."""
        if self.execution is not None:
            return self.execution
        from airflow.sdk.configuration import conf

        value: str = conf.get(CONFIG_SECTION, "execution", fallback="kubernetes")
        if value not in EXECUTIONS:
            raise AirflowFailException(
                f"[{CONFIG_SECTION}] execution: expected 'kubernetes' or 'local', got {value!r} "
                "(env AIRFLOW__TORCH_ELASTIC__EXECUTION)"
            )
        return value

    def execute(self, context: Context) -> Any:
        execution = self.resolve_execution()
        payload = dump_payload(self.python_callable, self.op_args, self.op_kwargs)
        self.log.info(
            "Running %s with %s (%s execution), payload %d bytes",
            getattr(self.python_callable, "__qualname__", self.python_callable),
            self.task_config,
            execution,
            len(payload),
        )
        if execution == "local":
            return self._execute_locally(context, payload)
        return self._execute_on_kubernetes(context, payload)

    def _execute_locally(self, context: Context, payload: bytes) -> Any:
        from airflow_provider_torchelastic.core.tap import MetricsTap
        from airflow_provider_torchelastic.local.run import LocalRun, run_locally

        spec = config_to_launch_spec(self.task_config)
        identity = self._identity(context)
        task_context = self._task_context(identity, context, self.checkpoint_uri)
        run = self._local_run = LocalRun()
        # Rank 0's metrics lines become progress lines; the tap keeps them, and the log's tail, for the job summary.
        tap = MetricsTap(self.log.info, keep_unprefixed=True)
        started = time.time()
        try:
            verdict = run_locally(
                payload,
                spec,
                log_line=tap,
                run=run,
                task_context=task_context,
                result_url=_result_url(task_context),
                extra_env=_metrics_env(),
            )
        finally:
            self._local_run = None
        self._push_job_summary(context, _local_summary(identity, spec, run, verdict, tap, started))
        return self.result_or_raise(verdict, last_metrics=tap.summary_line())

    def _push_job_summary(self, context: Context, summary: JobSummary) -> None:
        """Save the job summary (the UI's record of a finished job) as the XCom ``torch_elastic_job``."""
        from airflow_provider_torchelastic.core.summary import XCOM_KEY

        try:
            context["ti"].xcom_push(key=XCOM_KEY, value=summary.to_dict())
        except Exception as e:  # the training's outcome stands; only the UI's record of it is missing
            self.log.warning("Could not save the job summary (XCom %r): %s", XCOM_KEY, e)

    def result_or_raise(self, verdict: Verdict, *, last_metrics: str = "") -> Any:
        """Rank 0's result, or the Airflow exception that says what failed and whether a retry can help.

        ``last_metrics`` (``MetricsTap.summary_line()``) ends the task's final log line: the last reported values.
        """
        suffix = f"; {last_metrics}" if last_metrics else ""
        if verdict.succeeded and verdict.result_ref is not None:
            try:
                value = read_stored_result(verdict.result_ref, configured_result_storage())
            except Exception as e:  # the store or its connection failed: the training is done, but its value is not
                raise TrainingRecoverableError(
                    f"Training succeeded but rank 0's result could not be read from {verdict.result_ref} "
                    f"(result storage, connection [torch_elastic] result_storage_conn_id): {type(e).__name__}: {e}"
                ) from e
            self.log.info("Training succeeded; rank 0's result read from %s%s", verdict.result_ref, suffix)
            return value
        if verdict.succeeded:
            self.log.info("Training succeeded; rank 0's result: %r%s", verdict.result, suffix)
            return verdict.result
        if verdict.failure is not None and verdict.failure.traceback:
            self.log.error("Root cause, %s, traceback:\n%s", verdict.failure.summary(), verdict.failure.traceback)
        if last_metrics:
            self.log.info("Training failed; %s", last_metrics)
        if verdict.recoverable:
            raise TrainingRecoverableError(f"Training failed, a retry may help: {verdict.detail}")
        raise TrainingFailedError(f"Training failed, a retry will not help: {verdict.detail}")

    # --- Kubernetes ----------------------------------------------------------------------------------------------

    def render_manifests(self, context: Context | None = None) -> list[dict[str, Any]]:
        """The objects this task would create, in creation order, without touching the network.

        Templated fields are rendered with ``context``; with ``context=None``, with a minimal one for a placeholder
        run (dag, task, ``ti``'s identity, params, readable Variables). A field that cannot be rendered so (it needs
        the real run: an XCom, a date, a missing Variable) is named in a ``UserWarning`` and a placeholder takes its
        place (namespace ``default``, image ``UNRENDERED_IMAGE``, the unrendered arguments in the payload): no
        ``{{ ... }}`` reaches a manifest. The payload is the real one otherwise (so its size counts). The operator
        itself is not changed.
        """
        identity = self._identity(context)
        template_context = context if context is not None else _placeholder_context(self, identity)
        rendered, failed = _render_template_fields(
            self, ("image", "namespace", "op_args", "op_kwargs", "checkpoint_uri"), template_context
        )
        image, namespace = rendered["image"], rendered["namespace"]
        if "image" in failed or is_templated(image):
            failed.setdefault("image", "it renders to another template")
            image = UNRENDERED_IMAGE
        if "namespace" in failed or is_templated(namespace):
            failed.setdefault("namespace", "it renders to another template")
            namespace = _UNRENDERED_NAMESPACE
        checkpoint_uri = rendered["checkpoint_uri"]
        if "checkpoint_uri" in failed or is_templated(checkpoint_uri):
            failed.setdefault("checkpoint_uri", "it renders to another template")
            checkpoint_uri = None
        if failed:
            placeholders = {
                "image": repr(UNRENDERED_IMAGE),
                "namespace": repr(_UNRENDERED_NAMESPACE),
                "checkpoint_uri": "the [torch_elastic] checkpoint_root location, or none",
            }
            warnings.warn(
                "render_manifests: these templated fields need the task's run and are shown with placeholders: "
                + "; ".join(
                    f"{name} ({reason}; shown as {placeholders.get(name, 'its unrendered value, in the payload')})"
                    for name, reason in failed.items()
                ),
                UserWarning,
                stacklevel=2,
            )
        payload = dump_payload(self.python_callable, rendered["op_args"], rendered["op_kwargs"])
        task_context = self._task_context(identity, context, checkpoint_uri)
        return self._render_objects(
            identity, namespace if namespace is not None else "default", payload, image=image, task_context=task_context
        )

    def _identity(self, context: Context | None) -> RunIdentity:
        if context is None:
            return placeholder_identity(self.dag_id, self.task_id)
        ti = context["ti"]
        return RunIdentity(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=ti.run_id,
            map_index=ti.map_index if ti.map_index is not None else -1,
            try_number=ti.try_number,
        )

    def _task_context(self, identity: RunIdentity, context: Context | None, checkpoint_uri: str | None) -> TaskContext:
        """What every worker of this try sees as its run context (``TORCHELASTIC_CONTEXT``): the same for every
        rendering of the try, so that a re-attaching worker renders the same manifest."""
        if checkpoint_uri is not None and (is_templated(checkpoint_uri) or not checkpoint_uri):
            raise TrainingFailedError(f"checkpoint_uri: expected a path or fsspec URL, got {checkpoint_uri!r}")
        root = configured_checkpoint_root()
        if checkpoint_uri is None and root is not None:
            checkpoint_uri = checkpoint_location(
                root,
                dag_id=identity.dag_id,
                run_id=identity.run_id,
                task_id=identity.task_id,
                map_index=identity.map_index,
            )
        # What the identity alone gives (render_manifests without a run uses the same), then what the run knows.
        task_context = replace(task_context_for(identity), checkpoint_uri=checkpoint_uri)
        if context is None:
            return task_context
        logical_date = context.get("logical_date")
        return replace(
            task_context,
            max_tries=int(getattr(context["ti"], "max_tries", 0) or 0),
            logical_date=logical_date.isoformat() if logical_date is not None else None,
        )

    def _render_objects(
        self,
        identity: RunIdentity,
        namespace: str,
        payload: bytes,
        *,
        image: str | None = None,
        task_context: TaskContext | None = None,
    ) -> list[dict[str, Any]]:
        """The manifests of one try; ``image`` (rendered) replaces the operator's when given. Where neither the
        replicas, the operator nor the pod template names an image, ``[torch_elastic] image`` (read now) does."""
        return render_manifests(
            self.task_config,
            identity=identity,
            namespace=namespace,
            image=image if image is not None else self.image,
            payload=payload,
            pod_options=self.pod_options,
            job_options=self.job_options,
            default_image=configured_image(),
            renderer=kinds.for_config(self.task_config).render,
            task_context=task_context,
            result_url=_result_url(task_context) if task_context is not None else None,
            report_interval=configured_report_interval(),
        )

    def _hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    def _policy(self, context: Context) -> WaitPolicy:
        return WaitPolicy(
            poll_interval=self.poll_interval,
            pending_grace_seconds=self.pending_grace_seconds,
            deadline=self._deadline(context),
            finish_action=self.on_finish_action,
            scheduling_timeout=self.scheduling_timeout,
        )

    def _resolve_deferrable(self) -> bool:
        if self.deferrable is not None:
            return bool(self.deferrable)
        from airflow.sdk.configuration import conf

        deferrable: bool = conf.getboolean(CONFIG_SECTION, "deferrable", fallback=True)
        return deferrable

    def _execute_on_kubernetes(self, context: Context, payload: bytes) -> Any:
        from airflow_provider_torchelastic.kubernetes.client import SyncKube
        from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job

        hook = self._hook()
        _check_one_cluster_source(self.kubernetes_conn_id, hook)
        namespace = self.namespace or hook.get_namespace() or "default"
        try:
            identity = self._identity(context)
            task_context = self._task_context(identity, context, self.checkpoint_uri)
            manifests = self._render_objects(identity, namespace, payload, task_context=task_context)
        except (ValueError, TypeError) as e:
            # A setting only known at run time (templated image, the connection's namespace, the payload's size)
            # is wrong: the same try would fail the same way, so do not spend retries on it.
            raise TrainingFailedError(f"Cannot build the Kubernetes objects for this task: {e}") from e
        configmap, workload = manifests
        ref = JobRef(kind=workload["kind"], name=workload["metadata"]["name"], namespace=namespace)
        self.rendered_job = summarize_for_ui(manifests)
        elided = [elide_payload(manifest) for manifest in manifests]
        self.log.info("Manifests to submit (payload elided):\n%s", json.dumps(elided, indent=2))
        kube = SyncKube(hook.api_client)
        ref = self._submit(kube, ref, configmap, workload, context)
        self._job = ref
        self._warn_if_it_may_queue_forever(workload)
        ti = context["ti"]
        ti.xcom_push(key=XCOM_JOB_NAME, value=ref.name)
        ti.xcom_push(key=XCOM_JOB_NAMESPACE, value=ref.namespace)
        ti.xcom_push(key=XCOM_JOB_KIND, value=ref.kind)
        ti.xcom_push(key=XCOM_MANIFESTS, value=elided)

        if self._resolve_deferrable():
            self._defer(hook, ref, context)
        from airflow_provider_torchelastic.core.tap import MetricsTap

        # Rank 0's metrics lines (in its pod's log) become progress lines; the tap keeps them for the job summary.
        tap = MetricsTap(self.log.info)
        # Waiting here: the wait core enforces execution_timeout, deletes the job when it cannot be observed, and
        # applies on_finish_action; anything else that ends the wait (SIGTERM, a bug) must not leave the job running.
        try:
            decision = drive_sync(wait_for_job(ref, self._policy(context)), kube, tap)
        except BaseException:
            self.log.warning("Waiting for %s %s/%s was interrupted", ref.kind, ref.namespace, ref.name)
            self._stop(ref, kube)
            raise
        finally:
            self._job = None
        return self._result_of(ref, decision, context, tap)

    def _warn_if_it_may_queue_forever(self, workload: Mapping[str, Any]) -> None:
        queue = queue_name(workload)
        if not (queue or is_suspended(workload)) or self.scheduling_timeout or self.execution_timeout:
            return
        held = f"in Kueue LocalQueue {queue}" if queue else "suspended"
        self.log.warning(
            "%s %s is %s and this task sets neither scheduling_timeout nor execution_timeout: it waits for as "
            "long as the queue holds the job, and a job that is never admitted keeps this task waiting forever",
            workload.get("kind"),
            workload.get("metadata", {}).get("name"),
            held,
        )

    def _submit(
        self, kube: SyncKube, ref: JobRef, configmap: dict[str, Any], workload: dict[str, Any], context: Context
    ) -> JobRef:
        """Create the ConfigMap and the job, or re-attach to the job this try already created; returns the job."""
        from airflow_provider_torchelastic.kubernetes.client import retry_sync

        def call(fn: Callable[..., Any], *args: Any) -> Any:
            return retry_sync(functools.partial(fn, *args), self.log.warning)

        try:
            return self._create_or_reattach(call, kube, ref, configmap, workload, context)
        except KubeError as e:
            error = _submit_error(ref, e)
            # The payload ConfigMap may exist already: leave nothing behind (a retry creates everything anew).
            self._stop(ref, kube)
            raise error from e

    def _create_or_reattach(
        self,
        call: Callable[..., Any],
        kube: SyncKube,
        ref: JobRef,
        configmap: dict[str, Any],
        workload: dict[str, Any],
        context: Context,
    ) -> JobRef:
        from airflow_provider_torchelastic.kubernetes.render import payload_configmap_owner_reference

        store = context.get("task_state_store")
        saved = store.get(STATE_KEY) if store is not None else None
        try_number = context["ti"].try_number
        # The state store remembers the job of this try even if its name were computed differently now (a provider
        # upgrade between a worker crash and the resumed try); the deterministic name covers everything else. Its
        # values survive retries, so only the record of *this* try counts: a new try must get a new job.
        remembered = []
        if isinstance(saved, dict) and saved.get("try_number") == try_number:
            remembered = [JobRef(kind=str(saved["kind"]), name=str(saved["name"]), namespace=str(saved["namespace"]))]
        for candidate in [*remembered, ref]:
            if call(kube.get, candidate.kind, candidate.name, candidate.namespace) is not None:
                self.log.info(
                    "Re-attaching to %s %s/%s created earlier by this try",
                    candidate.kind,
                    candidate.namespace,
                    candidate.name,
                )
                return candidate
        if store is not None:
            # Before creating: a crash between create and store must still find the job.
            store.set(STATE_KEY, {**asdict(ref), "try_number": try_number})
        name = configmap["metadata"]["name"]
        try:
            call(kube.create, configmap)
        except KubeError as e:
            if not e.conflict:
                raise
            # Left by this try's earlier attempt that crashed before creating its job. The ConfigMap is immutable
            # and holds the same function and arguments (same try, same rendered templates): use it.
            self.log.info("Payload ConfigMap %s/%s exists already; using it", ref.namespace, name)
        try:
            created = call(kube.create, workload)
        except KubeError as e:
            if not e.conflict:
                raise
            # A retried create whose first attempt went through, or a concurrent run of the same try.
            self.log.info("%s %s/%s already exists; re-attaching", ref.kind, ref.namespace, ref.name)
            return ref
        self.log.info("Created %s %s/%s", ref.kind, ref.namespace, ref.name)
        owner = payload_configmap_owner_reference(
            owner_name=ref.name, owner_uid=created["metadata"]["uid"], kind=ref.kind
        )
        call(kube.patch_configmap, name, ref.namespace, owner)
        return ref

    def _defer(self, hook: Any, ref: JobRef, context: Context) -> None:
        from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger, WatchArgs

        try:
            extras = hook.get_connection(self.kubernetes_conn_id).extra_dejson
        except Exception:  # no connection: the triggerer resolves in-cluster or default config itself
            extras = None
        args = WatchArgs(
            kind=ref.kind,
            name=ref.name,
            namespace=ref.namespace,
            kubernetes_conn_id=self.kubernetes_conn_id,
            connection_extras=extras,
            poll_interval=self.poll_interval,
            pending_grace_seconds=self.pending_grace_seconds,
            deadline=self._deadline(context),
            finish_action=self.on_finish_action,
            scheduling_timeout=self.scheduling_timeout,
        )
        # The trigger enforces the deadline (and deletes the job); Airflow's own timeout is only a backstop after it.
        backstop = None
        if args.deadline is not None:
            backstop = datetime.timedelta(
                seconds=max(0.0, args.deadline - time.time()) + max(60.0, 2 * self.poll_interval)
            )
        self.log.info("Deferring: the triggerer waits for %s %s/%s", ref.kind, ref.namespace, ref.name)
        trigger = TorchElasticJobTrigger.for_job(args)
        self.defer(trigger=trigger, method_name="execute_complete", timeout=backstop)

    def _deadline(self, context: Context) -> float | None:
        """``execution_timeout`` as a Unix time, anchored on the try's start (stable across re-deferrals)."""
        if self.execution_timeout is None:
            return None
        start = getattr(context["ti"], "start_date", None)
        started = start.timestamp() if start is not None else time.time()
        return started + self.execution_timeout.total_seconds()

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: a fresh operator instance, so everything comes from the event and XCom.

        ``event`` is the payload of the trigger's :class:`~triggers.JobEnded` or :class:`~triggers.WaitFailed` (a
        plain dict; one written before those classes existed reads the same). The trigger has already applied
        ``on_finish_action`` (or deleted the job at the deadline, or when it could not observe it); only the verdict
        is left to turn into a result or an exception.
        """
        from airflow_provider_torchelastic.triggers import WaitFailed, event_from_payload

        ti = context["ti"]
        ref = JobRef(
            kind=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_KIND, map_indexes=ti.map_index),
            name=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAME, map_indexes=ti.map_index),
            namespace=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAMESPACE, map_indexes=ti.map_index),
        )
        manifests = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_MANIFESTS, map_indexes=ti.map_index)
        if manifests:
            self.rendered_job = summarize_for_ui(manifests)
        outcome = event_from_payload(event)
        if isinstance(outcome, WaitFailed):
            # The trigger could not even start waiting: do not leave the job holding the cluster.
            self._stop(ref)
            raise TrainingRecoverableError(
                f"Waiting for {ref.kind} {ref.namespace}/{ref.name} failed: {outcome.message}"
            )
        from airflow_provider_torchelastic.core.tap import MetricsTap

        decision = outcome.decision
        # The trigger's tap (when it drove the wait with one) sent what it kept along with the decision.
        tap = MetricsTap.from_json(decision.metrics, self.log.info)
        return self._result_of(ref, decision, context, tap)

    def _result_of(self, ref: JobRef, decision: WaitDecision, context: Context, tap: MetricsTap) -> Any:
        from airflow_provider_torchelastic.core.summary import JobSummary, with_log_tails

        verdict = decision.verdict or Verdict(succeeded=False, detail=decision.progress)
        self.log.info("%s %s/%s ended: %s", ref.kind, ref.namespace, ref.name, decision.progress)
        start = getattr(context["ti"], "start_date", None)
        created = decision.created or (start.timestamp() if start is not None else time.time())
        summary = JobSummary.build(
            kind=ref.kind,
            namespace=ref.namespace,
            name=ref.name,
            succeeded=verdict.succeeded,
            created=created,
            finished=time.time(),
            root_cause=verdict.detail,
            pods=with_log_tails(decision.pods, tap.tails()),
            series=tap.series,
        )
        self._push_job_summary(context, summary)
        return self.result_or_raise(verdict, last_metrics=tap.summary_line())

    def _stop(self, ref: JobRef, kube: SyncKube | None = None) -> None:
        """Delete the job unless it has finished: the one way the worker ends a job it no longer waits for."""
        from airflow_provider_torchelastic.kubernetes.client import SyncKube
        from airflow_provider_torchelastic.kubernetes.wait import drive_sync, stop_job

        drive_sync(stop_job(ref), kube or SyncKube(self._hook().api_client), self.log.info)

    def on_kill(self) -> None:
        run = self._local_run
        if run is not None:
            self.log.info("Task killed: stopping the local training processes")
            run.stop()
        if self._job is not None:
            self.log.info("Task killed: stopping %s %s/%s", self._job.kind, self._job.namespace, self._job.name)
            self._stop(self._job)


def _result_url(task_context: TaskContext) -> str | None:
    """Where this try's rank 0 writes a result too large for its result file, when result storage is configured."""
    storage = configured_result_storage()
    return result_location(storage.url, task_context) if storage is not None else None


#: The connection's ways to reach a cluster; the cncf.kubernetes hook accepts exactly one of them.
_CLUSTER_SOURCES: Final = ("in_cluster", "kube_config_path", "kube_config")


def _check_one_cluster_source(conn_id: str, hook: Any) -> None:
    """Refuse a connection that names two ways to reach a cluster, before anything is created.

    The hook refuses the pair itself, but only when it first connects and with an AirflowException, which Airflow
    retries although every try fails the same way.
    """
    try:
        extras = hook.get_connection(conn_id).extra_dejson
    except Exception:  # no such connection: the hook's in-cluster / default kubeconfig fallback applies
        return
    chosen = [key for key in _CLUSTER_SOURCES if extras.get(key) or extras.get(f"extra__kubernetes__{key}")]
    if len(chosen) > 1:
        raise TrainingFailedError(
            f"connection {conn_id!r} sets {' and '.join(chosen)}; expected one of {', '.join(_CLUSTER_SOURCES)} "
            "(the Kubernetes hook cannot use more than one); fix the connection (a retry will not help)"
        )


def _submit_error(ref: JobRef, error: KubeError) -> Exception:
    """What a failed submission means for the task: only an API that stayed unavailable is worth a retry.

    401/403 (no permission, told apart from an admission webhook's 403 denial by the Status's details), 404 (no
    such resource: the CRD is not installed), 400/422 (the API server or an admission webhook rejected the object)
    fail the same way on every retry.
    """
    where = f"Cannot create {ref.kind} {ref.namespace}/{ref.name}"
    if error.recoverable:
        return TrainingRecoverableError(f"{where}: the Kubernetes API stayed unavailable ({error})")
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
    return TrainingFailedError(f"{where}: {error}{hint} (a retry will not help)")

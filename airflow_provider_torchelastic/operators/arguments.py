"""``TorchElasticOperator``'s arguments, and their checks that run while the DAG file is parsed.

:class:`OperatorArguments` declares each argument and its default once; the constructor's signature takes its
defaults from it. One table (:data:`_ARGUMENT_CHECKS`, a row per field) serves the constructor and the expansion of
a mapped task, which Airflow builds without running ``__init__``: a mapped argument is skipped here and checked when
the run expands the task.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from airflow_provider_torchelastic.compat import CheckedOperatorPartial
from airflow_provider_torchelastic.core.choices import (
    BACKENDS,
    FINISH_ACTION_ALIASES,
    FINISH_ACTIONS,
    Execution,
    OnFinishAction,
    TrainingJobKind,
    executions_expected,
    finish_action_of,
)
from airflow_provider_torchelastic.core.config import Elastic, TaskConfig, check_task_config
from airflow_provider_torchelastic.core.naming import DNS_1123_LABEL
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.core.retry_resources import check_retry_resources
from airflow_provider_torchelastic.core.stall import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_STALL_TIMEOUT,
    check_grace_period,
    check_stall_timeout,
)
from airflow_provider_torchelastic.core.validation import check_image, check_int, check_seconds, fail, is_templated
from airflow_provider_torchelastic.operators.context_arguments import check_context_parameters
from airflow_provider_torchelastic.settings import (
    JOB_KINDS,
    read_execution_option,
    read_image,
    read_job_kind_option,
)

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.kinds import JobKind

__all__ = [
    "DEFAULTS",
    "CheckedArguments",
    "OperatorArguments",
    "check_checkpoint_uri",
    "check_resume_from",
    "check_mapped_arguments",
    "check_operator_arguments",
]

_NAMESPACE_EXPECTED: Final = "a namespace name (a lowercase DNS-1123 label), a template, or None for the connection's"


def _check_execution(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value in BACKENDS:
        return str(value)  # the plain string, whether given as one or as the enum
    raise ValueError(
        f"execution: expected {executions_expected()} (or None for [torch_elastic] execution), got {value!r}"
    )


def check_checkpoint_uri(value: object) -> str:
    """``checkpoint_uri``: a non-empty path or fsspec URL (or a template of one), without surrounding spaces."""
    expected = "a path or fsspec URL (s3://bucket/prefix, file:///mnt/ckpt, /mnt/ckpt), a template, or None"
    if not isinstance(value, str):
        raise fail("", "checkpoint_uri", value, expected, TypeError)
    if not value or value != value.strip():
        raise fail("", "checkpoint_uri", value, expected)
    return value


#: The longest run id Airflow stores (its ``run_id`` column).
_MAX_RUN_ID = 250


def check_resume_from(value: object) -> str | None:
    """``resume_from``: None, ``"latest"`` (the newest complete checkpoint of this task in the DAG's earlier runs), a
    run id, or a template of one; refused when it names nothing a run could have (empty, surrounding spaces, too
    long)."""
    expected = "'latest', an earlier run's run_id (manual__2026-01-01T00:00:00+00:00), a template, or None"
    if value is None:
        return None
    if not isinstance(value, str):
        raise fail("", "resume_from", value, expected, TypeError)
    if not value or value != value.strip() or len(value) > _MAX_RUN_ID or "\n" in value:
        raise fail("", "resume_from", value, expected)
    return value


def _check_callable(value: object) -> object:
    if value is not None and not callable(value):
        raise TypeError(f"python_callable: expected a callable, got {value!r}")
    if inspect.isgeneratorfunction(value) or inspect.isasyncgenfunction(value):
        # Its call only makes a generator, which nothing would run, and rank 0's value would be that generator.
        raise fail(
            "",
            "python_callable",
            value,
            "a function that returns its result (this one yields: return a value, or collect the yielded ones)",
            TypeError,
        )
    return value


#: ``python -m``'s argument: dotted Python identifiers.
_MODULE: Final = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


def _check_module(value: object) -> object:
    if value is not None and (not isinstance(value, str) or not _MODULE.match(value)):
        expected = "a dotted module name (team.train), run as `python -m` runs it, or None"
        raise fail("", "module", value, expected, TypeError if not isinstance(value, str) else ValueError)
    return value


def _check_script(value: object) -> object:
    if value is not None and (not isinstance(value, str) or not value.strip() or value != value.strip()):
        expected = "a script's path where the workers run (in the image), or None"
        raise fail("", "script", value, expected, TypeError if not isinstance(value, str) else ValueError)
    return value


def _check_args(value: object) -> object:
    expected = "a list of strings (the command-line arguments of module= or script=; templates allowed), or None"
    if value is None or is_templated(value):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise fail("", "args", value, expected, TypeError)
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise fail("", f"args[{index}]", item, expected, TypeError)
    return value


def _check_one_entrypoint(arguments: OperatorArguments) -> None:
    """Exactly one of ``python_callable``, ``module`` and ``script``; ``args`` only with the last two, and
    ``op_args``/``op_kwargs`` only with the first."""
    given = [name for name in ("python_callable", "module", "script") if getattr(arguments, name) is not None]
    if len(given) != 1:
        got = ", ".join(f"{name}={getattr(arguments, name)!r}" for name in given) or "none of them"
        raise TypeError(f"python_callable, module, script: expected exactly one of them, got {got}")
    if given == ["python_callable"] and arguments.args:
        raise TypeError(
            f"args: only for module= or script= (a function takes op_args/op_kwargs), got {arguments.args!r}"
        )
    if given == ["python_callable"]:
        check_context_parameters(arguments.python_callable, arguments.op_args or (), arguments.op_kwargs or {})
    if given != ["python_callable"] and (arguments.op_args or arguments.op_kwargs):
        raise TypeError(
            f"op_args, op_kwargs: only for python_callable (module= and script= take args=[...]), got "
            f"op_args={arguments.op_args!r}, op_kwargs={arguments.op_kwargs!r}"
        )


def _check_namespace(value: object) -> object:
    if value is None or is_templated(value):
        return value
    if not isinstance(value, str):
        raise fail("", "namespace", value, _NAMESPACE_EXPECTED, TypeError)
    if not DNS_1123_LABEL.match(value):
        raise fail("", "namespace", value, _NAMESPACE_EXPECTED)
    return value


def _check_conn_id(value: object) -> object:
    if not isinstance(value, str) or not value:
        raise fail("", "kubernetes_conn_id", value, "a connection id (a non-empty str)", TypeError)
    return value


def _instance_or_none(name: str, cls: type, expected: str) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is not None and not isinstance(value, cls):
            raise fail("", name, value, expected, TypeError)
        return value

    return check


def _check_image(value: object) -> object:
    check_image("", "image", value, templated_ok=True)
    return value


def _check_finish_action(value: object) -> str:
    action = finish_action_of(value)
    if action is None:
        expected = (
            f"one of {', '.join(map(repr, FINISH_ACTIONS))} (an OnFinishAction), or KubernetesPodOperator's "
            f"{', '.join(map(repr, FINISH_ACTION_ALIASES))}"
        )
        raise fail("", "on_finish_action", value, expected, TypeError if not isinstance(value, str) else ValueError)
    return action


def _check_job_kind(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value in JOB_KINDS:
        return TrainingJobKind(value).value
    expected = f"one of {', '.join(map(repr, JOB_KINDS))}, or None for [torch_elastic] job_kind"
    raise fail("", "job_kind", value, expected, TypeError if not isinstance(value, str) else ValueError)


def _check_roots(value: object) -> tuple[str, ...]:
    expected = "a list of folder URLs or paths (s3://bucket/models, /mnt/models), each without surrounding spaces"
    if isinstance(value, str) or not isinstance(value, Collection):
        raise fail("", "trusted_artifact_roots", value, expected, TypeError)
    roots = tuple(value)
    for root in roots:
        if not isinstance(root, str) or not root.strip("/") or root != root.strip() or is_templated(root):
            raise fail(
                "", "trusted_artifact_roots", value, expected, TypeError if not isinstance(root, str) else ValueError
            )
    return roots


def _unchecked(value: object) -> object:
    return value


def _check_max_preemptions(value: object) -> object:
    check_int("", "max_preemptions", value, minimum=1, optional=True)
    return value


@dataclass(frozen=True, kw_only=True)
class OperatorArguments:
    """``TorchElasticOperator``'s own arguments (not ``BaseOperator``'s), as given, with their defaults.

    The one place the defaults are declared: the constructor's signature reads them from :data:`DEFAULTS` (Airflow
    fills ``default_args`` from that signature, so it stays explicit), and the checks read them from here.
    """

    python_callable: Callable[..., Any] | None = None
    op_args: Collection[Any] | None = None
    op_kwargs: Mapping[str, Any] | None = None
    task_config: TaskConfig | None = None
    execution: str | None = None
    image: str | None = None
    namespace: str | None = None
    kubernetes_conn_id: str = "kubernetes_default"
    pod_options: PodOptions | None = None
    job_options: JobOptions | None = None
    deferrable: bool | None = None
    poll_interval: float = 10.0
    pending_grace_seconds: float = 120.0
    image_pull_timeout: float = 600.0
    on_finish_action: str = OnFinishAction.DELETE_SUCCEEDED.value
    scheduling_timeout: float | None = None
    stall_timeout: float | timedelta | None = DEFAULT_STALL_TIMEOUT
    termination_grace_period: float | timedelta = DEFAULT_GRACE_PERIOD
    checkpoint_uri: str | None = None
    resume_from: str | None = None
    job_kind: str | None = None
    module: str | None = None
    script: str | None = None
    args: Collection[str] | None = None
    trusted_artifact_roots: Collection[str] = ()
    allow_pickled_artifacts: bool = False
    retry_resources: float | Callable[[int, str, Any], Any] | None = None
    max_preemptions: int | None = None

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> OperatorArguments:
        """The arguments among ``values`` (a constructor's ``locals()``, say); the others are ignored."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


DEFAULTS: Final = OperatorArguments()


@dataclass(frozen=True)
class _Argument:
    """One argument: how it is checked (and normalized), and what stands for it while only the run knows it."""

    name: str
    check: Callable[[Any], Any]
    unknown: Callable[[Any], Any] = _unchecked


#: A row per field of :class:`OperatorArguments`, in the order they are checked (the first bad one is the error).
_ARGUMENT_CHECKS: Final = (
    _Argument("python_callable", _check_callable),
    _Argument("op_args", _unchecked),
    _Argument("op_kwargs", _unchecked),
    _Argument(
        "task_config", lambda value: Elastic() if value is None else check_task_config(value), lambda _: Elastic()
    ),
    _Argument("execution", _check_execution),
    _Argument("image", _check_image),
    _Argument("namespace", _check_namespace),
    _Argument("kubernetes_conn_id", _check_conn_id),
    _Argument("pod_options", _instance_or_none("pod_options", PodOptions, "a PodOptions(...) or None")),
    _Argument("job_options", _instance_or_none("job_options", JobOptions, "a JobOptions(...) or None")),
    _Argument(
        "deferrable",
        _instance_or_none("deferrable", bool, "True, False or None (None: [torch_elastic] deferrable)"),
    ),
    _Argument("poll_interval", lambda value: check_seconds("", "poll_interval", value), lambda _: 0.0),
    _Argument(
        "pending_grace_seconds",
        lambda value: check_seconds("", "pending_grace_seconds", value, allow_zero=True),
        lambda _: 0.0,
    ),
    _Argument(
        "image_pull_timeout",
        lambda value: check_seconds("", "image_pull_timeout", value, allow_zero=True),
        lambda _: 0.0,
    ),
    _Argument("on_finish_action", _check_finish_action),
    _Argument("checkpoint_uri", lambda value: None if value is None else check_checkpoint_uri(value)),
    _Argument("resume_from", check_resume_from),
    _Argument("stall_timeout", check_stall_timeout, lambda _: None),
    _Argument("termination_grace_period", check_grace_period, lambda _: DEFAULT_GRACE_PERIOD),
    _Argument(
        "scheduling_timeout",
        lambda value: None if value is None else check_seconds("", "scheduling_timeout", value),
        lambda _: None,
    ),
    _Argument("job_kind", _check_job_kind, lambda _: None),
    _Argument("module", _check_module),
    _Argument("script", _check_script),
    _Argument("args", _check_args),
    _Argument("trusted_artifact_roots", _check_roots, lambda _: ()),
    _Argument(
        "allow_pickled_artifacts", _instance_or_none("allow_pickled_artifacts", bool, "True or False"), lambda _: False
    ),
    _Argument("retry_resources", check_retry_resources),
    _Argument("max_preemptions", _check_max_preemptions),
)
#: The arguments ``check_operator_arguments`` knows.
_ARGUMENTS: Final = tuple(argument.name for argument in _ARGUMENT_CHECKS)


@dataclass(frozen=True, kw_only=True)
class CheckedArguments:
    """The operator's arguments as ``check_operator_arguments`` normalized them."""

    task_config: TaskConfig
    execution: str | None
    job_kind: str | None
    poll_interval: float
    pending_grace_seconds: float
    image_pull_timeout: float
    scheduling_timeout: float | None
    on_finish_action: str
    #: Seconds, or None: no stall detection.
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT
    termination_grace_period: float = DEFAULT_GRACE_PERIOD
    #: A factor > 1 (a float) or a callable; None: the next try gets what this one had.
    retry_resources: float | Callable[[int, str, Any], Any] | None = None


def check_operator_arguments(
    arguments: OperatorArguments, *, dag_id: str = "dag", task_id: str = "task", known_at_run_time: Collection[str] = ()
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
    if not later & {"python_callable", "module", "script", "args", "op_args", "op_kwargs"}:
        _check_one_entrypoint(arguments)
    if arguments.resume_from is not None and arguments.checkpoint_uri is not None and not later & {"resume_from"}:
        # resume_from finds another run's location under [torch_elastic] checkpoint_root's per-run layout; a task's
        # own checkpoint_uri replaces that layout, and whatever it names is what every run reads already.
        raise ValueError(
            f"resume_from={arguments.resume_from!r} with checkpoint_uri={arguments.checkpoint_uri!r}: resume_from "
            "reads an earlier run's location under [torch_elastic] checkpoint_root; pass one of the two (to start "
            "from a location of your own, give it as checkpoint_uri)"
        )
    values = {
        row.name: (row.unknown if row.name in later else row.check)(getattr(arguments, row.name))
        for row in _ARGUMENT_CHECKS
    }
    config: TaskConfig = values["task_config"]
    checked = CheckedArguments(
        task_config=config,
        execution=values["execution"],
        job_kind=values["job_kind"],
        poll_interval=values["poll_interval"],
        pending_grace_seconds=values["pending_grace_seconds"],
        image_pull_timeout=values["image_pull_timeout"],
        scheduling_timeout=values["scheduling_timeout"],
        on_finish_action=values["on_finish_action"],
        stall_timeout=values["stall_timeout"],
        termination_grace_period=values["termination_grace_period"],
        retry_resources=values["retry_resources"],
    )

    def known(name: str) -> bool:
        return name not in later

    if known("execution") and checked.execution not in (None, Execution.KUBERNETES):
        if checked.retry_resources is not None and known("retry_resources"):
            raise fail("", "retry_resources", arguments.retry_resources, _RETRY_RESOURCES_WHERE)
        return checked  # runs elsewhere (local: on the Airflow worker): no image, nothing rendered
    if not (known("task_config") and known("pod_options") and known("job_options")):
        return checked  # what would be rendered is known only at run time
    # Imported here, not at the top: the renderer and the kinds' table are most of what importing the operator would
    # cost a DAG file (issue 39), and a task given execution="local" never needs them.
    from airflow_provider_torchelastic.kubernetes.render import check_renderable

    # Whether the pods need an image from what is known here: the run's own configuration decides execution=None,
    # but a DAG parsed where Kubernetes is the default must not wait for the run to find that it names no image.
    on_kubernetes = known("execution") and (checked.execution or read_execution_option()) == Execution.KUBERNETES
    image = arguments.image
    image_now = image if known("image") and not is_templated(image) else None
    # The kind, where it does not depend on the cluster: a job_kind that names TrainJob checks now what a TrainJob
    # cannot run, and renders one. `auto` (the default) is decided at submit, by what the cluster serves.
    kind = _fixed_kind(config, checked.job_kind) if on_kubernetes and known("job_kind") else None
    manifests = check_renderable(
        config,
        image=image_now,
        pod_options=arguments.pod_options,
        job_options=arguments.job_options,
        dag_id=dag_id,
        task_id=task_id,
        default_image=read_image(),
        # A templated or mapped image reaches every pod at run time.
        require_image=on_kubernetes and known("image") and not is_templated(image),
        renderer=kind.render if kind is not None else None,
    )
    if checked.retry_resources is not None and known("retry_resources"):
        _check_memory_is_set(manifests[-1], arguments.retry_resources)
    return checked


_RETRY_RESOURCES_WHERE: Final = (
    "None with execution='local' (retry_resources changes the pods' memory on Kubernetes; local workers have no "
    "memory limit to raise)"
)


def _check_memory_is_set(workload: Mapping[str, Any], value: object) -> None:
    """``retry_resources`` raises memory that is set: every replica's training container needs a request or limit."""
    from airflow_provider_torchelastic.kubernetes.training_resources import missing_memory

    missing = missing_memory(workload)
    if missing:
        raise fail(
            "",
            "retry_resources",
            value,
            "a memory request or limit on the training container of every replica to raise after an OOM "
            "(PodOptions(limits={'memory': '8Gi'}), or a replica's requests/limits); none on "
            f"{', '.join(missing)}",
        )


def _fixed_kind(config: TaskConfig, job_kind: str | None) -> JobKind | None:
    """The kind that will run ``config`` when ``job_kind`` (else ``[torch_elastic] job_kind``) fixes it; a
    ValueError naming the field, the value and why when that kind cannot run it."""
    from airflow_provider_torchelastic.kubernetes import kinds

    value = job_kind if job_kind is not None else read_job_kind_option()
    where = f"job_kind={value!r}" if job_kind is not None else f"[torch_elastic] job_kind={value!r}"
    try:
        choice = kinds.fixed_choice(config, value)
    except ValueError as e:
        raise ValueError(f"{e} ({where})") from e
    return choice[0] if choice is not None else None


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
        OperatorArguments.pick({"python_callable": None, **given}),
        dag_id=getattr(dag, "dag_id", None) or "dag",
        task_id=task_id if isinstance(task_id, str) and task_id else "task",
        known_at_run_time=later,
    )


class _CheckedOperatorPartial(CheckedOperatorPartial):
    """What ``TorchElasticOperator.partial(...)`` returns: its expansion first checks every argument that is not
    mapped (the hook into Airflow's expansion is :mod:`~airflow_provider_torchelastic.compat`'s)."""

    __slots__ = ()

    def check_expansion(self, mapped: frozenset[str] | None) -> None:
        check_mapped_arguments(self.kwargs, mapped=mapped)

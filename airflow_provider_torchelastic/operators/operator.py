"""``TorchElasticOperator``: run a Python training function under torch elastic as one Airflow task.

The class holds the checked arguments, the running try's backend and handle, and the task's entry points, which call
only the backend protocol (:mod:`.backends`): ``prepare`` a plan, ``submit`` it, ``wait`` (or defer and ``resume``),
``stop`` on kill. The parse-time checks are in :mod:`.arguments`; rendering the templated fields without a run (for
``render_manifests`` and ``plan``) is here, beside the class. Importing it (what a DAG file does at every parse)
imports Airflow's SDK but neither torch nor the kubernetes client: a backend is imported when a task runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Final

from airflow.sdk import BaseOperator

from airflow_provider_torchelastic.compat import mark_expanded
from airflow_provider_torchelastic.core.public import OPERATORS_MODULE, publish
from airflow_provider_torchelastic.core.validation import is_templated
from airflow_provider_torchelastic.operators.arguments import (
    DEFAULTS,
    CheckedArguments,
    OperatorArguments,
    _CheckedOperatorPartial,
    check_operator_arguments,
)
from airflow_provider_torchelastic.operators.exceptions import TrainingError, for_retry_policy
from airflow_provider_torchelastic.operators.links import TorchElasticJobLink, TorchElasticLogsLink
from airflow_provider_torchelastic.settings import Settings, read_execution

# What only a run needs (the backends, the payload, results) is imported in the functions that need it: a DAG file
# imports this module at every parse and only builds the operator (issue 39).
if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.definitions.mappedoperator import OperatorPartial

    from airflow_provider_torchelastic.core.config import TaskConfig
    from airflow_provider_torchelastic.core.naming import RunIdentity
    from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
    from airflow_provider_torchelastic.operators.backends import Attempt, Backend, Plan, TaskSpec

__all__ = ["UNRENDERED_IMAGE", "TorchElasticOperator"]

#: Stands in for an image that only the run can render (``.invalid`` is a reserved domain: it is never pulled).
UNRENDERED_IMAGE: Final = "image.invalid/rendered-at-run-time:placeholder"
_UNRENDERED_NAMESPACE: Final = "default"


class TorchElasticOperator(BaseOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on every worker of a torch elastic job, or a torchrun
    script or module (``script=``/``module=`` with ``args``).

    Rank 0's return value (JSON-serializable) becomes the task's ``return_value`` XCom; a script's or module's is
    what its rank 0 passed to ``set_result()``.

    :param python_callable: the training function. It runs in fresh worker processes (and, on Kubernetes, in pods
        where the DAG file does not exist): it and the helpers defined beside it are shipped by value.
    :param op_args: positional arguments (templated).
    :param op_kwargs: keyword arguments (templated).
    :param module: in place of ``python_callable``: a module each worker runs as ``python -m module *args`` would
        (as ``__main__``), from the image (or the Airflow worker's environment for local execution).
    :param script: in place of ``python_callable``: a script path each worker runs as ``python script *args``; it
        must exist where the workers run (checked there).
    :param args: the command-line arguments of ``module``/``script`` (strings; templated).
    :param task_config: ``Elastic(...)`` (default: one node, one worker) or ``PyTorch(...)``.
    :param execution: ``"local"`` (subprocesses on the Airflow worker) or ``"kubernetes"`` (or ``Execution.LOCAL``,
        ``Execution.KUBERNETES``); default: the Airflow option ``[torch_elastic] execution``, itself ``kubernetes``.
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
        invalid image, container config such as a missing Secret) this long. An image the registry refuses for good
        (not found, unauthorized) or whose name is invalid fails at once, as ``ImageUnavailableError``.
    :param image_pull_timeout: seconds a scheduled pod may keep failing to pull its image because the registry
        throttles (429), fails (5xx), times out or resets the connection, while the kubelet pulls again; then the
        task fails with ``ImageTransientlyUnavailableError``, which is retried. Default 600.
    :param scheduling_timeout: seconds the job may wait for capacity (pods Unschedulable before it can start, a
        suspended or Kueue-queued job) before the task fails as recoverable; default None: until
        ``execution_timeout``. Pods of an elastic job beyond its minimum never count: it runs on what it got.
    :param stall_timeout: seconds (or a ``timedelta``) a rank may make no progress before the runner takes every
        rank's stacks, stops the workers and fails the try as ``StalledError`` (recoverable); ``None`` turns it off.
        Progress is per rank: the function starting, every optimizer step, every ``report()`` and
        ``context.heartbeat()`` call. The clock starts when a rank's worker process starts. Default 30 minutes.
    :param termination_grace_period: seconds (or a ``timedelta``) between SIGTERM and SIGKILL: rendered as the pods'
        ``terminationGracePeriodSeconds`` (rounded up), and given to a local run that is killed. On SIGTERM (a
        preemption, a drain, a deleted pod, a killed task) ``context.current().stop_requested()`` turns True and the
        function gets this less a few seconds to save and return; the try then fails as ``PreemptedError``
        (recoverable). Default 120 s.
    :param on_finish_action: ``delete_succeeded`` (default), ``delete`` or ``keep`` the job once it ended (or an
        ``OnFinishAction``); KubernetesPodOperator's ``delete_succeeded_pod``, ``delete_pod`` and ``keep_pod`` mean
        the same three.
    :param checkpoint_uri: this task's checkpoint location (a path or fsspec URL; templated), in place of
        ``{[torch_elastic] checkpoint_root}/{dag_id}/{run_id}/{task_id}/{map_index}``. The workers read it from
        ``context.current().checkpoint_uri``; the ``checkpoint`` helpers use it.
    :param resume_from: where a try that finds no checkpoint of its own starts from (templated): ``"latest"``, the
        newest complete checkpoint of this task in the DAG's earlier runs, or an earlier run's ``run_id``. Read, never
        written: the run's own checkpoints go to its own location, and a retry resumes from those. The checkpoint
        helpers and the framework integrations look there; needs ``[torch_elastic] checkpoint_root`` (not
        ``checkpoint_uri``). Default None: a new run starts over.
    :param job_kind: what runs a task of several nodes: ``auto`` (ask the cluster at submit: a TrainJob where
        Kubeflow Trainer v2 is installed and the task fits one, else a PyTorchJob), ``pytorchjob`` or ``trainjob``
        (or a ``TrainingJobKind``); default ``[torch_elastic] job_kind`` (``auto``). One node is always a Pod. A
        kind known at parse time is checked then: what a TrainJob cannot run is an error naming the field.
    :param trusted_artifact_roots: folders besides ``[torch_elastic] artifact_storage`` whose artifact references
        the arguments may hold (an upstream task's model, say): the workers load only references under these roots
        or the artifact storage, pinned with their sha256 in the payload; any other fails the try, naming where it
        was (``op_kwargs['model']``). A dict that merely has a reference's shape never loads anything.
    :param allow_pickled_artifacts: let the arguments hold references to pickled modules (``artifacts.pickled()``),
        whose loading runs their pickle's code in every worker; off by default.
    :param retry_resources: more memory after an out-of-memory kill (Kubernetes): a factor > 1 (``2.0`` doubles the
        training container's memory requests and limits of every replica on the try after each OOM) or a callable
        ``(try_number, cause, resources) -> resources`` given the training container's ``{"requests": ...,
        "limits": ...}`` as the previous try ran it. Capped by the namespace's LimitRange (its Container
        ``max.memory``), else ``[torch_elastic] retry_memory_max``; logged and shown in the job summary. Every
        replica needs a memory request or limit (checked when the DAG is parsed). Default None: every try the same.
    :param max_preemptions: fail the try with ``PreemptedError`` at this task instance's N-th preemption (a Kueue
        job suspended again after it was admitted, counted over all tries) instead of waiting to be admitted
        again; default None: wait every time. A job that Kueue admitted but that stays suspended longer than
        ``pending_grace_seconds`` fails with ``ConfigurationError`` naming its Workload (a Kueue/operator version
        skew) whatever this says.
    """

    operator_extra_links = (TorchElasticJobLink(), TorchElasticLogsLink())
    # The manifest is built in execute(); show it in the rendered-template view of the run, not the parse-time one.
    overwrite_rtif_after_execution = True

    template_fields: Sequence[str] = (
        "op_args",
        "op_kwargs",
        "args",
        "image",
        "namespace",
        "checkpoint_uri",
        "resume_from",
        "rendered_job",
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {"op_args": "py", "op_kwargs": "py", "rendered_job": "yaml"}
    # The callable may hold objects that cannot be deep-copied (Airflow copies operators when it maps tasks).
    shallow_copy_attrs: Sequence[str] = ("python_callable", "retry_resources")
    ui_color = "#ee4c2c"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any] | None = DEFAULTS.python_callable,
        op_args: Collection[Any] | None = DEFAULTS.op_args,
        op_kwargs: Mapping[str, Any] | None = DEFAULTS.op_kwargs,
        task_config: TaskConfig | None = DEFAULTS.task_config,
        execution: str | None = DEFAULTS.execution,
        image: str | None = DEFAULTS.image,
        namespace: str | None = DEFAULTS.namespace,
        kubernetes_conn_id: str = DEFAULTS.kubernetes_conn_id,
        pod_options: PodOptions | None = DEFAULTS.pod_options,
        job_options: JobOptions | None = DEFAULTS.job_options,
        deferrable: bool | None = DEFAULTS.deferrable,
        poll_interval: float = DEFAULTS.poll_interval,
        pending_grace_seconds: float = DEFAULTS.pending_grace_seconds,
        image_pull_timeout: float = DEFAULTS.image_pull_timeout,
        on_finish_action: str = DEFAULTS.on_finish_action,
        scheduling_timeout: float | None = DEFAULTS.scheduling_timeout,
        stall_timeout: float | timedelta | None = DEFAULTS.stall_timeout,
        termination_grace_period: float | timedelta = DEFAULTS.termination_grace_period,
        checkpoint_uri: str | None = DEFAULTS.checkpoint_uri,
        resume_from: str | None = DEFAULTS.resume_from,
        job_kind: str | None = DEFAULTS.job_kind,
        module: str | None = DEFAULTS.module,
        script: str | None = DEFAULTS.script,
        args: Collection[str] | None = DEFAULTS.args,
        trusted_artifact_roots: Collection[str] = DEFAULTS.trusted_artifact_roots,
        allow_pickled_artifacts: bool = DEFAULTS.allow_pickled_artifacts,
        retry_resources: float | Callable[[int, str, Any], Any] | None = DEFAULTS.retry_resources,
        max_preemptions: int | None = DEFAULTS.max_preemptions,
        **kwargs: Any,
    ) -> None:
        arguments = OperatorArguments.pick(locals())
        super().__init__(**kwargs)
        # One set of checks for this constructor and for mapped tasks (see partial() and the decorator's expand).
        self._hold_checked(check_operator_arguments(arguments, dag_id=self.dag_id, task_id=self.task_id))
        # The others as given: templated ones are rendered in place before execute().
        self.python_callable = python_callable
        self.module = module
        self.script = script
        self.args: list[str] = list(args or [])
        self.op_args: Collection[Any] = list(op_args or [])
        self.op_kwargs: Mapping[str, Any] = dict(op_kwargs or {})
        self.image = image
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.pod_options = pod_options
        self.job_options = job_options
        self.deferrable = deferrable
        self.checkpoint_uri = checkpoint_uri
        self.resume_from = resume_from
        self.trusted_artifact_roots: tuple[str, ...] = tuple(trusted_artifact_roots)
        self.allow_pickled_artifacts = allow_pickled_artifacts
        self.max_preemptions = max_preemptions
        self.rendered_job: str | None = None
        #: The backend running this try and its handle, for on_kill.
        self._running: tuple[Backend, object] | None = None

    def _hold_checked(self, checked: CheckedArguments) -> None:
        """Keep the arguments that :func:`.arguments.check_operator_arguments` normalized (a default filled in, a
        ``timedelta`` in seconds, an alias or enum as its plain string) in their normalized form."""
        self.task_config: TaskConfig = checked.task_config
        self.execution = checked.execution
        self.poll_interval = checked.poll_interval
        self.pending_grace_seconds = checked.pending_grace_seconds
        self.image_pull_timeout = checked.image_pull_timeout
        self.scheduling_timeout = checked.scheduling_timeout
        self.stall_timeout = checked.stall_timeout
        self.termination_grace_period = checked.termination_grace_period
        self.on_finish_action = checked.on_finish_action
        self.job_kind = checked.job_kind
        self.retry_resources = checked.retry_resources

    @classmethod
    def partial(cls, **kwargs: Any) -> OperatorPartial:
        """Airflow's ``partial``, whose ``expand``/``expand_kwargs`` also run the constructor's parse-time checks
        (a mapped task is built without calling ``__init__`` until it runs)."""
        plain = super().partial(**kwargs)
        checked = _CheckedOperatorPartial(operator_class=plain.operator_class, kwargs=plain.kwargs, params=plain.params)
        mark_expanded(plain)  # replaced, not forgotten by the user
        return checked

    def training_call(
        self, rendered: Mapping[str, Any] | None = None
    ) -> tuple[Callable[..., Any], Collection[Any], Mapping[str, Any]]:
        """What every worker calls: the function with its arguments, or the script or module as a
        :class:`~airflow_provider_torchelastic.worker.program.Program` with its command-line arguments. The
        arguments are this operator's (rendered, in a run), or those of ``rendered`` (a dry run's)."""
        given = {"op_args": self.op_args, "op_kwargs": self.op_kwargs, "args": self.args, **(rendered or {})}
        if self.python_callable is not None:
            return self.python_callable, given["op_args"] or (), given["op_kwargs"] or {}
        from airflow_provider_torchelastic.worker.program import Program

        program = Program(module=self.module, script=self.script, args=tuple(map(str, given["args"] or ())))
        return program, (), {}

    def resolve_execution(self) -> str:
        """The execution mode: the operator's own, else ``[torch_elastic] execution`` (read at run time)."""
        return self.execution if self.execution is not None else read_execution()

    def execute(self, context: Context) -> Any:
        from airflow_provider_torchelastic.operators.backends import backend_for
        from airflow_provider_torchelastic.operators.backends.attempt import new_attempt

        execution = self.resolve_execution()
        backend = backend_for(execution, _task_spec(self))
        # Every option this try uses, read once: the rest of the try sees these values only. A backend that cannot
        # defer waits in the task whatever ``deferrable`` says, so its try reads none of the deferral's options.
        deferrable = self.deferrable and backend.can_defer
        settings = Settings.read(execution=execution, deferrable=deferrable, job_kind=self.job_kind)
        with self._raising_for_retry_policy(context):
            call = self.training_call()
            attempt = new_attempt(backend.task, call, context, settings)
            self.log.info("Running %s with %s (%s execution), payload %d bytes", *_described(call[0], self, attempt))
            plan = backend.prepare(attempt)
            self.rendered_job = plan.rendered
            handle = backend.submit(attempt, plan)
            self._running = (backend, handle)
            try:
                return backend.wait(attempt, handle)
            finally:
                self._running = None

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: a fresh operator instance, so everything comes from the event and XCom.

        ``event`` is the payload of the trigger's :class:`~triggers.JobEnded` or :class:`~triggers.WaitFailed` (a
        plain dict; one written before those classes existed reads the same). The trigger has already applied
        ``on_finish_action`` (or deleted the job at the deadline, or when it could not observe it); only the verdict
        is left to turn into a result or an exception.
        """
        from airflow_provider_torchelastic.operators.backends import backend_for

        # The try did defer; what is left reads only result storage.
        settings = Settings.read(execution="kubernetes", deferrable=True)
        backend = backend_for("kubernetes", _task_spec(self))
        with self._raising_for_retry_policy(context):
            try:
                return backend.resume(context, event, settings)
            finally:
                self.rendered_job = backend.rendered

    def render_manifests(self, context: Context | None = None) -> list[dict[str, Any]]:
        """The objects this task would create on Kubernetes, in creation order, without touching the network.

        Templated fields are rendered with ``context``; with ``context=None``, with a minimal one for a placeholder
        run (dag, task, ``ti``'s identity, params, readable Variables). A field that cannot be rendered so (it needs
        the real run: an XCom, a date, a missing Variable) is named in a ``UserWarning`` and a placeholder takes its
        place (namespace ``default``, image ``UNRENDERED_IMAGE``, the unrendered arguments in the payload): no
        ``{{ ... }}`` reaches a manifest. The payload is the real one otherwise (so its size counts). The operator
        itself is not changed.
        """
        # Rendered as on Kubernetes whatever the execution; deferring is no part of the manifests.
        return _dry_run(self, context, "kubernetes").objects

    def plan(self, context: Context | None = None) -> Plan:
        """What a try of this task would run where its execution runs it, without running anything: the Kubernetes
        manifests, or a local run's node command lines and the environment the run adds. ``print()`` it to see it
        as the task log would (payload elided, secrets masked); ``.objects`` holds the objects themselves.
        Templated fields are rendered as :meth:`render_manifests` renders them."""
        return _dry_run(self, context, self.resolve_execution())

    @contextlib.contextmanager
    def _raising_for_retry_policy(self, context: Context) -> Iterator[None]:
        """A :class:`TrainingError` raised as the task's retry_policy needs it (:func:`.exceptions.for_retry_policy`),
        when that is another object: the same one, with the same cause, in its place in the log."""
        try:
            yield
        except TrainingError as error:
            ti = context.get("ti")
            tries = {
                "try_number": int(getattr(ti, "try_number", 1) or 1),
                "max_tries": int(getattr(ti, "max_tries", 0) or 0),
            }
            replacement = for_retry_policy(error, self.retry_policy, **tries)
            if replacement is not error:
                raise replacement from error.__cause__
            raise

    def on_kill(self) -> None:
        if (running := self._running) is not None:  # read once: execute() may clear it meanwhile
            backend, handle = running
            backend.stop(handle)


def _placeholder_context(op: BaseOperator, identity: RunIdentity) -> dict[str, Any]:
    """A minimal template context for a task outside a run: what the placeholder identity, the DAG and the task
    know, and Variables that can be read here (environment, secrets backends). No XComs, dates or connections."""
    from airflow.sdk.execution_time.context import VariableAccessor

    ti = SimpleNamespace(**dataclasses.asdict(identity))  # the identity's fields, read as a task instance's
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


def _dry_run(op: TorchElasticOperator, context: Context | None, execution: str) -> Plan:
    """The body of ``TorchElasticOperator.render_manifests`` and ``.plan`` (their docstrings say what they
    promise): the task's templated fields rendered without changing it, placeholders where they cannot be, then the
    backend's plan of a placeholder try."""
    from airflow_provider_torchelastic.operators.backends import backend_for
    from airflow_provider_torchelastic.operators.backends.attempt import identity_of, new_attempt

    settings = Settings.read(execution=execution, deferrable=False, job_kind=op.job_kind)
    spec = _task_spec(op)
    identity = identity_of(context, spec)
    template_context = context if context is not None else _placeholder_context(op, identity)
    rendered, failed = _render_template_fields(
        op, ("image", "namespace", "op_args", "op_kwargs", "args", "checkpoint_uri"), template_context
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
            # The caller of TorchElasticOperator.render_manifests, two frames up from here.
            stacklevel=3,
        )
    task = dataclasses.replace(spec, image=image, namespace=namespace, checkpoint_uri=checkpoint_uri)
    backend = backend_for(execution, task)
    return backend.prepare(new_attempt(task, op.training_call(rendered), context, settings, dry_run=True))


def _task_spec(op: TorchElasticOperator) -> TaskSpec:
    """What the backends read of ``op``: its arguments as they are now (rendered, in a run) and its logger."""
    from airflow_provider_torchelastic.operators.backends import TaskSpec

    return TaskSpec(**{field.name: getattr(op, field.name) for field in dataclasses.fields(TaskSpec)})


def _described(fn: Callable[..., Any], op: TorchElasticOperator, attempt: Attempt) -> tuple[object, ...]:
    """What the try's first line names: the training function ``fn`` (or program), the config, the execution and
    the payload's size."""
    name = getattr(fn, "name", None) or getattr(fn, "__qualname__", fn)
    return name, op.task_config, attempt.settings.execution, len(attempt.payload)


# The path users import it from, which a serialized DAG's task module, tracebacks and reprs then show.
publish(TorchElasticOperator, module=OPERATORS_MODULE)

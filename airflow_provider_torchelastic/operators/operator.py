"""``TorchElasticOperator``: run a Python training function under torch elastic as one Airflow task.

The class holds the arguments and the task's entry points; the work is beside it: the parse-time checks
(:mod:`.arguments`), rendering without a run (:mod:`.dry_run`), the Kubernetes path (:mod:`.on_kubernetes`) and
results (:mod:`.results`). Importing it (what a DAG file does at every parse) imports Airflow's SDK but neither torch
nor the kubernetes client: those are imported inside ``execute``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator

from airflow_provider_torchelastic.compat import mark_expanded
from airflow_provider_torchelastic.core.public import OPERATORS_MODULE, publish
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

# What only a run needs (the payload, the launch, the Kubernetes path, results, the dry run) is imported in the
# methods that need it: a DAG file imports this module at every parse and only builds the operator (issue 39).
if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.definitions.mappedoperator import OperatorPartial

    from airflow_provider_torchelastic.core.config import TaskConfig
    from airflow_provider_torchelastic.core.outcome import Verdict
    from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
    from airflow_provider_torchelastic.core.run_context import TaskContext
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.status import JobRef
    from airflow_provider_torchelastic.local.run import LocalRun

__all__ = ["TorchElasticOperator"]


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
        self._local_run: LocalRun | None = None
        self._job: JobRef | None = None

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
        try:
            return self._execute(context)
        except TrainingError as e:
            self._raise_for_retry_policy(e, context)
            raise

    def _execute(self, context: Context) -> Any:
        from airflow_provider_torchelastic.operators import on_kubernetes
        from airflow_provider_torchelastic.operators.dry_run import identity_of, task_context_of
        from airflow_provider_torchelastic.operators.spill import dump_try_payload

        execution = self.resolve_execution()
        # Every option this try uses, read once: the rest of the try sees these values only.
        settings = Settings.read(execution=execution, deferrable=self.deferrable, job_kind=self.job_kind)
        fn, fn_args, fn_kwargs = self.training_call()
        payload = dump_try_payload(
            fn,
            fn_args,
            fn_kwargs,
            storage=settings.artifact_storage,
            task_context=task_context_of(identity_of(self, context), context, self.checkpoint_uri, settings),
            trusted_roots=self.trusted_artifact_roots,
            allow_pickles=self.allow_pickled_artifacts,
        )
        self.log.info(
            "Running %s with %s (%s execution), payload %d bytes",
            getattr(fn, "name", None) or getattr(fn, "__qualname__", fn),
            self.task_config,
            execution,
            len(payload),
        )
        if execution == "local":
            return self._execute_locally(context, payload, settings)
        return on_kubernetes.execute_on_kubernetes(self, context, payload, settings)

    def _execute_locally(self, context: Context, payload: bytes, settings: Settings) -> Any:
        from airflow_provider_torchelastic.core.launch import config_to_launch_spec
        from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV
        from airflow_provider_torchelastic.core.stall import liveness_env
        from airflow_provider_torchelastic.core.tap import MetricsTap
        from airflow_provider_torchelastic.local.run import LocalRun, run_locally
        from airflow_provider_torchelastic.operators import results
        from airflow_provider_torchelastic.operators.dry_run import identity_of, task_context_of

        spec = config_to_launch_spec(self.task_config)
        identity = identity_of(self, context)
        task_context = task_context_of(identity, context, self.checkpoint_uri, settings)
        run = self._local_run = LocalRun(grace_period=self.termination_grace_period)
        # Rank 0's metrics lines become progress lines; the tap keeps them, and the log's tail, for the job summary.
        tap = MetricsTap(self.log.info, keep_unprefixed=True)
        started = time.time()
        interval = settings.report_interval
        try:
            verdict = run_locally(
                payload,
                spec,
                log_line=tap,
                run=run,
                task_context=task_context,
                result_url=results.result_url(settings.result_storage, task_context),
                # The workers' metrics interval, as rendered into pods.
                extra_env={
                    **({} if interval is None else {INTERVAL_ENV: f"{interval:g}"}),
                    **liveness_env(self.stall_timeout, self.termination_grace_period),
                },
            )
        finally:
            self._local_run = None
        summary = results.local_summary(identity, spec, run, verdict, tap, started)
        return results.finish(
            self.log,
            context,
            summary,
            lambda: self.result_or_raise(
                verdict, last_metrics=tap.summary_line(), settings=settings, task_context=task_context
            ),
        )

    def result_or_raise(
        self,
        verdict: Verdict,
        *,
        last_metrics: str = "",
        settings: Settings | None = None,
        task_context: TaskContext | None = None,
    ) -> Any:
        """Rank 0's result, or the Airflow exception that says what failed and whether a retry can help.

        ``last_metrics`` (``MetricsTap.summary_line()``) ends the task's final log line: the last reported values.
        ``settings``: the try's, else read now (only result storage is used). ``task_context``: the try's, from which
        the one location a result in result storage may be read from is recomputed (without it, none may).
        """
        from airflow_provider_torchelastic.operators import results

        if settings is None:
            settings = Settings.read(execution="local", deferrable=False)  # reads no option it does not use
        return results.result_or_raise(
            self.log,
            verdict,
            settings.result_storage,
            last_metrics=last_metrics,
            task_context=task_context,
            artifacts=settings.artifact_storage,
        )

    def render_manifests(self, context: Context | None = None) -> list[dict[str, Any]]:
        """The objects this task would create, in creation order, without touching the network.

        Templated fields are rendered with ``context``; with ``context=None``, with a minimal one for a placeholder
        run (dag, task, ``ti``'s identity, params, readable Variables). A field that cannot be rendered so (it needs
        the real run: an XCom, a date, a missing Variable) is named in a ``UserWarning`` and a placeholder takes its
        place (namespace ``default``, image ``UNRENDERED_IMAGE``, the unrendered arguments in the payload): no
        ``{{ ... }}`` reaches a manifest. The payload is the real one otherwise (so its size counts). The operator
        itself is not changed.
        """
        from airflow_provider_torchelastic.operators.dry_run import render_without_run

        # Rendered as on Kubernetes whatever the execution; deferring is no part of the manifests.
        settings = Settings.read(execution="kubernetes", deferrable=False, job_kind=self.job_kind)
        return render_without_run(self, context, settings)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: a fresh operator instance, so everything comes from the event and XCom.

        ``event`` is the payload of the trigger's :class:`~triggers.JobEnded` or :class:`~triggers.WaitFailed` (a
        plain dict; one written before those classes existed reads the same). The trigger has already applied
        ``on_finish_action`` (or deleted the job at the deadline, or when it could not observe it); only the verdict
        is left to turn into a result or an exception.
        """
        from airflow_provider_torchelastic.operators import on_kubernetes

        # The try did defer; what is left reads only result storage.
        settings = Settings.read(execution="kubernetes", deferrable=True)
        try:
            return on_kubernetes.resume(self, context, event, settings)
        except TrainingError as e:
            self._raise_for_retry_policy(e, context)
            raise

    def _raise_for_retry_policy(self, error: TrainingError, context: Context) -> None:
        """Raise ``error`` as the task's retry_policy needs it (:func:`.exceptions.for_retry_policy`), when that is
        another object: the same one, with the same cause, in its place in the log."""
        ti = context.get("ti")
        tries = {
            "try_number": int(getattr(ti, "try_number", 1) or 1),
            "max_tries": int(getattr(ti, "max_tries", 0) or 0),
        }
        replacement = for_retry_policy(error, self.retry_policy, **tries)
        if replacement is not error:
            raise replacement from error.__cause__

    def _stop(self, ref: JobRef, kube: SyncKube | None = None) -> None:
        """Delete the job unless it has finished: the one way the worker ends a job it no longer waits for."""
        from airflow_provider_torchelastic.operators import on_kubernetes

        on_kubernetes.stop(self, ref, kube)

    def on_kill(self) -> None:
        run = self._local_run
        if run is not None:
            self.log.info("Task killed: stopping the local training processes")
            run.stop()
        if self._job is not None:
            self.log.info("Task killed: stopping %s %s/%s", self._job.kind, self._job.namespace, self._job.name)
            self._stop(self._job)


# The path users import it from, which a serialized DAG's task module, tracebacks and reprs then show.
publish(TorchElasticOperator, module=OPERATORS_MODULE)

"""``TorchElasticOperator``: run a Python training function under torch elastic as one Airflow task.

Importing this module (what a DAG file does at every parse) imports Airflow's SDK but neither torch nor the
kubernetes client: those are imported inside ``execute``.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar, Final

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_torchelastic.config import Elastic, TaskConfig, check_task_config
from airflow_provider_torchelastic.launch import config_to_launch_spec
from airflow_provider_torchelastic.naming import RunIdentity, placeholder_identity
from airflow_provider_torchelastic.outcome import Verdict
from airflow_provider_torchelastic.payload import dump_payload
from airflow_provider_torchelastic.pod import JobOptions, PodOptions
from airflow_provider_torchelastic.render import check_renderable, elide_payload, render_manifests, summarize_for_ui
from airflow_provider_torchelastic.status import JobRef, WaitDecision, WaitPolicy, watch_job

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

    from airflow_provider_torchelastic.kube import SyncKube
    from airflow_provider_torchelastic.local import LocalRun

__all__ = ["TorchElasticOperator", "TrainingFailedError", "TrainingRetryableError"]

EXECUTIONS: Final = ("kubernetes", "local")
CONFIG_SECTION: Final = "torch_elastic"
#: What happens to the job once it ended: delete it, keep it, or delete it only when it succeeded (the default:
#: a failed job's pods and events stay for debugging; the PyTorchJob's ttl / cleanPodPolicy still apply).
FINISH_ACTIONS: Final = ("delete_succeeded", "delete", "keep")
#: task_state_store key of the job this try created; survives a worker crash so the same try re-attaches.
STATE_KEY: Final = "torchelastic_job"
#: XCom keys pushed before deferring (extra links read them, so they survive deferral).
XCOM_JOB_NAME: Final = "job_name"
XCOM_JOB_NAMESPACE: Final = "job_namespace"
XCOM_JOB_KIND: Final = "job_kind"
XCOM_MANIFESTS: Final = "manifests"
_PLACEHOLDER_IMAGE: Final = "image-given-at-run-time"


class TrainingRetryableError(AirflowException):
    """Training failed in a way a retry may fix (``RecoverableError``, out of memory, eviction): Airflow retries."""


class TrainingFailedError(AirflowFailException):
    """Training failed in a way a retry will not fix: the task fails without using its retries."""


def _is_templated(value: object) -> bool:
    return isinstance(value, str) and "{{" in value


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
    :param image: the training image on Kubernetes (Python, torch, cloudpickle and this package; see docker/).
    :param namespace: Kubernetes namespace; default: the connection's, else ``default``.
    :param kubernetes_conn_id: the cncf.kubernetes connection to the cluster.
    :param pod_options: pod customization (env, secrets, GPUs, tolerations, volumes, a full pod template...).
    :param job_options: PyTorchJob-only settings (``schedulingPolicy``, ``suspend``).
    :param deferrable: release the worker slot while the job runs; default ``[torch_elastic] deferrable`` (True).
    :param poll_interval: seconds between status polls on Kubernetes.
    :param pending_grace_seconds: fail once a pod is stuck (image pull, unschedulable, bad config) this long.
    :param on_finish_action: ``delete_succeeded`` (default), ``delete`` or ``keep`` the job once it ended.
    """

    operator_extra_links = (TorchElasticJobLink(), TorchElasticLogsLink())
    # The manifest is built in execute(); show it in the rendered-template view of the run, not the parse-time one.
    overwrite_rtif_after_execution = True

    template_fields: Sequence[str] = ("op_args", "op_kwargs", "image", "namespace", "rendered_job")
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise TypeError(f"python_callable: expected a callable, got {python_callable!r}")
        self.python_callable = python_callable
        self.op_args: Collection[Any] = list(op_args or [])
        self.op_kwargs: Mapping[str, Any] = dict(op_kwargs or {})
        self.task_config: TaskConfig = Elastic() if task_config is None else check_task_config(task_config)
        self.execution = _check_execution(execution)
        self.image = image
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.pod_options = pod_options
        self.job_options = job_options
        self.deferrable = deferrable
        if not isinstance(poll_interval, int | float) or isinstance(poll_interval, bool) or poll_interval <= 0:
            raise ValueError(f"poll_interval: expected seconds > 0, got {poll_interval!r}")
        if not isinstance(pending_grace_seconds, int | float) or pending_grace_seconds < 0:
            raise ValueError(f"pending_grace_seconds: expected seconds >= 0, got {pending_grace_seconds!r}")
        if on_finish_action not in FINISH_ACTIONS:
            raise ValueError(
                f"on_finish_action: expected one of {', '.join(map(repr, FINISH_ACTIONS))}, got {on_finish_action!r}"
            )
        self.poll_interval = float(poll_interval)
        self.pending_grace_seconds = float(pending_grace_seconds)
        self.on_finish_action = on_finish_action
        self.rendered_job: str | None = None
        if self.execution != "local":
            # Render once with a placeholder run, so that a conflicting customization fails while the DAG is parsed.
            check_renderable(
                self.task_config,
                image=self.image if self.image and not _is_templated(self.image) else _PLACEHOLDER_IMAGE,
                pod_options=pod_options,
                job_options=job_options,
            )
        self._local_run: LocalRun | None = None
        self._job: JobRef | None = None

    # --- execution ----------------------------------------------------------------------------------------------

    def resolve_execution(self) -> str:
        """The execution mode: the operator's own, else ``[torch_elastic] execution`` (read at run time)."""
        if self.execution is not None:
            return self.execution
        from airflow.sdk.configuration import conf

        value = conf.get(CONFIG_SECTION, "execution", fallback="kubernetes")
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
            return self._execute_locally(payload)
        return self._execute_on_kubernetes(context, payload)

    def _execute_locally(self, payload: bytes) -> Any:
        from airflow_provider_torchelastic.local import LocalRun, run_locally

        spec = config_to_launch_spec(self.task_config)
        self._local_run = LocalRun()
        try:
            verdict = run_locally(payload, spec, log_line=self.log.info, run=self._local_run)
        finally:
            self._local_run = None
        return self.result_or_raise(verdict)

    def result_or_raise(self, verdict: Verdict) -> Any:
        """Rank 0's result, or the Airflow exception that says what failed and whether a retry can help."""
        if verdict.succeeded:
            self.log.info("Training succeeded; rank 0's result: %r", verdict.result)
            return verdict.result
        if verdict.failure is not None and verdict.failure.traceback:
            self.log.error("Root cause, %s, traceback:\n%s", verdict.failure.summary(), verdict.failure.traceback)
        if verdict.recoverable:
            raise TrainingRetryableError(f"Training failed, a retry may help: {verdict.detail}")
        raise TrainingFailedError(f"Training failed, a retry will not help: {verdict.detail}")

    # --- Kubernetes ----------------------------------------------------------------------------------------------

    def render_manifests(self, context: Context | None = None) -> list[dict[str, Any]]:
        """The objects this task would create, in creation order, without touching the network.

        With ``context=None`` a placeholder run identity is used. The payload is the real one (so its size counts).
        """
        identity = self._identity(context)
        payload = dump_payload(self.python_callable, self.op_args, self.op_kwargs)
        return self._render_objects(identity, self.namespace or "default", payload)

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

    def _render_objects(self, identity: RunIdentity, namespace: str, payload: bytes) -> list[dict[str, Any]]:
        return render_manifests(
            self.task_config,
            identity=identity,
            namespace=namespace,
            image=self.image,
            payload=payload,
            pod_options=self.pod_options,
            job_options=self.job_options,
        )

    def _hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    def _policy(self) -> WaitPolicy:
        return WaitPolicy(poll_interval=self.poll_interval, pending_grace_seconds=self.pending_grace_seconds)

    def _resolve_deferrable(self) -> bool:
        if self.deferrable is not None:
            return bool(self.deferrable)
        from airflow.sdk.configuration import conf

        return conf.getboolean(CONFIG_SECTION, "deferrable", fallback=True)

    def _execute_on_kubernetes(self, context: Context, payload: bytes) -> Any:
        from airflow_provider_torchelastic.kube import SyncKube, drive_sync

        hook = self._hook()
        namespace = self.namespace or hook.get_namespace() or "default"
        try:
            manifests = self._render_objects(self._identity(context), namespace, payload)
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
        ti = context["ti"]
        ti.xcom_push(key=XCOM_JOB_NAME, value=ref.name)
        ti.xcom_push(key=XCOM_JOB_NAMESPACE, value=ref.namespace)
        ti.xcom_push(key=XCOM_JOB_KIND, value=ref.kind)
        ti.xcom_push(key=XCOM_MANIFESTS, value=elided)

        if self._resolve_deferrable():
            self._defer(hook, ref, context)
        # Waiting here: an execution_timeout (AirflowTaskTimeout) or SIGTERM reaches on_kill, which deletes the job.
        decision = drive_sync(watch_job(ref, self._policy()), kube, self.log.info)
        return self._finish(kube, ref, decision)

    def _submit(
        self, kube: SyncKube, ref: JobRef, configmap: dict[str, Any], workload: dict[str, Any], context: Context
    ) -> JobRef:
        """Create the ConfigMap and the job, or re-attach to the job this try already created; returns the job."""
        from airflow_provider_torchelastic.kube import KubeError, retry_sync
        from airflow_provider_torchelastic.render import payload_configmap_owner_reference

        def call(fn: Callable[..., Any], *args: Any) -> Any:
            return retry_sync(functools.partial(fn, *args), self.log.warning)

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
        )
        # The trigger enforces the deadline (and deletes the job); Airflow's own timeout is only a backstop after it.
        backstop = None
        if args.deadline is not None:
            backstop = datetime.timedelta(
                seconds=max(0.0, args.deadline - time.time()) + max(60.0, 2 * self.poll_interval)
            )
        self.log.info("Deferring: the triggerer waits for %s %s/%s", ref.kind, ref.namespace, ref.name)
        self.defer(trigger=TorchElasticJobTrigger(**asdict(args)), method_name="execute_complete", timeout=backstop)

    def _deadline(self, context: Context) -> float | None:
        """``execution_timeout`` as a Unix time, anchored on the try's start (stable across re-deferrals)."""
        if self.execution_timeout is None:
            return None
        start = getattr(context["ti"], "start_date", None)
        started = start.timestamp() if start is not None else time.time()
        return started + self.execution_timeout.total_seconds()

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: a fresh operator instance, so everything comes from the event and XCom."""
        from airflow_provider_torchelastic.kube import SyncKube
        from airflow_provider_torchelastic.triggers import EVENT_ERROR

        ti = context["ti"]
        ref = JobRef(
            kind=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_KIND, map_indexes=ti.map_index),
            name=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAME, map_indexes=ti.map_index),
            namespace=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAMESPACE, map_indexes=ti.map_index),
        )
        manifests = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_MANIFESTS, map_indexes=ti.map_index)
        if manifests:
            self.rendered_job = summarize_for_ui(manifests)
        kube = SyncKube(self._hook().api_client)
        if event.get("status") == EVENT_ERROR:
            # We lost track of the job: do not leave it holding the cluster; a retry starts a fresh one.
            self._delete(kube, ref)
            raise TrainingRetryableError(
                f"Waiting for {ref.kind} {ref.namespace}/{ref.name} failed: {event.get('message')}"
            )
        return self._finish(kube, ref, WaitDecision.from_event(event))

    def _finish(self, kube: SyncKube, ref: JobRef, decision: WaitDecision) -> Any:
        verdict = decision.verdict or Verdict(succeeded=False, detail=decision.progress)
        self.log.info("%s %s/%s ended: %s", ref.kind, ref.namespace, ref.name, decision.progress)
        if self.on_finish_action == "delete" or (self.on_finish_action == "delete_succeeded" and verdict.succeeded):
            self._delete(kube, ref)
        else:
            self.log.info(
                "Keeping %s %s/%s (on_finish_action=%s)", ref.kind, ref.namespace, ref.name, self.on_finish_action
            )
        return self.result_or_raise(verdict)

    def _delete(self, kube: SyncKube, ref: JobRef) -> None:
        from airflow_provider_torchelastic.render import payload_configmap_name

        deleted = kube.delete(ref.kind, ref.name, ref.namespace)
        # The ConfigMap is owned by the job and garbage-collected with it; deleting it too costs one call and leaves
        # nothing behind where no garbage collector runs.
        kube.delete("ConfigMap", payload_configmap_name(ref.name), ref.namespace)
        self.log.info("Deleted %s %s/%s (existed: %s)", ref.kind, ref.namespace, ref.name, deleted)

    def on_kill(self) -> None:
        run = self._local_run
        if run is not None:
            self.log.info("Task killed: stopping the local training processes")
            run.stop()
        if self._job is not None:
            from airflow_provider_torchelastic.kube import SyncKube

            self.log.info("Task killed: deleting %s %s/%s", self._job.kind, self._job.namespace, self._job.name)
            self._delete(SyncKube(self._hook().api_client), self._job)

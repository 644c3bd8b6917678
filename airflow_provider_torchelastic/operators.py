"""``TorchElasticOperator``: run a Python training function under torch elastic as one Airflow task.

Importing this module (what a DAG file does at every parse) imports Airflow's SDK but neither torch nor the
kubernetes client: those are imported inside ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_torchelastic.config import Elastic, TaskConfig, check_task_config
from airflow_provider_torchelastic.launch import config_to_launch_spec
from airflow_provider_torchelastic.outcome import Verdict
from airflow_provider_torchelastic.payload import dump_payload

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.local import LocalRun

__all__ = ["TorchElasticOperator", "TrainingFailedError", "TrainingRetryableError"]

EXECUTIONS: Final = ("kubernetes", "local")
CONFIG_SECTION: Final = "torch_elastic"


class TrainingRetryableError(AirflowException):
    """Training failed in a way a retry may fix (``RecoverableError``, out of memory, eviction): Airflow retries."""


class TrainingFailedError(AirflowFailException):
    """Training failed in a way a retry will not fix: the task fails without using its retries."""


def _check_execution(value: object) -> str | None:
    if value is None or value in EXECUTIONS:
        return value  # type: ignore[return-value]
    raise ValueError(f"execution: expected 'kubernetes' or 'local' (or None for [torch_elastic] execution), got {value!r}")


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
    """

    template_fields: Sequence[str] = ("op_args", "op_kwargs", "image", "namespace")
    template_fields_renderers: ClassVar[dict[str, str]] = {"op_args": "py", "op_kwargs": "py"}
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise TypeError(f"python_callable: expected a callable, got {python_callable!r}")
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        self.task_config: TaskConfig = Elastic() if task_config is None else check_task_config(task_config)
        self.execution = _check_execution(execution)
        self.image = image
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self._local_run: LocalRun | None = None

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
        raise AirflowFailException(
            "execution='kubernetes' is not available in this version of airflow-provider-torchelastic; use "
            "execution='local' (or set [torch_elastic] execution = local / AIRFLOW__TORCH_ELASTIC__EXECUTION=local)"
        )

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

    def on_kill(self) -> None:
        run = self._local_run
        if run is not None:
            self.log.info("Task killed: stopping the local training processes")
            run.stop()

"""The local backend (``execution="local"``): the try's nodes as runner subprocesses of the Airflow worker
(:mod:`...local.run`), with the same payload, run context and result path as in pods; no cluster, no deferral."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

from airflow_provider_torchelastic.core.launch import config_to_launch_spec
from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV
from airflow_provider_torchelastic.core.stall import liveness_env
from airflow_provider_torchelastic.operators import results
from airflow_provider_torchelastic.operators.backends.base import Attempt, Plan, TaskSpec

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.core.launch import LaunchSpec
    from airflow_provider_torchelastic.local.run import LocalRun
    from airflow_provider_torchelastic.settings import Settings

__all__ = ["LocalBackend"]

#: How a plan names the folder a run creates for its payload and results (a fresh temporary one per run).
RUN_FOLDER: Final = Path("<run folder>")


class LocalBackend:
    """A try as runner processes on this machine: ``prepare`` shows their command lines and what the run adds to
    their environment, ``submit`` holds the run for ``stop`` (``on_kill``), and ``wait`` runs it to its end."""

    execution: ClassVar[str] = "local"
    can_defer: ClassVar[bool] = False

    def __init__(self, task: TaskSpec) -> None:
        self.task = task
        self.rendered: str | None = None
        # What prepare() derived for the run (its launch spec, result location and extra environment), which wait()
        # launches with: computed once.
        self._launch: tuple[LaunchSpec, str | None, dict[str, str]] | None = None

    def prepare(self, attempt: Attempt) -> Plan:
        """One object per node: its runner's command line and the environment the run gives it beyond the Airflow
        worker's own (which it inherits, less Airflow's settings and credentials: :mod:`...local.run`). The run's
        folder and, with several nodes, its rendezvous port are chosen when it starts."""
        from airflow_provider_torchelastic.local.run import added_env, node_commands, run_env

        spec = config_to_launch_spec(self.task.task_config)
        url = results.result_url(attempt.settings.result_storage, attempt.task_context)
        extra = self._extra_env(attempt.settings)
        self._launch = (spec, url, extra)
        env = added_env(run_env(attempt.task_context, self.task.termination_grace_period, extra, workdir=RUN_FOLDER))
        commands = node_commands(spec, workdir=RUN_FOLDER, result_url=url)
        objects = [{"node": index, "command": command, "env": env} for index, command in enumerate(commands)]
        return Plan(self.execution, objects, shown=objects)

    def submit(self, attempt: Attempt, plan: Plan) -> LocalRun:
        """The run, not started yet: ``wait`` starts its nodes; ``stop`` before then keeps them from starting."""
        from airflow_provider_torchelastic.local.run import LocalRun

        return LocalRun(grace_period=self.task.termination_grace_period)

    def wait(self, attempt: Attempt, handle: object) -> Any:
        """Run the nodes to their end; rank 0's result, or the task's exception."""
        from airflow_provider_torchelastic.core.tap import MetricsTap
        from airflow_provider_torchelastic.local.run import LocalRun, run_locally

        assert isinstance(handle, LocalRun) and attempt.context is not None and self._launch is not None
        spec, url, extra = self._launch
        # Rank 0's metrics lines become progress lines; the tap keeps them, and the log's tail, for the job summary.
        tap = MetricsTap(self.task.log.info, keep_unprefixed=True)
        started = time.time()
        verdict = run_locally(
            attempt.payload,
            spec,
            log_line=tap,
            run=handle,
            task_context=attempt.task_context,
            result_url=url,
            extra_env=extra,
        )
        summary = results.local_summary(attempt.identity, spec, handle, verdict, tap, started)
        return results.finish(
            self.task.log,
            attempt.context,
            summary,
            lambda: results.settle(
                self.task.log,
                verdict,
                attempt.settings,
                last_metrics=tap.summary_line(),
                task_context=attempt.task_context,
            ),
        )

    def resume(self, context: Context, event: Mapping[str, Any], settings: Settings) -> Any:
        raise NotImplementedError("local execution never defers")

    def stop(self, handle: object) -> None:
        """The task is killed: stop the nodes (SIGTERM, then SIGKILL after ``termination_grace_period``); safe from
        any thread."""
        from airflow_provider_torchelastic.local.run import LocalRun

        assert isinstance(handle, LocalRun)
        self.task.log.info("Task killed: stopping the local training processes")
        handle.stop()

    def _extra_env(self, settings: Settings) -> dict[str, str]:
        """What every node gets beyond the run context: the workers' metrics interval (as rendered into pods) and
        their stall and stop settings."""
        interval = settings.report_interval
        return {
            **({} if interval is None else {INTERVAL_ENV: f"{interval:g}"}),
            **liveness_env(self.task.stall_timeout, self.task.termination_grace_period),
        }

"""What a test holds: a running deployment and an authenticated REST client for it."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.airflow_services.client import AirflowClient
from tests.airflow_services.deployment import Deployment, DeploymentError, DeploymentInfo, load_info, marked_processes
from tests.cluster.control_plane import signal_proc, wait_gone


class AirflowServices(AirflowClient):
    """The REST helpers of :class:`AirflowClient` (``api``, ``trigger_dag``, ``wait_for_run``, ``task_instance``,
    ``xcom``, ``set_task_state`` ...) plus control of the processes behind them."""

    def __init__(self, deployment: Deployment) -> None:
        info = deployment.info or load_info(deployment.state_dir)
        if info is None:
            raise DeploymentError(f"no deployment is up in {deployment.state_dir}")
        super().__init__(info.base_url, info.username, info.password)
        self.deployment = deployment
        self.info: DeploymentInfo = info

    @classmethod
    def attach(cls, state_dir: Path) -> AirflowServices:
        """A deployment started elsewhere (``python -m tests.airflow_services up``)."""
        return cls(Deployment(state_dir))

    @property
    def state_dir(self) -> Path:
        return self.info.state_dir

    @property
    def home(self) -> Path:
        """AIRFLOW_HOME; task and trigger logs are under ``home / "logs"``."""
        return self.info.home

    def restart(self, process_name: str, sig: int = signal.SIGTERM) -> int:
        """Stop ``dag-processor``, ``scheduler``, ``triggerer`` or ``api-server`` with ``sig`` and start it again;
        returns the new pid once the process is healthy (for the heartbeating ones: has beaten since)."""
        return self.deployment.restart(process_name, sig)

    def kill_task(self, ti: Mapping[str, Any], sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the process that runs the task instance ``ti`` (as the REST API returns it), not to the
        supervisor above it, which sees it die and reports the try failed: what an OOM kill of the task does.
        Returns its pid.

        The supervisor registers its child's pid when the try starts (the REST API's ``pid``); it is signalled only
        if it is one of this deployment's processes.
        """
        found = [p for p in marked_processes(self.state_dir) if p.pid == ti.get("pid")]
        if not found:
            raise DeploymentError(
                f"task instance {ti.get('id')}'s pid {ti.get('pid')} is no process of this deployment"
            )
        signal_proc(found[0], sig)
        if sig == signal.SIGKILL:
            wait_gone(found, 10)
        return found[0].pid

    def log_text(self, process_name: str) -> str:
        """What a process (or ``db-migrate``, ``postgres``) wrote to its log so far."""
        return self.info.log_file(process_name).read_text(errors="replace")

    def trigger_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """What the task's trigger logged, in every triggerer that ran it (``<task log>.trigger.<job id>.log``):
        the trigger's own lines and the triggerer's about it (cancelled, on_kill, fired), not in the triggerer's
        process log."""
        logs = sorted(self._task_log_dir(dag_id, run_id, task_id).glob(f"attempt={try_number}.log.trigger.*.log"))
        return "".join(log.read_text(errors="replace") for log in logs)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """What the try logged in its worker (``attempt=<try>.log``; the trigger's lines are in :meth:`trigger_log`)."""
        log = self._task_log_dir(dag_id, run_id, task_id) / f"attempt={try_number}.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def describe(self, lines: int = 15) -> str:
        """The tail of every process log, for failure messages."""
        return self.deployment.describe(lines)

    def _task_log_dir(self, dag_id: str, run_id: str, task_id: str) -> Path:
        return self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"

"""The Airflow REST API (``/api/v2``) as the tests use it, authenticated as the deployment's admin.

Airflow 3.3's default auth manager is SimpleAuthManager: users come from ``[core] simple_auth_manager_users`` and
their passwords from its password file; ``POST /auth/token`` with a username and password returns a JWT
(``access_token``) that the public API takes as a bearer token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

TERMINAL_RUN_STATES = frozenset({"success", "failed"})


class AirflowAPIError(AssertionError):
    """An unexpected answer from the REST API; the message holds the request and the answer's body."""


class AirflowClient:
    """An authenticated REST client (``.api``, an ``httpx.Client`` rooted at ``/api/v2``) and the helpers tests need."""

    def __init__(self, base_url: str, username: str, password: str, *, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        answer = httpx.post(
            f"{self.base_url}/auth/token", json={"username": username, "password": password}, timeout=timeout
        )
        if answer.status_code != 201:
            raise AirflowAPIError(f"POST /auth/token: HTTP {answer.status_code}: {answer.text[:500]}")
        token = answer.json()["access_token"]
        self.api = httpx.Client(
            base_url=f"{self.base_url}/api/v2", headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def close(self) -> None:
        self.api.close()

    # -- plain calls --------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, ok: Iterable[int] = (200,), **kwargs: Any) -> httpx.Response:
        answer = self.api.request(method, path, **kwargs)
        if answer.status_code not in set(ok):
            raise AirflowAPIError(f"{method} {path}: HTTP {answer.status_code}: {answer.text[:1000]}")
        return answer

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None).json()

    # -- DAGs and runs ------------------------------------------------------------------------------------------

    def wait_for_dag(self, dag_id: str, timeout: float = 90.0) -> dict[str, Any]:
        """The DAG, once the dag-processor has parsed and serialized it."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.request("GET", f"/dags/{dag_id}", ok=(200, 404))
            if answer.status_code == 200:
                return answer.json()
            if time.monotonic() > deadline:
                errors = self.get("/importErrors").get("import_errors", [])
                raise AirflowAPIError(f"DAG {dag_id} was not parsed within {timeout:.0f}s; import errors: {errors}")
            time.sleep(0.5)

    def trigger_dag(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """A manual run of ``dag_id`` (waiting until it is parsed); returns its run id."""
        self.wait_for_dag(dag_id)
        run = self.request("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}}).json()
        return str(run["dag_run_id"])

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.get(f"/dags/{dag_id}/dagRuns/{run_id}")

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 180.0) -> str:
        """The run's state once it is ``success`` or ``failed``."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.dag_run(dag_id, run_id)["state"]
            if state in TERMINAL_RUN_STATES:
                return str(state)
            if time.monotonic() > deadline:
                tis = self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
                summary = {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in tis}
                raise AirflowAPIError(f"run {dag_id}/{run_id} still {state} after {timeout:.0f}s; tasks: {summary}")
            time.sleep(0.5)

    # -- task instances and XComs ---------------------------------------------------------------------------

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")

    def wait_for_task(
        self,
        dag_id: str,
        run_id: str,
        task_id: str,
        until: Callable[[dict[str, Any]], bool],
        timeout: float = 120.0,
        what: str = "the task",
    ) -> dict[str, Any]:
        """Poll the task instance until ``until(ti)``; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            ti = self.task_instance(dag_id, run_id, task_id)
            if until(ti):
                return ti
            if time.monotonic() > deadline:
                raise AirflowAPIError(
                    f"timed out after {timeout:.0f}s waiting for {what}; task {task_id} is {ti['state']}"
                )
            time.sleep(0.5)

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        entry = self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")
        return entry["value"]

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str = "failed") -> list[dict[str, Any]]:
        """What a user's "mark failed" (or success, skipped) does; returns the changed task instances."""
        answer = self.request(
            "PATCH", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}", json={"new_state": state}
        )
        return list(answer.json()["task_instances"])

    def health(self) -> dict[str, Any]:
        return self.get("/monitor/health")

"""A backend written as a user of the protocol would write one (docs/contributing.md shows it): it runs the training
function in the Airflow worker's own process, as one rank. Registered by the tests that use it, as
``BACKENDS["inline"]``; the package itself never names it."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from airflow_provider_torchelastic.core.payload import load_payload
from airflow_provider_torchelastic.operators.backends import Attempt, Plan, TaskSpec


class InlineBackend:
    execution: ClassVar[str] = "inline"
    can_defer: ClassVar[bool] = False

    def __init__(self, task: TaskSpec) -> None:
        self.task = task
        self.rendered: str | None = None

    def prepare(self, attempt: Attempt) -> Plan:
        call = {"runs": "in the Airflow worker's process", "payload_bytes": len(attempt.payload)}
        return Plan(self.execution, [call], shown=[call])

    def submit(self, attempt: Attempt, plan: Plan) -> threading.Event:
        return threading.Event()  # set by stop(): this backend can only refuse to start

    def wait(self, attempt: Attempt, handle: object) -> Any:
        assert isinstance(handle, threading.Event)
        if handle.is_set():
            raise RuntimeError("stopped before it started")
        payload = load_payload(attempt.payload)
        return payload.fn(*payload.args, **payload.kwargs)

    def resume(self, context: Any, event: Mapping[str, Any], settings: Any) -> Any:
        raise NotImplementedError("never defers")

    def stop(self, handle: object) -> None:
        assert isinstance(handle, threading.Event)
        handle.set()

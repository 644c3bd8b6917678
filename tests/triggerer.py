"""Airflow's own trigger runner, fed trigger rows as the ``airflow triggerer`` process feeds it, in this process.

The ``airflow triggerer`` process is a supervisor (reading ``trigger`` rows from the metadata DB) and a
``TriggerRunner`` subprocess it talks to over a socket. :class:`InProcessTriggerer` keeps the runner and drops the
socket: it hands the runner the same ``RunTrigger`` workloads (classpath and Fernet-encrypted kwargs, as stored in
the row) and runs the runner's own loop steps (create, cancel as a user action, clean up), collecting the events it
would send back. Everything between a trigger row and its event is Airflow's code: the runner's
``SharedStreamManager`` groups triggers by ``shared_stream_key()``, calls ``on_kill()`` on a user cancel, and so on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class InProcessTriggerer:
    """One ``TriggerRunner``; create it inside a running event loop (it binds asyncio objects)."""

    def __init__(self) -> None:
        from airflow.jobs.triggerer_job_runner import TriggerRunner

        self.runner = TriggerRunner()
        self._ids = itertools.count(1)
        #: trigger id -> (event payload, time.time() when the runner emitted it)
        self.events: dict[int, list[tuple[dict[str, Any], float]]] = defaultdict(list)
        self.failed: dict[int, BaseException | None] = {}

    def add(self, trigger: Any) -> int:
        """Queue a trigger as the supervisor queues a new ``trigger`` row; returns its id."""
        from airflow.executors.workloads.trigger import RunTrigger
        from airflow.models.trigger import Trigger

        classpath, kwargs = trigger.serialize()
        trigger_id = next(self._ids)
        self.runner.to_create.append(
            RunTrigger(id=trigger_id, classpath=classpath, encrypted_kwargs=Trigger.encrypt_kwargs(kwargs))
        )
        return trigger_id

    def cancel(self, trigger_id: int) -> None:
        """What marking the deferred task failed does: a user-action cancel, which calls ``on_kill()``."""
        self.runner.to_cancel.append(trigger_id)

    @property
    def running(self) -> set[int]:
        return set(self.runner.triggers)

    async def step(self) -> None:
        """One pass of the runner's main loop, minus the socket."""
        runner = self.runner
        await runner.cleanup_finished_triggers()
        await runner.create_triggers()
        await runner.cancel_triggers()
        now = time.time()
        while runner.events:
            entry = runner.events.popleft()
            self.events[entry.trigger_id].append((dict(entry.event.payload), now))
        while runner.failed_triggers:
            trigger_id, exc = runner.failed_triggers.popleft()
            self.failed[trigger_id] = exc

    async def run_until(self, done: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while True:
            await self.step()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; failed: {self.failed}")
            await asyncio.sleep(interval)

    def event(self, trigger_id: int) -> dict[str, Any]:
        return self.events[trigger_id][0][0]

    async def close(self) -> None:
        for details in list(self.runner.triggers.values()):
            details["task"].cancel()
        for details in list(self.runner.triggers.values()):
            with contextlib.suppress(BaseException):
                await details["task"]
        await self.runner._shared_streams.stop_all()

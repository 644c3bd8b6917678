"""Stopping a local run (the task's ``on_kill``) leaves nothing running: not the nodes, not their workers, which
run in sessions of their own (``runner.worker.leave_agent_session``), and not what the training function started."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time

import pytest

from airflow_provider_torchelastic.core.launch import LaunchSpec
from airflow_provider_torchelastic.core.payload import dump_payload
from airflow_provider_torchelastic.local.run import LocalRun, run_locally
from tests.runner.support import gone

pytestmark = pytest.mark.slow


def start_a_helper_and_sleep() -> None:
    # A process of the function's own, in yet another session: nothing but the process tree links it to the run.
    helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    print(f"started: worker={os.getpid()} helper={helper.pid}", flush=True)
    time.sleep(300)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_stopped_local_run_leaves_no_worker_and_nothing_they_started(start_method: str) -> None:
    spec = LaunchSpec(
        min_nodes=1, max_nodes=1, nproc_per_node=2, start_method=start_method,
        monitor_interval=0.3, max_restarts=0, rdzv_configs={},
    )  # fmt: skip
    run = LocalRun(grace_period=5)  # the workers ignore the stop request: killed 5 s after it
    pids: list[int] = []
    lines: list[str] = []

    def log_line(line: str) -> None:
        lines.append(line)
        if match := re.search(r"started: worker=(\d+) helper=(\d+)", line):
            pids.extend(int(pid) for pid in match.groups())
            if len(pids) == 4:
                threading.Thread(target=run.stop, daemon=True).start()

    result: list[object] = []
    runner = threading.Thread(
        target=lambda: result.append(
            run_locally(dump_payload(start_a_helper_and_sleep), spec, log_line=log_line, run=run)
        )
    )
    runner.start()
    runner.join(timeout=180)
    try:
        assert not runner.is_alive(), "\n".join(lines)
        assert len(pids) == 4, "\n".join(lines)
        verdict = result[0]
        assert "stopped" in verdict.detail  # type: ignore[attr-defined]
        # run_locally promises every process is gone when it returns: no waiting here.
        assert [pid for pid in pids if not gone(pid)] == [], "\n".join(lines)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

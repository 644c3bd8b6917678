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


def print_where_files_go_and_sleep() -> None:
    import tempfile

    # The agent's log folder (the workers' output, copied by torch) holds the error file; tempfile's folder is where
    # the agent made it, and where the training code's own temporary files go.
    print(f"files: error={os.environ['TORCHELASTIC_ERROR_FILE']} tmp={tempfile.gettempdir()}", flush=True)
    time.sleep(300)


def test_a_killed_node_leaves_no_temporary_files_behind() -> None:
    # A node killed outright (the OOM killer, SIGKILL) cannot remove its own folders; the local run removes them.
    spec = LaunchSpec(
        min_nodes=1, max_nodes=1, nproc_per_node=1, start_method="spawn",
        monitor_interval=0.3, max_restarts=0, rdzv_configs={},
    )  # fmt: skip
    run = LocalRun(grace_period=5)
    lines: list[str] = []
    where: dict[str, str] = {}

    def log_line(line: str) -> None:
        lines.append(line)
        if match := re.search(r"files: error=(\S+) tmp=(\S+)", line):
            where.update(error=match[1], tmp=match[2])
            os.kill(run.processes[0].pid, 9)

    verdict = run_locally(dump_payload(print_where_files_go_and_sleep), spec, log_line=log_line, run=run)
    assert not verdict.succeeded and where, "\n".join(lines)
    # The agent's folders are made in a folder of the run's own, which the run removes whatever became of the node.
    assert where["error"].startswith(where["tmp"] + os.sep), where
    assert not os.path.exists(where["tmp"]), where

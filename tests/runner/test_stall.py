"""Stalled ranks and graceful stops, through the real runner with gloo on CPU (issue 35).

Each case runs ``python -m airflow_provider_torchelastic.runner`` with 2 spawned workers and a short
``--stall-timeout``; the stall or the stop is real (a rank asleep before a collective, a pure-Python loop, SIGTERM to
the runner as the kubelet sends it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.outcome import NodeReport, decide_run
from airflow_provider_torchelastic.errors import EXIT_RECOVERABLE
from tests.runner.support import run_runner, runner_command, runner_env, write_payload

pytestmark = pytest.mark.slow

LIMIT = "6"


def _verdict_cause(run: object) -> str:
    outcome = run.outcome  # type: ignore[attr-defined]
    return decide_run([NodeReport(name="runner", exit_code=run.returncode, outcome=outcome)]).cause  # type: ignore[attr-defined]


def rank1_asleep_before_all_reduce() -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(600)  # stuck: never enters the collective its peer waits in
    dist.all_reduce(torch.ones(1))


def test_a_rank_asleep_before_a_collective_is_a_recoverable_stall_with_both_stacks(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_runner(tmp_path, rank1_asleep_before_all_reduce, extra=["--stall-timeout", LIMIT], timeout=120)
    elapsed = time.monotonic() - started
    assert run.returncode == EXIT_RECOVERABLE, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.recoverable and failure.exception == "TrainingStalled", run.describe()
    # The stalled ranks are the silent ones, the waiting rank 0 included (it is silent too); which crossed the limit
    # first depends on which started first.
    assert "stall_timeout=6 s" in failure.message, failure.message
    # Each stalled rank is named with how long it was silent when the runner looked: the limit or a little more (the
    # watchdog looks every tenth of the limit, and CI once saw 7 s on a busy machine).
    silent = [int(seconds) for seconds in re.findall(r"rank \d+ for (\d+) s", failure.message)]
    assert silent and all(6 <= seconds < 6 + 10 for seconds in silent), failure.message
    # Both stacks: the waiting rank in all_reduce, the stuck one in its sleep.
    assert "--- rank 0: main thread, innermost first ---" in failure.traceback, failure.traceback
    assert "--- rank 1: main thread, innermost first ---" in failure.traceback, failure.traceback
    assert "all_reduce" in failure.traceback and "rank1_asleep_before_all_reduce" in failure.traceback
    # torch's Flight Recorder names the rank that never entered the collective the other waits in.
    assert "rank(s) 0 entered gloo:all_reduce" in failure.message and "rank(s) 1 never entered it" in failure.message, (
        failure.message
    )
    assert _verdict_cause(run) == causes.STALLED
    # The limit, plus worker start-up (torch's import on 2 busy cores) and the forensics: well within limit + 60 s.
    assert elapsed < 6 + 60, run.describe()


def rank0_spins_rank1_returns() -> None:
    import os

    if os.environ["RANK"] == "0":
        x = 0
        while True:  # a pure-Python loop: holds the GIL, no collective, never ends
            x += 1


def test_a_pure_python_loop_is_a_stall_and_a_returned_peer_is_named(tmp_path: Path) -> None:
    run = run_runner(tmp_path, rank0_spins_rank1_returns, extra=["--stall-timeout", LIMIT], timeout=120)
    assert run.returncode == EXIT_RECOVERABLE, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == "TrainingStalled" and failure.rank == 0, run.describe()
    assert "rank 0 for" in failure.message and "rank(s) 1 had returned" in failure.message, failure.message
    assert "rank0_spins_rank1_returns" in failure.message, failure.message  # its top frame, in the message itself


def rank1_exits_hard() -> None:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a result, while rank 0 waits for it
    dist.all_reduce(torch.ones(1))


def test_a_rank_gone_without_a_result_ends_the_job_within_the_limit_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_runner(tmp_path, rank1_exits_hard, extra=["--stall-timeout", "20"], timeout=120)
    # gloo sees the peer's socket close: the waiting rank fails at once, and says who left.
    assert run.returncode != 0 and time.monotonic() - started < 20 + 60, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and "rank(s) 1 left without a result" in failure.message, run.describe()


def quiet_but_stepping(steps: int) -> int:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # A fixed number of steps, the same on every rank (a loop on each rank's own clock would leave one rank in an
    # all_reduce its peer never enters: a real hang, which the watchdog rightly reports).
    for _ in range(steps):  # prints nothing, reports nothing: only its optimizer steps show progress
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.5)
    return steps


def test_a_quiet_rank_that_steps_its_optimizer_is_not_stalled(tmp_path: Path) -> None:
    # The first optimizer step imports much of torch (dynamo, sympy): slow on a busy machine, hence 10 s, not less.
    run = run_runner(tmp_path, quiet_but_stepping, args=(30,), extra=["--stall-timeout", "10"], timeout=120)
    assert run.returncode == 0, run.describe()
    assert run.outcome.result == 30  # type: ignore[union-attr]


def silent_for(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "done"


def test_with_the_limit_off_a_long_silence_is_not_a_stall(tmp_path: Path) -> None:
    run = run_runner(tmp_path, silent_for, args=(6.0,), extra=["--stall-timeout", "none"], nproc=1, timeout=120)
    assert run.returncode == 0 and run.outcome.result == "done", run.describe()  # type: ignore[union-attr]


def save_when_asked(folder: str) -> str:
    import os
    import time
    from pathlib import Path

    from airflow_provider_torchelastic import context

    ctx = context.current()
    print(f"training rank={ctx.rank}", flush=True)
    step = 0
    while not ctx.stop_requested():
        step += 1
        time.sleep(0.1)
    time.sleep(2)  # a checkpoint save that takes a moment
    Path(folder, f"saved-{os.environ['RANK']}").write_text(str(step))
    return "stopped early"


def _start(tmp_path: Path, fn: object, args: tuple[object, ...], extra: list[str]) -> subprocess.Popen[str]:
    payload = write_payload(tmp_path, fn, args)  # type: ignore[arg-type]
    env = runner_env(TORCHELASTIC_CONTEXT='{"dag_id": "d", "task_id": "t", "run_id": "r", "try_number": 1}')
    return subprocess.Popen(
        runner_command(payload, tmp_path / "result.json", extra=extra),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _sigterm_when_training(proc: subprocess.Popen[str], ranks: int = 2) -> str:
    lines = []
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        lines.append(line)
        if "training rank=" in line:
            seen += 1
            if seen == ranks:
                time.sleep(0.5)
                os.kill(proc.pid, signal.SIGTERM)  # only the runner, as a kubelet signals a container's PID 1
                break
    output, _ = proc.communicate(timeout=90)
    return "".join(lines) + output


def test_sigterm_lets_the_function_save_and_the_try_fails_as_preempted(tmp_path: Path) -> None:
    proc = _start(tmp_path, save_when_asked, (str(tmp_path),), ["--grace-period", "40"])
    try:
        output = _sigterm_when_training(proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == EXIT_RECOVERABLE, output
    assert (tmp_path / "saved-0").exists() and (tmp_path / "saved-1").exists(), output
    from airflow_provider_torchelastic.core.outcome import decode_outcome

    outcome = decode_outcome((tmp_path / "result.json").read_text())
    failure = outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == "StopRequested" and failure.recoverable, output
    assert "saw stop_requested() and ended" in failure.message, failure.message
    cause = decide_run([NodeReport(name="runner", exit_code=proc.returncode, outcome=outcome)]).cause
    assert cause == causes.PREEMPTED


def ignore_stop(_: str) -> None:
    import time

    from airflow_provider_torchelastic import context

    print(f"training rank={context.current().rank}", flush=True)
    time.sleep(600)


def test_a_function_that_ignores_the_stop_is_stopped_at_the_deadline_with_its_stacks(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = _start(tmp_path, ignore_stop, (str(tmp_path),), ["--grace-period", "6"])
    try:
        output = _sigterm_when_training(proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == EXIT_RECOVERABLE, output
    assert time.monotonic() - started < 60, output
    from airflow_provider_torchelastic.core.outcome import decode_outcome

    failure = decode_outcome((tmp_path / "result.json").read_text()).failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == "StopRequested", output
    assert "did not finish within" in failure.message and "ignore_stop" in failure.traceback, failure

"""Which worker the runner blames when several fail together: the cause, not its victims.

torch's agent reports one failed worker per poll (with function workers, the first failed process it finds, usually
the lowest local rank) and stamps failures with whole seconds. When rank 1 raises, rank 0 fails a few milliseconds
later in its next collective (gloo's "Connection closed by peer"), and torch then reports rank 0. The runner reads
every failed worker of the attempt from its log dir instead, each with its own sub-second time.

The first tests build the log dir's layout by hand with torch's own ``ProcessFailure``/``ChildFailedError``; the
slow ones run the runner for real with 2 gloo workers. Those use a 2 s monitor interval: both workers have failed
before the agent polls, which is when torch reports the wrong one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from airflow_provider_torchelastic import RecoverableError
from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_RECOVERABLE
from airflow_provider_torchelastic.runner import (
    EXCEPTION_MARKER,
    FAILED_AT_MARKER,
    RECOVERABLE_MARKER,
    failure_from_child_failed,
)
from tests.runner.support import run_runner

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2486. "
    "This is typically caused by a remote worker crashing."
)


# --- the log dir, by hand -------------------------------------------------------------------------------------------


def write_worker(
    attempt: Path,
    local_rank: int,
    *,
    raised: str | None = None,
    failed_at: float | None = None,
    recoverable: bool = False,
    error_file: bool = True,
    whole_seconds: int = 1000,
) -> Path:
    """A worker's folder as torch and the runner leave it: ``error.json`` (torch) and the runner's markers."""
    folder = attempt / str(local_rank)
    folder.mkdir(parents=True)
    if raised is not None and error_file:
        data = {
            "message": {
                "message": raised,
                "extraInfo": {"py_callstack": f"Traceback ...\n{raised}\n", "timestamp": str(whole_seconds)},
            }
        }
        (folder / "error.json").write_text(json.dumps(data))
    if raised is not None and failed_at is not None:
        name, _, message = raised.partition(": ")
        (folder / FAILED_AT_MARKER).write_text(repr(failed_at))
        (folder / EXCEPTION_MARKER).write_text(json.dumps({"exception": name, "message": message}))
    if recoverable:
        (folder / RECOVERABLE_MARKER).touch()
    return folder / "error.json"


def child_failed(failures: dict[int, tuple[int, int, Path]]):
    """torch's ChildFailedError: global rank -> (local rank, exit code, error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError(
        name="entrypoint",
        failures={
            rank: ProcessFailure(local_rank=local, pid=4000 + local, exitcode=code, error_file=str(path))
            for rank, (local, code, path) in failures.items()
        },
    )


@pytest.fixture
def attempt(tmp_path: Path) -> Path:
    folder = tmp_path / "logs" / "run-id_abc" / "attempt_0"
    folder.mkdir(parents=True)
    return folder


def test_the_reported_victim_loses_to_its_unreported_peer(attempt: Path) -> None:
    # Node 1 of a 2-node job: global ranks 2 and 3. torch reported local rank 0, in the same whole second.
    victim = write_worker(attempt, 0, raised=f"RuntimeError: {GLOO_CLOSED}", failed_at=1000.31)
    write_worker(attempt, 1, raised="FlakyStorageError: bucket timed out", failed_at=1000.29, recoverable=True)
    failure = failure_from_child_failed(child_failed({2: (0, 1, victim)}), attempt.parent.parent)
    assert (failure.rank, failure.exception, failure.message) == (3, "FlakyStorageError", "bucket timed out")
    assert failure.recoverable is True and failure.timestamp == 1000.29
    assert "FlakyStorageError: bucket timed out" in failure.traceback


def test_a_known_cause_wins_even_when_its_victim_was_earlier(attempt: Path) -> None:
    # Clocks of one node agree, but a cause may still be stamped later than what it broke (flushing, a slow exit).
    victim = write_worker(attempt, 0, raised=f"RuntimeError: {GLOO_CLOSED}", failed_at=1000.1)
    write_worker(attempt, 1, raised="ValueError: label 7 is out of range", failed_at=1000.2)
    failure = failure_from_child_failed(child_failed({0: (0, 1, victim)}), attempt.parent.parent)
    assert (failure.rank, failure.exception, failure.recoverable) == (1, "ValueError", False)


def test_every_reported_failure_gets_its_own_sub_second_time(attempt: Path) -> None:
    first = write_worker(attempt, 0, raised="KeyError: 'label'", failed_at=1000.9)
    second = write_worker(attempt, 1, raised="IndexError: 9", failed_at=1000.4)
    failure = failure_from_child_failed(child_failed({0: (0, 1, first), 1: (1, 1, second)}), attempt.parent.parent)
    assert (failure.rank, failure.exception, failure.timestamp) == (1, "IndexError", 1000.4)


def test_a_worker_stopped_before_torch_wrote_its_error_file_is_read_from_the_markers(attempt: Path) -> None:
    victim = write_worker(attempt, 0, raised=f"RuntimeError: {GLOO_CLOSED}", failed_at=1000.5)
    # Rank 1 raised, left its markers, and was stopped by the agent before torch wrote error.json.
    write_worker(
        attempt, 1, raised="FlakyStorageError: timed out", failed_at=1000.4, recoverable=True, error_file=False
    )
    failure = failure_from_child_failed(child_failed({0: (0, 1, victim)}), attempt.parent.parent)
    assert (failure.rank, failure.exception, failure.recoverable) == (1, "FlakyStorageError", True)


def test_a_reported_worker_killed_by_a_signal_is_named_after_it(attempt: Path) -> None:
    # No error file: torch says "<N/A>"; the folder is found from the log dir. SIGKILL: the OOM killer, a cause.
    (attempt / "0").mkdir()
    failure = failure_from_child_failed(child_failed({0: (0, -9, attempt / "0" / "error.json")}), attempt.parent.parent)
    assert (failure.rank, failure.exception, failure.recoverable, failure.exitcode) == (0, "SignalSIGKILL", True, -9)
    assert not failure.is_consequence


def test_a_worker_its_agent_stopped_is_not_the_cause(attempt: Path) -> None:
    write_worker(attempt, 0)  # stopped with SIGTERM: no error file, no markers
    write_worker(attempt, 1, raised="ValueError: bad shard", failed_at=1000.7)
    failure = failure_from_child_failed(
        child_failed({0: (0, -15, attempt / "0" / "error.json")}), attempt.parent.parent
    )
    assert (failure.rank, failure.exception) == (1, "ValueError")


def test_only_the_last_attempt_counts(tmp_path: Path) -> None:
    run = tmp_path / "logs" / "run-id_abc"
    write_worker(run / "attempt_0", 1, raised="ValueError: from the first attempt", failed_at=900.0)
    (run / "attempt_0" / "0").mkdir()
    last = run / "attempt_1"
    (last / "0").mkdir(parents=True)
    write_worker(last, 1, raised="IndexError: from the last attempt", failed_at=1000.0)
    failure = failure_from_child_failed(child_failed({0: (0, -15, last / "0" / "error.json")}), tmp_path / "logs")
    assert (failure.rank, failure.exception) == (1, "IndexError")


def test_without_a_log_dir_the_reported_failure_stands(attempt: Path) -> None:
    victim = write_worker(attempt, 0, raised=f"RuntimeError: {GLOO_CLOSED}", failed_at=1000.5)
    failure = failure_from_child_failed(child_failed({0: (0, 1, victim)}))
    assert (failure.rank, failure.exception, failure.timestamp) == (0, "RuntimeError", 1000.5)
    assert failure.is_consequence


# --- the runner for real --------------------------------------------------------------------------------------------


class FlakyStorageError(RecoverableError):
    """A user's recoverable error."""


def both_raise_recoverable_after_a_barrier() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    raise FlakyStorageError(f"rank {dist.get_rank()} lost its data loader")


def rank_1_raises_rank_0_dies_in_the_next_collective(kind: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        if kind == "recoverable":
            raise FlakyStorageError("bucket timed out on rank 1")
        raise ValueError("label 7 is out of range")
    try:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: its exit closes the connection
    except Exception as e:
        print(f"rank 0 saw: {type(e).__name__}: {e}", flush=True)
        raise


#: Longer than a worker takes to fail after its peer: torch then finds both failed at one poll, and reports rank 0.
SLOW_POLL = ["--monitor-interval", "2"]


@pytest.mark.slow
# fork only: spawn runs the same case through dag.test() in tests/e2e/test_root_cause.py (each case costs ~10 s).
@pytest.mark.parametrize("start_method", ["fork"])
def test_two_ranks_raising_recoverable_errors_after_a_barrier_fail_recoverably(
    tmp_path: Path, start_method: str
) -> None:
    started = time.monotonic()
    run = run_runner(tmp_path, both_raise_recoverable_after_a_barrier, start_method=start_method, extra=SLOW_POLL)
    print(f"runner took {time.monotonic() - started:.1f} s")
    assert run.returncode == EXIT_RECOVERABLE, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.recoverable, run.describe()
    assert failure.exception == "FlakyStorageError" and "lost its data loader" in failure.message
    assert failure.timestamp != int(failure.timestamp), "the worker's own sub-second time"


@pytest.mark.slow
# Each start method once, and each kind once: the choice of the cause does not depend on the start method.
@pytest.mark.parametrize(("start_method", "kind"), [("spawn", "permanent"), ("fork", "recoverable")])
def test_a_rank_dying_in_the_collective_after_its_peer_raised_is_not_the_cause(
    tmp_path: Path, start_method: str, kind: str
) -> None:
    started = time.monotonic()
    run = run_runner(
        tmp_path, rank_1_raises_rank_0_dies_in_the_next_collective, (kind,), start_method=start_method, extra=SLOW_POLL
    )
    print(f"runner took {time.monotonic() - started:.1f} s")
    # Rank 0 did fail, as a victim (a lost connection), not only stopped by its agent. gloo words it "closed by peer"
    # when the peer's socket closed first and "reset by peer" when rank 1 died with it open (under load, either).
    lost = ("Connection closed by peer", "Connection reset by peer")
    assert "[rank0]:rank 0 saw: " in run.output and any(m in run.output for m in lost), run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 1, run.describe()
    if kind == "recoverable":
        assert run.returncode == EXIT_RECOVERABLE, run.describe()
        assert (failure.exception, failure.recoverable) == ("FlakyStorageError", True)
    else:
        assert run.returncode == EXIT_FAILED, run.describe()
        assert (failure.exception, failure.message, failure.recoverable) == (
            "ValueError",
            "label 7 is out of range",
            False,
        )
        assert failure.traceback.rstrip().endswith("ValueError: label 7 is out of range")
    assert "non-recoverable failure: rank 1" in run.output or "recoverable failure: rank 1" in run.output

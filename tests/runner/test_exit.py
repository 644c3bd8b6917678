"""``exit()`` in a worker (issue 32, item 1), through the runner for real: code None or 0 is the worker returning
None, any other code fails that rank as ``SystemExit`` with its traceback, and ``os._exit(n)`` is named by its code.

Left to torch, ``exit()`` hangs the job (a function entrypoint that never returns), ``sys.exit(0)`` hides rank 0's
place, and ``sys.exit(2)`` fails with torch's "To enable traceback see" and nothing else.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK
from tests.runner.support import run_runner

pytestmark = pytest.mark.slow

#: Far less than a hang: each run ends as soon as its workers do.
WITHIN_SECONDS = 60


def exits(how: str, ranks: str, value: object = None) -> object:
    """``how`` on the ranks in ``ranks`` ("all", or a comma-separated list); the others return ``value``."""
    import os
    import sys

    rank = int(os.environ["RANK"])
    if ranks == "all" or str(rank) in ranks.split(","):
        if how == "exit()":
            exit()
        if how == "sys.exit()":
            sys.exit()
        if how == "sys.exit(0)":
            sys.exit(0)
        if how == "sys.exit(2)":
            sys.exit(2)
        if how == "sys.exit(message)":
            sys.exit("config.yaml: no such file")
        if how == "os._exit(3)":
            os._exit(3)
    return value


def run(tmp_path: Path, how: str, ranks: str, start_method: str, value: object = None):
    started = time.monotonic()
    result = run_runner(tmp_path, exits, (how, ranks, value), start_method=start_method, timeout=WITHIN_SECONDS * 3)
    took = time.monotonic() - started
    print(f"{how} on {ranks} ({start_method}): {took:.1f} s")
    assert took < WITHIN_SECONDS, result.describe()
    return result


@pytest.mark.parametrize(
    ("how", "start_method"), [("exit()", "spawn"), ("sys.exit()", "fork"), ("sys.exit(0)", "spawn"), ("exit()", "fork")]
)
def test_exit_with_no_code_or_0_on_every_rank_returns_none(tmp_path: Path, how: str, start_method: str) -> None:
    result = run(tmp_path, how, "all", start_method)
    assert result.returncode == EXIT_OK, result.describe()
    outcome = result.outcome
    assert outcome is not None and outcome.holds_rank0 and outcome.result is None, result.describe()
    assert "[rank1]:rank 1: the training function called exit(" in result.output, result.output


@pytest.mark.parametrize(("ranks", "start_method"), [("0", "fork"), ("1", "spawn")])
def test_exit_on_one_rank_is_that_rank_returning_none(tmp_path: Path, ranks: str, start_method: str) -> None:
    result = run(tmp_path, "exit()", ranks, start_method, value={"loss": 0.5})
    assert result.returncode == EXIT_OK, result.describe()
    outcome = result.outcome
    assert outcome is not None and outcome.holds_rank0, result.describe()
    # Rank 0's value: None where rank 0 exited, its return value where another rank did.
    assert outcome.result == (None if ranks == "0" else {"loss": 0.5}), result.describe()


@pytest.mark.parametrize(
    ("how", "ranks", "start_method", "message"),
    [
        ("sys.exit(2)", "1", "spawn", "exit code 2"),
        ("sys.exit(message)", "0", "fork", "config.yaml: no such file (exit code 1)"),
    ],
)
def test_exit_with_a_failing_code_fails_that_rank_as_system_exit(
    tmp_path: Path, how: str, ranks: str, start_method: str, message: str
) -> None:
    result = run(tmp_path, how, ranks, start_method)
    assert result.returncode == EXIT_FAILED, result.describe()
    failure = result.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == int(ranks), result.describe()
    assert (failure.exception, failure.message, failure.recoverable) == ("SystemExit", message, False)
    assert (failure.module, failure.bases) == ("builtins", ("builtins.SystemExit",)), failure
    # Its traceback, down to the call: what torch records for an exception, which a bare SystemExit never got.
    assert "sys.exit(" in failure.traceback and "To enable traceback" not in failure.message, failure


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_os_exit_with_a_code_is_a_failed_worker_named_by_its_code(tmp_path: Path, start_method: str) -> None:
    result = run(tmp_path, "os._exit(3)", "1", start_method)
    assert result.returncode == EXIT_FAILED, result.describe()
    failure = result.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and (failure.rank, failure.exception, failure.exitcode) == (1, "WorkerExited", 3)
    assert "exited with code 3 without raising an exception" in failure.message, failure

"""``exit()`` in a training function through ``dag.test()`` (issue 32, item 1): a task whose ranks all call
``exit()`` succeeds with ``None`` at once, and ``sys.exit(2)`` fails it at try 1 as the user's code, naming
``SystemExit``, its code and the rank. The start methods and every other exit are covered in tests/runner/test_exit.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_local_execution import failure_dir, run_dag  # noqa: F401  (failure_dir is a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


def test_exit_ends_the_task_with_none_and_a_failing_code_fails_it_at_once(failure_dir: Path) -> None:  # noqa: F811
    started = time.monotonic()
    result = run_dag("te_exits")
    print(f"te_exits: {time.monotonic() - started:.1f} s")
    assert result.tasks == {("exit_everywhere", -1): ("success", 1), ("exit_2", -1): ("failed", 1)}, result
    # Rank 0's value is None, which Airflow stores as no XCom at all.
    assert result.xcoms.get(("exit_everywhere", -1, "return_value")) is None, result.xcoms
    error = (failure_dir / "te_exits.exit_2.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "rank 1" in error and "SystemExit: exit code 2" in error, error

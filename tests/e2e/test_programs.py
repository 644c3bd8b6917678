"""A torchrun module and script as tasks through ``dag.test()`` (issue 32): templated args, set_result as the
XCom, a RecoverableError retried, a permanent error named with its rank and traceback. The runner-level cases
(spawn and fork, exit(), a missing script) are in tests/runner/test_program.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_local_execution import failure_dir, run_dag  # noqa: F401  (failure_dir is a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]

PROGRAMS = Path(__file__).parents[1] / "programs"


def test_a_module_and_a_script_run_as_tasks(failure_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("PYTHONPATH", str(PROGRAMS))
    result = run_dag("te_programs")
    assert result.tasks == {("module", -1): ("success", 2), ("script", -1): ("failed", 1)}, result
    value = result.xcom("module")
    assert value["argv"] == ["recoverable-on-try-1", "--steps", "2", "--try-number", "2"], value
    assert (value["total"], value["main"], value["try_number"]) == (4.0, "__main__", 2), value
    first = (failure_dir / "te_programs.module.try1.txt").read_text()
    assert first.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), first
    assert "ShardServerDown: rank " in first and "the shard server is down on try 1" in first, first
    error = (failure_dir / "te_programs.script.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "rank 1" in error and "ValueError: label 7 is out of range in shard 3" in error, error

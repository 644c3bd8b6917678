"""A torchrun script or module in place of a function (issue 32, item 2), through the runner for real: each worker
runs tests/programs/team/train.py as ``python -m team.train ARGS`` or ``python train.py ARGS`` would, and rank 0's
``set_result`` value is the outcome; failures are named as a function's are."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK, EXIT_RECOVERABLE
from airflow_provider_torchelastic.worker.program import Program
from tests.conftest import REPO_ROOT
from tests.runner.support import run_runner, runner_env

pytestmark = pytest.mark.slow

PROGRAMS = REPO_ROOT / "tests" / "programs"
SCRIPT = PROGRAMS / "team" / "train.py"


def env() -> dict[str, str]:
    """The workers' environment: the programs' folder on PYTHONPATH, as an image would install the team's package."""
    return runner_env(PYTHONPATH=str(PROGRAMS))


@pytest.mark.parametrize(
    ("program", "start_method"),
    [
        (Program(module="team.train", args=("ok", "--steps", "3")), "spawn"),
        (Program(script=str(SCRIPT), args=("ok", "--steps", "3")), "fork"),
    ],
    ids=["module-spawn", "script-fork"],
)
def test_a_program_runs_as_main_with_its_args_and_rank_0_sets_the_result(
    tmp_path: Path, program: Program, start_method: str
) -> None:
    run = run_runner(tmp_path, program, start_method=start_method, env=env())
    assert run.returncode == EXIT_OK, run.describe()
    value = run.outcome.result  # type: ignore[union-attr]
    # 2 ranks, steps 0..2: (0+1) + (1+2) + (2+3) = 9.
    assert value == {
        "argv": ["ok", "--steps", "3"],
        "total": 9.0,
        "main": "__main__",
        "main_file": "train.py",
        "try_number": 1,
    }, run.describe()


def test_a_programs_recoverable_error_is_recoverable(tmp_path: Path) -> None:
    run = run_runner(tmp_path, Program(module="team.train", args=("recoverable-on-try-1",)), env=env())
    assert run.returncode == EXIT_RECOVERABLE, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == "ShardServerDown" and failure.recoverable, failure
    assert "team.train.ShardServerDown" in failure.bases or "__main__.ShardServerDown" in failure.bases, failure


def test_a_programs_exception_is_named_with_its_rank_and_traceback(tmp_path: Path) -> None:
    run = run_runner(tmp_path, Program(script=str(SCRIPT), args=("fail",)), start_method="fork", env=env())
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and (failure.rank, failure.exception) == (1, "ValueError"), failure
    assert failure.message == "label 7 is out of range in shard 3"
    assert "train.py" in failure.traceback and 'raise ValueError("label 7' in failure.traceback, failure.traceback


def test_exit_0_keeps_the_result_set_before_it(tmp_path: Path) -> None:
    run = run_runner(tmp_path, Program(module="team.train", args=("exit",)), env=env())
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome.result == {"stopped": "early", "rank": 0}, run.describe()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("program", "exception", "words"),
    [
        (
            Program(script="jobs/no_such_train.py"),
            "ScriptNotFoundError",
            "script='jobs/no_such_train.py': no such file",
        ),
        (
            Program(module="team.no_such_train"),
            "ModuleNotInstalledError",
            "module='team.no_such_train': not installed on ",
        ),
    ],
    ids=["script", "module"],
)
def test_a_program_that_is_not_there_is_named_where_the_workers_run(
    tmp_path: Path, program: Program, exception: str, words: str
) -> None:
    run = run_runner(tmp_path, program, start_method="fork", env=env())
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == exception, failure
    assert words in failure.message, failure


def test_a_module_whose_own_import_is_missing_fails_as_the_modules_error(tmp_path: Path) -> None:
    package = tmp_path / "packages" / "brokendep"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import no_such_dependency_of_train  # noqa: F401\n")
    workers_env = runner_env(PYTHONPATH=f"{tmp_path / 'packages'}:{PROGRAMS}")
    run = run_runner(tmp_path, Program(module="brokendep.train"), start_method="fork", env=workers_env)
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    # The module is there; what it imports is not: the training code's own failure, named as Python names it.
    assert failure is not None and failure.exception == "ModuleNotFoundError", failure
    assert "no_such_dependency_of_train" in failure.message, failure

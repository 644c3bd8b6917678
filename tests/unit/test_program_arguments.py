"""``module=``/``script=`` with ``args`` (issue 32, item 2): checked when the DAG file is parsed, and turned into
the :class:`Program` every worker runs (templated ``args`` rendered)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic import TorchElasticOperator
from airflow_provider_torchelastic.worker.program import Program


def train() -> None:
    pass


def op(**kwargs: Any) -> TorchElasticOperator:
    return TorchElasticOperator(task_id="t", execution="local", **kwargs)


def test_a_module_or_a_script_becomes_the_program_the_workers_call() -> None:
    module = op(module="team.train", args=["--epochs", "3"])
    assert module.training_call() == (Program(module="team.train", args=("--epochs", "3")), (), {})
    script = op(script="jobs/train.py")
    assert script.training_call() == (Program(script="jobs/train.py"), (), {})
    assert "args" in TorchElasticOperator.template_fields
    rendered = module.training_call({"args": ["--epochs", "4"]})[0]
    assert rendered == Program(module="team.train", args=("--epochs", "4"))
    assert op(python_callable=train, op_args=[1]).training_call() == (train, [1], {})


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({}, TypeError, "python_callable, module, script: expected exactly one of them, got none of them"),
        ({"python_callable": train, "module": "team.train"}, TypeError, "got python_callable="),
        ({"module": "team.train", "script": "train.py"}, TypeError, "got module='team.train', script='train.py'"),
        ({"module": "team/train.py"}, ValueError, "module: expected a dotted module name"),
        ({"module": "team..train"}, ValueError, "'team..train'"),
        ({"module": 3}, TypeError, "module: expected a dotted module name"),
        ({"script": ""}, ValueError, "script: expected a script's path"),
        ({"module": "team.train", "args": "--epochs 3"}, TypeError, "args: expected a list of strings"),
        ({"module": "team.train", "args": ["--epochs", 3]}, TypeError, "args[1]: expected a list of strings"),
        ({"python_callable": train, "args": ["x"]}, TypeError, "args: only for module= or script="),
        ({"module": "team.train", "op_args": [1]}, TypeError, "op_args, op_kwargs: only for python_callable"),
    ],
)
def test_bad_entrypoints_fail_when_the_dag_is_parsed(kwargs: dict[str, Any], error: type, words: str) -> None:
    with pytest.raises(error) as caught:
        op(**kwargs)
    assert words in str(caught.value), caught.value


def test_templated_args_are_accepted_as_they_are() -> None:
    assert op(module="team.train", args=["--try", "{{ ti.try_number }}"]).args == ["--try", "{{ ti.try_number }}"]


def test_a_missing_script_or_module_is_the_jobs_configuration_not_the_code() -> None:
    from airflow_provider_torchelastic.core import causes
    from airflow_provider_torchelastic.core.outcome import (
        NodeReport,
        WorkerFailure,
        decide_run,
        decode_outcome,
        encode_failure,
    )

    for exception in ("ScriptNotFoundError", "ModuleNotInstalledError"):
        failure = WorkerFailure(rank=0, exception=exception, message="not there where the workers run")
        report = NodeReport(name="pod-0", exit_code=1, outcome=decode_outcome(encode_failure(failure)))
        verdict = decide_run([report])
        assert (verdict.cause, verdict.recoverable) == (causes.CONFIGURATION, False), (exception, verdict)

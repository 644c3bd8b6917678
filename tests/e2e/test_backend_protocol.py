"""Issue 40: every place a try runs is one backend behind one protocol. A new one is a module and a table entry:
the stub in tests/backends/inline.py runs a task end to end through ``dag.test()``, with the operator unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.core import choices
from airflow_provider_torchelastic.operators.backends import Backend, backend_for
from tests.e2e.test_local_execution import LOCAL_BUNDLE, run_dag

pytestmark = [pytest.mark.usefixtures("airflow_db")]

INLINE = "tests.backends.inline:InlineBackend"


def add(a: int, b: int) -> dict[str, int]:
    return {"sum": a + b}


@pytest.fixture
def inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(choices.BACKENDS, "inline", INLINE)


DAG_FILE = """
from airflow.sdk import DAG

from airflow_provider_torchelastic import TorchElasticOperator


def add(a, b):
    return {"sum": a + b}


with DAG("te_inline_backend", schedule=None) as dag:
    TorchElasticOperator(task_id="train", python_callable=add, op_args=[2, 3], execution="inline")
"""


def test_a_stub_backend_runs_a_task_end_to_end(inline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A DAG file, parsed by Airflow as any other, whose task names the new execution; dag.test() runs it.
    (tmp_path / "te_inline_backend.py").write_text(DAG_FILE)
    bundles = [{"name": "inline-dags", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(tmp_path)}}]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
    result = run_dag("te_inline_backend", tmp_path)
    assert result.tasks == {("train", -1): ("success", 1)}, result
    assert result.xcom() == {"sum": 5}


def test_a_stub_backends_plan_is_the_operators_plan(inline: None) -> None:
    op = TorchElasticOperator(task_id="train", python_callable=add, op_args=[2, 3], execution="inline")
    plan = op.plan()
    assert plan.execution == "inline" and plan.objects[0]["runs"] == "in the Airflow worker's process"
    assert '"payload_bytes"' in str(plan)


def test_every_backend_in_the_table_implements_the_protocol(inline: None) -> None:
    from airflow_provider_torchelastic.operators.operator import _task_spec

    task = _task_spec(TorchElasticOperator(task_id="t", python_callable=add, execution="local"))
    for execution in choices.BACKENDS:
        backend: Backend = backend_for(execution, task)
        assert backend.execution == execution and backend.task is task
        for method in ("prepare", "submit", "wait", "resume", "stop"):
            assert callable(getattr(backend, method)), (execution, method)


def test_an_execution_no_backend_runs_is_refused_at_parse_time_naming_the_table() -> None:
    with pytest.raises(ValueError, match=r"execution: expected 'kubernetes' or 'local' .*got 'inline'"):
        TorchElasticOperator(task_id="t", python_callable=add, execution="inline")


def test_a_local_plan_shows_each_nodes_command_and_what_the_run_adds_to_its_environment() -> None:
    op = TorchElasticOperator(
        task_id="train", python_callable=add, execution="local", task_config=Elastic(nnodes=2, nproc_per_node=2)
    )
    plan = op.plan()
    assert plan.execution == "local" and [o["node"] for o in plan.objects] == [0, 1]
    for node in plan.objects:
        assert node["command"][1:3] == ["-m", "airflow_provider_torchelastic.runner"], node["command"]
        assert "TORCHELASTIC_CONTEXT" in node["env"] and "PATH" not in node["env"], sorted(node["env"])
        assert node["env"]["TMPDIR"] == "<run folder>/tmp", "the run's own, removed with it"
    # The rendezvous is node 0's: both name the same endpoint.
    endpoints = {c[c.index("--rdzv-endpoint") + 1] for c in (o["command"] for o in plan.objects)}
    assert len(endpoints) == 1, endpoints

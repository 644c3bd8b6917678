"""Stall detection through a real Airflow task (``dag.test()``, local execution, gloo on CPU): the stalled try fails
as ``StalledError`` naming the stuck rank with both ranks' stacks, is retried, and the retry resumes from its
checkpoint (issue 35)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dags.stalls import STEPS, STUCK_AFTER
from tests.e2e.test_local_execution import run_dag

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


def test_a_stalled_try_is_retried_and_resumes_from_its_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", f"file://{tmp_path / 'store'}")
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(tmp_path))
    result = run_dag("te_stall_resume")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    value = result.xcom()
    # Try 1 saved steps 0..STUCK_AFTER, then rank 1 hung; try 2 starts at the next step and finishes the sum.
    assert value["resumed_from"] == STUCK_AFTER and value["try_number"] == 2, value
    assert value["total"] == 2 * sum(range(STEPS)), value
    first_try = (tmp_path / "te_stall_resume.train.try1.txt").read_text()
    assert first_try.startswith("airflow_provider_torchelastic.operators.StalledError"), first_try
    assert "stall_timeout=8 s" in first_try and "rank(s) 1 never entered it" in first_try, first_try

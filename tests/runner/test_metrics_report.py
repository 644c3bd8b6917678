"""report() in real torch elastic workers: rank 0's lines reach the runner's output, rate limited, and the last step
is printed when the training function ends (spawned workers and forked ones, which skip atexit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV, MARKER, MetricSeries, parse_metrics_line
from airflow_provider_torchelastic.errors import EXIT_OK
from tests.runner.support import run_runner, runner_env

pytestmark = pytest.mark.slow


def train_and_report(steps: int) -> int:
    import torch

    from airflow_provider_torchelastic import report

    for step in range(steps):
        # A 0-d tensor, as training code has it: report() takes anything float() takes.
        report(step=step, loss=torch.tensor(1.0 / (step + 1)), accuracy=step / steps)
    return steps


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_rank_0_reports_rate_limited_lines_and_the_last_step_at_the_end(tmp_path: Path, start_method: str) -> None:
    # An interval longer than the run: the first report prints at once, the rest only at the end.
    run = run_runner(
        tmp_path,
        train_and_report,
        (500,),
        start_method=start_method,
        env=runner_env(**{INTERVAL_ENV: "3600"}),
    )
    assert run.returncode == EXIT_OK, run.describe()
    lines = [line for line in run.output.splitlines() if MARKER in line]
    assert all(line.startswith(f"[rank0]:{MARKER} ") for line in lines), "only rank 0 reports: " + run.describe()
    parsed = [parse_metrics_line(line) for line in lines]
    assert len(parsed) == 2 and all(item is not None for item in parsed), run.describe()
    first, last = parsed
    assert first is not None and last is not None
    assert first.step == 0 and first.last == {"loss": 1.0, "accuracy": 0.0}
    assert last.step == 499 and last.last == pytest.approx({"loss": 1.0 / 500, "accuracy": 499 / 500})
    series = MetricSeries()
    for item in (first, last):
        series.extend(item)
    points = series.points("loss")
    assert points[0][0] == 0 and points[-1][0] == 499 and len(points) <= 64 + 1

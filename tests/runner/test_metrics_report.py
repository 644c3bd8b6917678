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


def report_after_an_unfinished_line() -> int:
    import os
    import time

    from airflow_provider_torchelastic import report

    written = "unfinished-line-written"  # in the runner's folder, which both ranks share
    if int(os.environ["RANK"]) == 1:
        # C++ code (gloo's warnings at the first collective) writes a line in pieces; the tee copies the first at once.
        time.sleep(1.0)  # after rank 0's own start-up lines
        os.write(2, b"[W1204] a warning written in pieces: ")
        open(written, "w").close()
        time.sleep(2.0)
        os.write(2, b"its end\n")
    else:
        while not os.path.exists(written):
            time.sleep(0.05)
        time.sleep(0.5)  # the tee (every 0.1 s) has copied the piece
        report(step=1, loss=2.0)
    return 0


def test_a_metrics_line_that_follows_another_ranks_unfinished_line_is_still_read(tmp_path: Path) -> None:
    run = run_runner(tmp_path, report_after_an_unfinished_line)
    assert run.returncode == EXIT_OK, run.describe()
    (line,) = [line for line in run.output.splitlines() if MARKER in line]
    # The tee glued the two (the point of the test: if torch stops doing so, this says where to look).
    assert line.startswith("[rank1]:[W1204] a warning written in pieces: [rank0]:"), run.describe()
    parsed = parse_metrics_line(line)
    assert parsed is not None and parsed.step == 1 and parsed.last == {"loss": 2.0}, line

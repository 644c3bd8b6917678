"""report() and its lines: the rate limit (a fake clock), bounded points, no-op outside a job, bad values, and the
Airflow side's parsing and progress lines."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction

import pytest

from airflow_provider_torchelastic.core import metrics_format
from airflow_provider_torchelastic.core.metrics_format import (
    MARKER,
    POINTS_PER_LINE,
    MetricSeries,
    MetricsLine,
    parse_metrics_line,
    split_glued,
)
from airflow_provider_torchelastic.core.tap import (
    EVENT_MAX_BYTES,
    TAIL_LINE_CHARS,
    TAIL_LINES,
    TAIL_SOURCES,
    MetricsTap,
)
from airflow_provider_torchelastic.worker import metrics
from airflow_provider_torchelastic.worker.metrics import Reporter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reporter(interval: float = 15.0) -> tuple[Reporter, list[str], FakeClock]:
    lines: list[str] = []
    clock = FakeClock()
    return Reporter(interval=interval, write=lines.append, clock=clock), lines, clock


def parsed(lines: list[str]) -> list[MetricsLine]:
    result = [parse_metrics_line(line) for line in lines]
    assert all(item is not None for item in result), lines
    return result  # type: ignore[return-value]


# --- the producer ---------------------------------------------------------------------------------------------------


def test_at_most_one_line_per_interval_however_often_report_is_called() -> None:
    rep, lines, clock = reporter(interval=15)
    for step in range(1000):  # 1000 steps in 100 s
        rep.report(step, {"loss": 1.0 / (step + 1)})
        clock.now += 0.1
    # The first report prints at once, then one line per 15 s: at 0, 15, 30, ..., 90 s.
    assert len(lines) == 7, lines
    rep.flush()
    assert len(lines) == 8
    last = parsed(lines)[-1]
    assert last.step == 999 and last.last == {"loss": 1.0 / 1000}
    # Every step reported reaches some line (decimated), and the newest step always does.
    steps = [step for line in parsed(lines) for step, _ in line.points["loss"]]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 999
    rep.flush()
    assert len(lines) == 8, "nothing new: nothing printed"


def test_points_per_line_and_memory_are_bounded_for_a_100000_step_run() -> None:
    rep, lines, clock = reporter(interval=15)
    for step in range(100_000):
        rep.report(step, {"loss": math.exp(-step / 20_000), "accuracy": step / 100_000})
        clock.now += 0.01  # 1000 s in all
    rep.flush()
    assert len(lines) <= 1000 / 15 + 2
    for line in parsed(lines):
        assert all(len(points) <= POINTS_PER_LINE for points in line.points.values())
    assert max(len(line) for line in lines) < 4096
    # The reporter's own buffer is bounded by the points of one line.
    assert all(len(rep._pending.points(name)) <= POINTS_PER_LINE for name in rep._pending.names)
    # The Airflow side keeps a bounded series of the whole run, from first to last step.
    series = MetricSeries()
    for line in parsed(lines):
        series.extend(line)
    for name in ("loss", "accuracy"):
        points = series.points(name)
        assert 100 <= len(points) <= 500, len(points)
        assert points[0][0] == 0 and points[-1][0] == 99_999
    assert series.last() == {"loss": math.exp(-99_999 / 20_000), "accuracy": 0.99999}


def test_step_defaults_to_the_previous_plus_one() -> None:
    rep, lines, _ = reporter(interval=0)
    rep.report(None, {"loss": 3.0})
    rep.report(10, {"loss": 2.0})
    rep.report(None, {"loss": 1.0})
    assert [line.step for line in parsed(lines)] == [0, 10, 11]


class Scalar:
    """Like a 0-d torch tensor or a numpy scalar: float() works on it."""

    def __float__(self) -> float:
        return 0.25


def test_bad_values_warn_once_and_are_skipped_scalars_are_accepted() -> None:
    rep, lines, _ = reporter(interval=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep.report(1, {"loss": "high", "acc": Scalar(), "lr": Decimal("0.5"), "ratio": Fraction(1, 4)})
        rep.report(2, {"loss": [1.0], "acc": 1})
        rep.report(3, {"loss": None, "flag": True})
    assert [str(w.message) for w in caught if "loss" in str(w.message)] == [
        "report(): loss='high' is not a number (expected a float, int, or a torch/numpy scalar); it is skipped"
    ], "one warning per metric name"
    assert any("flag=True" in str(w.message) for w in caught), "a bool is not a metric"
    # Step 3 reported nothing usable: no line for it.
    assert [line.last for line in parsed(lines)] == [
        {"acc": 0.25, "lr": 0.5, "ratio": 0.25},
        {"acc": 1.0, "lr": 0.5, "ratio": 0.25},
    ]
    with pytest.warns(RuntimeWarning, match="step must be a number"):
        rep.report("ten", {"acc": 1.0})  # type: ignore[arg-type]


def test_non_finite_values_travel_as_strings_and_come_back() -> None:
    rep, lines, _ = reporter(interval=0)
    rep.report(1, {"loss": float("nan"), "grad": float("inf")})
    json.loads(lines[0].split(" ", 1)[1])  # strict JSON: no bare NaN
    line = parsed(lines)[0]
    assert math.isnan(line.last["loss"]) and line.last["grad"] == math.inf


def forget_the_reporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a fresh worker process: the next report() sets the module's reporter up again (restored after the test)."""
    monkeypatch.setattr(metrics, "_reporter", None)


@pytest.fixture
def fresh_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    forget_the_reporter(monkeypatch)
    for name in ("RANK", "TORCHELASTIC_RUN_ID", metrics.INTERVAL_ENV):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.usefixtures("fresh_module")
def test_outside_a_job_report_is_a_no_op_with_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(RuntimeWarning, match="outside a torch elastic worker") as caught:
        for step in range(5):
            metrics.report(step, loss=1.0)
    assert len(caught) == 1
    metrics.flush()
    assert capsys.readouterr().out == ""


@pytest.mark.usefixtures("fresh_module")
def test_only_rank_0_prints(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.report(1, loss=1.0)
    assert capsys.readouterr().out == ""
    forget_the_reporter(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(metrics.INTERVAL_ENV, "3600")
    metrics.report(1, loss=1.0)
    metrics.report(2, loss=0.5)  # within the interval: held back
    first = capsys.readouterr().out
    assert first.startswith(f"{MARKER} ") and first.count("\n") == 1
    metrics.flush()  # what the runner (and atexit) does when the training function ends
    assert parse_metrics_line(capsys.readouterr().out.strip()) == MetricsLine(
        step=2, last={"loss": 0.5}, points={"loss": ((2.0, 0.5),)}
    )


# --- parsing ----------------------------------------------------------------------------------------------------------

DOC = '{"step":1200,"last":{"loss":0.312,"accuracy":0.91},"points":{"loss":[[1100,0.35],[1200,0.312]]}}'


@pytest.mark.parametrize(
    "line",
    [
        f"{MARKER} {DOC}",
        f"[rank0]:{MARKER} {DOC}",
        f"[node1] [rank0]:{MARKER} {DOC}",
        f"[train-abc-worker-0] [rank0]:{MARKER} {DOC}",
        f"2026-11-29T17:40:19.123456789Z [rank0]:{MARKER} {DOC}",
        f"[rank0]:{MARKER} {DOC}   ",
    ],
    ids=["bare", "rank", "local-node", "pod", "k8s-timestamp", "trailing-space"],
)
def test_parse_tolerates_the_carriers_prefixes(line: str) -> None:
    assert parse_metrics_line(line) == MetricsLine(
        step=1200, last={"loss": 0.312, "accuracy": 0.91}, points={"loss": ((1100.0, 0.35), (1200.0, 0.312))}
    )


@pytest.mark.parametrize(
    "line",
    [
        "[rank0]:epoch 3 loss 0.2",
        f"[rank0]:print('{MARKER} {DOC}')",  # the marker inside other text
        f"[rank0]:{MARKER} {{not json}}",
        f"[rank0]:{MARKER} []",
        f"[rank0]:{MARKER} {{}}",
        f'[rank0]:{MARKER} {{"last": {{"loss": "high"}}}}',
    ],
)
def test_parse_rejects_what_is_not_a_metrics_line(line: str) -> None:
    assert parse_metrics_line(line) is None


@pytest.mark.parametrize(
    "unfinished",
    [
        "[rank1]:[W1204 04:50:00.123 ProcessGroupGloo.cpp:514] Warning: ",  # C++ code writes a warning in pieces
        "[rank0]:{'loss': 2.31, 'grad_norm': 1.7",  # print(): the text, then its newline
        "[node0] [rank1]:partial",
        "2026-11-29T17:40:19.123456789Z [rank1]:partial",
    ],
)
def test_a_metrics_line_glued_to_another_workers_unfinished_line_is_read_and_the_rest_kept(unfinished: str) -> None:
    # torch elastic's tee copies a worker's unfinished line at once; rank 0's next line lands right after it.
    line = f"{unfinished}[rank0]:{MARKER} {DOC}"
    assert split_glued(line) == (unfinished, f"[rank0]:{MARKER} {DOC}")
    assert parse_metrics_line(line) == parse_metrics_line(f"[rank0]:{MARKER} {DOC}") is not None
    logged: list[str] = []
    tap = MetricsTap(logged.append, keep_unprefixed=True)
    tap(line)
    assert logged == [unfinished, "metrics: step 1200 loss=0.312 accuracy=0.91"]
    assert tap.series.points("loss") == [(1100.0, 0.35), (1200.0, 0.312)]


@pytest.mark.parametrize(
    "line",
    [
        f"[rank0]:{MARKER} {DOC}",
        f"[rank0]:print('[rank0]:{MARKER} {DOC}')",  # inside other text, not at the end of a line
        f"[rank0]:text {MARKER} {DOC}",  # no tee prefix where it starts
        "[rank0]:epoch 3 loss 0.2",
    ],
)
def test_only_a_tee_prefix_followed_by_the_marker_splits_a_line(line: str) -> None:
    assert split_glued(line) == ("", line)


# --- the series and the tap -------------------------------------------------------------------------------------------


def test_series_round_trips_through_json_and_keeps_decimating() -> None:
    series = MetricSeries(max_points=50)
    for step in range(1000):
        series.add("loss", step, 1000 - step)
    restored = MetricSeries.from_json(json.loads(json.dumps(series.to_json())))
    assert restored.points("loss") == series.points("loss") and len(series.points("loss")) <= 50
    for step in range(1000, 5000):
        restored.add("loss", step, 0.0)
        series.add("loss", step, 0.0)
    assert restored.points("loss") == series.points("loss") and len(restored.points("loss")) <= 50
    assert restored.points("loss")[-1] == (4999.0, 0.0)


def test_series_bounds_the_number_of_metrics() -> None:
    series = MetricSeries(max_metrics=2)
    assert series.add("a", 0, 1) and series.add("b", 0, 1)
    assert not series.add("c", 0, 1)
    assert series.names == ["a", "b"]


def test_tap_turns_metrics_lines_into_progress_lines_and_keeps_tails() -> None:
    logged: list[str] = []
    tap = MetricsTap(logged.append)
    tap(f"[job-worker-0] [rank0]:{MARKER} {DOC}")
    tap("[job-worker-0] [rank0]:epoch done")
    tap("PyTorchJob job: Running; pods running 2/2; elapsed 0m10s")
    assert logged == [
        "metrics: step 1200 loss=0.312 accuracy=0.91",
        "[job-worker-0] [rank0]:epoch done",
        "PyTorchJob job: Running; pods running 2/2; elapsed 0m10s",
    ]
    assert tap.summary_line() == "last metrics: step 1200 loss=0.312 accuracy=0.91"
    assert tap.series.points("loss") == [(1100.0, 0.35), (1200.0, 0.312)]
    assert tap.series.points("accuracy") == [(1200.0, 0.91)]
    # Only pods' (nodes') lines are kept: the wait's own lines would come back in the trigger event's log line.
    assert tap.tails() == {"job-worker-0": "[rank0]:epoch done"}
    # A one-node local run's output has no prefix: its tap keeps it under "".
    local = MetricsTap(logged.append, keep_unprefixed=True)
    local("[rank1]:ValueError: diverged")
    assert local.tails() == {"": "[rank1]:ValueError: diverged"}
    # The state travels as JSON (a trigger event) and comes back whole.
    again = MetricsTap.from_json(json.loads(json.dumps(tap.to_json())), logged.append)
    assert again.summary_line() == tap.summary_line() and again.tails() == tap.tails()
    assert MetricsTap.from_json(None, logged.append).summary_line() == ""


def test_tap_tails_are_bounded() -> None:
    tap = MetricsTap(lambda line: None)
    for index in range(200):
        tap(f"[pod-{index % 40}] line {index} " + "x" * 5000)
    tails = tap.tails()
    assert len(tails) == TAIL_SOURCES
    assert all(len(text.splitlines()) <= TAIL_LINES for text in tails.values())
    assert all(len(line) <= TAIL_LINE_CHARS for text in tails.values() for line in text.splitlines())


def test_tap_state_for_a_trigger_event_is_bounded() -> None:
    tap = MetricsTap(lambda line: None)
    for step in range(2_000):
        line = MetricsLine(step=step, last={f"m{i}": step * 1.5 for i in range(32)}, points={})
        tap.series.extend(line)
    for index in range(16):
        for row in range(50):
            tap(f"[pod-{index}] {row} " + "z" * 900)
    doc = tap.to_json()
    assert len(json.dumps(doc)) <= EVENT_MAX_BYTES
    again = MetricsTap.from_json(json.loads(json.dumps(doc)), lambda line: None)
    assert again.summary_line() == tap.summary_line(), "the last values survive any trimming"
    points = again.series.points("m0")
    assert points[0][0] == 0 and points[-1][0] == 1_999
    # Later points keep being decimated consistently after the state travelled.
    again.series.add("m0", 2_000, 1.0)
    assert again.series.points("m0")[-1] == (2_000.0, 1.0)


def test_a_loss_straight_from_the_graph_is_taken_without_a_warning_per_call() -> None:
    import warnings

    import torch

    from airflow_provider_torchelastic.worker.metrics import _as_float

    loss = (torch.ones(3, requires_grad=True) * 2).mean()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when float() converts a tensor that requires grad
        assert _as_float(loss) == 2.0


def test_long_metric_names_are_cut_when_parsed_and_an_event_drops_whole_metrics_to_fit() -> None:
    """Rank 0 writes the names: 32 metrics named by 20,000 characters each made a 640 KB trigger event (its bound is
    64 KiB), and every summary and chart carried them."""
    names = {f"{i:02d}" + "n" * 20_000: 1.0 for i in range(metrics_format.MAX_METRICS)}
    parsed = metrics_format.parse_metrics_line(f"{metrics_format.MARKER} " + json.dumps({"step": 1, "last": names}))
    assert parsed is not None and len(parsed.last) == metrics_format.MAX_METRICS
    assert all(len(name) == metrics_format.MAX_METRIC_NAME for name in parsed.last)
    tap = MetricsTap(lambda line: None)
    tap.series.extend(parsed)
    doc = tap.to_json(max_bytes=2_000)
    assert len(json.dumps(doc, separators=(",", ":"))) <= 2_000
    kept = list(doc["series"]["metrics"])
    assert kept and kept == list(parsed.last)[: len(kept)], "whole metrics go, the last first"

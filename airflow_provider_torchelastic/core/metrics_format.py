"""The metrics wire format: the line rank 0 prints, its parser, and the bounded series both sides keep.

Training metrics are ``report()`` in the training code (:mod:`airflow_provider_torchelastic.worker.metrics`),
progress lines in the task log and bounded series for the UI (:class:`~airflow_provider_torchelastic.core.tap.
MetricsTap`, the Airflow side); this module is what they share.

No new service carries them: rank 0 prints one machine-readable line now and then to its stdout, which already
flows to the task log (local execution pumps the runner's output; on Kubernetes the wait loop reads the pod's log)::

    TORCHELASTIC_METRICS {"step": 1200, "last": {"loss": 0.312}, "points": {"loss": [[1100, 0.35], [1200, 0.312]]}}

The Airflow side (:class:`MetricsTap`, wrapped around the log callable) turns such a line into a human progress line
and keeps a bounded :class:`MetricSeries` for the job summary.

Costs stay bounded however long the run: :func:`report` prints at most one line per interval (env
``TORCHELASTIC_REPORT_INTERVAL``, from ``[torch_elastic] report_interval``), each line carries at most
:data:`POINTS_PER_LINE` points per metric (decimated where they are produced), and a series keeps at most
``max_points`` per metric by decimation. Standard library only: the runner's workers and Airflow import it alike.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.core.encoding import loads_untrusted
from airflow_provider_torchelastic.core.validation import finite_float, int_or

__all__ = [
    "INTERVAL_ENV",
    "MARKER",
    "MetricSeries",
    "MetricsLine",
    "format_metrics",
    "parse_metrics_line",
    "split_glued",
]

#: What starts a metrics line (after the ``[rankN]:`` prefix torch elastic puts on worker output).
MARKER: Final = "TORCHELASTIC_METRICS"
#: Seconds between two metrics lines of rank 0; rendered into every pod and set by local execution.
INTERVAL_ENV: Final = "TORCHELASTIC_REPORT_INTERVAL"
DEFAULT_INTERVAL: Final = 15.0
#: Points per metric in one line: the points reported since the previous line, decimated to this many.
POINTS_PER_LINE: Final = 64
#: Points per metric kept for the job summary and the UI's charts.
SERIES_POINTS: Final = 500
#: Distinct metric names a job may report; more are dropped (with one warning), so a name built from a step
#: number cannot grow memory without bound.
MAX_METRICS: Final = 32
#: The longest metric name kept; a longer one is cut here, when the line is parsed (rank 0 writes the names, and
#: every event, summary and chart carries them).
MAX_METRIC_NAME: Final = 128
#: The longest log line read as a metrics line: rank 0 prints at most MAX_METRICS names of 64 points each, far less.
MAX_LINE_CHARS: Final = 1024 * 1024
#: The longest log line the wait passes on (the task log, trigger events and summary tails hold it; a pod writes it).
MAX_LOG_LINE: Final = 64 * 1024


def cut_log_line(line: str) -> str:
    """``line``, or its first :data:`MAX_LOG_LINE` characters and how many more there were."""
    if len(line) <= MAX_LOG_LINE:
        return line
    return f"{line[:MAX_LOG_LINE]} [... {len(line) - MAX_LOG_LINE} more characters cut]"


Point: TypeAlias = tuple[float, float]

# JSON has no NaN or infinities: a diverged loss is still worth showing, so they travel as these strings (the same
# spelling as rank 0's result encoding).
_NON_FINITE: Final = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number_to_json(value: float) -> float | int | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _number_from_json(value: Any) -> float | None:
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    if isinstance(value, float):
        return value  # 1e999 parses to infinity: a diverged value, shown as such
    # An int past float's range (a 400-digit step) is no number a metric can be.
    return finite_float(value)


def _step_to_json(step: float) -> float | int:
    return int(step) if step.is_integer() else step


# --- the bounded series -----------------------------------------------------------------------------------------


@dataclass
class _Decimated:
    """One metric's points: every ``stride``-th point offered is kept; when too many are kept, every other one goes
    and the stride doubles. The newest point is always known, so a chart ends where the training ended."""

    kept: list[Point]
    stride: int = 1
    offered: int = 0
    newest: Point | None = None

    def add(self, point: Point, max_points: int) -> None:
        if self.offered % self.stride == 0:
            self.kept.append(point)
            # One place is left for the newest point, which points() adds when it was not kept.
            if len(self.kept) > max(1, max_points - 1):
                self.kept = self.kept[::2]
                self.stride *= 2
        self.offered += 1
        self.newest = point

    def points(self) -> list[Point]:
        if self.newest is not None and (not self.kept or self.kept[-1] != self.newest):
            return [*self.kept, self.newest]
        return list(self.kept)


class MetricSeries:
    """Points ``(step, value)`` per metric, at most ``max_points`` each (decimated), and the last value of each.

    Memory is ``O(max_points * MAX_METRICS)`` whatever the number of points added; ``to_json``/``from_json`` carry the
    state (a trigger event, the job summary).
    """

    def __init__(self, max_points: int = SERIES_POINTS, max_metrics: int = MAX_METRICS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points: expected an int >= 2, got {max_points!r}")
        self.max_points = max_points
        self.max_metrics = max_metrics
        self._series: dict[str, _Decimated] = {}
        self.last_step: float | None = None

    def add(self, name: str, step: float, value: float) -> bool:
        """Add one point; False when ``name`` is one metric too many (it is dropped)."""
        series = self._series.get(name)
        if series is None:
            if len(self._series) >= self.max_metrics:
                return False
            series = self._series[name] = _Decimated(kept=[])
        series.add((float(step), float(value)), self.max_points)
        if self.last_step is None or step >= self.last_step:
            self.last_step = float(step)
        return True

    def extend(self, line: MetricsLine) -> None:
        """The points of a metrics line (or, where it carries none for a metric, its last value at its step)."""
        for name, points in line.points.items():
            for step, value in points:
                self.add(name, step, value)
        for name, value in line.last.items():
            if name not in line.points and line.step is not None:
                self.add(name, line.step, value)
        if line.step is not None and (self.last_step is None or line.step > self.last_step):
            self.last_step = line.step

    @property
    def names(self) -> list[str]:
        return list(self._series)

    def points(self, name: str) -> list[Point]:
        series = self._series.get(name)
        return series.points() if series is not None else []

    def last(self) -> dict[str, float]:
        """The newest value of every metric."""
        return {name: s.newest[1] for name, s in self._series.items() if s.newest is not None}

    def __len__(self) -> int:
        return len(self._series)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_points": self.max_points,
            "last_step": None if self.last_step is None else _step_to_json(self.last_step),
            "metrics": {
                name: {
                    "kept": [[_step_to_json(s), _number_to_json(v)] for s, v in series.kept],
                    "stride": series.stride,
                    "offered": series.offered,
                    "newest": None
                    if series.newest is None
                    else [_step_to_json(series.newest[0]), _number_to_json(series.newest[1])],
                }
                for name, series in self._series.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MetricSeries:
        """The series :meth:`to_json` gave. Never raises: it travels in a trigger event and the job summary, and a
        part of the wrong shape is dropped, as a chart can go without it (a job's verdict cannot wait on it)."""
        if not isinstance(data, Mapping):
            return cls()
        # Bounded as a series built here is: its memory is the bound's, whatever an event says.
        series = cls(max_points=int_or(data.get("max_points"), SERIES_POINTS, low=2, high=SERIES_POINTS))
        series.last_step = finite_float(data.get("last_step"))
        metrics = data.get("metrics")
        for name, raw in metrics.items() if isinstance(metrics, Mapping) else ():
            if not isinstance(name, str) or not isinstance(raw, Mapping) or len(series) >= series.max_metrics:
                continue
            items = raw.get("kept")
            kept = [p for p in (_point(item) for item in (items if isinstance(items, list) else ())) if p]
            series._series[name] = _Decimated(
                kept=kept[-series.max_points :],
                stride=int_or(raw.get("stride"), 1, low=1),
                offered=int_or(raw.get("offered"), len(kept), low=0),
                newest=_point(raw.get("newest")),
            )
        return series


def _point(item: Any) -> Point | None:
    if not isinstance(item, list | tuple) or len(item) != 2:
        return None
    step, value = _number_from_json(item[0]), _number_from_json(item[1])
    if step is None or value is None or not math.isfinite(step):
        return None
    return step, value


# --- the line: written by rank 0, parsed on the Airflow side -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MetricsLine:
    """One metrics line: the newest step, the last value of each metric, and the (decimated) points since the
    previous line."""

    step: float | None
    last: Mapping[str, float]
    points: Mapping[str, tuple[Point, ...]]

    def to_text(self) -> str:
        doc = {
            "step": None if self.step is None else _step_to_json(self.step),
            "last": {name: _number_to_json(value) for name, value in self.last.items()},
            "points": {
                name: [[_step_to_json(s), _number_to_json(v)] for s, v in points]
                for name, points in self.points.items()
            },
        }
        return f"{MARKER} {json.dumps(doc, separators=(',', ':'))}"


# Before the marker only what the log's carriers add: a Kubernetes log timestamp, our ``[pod] ``/``[node0] `` source
# prefix and torch elastic's ``[rank0]:``. A marker anywhere else (inside a traceback, a user's print) is not a line.
_LINE: Final = re.compile(
    r"^(?:\d{4}-\d\d-\d\dT\S+Z )?(?:\[[^\]\s]+\] )*(?:\[[^\]\s]+\]:)?" + MARKER + r" (?P<doc>\{.*\})\s*$"
)


# Rank 0's metrics line inside a longer one. torch elastic's tee copies each worker's output to the log as soon as it
# is written, an unfinished line too: when a worker writes a line in pieces (C++ code's warnings; print(), which
# writes the text and its newline apart), another worker's line that comes next lands after those pieces, with no
# newline between. The tee's prefix says where that worker's line starts.
_GLUED: Final = re.compile(r"\[rank\d+\]:" + MARKER + " ")


def split_glued(line: str) -> tuple[str, str]:
    """``(unfinished, metrics line)`` when a metrics line came glued to another worker's unfinished line;
    ``("", line)`` otherwise. The unfinished text is still log output, so it is kept, not dropped."""
    if not isinstance(line, str) or MARKER not in line or _LINE.match(line):
        return "", line
    glued = _GLUED.search(line)
    if glued is None or glued.start() == 0 or not _LINE.match(line[glued.start() :]):
        return "", line
    return line[: glued.start()], line[glued.start() :]


def parse_metrics_line(line: str) -> MetricsLine | None:
    """The metrics in a log line, or None when it is not a (well-formed) metrics line. Never raises.

    A metrics line glued to another worker's unfinished line (:func:`split_glued`) is read too."""
    # Total: rank 0's code prints these lines, so any text gives a value or None. The cheap test first: almost no
    # line is one; an over-long one is refused before the regex and the parser see it.
    if not isinstance(line, str) or MARKER not in line or len(line) > MAX_LINE_CHARS:
        return None
    match = _LINE.match(split_glued(line)[1])
    if match is None:
        return None
    doc = loads_untrusted(match.group("doc"), max_bytes=MAX_LINE_CHARS)
    if not isinstance(doc, dict):
        return None
    step = _number_from_json(doc.get("step"))
    raw_last = doc.get("last")
    last = {
        str(name)[:MAX_METRIC_NAME]: number
        for name, value in (raw_last.items() if isinstance(raw_last, dict) else ())
        if (number := _number_from_json(value)) is not None
    }
    points: dict[str, tuple[Point, ...]] = {}
    raw_points = doc.get("points") or {}
    if isinstance(raw_points, dict):
        for name, items in raw_points.items():
            if isinstance(items, list):
                kept = tuple(p for p in (_point(item) for item in items) if p is not None)
                if kept:
                    points[str(name)[:MAX_METRIC_NAME]] = kept
    if not last and not points:
        return None
    return MetricsLine(step=step if step is not None and math.isfinite(step) else None, last=last, points=points)


def format_metrics(step: float | None, values: Mapping[str, float]) -> str:
    """``step 1200 loss=0.312 accuracy=0.91``: how metrics read in the task log."""
    parts = [] if step is None else [f"step {_step_to_json(step)}"]
    parts += [f"{name}={value:.4g}" for name, value in values.items()]
    return " ".join(parts)

"""Training metrics: ``report()`` in the training code, progress lines in the task log, bounded series for the UI.

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

import atexit
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.encoding import loads_untrusted

__all__ = [
    "INTERVAL_ENV",
    "MARKER",
    "MetricSeries",
    "MetricsLine",
    "MetricsTap",
    "Reporter",
    "flush",
    "format_metrics",
    "parse_metrics_line",
    "report",
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
#: Lines of each pod's (or node's) log kept for the job summary, and the longest line kept.
TAIL_LINES: Final = 50
TAIL_LINE_CHARS: Final = 1000
#: Log sources whose tails are kept (pods streamed into the task log; the wait core streams at most 8).
TAIL_SOURCES: Final = 16
#: The most ``MetricsTap.to_json()`` takes: it travels in a trigger event, which Airflow keeps in its database.
EVENT_MAX_BYTES: Final = 64 * 1024
#: The longest log line read as a metrics line: rank 0 prints at most MAX_METRICS names of 64 points each, far less.
MAX_LINE_CHARS: Final = 1024 * 1024

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
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return None


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
        series = cls(max_points=int(data.get("max_points", SERIES_POINTS)))
        last_step = data.get("last_step")
        series.last_step = float(last_step) if isinstance(last_step, int | float) else None
        for name, raw in (data.get("metrics") or {}).items():
            kept = [p for p in (_point(item) for item in raw.get("kept") or []) if p is not None]
            series._series[str(name)] = _Decimated(
                kept=kept[-series.max_points :],
                stride=max(1, int(raw.get("stride", 1))),
                offered=int(raw.get("offered", len(kept))),
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


def parse_metrics_line(line: str) -> MetricsLine | None:
    """The metrics in a log line, or None when it is not a (well-formed) metrics line. Never raises."""
    # Total: rank 0's code prints these lines, so any text gives a value or None. The cheap test first: almost no
    # line is one; an over-long one is refused before the regex and the parser see it.
    if MARKER not in line or len(line) > MAX_LINE_CHARS:
        return None
    match = _LINE.match(line)
    if match is None:
        return None
    doc = loads_untrusted(match.group("doc"), max_bytes=MAX_LINE_CHARS)
    if not isinstance(doc, dict):
        return None
    step = _number_from_json(doc.get("step"))
    raw_last = doc.get("last")
    last = {
        str(name): number
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
                    points[str(name)] = kept
    if not last and not points:
        return None
    return MetricsLine(step=step if step is not None and math.isfinite(step) else None, last=last, points=points)


def format_metrics(step: float | None, values: Mapping[str, float]) -> str:
    """``step 1200 loss=0.312 accuracy=0.91``: how metrics read in the task log."""
    parts = [] if step is None else [f"step {_step_to_json(step)}"]
    parts += [f"{name}={value:.4g}" for name, value in values.items()]
    return " ".join(parts)


# --- the producer: report() in the training code --------------------------------------------------------------------


class Reporter:
    """Rank 0's side: collects reported values and prints at most one metrics line per ``interval`` seconds.

    The clock and the writer are parameters, so the rate limit is testable without sleeping.
    """

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        points_per_line: int = POINTS_PER_LINE,
    ) -> None:
        self.interval = interval
        self._write = write or _print_line
        self._clock = clock
        self._points_per_line = points_per_line
        self._pending = MetricSeries(max_points=points_per_line)
        self._last: dict[str, float] = {}
        self._names: set[str] = set()
        self._step: float | None = None
        self._printed_at: float | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def report(self, step: int | float | None, values: Mapping[str, Any]) -> None:
        with self._lock:
            if step is None:
                step = 0.0 if self._step is None else self._step + 1
            else:
                checked = _as_float(step)
                if checked is None or not math.isfinite(checked):
                    self._warn_once("step", f"report(): step must be a number, got {step!r}; the report is skipped")
                    return
                step = checked
            self._step = float(step)
            for name, raw in values.items():
                value = _as_float(raw)
                if value is None:
                    self._warn_once(
                        f"value:{name}",
                        f"report(): {name}={raw!r} is not a number (expected a float, int, or a torch/numpy scalar); "
                        "it is skipped",
                    )
                    continue
                if name not in self._names and len(self._names) >= MAX_METRICS:
                    self._warn_once("too-many", f"report(): more than {MAX_METRICS} metric names; {name!r} is skipped")
                    continue
                self._names.add(name)
                self._pending.add(name, self._step, value)
                self._last[name] = value
            now = self._clock()
            if self._printed_at is None or now - self._printed_at >= self.interval:
                self._print(now)

    def flush(self) -> None:
        """Print what was reported since the last line (at exit: the last step is never lost)."""
        with self._lock:
            if len(self._pending):
                self._print(self._clock())

    def _print(self, now: float) -> None:
        if not len(self._pending):
            return
        line = MetricsLine(
            step=self._step,
            last=dict(self._last),
            points={name: tuple(self._pending.points(name)) for name in self._pending.names},
        )
        self._pending = MetricSeries(max_points=self._points_per_line)
        self._printed_at = now
        self._write(line.to_text())

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def _as_float(value: Any) -> float | None:
    """A number (int, float, a 0-d torch tensor or numpy scalar: anything ``float()`` takes), else None."""
    if isinstance(value, bool | str | bytes):
        return None
    # A loss straight from the graph (requires_grad): float() would warn on every call; detach() does not copy.
    detach = getattr(value, "detach", None)
    if callable(detach):
        value = detach()
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor with more than one element
        return None


def _print_line(text: str) -> None:
    # One write with its newline, flushed: lines of several threads never interleave, and they reach the log now.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _Outside:
    """Not a torch elastic worker: every report() is a no-op; the first one warns."""

    warned = False


_reporter: Reporter | _Outside | None = None
_setup_lock = threading.Lock()


def _interval_from_env(env: Mapping[str, str]) -> float:
    raw = env.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        warnings.warn(
            f"{INTERVAL_ENV}={raw!r}: expected seconds >= 0; using {DEFAULT_INTERVAL:g}", RuntimeWarning, stacklevel=4
        )
        return DEFAULT_INTERVAL
    return value


def _current() -> Reporter | _Outside | None:
    """This process's reporter, made on the first call: rank 0's, None on other ranks, ``_Outside`` outside a job."""
    global _reporter
    if _reporter is None:
        with _setup_lock:
            if _reporter is None:
                env = os.environ
                if "RANK" not in env or "TORCHELASTIC_RUN_ID" not in env:
                    _reporter = _Outside()
                elif env["RANK"] != "0":
                    # Only rank 0's reports count; the others stay a cheap no-op.
                    _reporter = _NOT_RANK_0
                else:
                    reporter = Reporter(interval=_interval_from_env(env))
                    # Backstop for workers that end through sys.exit (spawn); the runner also flushes after the
                    # training function returns or raises, which covers forked workers (they end with os._exit).
                    atexit.register(reporter.flush)
                    _reporter = reporter
    return None if _reporter is _NOT_RANK_0 else _reporter


_NOT_RANK_0: Final = _Outside()


def report(step: int | None = None, **values: float) -> None:
    """Report training metrics, e.g. ``report(step=epoch, loss=loss.item(), accuracy=acc)``, from any rank.

    Only rank 0's reports count (on other ranks this returns at once). They show as progress lines in the task log
    (at most one per ``[torch_elastic] report_interval``, 15 s by default, however often this is called), as charts in
    the Airflow UI, and as the last values in the task's final log line. ``step`` defaults to the previous step + 1.
    Values are anything ``float()`` accepts (a torch or numpy scalar too); others are skipped with a warning.
    Outside a torch elastic worker this does nothing and warns once; it never raises.
    """
    reporter = _current()
    if reporter is None:
        return
    if isinstance(reporter, _Outside):
        if not reporter.warned:
            reporter.warned = True
            warnings.warn(
                "report() outside a torch elastic worker (no RANK/TORCHELASTIC_RUN_ID in the environment): "
                "the metrics are ignored",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    reporter.report(step, values)


def flush() -> None:
    """Print rank 0's pending metrics now (the runner calls it when the training function ends)."""
    reporter = _reporter
    if isinstance(reporter, Reporter):
        reporter.flush()


def _reset_for_tests() -> None:
    global _reporter
    _reporter = None


# --- the Airflow side: the log callable's wrapper ---------------------------------------------------------------------

# ``[pod-or-node] line``: the source prefix that the wait core (pods) and local execution (nodes) put on output lines.
_SOURCE: Final = re.compile(r"^\[(?P<source>[^\]\s]+)\] (?P<rest>.*)$", re.DOTALL)


class MetricsTap:
    """Wraps a log callable: a metrics line becomes ``metrics: step 1200 loss=0.312 ...``, every other line passes
    unchanged. Keeps what the job summary needs: the metric series and a bounded tail of each source's log.

    Its state is JSON (``to_json``/``from_json``), so it can travel in a trigger event.
    """

    def __init__(
        self, log: Callable[[str], None], *, series: MetricSeries | None = None, keep_unprefixed: bool = False
    ) -> None:
        self._log = log
        self.series = series or MetricSeries()
        #: Keep lines without a ``[source] `` prefix as the tail of source ``""``: a one-node local run's output has
        #: no prefix. On Kubernetes such lines are the wait's own (progress, notices), which no summary shows.
        self._keep_unprefixed = keep_unprefixed
        self._tails: dict[str, deque[str]] = {}
        self._lock = threading.Lock()  # local execution pumps each node's output from its own thread

    def __call__(self, line: str) -> None:
        parsed = parse_metrics_line(line)
        if parsed is not None:
            with self._lock:
                self.series.extend(parsed)
            self._log(f"metrics: {format_metrics(parsed.step, parsed.last)}")
            return
        self._keep_tail(line)
        self._log(line)

    def _keep_tail(self, line: str) -> None:
        match = _SOURCE.match(line)
        if match is None and not self._keep_unprefixed:
            # The wait's own lines (progress, fallbacks), not a pod's log: no summary shows them, and keeping them
            # would put them in the trigger event, which the triggerer logs again.
            return
        source, rest = (match.group("source"), match.group("rest")) if match else ("", line)
        with self._lock:
            tail = self._tails.get(source)
            if tail is None:
                if len(self._tails) >= TAIL_SOURCES:
                    return
                tail = self._tails[source] = deque(maxlen=TAIL_LINES)
            tail.append(rest[:TAIL_LINE_CHARS])

    def tails(self) -> dict[str, str]:
        """The last lines of each source's log (``""``: a one-node local run's, whose lines have no prefix)."""
        with self._lock:
            return {source: "\n".join(lines) for source, lines in self._tails.items()}

    @property
    def last(self) -> dict[str, float]:
        return self.series.last()

    def summary_line(self) -> str:
        """``last metrics: step 1200 loss=0.312 ...``, or ``""`` when nothing was reported."""
        last = self.last
        if not last:
            return ""
        return f"last metrics: {format_metrics(self.series.last_step, last)}"

    def to_json(self, max_bytes: int = EVENT_MAX_BYTES) -> dict[str, Any]:
        """The state as JSON, within ``max_bytes`` (it travels in a trigger event): the longest log tails are dropped
        first, then every metric keeps every other point until it fits."""
        doc: dict[str, Any] = {"series": self.series.to_json(), "tails": self.tails()}

        def size() -> int:
            return len(json.dumps(doc, separators=(",", ":")))

        tails: dict[str, str] = doc["tails"]
        for source in sorted(tails, key=lambda name: -len(tails[name])):
            if size() <= max_bytes:
                return doc
            del tails[source]
        metrics: dict[str, Any] = doc["series"]["metrics"]
        while size() > max_bytes and any(len(raw["kept"]) > 1 for raw in metrics.values()):
            for raw in metrics.values():
                raw["kept"], raw["stride"] = raw["kept"][::2], raw["stride"] * 2
        return doc

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, log: Callable[[str], None]) -> MetricsTap:
        tap = cls(log, series=MetricSeries.from_json(data["series"]) if data and data.get("series") else None)
        for source, text in ((data or {}).get("tails") or {}).items():
            lines: Iterable[str] = str(text).splitlines()
            tap._tails[str(source)] = deque(lines, maxlen=TAIL_LINES)
        return tap

"""``report(step=..., **values)`` for the training code: rank 0 prints a metrics line at most once per interval.

The line's format is :mod:`airflow_provider_torchelastic.core.metrics_format`; what Airflow does with it is
:class:`~airflow_provider_torchelastic.core.tap.MetricsTap`. Standard library only: it runs in the workers.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.metrics_format import (
    DEFAULT_INTERVAL,
    INTERVAL_ENV,
    MAX_METRICS,
    POINTS_PER_LINE,
    MetricSeries,
    MetricsLine,
)
from airflow_provider_torchelastic.core.public import publish
from airflow_provider_torchelastic.worker.liveness import heartbeat

__all__ = ["Reporter", "flush", "report"]

# --- the producer --------------------------------------------------------------------


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
    heartbeat()  # every rank's call is progress, though only rank 0's values count
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


# Exported at the package root, and shown (and pickled by reference) by that path.
publish(report)

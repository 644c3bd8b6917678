"""The Airflow side of the metrics lines: a wrapper of the task's log callable that turns them into progress lines
and keeps what the job summary needs (the series and each source's log tail). Pure: local execution, the wait core
and the trigger wrap their log callables in it alike."""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.metrics_format import (
    MetricSeries,
    format_metrics,
    parse_metrics_line,
    split_glued,
)

__all__ = ["EVENT_MAX_BYTES", "TAIL_LINES", "TAIL_LINE_CHARS", "TAIL_SOURCES", "MetricsTap"]

#: Lines of each pod's (or node's) log kept for the job summary, and the longest line kept.
TAIL_LINES: Final = 50
TAIL_LINE_CHARS: Final = 1000
#: Log sources whose tails are kept (pods streamed into the task log; the wait core streams at most 8).
TAIL_SOURCES: Final = 16
#: The most :meth:`MetricsTap.to_json` takes: it travels in a trigger event, which Airflow keeps in its database.
EVENT_MAX_BYTES: Final = 64 * 1024

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
        unfinished, rest = split_glued(line)
        if unfinished:  # another worker's unfinished line, which rank 0's metrics line followed: still its output
            self._keep_tail(unfinished)
            self._log(unfinished)
        parsed = parse_metrics_line(rest)
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
        first, then every metric keeps every other point, then whole metrics go, the last first, until it fits."""
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
        while size() > max_bytes and metrics:
            del metrics[next(reversed(metrics))]
        return doc

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, log: Callable[[str], None]) -> MetricsTap:
        """The tap :meth:`to_json` gave, read back from a trigger event. Never raises: a part of the wrong shape is
        dropped, as the job's result does not depend on its charts or log tails."""
        if not isinstance(data, Mapping):
            data = {}
        series = data.get("series")
        tap = cls(log, series=MetricSeries.from_json(series) if isinstance(series, Mapping) and series else None)
        tails = data.get("tails")
        for source, text in tails.items() if isinstance(tails, Mapping) else ():
            if isinstance(source, str) and isinstance(text, str) and len(tap._tails) < TAIL_SOURCES:
                lines: Iterable[str] = text.splitlines()
                tap._tails[source] = deque(lines, maxlen=TAIL_LINES)
        return tap

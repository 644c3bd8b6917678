"""The runner's watchdog: stalled ranks, and the deadline of a requested stop.

One daemon thread per runner, beside torch's agent (which owns the main thread while the workers run). It reads the
heartbeat files of this node's ranks (:mod:`airflow_provider_torchelastic.worker.liveness`), asks
:func:`~airflow_provider_torchelastic.core.stall.judge` whether some rank is stalled and, if so, takes every local
worker's Python stacks (``faulthandler`` on SIGUSR2, which works while a rank is blocked in C; not SIGUSR1, which
Lightning's SLURM requeue uses) and torch's Flight Recorder trace, then kills the workers: torch's agent sees them
fail and the runner reports the stall instead of their signals. After SIGTERM (:meth:`Watchdog.request_stop`) it
lets the workers finish until the shutdown timeout, then takes their stacks and kills them the same way.

Standard library only; the decisions are :mod:`airflow_provider_torchelastic.core.stall`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from airflow_provider_torchelastic.core.stall import RankBeat, Stall, judge
from airflow_provider_torchelastic.worker.liveness import DONE_SUFFIX, HEARTBEAT_PREFIX

__all__ = ["DUMP_REQUEST", "STACKS_SIGNAL", "Forensics", "Watchdog"]

#: The signal on which every worker's ``faulthandler`` writes all its threads' stacks.
STACKS_SIGNAL: Final = signal.SIGUSR2
#: Created in the heartbeat folder to ask every worker's trace thread for a Flight Recorder dump.
DUMP_REQUEST: Final = "dump-request"
STACKS_SUFFIX: Final = ".stacks"
TRACE_SUFFIX: Final = ".trace.json"
#: How long the workers get to write their stacks and traces.
_FORENSICS_WAIT: Final = 3.0
#: How long torch's agent gets to notice the workers killed at a stop's deadline before the runner exits itself.
_AGENT_WAIT: Final = 5.0
#: Frames of the launch machinery, left out of the short stacks in a report (the kept files have them all).
_LAUNCH_FRAMES: Final = (
    "/multiprocessing/",
    "/torch/distributed/elastic/",
    "/torch/multiprocessing/",
    "/torch/distributed/c10d_logger.py",
    "airflow_provider_torchelastic/runner/",
    'File "<string>"',
)
#: The most of one rank's short stack in a report, which a termination message (4 KiB) must hold for every rank.
_TOP_CHARS: Final = 1200
#: The most of one rank's stacks or trace kept (a trace of thousands of collectives is large).
FORENSICS_LIMIT: Final = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class Forensics:
    """What the workers left when they were stopped: each rank's stacks and Flight Recorder trace (bounded)."""

    stacks: dict[int, str] = field(default_factory=dict)
    traces: dict[int, str] = field(default_factory=dict)

    def top_frames(self, rank: int, count: int = 8) -> str:
        """The innermost frames of the rank's main thread (the one the signal interrupted), without the frames of
        the launch machinery (multiprocessing, torch elastic, the runner) that every rank shares."""
        text = self.stacks.get(rank, "")
        block = text.partition("Current thread")[2] or text
        block = block.split("\nThread 0x", 1)[0]
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        return "\n".join(f for f in frames if not any(noise in f for noise in _LAUNCH_FRAMES))[:_TOP_CHARS]


def _alive(pid: int) -> bool:
    """Whether the process runs: a zombie (ended, not yet reaped by torch) does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _read_limited(path: Path) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(FORENSICS_LIMIT + 1)
    except OSError:
        return ""
    text = data[:FORENSICS_LIMIT].decode("utf-8", "replace")
    return text + ("\n... (cut)" if len(data) > FORENSICS_LIMIT else "")


class Watchdog(threading.Thread):
    """Watches the ranks of this node (their files in ``folder``) and the deadline of a requested stop."""

    def __init__(
        self,
        folder: Path,
        stop_file: Path,
        *,
        stall_timeout: float | None,
        shutdown_timeout: float,
        interval: float | None = None,
        clock: Callable[[], float] = time.time,
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__(name="torchelastic-watchdog", daemon=True)
        self.folder = folder
        self.stop_file = stop_file
        self.stall_timeout = stall_timeout
        self.shutdown_timeout = shutdown_timeout
        # Often enough that a stall is seen well within a minute of the limit, rarely enough to cost nothing.
        limit = stall_timeout if stall_timeout is not None else 60.0
        self.interval = interval if interval is not None else min(5.0, max(0.5, limit / 10))
        self.clock = clock
        self.log = log
        #: The stall that stopped the workers, and what they left.
        self.stall: Stall | None = None
        self.forensics: Forensics | None = None
        #: When SIGTERM came (Unix time), and whether the deadline then passed (the workers were killed).
        self.stop_requested_at: float | None = None
        self.stop_expired = False
        #: The stop found no worker running (none started, or all returned while the node waited for its peers).
        self.stop_idle = False
        #: Called when the workers are gone after the deadline but the agent still has not returned (it waits in a
        #: rendezvous for nodes that are gone): the runner reports the stop and exits.
        self.on_expired: Callable[[], object] | None = None
        self._wake = threading.Event()
        self._done = threading.Event()

    # --- called from the main thread -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM came: tell the workers (the stop file), and start the deadline. Safe in a signal handler."""
        if self.stop_requested_at is None:
            self.stop_requested_at = self.clock()
            with contextlib.suppress(OSError):
                self.stop_file.touch()
            self._wake.set()

    def close(self) -> None:
        self._done.set()
        self._wake.set()

    # --- the thread ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._done.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._done.is_set():
                return
            now = self.clock()
            if self.stop_requested_at is not None:
                # No worker left to save anything (none started yet, or all returned and torch's agent waits in its
                # exit barrier for other nodes): nothing to wait for, the stop ends the node now.
                idle = not any(beat.alive and not beat.done for beat in self.beats().values())
                if not self.stop_expired and (idle or now - self.stop_requested_at >= self.shutdown_timeout):
                    self.stop_expired, self.stop_idle = True, idle
                    self.log(
                        "torchelastic runner: no worker is running: the node stops now"
                        if idle
                        else f"torchelastic runner: the workers did not finish within {self.shutdown_timeout:g} s of "
                        "the stop request; taking their stacks and stopping them"
                    )
                    self._stop_workers()
                    if not self._done.wait(_AGENT_WAIT) and self.on_expired is not None:
                        self.on_expired()
                continue
            if self.stall_timeout is None or self.stall is not None:
                continue  # no detection, or a stall already handled: no folder to read
            stall = judge(list(self.beats().values()), now, self.stall_timeout)
            if stall is not None:
                self.stall = stall
                self.log(f"torchelastic runner: stalled: {stall.message()}")
                self._stop_workers()

    def beats(self) -> dict[int, RankBeat]:
        """The ranks that started on this node in the current attempt, by global rank."""
        found: dict[int, RankBeat] = {}
        with contextlib.suppress(OSError):
            for path in self.folder.iterdir():
                rank_text = path.name[len(HEARTBEAT_PREFIX) :]
                if not path.name.startswith(HEARTBEAT_PREFIX) or not rank_text.isdigit():
                    continue
                try:
                    last = path.stat().st_mtime
                    pid = int(path.read_text() or "0")
                except (OSError, ValueError):
                    continue
                done = path.with_name(path.name + DONE_SUFFIX).exists()
                found[int(rank_text)] = RankBeat(
                    rank=int(rank_text), last_beat=last, done=done, alive=pid > 0 and _alive(pid)
                )
        return found

    def _pids(self) -> dict[int, int]:
        """Each started rank's worker pid, as its heartbeat file holds it (one read per file)."""
        pids = {}
        for path in self.folder.glob(f"{HEARTBEAT_PREFIX}*"):
            rank = path.name[len(HEARTBEAT_PREFIX) :]
            if rank.isdigit():
                with contextlib.suppress(OSError, ValueError):
                    pids[int(rank)] = int(path.read_text())
        return pids

    def _stop_workers(self) -> None:
        pids = {rank: pid for rank, pid in self._pids().items() if pid > 0 and _alive(pid)}
        self.forensics = self.collect(pids)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        # A restarted attempt (max_restarts) starts its ranks' clocks afresh.
        for path in self.folder.glob(f"{HEARTBEAT_PREFIX}*"):
            if not path.name.endswith((STACKS_SUFFIX, TRACE_SUFFIX)):
                path.unlink(missing_ok=True)

    def collect(self, pids: dict[int, int]) -> Forensics:
        """Every live rank's stacks (all threads) and Flight Recorder trace, bounded, as the workers wrote them."""
        request = self.folder / DUMP_REQUEST
        with contextlib.suppress(OSError):
            request.touch()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, STACKS_SIGNAL)
        deadline = time.monotonic() + _FORENSICS_WAIT
        while time.monotonic() < deadline:
            if all(self.folder.joinpath(f"{HEARTBEAT_PREFIX}{r}{TRACE_SUFFIX}").exists() for r in pids):
                break
            time.sleep(0.1)
        time.sleep(0.2)  # faulthandler writes as the signal arrives; the last trace may still be closing
        request.unlink(missing_ok=True)
        stacks = {r: _read_limited(self.folder / f"{HEARTBEAT_PREFIX}{r}{STACKS_SUFFIX}") for r in pids}
        traces = {r: _read_limited(self.folder / f"{HEARTBEAT_PREFIX}{r}{TRACE_SUFFIX}") for r in pids}
        return Forensics(stacks={r: s for r, s in stacks.items() if s}, traces={r: t for r, t in traces.items() if t})

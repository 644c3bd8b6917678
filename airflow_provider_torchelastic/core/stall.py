"""When training stops moving: which ranks are stalled, and what a stop gives the training code.

Pure and standard library only: the runner's watchdog (:mod:`airflow_provider_torchelastic.runner.watchdog`) reads
the ranks' heartbeat files and asks :func:`judge`; the operator checks ``stall_timeout`` and
``termination_grace_period`` with :func:`check_stall_timeout` and :func:`check_grace_period` when the DAG is parsed.

How a stall is decided: every rank's worker keeps a heartbeat (the runner's worker wrapper beats when the function
starts, then every optimizer step, every ``report()`` and every ``context.heartbeat()`` does). A rank whose last beat
is older than ``stall_timeout`` while its process lives and its function has not returned is stalled. The clock of a
rank starts when its worker process starts, after the rendezvous: importing torch, unpickling the function and
``init_process_group`` count against it, waiting for other nodes to join does not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_STALL_TIMEOUT",
    "GRACE_PERIOD_ENV",
    "STALLED_EXCEPTION",
    "STALL_TIMEOUT_ENV",
    "STOPPED_EXCEPTION",
    "RankBeat",
    "Stall",
    "check_grace_period",
    "check_stall_timeout",
    "FORENSICS_PHRASE",
    "collective_timeout_message",
    "forensics_location",
    "is_collective_timeout",
    "grace_period_seconds",
    "judge",
    "liveness_env",
    "shutdown_timeout",
]

#: Seconds a rank may go without a sign of progress: generous, since a first step, an evaluation or a checkpoint
#: save can be slow, and as long as gloo's own collective timeout, so a pending collective fails here no later.
DEFAULT_STALL_TIMEOUT: Final = 1800.0
#: Seconds a pod (and a local run) gets between SIGTERM and SIGKILL, rendered as ``terminationGracePeriodSeconds``:
#: Kubernetes' 30 s rarely saves a checkpoint of a large model to object storage; a spot reclaim gives about 2 min.
DEFAULT_GRACE_PERIOD: Final = 120.0
#: The runner's settings, rendered into every pod's training container and set for local execution.
STALL_TIMEOUT_ENV: Final = "TORCHELASTIC_STALL_TIMEOUT"
GRACE_PERIOD_ENV: Final = "TORCHELASTIC_GRACE_PERIOD"
#: The names the runner's reports give a stall and a requested stop (:mod:`.outcome`'s causes read them).
STALLED_EXCEPTION: Final = "TrainingStalled"
STOPPED_EXCEPTION: Final = "StopRequested"
#: Seconds of the grace period the runner keeps for itself (forensics, its report) after the workers' share.
_REPORT_MARGIN: Final = 10.0


def _seconds(name: str, value: object, *, allow_none: bool) -> float | None:
    expected = "seconds > 0 (an int, a float or a timedelta)" + (", or None to turn it off" if allow_none else "")
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


def check_stall_timeout(value: object) -> float | None:
    """``stall_timeout``: seconds or a timedelta (> 0), or None (no stall detection)."""
    return _seconds("stall_timeout", value, allow_none=True)


def check_grace_period(value: object) -> float:
    """``termination_grace_period``: seconds or a timedelta (> 0); Kubernetes takes whole seconds (rounded up)."""
    seconds = _seconds("termination_grace_period", value, allow_none=False)
    assert seconds is not None
    return seconds


def liveness_env(stall_timeout: float | None, grace_period: float) -> dict[str, str]:
    """The runner's stall and stop settings as the variables every pod and local node gets."""
    return {
        STALL_TIMEOUT_ENV: "none" if stall_timeout is None else f"{stall_timeout:g}",
        GRACE_PERIOD_ENV: f"{grace_period:g}",
    }


def grace_period_seconds(grace_period: float) -> int:
    """``terminationGracePeriodSeconds``: whole seconds, rounded up (never less time than asked for)."""
    return max(1, math.ceil(grace_period))


def shutdown_timeout(grace_period: float) -> float:
    """How long the runner lets its workers finish after a stop was requested: the grace period less the runner's
    own margin (at most a quarter of it), so that the report is written before the SIGKILL."""
    return max(1.0, grace_period - min(_REPORT_MARGIN, grace_period / 4))


@dataclass(frozen=True, kw_only=True)
class RankBeat:
    """What the watchdog knows of one local rank."""

    rank: int
    #: Unix time of its last sign of progress.
    last_beat: float
    #: Its function returned (it waits for nothing from it any more).
    done: bool = False
    #: Its worker process still runs.
    alive: bool = True


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Ranks silent for longer than the limit, and ranks whose process ended without returning."""

    #: (rank, seconds silent) of each stalled rank, longest first.
    silent: tuple[tuple[int, float], ...]
    #: Ranks whose process ended without their function returning (``os._exit``, killed).
    gone: tuple[int, ...] = ()
    #: Ranks whose function had returned (``exit()``, an early return) while others waited.
    returned: tuple[int, ...] = ()
    limit: float = DEFAULT_STALL_TIMEOUT

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.silent)

    def message(self) -> str:
        """One paragraph: who is stalled, for how long, and who left (the likely reason the others wait)."""
        silent = ", ".join(f"rank {rank} for {seconds:.0f} s" for rank, seconds in self.silent)
        text = f"no progress within stall_timeout={self.limit:g} s: {silent} silent"
        if self.gone:
            text += (
                f"; rank(s) {', '.join(map(str, self.gone))} left without a result (the process ended without its "
                "function returning: os._exit(), a signal), which the others may be waiting for"
            )
        if self.returned:
            text += (
                f"; rank(s) {', '.join(map(str, self.returned))} had returned (exit() or an early return) while the "
                "others still ran, which a collective of theirs may be waiting for"
            )
        return text + (
            ". A stall is recoverable: the retry resumes from the last checkpoint. Give slow phases a heartbeat "
            "(context.heartbeat()) or raise stall_timeout if this rank was busy, not stuck"
        )


def judge(beats: Sequence[RankBeat], now: float, limit: float | None) -> Stall | None:
    """A stall when some live rank that has not returned was silent for longer than ``limit`` (None: never)."""
    if limit is None:
        return None
    silent = sorted(
        ((b.rank, now - b.last_beat) for b in beats if b.alive and not b.done and now - b.last_beat > limit),
        key=lambda item: (-item[1], item[0]),
    )
    if not silent:
        return None
    gone = tuple(sorted(b.rank for b in beats if not b.alive and not b.done))
    returned = tuple(sorted(b.rank for b in beats if b.done))
    return Stall(silent=tuple(silent), gone=gone, returned=returned, limit=limit)


#: What a collective that timed out says: gloo's ``Timed out waiting 1800000ms for recv operation to complete`` (and
#: send), the c10d wrapper's ``... timed out after ...``, NCCL's watchdog ``Watchdog caught collective operation
#: timeout``.
_COLLECTIVE_TIMEOUT: Final = re.compile(
    r"timed out waiting \d+ ?ms for (recv|send)|watchdog caught collective operation timeout"
    r"|collective operation timeout",
    re.IGNORECASE,
)
#: gloo names the peer it waited for: ``[127.0.0.1]:43567`` style addresses after "for"/"from".
_PEER: Final = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")


#: How a failure says where its forensics went (runner/stops.py writes it; the job summary lists the location).
FORENSICS_PHRASE: Final = "stacks and traces kept at "
_FORENSICS: Final = re.compile(re.escape(FORENSICS_PHRASE) + r"([^\s,;)\"\\]+)")


def forensics_location(text: str) -> str | None:
    """Where a stalled or stopped try's stacks and traces were kept, as its failure message says; None if nowhere."""
    found = _FORENSICS.search(text)
    return found.group(1) if found else None


def is_collective_timeout(message: str) -> bool:
    """Whether a worker's error is a collective that timed out: the stall of a peer, not this rank's own bug."""
    return bool(_COLLECTIVE_TIMEOUT.search(message))


def collective_timeout_message(message: str) -> str:
    """The error of a timed-out collective, said as the stall it is (naming the peer it waited for, where given)."""
    peer = _PEER.search(message)
    who = f" (it waited for the peer at {peer.group(1)}:{peer.group(2)})" if peer else ""
    return (
        f"a collective timed out{who}: a peer rank stopped making progress (stuck, or gone) while this rank waited "
        f"for it; this is a stall, and recoverable. Original error: {message}"
    )

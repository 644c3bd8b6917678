"""What the runner reports when its watchdog stopped the workers: a stall, or a stop after SIGTERM.

The watchdog (:mod:`airflow_provider_torchelastic.runner.watchdog`) decides and collects; this turns what it saw into
the node's failure report (a :class:`~airflow_provider_torchelastic.core.outcome.WorkerFailure`), bounded to fit a
termination message, and keeps the full stacks and traces in the try's artifact or checkpoint location.
Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from airflow_provider_torchelastic.core.outcome import WorkerFailure
from airflow_provider_torchelastic.core.stall import (
    FORENSICS_PHRASE,
    STALLED_EXCEPTION,
    STOPPED_EXCEPTION,
    collective_timeout_message,
    is_collective_timeout,
)
from airflow_provider_torchelastic.runner.watchdog import Forensics, Watchdog

__all__ = ["name_the_rank_that_left", "stall_of_timeout", "stop_failure", "watched_failure"]


def watched_failure(watchdog: Watchdog, failure: WorkerFailure | None) -> WorkerFailure | None:
    """The try's failure as the watchdog saw it: a requested stop, or a stall; None when it saw neither."""
    if watchdog.stop_requested_at is not None:
        return stop_failure(watchdog, failure)
    if watchdog.stall is not None:
        return _stall_failure(watchdog)
    return None


def stop_failure(watchdog: Watchdog | None, failure: WorkerFailure | None) -> WorkerFailure:
    if watchdog is None:
        how = "the workers had not started yet"
    elif watchdog.stop_idle:
        how = "no worker was running (none had started, or all had returned and the node waited for its peers)"
    elif watchdog.stop_expired:
        how = (
            f"the workers did not finish within {watchdog.shutdown_timeout:g} s of it (shutdown timeout: the grace "
            "period less the runner's margin), so they were stopped"
        )
    else:
        elapsed = time.time() - (watchdog.stop_requested_at or time.time())
        how = f"the training function saw stop_requested() and ended {elapsed:.0f} s later"
        if failure is not None and failure.exception != STOPPED_EXCEPTION:
            how += f" (rank {failure.rank} raised {failure.exception}: {failure.message[:500]})"
    forensics = watchdog.forensics if watchdog is not None else None
    return WorkerFailure(
        rank=failure.rank if failure is not None else -1,
        exception=STOPPED_EXCEPTION,
        message=f"SIGTERM: this node was asked to stop (its pod deleted, preempted or drained, or the task killed); "
        f"{how}. Recoverable: the next try resumes from the last checkpoint" + _kept_forensics(forensics, "stopped"),
        traceback=_stacks_text(forensics),
        recoverable=True,
        timestamp=time.time(),
        hostname=socket.gethostname(),
    )


def _stall_failure(watchdog: Watchdog) -> WorkerFailure:
    stall = watchdog.stall
    assert stall is not None
    forensics = watchdog.forensics or Forensics()
    where = "".join(
        f"\nrank {rank} was at: {frames.splitlines()[0]}"
        for rank in stall.ranks
        if (frames := forensics.top_frames(rank))
    )
    return WorkerFailure(
        rank=stall.ranks[0],
        exception=STALLED_EXCEPTION,
        message=stall.message() + _pending_collectives(forensics) + where + _kept_forensics(forensics, "stalled"),
        traceback=_stacks_text(forensics),
        recoverable=True,
        timestamp=time.time(),
        hostname=socket.gethostname(),
    )


def name_the_rank_that_left(failure: WorkerFailure, watchdog: Watchdog, error: Any) -> WorkerFailure:
    """A rank that lost its peer (a consequence) because that peer's process ended without its function returning
    or failing (``os._exit(0)``: torch counts it a success) says which rank left."""
    if not failure.is_consequence:
        return failure
    failed = {int(rank) for rank in getattr(error, "failures", {})}
    left = sorted(rank for rank, beat in watchdog.beats().items() if not beat.done and rank not in failed)
    if not left:
        return failure
    return replace(
        failure,
        message=f"rank(s) {', '.join(map(str, left))} left without a result (the process ended before the function "
        f"returned, without an exception: os._exit()?) while rank {failure.rank} waited for it: {failure.message}",
    )


def stall_of_timeout(failure: WorkerFailure) -> WorkerFailure:
    """A collective that timed out is the stall of a peer this rank waited for: recoverable, and said so."""
    if failure.recoverable or not is_collective_timeout(failure.message):
        return failure
    return replace(
        failure, exception=STALLED_EXCEPTION, message=collective_timeout_message(failure.message), recoverable=True
    )


def _stacks_text(forensics: Forensics | None) -> str:
    """Each rank's main-thread stack, short (a termination message holds 4 KiB); the kept files have every thread."""
    if forensics is None:
        return ""
    return "\n".join(
        f"--- rank {rank}: main thread, innermost first ---\n{forensics.top_frames(rank)}"
        for rank in sorted(forensics.stacks)
    )


def _pending_collectives(forensics: Forensics) -> str:
    """From the Flight Recorder traces: the newest collective any rank entered, which ranks wait in it, and which
    never entered it (their newest collective is an older one: that rank is the one the others wait for)."""
    newest: dict[int, tuple[int, str]] = {}
    for rank, text in forensics.traces.items():
        try:
            entries = json.loads(text).get("entries") or []
        except (ValueError, AttributeError):
            entries = []
        seqs = [
            (int(e.get("collective_seq_id") or 0), str(e.get("profiling_name") or "a collective"))
            for e in entries
            if isinstance(e, dict)
        ]
        newest[rank] = max(seqs, default=(0, ""))
    if not newest or max(seq for seq, _ in newest.values()) == 0:
        return ""
    seq, name = max(newest.values())
    waiting = sorted(rank for rank, (s, _) in newest.items() if s == seq)
    absent = sorted(rank for rank, (s, _) in newest.items() if s < seq)
    text = f"; torch's Flight Recorder: rank(s) {', '.join(map(str, waiting))} entered {name} (collective {seq})"
    if absent:
        text += f"; rank(s) {', '.join(map(str, absent))} never entered it"
    return text


def _kept_forensics(forensics: Forensics | None, what: str) -> str:
    """Copy the stacks and traces to the try's artifact (else checkpoint) location; where they went, or ""."""
    if forensics is None or not (forensics.stacks or forensics.traces):
        return ""
    try:
        context = json.loads(os.environ.get("TORCHELASTIC_CONTEXT") or "{}")
        base = context.get("artifact_uri") or context.get("checkpoint_uri")
        if not isinstance(base, str) or not base:
            return ""
        url = f"{base.rstrip('/')}/forensics/try-{int(context.get('try_number') or 0)}/{socket.gethostname()}"
        from airflow_provider_torchelastic.worker.checkpoint_store import write_bytes

        for rank, text in forensics.stacks.items():
            write_bytes(f"{url}/rank-{rank}.stacks.txt", text.encode())
        for rank, text in forensics.traces.items():
            write_bytes(f"{url}/rank-{rank}.trace.json", text.encode())
    except Exception as e:  # forensics are a bonus: the failure is reported whatever the store says
        print(f"torchelastic runner: could not keep the {what} workers' stacks: {e}", file=sys.stderr)
        return ""
    return f"; {FORENSICS_PHRASE}{url}"

"""The task log of a job's pods: rank 0's log as it grows, and the tails of failed pods and restarted runs.

Part of the wait core (:mod:`.wait` yields these requests between its looks at the job): pure, no I/O. Which pod holds
rank 0 is found by its log's ``[rank0]:`` lines; reads are paced and bounded, so a job costs the same few requests a
minute whatever its number of pods and however much it prints.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.requests import EmitLog, ReadLog, Request
from airflow_provider_torchelastic.kubernetes.status import (
    LOG_SKEW_SECONDS,
    LogCursor,
    new_log_lines,
    restarted_run,
    seconds_before,
)
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot, WaitPolicy

__all__ = ["FAILED_TAIL_LINES", "FIRST_READ_TAIL_LINES", "PodLogs", "print_logs"]

#: Log reads of a job are paced: one read per interval, which starts at the poll interval, triples while reads bring
#: nothing to print, and is capped here. So a job costs at most ``60 / poll_interval`` log requests a minute however
#: many pods it has, a quiet one about one, and a queued one (no pods yet) none.
LOG_INTERVAL_MAX: Final = 60.0
#: Lines read from the end of a pod's log on the first read of it: earlier lines are not printed.
FIRST_READ_TAIL_LINES: Final = 1000
#: Lines read from the end of a failed pod's log (its log is final; the tail holds the error).
FAILED_TAIL_LINES: Final = 50
#: Every worker line starts with ``[rank<global rank>]:`` (the runner's ``LOG_LINE_PREFIX``), so the pod whose log has
#: ``[rank0]:`` lines holds rank 0; with elastic rendezvous no one knows which pod that is before the workers start.
RANK0_PREFIX: Final = "[rank0]:"


@dataclass(kw_only=True)
class PodLogs:
    """How far a job's pods' logs were printed, between the wait's looks."""

    cursors: dict[str, LogCursor] = field(default_factory=dict)
    #: Pods whose last read was cut at ``limit_bytes``: the next takes this many lines of the end of the log
    #: (:func:`_paced_read`).
    behind: dict[str, int] = field(default_factory=dict)
    #: The pod whose log showed rank 0's lines: the one whose log is streamed.
    rank0_pod: str | None = None
    #: Round-robin position among the started pods while rank 0's pod is not known.
    probe: int = 0
    next_log_at: float = 0.0
    log_interval: float = 0.0
    #: Failed pods whose tails were printed (at most ``log_pods`` of them).
    tails: set[str] = field(default_factory=set)
    #: Restarted pods: the restart count up to which their previous containers' tails were printed (at most
    #: ``log_pods`` pods).
    restarts_read: dict[str, int] = field(default_factory=dict)


def print_logs(
    ref: JobRef, kind: kinds.JobKind, snapshot: Snapshot, policy: WaitPolicy, state: PodLogs, *, final: bool
) -> Generator[Request, Any, None]:
    """Print rank 0's log and the tails of failed pods, at a bounded number of reads per minute.

    The cost does not grow with the number of pods: one paced read of one pod per interval (rank 0's, or while it is
    not known the next pod in turn, looking for ``[rank0]:`` lines), plus one tail read for each of at most
    ``log_pods`` failed pods over the whole wait, plus one last read of rank 0 when the job ended.
    """
    own_pod = kind.pod_selector(ref.name) is None
    container = kind.log_container
    pods = [snapshot.job] if own_pod and snapshot.job is not None else list(snapshot.pods)
    started = sorted(
        (p for p in pods if p.get("status", {}).get("phase") in ("Running", "Succeeded", "Failed")),
        key=lambda p: p.get("metadata", {}).get("name", ""),
    )
    names = [p["metadata"]["name"] for p in started]
    if own_pod and names:
        state.rank0_pod = names[0]
    elif state.rank0_pod not in names:
        state.rank0_pod = None  # deleted, or recreated by a restart: rank 0 may land elsewhere now
    yield from _previous_tails(ref, container, pods, policy, state)
    for pod in started:
        name = pod["metadata"]["name"]
        failed = pod.get("status", {}).get("phase") == "Failed"
        if not failed or name in state.tails or name == state.rank0_pod or len(state.tails) >= policy.log_pods:
            continue
        state.tails.add(name)
        text = yield ReadLog(
            pod=name, namespace=ref.namespace, since_time=None, tail_lines=FAILED_TAIL_LINES, container=container
        )
        # A fresh cursor: what a probe read of this pod saw was not printed, and the tail holds the error.
        lines, state.cursors[name] = new_log_lines(LogCursor(), text or "")
        for line in lines:
            yield EmitLog(f"[{name}] {line}")
    if not names or (snapshot.now < state.next_log_at and not final):
        return
    # Once the job ended, rank 0's pod must be found now or never: probe up to ``log_pods`` pods in this one pass (a
    # job shorter than the first paced read ends before any probe ran).
    probes = 1 if not final or state.rank0_pod is not None else max(1, min(len(names), policy.log_pods))
    shown: list[str] = []
    for _ in range(probes):
        if state.rank0_pod is not None:
            target = state.rank0_pod
        else:
            target = names[state.probe % len(names)]
            state.probe += 1
        lines = yield from _paced_read(ref, target, container, final, state)
        if target != state.rank0_pod and any(line.startswith(RANK0_PREFIX) for line in lines):
            state.rank0_pod = target
        shown = lines if target == state.rank0_pod else []
        for line in shown:
            yield EmitLog(f"[{target}] {line}")
        if state.rank0_pod is not None:
            break
    # Back off while reads bring nothing to print (a queued, quiet or hidden rank 0); come back as soon as they do,
    # or as soon as a read was cut (more is waiting).
    base = max(policy.poll_interval, 1.0)
    busy = bool(shown) or bool(state.behind) or not state.log_interval
    state.log_interval = base if busy else min(state.log_interval * 3, LOG_INTERVAL_MAX)
    state.next_log_at = snapshot.now + state.log_interval


def _paced_read(
    ref: JobRef, target: str, container: str, final: bool, state: PodLogs
) -> Generator[Request, Any, list[str]]:
    """Read ``target``'s log on from where it was printed to; the lines not printed yet.

    From the whole second before the last line printed (a line written after it may be stamped in that second), by
    the node's own stamps: no clock here is compared with the node's, which may differ by seconds. A first read (or
    the first after a triggerer restart) takes the end of the log, not all of it: a pod that has run for days may have
    printed gigabytes. So does a read after one cut at ``limit_bytes``: more was written than a read brings, and
    reading on from the cut would fall further behind at each read (or, when a read's overlap alone filled it, bring
    the same lines for good). The wait's last read, cut, is followed by one of the end at once. What a read of the
    end leaves out is said in the task log, for rank 0's pod (a probe's lines are not printed, nor what it skipped).
    """
    lines: list[str] = []
    while True:
        cursor = state.cursors.get(target, LogCursor())
        since = _whole_second(seconds_before(cursor.last_time, LOG_SKEW_SECONDS)) or None
        tail = FIRST_READ_TAIL_LINES if since is None else state.behind.pop(target, None)
        read = ReadLog(
            pod=target, namespace=ref.namespace, since_time=since, tail_lines=tail, container=container, last=final
        )
        text = (yield read) or ""
        cut = len(text.encode()) >= read.limit_bytes
        if cut and "\n" in text:
            text = text[: text.rindex("\n") + 1]  # its last line came in part: a later read brings it whole
        brought = len(text.splitlines())
        if cut:
            # Lines of the end of the log that a read likely holds whole, judged by the lines this one held.
            state.behind[target] = max(1, brought * 3 // 4)
        fresh, state.cursors[target] = new_log_lines(cursor, text, cut=cut)
        lines += fresh
        # A read of the end, none of whose lines was printed, and there were more since the cursor than it brought.
        skipped = since and tail and fresh and len(fresh) == brought and (brought >= tail or target in state.behind)
        if skipped and target == state.rank0_pod:
            yield EmitLog(
                f"[{target}] [... lines written after {cursor.last_time} not shown: the log grew faster than reads "
                f"of {read.limit_bytes} bytes every poll bring]"
            )
        if not final or tail or target not in state.behind:
            return lines


def _whole_second(stamp: str) -> str:
    """A cursor's time (or ``""``) in whole seconds, as ``sinceTime`` takes it: the API reads no fraction."""
    return stamp[:19] + "Z" if stamp else ""


def _previous_tails(
    ref: JobRef, container: str, pods: list[Mapping[str, Any]], policy: WaitPolicy, state: PodLogs
) -> Generator[Request, Any, None]:
    """Print the tail of each restarted container's previous run, once per restart.

    A node restarted in place (a TrainJob's ``OnFailure``, a PyTorchJob replica's ``OnFailure``/``ExitCode``) runs
    again in the same pod: its phase never becomes Failed, and its current log starts after the restart, so the
    exception that killed the earlier run is only in the previous container's log. Bounded like the failed pods'
    tails: at most ``log_pods`` pods, one read per restart seen (the kubelet's back-off spaces restarts out).
    """
    for pod in pods:
        restarted = restarted_run(pod, container)
        if restarted is None:
            continue
        name = pod.get("metadata", {}).get("name", "?")
        count, terminated = restarted
        if state.restarts_read.get(name, 0) >= count:
            continue
        if name not in state.restarts_read and len(state.restarts_read) >= policy.log_pods:
            continue
        state.restarts_read[name] = count
        text = yield ReadLog(
            pod=name,
            namespace=ref.namespace,
            since_time=None,
            # One line less than a failed pod's tail: with the header below, it fills one tail of the job summary
            # (core.tap.TAIL_LINES), which would otherwise drop the header.
            tail_lines=FAILED_TAIL_LINES - 1,
            container=container,
            previous=True,
        )
        lines, _ = new_log_lines(LogCursor(), text or "")
        reason = terminated.get("reason") or ""
        ended = f"exit code {terminated.get('exitCode')}" + (f", {reason}" if reason not in ("", "Error") else "")
        yield EmitLog(f"[{name}] --- restart {count}: its previous {container} container ended ({ended}); last lines:")
        for line in lines:
            yield EmitLog(f"[{name}] {line}")

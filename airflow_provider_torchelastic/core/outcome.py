"""What one node (a pod, or a local runner process) reports when it ends, and how it is read back.

The runner writes a small JSON document to its result file; on Kubernetes that file is the container's termination
message, read from the pod status with a plain GET. It is JSON, never a pickle: nothing that comes from a pod is
unpickled on the Airflow side. Standard library only (the runner and the Airflow side share it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.encoding import NAN, NEGATIVE_INFINITY, POSITIVE_INFINITY, loads_untrusted
from airflow_provider_torchelastic.core.stall import STALLED_EXCEPTION, STOPPED_EXCEPTION
from airflow_provider_torchelastic.core.validation import finite_float, int_or, short_repr, text_or

__all__ = [
    "NodeOutcome",
    "ResultTooLargeError",
    "WorkerFailure",
    "decode_outcome",
    "consequence_sign",
    "is_consequence",
    "root_cause",
    "decode_result",
    "encode_failure",
    "encode_success",
    "encode_success_ref",
    "failure_from_json",
    "verdict_from_json",
]

#: Marks our documents, so that a log tail (``FallbackToLogsOnError``) is never mistaken for an outcome.
SCHEMA: Final = "torchelastic.outcome/v1"
#: Kubernetes keeps at most 4096 bytes of a container's termination message.
TERMINATION_MESSAGE_LIMIT: Final = 4096


class ResultTooLargeError(ValueError):
    """Rank 0's result does not fit where it has to travel."""


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """The root cause of a failed node: of the workers that failed, a cause before a victim, then the earliest."""

    #: Global rank of the failing worker (-1 when the node failed before any worker started).
    rank: int
    exception: str
    message: str
    traceback: str = ""
    recoverable: bool = False
    exitcode: int = 1
    #: Unix time of the failure (sub-second: the worker's own clock, not torch's whole seconds), to order failures
    #: of ranks and nodes that failed in the same second.
    timestamp: float = 0.0
    hostname: str = ""
    #: The module of the exception's class (``builtins``, ``team.errors``), where the worker recorded it.
    module: str = ""
    #: The qualified names of the exception's classes, its own first, then its bases up to ``Exception``: so that a
    #: retry rule naming a base class matches a subclass raised in a pod, where the class itself lives.
    bases: tuple[str, ...] = ()

    def summary(self) -> str:
        where = f"rank {self.rank}" if self.rank >= 0 else "the runner"
        host = f" on {self.hostname}" if self.hostname else ""
        return f"{where}{host} failed with {self.exception}: {self.message}"

    @property
    def is_consequence(self) -> bool:
        """Whether this looks like the consequence of a peer's failure rather than a cause (:func:`is_consequence`)."""
        return is_consequence(self.exception, self.message, recoverable=self.recoverable)

    @property
    def consequence_sign(self) -> str | None:
        return consequence_sign(self.exception, self.message, recoverable=self.recoverable)


# --- causes and consequences ---------------------------------------------------------------------------------------

#: Once one rank or node fails, its peers fail too, within milliseconds: their collectives lose a connection, their
#: agents lose the rendezvous store that a dead node hosted, their agents stop them. Those failures are victims, not
#: the cause, and are not blamed when a cause is known. What they look like, and why, as (what is matched, pattern,
#: why): ``type`` is the exception's type name (its last dotted part), ``message`` a lower-case text found anywhere
#: in the message, whatever the type (gloo raises a plain RuntimeError).
CONSEQUENCE_SIGNS: Final[tuple[tuple[str, str, str], ...]] = (
    ("type", "DistNetworkError", "a socket to torch's c10d store broke; the store lives in one node's agent"),
    ("type", "DistStoreError", "a c10d store call failed, or timed out on a key that a lost peer never set"),
    ("type", "RendezvousConnectionError", "the agent lost the rendezvous store, which another node hosted"),
    ("type", "RendezvousClosedError", "another node's agent closed the rendezvous, as it does when it fails"),
    # A worker that a signal ended, without an exception: the runner names it Signal<NAME>.
    ("type", "SignalSIGTERM", "the agent stops the remaining workers with SIGTERM once one of them failed"),
    ("type", "SignalSIGABRT", "NCCL's watchdog aborts a rank whose collective failed because a peer went away"),
    ("message", "connection closed", "gloo's 'Connection closed by peer' (NCCL: 'by remote peer'): the peer exited"),
    ("message", "failed to recv, got 0 bytes", "the c10d store's client: the store's host exited"),
    ("message", "connection reset by peer", "ECONNRESET: the other end died with its socket open (killed, OOM)"),
    ("message", "broken pipe", "EPIPE: writing to a peer, or to the store, after it exited"),
    ("message", "remote process exited", "NCCL's ncclRemoteError: 'remote process exited or there was a network ...'"),
)


def consequence_sign(exception: str, message: str, *, recoverable: bool = False) -> str | None:
    """Why a failure (its exception type name and message) looks like a victim of a peer's failure, or None.

    Pure (names and text only, no torch), so that the runner and the Airflow side judge alike. A failure declared
    recoverable (a ``RecoverableError`` of the code's own) is its own cause, whatever its message says; the type
    names are never the code's own (the runner marks a worker's SIGTERM recoverable too).
    """
    name, text = exception.rpartition(".")[2], message.lower()
    for kind, pattern, why in CONSEQUENCE_SIGNS:
        if kind == "type" and name == pattern:
            return why
        if kind == "message" and pattern in text and not recoverable:
            return why
    return None


def is_consequence(exception: str, message: str, *, recoverable: bool = False) -> bool:
    """Whether a failure looks like a victim of a peer's failure, not a cause (:func:`consequence_sign`)."""
    return consequence_sign(exception, message, recoverable=recoverable) is not None


def root_cause(failures: Sequence[WorkerFailure]) -> WorkerFailure:
    """The cause among failures seen together (one node's ranks): a known cause before a consequence, then the
    earliest; on a tie, the first given."""
    if not failures:
        raise ValueError("root_cause: no failures")
    return min(failures, key=lambda failure: (failure.is_consequence, failure.timestamp))


@dataclass(frozen=True, kw_only=True)
class NodeOutcome:
    succeeded: bool
    #: True on the one node whose workers included global rank 0.
    holds_rank0: bool = False
    #: Rank 0's return value, already decoded from JSON: strict JSON values only, NaN and infinities as the strings
    #: ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (:mod:`airflow_provider_torchelastic.core.encoding`).
    result: Any = None
    #: Where rank 0's value was written instead ([torch_elastic] result_storage), when it was too large to carry.
    result_ref: str | None = None
    failure: WorkerFailure | None = None


def encode_success(result_json: str | None, *, max_bytes: int | None = None) -> str:
    """The document for a node that finished; ``result_json`` is rank 0's value if this node held it."""
    if result_json is None:
        return json.dumps({"schema": SCHEMA, "succeeded": True, "holds_rank0": False})
    # Splice the already-encoded value instead of decoding and encoding it again.
    text = f'{{"schema": "{SCHEMA}", "succeeded": true, "holds_rank0": true, "result": {result_json}}}'
    size = len(text.encode())
    if max_bytes is not None and size > max_bytes:
        raise ResultTooLargeError(
            f"rank 0's return value is {size} bytes as JSON (with its envelope), more than the limit of {max_bytes} "
            "bytes for a Kubernetes termination message; set the Airflow option [torch_elastic] result_storage "
            "(env AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE, an fsspec URL such as s3://bucket/results) to pass larger "
            "values through object storage, or return a smaller value (metrics, a path)"
        )
    return text


def encode_success_ref(url: str) -> str:
    """The document for the node holding rank 0 whose value was written to ``url`` (result storage)."""
    return json.dumps({"schema": SCHEMA, "succeeded": True, "holds_rank0": True, "result_ref": url})


def encode_failure(failure: WorkerFailure, *, max_bytes: int | None = None) -> str:
    """The document for a failed node, trimmed to ``max_bytes`` by shortening the traceback, then the message."""
    fields = asdict(failure)
    text = json.dumps({"schema": SCHEMA, "succeeded": False, "failure": fields})
    if max_bytes is None:
        return text
    # Keep the end of a traceback (where the error is) and the start of a message.
    for key, keep_end in (("traceback", True), ("message", False)):
        excess = len(text.encode()) - max_bytes
        if excess <= 0:
            break
        value: str = fields[key]
        if value:
            fields[key] = _trim_to_encoded_size(value, _json_size(value) - excess, keep_end=keep_end)
            text = json.dumps({"schema": SCHEMA, "succeeded": False, "failure": fields})
    if len(text.encode()) > max_bytes and fields.get("bases"):
        # Only the class names are left to give up: the rules that name a base class then match the class alone.
        fields["bases"] = []
        text = json.dumps({"schema": SCHEMA, "succeeded": False, "failure": fields})
    return text


def _json_size(value: str) -> int:
    # json.dumps escapes to ASCII, so characters are bytes; a newline or quote takes 2, a non-ASCII character 6 or 12.
    return len(json.dumps(value)) - 2


def _trim_to_encoded_size(value: str, budget: int, *, keep_end: bool) -> str:
    """The longest end (or start) of ``value``, marked with ``...``, whose JSON encoding fits in ``budget`` bytes."""
    marker = "..."
    used, kept = len(marker), 0
    for char in reversed(value) if keep_end else value:
        size = _json_size(char)
        if used + size > budget:
            break
        used += size
        kept += 1
    if used > budget:  # not even the marker fits
        return ""
    return marker + value[len(value) - kept :] if keep_end else value[:kept] + marker


#: A runner before strict encoding wrote Python's bare ``NaN``/``Infinity``; read them as the strings the runner writes
#: now, so that what reaches XCom is strict JSON whichever image produced it.
_NON_FINITE: Final[dict[str, str]] = {"NaN": NAN, "Infinity": POSITIVE_INFINITY, "-Infinity": NEGATIVE_INFINITY}


def decode_result(text: str | bytes) -> Any:
    """Rank 0's value as written to result storage (JSON text), decoded as its outcome document's would be."""
    return json.loads(text, parse_constant=_NON_FINITE.__getitem__)


def decode_outcome(text: str | bytes | None) -> NodeOutcome | None:
    """Parse a node's document; ``None`` for anything else (an empty file, a log tail, another program's output).

    Total: a pod controls this text (with ``FallbackToLogsOnError`` it can be any log tail), so any text gives an
    outcome or None, never an exception, and a field of the wrong type is read as absent.
    """
    if not isinstance(text, str | bytes | bytearray) or not text:
        return None
    doc = loads_untrusted(text, max_bytes=MAX_DOCUMENT_BYTES, parse_constant=_NON_FINITE.__getitem__)
    # Without a boolean verdict, or a failure without its record, the document says nothing: the pod's exit code
    # decides (a forged envelope must not turn a pod killed from outside into a permanent failure).
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("succeeded"), bool):
        return None
    if doc["succeeded"]:
        ref = doc.get("result_ref")
        return NodeOutcome(
            succeeded=True,
            holds_rank0=doc.get("holds_rank0") is True,
            result=doc.get("result"),
            result_ref=ref if isinstance(ref, str) and ref else None,
        )
    raw = doc.get("failure")
    if not isinstance(raw, dict):
        return None
    return NodeOutcome(succeeded=False, failure=failure_from_json(raw))


#: A node's document is at most a termination message (4096 bytes); a local result file is written by the same
#: runner under the same limit. Anything much longer is not ours.
MAX_DOCUMENT_BYTES: Final = 4 * TERMINATION_MESSAGE_LIMIT


def failure_from_json(raw: Mapping[str, Any]) -> WorkerFailure:
    """A failure record as a pod's document (or a trigger event) carries it; a field of the wrong type, or a number
    no worker could have written (a 400-digit rank, an infinite time), is read as absent. Never raises."""

    def text(key: str, default: str = "") -> str:
        return text_or(raw.get(key), default)

    stamp = finite_float(raw.get("timestamp"))
    return WorkerFailure(
        rank=int_or(raw.get("rank"), -1),
        exception=text("exception", "UnknownError") or "UnknownError",
        message=text("message"),
        traceback=text("traceback"),
        recoverable=raw.get("recoverable") is True,
        exitcode=int_or(raw.get("exitcode"), 1),
        timestamp=0.0 if stamp is None else stamp,
        hostname=text("hostname"),
        module=text("module"),
        bases=_names(raw.get("bases")),
    )


#: At most this many class names are kept of an exception's bases (its own class first), each at most this long.
MAX_BASES: Final = 8
_MAX_NAME: Final = 200


def _names(value: Any) -> tuple[str, ...]:
    """A list of class names from a pod's document: strings only, bounded in count and length."""
    if not isinstance(value, list):
        return ()
    return tuple(item[:_MAX_NAME] for item in value if isinstance(item, str) and item)[:MAX_BASES]


# --- deciding a whole run from its nodes (shared by local execution and Kubernetes) --------------------------------


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What is known of one node once it ended: its name (a pod, ``node 1``), exit code and outcome document."""

    name: str
    exit_code: int | None
    outcome: NodeOutcome | None
    #: Why the node ended, where something outside the runner says so (``OOMKilled``, ``Evicted``).
    reason: str = ""
    #: Unix time it ended, where known (a container's ``finishedAt``: whole seconds); orders nodes without a report.
    finished_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class Verdict:
    succeeded: bool
    result: Any = None
    #: Where rank 0's value is, when it went through result storage: the Airflow side reads it from there.
    result_ref: str | None = None
    #: Whether a retry may help; meaningful only when not succeeded.
    recoverable: bool = False
    #: The node holding the root cause, and its failure, when one reported it.
    node: str | None = None
    failure: WorkerFailure | None = None
    detail: str = ""
    #: Why it failed, as one word Airflow can act on (:mod:`airflow_provider_torchelastic.core.causes`); ``""``
    #: when nothing says why: ``recoverable`` alone decides then.
    cause: str = causes.UNKNOWN
    #: The exit code and ending reason of the root cause's container (a pod) or runner (local), where known.
    exit_code: int | None = None
    reason: str = ""
    #: Times the wait saw the job preempted by its queue (suspended again after it ran) in this try.
    preemptions: int = 0


def verdict_from_json(data: Any) -> Verdict | None:
    """A verdict as ``asdict`` wrote it (a trigger event), None for None. ``ValueError``, and nothing else, for
    anything without a boolean ``succeeded``; any other field of the wrong type is read as absent, and a field this
    version does not know is ignored (an event written by a newer one)."""
    if data is None:
        return None
    if not isinstance(data, Mapping) or not isinstance(data.get("succeeded"), bool):
        raise ValueError(f"a verdict: expected an object with a boolean 'succeeded', got {short_repr(data)}")
    failure = data.get("failure")
    return Verdict(
        succeeded=data["succeeded"],
        result=data.get("result"),
        result_ref=text_or(data.get("result_ref"), None),
        recoverable=data.get("recoverable") is True,
        node=text_or(data.get("node"), None),
        failure=failure_from_json(failure) if isinstance(failure, Mapping) else None,
        detail=text_or(data.get("detail"), ""),
        cause=text_or(data.get("cause"), causes.UNKNOWN),
        exit_code=int_or(data.get("exit_code"), None),
        reason=text_or(data.get("reason"), ""),
        preemptions=int_or(data.get("preemptions"), 0, low=0),
    )


#: Exit codes >= 128 without a failure report mean the runner was killed by a signal: OOM killer (137), eviction or
#: preemption (143). Infrastructure, so a retry may help.
_SIGNAL_EXIT = 128
#: Reasons (from the pod or container status) that mean the node or the cluster ended the pod, not the code.
#: Container reasons of a command the runtime could not start (no such executable in the image, a working directory
#: it cannot enter): containerd's ``StartError`` and Docker's ``ContainerCannotRun``, both with exit code 128.
NEVER_STARTED_REASONS: Final = frozenset({"StartError", "ContainerCannotRun"})
INFRASTRUCTURE_REASONS: Final = frozenset({"Evicted", "OOMKilled", "Preempted", "NodeLost", "Shutdown", "Terminated"})


#: How much a failed node says about the cause, best first (see :func:`decide_run`).
_CAUSE, _KILLED, _CONSEQUENCE, _UNEXPLAINED = range(4)


def _standing(report: NodeReport) -> tuple[int, float] | None:
    """(rank of what the node says about the cause, when it failed) for a node that failed; None otherwise."""
    outcome = report.outcome
    if outcome is not None and outcome.failure is not None:
        failure = outcome.failure
        return (_CONSEQUENCE if failure.is_consequence else _CAUSE), failure.timestamp
    if report.exit_code in (0, None) and not (report.exit_code is None and report.reason):
        return None
    when = report.finished_at if report.finished_at is not None else math.inf
    return (_KILLED if _killed_for_a_known_reason(report) else _UNEXPLAINED), when


def _killed_for_a_known_reason(report: NodeReport) -> bool:
    return bool(report.reason) and (
        report.reason in INFRASTRUCTURE_REASONS or report.exit_code is None or report.exit_code >= _SIGNAL_EXIT
    )


#: What the runner itself raises when its settings or payload are unusable: the job's configuration, not the code.
_RUNNER_CONFIGURATION_ERRORS: Final = frozenset(
    {
        "RunnerUsageError",
        "TorchIncompatibleError",
        "PayloadError",
        "ResultTooLargeError",
        "ScriptNotFoundError",
        "ModuleNotInstalledError",
    }
)


def _cause_of_report(failure: WorkerFailure, reason: str) -> str:
    """The cause of a node that reported a failure: its container's reason first (a worker the kernel's OOM killer
    picked reports a SIGKILL; only the container says OOMKilled), then what the report says."""
    named = causes.cause_of_reason(reason)
    if named:
        return named
    if failure.exception == STALLED_EXCEPTION:
        return causes.STALLED
    if failure.exception == STOPPED_EXCEPTION:
        # The runner got SIGTERM: its pod deleted, preempted or drained (Kubernetes says which, where it does).
        return causes.PREEMPTED
    if failure.exception in _RUNNER_CONFIGURATION_ERRORS:
        return causes.CONFIGURATION
    if failure.exception in ("SignalSIGKILL", "SignalSIGTERM"):
        # A worker killed from outside the code, with nothing to say by whom: the OOM killer, a drain.
        return causes.INFRASTRUCTURE
    if failure.rank < 0:
        # The runner's own agent failed (it lost the rendezvous a failed node hosted): no training code raised this.
        return causes.INFRASTRUCTURE
    return causes.USER_CODE


def _ended(report: NodeReport) -> str:
    reason = f" ({report.reason})" if report.reason else ""
    code = f"exited with code {report.exit_code}" if report.exit_code is not None else "ended"
    return f"{report.name} {code}{reason} without a failure report"


def decide_run(reports: list[NodeReport]) -> Verdict:
    """The outcome of a run from its ended nodes: rank 0's result, or the root cause of the failure.

    Once one worker fails, its peers fail too (closed connections, a lost rendezvous store) or are stopped, often in
    the same second. The root cause is therefore the node that says most about a cause, and the earliest of those
    (the reports' sub-second times; whole seconds of ``finished_at`` for nodes without one):

    1. a failure report that is not a consequence of a peer's failure (the function's exception, a runner error);
    2. a node killed from outside for a known reason, without a report (``OOMKilled``, ``Evicted``, or an exit
       code >= 128 with a reason);
    3. a failure report that looks like a consequence (:data:`CONSEQUENCE_SIGNS`): kept, and said to be one;
    4. a node that exited non-zero without a report or a reason (a broken pipe before the runner could write).

    Whether a retry may help follows the chosen cause.
    """
    standings = [(standing, index, r) for index, r in enumerate(reports) if (standing := _standing(r)) is not None]
    if standings:
        (tier, _), _, node = min(standings, key=lambda item: (item[0], item[1]))
        failure = node.outcome.failure if node.outcome is not None else None
        if failure is None:
            return _verdict_of_silent_node(node)
        silent = [_ended(r) for (t, _), _, r in standings if t == _UNEXPLAINED]
        return _verdict_of_report(node, failure, consequence=tier == _CONSEQUENCE, silent=silent)
    holders = [(r.name, o) for r in reports if (o := r.outcome) is not None and o.holds_rank0]
    if holders:
        name, outcome = holders[0]
        return Verdict(succeeded=True, result=outcome.result, result_ref=outcome.result_ref, node=name)
    return Verdict(
        succeeded=False,
        detail="the run ended but no node reported rank 0's result (was the result file written?)",
    )


def _verdict_of_report(node: NodeReport, failure: WorkerFailure, *, consequence: bool, silent: list[str]) -> Verdict:
    """The verdict when the root cause is ``node``'s own failure report; ``silent``: the nodes that ended badly
    without one (named when the report looks like a consequence, since one of them may be the cause)."""
    kind = "recoverable" if failure.recoverable else "non-recoverable"
    detail = f"{node.name}: {failure.summary()} ({kind})"
    if node.reason in INFRASTRUCTURE_REASONS:
        # The runner saw a worker die of a signal; only the container's status says who sent it (on a real
        # node the kernel's OOM killer picks a worker, not the runner, and the container ends OOMKilled).
        detail += f"; its container ended {node.reason}" + (
            " (out of memory: raise its memory limit or use less)" if node.reason == "OOMKilled" else ""
        )
    if consequence:
        detail += (
            f"; this looks like a consequence of a peer's failure ({failure.consequence_sign}), not its "
            "cause, but no node reported a cause" + (f" ({'; '.join(silent)}: see their logs)" if silent else "")
        )
    return Verdict(
        succeeded=False,
        recoverable=failure.recoverable,
        node=node.name,
        failure=failure,
        detail=detail,
        cause=_cause_of_report(failure, node.reason),
        exit_code=node.exit_code,
        reason=node.reason,
    )


def _verdict_of_silent_node(node: NodeReport) -> Verdict:
    """The verdict when the root cause is a node that ended badly without a report: its exit code, or (evicted
    before exiting) only a reason."""
    if node.reason in NEVER_STARTED_REASONS:
        # Exit code 128 here is the runtime's, not a signal's: the image, not the platform, is at fault.
        return Verdict(
            succeeded=False,
            recoverable=False,
            node=node.name,
            cause=causes.CONFIGURATION,
            exit_code=node.exit_code,
            reason=node.reason,
            detail=f"{_ended(node)}; the container runtime could not start its command (the image lacks it, or "
            "cannot run it: see the pod's events), so a retry will not help",
        )
    killed = (node.exit_code or 0) >= _SIGNAL_EXIT or node.reason in INFRASTRUCTURE_REASONS
    return Verdict(
        succeeded=False,
        recoverable=killed,
        node=node.name,
        # Killed from outside with no reason given (a bare 137 or 143): the platform's doing, not the code's.
        cause=causes.cause_of_reason(node.reason) or (causes.INFRASTRUCTURE if killed else causes.UNKNOWN),
        exit_code=node.exit_code,
        reason=node.reason,
        detail=f"{_ended(node)}; "
        + (
            "it was killed from outside (out of memory, eviction, preemption), so a retry may help"
            if killed
            else "see its log"
        ),
    )

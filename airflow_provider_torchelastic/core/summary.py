"""The job summary saved in Airflow's database when a job ends: its pods, why it ended, and its metrics.

The operator pushes it as the XCom ``torch_elastic_job`` (success or failure, before raising), as JSON:
``{"version": 1, "kind", "namespace", "name", "phase", "created", "finished", "elapsed_seconds", "root_cause",
"pods": [{"name", "replica_type", "replica_index", "ranks", "phase", "node", "restarts", "reason", "message",
"exit_code", "log_tail"}], "metrics": {"loss": [[step, value], ...]}, "last_metrics": {"loss": value},
"artifacts": [{"path", "kind", "url", "bytes"}], "artifacts_omitted"}``. It is what shows a job in the UI once
``on_finish_action`` deleted it, and what shows a local execution at all. ``artifacts`` lists the tensors, state dicts
and Modules of rank 0's value (where they are in it, and their size): a try's outputs, kept in artifact storage.

Pure (standard library only): builders from the Kubernetes pod objects (the API's camelCase JSON) or from a local
run's node reports, and a bound on the size (:data:`MAX_SUMMARY_BYTES`: log tails go first, then metric points).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

from airflow_provider_torchelastic.core.artifact_ref import walk_refs
from airflow_provider_torchelastic.core.metrics_format import MetricSeries
from airflow_provider_torchelastic.core.naming import (
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    TRAINING_CONTAINER,
    replica_order,
)
from airflow_provider_torchelastic.core.outcome import NodeReport, decode_outcome
from airflow_provider_torchelastic.core.validation import (
    as_list,
    as_mapping,
    ascii_decimal,
    finite_float,
    int_or,
    short_repr,
    text_or,
)

__all__ = [
    "KIND_LOCAL",
    "MAX_ARTIFACTS",
    "MAX_SUMMARY_BYTES",
    "SUMMARY_VERSION",
    "XCOM_KEY",
    "ArtifactEntry",
    "JobSummary",
    "PodSummary",
    "bound_summary",
    "local_job_summary",
    "local_pod_summaries",
    "pod_summaries",
    "pod_summary",
    "training_container_status",
    "with_log_tails",
]

#: The XCom key of the summary.
XCOM_KEY: Final = "torch_elastic_job"
SUMMARY_VERSION: Final = 1
KIND_LOCAL: Final = "local"
#: The most a summary takes as JSON; Airflow keeps XComs in its database, and the UI reads many at once.
MAX_SUMMARY_BYTES: Final = 64 * 1024
#: Per pod, the end of its training container's log, at most this many lines and bytes; and only for a few pods.
LOG_TAIL_LINES: Final = 50
LOG_TAIL_BYTES: Final = 8 * 1024
MAX_LOG_TAILS: Final = 4
#: A pod's status message (e.g. a crash's log tail in the termination message) is cut to this.
MESSAGE_CHARS: Final = 1000
#: The artifacts listed, at most (a value holding more says how many it left out); each names its URL and size.
MAX_ARTIFACTS: Final = 50


@dataclass(frozen=True, kw_only=True)
class ArtifactEntry:
    """One artifact of rank 0's value: where it is in the value (``model``, ``layers[2]``; ``""`` for the value
    itself), what it holds (``module``, ``state_dict``, ``tensor``, ...), its URL and its size in bytes."""

    path: str
    kind: str
    url: str
    bytes: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArtifactEntry:
        """Never raises: a field of the wrong type is read as absent (so are the others of a non-mapping)."""
        data = as_mapping(data)
        return cls(
            path=text_or(data.get("path"), ""),
            kind=text_or(data.get("kind"), ""),
            url=text_or(data.get("url"), ""),
            bytes=int_or(data.get("bytes"), 0, low=0),
        )


@dataclass(frozen=True, kw_only=True)
class PodSummary:
    """One pod of the job (or one node of a local run) as it was when the job ended."""

    name: str
    #: ``master``/``worker`` (the training operator's label), ``pod`` for a single Pod, ``node`` locally.
    replica_type: str
    replica_index: int | None = None
    #: The global ranks it held, where they can be known (a static rank, or the node that held rank 0); else [].
    ranks: tuple[int, ...] = ()
    #: The pod's phase: ``Pending``, ``Running``, ``Succeeded``, ``Failed``, ``Unknown``.
    phase: str = "Unknown"
    node: str | None = None
    restarts: int = 0
    #: Why the training container waits or ended (``OOMKilled``, ``ImagePullBackOff``, ``Evicted``), and what it says.
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    log_tail: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranks"] = list(self.ranks)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PodSummary:
        """What :meth:`to_dict` gave. Never raises: a field of the wrong type is read as absent."""
        data = as_mapping(data)
        ranks = data.get("ranks")
        return cls(
            name=text_or(data.get("name"), ""),
            replica_type=text_or(data.get("replica_type"), ""),
            replica_index=int_or(data.get("replica_index"), None),
            ranks=tuple(rank for rank in ranks if int_or(rank, None) is not None) if isinstance(ranks, list) else (),
            phase=text_or(data.get("phase"), "Unknown"),
            node=text_or(data.get("node"), None),
            restarts=int_or(data.get("restarts"), 0, low=0),
            reason=text_or(data.get("reason"), ""),
            message=text_or(data.get("message"), ""),
            exit_code=int_or(data.get("exit_code"), None),
            log_tail=text_or(data.get("log_tail"), ""),
        )


@dataclass(frozen=True, kw_only=True)
class JobSummary:
    #: ``PyTorchJob``, ``Pod`` or ``local``.
    kind: str
    #: None for a local run.
    namespace: str | None
    name: str
    #: ``succeeded`` or ``failed``.
    phase: str
    #: Unix times.
    created: float
    finished: float
    root_cause: str | None = None
    pods: tuple[PodSummary, ...] = ()
    #: ``{metric: [[step, value], ...]}``, decimated; finite values only.
    metrics: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    #: ``{metric: value}``; None where the value was not finite (a diverged loss).
    last_metrics: Mapping[str, float | None] = field(default_factory=dict)
    #: The artifacts of rank 0's value, in its order (at most :data:`MAX_ARTIFACTS`; ``artifacts_omitted`` more).
    artifacts: tuple[ArtifactEntry, ...] = ()
    artifacts_omitted: int = 0
    version: int = SUMMARY_VERSION

    @property
    def elapsed_seconds(self) -> float:
        return max(0.0, self.finished - self.created)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "phase": self.phase,
            "created": self.created,
            "finished": self.finished,
            "elapsed_seconds": round(self.elapsed_seconds, 3),
            "root_cause": self.root_cause,
            "pods": [pod.to_dict() for pod in self.pods],
            "metrics": {name: [[_compact(s), v] for s, v in points] for name, points in self.metrics.items()},
            "last_metrics": dict(self.last_metrics),
            "artifacts": [asdict(entry) for entry in self.artifacts],
            "artifacts_omitted": self.artifacts_omitted,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> JobSummary:
        """From the JSON text or the already-decoded dict (an XCom value is either, depending on who reads it).

        ``ValueError``, and nothing else, for anything that is not a summary: any DAG can push this XCom. What is
        read is strict JSON again (finite numbers), as the UI's responses must be.
        """
        try:
            doc = json.loads(data) if isinstance(data, str | bytes | bytearray) else data
        except RecursionError:
            raise ValueError("a job summary: nested too deeply to be one") from None
        if not isinstance(doc, Mapping):
            raise ValueError(f"a job summary: expected a JSON object, got {type(doc).__name__}")
        version = doc.get("version")
        if not isinstance(version, int) or version != SUMMARY_VERSION:
            raise ValueError(f"a job summary: expected version {SUMMARY_VERSION}, got {short_repr(version)}")
        texts = {key: _required(doc, key, text_or(doc.get(key), None), "a str") for key in ("kind", "name", "phase")}
        created, finished = (
            _required(doc, key, finite_float(doc.get(key)), "a number") for key in ("created", "finished")
        )
        if finite_float(finished - created) is None:
            raise ValueError(f"a job summary: created and finished are {created!r} and {finished!r}")
        return cls(
            **texts,
            namespace=text_or(doc.get("namespace"), None),
            created=created,
            finished=finished,
            root_cause=text_or(doc.get("root_cause"), None),
            pods=tuple(PodSummary.from_dict(pod) for pod in _items(doc, "pods", list) if isinstance(pod, Mapping)),
            metrics={
                name: tuple(point for point in map(_finite_point, points) if point is not None)
                for name, points in _items(doc, "metrics", Mapping)
                if isinstance(name, str) and isinstance(points, list)
            },
            # None stands for a value that was not finite (a diverged loss).
            last_metrics={
                name: finite_float(value)
                for name, value in _items(doc, "last_metrics", Mapping)
                if isinstance(name, str)
            },
            # Absent from summaries saved before artifacts were listed.
            artifacts=tuple(
                ArtifactEntry.from_dict(item) for item in _items(doc, "artifacts", list) if isinstance(item, Mapping)
            ),
            artifacts_omitted=int_or(doc.get("artifacts_omitted"), 0, low=0),
        )

    def with_artifacts(self, value: Any) -> JobSummary:
        """This summary listing the artifact references in rank 0's ``value`` (a JSON value, already checked to be
        this try's own), at most :data:`MAX_ARTIFACTS` of them."""
        found = [
            ArtifactEntry(path=path, kind=ref.kind, url=ref.url, bytes=ref.bytes) for path, ref in walk_refs(value)
        ]
        return replace(
            self, artifacts=tuple(found[:MAX_ARTIFACTS]), artifacts_omitted=max(0, len(found) - MAX_ARTIFACTS)
        )

    @classmethod
    def build(
        cls,
        *,
        kind: str,
        namespace: str | None,
        name: str,
        succeeded: bool,
        created: float,
        finished: float,
        root_cause: str | None,
        pods: Sequence[PodSummary],
        series: MetricSeries | None = None,
        max_bytes: int = MAX_SUMMARY_BYTES,
    ) -> JobSummary:
        """A bounded summary; ``series`` gives the metrics (non-finite points are left out of the charts)."""
        metrics: dict[str, tuple[tuple[float, float], ...]] = {}
        last: dict[str, float | None] = {}
        if series is not None:
            for metric in series.names:
                metrics[metric] = tuple((s, v) for s, v in series.points(metric) if math.isfinite(v))
            last = {metric: value if math.isfinite(value) else None for metric, value in series.last().items()}
        summary = cls(
            kind=kind,
            namespace=namespace,
            name=name,
            phase="succeeded" if succeeded else "failed",
            created=created,
            finished=max(finished, created),
            root_cause=None if succeeded else root_cause,
            pods=tuple(pods),
            metrics=metrics,
            last_metrics=last,
        )
        return bound_summary(summary, max_bytes)


def _required(doc: Mapping[str, Any], key: str, value: Any, expected: str) -> Any:
    if value is None:
        raise ValueError(f"a job summary: {key}: expected {expected}, got {short_repr(doc.get(key))}")
    return value


def _items(doc: Mapping[str, Any], key: str, kind: type) -> Any:
    """The items of a list, or the ``(key, value)`` pairs of a mapping, at ``doc[key]`` (absent or null: none);
    ``ValueError`` for anything else there."""
    value = doc.get(key)
    if value is None:
        return ()
    if not isinstance(value, kind):
        raise ValueError(f"a job summary: {key}: expected a {kind.__name__}, got {short_repr(value)}")
    return value.items() if isinstance(value, Mapping) else value


def _finite_point(point: Any) -> tuple[float, float] | None:
    if not isinstance(point, list | tuple) or len(point) != 2:
        return None
    step, value = finite_float(point[0]), finite_float(point[1])
    return None if step is None or value is None else (step, value)


def _compact(step: float) -> float | int:
    return int(step) if step.is_integer() else step


def _size(summary: JobSummary) -> int:
    return len(summary.to_json().encode())


def bound_summary(summary: JobSummary, max_bytes: int = MAX_SUMMARY_BYTES) -> JobSummary:
    """``summary`` within ``max_bytes`` of JSON: log tails are dropped first (longest first), then every metric keeps
    every other point until it fits, then the pods' messages are cut, then pods beyond the first few go."""
    if _size(summary) <= max_bytes:
        return summary
    pods = list(summary.pods)
    for index in sorted(range(len(pods)), key=lambda i: -len(pods[i].log_tail)):
        pods[index] = replace(pods[index], log_tail="")
        summary = replace(summary, pods=tuple(pods))
        if _size(summary) <= max_bytes:
            return summary
    while any(len(points) > 2 for points in summary.metrics.values()):
        summary = replace(summary, metrics={name: _halve(points) for name, points in summary.metrics.items()})
        if _size(summary) <= max_bytes:
            return summary
    pods = [replace(pod, message=pod.message[:200]) for pod in summary.pods]
    summary = replace(summary, pods=tuple(pods))
    while _size(summary) > max_bytes and len(summary.pods) > 1:
        summary = replace(summary, pods=summary.pods[: len(summary.pods) // 2])
    if _size(summary) > max_bytes:
        summary = replace(summary, metrics={}, root_cause=(summary.root_cause or "")[:MESSAGE_CHARS] or None)
    return summary


def _halve(points: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    if len(points) <= 2:
        return points
    kept = points[::2]
    return kept if kept[-1] == points[-1] else (*kept, points[-1])  # the chart still ends at the last step


def _tail(text: str) -> str:
    """The last :data:`LOG_TAIL_LINES` lines, at most :data:`LOG_TAIL_BYTES` bytes."""
    lines = text.splitlines()[-LOG_TAIL_LINES:]
    tail = "\n".join(lines)
    encoded = tail.encode()
    if len(encoded) > LOG_TAIL_BYTES:
        tail = encoded[-LOG_TAIL_BYTES:].decode(errors="ignore")
        tail = tail.partition("\n")[2] or tail  # start at a whole line
    return tail


def with_log_tails(pods: Sequence[PodSummary], tails: Mapping[str, str]) -> tuple[PodSummary, ...]:
    """The pods with the tails of their logs (by pod name), for at most :data:`MAX_LOG_TAILS` pods: failed pods first
    (that is where the root cause is), then those that held ranks, then by name."""

    def priority(pod: PodSummary) -> tuple[int, int, str]:
        return (0 if pod.phase == "Failed" or pod.exit_code not in (None, 0) else 1, 0 if pod.ranks else 1, pod.name)

    chosen = {pod.name for pod in sorted((p for p in pods if tails.get(p.name)), key=priority)[:MAX_LOG_TAILS]}
    return tuple(replace(pod, log_tail=_tail(tails[pod.name])) if pod.name in chosen else pod for pod in pods)


# --- from Kubernetes pod objects ------------------------------------------------------------------------------------


# Pod objects are read part by part with as_mapping() and as_list(): the API server gives them that shape, but the
# user writes the pod's template, and any pod must give a summary (never from a wrong guess: "²".isdigit() is True).
def _training_entry(entries: Any) -> Mapping[str, Any]:
    """The training container's entry in a pod's list of containers or of their statuses (else the first)."""
    found = [as_mapping(entry) for entry in as_list(entries)]
    return next((entry for entry in found if entry.get("name") == TRAINING_CONTAINER), found[0] if found else {})


def training_container_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The status of the pod's training container (the first container's when none has its name)."""
    return _training_entry(as_mapping(as_mapping(pod).get("status")).get("containerStatuses"))


def _training_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return _training_entry(as_mapping(pod.get("spec")).get("containers"))


def _env(container: Mapping[str, Any], name: str) -> str | None:
    for item in map(as_mapping, as_list(container.get("env"))):
        if item.get("name") == name and isinstance(item.get("value"), str):
            return str(item["value"])
    return None


#: More workers than this on one node is no count a pod's settings can mean (its ranks would be listed one by one).
_MAX_NPROC: Final = 4096


def _nproc(container: Mapping[str, Any]) -> int | None:
    """Workers per node as the runner counts them: its ``--nproc-per-node`` wins over ``PET_NPROC_PER_NODE`` (a
    Trainer's is its CPU count); ``auto``, ``cpu``, ``gpu`` are resolved on the node, so unknown here."""
    command = [
        part for part in as_list(container.get("command")) + as_list(container.get("args")) if isinstance(part, str)
    ]
    if "--nproc-per-node" not in command:
        return ascii_decimal(_env(container, "PET_NPROC_PER_NODE"), high=_MAX_NPROC) or None
    position = command.index("--nproc-per-node") + 1
    return ascii_decimal(command[position] if position < len(command) else None, high=_MAX_NPROC) or None


def _ranks(pod: Mapping[str, Any], replica_type: str, outcome_rank: int | None, holds_rank0: bool) -> tuple[int, ...]:
    """The global ranks a pod held: ``node rank * nproc + local rank`` where the node rank is known (a single Pod is
    node 0; a Master/Worker job's pods get ``PET_NODE_RANK``; an elastic node that held rank 0, or reported a
    failing rank, is the node of that rank's group). Empty where it cannot be known (elastic peers)."""
    container = _training_container(pod)
    nproc = _nproc(container)
    if nproc is None:
        return (0,) if holds_rank0 else ()
    node_rank: int | None = None
    static = ascii_decimal(_env(container, "PET_NODE_RANK"))
    if replica_type == "pod" or holds_rank0:
        node_rank = 0
    elif static is not None:
        node_rank = static
    elif outcome_rank is not None and outcome_rank >= 0:
        node_rank = outcome_rank // nproc
    if node_rank is None:
        return ()
    return tuple(range(node_rank * nproc, (node_rank + 1) * nproc))


def pod_summary(pod: Mapping[str, Any]) -> PodSummary:
    """What one pod says: its replica, phase, node, restarts, and the training container's state. Never raises: a
    part of the wrong type is read as absent."""
    pod = as_mapping(pod)
    metadata, status = as_mapping(pod.get("metadata")), as_mapping(pod.get("status"))
    labels = as_mapping(metadata.get("labels"))
    replica_type = (text_or(labels.get(REPLICA_TYPE_LABEL), "") or "pod").lower()
    replica_index = 0 if replica_type == "pod" else ascii_decimal(labels.get(REPLICA_INDEX_LABEL))
    container = training_container_status(pod)
    state = as_mapping(container.get("state"))
    terminated = as_mapping(state.get("terminated") or as_mapping(container.get("lastState")).get("terminated"))
    waiting = as_mapping(state.get("waiting"))

    def first_text(key: str) -> str:
        return next((text for part in (terminated, waiting, status) if (text := text_or(part.get(key), ""))), "")

    reason = first_text("reason")
    raw_message = first_text("message")
    outcome = decode_outcome(terminated.get("message"))
    failing_rank: int | None = None
    if outcome is not None:
        # Our own outcome document: say what failed; a success says nothing (rank 0's value is the task's XCom).
        raw_message = outcome.failure.summary() if outcome.failure is not None else ""
        failing_rank = outcome.failure.rank if outcome.failure is not None else None
    return PodSummary(
        name=text_or(metadata.get("name"), "?"),
        replica_type=replica_type,
        replica_index=replica_index,
        ranks=_ranks(pod, replica_type, failing_rank, outcome is not None and outcome.holds_rank0),
        phase=text_or(status.get("phase"), "") or "Unknown",
        node=text_or(as_mapping(pod.get("spec")).get("nodeName"), None),
        restarts=int_or(container.get("restartCount"), 0, low=0),
        reason=reason,
        message=raw_message[:MESSAGE_CHARS],
        exit_code=int_or(terminated.get("exitCode"), None),
    )


def pod_summaries(pods: Sequence[Mapping[str, Any]]) -> tuple[PodSummary, ...]:
    """The pods of a job, Master first, then Workers by index (a list that is none: no pods)."""

    def order(pod: PodSummary) -> tuple[int, int, str]:
        return (*replica_order(pod.replica_type, pod.replica_index), pod.name)

    return tuple(sorted((pod_summary(pod) for pod in (pods if isinstance(pods, list | tuple) else ())), key=order))


# --- from a local run -------------------------------------------------------------------------------------------------


def local_pod_summaries(
    reports: Sequence[NodeReport], *, nproc_per_node: int | None, hostname: str | None
) -> tuple[PodSummary, ...]:
    """One entry per local node (``node-0``, ``node-1``, ...): its exit code and what its outcome says."""
    summaries = []
    for index, report in enumerate(reports):
        outcome = report.outcome
        failure = outcome.failure if outcome is not None else None
        failed = report.exit_code not in (0, None) or (outcome is not None and not outcome.succeeded)
        ranks: tuple[int, ...] = ()
        if nproc_per_node:
            # Local nodes join one rendezvous; node ranks follow the start order only for a static job, so the
            # node's ranks are known where its outcome names one: the holder of rank 0, or the failing rank.
            node_rank = 0 if len(reports) == 1 or (outcome is not None and outcome.holds_rank0) else None
            if node_rank is None and failure is not None and failure.rank >= 0:
                node_rank = failure.rank // nproc_per_node
            if node_rank is not None:
                ranks = tuple(range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node))
        summaries.append(
            PodSummary(
                name=f"node-{index}",
                replica_type="node",
                replica_index=index,
                ranks=ranks,
                phase="Failed" if failed else ("Succeeded" if report.exit_code == 0 else "Unknown"),
                node=hostname,
                reason=report.reason,
                message=(failure.summary() if failure is not None else "")[:MESSAGE_CHARS],
                exit_code=report.exit_code,
            )
        )
    return tuple(summaries)


def local_job_summary(
    *,
    name: str,
    reports: Sequence[NodeReport],
    succeeded: bool,
    root_cause: str | None,
    created: float,
    finished: float,
    nproc_per_node: int | None,
    hostname: str | None,
    tails: Mapping[str, str],
    series: MetricSeries | None,
) -> JobSummary:
    """The summary of a local run. ``tails`` are the log tails by source as the task log got them: local execution
    prefixes a node's lines with ``[node<i>] `` when it runs several nodes, and with nothing when it runs one."""
    pods = local_pod_summaries(reports, nproc_per_node=nproc_per_node, hostname=hostname)
    by_pod = {
        pod.name: tails.get("" if len(pods) == 1 else f"node{pod.replica_index}", "")
        for pod in pods
        if pod.replica_index is not None
    }
    return JobSummary.build(
        kind=KIND_LOCAL,
        namespace=None,
        name=name,
        succeeded=succeeded,
        created=created,
        finished=finished,
        root_cause=root_cause,
        pods=with_log_tails(pods, by_pod),
        series=series,
    )

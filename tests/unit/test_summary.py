"""The job summary: built from pod JSON as the API returns it (and from a local run), round trips, and bounds."""

from __future__ import annotations

import json
from typing import Any

from airflow_provider_torchelastic.core.metrics_format import MetricSeries
from airflow_provider_torchelastic.core.outcome import (
    NodeOutcome,
    NodeReport,
    WorkerFailure,
    encode_failure,
    encode_success,
)
from airflow_provider_torchelastic.core.summary import (
    LOG_TAIL_BYTES,
    LOG_TAIL_LINES,
    MAX_ARTIFACTS,
    MAX_LOG_TAILS,
    MAX_SUMMARY_BYTES,
    ArtifactEntry,
    JobSummary,
    PodSummary,
    local_job_summary,
    pod_summaries,
    with_log_tails,
)
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

STAMP0 = "2027-01-15T08:00:00Z"
T0 = 1_800_000_000.0
RUNNER = ["python", "-m", "airflow_provider_torchelastic.runner", "--nproc-per-node", "2"]


def pod(
    name: str,
    phase: str,
    *,
    replica: tuple[str, int] | None = None,
    env: dict[str, str] | None = None,
    terminated: dict[str, Any] | None = None,
    waiting: dict[str, Any] | None = None,
    restarts: int = 0,
    status_reason: str | None = None,
) -> dict[str, Any]:
    """A pod as the API server returns it, with the training operator's labels and env where given."""
    labels = {"app.kubernetes.io/managed-by": "airflow-provider-torchelastic"}
    if replica is not None:
        labels |= {
            "training.kubeflow.org/replica-type": replica[0],
            "training.kubeflow.org/replica-index": str(replica[1]),
        }
    state: dict[str, Any] = {"running": {}}
    if terminated is not None:
        state = {"terminated": terminated}
    elif waiting is not None:
        state = {"waiting": waiting}
    status: dict[str, Any] = {
        "phase": phase,
        "containerStatuses": [{"name": "pytorch", "state": state, "restartCount": restarts}],
    }
    if status_reason:
        status["reason"] = status_reason
    container = {"name": "pytorch", "command": RUNNER, "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    return {
        "metadata": {"name": name, "creationTimestamp": STAMP0, "labels": labels},
        "spec": {"nodeName": f"node-{name[-1]}", "containers": [container]},
        "status": status,
    }


def failed(rank: int) -> str:
    return encode_failure(WorkerFailure(rank=rank, exception="ValueError", message="bad shard", timestamp=T0))


def test_pods_of_a_master_worker_job_with_static_ranks() -> None:
    pods = [
        pod(
            "job-worker-0",
            "Failed",
            replica=("worker", 0),
            env={"PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2"},
            terminated={"exitCode": 1, "reason": "Error", "message": failed(3)},
            restarts=2,
        ),
        pod(
            "job-master-0",
            "Running",
            replica=("master", 0),
            env={"PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "2"},
        ),
    ]
    master, worker = pod_summaries(pods)
    assert master == PodSummary(
        name="job-master-0", replica_type="master", replica_index=0, ranks=(0, 1), phase="Running", node="node-0"
    )
    assert worker.replica_type == "worker" and worker.replica_index == 0 and worker.ranks == (2, 3)
    assert (worker.phase, worker.exit_code, worker.restarts, worker.reason) == ("Failed", 1, 2, "Error")
    assert worker.message == "rank 3 failed with ValueError: bad shard"


def test_ranks_follow_the_runners_own_nproc_not_the_trainers_env() -> None:
    """A Trainer v2.3.0 sets ``PET_NPROC_PER_NODE`` from the CPU request (or "1"), while the runner runs its own
    ``--nproc-per-node``: the ranks are the runner's; a symbolic count is resolved on the node, so unknown here."""
    worker = pod(
        "job-node-0-1-abcde", "Running", replica=("worker", 1), env={"PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4"}
    )
    assert pod_summaries([worker])[0].ranks == (2, 3)  # RUNNER says --nproc-per-node 2
    worker["spec"]["containers"][0]["command"] = [*RUNNER[:-1], "auto"]
    assert pod_summaries([worker])[0].ranks == ()
    worker["spec"]["containers"][0]["command"] = RUNNER[:3]  # not our runner's flag: the env is all there is
    assert pod_summaries([worker])[0].ranks == (4, 5, 6, 7)


def test_elastic_pods_know_ranks_only_where_an_outcome_names_them() -> None:
    pods = [
        pod(
            "job-worker-1",
            "Succeeded",
            replica=("worker", 1),
            terminated={"exitCode": 0, "message": encode_success("7")},
        ),
        pod(
            "job-worker-0",
            "Succeeded",
            replica=("worker", 0),
            terminated={"exitCode": 0, "message": encode_success(None)},
        ),
        pod(
            "job-worker-2",
            "Pending",
            replica=("worker", 2),
            waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image"},
        ),
        pod("job-worker-3", "Failed", replica=("worker", 3), status_reason="Evicted"),
    ]
    summaries = pod_summaries(pods)
    assert [p.name for p in summaries] == ["job-worker-0", "job-worker-1", "job-worker-2", "job-worker-3"]
    by_name = {p.name: p for p in summaries}
    # The pod that held rank 0 held the first group of ranks; its peers' ranks are unknown.
    assert by_name["job-worker-1"].ranks == (0, 1) and by_name["job-worker-0"].ranks == ()
    assert by_name["job-worker-1"].message == "", "rank 0's value is the task's XCom, not repeated here"
    assert (by_name["job-worker-2"].reason, by_name["job-worker-2"].message) == (
        "ImagePullBackOff",
        "Back-off pulling image",
    )
    assert by_name["job-worker-3"].reason == "Evicted" and by_name["job-worker-3"].exit_code is None


def test_a_single_pod_holds_every_rank() -> None:
    (single,) = pod_summaries([pod("job", "Succeeded", terminated={"exitCode": 0, "message": encode_success("1")})])
    assert (single.replica_type, single.replica_index, single.ranks) == ("pod", 0, (0, 1))


def test_a_terminal_decision_carries_the_pods_and_they_travel_in_the_trigger_event() -> None:
    ref = JobRef(kind="Pod", name="job", namespace="ml")
    done = pod("job", "Failed", terminated={"exitCode": 1, "reason": "Error", "message": failed(1)})
    decision = kinds.get("Pod").decide(ref, Snapshot(job=done, now=T0 + 30), WaitPolicy())
    assert decision.phase is Phase.FAILED and decision.created == T0
    assert [p.name for p in decision.pods] == ["job"]
    with_metrics = WaitDecision.from_event(json.loads(json.dumps(decision.to_event())))
    assert with_metrics == decision
    running = kinds.get("Pod").decide(ref, Snapshot(job=pod("job", "Running"), now=T0 + 30), WaitPolicy())
    assert running.pods == () and running.created is None, "pods are summarized once, when the wait ends"


def summary_with(pods: tuple[PodSummary, ...], series: MetricSeries | None = None) -> JobSummary:
    return JobSummary.build(
        kind="PyTorchJob",
        namespace="ml",
        name="job",
        succeeded=False,
        created=T0,
        finished=T0 + 90.5,
        root_cause="job-worker-0: rank 3 failed with ValueError: bad shard (non-recoverable)",
        pods=pods,
        series=series,
    )


def test_summary_round_trips_through_json_with_the_documented_fields() -> None:
    series = MetricSeries()
    for step in range(10):
        series.add("loss", step, 1.0 / (step + 1))
    series.add("grad_norm", 9, float("nan"))
    pods = pod_summaries([pod("job-worker-0", "Failed", replica=("worker", 0), terminated={"exitCode": 1})])
    summary = summary_with(with_log_tails(pods, {"job-worker-0": "a\nb"}), series)
    doc = json.loads(summary.to_json())
    assert set(doc) == {
        "version",
        "kind",
        "namespace",
        "name",
        "phase",
        "created",
        "finished",
        "elapsed_seconds",
        "root_cause",
        "pods",
        "metrics",
        "last_metrics",
        "artifacts",
        "artifacts_omitted",
    }
    assert set(doc["pods"][0]) == {
        "name",
        "replica_type",
        "replica_index",
        "ranks",
        "phase",
        "node",
        "restarts",
        "reason",
        "message",
        "exit_code",
        "log_tail",
    }
    assert doc["version"] == 1 and doc["phase"] == "failed" and doc["elapsed_seconds"] == 90.5
    assert doc["metrics"]["loss"][0] == [0, 1.0] and doc["metrics"]["grad_norm"] == []
    assert doc["last_metrics"] == {"loss": 0.1, "grad_norm": None}, "a NaN is null: the JSON stays strict"
    assert doc["pods"][0]["log_tail"] == "a\nb"
    assert JobSummary.from_json(summary.to_json()) == summary
    assert JobSummary.from_json(doc) == summary, "an XCom value read back as a dict"


def test_log_tails_are_bounded_and_failed_pods_come_first() -> None:
    names = [f"job-worker-{i}" for i in range(8)]
    pods = tuple(PodSummary(name=name, replica_type="worker", phase="Succeeded") for name in names)
    pods = (*pods[:6], PodSummary(name=names[6], replica_type="worker", phase="Failed", exit_code=1), pods[7])
    long_log = "\n".join(f"line {i} " + "x" * 400 for i in range(500))
    tailed = with_log_tails(pods, dict.fromkeys(names, long_log))
    with_tails = [p for p in tailed if p.log_tail]
    assert len(with_tails) == MAX_LOG_TAILS
    assert names[6] in {p.name for p in with_tails}, "the failed pod's tail is kept first"
    for p in with_tails:
        assert len(p.log_tail.encode()) <= LOG_TAIL_BYTES and len(p.log_tail.splitlines()) <= LOG_TAIL_LINES
        assert p.log_tail.endswith("line 499 " + "x" * 400), "the end of the log is kept"


def test_summary_stays_under_its_byte_bound_dropping_tails_before_points() -> None:
    series = MetricSeries(max_points=500)
    for step in range(100_000):
        for metric in range(12):
            series.add(f"metric_{metric}", step, step * 0.001 + metric)
    pods = tuple(PodSummary(name=f"job-worker-{i}", replica_type="worker", message="m" * 900) for i in range(16))
    tails = {p.name: "\n".join("y" * 150 for _ in range(50)) for p in pods}
    summary = summary_with(with_log_tails(pods, tails), series)
    size = len(summary.to_json().encode())
    assert size <= MAX_SUMMARY_BYTES, size
    assert all(not p.log_tail for p in summary.pods), "log tails go first"
    assert len(summary.pods) == 16
    for points in summary.metrics.values():
        assert points[0][0] == 0 and points[-1][0] == 99_999, "charts still span the whole run"
    # A small job keeps everything.
    small = summary_with(with_log_tails(pods[:2], tails))
    assert all(p.log_tail for p in small.pods)


def test_local_summary_names_nodes_and_takes_tails_by_the_local_prefixes() -> None:
    reports = [
        NodeReport(name="node 0", exit_code=0, outcome=NodeOutcome(succeeded=True, holds_rank0=False)),
        NodeReport(
            name="node 1",
            exit_code=1,
            outcome=NodeOutcome(
                succeeded=False, failure=WorkerFailure(rank=2, exception="ValueError", message="bad", timestamp=T0)
            ),
        ),
    ]
    summary = local_job_summary(
        name="job",
        reports=reports,
        succeeded=False,
        root_cause="node 1: rank 2 failed",
        created=T0,
        finished=T0 + 3,
        nproc_per_node=2,
        hostname="host",
        tails={"node0": "zero", "node1": "one"},
        series=None,
    )
    assert summary.kind == "local" and summary.namespace is None and summary.phase == "failed"
    assert [(p.name, p.phase, p.ranks, p.log_tail, p.exit_code) for p in summary.pods] == [
        ("node-0", "Succeeded", (), "zero", 0),
        ("node-1", "Failed", (2, 3), "one", 1),
    ]


def test_the_metrics_tap_state_travels_with_the_decision_in_the_trigger_event() -> None:
    from dataclasses import replace

    from airflow_provider_torchelastic.core.metrics_format import MARKER
    from airflow_provider_torchelastic.core.tap import MetricsTap

    logged: list[str] = []
    tap = MetricsTap(logged.append)  # what the trigger wraps its log callable with
    tap(f'[job] [rank0]:{MARKER} {{"step":3,"last":{{"loss":0.5}},"points":{{"loss":[[0,2.0],[3,0.5]]}}}}')
    ref = JobRef(kind="Pod", name="job", namespace="ml")
    done = pod("job", "Succeeded", terminated={"exitCode": 0, "message": encode_success("1")})
    decision = kinds.get("Pod").decide(ref, Snapshot(job=done, now=T0 + 30), WaitPolicy())
    event = json.loads(json.dumps(replace(decision, metrics=tap.to_json()).to_event()))
    resumed = WaitDecision.from_event(event)  # execute_complete, on a fresh operator
    again = MetricsTap.from_json(resumed.metrics, logged.append)
    assert again.summary_line() == "last metrics: step 3 loss=0.5"
    assert again.series.points("loss") == [(0.0, 2.0), (3.0, 0.5)]
    assert resumed.pods == decision.pods and resumed.created == T0


def artifact_ref(url: str, kind: str = "tensor", size: int = 1024) -> dict[str, Any]:
    return {"__torchelastic_artifact__": 1, "kind": kind, "url": url, "format": "safetensors", "bytes": size,
            "sha256": "0" * 64}  # fmt: skip


def test_the_summary_lists_rank_0s_artifacts_with_where_they_are_and_their_size() -> None:
    value = {
        "loss": 0.1,
        "model": artifact_ref("s3://b/run/model.safetensors", "module", 4096),
        "layers": [1, artifact_ref("s3://b/run/l1.safetensors")],
        "stats": {"mean": artifact_ref("s3://b/run/mean.safetensors", "ndarray", 16)},
    }
    summary = summary_with(()).with_artifacts(value)
    assert summary.artifacts == (
        ArtifactEntry(path="model", kind="module", url="s3://b/run/model.safetensors", bytes=4096),
        ArtifactEntry(path="layers[1]", kind="tensor", url="s3://b/run/l1.safetensors", bytes=1024),
        ArtifactEntry(path="stats.mean", kind="ndarray", url="s3://b/run/mean.safetensors", bytes=16),
    )
    doc = json.loads(summary.to_json())
    assert doc["artifacts"][0] == {"path": "model", "kind": "module", "url": "s3://b/run/model.safetensors",
                                   "bytes": 4096}  # fmt: skip
    assert JobSummary.from_json(summary.to_json()) == summary
    # A summary saved before artifacts were listed still reads.
    old = {k: v for k, v in doc.items() if not k.startswith("artifacts")}
    assert JobSummary.from_json(old).artifacts == ()
    # The value itself a tensor: its path is empty.
    assert summary_with(()).with_artifacts(artifact_ref("f")).artifacts[0].path == ""


def test_a_value_of_many_artifacts_lists_the_first_and_counts_the_rest() -> None:
    value = [artifact_ref(f"s3://b/run/{i}.safetensors") for i in range(MAX_ARTIFACTS + 7)]
    summary = summary_with(()).with_artifacts(value)
    assert len(summary.artifacts) == MAX_ARTIFACTS and summary.artifacts_omitted == 7
    assert summary.artifacts[-1].path == f"[{MAX_ARTIFACTS - 1}]"
    assert len(summary.to_json()) < MAX_SUMMARY_BYTES


def test_the_tap_keeps_at_least_what_a_summary_shows() -> None:
    # Two modules of one layer, which may not import each other: the tap keeps the tails a summary then cuts to its
    # own bounds, so keeping fewer lines or sources would silently shorten every finished job's log tails.
    from airflow_provider_torchelastic.core import summary, tap

    assert tap.TAIL_LINES >= summary.LOG_TAIL_LINES
    assert tap.TAIL_SOURCES >= summary.MAX_LOG_TAILS

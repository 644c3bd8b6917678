"""The pure parts of the shared watch and of bounded log reading: the stream key, the cache's view of a namespace,
and how many log reads a job costs however many pods it has."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import encode_success
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection
from airflow_provider_torchelastic.kubernetes.requests import EmitLog, FetchJob, ReadEvents, ReadLog, Sleep
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot, WaitPolicy
from airflow_provider_torchelastic.kubernetes.watch import JobCache, stream_key

T0 = 1_800_000_000.0


def key(namespace: str = "ml", **overrides: Any) -> tuple[str, str, str]:
    settings: dict[str, Any] = {"conn_id": "kubernetes_default", "extras": {"token": "s3cr3t-token", "namespace": "ml"}}
    return stream_key(namespace, ClusterConnection(**{**settings, **overrides}))


def test_the_stream_key_is_a_deterministic_fingerprint_without_secrets() -> None:
    assert key() == key()
    assert "s3cr3t" not in repr(key())
    assert key(extras={"token": "other", "namespace": "ml"}) != key()
    assert key(namespace="other")[1] == "other" and key(namespace="other")[2] == key()[2]


def pod(name: str, job: str | None = None, phase: str = "Running", rv: int = 1) -> dict[str, Any]:
    labels = {"training.kubeflow.org/job-name": job} if job else {}
    # Controlled by the job it names (the training operator's controller ownerReference, by the job's uid).
    owners = [{"kind": "PyTorchJob", "name": job, "uid": f"uid-{job}", "controller": True}] if job else []
    meta = {"name": name, "labels": labels, "resourceVersion": str(rv), "ownerReferences": owners}
    return {"metadata": meta, "status": {"phase": phase}}


def job(name: str, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": str(rv)}, "status": {}}


def cache() -> JobCache:
    c = JobCache("ml", kube=None)
    c.kinds = ("Pod", "PyTorchJob")
    return c


def test_the_cache_files_pods_under_their_job_and_answers_only_once_listed() -> None:
    c = cache()
    ref = JobRef(kind="PyTorchJob", name="a", namespace="ml")
    c.replace("PyTorchJob", [job("a"), job("b")])
    assert not c.knows(ref)  # the pods are not listed yet: a snapshot would miss them
    c.replace("Pod", [pod("a-master-0", "a"), pod("b-master-0", "b"), pod("bare")])
    assert c.knows(ref)
    assert [p["metadata"]["name"] for p in c.snapshot(ref).pods] == ["a-master-0"]
    assert c.take_changes() is None  # a relist may have changed anything

    c.apply("Pod", "MODIFIED", pod("a-master-0", "a", "Succeeded", rv=5))
    c.apply("Pod", "MODIFIED", pod("bare", phase="Failed", rv=6))
    assert c.take_changes() == {"a", "bare"}
    # An older copy (a GET that raced the watch) does not replace a newer one.
    c.apply("Pod", "ADDED", pod("a-master-0", "a", "Running", rv=3))
    assert c.snapshot(ref).pods[0]["status"]["phase"] == "Succeeded"

    c.apply("PyTorchJob", "DELETED", job("a", rv=7))
    assert c.knows(ref) and c.snapshot(ref).job is None  # gone, known to be gone
    unknown = JobRef(kind="PyTorchJob", name="new", namespace="ml")
    assert not c.knows(unknown)  # created after the list: the stream fetches it (want), the trigger does not
    c.want(unknown)
    assert c.wanted == {("PyTorchJob", "new")}


def test_a_snapshot_reads_its_jobs_pods_through_the_index_as_a_scan_of_every_pod_would() -> None:
    """The cache files pods by their owner label, so that each of 1,000 triggers does not scan every pod of the
    namespace; across adds, relabels, deletes, stale copies and relists it answers what the full scan answers."""
    import random

    from airflow_provider_torchelastic.kubernetes import kinds

    rng = random.Random(7)
    c = cache()
    jobs = [f"j{i}" for i in range(6)]
    c.replace("PyTorchJob", [job(name) for name in jobs])
    c.replace("Pod", [])
    descriptor = kinds.get("PyTorchJob")
    version = 1
    for step in range(600):
        version += 1
        name = f"p{rng.randrange(20)}"
        owner = rng.choice([*jobs, None])
        move = rng.random()
        if move < 0.6:
            c.apply("Pod", "MODIFIED", pod(name, owner, rv=version))
        elif move < 0.8:
            c.apply("Pod", "DELETED", pod(name, owner, rv=version))
        elif move < 0.95:
            c.apply("Pod", "ADDED", pod(name, owner, rv=version - rng.randrange(5)))  # maybe a stale copy
        else:
            kept = rng.sample(sorted(c.objects["Pod"].values(), key=str), k=len(c.objects["Pod"]) // 2)
            c.replace("Pod", [pod(p["metadata"]["name"], rng.choice(jobs), rv=version) for p in kept])
        for name in jobs:
            ref = JobRef(kind="PyTorchJob", name=name, namespace="ml")
            scanned = descriptor.pods_of(name).pick(c.objects["PyTorchJob"][name], c.objects["Pod"].values())
            assert sorted(p["metadata"]["name"] for p in c.snapshot(ref).pods) == sorted(
                p["metadata"]["name"] for p in scanned
            ), step
    filed = {pod_name for bucket in c._pods_by_owner.values() for pod_name in bucket}
    assert filed <= set(c.objects["Pod"]) and all(c._pods_by_owner.values())  # nothing stale, no empty bucket


def running_pods(n: int, job_name: str = "j") -> list[dict[str, Any]]:
    return [pod(f"{job_name}-worker-{i}", job_name) for i in range(n)]


def drive(
    flow: Generator[Any, Any, Any],
    snapshot: Callable[[float], Snapshot],
    logs: dict[str, str],
    until: Callable[[list[ReadLog], float], bool],
) -> tuple[list[ReadLog], list[str]]:
    """Answer the wait core's requests in fake time, from ``T0``, until ``until(reads, now)`` or the wait ends: the
    log reads it asked for and the lines it emitted."""
    reads: list[ReadLog] = []
    emitted: list[str] = []
    request, now = next(flow), T0
    try:
        while not until(reads, now):
            if isinstance(request, FetchJob):
                request = flow.send(snapshot(now))
            elif isinstance(request, ReadLog):
                reads.append(request)
                request = flow.send(logs.get(request.pod, ""))
            elif isinstance(request, EmitLog):
                emitted.append(request.line)
                request = flow.send(None)
            elif isinstance(request, Sleep):
                now += request.seconds
                request = flow.send(None)
            else:
                request = flow.send(None)
    except StopIteration:
        pass
    return reads, emitted


def drive_minutes(pods: list[dict[str, Any]], minutes: float, logs: dict[str, str]) -> list[ReadLog]:
    """Run the wait core over a running PyTorchJob for ``minutes`` of fake time; the log reads it asked for."""
    ref = JobRef(kind="PyTorchJob", name="j", namespace="ml")
    job_obj = {"metadata": {"name": "j", "creationTimestamp": "2027-01-15T08:00:00Z"}, "spec": {}}
    job_obj["status"] = {"conditions": [{"type": "Running", "status": "True"}]}
    reads, _ = drive(
        wait_for_job(ref, WaitPolicy(poll_interval=10.0)),
        lambda now: Snapshot(job=job_obj, pods=pods, now=now),
        logs,
        lambda reads, now: now >= T0 + minutes * 60,
    )
    return reads


@pytest.mark.parametrize("pods", [1, 8, 64])
def test_a_quiet_job_costs_about_one_log_read_a_minute_whatever_its_pod_count(pods: int) -> None:
    reads = drive_minutes(running_pods(pods), 10, {})
    assert len(reads) <= 10 + 4  # backing off to one a minute after the first reads


def test_rank_0s_pod_is_found_and_streamed_the_others_are_not() -> None:
    stamp = "2027-01-15T08:00:01Z"
    logs = {"j-worker-2": f"{stamp} [rank0]:this node holds rank 0\n", "j-worker-0": f"{stamp} [rank3]:noise\n"}
    ref = JobRef(kind="PyTorchJob", name="j", namespace="ml")
    job_obj = {"metadata": {"name": "j"}, "spec": {}, "status": {"conditions": [{"type": "Running", "status": "True"}]}}
    read_requests, emitted = drive(
        wait_for_job(ref, WaitPolicy(poll_interval=10.0)),
        lambda now: Snapshot(job=job_obj, pods=running_pods(4), now=now),
        logs,
        lambda reads, now: len(reads) >= 6,
    )
    reads = [r.pod for r in read_requests]
    assert reads[:3] == ["j-worker-0", "j-worker-1", "j-worker-2"]  # probing, one pod per read
    assert set(reads[3:]) == {"j-worker-2"}  # then only rank 0's pod
    assert "[j-worker-2] [rank0]:this node holds rank 0" in emitted
    assert not any("noise" in line for line in emitted)


def test_failed_pods_tails_are_read_once_each_and_bounded() -> None:
    pods = [pod(f"j-worker-{i}", "j", "Failed") for i in range(20)]
    reads = drive_minutes(pods, 3, {})
    from airflow_provider_torchelastic.kubernetes.wait_logs import FAILED_TAIL_LINES

    tails = [r for r in reads if r.tail_lines == FAILED_TAIL_LINES]  # a first probe read takes a longer tail
    assert len(tails) == WaitPolicy().log_pods and len({r.pod for r in tails}) == len(tails)


def restarted(p: dict[str, Any], count: int, code: int = 1) -> dict[str, Any]:
    """``p`` with its training container restarted in place ``count`` times, the last run having exited ``code``."""
    status = {"name": "pytorch", "restartCount": count, "state": {"running": {}}}
    status["lastState"] = {"terminated": {"exitCode": code, "reason": "Error"}}
    p["status"]["containerStatuses"] = [status]
    return p


def test_a_restarted_containers_previous_run_is_read_once_per_restart_and_printed() -> None:
    """A node restarted in place stays Running: the exception that killed its earlier run is only in the previous
    container's log, which is read (previous=true) once per restart, and printed under the pod's name."""
    stamp = "2027-01-15T08:00:01Z"
    pods = [restarted(pod("j-worker-0", "j"), 1), pod("j-worker-1", "j")]
    ref = JobRef(kind="PyTorchJob", name="j", namespace="ml")
    job_obj = {"metadata": {"name": "j"}, "spec": {}, "status": {"conditions": [{"type": "Running", "status": "True"}]}}
    logs = {"j-worker-0": f"{stamp} ValueError: shard 3 has a corrupt header\n"}
    polls = [0]

    def snapshot(now: float) -> Snapshot:
        polls[0] += 1
        if polls[0] == 4:  # restarted again: its new previous run is read too
            restarted(pods[0], 2, code=137)
        return Snapshot(job=job_obj, pods=pods, now=now)

    reads, emitted = drive(
        wait_for_job(ref, WaitPolicy(poll_interval=10.0)), snapshot, logs, lambda r, now: polls[0] > 6
    )
    previous = [r for r in reads if r.previous]
    assert [(r.pod, r.container) for r in previous] == [("j-worker-0", "pytorch")] * 2, previous
    from airflow_provider_torchelastic.core.tap import TAIL_LINES

    # Bounded like every read, and with its header it fits one tail of the job summary (the header is not dropped).
    assert all(r.tail_lines is not None and r.tail_lines + 1 <= TAIL_LINES for r in previous), previous
    assert "[j-worker-0] ValueError: shard 3 has a corrupt header" in emitted
    headers = [line for line in emitted if "previous pytorch container ended" in line]
    assert len(headers) == 2 and "exit code 1)" in headers[0] and "exit code 137" in headers[1], headers


def test_previous_runs_are_read_for_a_bounded_number_of_pods() -> None:
    pods = [restarted(pod(f"j-worker-{i}", "j"), 1) for i in range(20)]
    reads = drive_minutes(pods, 3, {})
    previous = [r for r in reads if r.previous]
    assert len(previous) == WaitPolicy().log_pods and len({r.pod for r in previous}) == len(previous)


def test_a_job_that_ends_before_any_probe_still_shows_rank_0s_log() -> None:
    """A short job is over before the first paced read found rank 0: the final pass probes until it does."""
    stamp = "2027-01-15T08:00:01Z"
    logs = {"j-worker-2": f"{stamp} [rank0]:TORCHELASTIC_METRICS {{}}\n", "j-worker-0": f"{stamp} [rank1]:x\n"}
    ref = JobRef(kind="PyTorchJob", name="j", namespace="ml")
    flow = wait_for_job(ref, WaitPolicy(poll_interval=10.0, finish_action="keep"))
    done = {"metadata": {"name": "j"}, "spec": {}}
    done["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}]}
    pods = [pod(f"j-worker-{i}", "j", "Succeeded") for i in range(4)]
    for i, p in enumerate(pods):  # what the runner leaves in the termination message: rank 0's value on its node
        outcome = encode_success('{"ok": true}' if i == 2 else None)
        terminated = {"exitCode": 0, "reason": "Completed", "message": outcome}
        p["status"]["containerStatuses"] = [{"name": "pytorch", "state": {"terminated": terminated}}]
    read_requests, emitted = drive(
        flow,
        lambda now: Snapshot(job=done, pods=pods, now=now),
        logs,
        # Until the first sleep (fake time moved) or, should a bug loop, 20 reads: fail the test, never hang it.
        lambda reads, now: now > T0 or len(reads) >= 20,
    )
    reads = [r.pod for r in read_requests]
    # All in the first pass that saw the job ended, before any sleep: it probed until it found rank 0's pod.
    assert reads == ["j-worker-0", "j-worker-1", "j-worker-2"]
    assert "[j-worker-2] [rank0]:TORCHELASTIC_METRICS {}" in emitted


# --- bounded state (issue 20, item 5) ---------------------------------------------------------------------------------


def test_the_record_of_jobs_gone_is_bounded_in_size_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.kubernetes import watch

    monkeypatch.setattr(watch, "MAX_ABSENT", 3)
    cache = JobCache("ml", kube=None)
    for i in range(5):
        cache.gone("PyTorchJob", f"j{i}", now=100.0 + i)
    assert list(cache.absent) == [("PyTorchJob", "j2"), ("PyTorchJob", "j3"), ("PyTorchJob", "j4")]
    cache.gone("PyTorchJob", "late", now=103.0 + watch.ABSENT_SECONDS)
    assert list(cache.absent) == [("PyTorchJob", "j4"), ("PyTorchJob", "late")], "older than an hour: forgotten"


def test_a_first_log_read_takes_the_end_of_the_log_and_later_reads_what_is_new() -> None:
    from airflow_provider_torchelastic.kubernetes.wait_logs import FIRST_READ_TAIL_LINES

    pods = running_pods(1)
    reads, _ = drive(
        wait_for_job(JobRef(kind="PyTorchJob", name="j", namespace="ml"), WaitPolicy(poll_interval=10.0)),
        lambda now: Snapshot(
            job={
                "metadata": {"name": "j"},
                "spec": {},
                "status": {"conditions": [{"type": "Running", "status": "True"}]},
            },
            pods=pods,
            now=now,
        ),
        {"j-worker-0": "2027-01-15T08:00:01Z [rank0]:hello\n"},
        lambda reads, now: len(reads) >= 2,
    )
    assert reads[0].tail_lines == FIRST_READ_TAIL_LINES and reads[0].since_time is None
    assert reads[1].tail_lines is None and reads[1].since_time is not None


# --- why an image pull failed (issue 31, item 3) ----------------------------------------------------------------------


def _stuck_pulling(reason: str) -> dict[str, Any]:
    p = pod("j-worker-0", "j", "Pending")
    message = 'Back-off pulling image "registry.example/team/train:v9"'
    p["metadata"]["creationTimestamp"] = "2027-01-15T07:00:00Z"
    p["status"]["containerStatuses"] = [
        {"name": "pytorch", "state": {"waiting": {"reason": reason, "message": message}}}
    ]
    return p


def _event(message: str, stamp: str) -> dict[str, Any]:
    return {"reason": "Failed", "message": message, "lastTimestamp": stamp, "involvedObject": {"name": "j-worker-0"}}


def _fail_stuck(reason: str, events: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    ref = JobRef(kind="PyTorchJob", name="j", namespace="ml")
    job_obj = {"metadata": {"name": "j", "creationTimestamp": "2027-01-15T07:00:00Z"}, "spec": {}, "status": {}}
    flow = wait_for_job(ref, WaitPolicy(poll_interval=10.0, pending_grace_seconds=3))
    asked: list[Any] = []
    request = next(flow)
    try:
        while True:
            if isinstance(request, FetchJob):
                request = flow.send(Snapshot(job=job_obj, pods=[_stuck_pulling(reason)], now=T0))
            elif isinstance(request, ReadEvents):
                asked.append(request)
                request = flow.send(events)
            else:
                request = flow.send("" if isinstance(request, ReadLog) else None)
    except StopIteration as stop:
        return stop.value, asked


def test_an_image_pull_back_off_is_explained_by_the_kubelets_newest_pull_error() -> None:
    events = [
        _event('Failed to pull image "registry.example/team/train:v9": rpc error: old', "2027-01-15T07:00:01Z"),
        _event("Error: ErrImagePull", "2027-01-15T07:00:02Z"),
        _event(
            'Failed to pull image "registry.example/team/train:v9": rpc error: code = NotFound desc = manifest unknown',
            "2027-01-15T07:00:09Z",
        ),
    ]
    decision, asked = _fail_stuck("ImagePullBackOff", events)
    assert [(r.name, r.namespace) for r in asked] == [("j-worker-0", "ml")]
    detail = decision.verdict.detail
    assert "ImagePullBackOff" in detail and "Back-off pulling image" in detail, detail
    assert detail.endswith("the last pull failed: " + events[2]["message"]), detail
    assert decision.verdict.cause == "image_unavailable" and not decision.verdict.recoverable


def test_without_events_the_back_off_message_stays_and_err_image_pull_needs_none() -> None:
    decision, _ = _fail_stuck("ImagePullBackOff", [])  # no permission, or the events expired
    assert decision.verdict.detail.endswith('Back-off pulling image "registry.example/team/train:v9"')
    # ErrImagePull's own message is the pull's error: no events are read.
    _, asked = _fail_stuck("ErrImagePull", [_event("Failed to pull image: x", "2027-01-15T07:00:09Z")])
    assert asked == []

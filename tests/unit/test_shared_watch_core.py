"""The pure parts of the shared watch and of bounded log reading: the stream key, the cache's view of a namespace,
and how many log reads a job costs however many pods it has."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import encode_success
from airflow_provider_torchelastic.kubernetes.status import JobRef, Snapshot, WaitPolicy
from airflow_provider_torchelastic.kubernetes.wait import EmitLog, FetchJob, ReadLog, Sleep, wait_for_job
from airflow_provider_torchelastic.kubernetes.watch import JobCache, stream_key

T0 = 1_800_000_000.0


def key(**overrides: Any) -> tuple[str, str, str]:
    settings: dict[str, Any] = {
        "namespace": "ml",
        "conn_id": "kubernetes_default",
        "connection_extras": {"token": "s3cr3t-token", "namespace": "ml"},
        "config_dict": None,
        "cluster_context": None,
        "in_cluster": None,
    }
    return stream_key(**{**settings, **overrides})


def test_the_stream_key_is_a_deterministic_fingerprint_without_secrets() -> None:
    assert key() == key()
    assert "s3cr3t" not in repr(key())
    assert key(connection_extras={"token": "other", "namespace": "ml"}) != key()
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
    from airflow_provider_torchelastic.kubernetes.wait import FAILED_TAIL_LINES

    tails = [r for r in reads if r.tail_lines == FAILED_TAIL_LINES]  # a first probe read takes a longer tail
    assert len(tails) == WaitPolicy().log_pods and len({r.pod for r in tails}) == len(tails)


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
    from airflow_provider_torchelastic.kubernetes.wait import FIRST_READ_TAIL_LINES

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
    assert reads[0].tail_lines == FIRST_READ_TAIL_LINES and reads[0].since_seconds is None
    assert reads[1].tail_lines is None and reads[1].since_seconds is not None

"""Pull failures told apart (issue 37, item 2): containerd 1.6's words, the decision they lead to, and the events the
wait reads when kubelet 1.20's back-off message says nothing. Pure: pod JSON, a fake clock, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.image_pull import PullError, backed_off_images, classify_pull, pull_error_of
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.requests import FetchJob, ReadEvents, ReadLog
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy
from airflow_provider_torchelastic.operators import (
    ImageTransientlyUnavailableError,
    ImageUnavailableError,
    TorchElasticOperator,
    TrainingRecoverableError,
)
from airflow_provider_torchelastic.operators.exceptions import class_for
from airflow_provider_torchelastic.triggers import WatchArgs

IMAGE = "10.77.0.1:5000/torchelastic-runner:t1"
REF = f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}"'
T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"  # == T0
SCHEDULED = "2027-01-15T08:01:00Z"  # T0 + 60: the pod waited a minute for a node first
POD = JobRef(kind="Pod", name="train-abc", namespace="ml")
JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
POLICY = WaitPolicy(poll_interval=5, pending_grace_seconds=30, image_pull_timeout=120)

# What the kubelet 1.20 wrote on the reference node for each fault of tests/cluster/registry_proxy.py (containerd
# 1.6.20; see ../shared/notes/registry-and-pulls.md), and what a few registries say elsewhere.
TRANSIENT = {
    "429": f"rpc error: code = Unknown desc = {REF}: pulling from host 10.77.0.1:5000 failed with status code "
    "[manifests t1]: 429 Too Many Requests",
    "503": f"rpc error: code = Unknown desc = {REF}: pulling from host 10.77.0.1:5000 failed with status code "
    "[manifests t1]: 503 Service Unavailable",
    "blob 502": f"rpc error: code = Unknown desc = {REF}: failed to copy: httpReadSeeker: failed open: unexpected "
    "status code http://10.77.0.1:5000/v2/torchelastic-runner/blobs/sha256:ab: 502 Bad Gateway",
    "reset": f'rpc error: code = Unknown desc = {REF}: failed to do request: Head "http://10.77.0.1:5000/v2/'
    'torchelastic-runner/manifests/t1": read tcp 10.77.0.1:41234->10.77.0.1:5000: read: connection reset by peer',
    "timeout": f'rpc error: code = Unknown desc = {REF}: failed to do request: Head "https://r.example/v2/x/'
    'manifests/t1": dial tcp 10.0.0.9:443: i/o timeout',
    "docker hub": "rpc error: code = Unknown desc = failed to pull and unpack image: 429 Too Many Requests - Server "
    "message: toomanyrequests: You have reached your pull rate limit. You may increase the limit by authenticating",
    "refused": f'rpc error: code = Unknown desc = {REF}: failed to do request: Head "http://10.77.0.1:5000/v2/x/'
    'manifests/t1": dial tcp 10.77.0.1:5000: connect: connection refused',
}
PERMANENT = {
    "missing tag": f"rpc error: code = NotFound desc = {REF}: {IMAGE}: not found",
    "no access": f"rpc error: code = Unknown desc = {REF}: pull access denied, repository does not exist or may "
    "require authorization: server message: insufficient_scope: authorization failed",
    "401": f"rpc error: code = Unknown desc = {REF}: failed to authorize: failed to fetch anonymous token: "
    "unexpected status: 401 Unauthorized",
    "403": f"rpc error: code = Unknown desc = {REF}: pulling from host r.example failed with status code "
    "[manifests t1]: 403 Forbidden",
    "bad name": 'rpc error: code = Unknown desc = failed to pull and unpack image "docker.io/library/Bad:x": '
    "invalid reference format: repository name must be lowercase",
    "no such host": f'rpc error: code = Unknown desc = {REF}: failed to do request: Head "https://regsitry.example/'
    'v2/x/manifests/t1": dial tcp: lookup regsitry.example on 10.96.0.10:53: no such host',
}


@pytest.mark.parametrize("message", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_throttling_server_errors_timeouts_and_resets_may_pass(message: str) -> None:
    found = classify_pull("ErrImagePull", message)
    assert found.kind is PullError.TRANSIENT and found.what, found


@pytest.mark.parametrize("message", PERMANENT.values(), ids=PERMANENT.keys())
def test_not_found_unauthorized_and_invalid_names_do_not(message: str) -> None:
    found = classify_pull("ErrImagePull", message)
    assert found.kind is PullError.PERMANENT and found.what, found


def test_the_words_that_decided_are_kept_and_reasons_alone_can_decide() -> None:
    assert classify_pull("ErrImagePull", TRANSIENT["429"]).what == "429 Too Many Requests"
    assert classify_pull("ErrImagePull", TRANSIENT["reset"]).what == "connection reset by peer"
    assert classify_pull("ErrImagePull", PERMANENT["missing tag"]).what == "code = NotFound"
    assert classify_pull("InvalidImageName", 'Failed to apply default image tag "x:": invalid').kind is (
        PullError.PERMANENT
    )
    assert classify_pull("ErrImageNeverPull", "").kind is PullError.PERMANENT
    # kubelet 1.20's back-off says nothing of why: the events must.
    assert classify_pull("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"').kind is PullError.UNKNOWN


def event(message: str, stamp: str, reason: str = "Failed") -> dict[str, Any]:
    return {"reason": reason, "message": message, "lastTimestamp": stamp}


def test_the_newest_pull_error_of_the_image_is_read_from_the_events() -> None:
    events = [
        event(f'Failed to pull image "{IMAGE}": {TRANSIENT["429"]}', "2027-01-15T08:01:05Z"),
        event(f'Failed to pull image "{IMAGE}": {TRANSIENT["reset"]}', "2027-01-15T08:01:40Z"),
        event("Error: ErrImagePull", "2027-01-15T08:01:41Z"),
        event(f'Back-off pulling image "{IMAGE}"', "2027-01-15T08:01:50Z", reason="BackOff"),
        event(f'Failed to pull image "other:1": {PERMANENT["missing tag"]}', "2027-01-15T08:01:59Z"),
    ]
    assert pull_error_of(events, IMAGE).endswith("connection reset by peer")
    assert pull_error_of(events).endswith(PERMANENT["missing tag"])  # any image
    assert pull_error_of([], IMAGE) == ""


def pod(
    name: str, reason: str, message: str, *, scheduled: str | None = SCHEDULED, image: str = IMAGE
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Pending",
        "containerStatuses": [
            {"name": "pytorch", "image": image, "state": {"waiting": {"reason": reason, "message": message}}}
        ],
    }
    if scheduled is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}]
    return {"metadata": {"name": name, "creationTimestamp": STAMP0}, "status": status}


def decide_pod(p: dict[str, Any], now: float, pull_errors: dict[str, str] | None = None) -> WaitDecision:
    return kinds.get("Pod").decide(POD, Snapshot(job=p, now=now, pull_errors=pull_errors), POLICY)


def test_an_image_the_registry_refuses_fails_at_once_without_the_grace() -> None:
    d = decide_pod(pod("train-abc", "ErrImagePull", PERMANENT["missing tag"]), now=T0 + 61)
    assert d.phase is Phase.FAILED and d.verdict is not None
    assert (d.verdict.cause, d.verdict.recoverable, d.verdict.reason) == (
        causes.IMAGE_UNAVAILABLE,
        False,
        "ErrImagePull",
    )
    assert d.verdict.detail.startswith("pod train-abc cannot pull its image (ErrImagePull, code = NotFound): ")
    assert IMAGE in d.verdict.detail
    assert class_for(d.verdict.cause, recoverable=d.verdict.recoverable) is ImageUnavailableError


def test_a_throttled_pull_is_waited_for_up_to_image_pull_timeout_from_scheduling_then_recoverable() -> None:
    throttled = pod("train-abc", "ErrImagePull", TRANSIENT["429"])
    # Long past pending_grace_seconds (30 s) since creation, and 119 s since the pod got its node: still waiting.
    assert decide_pod(throttled, now=T0 + 60 + 119).phase is Phase.PENDING
    d = decide_pod(throttled, now=T0 + 60 + 120)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert d.verdict.cause == causes.IMAGE_TRANSIENTLY_UNAVAILABLE and d.verdict.node == "train-abc"
    assert "image_pull_timeout=120" in d.verdict.detail and "429 Too Many Requests" in d.verdict.detail
    cls = class_for(d.verdict.cause, recoverable=d.verdict.recoverable)
    assert cls is ImageTransientlyUnavailableError and issubclass(cls, TrainingRecoverableError)


def test_a_back_off_is_judged_by_the_pull_error_of_its_image_and_without_one_by_the_grace() -> None:
    backing_off = pod("train-abc", "ImagePullBackOff", f'Back-off pulling image "{IMAGE}"')
    assert decide_pod(backing_off, now=T0 + 100, pull_errors={IMAGE: TRANSIENT["reset"]}).phase is Phase.PENDING
    refused = decide_pod(backing_off, now=T0 + 1, pull_errors={IMAGE: f"Failed to pull image: {PERMANENT['401']}"})
    assert refused.verdict is not None and refused.verdict.cause == causes.IMAGE_UNAVAILABLE
    assert refused.verdict.detail.endswith(f"; the last pull failed: Failed to pull image: {PERMANENT['401']}")
    # Events unreadable (no "list events") or expired: the grace decides, as before.
    assert decide_pod(backing_off, now=T0 + 29).phase is Phase.PENDING
    unknown = decide_pod(backing_off, now=T0 + 30)
    assert unknown.verdict is not None and not unknown.verdict.recoverable
    assert unknown.verdict.detail.startswith("pod train-abc stuck in ImagePullBackOff for more than 30 s")


def test_a_missing_secret_keeps_its_grace() -> None:
    missing = pod("train-abc", "CreateContainerConfigError", 'secret "s3" not found')
    assert decide_pod(missing, now=T0 + 29).phase is Phase.PENDING
    d = decide_pod(missing, now=T0 + 30)
    assert d.verdict is not None and d.verdict.cause == causes.CONFIGURATION


def test_a_pod_not_scheduled_yet_counts_from_its_creation() -> None:
    throttled = pod("train-abc", "ErrImagePull", TRANSIENT["503"], scheduled=None)
    assert decide_pod(throttled, now=T0 + 119).phase is Phase.PENDING
    assert decide_pod(throttled, now=T0 + 120).phase is Phase.FAILED


def job() -> dict[str, Any]:
    return {
        "kind": "PyTorchJob",
        "metadata": {"name": JOB.name, "namespace": "ml", "creationTimestamp": STAMP0},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 3}}},
        "status": {"conditions": [{"type": "Created", "status": "True"}]},
    }


def test_backed_off_images_names_one_pod_per_image() -> None:
    back_off = f'Back-off pulling image "{IMAGE}"'
    pods = [
        pod("w0", "ImagePullBackOff", back_off),
        pod("w1", "ImagePullBackOff", back_off),
        pod("w2", "ImagePullBackOff", "Back-off", image="other:1"),
        pod("w3", "ErrImagePull", TRANSIENT["429"]),  # says why itself
    ]
    assert backed_off_images(pods) == {IMAGE: "w0", "other:1": "w2"}


def test_the_wait_reads_one_pods_events_per_backed_off_image_at_every_poll() -> None:
    back_off = f'Back-off pulling image "{IMAGE}"'
    pods = [pod(f"{JOB.name}-worker-{i}", "ImagePullBackOff", back_off) for i in range(3)]
    events = [event(f'Failed to pull image "{IMAGE}": {TRANSIENT["429"]}', "2027-01-15T08:01:05Z")]
    flow = wait_for_job(JOB, POLICY)
    asked: list[ReadEvents] = []
    polls = [T0 + 60 + 10, T0 + 60 + 60, T0 + 60 + 121]
    request = next(flow)
    decision: WaitDecision | None = None
    try:
        while True:
            if isinstance(request, FetchJob):
                request = flow.send(Snapshot(job=job(), pods=pods, now=polls.pop(0)))
            elif isinstance(request, ReadEvents):
                asked.append(request)
                request = flow.send(events)
            else:
                request = flow.send("" if isinstance(request, ReadLog) else None)
    except StopIteration as stop:
        decision = stop.value
    assert [(r.name, r.namespace) for r in asked] == [(f"{JOB.name}-worker-0", "ml")] * 3
    assert decision is not None and decision.verdict is not None
    assert decision.verdict.cause == causes.IMAGE_TRANSIENTLY_UNAVAILABLE and decision.verdict.recoverable
    assert decision.verdict.detail.endswith(f'the last pull failed: Failed to pull image "{IMAGE}": {TRANSIENT["429"]}')


def test_image_pull_timeout_is_an_argument_checked_at_parse_time_and_carried_to_the_trigger() -> None:
    op = TorchElasticOperator(task_id="t", python_callable=print, image="img:1", image_pull_timeout=90)
    assert op.image_pull_timeout == 90.0
    assert TorchElasticOperator(task_id="u", python_callable=print, image="img:1").image_pull_timeout == 600.0
    with pytest.raises(ValueError, match="image_pull_timeout"):
        TorchElasticOperator(task_id="v", python_callable=print, image="img:1", image_pull_timeout=-1)
    with pytest.raises(TypeError, match="image_pull_timeout"):
        TorchElasticOperator(task_id="w", python_callable=print, image="img:1", image_pull_timeout=True)
    args = WatchArgs(kind="Pod", name="p", namespace="ml", image_pull_timeout=45)
    assert args.policy.image_pull_timeout == 45
    assert WatchArgs(kind="Pod", name="p", namespace="ml").policy.image_pull_timeout == 600


def test_a_pod_that_may_never_pull_its_image_is_stuck_not_waiting() -> None:
    # imagePullPolicy: Never with the image absent from the node: the kubelet will never pull it.
    from airflow_provider_torchelastic.kubernetes import status

    pod = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "image": "registry.example.com/train:1",
                    "state": {"waiting": {"reason": "ErrImageNeverPull", "message": "Container image ... not present"}},
                }
            ],
        }
    }
    assert status._stuck_reason(pod) == (
        "ErrImageNeverPull",
        "Container image ... not present",
        "registry.example.com/train:1",
    )
    assert classify_pull("ErrImageNeverPull", "Container image ... not present").kind is PullError.PERMANENT

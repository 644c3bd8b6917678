"""Kubernetes requests as data: what each builder sends, what a 404 means for it, and that the sync and async senders
put the same call on the wire (tests/e2e/test_kubernetes.py sends them to a real API server)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls, discovery, kinds
from airflow_provider_torchelastic.kubernetes.client import AsyncKube, SyncKube
from airflow_provider_torchelastic.kubernetes.requests import ReadLog
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
from tests.unit.fake_kube_api import Answer, fake_api, items, json_answer, status_answer

JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
NOT_FOUND = KubeError(404, "NotFound", "gone")


def test_objects_are_addressed_by_their_kinds_group_and_a_patch_takes_the_groups_content_type() -> None:
    assert calls.get("Pod", "p", "ml").path == "/api/v1/namespaces/ml/pods/p"
    assert calls.get("PyTorchJob", "j", "ml").path == "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs/j"
    assert calls.delete("Secret", "s", "ml").path == "/api/v1/namespaces/ml/secrets/s"
    [jobset, _] = kinds.get("TrainJob").intermediates
    assert calls.owners(jobset, JOB).path == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets"
    assert calls.patch_secret("s", "ml", {}).content_type == "application/strategic-merge-patch+json"
    labels = calls.label_job(JOB, {"a": "b"})
    assert (labels.method, labels.content_type) == ("PATCH", "application/merge-patch+json")
    assert labels.body == {"metadata": {"labels": {"a": "b"}}}
    assert calls.get("Pod", "a/b", "ml").path == "/api/v1/namespaces/ml/pods/a%2Fb"  # a name is one segment


def test_what_not_found_means_is_said_by_the_call() -> None:
    assert calls.get("Pod", "p", "ml").recover(NOT_FOUND) is None
    assert calls.delete("Pod", "p", "ml").recover(NOT_FOUND) is False
    assert discovery.served_resources("kueue.x-k8s.io", "v1beta1").recover(NOT_FOUND) is None
    assert discovery.crd("pytorchjobs.kubeflow.org").recover(NOT_FOUND) is None
    for call in (calls.create({"kind": "Pod", "metadata": {"namespace": "ml"}}), calls.list_pods("ml", "a=b")):
        with pytest.raises(KubeError) as info:
            call.recover(NOT_FOUND)
        assert info.value is NOT_FOUND
    with pytest.raises(KubeError):
        calls.get("Pod", "p", "ml").recover(KubeError(403, "Forbidden", "no"))


def test_a_log_read_is_the_readlog_whole_and_bounded() -> None:
    read = calls.read_log(ReadLog("p", "ml", "2027-01-15T08:00:00Z", None, "node", previous=True, limit_bytes=1000))
    assert read.path == "/api/v1/namespaces/ml/pods/p/log" and read.read_limit == 1000
    assert dict(read.query) == {
        "container": "node",
        "sinceTime": "2027-01-15T08:00:00Z",
        "limitBytes": "1000",
        "timestamps": "true",
        "previous": "true",
    }
    plain = calls.read_log(ReadLog("p", "ml", None, 5, timestamps=False))
    assert dict(plain.query) == {"container": "pytorch", "tailLines": "5", "limitBytes": str(1 << 20)}


def test_a_snapshot_is_one_flow_of_calls_whatever_sends_them() -> None:
    trainjob = JobRef(kind="TrainJob", name="t", namespace="ml")
    flow = calls.snapshot(trainjob)
    sent = [flow.send(None)]
    sent.append(flow.send({"kind": "TrainJob", "metadata": {"name": "t", "uid": "u"}}))
    while True:
        try:
            sent.append(flow.send([{"metadata": {"name": "x"}}]))
        except StopIteration as stop:
            snapshot = stop.value
            break
    assert [call.path.rsplit("/", 1)[-1] for call in sent] == ["t", "pods", "jobsets", "jobs"]
    assert snapshot.job["metadata"]["uid"] == "u" and snapshot.pods == []  # no controller chain up to the job

    gone = calls.snapshot(JOB)
    gone.send(None)
    with pytest.raises(StopIteration) as stop:
        gone.send(None)  # the job is gone: its pods are not asked for
    assert stop.value.value.job is None


def test_both_senders_put_the_same_calls_on_the_wire(tmp_path: Any) -> None:
    """One builder, two senders: the sync and async clients send the same method, path and query, map a 404 the
    same way, and read no more of a log than asked even where the server ignores ``limitBytes``."""
    from kubernetes import client
    from kubernetes_asyncio import client as async_client

    def answer(method: str, path: str, query: Mapping[str, str]) -> Answer:
        if path.endswith("/log"):
            return Answer(200, b"x" * 100, {"Content-Type": "text/plain"})
        if path.endswith("/gone"):
            return status_answer(404, "NotFound", "gone")
        if method == "DELETE" or method == "PATCH":
            return json_answer({"kind": "Status"})
        return items({"metadata": {"name": "a"}})

    wanted = [
        calls.list_kind("PyTorchJob", "ml", label_selector="app=x"),
        calls.read_log(ReadLog("p", "ml", None, 10, limit_bytes=7)),
        calls.get("Pod", "gone", "ml"),
        calls.delete("Pod", "gone", "ml"),
        calls.label_job(JOB, {"a": "b"}),
        calls.workloads("ml", "uid-1"),
    ]
    expected = [[{"metadata": {"name": "a"}}], "xxxxxxx", None, False, None, [{"metadata": {"name": "a"}}]]

    with fake_api(answer) as api:
        configuration = client.Configuration()
        configuration.host, configuration.retries = api.url, 0
        sync = SyncKube(client.ApiClient(configuration))
        assert [sync.send(call) for call in wanted] == expected
        sync_requests = list(api.requests)
        api.requests.clear()

        async def send_all() -> list[Any]:
            async with async_client.ApiClient(async_client.Configuration(host=api.url)) as api_client:
                kube = AsyncKube(api_client)
                return [await kube.send(call) for call in wanted]

        assert asyncio.run(send_all()) == expected
        async_requests = list(api.requests)
    assert sync_requests == async_requests
    assert [(r.method, r.path, r.content_type) for r in sync_requests] == [
        (c.method, c.path, c.content_type) for c in wanted
    ]
    assert sync_requests[0].query == {"labelSelector": "app=x"}
    log_query = {"container": "pytorch", "tailLines": "10", "limitBytes": "7", "timestamps": "true"}
    assert sync_requests[1].query == log_query

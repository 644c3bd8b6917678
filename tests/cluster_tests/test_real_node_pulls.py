"""Pull failures on the real node (issue 37): pods pull the runner image from the node's registry through its fault
proxy (tests/cluster/registry.py), and the package's own wait (``wait_for_job``, driven as the worker drives it,
against the real kube-apiserver) tells the failures apart. Each test uses a fresh tag of the runner image, so
containerd really resolves it; the kubelet's back-off (10 s, then 20 s) sets the pace. About 80 s in all.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.kubernetes.client import sync_kube_from_config
from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, WaitDecision, WaitPolicy
from tests.cluster import registry
from tests.cluster.pytest_plugin import REAL_NODE_GROUP, RealNodeCluster

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group(REAL_NODE_GROUP)]
IMAGE_CAUSES = (causes.IMAGE_UNAVAILABLE, causes.IMAGE_TRANSIENTLY_UNAVAILABLE)


class Pulls:
    def __init__(self, cluster: RealNodeCluster) -> None:
        from kubernetes import client, config

        self.cluster = cluster
        self.core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        self.kube = sync_kube_from_config(str(cluster.kubeconfig))
        self.made: list[str] = []

    def tag(self, fault: str | None = None, pulls: int = 0) -> tuple[str, str]:
        """A fresh tag of the runner image (and its fault); returns (tag, the ref a pod pulls)."""
        tag = f"t-{uuid.uuid4().hex[:8]}"
        ref = registry.tag_image(self.cluster.layout, self.cluster.image.rpartition(":")[2], tag)
        if fault is not None:
            registry.inject(self.cluster.layout, tag, fault, pulls)
        return tag, ref

    def wait(self, image: str, policy: WaitPolicy) -> tuple[WaitDecision, list[str]]:
        name = f"pull-{uuid.uuid4().hex[:8]}"
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "pytorch", "image": image, "command": ["python", "-c", "pass"]}],
            },
        }
        self.core.create_namespaced_pod(self.cluster.namespace, pod)
        self.made.append(name)
        lines: list[str] = []
        ref = JobRef(kind="Pod", name=name, namespace=self.cluster.namespace)
        decision: WaitDecision = drive_sync(wait_for_job(ref, policy), self.kube, lines.append)
        return decision, lines

    def clean(self) -> None:
        for name in self.made:
            with contextlib.suppress(Exception):  # deleted by the wait already
                self.core.delete_namespaced_pod(name, self.cluster.namespace, grace_period_seconds=0)


@pytest.fixture
def pulls(real_node_cluster: RealNodeCluster) -> Iterator[Pulls]:
    helper = Pulls(real_node_cluster)
    try:
        yield helper
    finally:
        helper.clean()


def policy(*, image_pull_timeout: float = 120.0) -> WaitPolicy:
    # A short grace: a pull that may pass must outlive it, bounded by image_pull_timeout instead.
    return WaitPolicy(poll_interval=1.0, pending_grace_seconds=5.0, image_pull_timeout=image_pull_timeout)


def assert_pulled_and_ran(decision: WaitDecision, lines: list[str]) -> None:
    """The pod's container ran to exit 0: its image was pulled. (The wait still fails the Pod: a plain ``python -c
    pass`` leaves no runner report.)"""
    assert decision.verdict is not None and decision.verdict.cause not in IMAGE_CAUSES, (decision, lines)
    assert [(p.exit_code, p.reason) for p in decision.pods] == [(0, "Completed")], (decision.pods, lines)


def test_a_missing_tag_fails_at_once_as_image_unavailable(pulls: Pulls) -> None:
    missing = registry.image_ref(pulls.cluster.layout, f"missing-{uuid.uuid4().hex[:8]}")
    decision, _ = pulls.wait(missing, policy())
    verdict = decision.verdict
    assert decision.phase is Phase.FAILED and verdict is not None
    assert (verdict.cause, verdict.recoverable) == (causes.IMAGE_UNAVAILABLE, False), verdict
    assert "not found" in verdict.detail and missing in verdict.detail, verdict.detail
    assert "for more than" not in verdict.detail, "not after the grace: at the first answer"


def test_a_tag_whose_first_pulls_are_throttled_is_pulled_after_the_back_off(pulls: Pulls) -> None:
    tag, ref = pulls.tag("429", pulls=2)
    decision, lines = pulls.wait(ref, policy())
    assert_pulled_and_ran(decision, lines)
    seen = registry.pulls(pulls.cluster.layout, tag)
    assert [r["fault"] for r in seen if r["pull"] <= 2] and {r["fault"] for r in seen if r["pull"] <= 2} == {"429"}
    assert max(r["pull"] for r in seen) == 3 and all(r["fault"] is None for r in seen if r["pull"] == 3), seen


def test_a_tag_that_stays_throttled_fails_recoverable_after_image_pull_timeout(pulls: Pulls) -> None:
    _, ref = pulls.tag("429", pulls=1000)
    decision, _ = pulls.wait(ref, policy(image_pull_timeout=20))
    verdict = decision.verdict
    assert decision.phase is Phase.FAILED and verdict is not None
    assert (verdict.cause, verdict.recoverable) == (causes.IMAGE_TRANSIENTLY_UNAVAILABLE, True), verdict
    assert "image_pull_timeout=20" in verdict.detail and "429 Too Many Requests" in verdict.detail, verdict.detail


def test_a_reset_connection_is_pulled_again(pulls: Pulls) -> None:
    tag, ref = pulls.tag("reset", pulls=1)
    decision, lines = pulls.wait(ref, policy())
    assert_pulled_and_ran(decision, lines)
    assert [r["pull"] for r in registry.pulls(pulls.cluster.layout, tag) if r["fault"] == "reset"], "reset once"

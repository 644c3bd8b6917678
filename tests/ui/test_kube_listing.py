"""What the plugin costs the API server, on the local cluster: one list per job kind and one pod list per namespace,
shared by every page view for LIST_TTL seconds; a job's pods found from the one pod list."""

from __future__ import annotations

import pytest

from airflow_provider_torchelastic.plugin import sources
from airflow_provider_torchelastic.plugin.sources import KubeJobs

pytestmark = pytest.mark.cluster


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_page_views_share_one_list_per_kind_and_namespace(kube_cluster, kubernetes_default_connection: str) -> None:
    clock = FakeClock()
    kube = KubeJobs(kubernetes_default_connection, clock=clock)
    namespace = kube_cluster.namespace
    kinds = len(sources._kinds())  # Pod and PyTorchJob: the pod list serves both
    for _ in range(5):  # five page views within the TTL
        kube.jobs(namespace)
    assert kube.calls == kinds
    clock.now += sources.LIST_TTL
    kube.jobs(namespace)
    assert kube.calls == 2 * kinds
    # A log read of a pod that does not exist costs one call, and says nothing rather than failing the page.
    assert kube.log_tail(namespace, "no-such-pod") == ""
    assert kube.log_tail(namespace, "no-such-pod") == ""
    assert kube.calls == 2 * kinds + 1

"""The worker's event-driven wait (``deferrable=False``, :mod:`airflow_provider_torchelastic.kubernetes.worker_wait`):
the shared watch's list+watch of one job in a private event loop, against the local cluster through the fault proxy.

Jobs here are held (tests/cluster/held_jobs.py): their pods run no process and end when a test releases them. The
poll interval is a minute, so a wait that sees the end within seconds saw it through the watch, not a poll.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.kubernetes.client import sync_kube_from_config
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitDecision, WaitPolicy
from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes, wait_watching
from tests.cluster.proxy import FaultProxy, Match
from tests.e2e.test_shared_watch import FALLBACK, Namespace, lists, single_gets, watches

pytestmark = [pytest.mark.cluster]

#: Far beyond what a test waits: an end seen sooner was seen through the watch.
POLL = 60.0
#: How soon the wait must see a released pod's end (the container's end, a status update, one watch event).
PROMPT = 5.0


@pytest.fixture
def namespace(kube_cluster: Any) -> Any:
    ns = Namespace(kube_cluster)
    yield ns
    ns.clean()


@pytest.fixture
def proxied(kube_cluster: Any, fault_proxy: FaultProxy, tmp_path: Path) -> Path:
    return kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "proxied.kubeconfig", namespace=None)


class Waiter:
    """``wait_watching`` in a thread of its own (it blocks, as in the worker), its log kept."""

    def __init__(self, ref: JobRef, kubeconfig: Path, *, poll_interval: float = POLL, **policy: Any) -> None:
        self.lines: list[str] = []
        self.decision: WaitDecision | None = None
        self.error: BaseException | None = None
        self.ended_at = 0.0
        polls = sync_kube_from_config(str(kubeconfig))
        self.deletes = BackgroundDeletes(polls, self.lines.append)

        @contextlib.asynccontextmanager
        async def open_client() -> AsyncIterator[Any]:
            from kubernetes_asyncio import config

            api = await config.new_client_from_config(config_file=str(kubeconfig))
            try:
                yield api
            finally:
                await api.close()

        flow = wait_for_job(ref, WaitPolicy(poll_interval=poll_interval, **policy))

        def run() -> None:
            try:
                self.decision = wait_watching(flow, ref, open_client, polls, self.lines.append, detach=self.deletes)
            except BaseException as e:
                self.error = e
            self.ended_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> WaitDecision:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the wait did not end within {timeout} s: {self.lines[-5:]}"
        assert self.error is None, self.error
        assert self.decision is not None
        return self.decision


def ended(decision: WaitDecision) -> bool:
    # A held pod succeeds without a rank-0 result, which the decision fails: what matters here is that it was seen.
    return decision.phase.is_terminal and "Succeeded" in decision.progress


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_sync_wait_sees_the_end_at_once_without_polling(
    namespace: Namespace, proxied: Path, fault_proxy: FaultProxy
) -> None:
    pod = namespace.pod("prompt")
    ref = JobRef(kind="Pod", name=pod, namespace=namespace.ns)
    until(lambda: namespace.running(pod), 30, "the pod to run")
    waiter = Waiter(ref, proxied, finish_action="keep")
    until(lambda: watches(fault_proxy, "pods") >= 1, 30, "the pod watch")
    time.sleep(0.5)
    released = time.monotonic()
    namespace.release(pod)
    decision = waiter.result(POLL / 2)
    assert ended(decision), decision
    assert waiter.ended_at - released < PROMPT, f"seen {waiter.ended_at - released:.1f} s after the release"
    # Watched, not polled: one list and one watch of this pod, no GET of it.
    assert (lists(fault_proxy, "pods"), watches(fault_proxy, "pods")) == (1, 1)
    assert single_gets(fault_proxy, [pod]) == 0


def test_a_cut_watch_resumes_and_a_410_relists(namespace: Namespace, proxied: Path, fault_proxy: FaultProxy) -> None:
    pod = namespace.pod("cut")
    ref = JobRef(kind="Pod", name=pod, namespace=namespace.ns)
    until(lambda: namespace.running(pod), 30, "the pod to run")
    pod_watch = Match(watch=True, path_endswith="/pods")
    fault_proxy.cut_watch_next(after_events=1, match=pod_watch)
    fault_proxy.expire_watch_next(match=pod_watch)
    waiter = Waiter(ref, proxied, finish_action="keep")
    until(lambda: watches(fault_proxy, "pods") >= 1, 30, "the pod watch")
    namespace.core.patch_namespaced_pod(pod, namespace.ns, {"metadata": {"labels": {"nudge": "1"}}})  # one event
    until(lambda: lists(fault_proxy, "pods") >= 2, 30, "a relist after the 410")
    until(lambda: watches(fault_proxy, "pods") >= 3, 30, "the watch after the relist")
    released = time.monotonic()
    namespace.release(pod)
    decision = waiter.result(POLL / 2)
    assert ended(decision), decision
    assert waiter.ended_at - released < PROMPT, f"seen {waiter.ended_at - released:.1f} s after the release"
    assert fault_proxy.pending_faults == 0
    assert not any(FALLBACK in line for line in waiter.lines), waiter.lines


def test_a_watch_refused_by_rbac_falls_back_to_polling(namespace: Namespace, kube_cluster: Any) -> None:
    """The Role as documented before the shared watch (no watch of pods): the wait polls, every poll_interval."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(namespace.api)
    ns = namespace.ns
    role = {
        "metadata": {"name": "ww-no-watch"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["delete"]},
        ],
    }
    binding = {
        "metadata": {"name": "ww-no-watch"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ww-no-watch"},
        "subjects": [{"kind": "ServiceAccount", "name": kube_cluster.sa_name, "namespace": ns}],
    }
    rbac.create_namespaced_role(ns, role)
    rbac.create_namespaced_role_binding(ns, binding)
    try:
        pod = namespace.pod("rbac")
        until(lambda: namespace.running(pod), 30, "the pod to run")
        waiter = Waiter(JobRef(kind="Pod", name=pod, namespace=ns), kube_cluster.sa_kubeconfig, poll_interval=1.0)
        until(lambda: any(FALLBACK in line for line in waiter.lines), 30, "the fall-back to polling")
        namespace.release(pod)
        decision = waiter.result(30)
    finally:
        rbac.delete_namespaced_role_binding("ww-no-watch", ns)
        rbac.delete_namespaced_role("ww-no-watch", ns)
    assert ended(decision), decision
    assert sum(FALLBACK in line for line in waiter.lines) == 1
    assert any("403" in line for line in waiter.lines), waiter.lines


#: A container that prints numbered lines over a few seconds (the simulated kubelet runs it on this machine).
PRINTER = "import time\nfor i in range({n}):\n    print(f'line {{i}}', flush=True)\n    time.sleep({pause})\n"


def printing_pod(namespace: Namespace, suffix: str, *, lines: int, pause: float) -> str:
    from tests.cluster import held_jobs

    name = f"{namespace.prefix}-{suffix}"
    body = held_jobs.held_pod(name, namespace.ns)
    body["metadata"]["annotations"] = {}  # not held: it runs its command, and ends when that ends
    body["spec"]["containers"][0]["command"] = ["python", "-c", PRINTER.format(n=lines, pause=pause)]
    namespace.core.create_namespaced_pod(namespace.ns, body)
    namespace.pods.append(name)
    return name


def log_requests(proxy: FaultProxy, pod: str) -> tuple[int, int]:
    """(log reads, log streams opened) of ``pod`` that the proxy saw."""
    logs = [r for r in proxy.requests if r.method == "GET" and r.path.endswith(f"/pods/{pod}/log")]
    followed = sum(1 for r in logs if "true" in r.query.get("follow", []))
    return len(logs) - followed, followed


def test_rank_0_log_is_followed_as_a_stream_reopened_from_its_last_line_when_cut(
    namespace: Namespace, proxied: Path, fault_proxy: FaultProxy
) -> None:
    """Every line once and in order, through a stream the proxy breaks off mid-way, in far fewer requests than a
    read per interval: the stream is opened again from the second before the last line printed, and the wait's
    cursor skips the lines that the new stream sends again."""
    count = 40
    pod = printing_pod(namespace, "follow", lines=count, pause=0.25)
    fault_proxy.cut_watch_next(after_bytes=600, match=Match(path_endswith=f"/{pod}/log", query=("follow", "true")))
    waiter = Waiter(JobRef(kind="Pod", name=pod, namespace=namespace.ns), proxied, poll_interval=1.0)
    decision = waiter.result(90)
    assert decision.phase.is_terminal and "Succeeded" in decision.progress, decision
    shown = [line.split("] ", 1)[1] for line in waiter.lines if line.startswith(f"[{pod}] line ")]
    assert shown == [f"line {i}" for i in range(count)], waiter.lines
    reads, streams = log_requests(fault_proxy, pod)
    # The cut took effect (a stream of the pod's log was broken off), and the follower opened another.
    assert fault_proxy.pending_faults == 0 and streams >= 2, (reads, streams)
    # About ten seconds of printing at a one-second pace: a read per interval would be about ten. Followed: the
    # first two reads (the tail, then the first paced one, which starts the stream) and the last one at the end.
    assert reads <= 4, (reads, streams, [r.query for r in fault_proxy.requests if r.path.endswith("/log")])

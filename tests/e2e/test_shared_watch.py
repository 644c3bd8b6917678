"""The shared watch through Airflow's own trigger runner (``TriggerRunner`` fed trigger rows, see tests/triggerer.py)
against the local cluster, through the fault proxy that counts requests and injects 410s, cut watches and stalls.

Jobs here are held (tests/cluster/held_jobs.py): their pods run no process and end when a test releases them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.triggers import EVENT_DONE, TorchElasticJobTrigger
from tests.cluster import held_jobs
from tests.cluster.proxy import FaultProxy, Match
from tests.triggerer import InProcessTriggerer

pytestmark = [pytest.mark.cluster]

FALLBACK = "polls the API on its own"


class Output:
    """What Airflow's logging printed so far (structlog writes the triggers' logs to stdout)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.seen = ""

    @property
    def text(self) -> str:
        self.seen += self.capsys.readouterr().out
        return self.seen


class Namespace:
    """Blocking admin calls: create held jobs, release them, clean up (the Kubernetes client, nothing of ours)."""

    def __init__(self, kube_cluster: Any) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(str(kube_cluster.kubeconfig))
        self.core, self.custom, self.rbac = client.CoreV1Api(api), client.CustomObjectsApi(api), None
        self.api = api
        self.ns = kube_cluster.namespace
        self.prefix = f"sw-{uuid.uuid4().hex[:6]}"
        self.pods: list[str] = []
        self.jobs: list[str] = []

    def pod(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        self.core.create_namespaced_pod(self.ns, held_jobs.held_pod(name, self.ns))
        self.pods.append(name)
        return name

    def pytorchjob(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        body = held_jobs.held_pytorchjob(name, self.ns)
        self.custom.create_namespaced_custom_object(held_jobs.GROUP, held_jobs.VERSION, self.ns, held_jobs.PLURAL, body)
        self.jobs.append(name)
        return name

    def release(self, pod: str, exit_code: int = 0) -> None:
        self.core.patch_namespaced_pod(pod, self.ns, held_jobs.release_patch(exit_code))

    def exists(self, pod: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_namespaced_pod(pod, self.ns)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def running(self, pod: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod(pod, self.ns).status.phase == "Running"
        except ApiException:
            return False

    def clean(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for name in self.jobs:
            with contextlib.suppress(ApiException):
                self.custom.delete_namespaced_custom_object(
                    held_jobs.GROUP, held_jobs.VERSION, self.ns, held_jobs.PLURAL, name
                )
        for name in self.pods:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)


@pytest.fixture
def namespace(kube_cluster: Any) -> Iterator[Namespace]:
    ns = Namespace(kube_cluster)
    yield ns
    ns.clean()


@pytest.fixture
def proxied(kube_cluster: Any, fault_proxy: FaultProxy, tmp_path: Path) -> Path:
    return kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "proxied.kubeconfig", namespace=None)


def trigger(kind: str, name: str, namespace: str, kubeconfig: Path, **extra: Any) -> TorchElasticJobTrigger:
    return TorchElasticJobTrigger(
        kind=kind,
        name=name,
        namespace=namespace,
        kubernetes_conn_id=None,
        connection_extras={"kube_config_path": str(kubeconfig)},
        poll_interval=2.0,
        finish_action="keep",
        **extra,
    )


def watches(proxy: FaultProxy, resource: str) -> int:
    return sum(1 for r in proxy.requests if r.watch and r.path.endswith(f"/{resource}"))


def lists(proxy: FaultProxy, resource: str) -> int:
    return sum(1 for r in proxy.requests if r.method == "GET" and not r.watch and r.path.endswith(f"/{resource}"))


def single_gets(proxy: FaultProxy, names: list[str]) -> int:
    return sum(1 for r in proxy.requests if r.method == "GET" and any(r.path.endswith(f"/{n}") for n in names))


def test_many_triggers_share_one_watch_joiners_and_leavers(
    namespace: Namespace, proxied: Path, fault_proxy: FaultProxy
) -> None:
    """Six triggers (a PyTorchJob among them) on one list+watch: three join late, one after its job already ended,
    and one is cancelled by a user mid-stream (on_kill deletes its job) while the others go on."""
    ns = namespace.ns
    early = [namespace.pod(f"early-{i}") for i in range(2)]
    job = namespace.pytorchjob("ptj")
    late = [namespace.pod(f"late-{i}") for i in range(2)]
    leaver = namespace.pod("leaver")

    async def scenario() -> None:
        t = InProcessTriggerer()
        try:
            ids = {name: t.add(trigger("Pod", name, ns, proxied)) for name in [*early, leaver]}
            ids[job] = t.add(trigger("PyTorchJob", job, ns, proxied))
            await t.run_until(
                lambda: lists(fault_proxy, "pods") >= 1 and watches(fault_proxy, "pods") >= 1, 30, "watch"
            )
            # A late joiner whose job already ended gets that state from the cache: the stream broadcasts only what
            # happens after it joined.
            namespace.release(late[0])
            await t.run_until(lambda: not namespace.running(late[0]), 30, "late-0 to end")
            await asyncio.sleep(1.5)
            ids.update({name: t.add(trigger("Pod", name, ns, proxied)) for name in late})
            await t.run_until(lambda: ids[late[0]] in t.events, 15, "the late joiner's event")
            assert t.event(ids[late[0]])["status"] == EVENT_DONE
            # A user marks one deferred task failed: on_kill deletes its job; the other triggers keep waiting.
            t.cancel(ids[leaver])
            await t.run_until(lambda: not namespace.exists(leaver), 30, "on_kill to delete the leaver's pod")
            assert ids[leaver] not in t.events
            await t.run_until(lambda: namespace.running(held_jobs.master_pod(job)), 60, "the PyTorchJob's pod")
            for pod in [*early, late[1], held_jobs.master_pod(job)]:
                namespace.release(pod)
            waiting = [ids[n] for n in [*early, late[1], job]]
            await t.run_until(lambda: all(i in t.events for i in waiting), 60, "every job's event")
            for i in waiting:
                assert t.event(i)["status"] == EVENT_DONE, t.event(i)
        finally:
            await t.close()

    asyncio.run(scenario())
    # One list+watch for all of them (relists only on 410, watches resumed only when the server ends one), and no
    # trigger read its job or pods on its own.
    assert lists(fault_proxy, "pods") == 1 and lists(fault_proxy, "pytorchjobs") == 1
    assert watches(fault_proxy, "pods") <= 2 and watches(fault_proxy, "pytorchjobs") <= 2
    assert single_gets(fault_proxy, [*early, job, late[1]]) == 0


def test_relist_after_410_and_resume_after_a_cut_watch(
    namespace: Namespace, proxied: Path, fault_proxy: FaultProxy
) -> None:
    ns = namespace.ns
    pods = [namespace.pod(f"w-{i}") for i in range(2)]

    async def scenario() -> None:
        t = InProcessTriggerer()
        try:
            # The first pod watch breaks after one event (a network failure): the stream resumes from the last
            # version; that watch is answered 410 Expired (the watch cache moved on): the stream lists again.
            pod_watch = Match(watch=True, path_endswith="/pods")
            fault_proxy.cut_watch_next(after_events=1, match=pod_watch)
            fault_proxy.expire_watch_next(match=pod_watch)
            ids = [t.add(trigger("Pod", name, ns, proxied)) for name in pods]
            await t.run_until(lambda: watches(fault_proxy, "pods") >= 1, 30, "the pod watch")
            namespace.release(pods[0])  # the one event the cut watch delivers
            await t.run_until(lambda: ids[0] in t.events, 30, "the first pod's event")
            await t.run_until(lambda: lists(fault_proxy, "pods") >= 2, 30, "a relist after 410")
            await t.run_until(lambda: watches(fault_proxy, "pods") >= 3, 30, "the watch after the relist")
            namespace.release(pods[1])  # seen through the watch that followed the relist
            await t.run_until(lambda: ids[1] in t.events, 30, "the second pod's event")
        finally:
            await t.close()

    asyncio.run(scenario())
    assert fault_proxy.pending_faults == 0


def test_a_trigger_in_a_slow_log_read_keeps_taking_its_updates_and_never_overflows(
    namespace: Namespace,
    proxied: Path,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A trigger stuck in a slow log read while other jobs change (each change an update to every trigger, with a
    queue of size 1 here) does not overflow: a task of its own takes its updates, so it stays on the stream and its
    job's end is seen there, without a read of its own. (A subscription that fails anyway falls back to polling,
    once: tests/unit/test_trigger_events.py.)"""
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_SUBSCRIBER_QUEUE_SIZE", "1")
    ns = namespace.ns
    pod = namespace.pod("slow")
    others = [namespace.pod(f"busy-{i}") for i in range(3)]
    caplog = Output(capsys)

    async def scenario() -> None:
        t = InProcessTriggerer()
        try:
            await t.run_until(lambda: all(namespace.running(p) for p in [pod, *others]), 30, "the pods to run")
            fault_proxy.stall_next(1, seconds=3.5, match=Match(path_contains="/log"))
            trigger_id = t.add(trigger("Pod", pod, ns, proxied))
            await t.run_until(lambda: fault_proxy.pending_faults == 0, 30, "the stalled log read")
            for other in others:  # updates while the trigger waits for its log
                namespace.release(other)
                await t.run_until(lambda o=other: not namespace.running(o), 30, f"{other} to end")
            namespace.release(pod)
            await t.run_until(lambda: trigger_id in t.events, 30, "the event")
            assert t.event(trigger_id)["status"] == EVENT_DONE
        finally:
            await t.close()

    asyncio.run(scenario())
    assert FALLBACK not in caplog.text and "Overflow" not in caplog.text, caplog.text[-2000:]
    assert single_gets(fault_proxy, [pod]) == 0


def test_an_identity_that_may_not_watch_falls_back_to_polling(
    namespace: Namespace, kube_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Role as documented before the shared watch (no list/watch of jobs, no watch of pods): the stream gets
    403 and every trigger polls on its own, saying so once."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(namespace.api)
    ns = namespace.ns
    role = {
        "metadata": {"name": "sw-no-watch"},
        "rules": [
            {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["create", "get", "delete"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        ],
    }
    binding = {
        "metadata": {"name": "sw-no-watch"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sw-no-watch"},
        "subjects": [{"kind": "ServiceAccount", "name": kube_cluster.sa_name, "namespace": ns}],
    }
    rbac.create_namespaced_role(ns, role)
    rbac.create_namespaced_role_binding(ns, binding)
    pods = [namespace.pod(f"rbac-{i}") for i in range(2)]
    caplog = Output(capsys)

    async def scenario() -> None:
        t = InProcessTriggerer()
        try:
            ids = [t.add(trigger("Pod", name, ns, kube_cluster.sa_kubeconfig)) for name in pods]
            await t.run_until(lambda: caplog.text.count(FALLBACK) >= 2, 30, "both triggers to fall back")
            for pod in pods:
                namespace.release(pod)
            await t.run_until(lambda: all(i in t.events for i in ids), 30, "both events")
            assert all(t.event(i)["status"] == EVENT_DONE for i in ids)
        finally:
            await t.close()

    try:
        asyncio.run(scenario())
    finally:
        rbac.delete_namespaced_role_binding("sw-no-watch", ns)
        rbac.delete_namespaced_role("sw-no-watch", ns)
    assert caplog.text.count(FALLBACK) == 2
    assert "403" in caplog.text

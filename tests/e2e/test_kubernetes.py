"""Kubernetes execution end to end, on the local test cluster (real kube-apiserver, simulated operator and kubelet).

DAG files under tests/dags (``k8s_e2e.py``) run through ``dag.test()``: the worker code, the trigger (run inline by
``dag.test()``), the Kubernetes clients and the cluster are all real. The only stand-ins are Airflow's own: the
``dag.test()`` harness, whose inline-trigger step some tests replace to play a triggerer that restarts or a user who
kills the deferred task, and the subprocess a test kills to play a worker that dies.

One cluster per session; every test leaves the namespace empty (``clean_namespace``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, TEST_DAGS
from tests.dag_support import SIM_IMAGE
from tests.e2e.test_local_execution import load_dag

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]

EXAMPLE_DAGS = REPO_ROOT / "example_dags"
LOCAL_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"
IMAGE = SIM_IMAGE
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
MANAGED = "app.kubernetes.io/managed-by=airflow-provider-torchelastic"
DAG_ID_LABEL = "torchelastic.airflow.apache.org/dag-id"


# --- running DAGs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DagRunResult:
    dag_id: str
    run_id: str
    state: str
    #: (task_id, map_index) -> (state, try_number)
    tasks: dict[tuple[str, int], tuple[str, int]]
    #: (task_id, map_index, key) -> value
    xcoms: dict[tuple[str, int, str], Any]

    def xcom(self, task_id: str = "train", key: str = "return_value", map_index: int = -1) -> Any:
        return self.xcoms[(task_id, map_index, key)]

    def identity(self, try_number: int = 1, task_id: str = "train"):
        from airflow_provider_torchelastic.core.naming import RunIdentity

        return RunIdentity(dag_id=self.dag_id, task_id=task_id, run_id=self.run_id, try_number=try_number)


def read_run(dag_id: str, run_id: str) -> DagRunResult:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        dag_run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).one()
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        ).all()
        rows = session.scalars(XComModel.get_many(run_id=run_id, dag_ids=dag_id)).all()
        return DagRunResult(
            dag_id=dag_id,
            run_id=run_id,
            state=str(dag_run.state),
            tasks={(ti.task_id, ti.map_index): (str(ti.state), ti.try_number) for ti in tis},
            xcoms={(row.task_id, row.map_index, row.key): XComModel.deserialize_value(row) for row in rows},
        )


def rendered_fields(dag_id: str, run_id: str, task_id: str = "train") -> dict[str, Any]:
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(
            select(RenderedTaskInstanceFields).where(
                RenderedTaskInstanceFields.dag_id == dag_id,
                RenderedTaskInstanceFields.run_id == run_id,
                RenderedTaskInstanceFields.task_id == task_id,
            )
        ).one()
        return dict(row.rendered_fields)


def run_dag(dag_id: str, folder: Path = TEST_DAGS) -> DagRunResult:
    dag_run = load_dag(dag_id, folder).test()
    return read_run(dag_id, dag_run.run_id)


#: The child runs dag.test() without importing tests.conftest, which would give it a fresh AIRFLOW_HOME (and database).
_CHILD = """
import sys
from airflow.dag_processing.dagbag import DagBag

bag = DagBag(dag_folder=sys.argv[1], safe_mode=False)
dag_run = bag.dags[sys.argv[2]].test()
print(f"CHILD-RESULT {dag_run.state}", flush=True)
"""


def start_dag_subprocess(dag_id: str, log_path: Path) -> subprocess.Popen:
    """``dag.test()`` in a child process (same AIRFLOW_HOME, database and connection env): a worker we can kill."""
    with log_path.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(TEST_DAGS), dag_id],
            cwd=REPO_ROOT,
            env=dict(os.environ),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


# --- the cluster, seen through the admin identity --------------------------------------------------------------------


class Cluster:
    """Blocking reads and clean-up through the admin kubeconfig (the Kubernetes client, nothing of ours)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.namespace = namespace

    def jobs(self, selector: str = "") -> list[dict[str, Any]]:
        doc = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, label_selector=selector)
        return list(doc.get("items", []))

    def pods(self, selector: str = "") -> list[Any]:
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def payloads(self, selector: str = MANAGED) -> list[Any]:
        """The provider's payload Secrets."""
        return list(self.core.list_namespaced_secret(self.namespace, label_selector=selector).items)

    def get_pod(self, name: str) -> Any | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_payload(self, name: str) -> Any | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_job(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def workloads(self, dag_id: str) -> tuple[list[dict[str, Any]], list[Any]]:
        """The PyTorchJobs and pods a DAG created (pods of a PyTorchJob carry the template's labels)."""
        selector = f"{MANAGED},{DAG_ID_LABEL}={dag_id}"
        return self.jobs(selector), self.pods(selector)

    def delete_everything(self) -> None:
        from kubernetes.client.exceptions import ApiException

        def quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, body={"propagationPolicy": "Background", **kwargs})
            except ApiException as e:
                if e.status != 404:
                    raise

        for job in self.jobs():
            quietly(
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                job["metadata"]["name"],
            )
        for pod in self.pods():
            # A test's leftovers, not a preemption: no grace period (the runner would give its workers most of the
            # pod's 120 s to save a checkpoint first).
            quietly(self.core.delete_namespaced_pod, pod.metadata.name, self.namespace, gracePeriodSeconds=0)
        for payload in self.payloads():
            quietly(self.core.delete_namespaced_secret, payload.metadata.name, self.namespace)

        def empty() -> bool:
            return not self.jobs() and not self.pods() and not self.payloads()

        try:
            wait_for(empty, 60, "namespace to empty")
        except AssertionError:
            # A real kubelet 1.20 can take minutes to finish deleting a pod that never started a container (stuck in
            # ImagePullBackOff or CreateContainerConfigError): it acts at its next back-off sync. Nothing of it runs,
            # so it is removed at once (grace period 0), as `kubectl delete --force` would; anything else left is an
            # error.
            for pod in self.pods():
                if pod.status.phase == "Pending":
                    try:
                        self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)
                    except ApiException as e:
                        if e.status != 404:
                            raise
            try:
                wait_for(empty, 30, "namespace to empty after the never-started pods were removed")
            except AssertionError as e:
                raise AssertionError(f"{e}; left: {self.leftovers()}") from None

    def leftovers(self) -> list[str]:
        """What is still in the namespace, and in what state (a pod's phase, whether it is being deleted)."""
        pods = [
            f"pod {p.metadata.name} ({p.status.phase}{', terminating' if p.metadata.deletion_timestamp else ''}"
            f"{', finalizers ' + str(p.metadata.finalizers) if p.metadata.finalizers else ''})"
            for p in self.pods()
        ]
        jobs = [f"job {j['metadata']['name']} (finalizers {j['metadata'].get('finalizers')})" for j in self.jobs()]
        return [*jobs, *pods, *(f"secret {s.metadata.name}" for s in self.payloads())]


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def training_container_status(pod: Any) -> Any:
    for status in pod.status.container_statuses or []:
        if status.name == "pytorch":
            return status
    raise AssertionError(f"pod {pod.metadata.name} has no pytorch container status")


# --- fixtures ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cluster(kube_cluster) -> Cluster:
    return Cluster(kube_cluster.kubeconfig, kube_cluster.namespace)


@pytest.fixture
def clean_namespace(cluster: Cluster) -> Iterator[None]:
    """Whatever a test leaves (kept failed jobs, a killed run's job) is deleted, and the pods' processes stopped."""
    yield
    cluster.delete_everything()


@pytest.fixture(autouse=True)
def connection(kubernetes_default_connection: str) -> str:
    return kubernetes_default_connection


@pytest.fixture(autouse=True)
def failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the DAGs' failure callbacks write the task's exception."""
    out = tmp_path / "failures"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(out))
    return out


def set_connection(monkeypatch: pytest.MonkeyPatch, kubeconfig: Path, namespace: str) -> None:
    from tests.cluster.pytest_plugin import airflow_connection_json

    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", airflow_connection_json(kubeconfig, namespace))


# --- (h)-(j): kills, restarts, crashes ------------------------------------------------------------------------------


def _replace_inline_trigger(monkeypatch: pytest.MonkeyPatch, play: Callable[[Any, Any, Callable], Any]) -> None:
    """Let ``play(trigger, ti, run_to_event)`` stand in for dag.test()'s inline triggerer."""
    import airflow.sdk.definitions.dag as dag_module

    original = dag_module._run_inline_trigger
    monkeypatch.setattr(dag_module, "_run_inline_trigger", lambda trigger, ti: play(trigger, ti, original))


def test_killed_deferred_task_deletes_its_job_from_the_trigger(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, failure_dir: Path
) -> None:
    from airflow.sdk.module_loading import import_string

    seen: dict[str, Any] = {}

    def kill_while_deferred(trigger: Any, ti: Any, run_to_event: Callable) -> Any:
        classpath, kwargs = trigger.serialize()
        name = kwargs["name"]
        wait_for(
            lambda: (pod := cluster.get_pod(name)) is not None and pod.status.phase == "Running", 60, "the pod to run"
        )
        # What the triggerer does on mark-failed / clear: a trigger rebuilt from its serialized form, then on_kill().
        asyncio.run(import_string(classpath)(**json.loads(json.dumps(kwargs))).on_kill())
        seen["name"] = name
        seen["gone"] = wait_for(lambda: cluster.get_pod(name) is None, 30, f"pod {name} to be deleted")
        return run_to_event(trigger, ti)  # the original trigger sees the job gone and fires

    _replace_inline_trigger(monkeypatch, kill_while_deferred)
    result = run_dag("k8s_killed_trigger")
    assert seen["gone"]
    assert result.state == "failed", result  # the job was deleted under it (retries=0)
    error = (failure_dir / "k8s_killed_trigger.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.InfrastructureError: "), error
    assert f"Pod {cluster.namespace}/{seen['name']} was deleted before it finished" in error, error
    assert cluster.workloads("k8s_killed_trigger") == ([], [])


def test_triggerer_restart_mid_job_resumes_the_same_job(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.module_loading import import_string

    seen: dict[str, Any] = {}

    def restart_mid_job(trigger: Any, ti: Any, run_to_event: Callable) -> Any:
        classpath, kwargs = trigger.serialize()
        name = kwargs["name"]

        async def first_life() -> None:
            events = trigger.run()
            waiting = asyncio.ensure_future(events.__anext__())
            await asyncio.sleep(4)
            assert not waiting.done(), "the job ended before the triggerer restarted: make it longer"
            waiting.cancel()  # the triggerer shuts down
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await trigger.cleanup()

        asyncio.run(first_life())
        pod = cluster.get_pod(name)
        assert pod is not None and pod.metadata.deletion_timestamp is None, "cleanup() must not touch the job"
        seen["uid"] = pod.metadata.uid
        seen["phase"] = pod.status.phase
        # A new triggerer rebuilds the trigger from what the database holds (JSON) and runs it to its event.
        return run_to_event(import_string(classpath)(**json.loads(json.dumps(kwargs))), ti)

    _replace_inline_trigger(monkeypatch, restart_mid_job)
    result = run_dag("k8s_triggerer_restart")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {"value": "survived a triggerer restart", "rank": 0}
    assert seen["phase"] in ("Pending", "Running")
    _, pods = cluster.workloads("k8s_triggerer_restart")  # on_finish_action="keep"
    assert [p.metadata.uid for p in pods] == [seen["uid"]], "exactly one job for the try"


def test_worker_crash_after_creation_reattaches_within_the_same_try(
    cluster: Cluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from airflow_provider_torchelastic.core.naming import label_selector

    dag_id = "k8s_worker_crash"
    proc = start_dag_subprocess(dag_id, tmp_path / "worker.log")
    try:
        pods = wait_for(lambda: cluster.workloads(dag_id)[1], 180, "the pod")
    finally:
        proc.kill()  # SIGKILL: nothing runs on the way out, like a lost node
        proc.wait(timeout=30)
    created = pods[0]
    # The same try runs again (what a re-queued task does after its worker died).
    with create_session() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).one()
        assert ti.try_number == 1 and str(ti.state) == "running", (ti.state, ti.try_number)
        session.expunge(ti)
    capfd.readouterr()
    _run_task(ti=ti, task=load_dag(dag_id).task_dict["train"], run_triggerer=True)
    assert f"Re-attaching to Pod {cluster.namespace}/{created.metadata.name}" in "".join(capfd.readouterr())
    result = read_run(dag_id, ti.run_id)
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {"value": "re-attached", "rank": 0}
    assert result.xcom(key="job_name") == created.metadata.name
    # Exactly one job for this try, the one the crashed worker created (on_finish_action="keep").
    same_try = cluster.pods(label_selector(result.identity()))
    assert [p.metadata.uid for p in same_try] == [created.metadata.uid]
    assert cluster.workloads(dag_id)[1][0].metadata.uid == created.metadata.uid


def test_a_job_that_ended_before_the_deferral_is_finished_in_the_worker_and_a_trigger_holds_an_early_event(
    cluster: Cluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 19, item 8: a trigger that fires before the scheduler processed the deferral can lose the try, so a
    job that has ended by the time the task would defer is decided in the worker, and a trigger holds an event
    that is ready within ``early_event_hold`` of the deferral."""

    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger

    dag_id = "k8s_ended_before_defer"
    proc = start_dag_subprocess(dag_id, tmp_path / "worker.log")
    try:
        pods = wait_for(lambda: cluster.workloads(dag_id)[1], 180, "the pod")
    finally:
        proc.kill()  # the worker dies right after creating the job
        proc.wait(timeout=30)
    name = pods[0].metadata.name
    wait_for(lambda: cluster.workloads(dag_id)[1][0].status.phase == "Succeeded", 120, "the pod to succeed")
    with create_session() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).one()
        session.expunge(ti)
    task = load_dag(dag_id).task_dict["train"]
    task.deferrable = True  # the same try again, on a worker that defers
    capfd.readouterr()
    _run_task(ti=ti, task=task, run_triggerer=True)
    out = "".join(capfd.readouterr())
    assert f"Pod {cluster.namespace}/{name} had ended before the task deferred: finished here" in out
    assert "Deferring" not in out
    result = read_run(dag_id, ti.run_id)
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {"value": "ended before the deferral", "rank": 0}

    # A trigger of a job that ended already (the same, kept) holds its event until early_event_hold has passed.
    hold = 3.0
    trigger = TorchElasticJobTrigger(
        kind="Pod",
        name=name,
        namespace=cluster.namespace,
        kubernetes_conn_id="kubernetes_default",
        finish_action="keep",
        deferred_at=time.time(),
        early_event_hold=hold,
    )

    async def first_event() -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        async for event in trigger.run():
            return dict(event.payload), time.monotonic() - started
        raise AssertionError("no event")

    capfd.readouterr()
    payload, waited = asyncio.run(first_event())
    assert payload["status"] == "done" and payload["phase"] == "succeeded", payload
    assert waited >= hold - 0.5, f"the event came {waited:.1f} s after the deferral, before the {hold} s hold"
    assert "holding the event" in "".join(capfd.readouterr())


def test_the_next_try_deletes_the_job_that_a_killed_worker_left_running(
    cluster: Cluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 19, item 7: a worker killed with -9 while it waits leaves try 1's job running (nothing of the try is
    left to stop it); the next try of the task instance, which finds try 1's record in the task state store, deletes
    it before it creates its own."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_id = "k8s_worker_lost"
    proc = start_dag_subprocess(dag_id, tmp_path / "worker.log")
    try:
        wait_for(
            lambda: (pods := cluster.workloads(dag_id)[1]) and pods[0].status.phase == "Running", 180, "try 1's pod"
        )
    finally:
        proc.kill()  # SIGKILL: the worker cannot delete its job on the way out
        proc.wait(timeout=30)
    first = cluster.workloads(dag_id)[1][0]
    time.sleep(2)
    assert cluster.get_pod(first.metadata.name) is not None, "try 1's job outlives its worker"
    # What the scheduler does once it finds the worker gone: the task instance gets its next try.
    with create_session() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).one()
        ti.try_number, ti.state = 2, "scheduled"
        session.commit()
        session.refresh(ti)
        session.expunge(ti)
    capfd.readouterr()
    _run_task(ti=ti, task=load_dag(dag_id).task_dict["train"], run_triggerer=True)
    out = "".join(capfd.readouterr())
    assert f"Pod {cluster.namespace}/{first.metadata.name} of try 1 is still running, but its try is over" in out
    result = read_run(dag_id, ti.run_id)
    assert result.tasks == {("train", -1): ("success", 2)}
    assert result.xcom() == {"value": "try 2", "rank": 0}
    wait_for(lambda: cluster.get_pod(first.metadata.name) is None, 60, "try 1's pod to be deleted")


def _sleeping_pod(name: str, labels: dict[str, str], *, done: bool = False) -> dict[str, Any]:
    command = ["python", "-c", "pass" if done else "import time; time.sleep(600)"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "pytorch", "image": "x:1", "command": command}]},
    }


def test_jobs_running_past_their_tasks_deadline_are_swept_by_the_next_submission_and_the_command_line(
    cluster: Cluster, kube_cluster, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 19, item 7: the backstop for a job whose task instance is over without anyone left to delete it (a
    deferred try marked failed before a triggerer picked it up, say). Decided from the job alone: the next task that
    submits in the namespace deletes it, and so does the command line, which needs no Airflow process."""
    from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
    from airflow_provider_torchelastic.kubernetes.sweep import GRACE_SECONDS, NOT_AFTER_LABEL

    managed = {LABEL_MANAGED_BY: MANAGED_BY}
    long_ago = str(int(time.time() - GRACE_SECONDS - 600))
    soon = str(int(time.time() + 3600))
    pods = {
        "overdue": _sleeping_pod("overdue", {**managed, NOT_AFTER_LABEL: long_ago}),
        "within": _sleeping_pod("within", {**managed, NOT_AFTER_LABEL: soon}),
        "finished": _sleeping_pod("finished", {**managed, NOT_AFTER_LABEL: long_ago}, done=True),
        "not-ours": _sleeping_pod("not-ours", {NOT_AFTER_LABEL: long_ago}),
    }
    for pod in pods.values():
        cluster.core.create_namespaced_pod(cluster.namespace, pod)
    wait_for(lambda: (pod := cluster.get_pod("finished")) and pod.status.phase == "Succeeded", 120, "a finished pod")
    capfd.readouterr()
    result = run_dag("k8s_minimal")
    assert result.state == "success", result
    out = "".join(capfd.readouterr())
    assert f"Pod {cluster.namespace}/overdue is still running" in out and "past its task's deadline" in out, out
    wait_for(lambda: cluster.get_pod("overdue") is None, 60, "the overdue pod to be deleted")
    assert all(cluster.get_pod(name) is not None for name in ("within", "finished", "not-ours"))

    # The command line, as a CronJob would run it: in a process that imports no Airflow.
    cluster.core.create_namespaced_pod(cluster.namespace, _sleeping_pod("late", {**managed, NOT_AFTER_LABEL: long_ago}))
    check = (
        "import sys\n"
        "from airflow_provider_torchelastic.kubernetes import sweep\n"
        "code = sweep.main(sys.argv[1:])\n"
        "assert not [m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')], 'imported Airflow'\n"
        "sys.exit(code)\n"
    )
    argv = [sys.executable, "-c", check, "--kubeconfig", str(kube_cluster.kubeconfig), "--namespace", cluster.namespace]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Pod {cluster.namespace}/late is still running" in done.stdout and "1 job(s) deleted" in done.stdout
    wait_for(lambda: cluster.get_pod("late") is None, 60, "the late pod to be deleted")
    assert all(cluster.get_pod(name) is not None for name in ("within", "finished", "not-ours"))


def _for_seconds(flow: Any, seconds: float) -> Any:
    """``flow`` (a wait) until ``seconds`` have passed: it is then closed at its next pause."""
    from airflow_provider_torchelastic.kubernetes.requests import Sleep

    until, answer = time.monotonic() + seconds, None
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Sleep) and time.monotonic() >= until:
            flow.close()
            return None
        answer = yield request


def test_the_waiter_renews_the_lease_of_a_job_without_a_deadline_with_the_documented_role(
    cluster: Cluster, kube_cluster, deploy_rbac
) -> None:
    """Issue 19, item 7, for a task without ``execution_timeout``: its job's not-after label is a lease, which the
    worker's wait and the trigger's move forward while they wait (and the sweep deletes a job whose lease ran out:
    its waiter is gone). With deploy/rbac.yaml's Role, for a PyTorchJob (queued, on the worker's driver) and a Pod
    (running, on the trigger's), against the API server."""
    from kubernetes import config as sync_config
    from kubernetes_asyncio import config as async_config

    from airflow_provider_torchelastic.kubernetes import sweep
    from airflow_provider_torchelastic.kubernetes.client import AsyncKube, SyncKube
    from airflow_provider_torchelastic.kubernetes.wait import drive_async, drive_sync, wait_for_job
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitPolicy
    from tests.cluster import held_jobs

    lease, ns, sa = 2.0, cluster.namespace, str(kube_cluster.sa_kubeconfig)
    policy = WaitPolicy(poll_interval=0.3, lease_seconds=lease)
    lines: list[str] = []

    def leased(obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["labels"].update(sweep.lease_labels(time.time() + lease))
        return obj

    started = time.time()
    body = leased(held_jobs.held_pytorchjob("leased-job", ns, suspended=True))
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    job = JobRef(kind="PyTorchJob", name="leased-job", namespace=ns)
    drive_sync(
        _for_seconds(wait_for_job(job, policy), 5), SyncKube(sync_config.new_client_from_config(sa)), lines.append
    )
    labels = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "leased-job")["metadata"]["labels"]
    assert float(labels[sweep.NOT_AFTER_LABEL]) >= started + 5, (labels, lines)

    started = time.time()
    cluster.core.create_namespaced_pod(ns, leased(held_jobs.held_pod("leased-pod", ns)))

    async def wait_as_the_trigger() -> None:
        api = await async_config.new_client_from_config(sa)
        try:
            flow = _for_seconds(wait_for_job(JobRef(kind="Pod", name="leased-pod", namespace=ns), policy), 5)
            await drive_async(flow, AsyncKube(api), lines.append)
        finally:
            await api.close()

    asyncio.run(wait_as_the_trigger())
    pod = cluster.get_pod("leased-pod")
    assert float(pod.metadata.labels[sweep.NOT_AFTER_LABEL]) >= started + 5, (pod.metadata.labels, lines)
    assert not [line for line in lines if "Could not renew" in line], lines
    # Nobody waits any more: the lease stays where the waiter left it, for the sweep to act on once it ran out.


# --- RBAC and API faults ---------------------------------------------------------------------------------------------


def _sa_can_get_pods(cluster: Cluster, kubeconfig: Path) -> bool:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
    try:
        api.read_namespaced_pod("no-such-pod", cluster.namespace)
    except ApiException as e:
        if e.status in (403, 404):
            return e.status == 404
        raise
    return True


@pytest.fixture
def deploy_rbac(cluster: Cluster, kube_cluster) -> Iterator[Callable[[bool], None]]:
    """deploy/rbac.yaml in the test namespace; call with ``binding=False`` to drop the RoleBinding again."""
    import yaml

    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text())}
    assert set(docs) == {"Role", "RoleBinding"}
    ns = cluster.namespace
    cluster.rbac.create_namespaced_role(ns, docs["Role"])
    cluster.rbac.create_namespaced_role_binding(ns, docs["RoleBinding"])
    wait_for(lambda: _sa_can_get_pods(cluster, kube_cluster.sa_kubeconfig), 10, "the RoleBinding to take effect")

    def set_binding(binding: bool) -> None:
        if not binding:
            cluster.rbac.delete_namespaced_role_binding(docs["RoleBinding"]["metadata"]["name"], ns)
            wait_for(lambda: not _sa_can_get_pods(cluster, kube_cluster.sa_kubeconfig), 10, "the binding to go")

    yield set_binding
    from kubernetes.client.exceptions import ApiException

    for delete, kind in (
        (cluster.rbac.delete_namespaced_role_binding, "RoleBinding"),
        (cluster.rbac.delete_namespaced_role, "Role"),
    ):
        with contextlib.suppress(ApiException):
            delete(docs[kind]["metadata"]["name"], ns)


def test_minimal_rbac_is_enough(kube_cluster, deploy_rbac, monkeypatch: pytest.MonkeyPatch) -> None:
    set_connection(monkeypatch, kube_cluster.sa_kubeconfig, kube_cluster.namespace)
    result = run_dag("k8s_minimal")
    assert result.state == "success", result
    assert result.xcom() == {"value": "ok", "rank": 0}


def test_without_the_role_binding_the_task_fails_forbidden(
    kube_cluster, deploy_rbac, monkeypatch: pytest.MonkeyPatch, failure_dir: Path
) -> None:
    deploy_rbac(False)
    set_connection(monkeypatch, kube_cluster.sa_kubeconfig, kube_cluster.namespace)
    result = run_dag("k8s_minimal")
    assert result.state == "failed", result
    error = (failure_dir / "k8s_minimal.train.try1.txt").read_text()
    assert "403" in error and "Forbidden" in error, error
    assert "airflow-torchelastic" in error, error  # the API server names the identity that was refused


@pytest.mark.parametrize("dag_id", ["k8s_minimal", "k8s_minimal_deferred"], ids=["worker", "trigger"])
def test_recoverable_api_errors_while_polling_are_retried(
    dag_id: str, cluster: Cluster, kube_cluster, fault_proxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.cluster.proxy import Match

    kubeconfig = kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "proxied.kubeconfig")
    set_connection(monkeypatch, kubeconfig, kube_cluster.namespace)
    injected: dict[str, str] = {}

    def inject_when_running() -> None:
        def running_pod() -> Any:
            pods = cluster.workloads(dag_id)[1]
            return pods[0] if pods and pods[0].status.phase == "Running" else None

        name = wait_for(running_pod, 90, "the pod to run").metadata.name
        injected["name"] = name
        # The next GETs of the pod (the operator's polls): a burst of overload answers.
        match = Match(method="GET", path_contains=f"/pods/{name}")
        fault_proxy.fail_next(2, status=503, match=match)
        fault_proxy.fail_next(2, status=429, retry_after=1, match=match)

    injector = threading.Thread(target=inject_when_running, daemon=True)
    injector.start()
    started = time.monotonic()
    result = run_dag(dag_id)
    elapsed = time.monotonic() - started
    injector.join(timeout=5)
    assert result.state == "success", result
    assert result.xcom() == {"value": "ok", "rank": 0}
    faulted = [r for r in fault_proxy.requests if r.fault == "status"]
    assert len(faulted) == 4, fault_proxy.requests
    polls = [r for r in faulted if r.path.endswith(f"/pods/{injected['name']}")]
    assert polls, "the faults must have hit the operator's status polls"
    assert fault_proxy.pending_faults == 0
    print(f"{dag_id}: run with 4 injected API errors took {elapsed:.1f} s")


# --- the API refuses, or cannot be read ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (401, "Unauthorized"),
        (403, "lacks permission"),
        (404, "is the Kubeflow training operator (its PyTorchJob CRD, kubeflow.org/v1) installed"),
        (422, "rejected the object"),
    ],
)
def test_a_refused_submission_fails_at_once_without_retries(
    status: int,
    words: str,
    cluster: Cluster,
    kube_cluster,
    fault_proxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    failure_dir: Path,
) -> None:
    from tests.cluster.proxy import Match

    set_connection(
        monkeypatch, kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "p.kubeconfig"), cluster.namespace
    )
    fault_proxy.fail_next(1, status=status, match=Match(method="POST", path_contains="/pytorchjobs"))
    result = run_dag("k8s_submit_refused")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "a refusal is not worth a retry"
    error = (failure_dir / "k8s_submit_refused.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.ConfigurationError: Cannot create PyTorchJob"), (
        error
    )
    assert str(status) in error and words in error and "a retry will not help" in error, error
    # Nothing is left behind: the payload Secret created before the refusal is deleted too.
    assert cluster.payloads() == [] and cluster.workloads("k8s_submit_refused") == ([], [])


@pytest.mark.parametrize("dag_id", ["k8s_minimal", "k8s_minimal_deferred"], ids=["worker", "trigger"])
def test_a_wait_that_cannot_read_the_job_deletes_it(
    dag_id: str,
    cluster: Cluster,
    kube_cluster,
    fault_proxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    failure_dir: Path,
) -> None:
    from tests.cluster.proxy import Match

    set_connection(
        monkeypatch, kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "p.kubeconfig"), cluster.namespace
    )

    def refuse_reads_when_running() -> None:
        pods = wait_for(
            lambda: [p for p in cluster.workloads(dag_id)[1] if p.status.phase == "Running"], 90, "the pod to run"
        )
        # The next read of the pod (not of its log, which is best effort) is refused: the wait cannot go on.
        match = Match(method="GET", path_endswith=f"/pods/{pods[0].metadata.name}")
        fault_proxy.fail_next(1, status=403, match=match)

    injector = threading.Thread(target=refuse_reads_when_running, daemon=True)
    injector.start()
    result = run_dag(dag_id)
    injector.join(timeout=5)
    assert result.state == "failed", result
    error = (failure_dir / f"{dag_id}.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.InfrastructureError: "), error
    assert "403 Forbidden" in error and "the job was deleted" in error, error
    wait_for(lambda: cluster.workloads(dag_id) == ([], []), 30, "the job to be deleted")
    assert cluster.payloads() == []

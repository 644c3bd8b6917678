"""The UI plugin's pure parts: rows from live objects (as rendered by the provider) and from summaries, one list
from both, the DAG-level filter through a real auth manager, and the light import of the plugin module."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from airflow_provider_torchelastic import Elastic
from airflow_provider_torchelastic.core.metrics_format import MetricSeries, MetricsLine
from airflow_provider_torchelastic.core.summary import JobSummary, PodSummary
from airflow_provider_torchelastic.plugin import views
from airflow_provider_torchelastic.plugin.service import RunningMetrics, readable_log
from tests.contract.builders import render, workload

NOW = 1_800_000_000.0
CREATED = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 3600))


def _live_pytorchjob(*, failed_rank1: bool = False, **identity: Any) -> views.LiveJob:
    """A rendered 2-node elastic PyTorchJob as the API returns it running, with its two pods."""
    job = workload(render(Elastic(nnodes="2:2", nproc_per_node=1), **identity))
    job["metadata"]["creationTimestamp"] = CREATED
    job["metadata"]["uid"] = "uid-of-the-job"
    controller = {"kind": "PyTorchJob", "name": job["metadata"]["name"], "uid": "uid-of-the-job", "controller": True}
    job["status"] = {"conditions": [{"type": "Running", "status": "True", "lastTransitionTime": CREATED}]}
    name = job["metadata"]["name"]
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pods = []
    for index in range(2):
        running = {"phase": "Running", "containerStatuses": [{"name": "pytorch", "state": {"running": {}}}]}
        if failed_rank1 and index == 1:
            terminated = {"exitCode": 1, "reason": "Error"}
            running = {
                "phase": "Failed",
                "containerStatuses": [{"name": "pytorch", "state": {"terminated": terminated}}],
            }
        labels = {
            **template["metadata"]["labels"],
            "training.kubeflow.org/job-name": name,
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": str(index),
        }
        meta = {"name": f"{name}-worker-{index}", "namespace": "ml", "labels": labels, "ownerReferences": [controller]}
        pod = {"metadata": meta, "status": running}
        pods.append({**pod, "spec": {"nodeName": f"node-{index}", "containers": template["spec"]["containers"]}})
    [grouped] = views.group_live_jobs({"PyTorchJob": [job], "Pod": []}, [*reversed(pods), _stranger_pod()])
    return grouped


def _stranger_pod() -> dict[str, Any]:
    return {"metadata": {"name": "other-worker-0", "labels": {"training.kubeflow.org/job-name": "other"}}}


def test_a_live_job_reads_as_the_task_decides_with_its_identity_from_annotations() -> None:
    run_id = "manual__2027-01-15T08:00:00+00:00"  # '+' and ':' are not label-safe: the annotation has it whole
    job = _live_pytorchjob(run_id=run_id, map_index=3, try_number=2)
    assert [p["metadata"]["name"][-8:] for p in job.pods] == ["worker-0", "worker-1"]
    row = views.job_row_from_live(job, now=NOW)
    assert row is not None
    assert {k: row[k] for k in ("dag_id", "task_id", "run_id", "map_index", "try_number", "kind", "phase")} == {
        "dag_id": "nightly_training",
        "task_id": "train",
        "run_id": run_id,
        "map_index": 3,
        "try_number": 2,
        "kind": "PyTorchJob",
        "phase": "running",
    }
    assert (row["pods_running"], row["pods_total"], row["elapsed_seconds"]) == (2, 2, 3600.0)
    assert row["ti_url"] == "/dags/nightly_training/runs/manual__2027-01-15T08%3A00%3A00%2B00%3A00/tasks/train/mapped/3"


def test_a_live_job_detail_has_its_pods_log_tails_and_metrics() -> None:
    job = _live_pytorchjob(failed_rank1=True)
    tails = {job.pods[1]["metadata"]["name"]: "Traceback ...\nFloatingPointError: nan"}
    detail = views.job_detail_from_live(job, now=NOW, log_tails=tails, metrics={"loss": [[1, 2.0], [2, 1.5]]})
    assert detail is not None
    assert [(p["replica_type"], p["replica_index"], p["phase"], p["node"]) for p in detail["pods"]] == [
        ("worker", 0, "Running", "node-0"),
        ("worker", 1, "Failed", "node-1"),
    ]
    assert detail["pods"][1]["exit_code"] == 1 and "FloatingPointError" in detail["pods"][1]["log_tail"]
    assert detail["metrics"] == {"loss": [[1, 2.0], [2, 1.5]]} and detail["last_metrics"] == {"loss": 1.5}


def _summary(name: str, phase: str = "failed", created: float = NOW) -> dict[str, Any]:
    summary = JobSummary(
        kind="PyTorchJob",
        namespace="ml",
        name=name,
        phase=phase,
        created=created,
        finished=created + 90,
        root_cause="rank 1 raised FloatingPointError: nan" if phase == "failed" else None,
        pods=(PodSummary(name=f"{name}-worker-0", replica_type="worker", replica_index=0, phase="Failed"),),
        metrics={"loss": tuple((float(s), 1.0 / s) for s in range(1, 201))},
        last_metrics={"loss": 1.0 / 200},
    )
    return summary.to_dict()


def test_a_summary_row_and_detail_come_from_the_xcom_value_as_stored() -> None:
    identity = views.Identity(dag_id="d", task_id="t", run_id="r", try_number=1)
    stored = _summary("job-a")
    for value in (stored, JobSummary.from_json(stored).to_json()):  # a decoded XCom or its JSON text
        summary = views.summary_from_xcom(value)
        assert summary is not None
        row = views.job_row_from_summary(summary, identity)
        assert (row["phase"], row["pods_running"], row["pods_total"], row["elapsed_seconds"]) == ("failed", 0, 1, 90)
        assert row["root_cause"] == "rank 1 raised FloatingPointError: nan"
        # The list's sparkline is small whatever the series; the detail has the series whole.
        assert len(row["sparkline"]["points"]) == views.SPARKLINE_POINTS
        assert row["sparkline"]["points"][-1] == [200, 1.0 / 200]
        assert len(views.job_detail_from_summary(summary, identity)["metrics"]["loss"]) == 200
    assert views.summary_from_xcom({"version": 99, "name": "x"}) is None
    assert views.summary_from_xcom("not json") is None


@pytest.mark.parametrize(
    ("names", "shown"),
    [
        (["epoch", "loss", "learning_rate"], "loss"),  # the HF Trainer's
        (["epoch", "train_loss"], "train_loss"),  # Lightning's: not epoch, the first by name
        (["accuracy", "train/loss", "val/loss"], "train/loss"),
        (["accuracy", "lr"], "accuracy"),
    ],
)
def test_the_lists_sparkline_shows_a_frameworks_loss(names: list[str], shown: str) -> None:
    line = views.sparkline({name: [[0, 1.0], [1, 0.5]] for name in names})
    assert line is not None and line["metric"] == shown


def test_a_stalled_trys_forensics_location_reaches_the_job_tab() -> None:
    identity = views.Identity(dag_id="d", task_id="t", run_id="r", try_number=1)
    cause = "rank 1 failed with TrainingStalled: …; stacks and traces kept at s3://b/ckpt/forensics/try-1/pod-0"
    summary = views.summary_from_xcom({**_summary("job-a"), "root_cause": cause})
    assert summary is not None
    assert views.job_detail_from_summary(summary, identity)["forensics"] == "s3://b/ckpt/forensics/try-1/pod-0"
    plain = views.summary_from_xcom(_summary("job-b")) or {}
    assert views.job_detail_from_summary(plain, identity)["forensics"] is None


def test_local_runs_get_a_namespace_that_is_no_kubernetes_namespace() -> None:
    local = {**_summary("local-run"), "kind": "local", "namespace": None}
    row = views.job_row_from_summary(local, views.Identity(dag_id="d", task_id="t", run_id="r"))
    assert row["namespace"] == views.LOCAL_NAMESPACE == "_local"


def _row(name: str, dag_id: str, phase: str, created: float, source: str) -> dict[str, Any]:
    return {"namespace": "ml", "name": name, "dag_id": dag_id, "phase": phase, "created": created, "source": source}


def test_one_list_newest_first_a_summary_replacing_its_live_job_then_filtered_and_paged() -> None:
    live = [_row("a", "d1", "running", 3, "kubernetes"), _row("b", "d1", "failed", 2, "kubernetes")]
    finished = [_row("b", "d1", "failed", 2, "summary"), _row("c", "d2", "succeeded", 1, "summary")]
    rows = views.merge_rows(live, finished)
    assert [(r["name"], r["source"]) for r in rows] == [("a", "kubernetes"), ("b", "summary"), ("c", "summary")]
    assert [r["name"] for r in views.merge_rows(live, finished, phase="failed")] == ["b"]
    assert [r["name"] for r in views.merge_rows(live, finished, offset=1, limit=1)] == ["b"]


def _simple_auth_manager(readable: set[str]) -> Any:
    """Airflow's SimpleAuthManager with a per-DAG rule, as FAB or Keycloak managers have (the simple one has none)."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    class PerDagAuthManager(SimpleAuthManager):
        def is_authorized_dag(self, *, method: str, user: Any, access_entity: Any = None, details: Any = None) -> bool:
            return method == "GET" and details is not None and details.id in readable

    return PerDagAuthManager()


def test_a_user_sees_only_jobs_of_dags_they_may_read() -> None:
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from airflow_provider_torchelastic.plugin import access

    manager = _simple_auth_manager({"d1"})
    user = SimpleAuthManagerUser(username="viewer", role="viewer")

    def no_teams(dag_ids: Any) -> dict[str, str | None]:  # what the database says without [core] multi_team
        return {}

    assert access.readable_dag_ids({"d1", "d2", "d3"}, user, manager, no_teams) == {"d1"}
    assert access.can_read_dag("d1", user, manager, no_teams) and not access.can_read_dag("d2", user, manager, no_teams)


def _metrics_line(step: int) -> str:
    return MetricsLine(step=float(step), last={"loss": 1 / step}, points={"loss": ((float(step), 1 / step),)}).to_text()


def test_running_metrics_take_each_line_once_across_overlapping_log_tails() -> None:
    running = RunningMetrics()
    key = ("ml", "job")
    first = "\n".join(f"[rank0]:{_metrics_line(s)}" for s in (1, 2, 3))
    running.feed(key, first)
    series = running.feed(key, first + "\n" + _metrics_line(4))  # the next read overlaps the previous one
    assert isinstance(series, MetricSeries)
    assert [step for step, _ in series.points("loss")] == [1, 2, 3, 4]
    assert readable_log(f"hello\n{_metrics_line(4)}") == "hello\nmetrics: step 4 loss=0.25"


def test_importing_the_plugin_imports_neither_torch_nor_the_kubernetes_client() -> None:
    code = (
        "import sys; import airflow_provider_torchelastic.plugin as p; "
        "assert p.TorchElasticPlugin.name == 'torch_elastic'; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kubernetes', 'kubernetes_asyncio')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_live_job_that_kubernetes_cannot_give_is_an_unavailable_error_not_a_crash() -> None:
    """The detail view of a job without a summary needs the cluster: when it cannot be read, the API says 503 and
    why (here the UI's connection does not exist), instead of a bare 500."""
    from airflow_provider_torchelastic.plugin.service import JobsService, KubernetesUnavailable
    from airflow_provider_torchelastic.plugin.sources import KubeJobs
    from tests.unit.test_ui_hardening import FakeSummaries, FakeViewer

    service = JobsService(KubeJobs("torch_elastic_no_such_connection"), FakeSummaries())  # type: ignore[arg-type]
    with pytest.raises(KubernetesUnavailable, match="torch_elastic_no_such_connection"):
        service.job("ml", "some-job", FakeViewer({"d"}))


# --- the pages' Kubernetes reads go through the provider's one client ----------------------------------------------


def _ui_connection(monkeypatch: pytest.MonkeyPatch, kubeconfig: Any, namespace: str = "ml") -> str:
    import json

    conn_id = "torch_elastic_ui_fake_api"
    extra = {"kube_config_path": str(kubeconfig), "namespace": namespace}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "kubernetes", "extra": extra}))
    return conn_id


def test_the_pages_list_jobs_and_read_log_tails_through_the_providers_client(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pod list and one list per kind (the managed-by label), a log tail bounded in lines and bytes and without
    timestamps, and a kind whose API is not served (404, the API server's plain-text answer) listing no jobs."""
    from airflow_provider_torchelastic.plugin import sources
    from airflow_provider_torchelastic.plugin.sources import KubeJobs
    from tests.unit.fake_kube_api import Answer, fake_api, items

    live = _live_pytorchjob()
    pods_path, jobs_path = "/api/v1/namespaces/ml/pods", "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs"
    pod = live.pods[0]["metadata"]["name"]

    def answer(method: str, path: str, query: Any) -> Answer:
        if path == pods_path:
            return items(*live.pods)
        if path == jobs_path:
            return items(live.obj)
        if path == f"{pods_path}/{pod}/log":
            return Answer(200, b"[rank0]:hello\n", {"Content-Type": "text/plain"})
        return Answer(404, b"404 page not found\n", {"Content-Type": "text/plain"})

    with fake_api(answer) as api:
        kube = KubeJobs(_ui_connection(monkeypatch, api.kubeconfig(tmp_path)))
        assert kube.default_namespace == "ml"
        [job] = kube.jobs("ml")
        assert (job.kind, job.name, len(job.pods)) == ("PyTorchJob", live.name, 2)
        assert kube.calls == len(sources._kinds())
        assert kube.log_tail("ml", pod) == "[rank0]:hello\n"
        assert kube.log_tail("ml", "gone") == ""  # a 404: no log yet, not a failed page
    selector = {"labelSelector": "app.kubernetes.io/managed-by=airflow-provider-torchelastic"}
    lists = [request for request in api.requests if not request.path.endswith("/log")]
    assert {request.path for request in lists} >= {pods_path, jobs_path}
    assert all(request.query == selector for request in lists), lists
    [log] = [request for request in api.requests if request.path == f"{pods_path}/{pod}/log"]
    assert log.query == {
        "container": "pytorch",
        "tailLines": str(sources.PAGE_LOG_LINES),
        "limitBytes": str(sources.PAGE_LOG_BYTES),
    }


def test_a_trainjob_lists_with_the_pods_its_jobset_and_jobs_lead_to_and_a_kind_the_role_may_not_list_is_skipped(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrainJob's pods are its own through its JobSet and Jobs (listed for it, by field and by label), its log
    tails come from the ``node`` container, and a 403 on another custom kind (a Role from before it) hides none."""
    from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
    from airflow_provider_torchelastic.plugin.sources import KubeJobs
    from tests.unit.fake_kube_api import Answer, fake_api, items

    name = "train-abc"

    def owned(kind: str, uid: str, owner_kind: str, owner_uid: str, **meta: Any) -> dict[str, Any]:
        ref = {"kind": owner_kind, "name": name, "uid": owner_uid, "controller": True}
        return {"kind": kind, "metadata": {"uid": uid, "namespace": "ml", "ownerReferences": [ref], **meta}}

    trainjob = {
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ml", "uid": "tj", "labels": {LABEL_MANAGED_BY: MANAGED_BY}},
        "spec": {"trainer": {"numNodes": 2}},
    }
    jobset = owned("JobSet", "js", "TrainJob", "tj", name=name)
    job = owned("Job", "j0", "JobSet", "js", name=f"{name}-node-0")
    labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": "node"}
    pods = [
        {
            **owned("Pod", f"p{i}", "Job", "j0", name=f"{name}-node-0-{i}-abcde", labels=labels),
            "status": {"phase": "Running"},
        }
        for i in range(2)
    ]
    stranger = {**owned("Pod", "px", "Job", "another", name=f"{name}-node-0-0-zzzzz", labels=labels), "status": {}}
    paths = {
        "/api/v1/namespaces/ml/pods": items(*pods, stranger),
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs": items(trainjob),
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets": items(jobset),
        "/apis/batch/v1/namespaces/ml/jobs": items(job),
        "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs": Answer(403, b'{"kind":"Status","code":403}'),
        f"/api/v1/namespaces/ml/pods/{name}-node-0-0-abcde/log": Answer(200, b"[rank0]:hi\n"),
    }

    with fake_api(lambda method, path, query: paths.get(path) or Answer(404, b"404 page not found\n")) as api:
        kube = KubeJobs(_ui_connection(monkeypatch, api.kubeconfig(tmp_path)))
        [live] = kube.jobs("ml")
        assert (live.kind, live.name) == ("TrainJob", name)
        assert [p["metadata"]["uid"] for p in live.pods] == ["p0", "p1"], "the stranger's chain leads elsewhere"
        assert kube.log_tails(live)[f"{name}-node-0-0-abcde"] == "[rank0]:hi\n"
    queries = {request.path.rsplit("/", 1)[-1]: request.query for request in api.requests}
    assert queries["jobsets"] == {"fieldSelector": f"metadata.name={name}"}
    assert queries["jobs"] == {"labelSelector": f"jobset.sigs.k8s.io/jobset-name={name}"}
    assert queries["log"]["container"] == "node"


def test_an_api_refusal_reaches_the_pages_as_the_clients_kube_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Translated once, by kubernetes.client's boundary: the status and the Status reason, not the raw body."""
    from airflow_provider_torchelastic.errors import KubeError
    from airflow_provider_torchelastic.plugin.sources import KubeJobs
    from tests.unit.fake_kube_api import Answer, fake_api, status_answer

    def answer(method: str, path: str, query: Any) -> Answer:
        return status_answer(403, "Forbidden", 'pods is forbidden: User "u" cannot list resource "pods"')

    with fake_api(answer) as api:
        kube = KubeJobs(_ui_connection(monkeypatch, api.kubeconfig(tmp_path)))
        with pytest.raises(KubeError) as refused:
            kube.jobs("ml")
    assert (refused.value.status, refused.value.reason, kube.calls) == (403, "Forbidden", 1)
    assert refused.value.__cause__ is not None  # chained from the kubernetes client's ApiException

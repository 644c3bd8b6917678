"""The UI plugin against hostile input and curious users (issue 20): URL segments that are no Kubernetes names reach
no API path, only namespaces of DAGs the user may read are listed, one failing namespace hides only its own jobs,
caches stay bounded and one slow namespace holds up no other, Kubernetes' words reach only those who may read the
connection, a summary counts only for its own task's job, log tails need TASK_LOGS and are masked, and the app has no
docs routes. Fakes stand for Kubernetes, the database and the auth manager; the API is asked through FastAPI's
TestClient with the plugin's app mounted at ``/torch-elastic`` as the api-server mounts it."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_provider_torchelastic.core.naming import (
    ANNOTATION_DAG_ID,
    ANNOTATION_RUN_ID,
    ANNOTATION_TASK_ID,
    LABEL_MAP_INDEX,
    LABEL_TRY_NUMBER,
    RunIdentity,
    job_name,
)
from airflow_provider_torchelastic.core.summary import JobSummary, PodSummary
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.plugin import app as plugin_app
from airflow_provider_torchelastic.plugin import service as plugin_service
from airflow_provider_torchelastic.plugin import sources, views
from airflow_provider_torchelastic.plugin.service import GENERIC_KUBE_ERROR, JobsService
from airflow_provider_torchelastic.plugin.views import Identity, LiveJob

SECRET = "hunter2-do-not-show"
RBAC_REFUSAL = 'pods is forbidden: User "system:serviceaccount:airflow:ui" cannot list resource "pods"'


# --- builders -----------------------------------------------------------------------------------------------------


def _identity(dag_id: str, task_id: str = "train", try_number: int = 1) -> RunIdentity:
    return RunIdentity(dag_id=dag_id, task_id=task_id, run_id="manual__1", try_number=try_number)


def _live(dag_id: str, namespace: str = "ml", *, log: str = "") -> LiveJob:
    """A running single-pod job of ``dag_id``'s task, named and annotated as the provider renders it."""
    identity = _identity(dag_id)
    name = job_name(identity)
    metadata = {
        "name": name,
        "namespace": namespace,
        "creationTimestamp": "2027-01-15T08:00:00Z",
        "labels": {LABEL_MAP_INDEX: "-1", LABEL_TRY_NUMBER: "1"},
        "annotations": {ANNOTATION_DAG_ID: dag_id, ANNOTATION_TASK_ID: "train", ANNOTATION_RUN_ID: "manual__1"},
    }
    pod = {
        "metadata": metadata,
        "spec": {"nodeName": "node-0", "containers": [{"name": "pytorch"}]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "pytorch", "state": {"running": {}}}]},
    }
    return LiveJob(kind="Pod", obj=pod, pods=(pod,))


def _row_identity(identity: RunIdentity) -> Identity:
    """The identity of the XCom row a task instance try saves its summary in."""
    return Identity(
        dag_id=identity.dag_id,
        task_id=identity.task_id,
        run_id=identity.run_id,
        map_index=identity.map_index,
        try_number=identity.try_number,
    )


def _summary(name: str, namespace: str = "ml", *, log_tail: str = "", root_cause: str = "rank 0 failed") -> Any:
    pod = PodSummary(name=f"{name}-0", replica_type="pod", replica_index=0, phase="Failed", log_tail=log_tail)
    summary = JobSummary(
        kind="Pod",
        namespace=namespace,
        name=name,
        phase="failed",
        created=1_800_000_000.0,
        finished=1_800_000_090.0,
        root_cause=root_cause,
        pods=(pod,),
    )
    return summary.to_dict()


# --- fakes --------------------------------------------------------------------------------------------------------


class CountingKube:
    """KubeJobs' surface; records every read, and refuses the namespaces in ``failing`` as RBAC would."""

    conn_id = "kubernetes_default"
    default_namespace = "ml"

    def __init__(self, jobs: Mapping[str, list[LiveJob]] | None = None, failing: tuple[str, ...] = ()) -> None:
        self._jobs = dict(jobs or {})
        self.failing = failing
        self.calls: list[tuple[str, str]] = []

    def jobs(self, namespace: str) -> tuple[LiveJob, ...]:
        self.calls.append(("list", namespace))
        if namespace in self.failing:
            raise KubeError(403, "Forbidden", RBAC_REFUSAL)
        return tuple(self._jobs.get(namespace, ()))

    def find(self, namespace: str, name: str) -> LiveJob | None:
        return next((job for job in self.jobs(namespace) if job.name == name), None)

    def log_tails(self, job: LiveJob) -> dict[str, str]:
        self.calls.append(("logs", job.namespace))
        return {pod["metadata"]["name"]: f"step 1\npassword={SECRET}\n" for pod in job.pods}

    def log_tail(self, namespace: str, pod: str, container: str = "pytorch") -> str:
        self.calls.append(("log", namespace))
        return ""


class FakeSummaries:
    """Summaries' surface over rows ``(row identity, summary)``, as the XCom table holds them."""

    def __init__(
        self, rows: list[tuple[Identity, Any]] | None = None, namespaces: Mapping[str, set[str]] | None = None
    ) -> None:
        self.rows = list(rows or [])
        self.namespaces = dict(namespaces or {})

    def dag_ids(self) -> set[str]:
        return {identity.dag_id for identity, _ in self.rows}

    def job_namespaces(self) -> dict[str, set[str]]:
        return dict(self.namespaces)

    def latest(self, query: sources.SummaryQuery) -> list[tuple[Identity, Any]]:
        return [(i, value) for i, value in self.rows if _matches(i, query)][: query.limit]

    def ended(self, jobs: Any) -> set[views.JobKey]:
        # What the real query does: a row of the job's own task instance that names the job.
        saved = {(i.dag_id, i.task_id, i.run_id, i.map_index, v["namespace"], v["name"]) for i, v in self.rows}
        return {key for i, key in jobs if (i.dag_id, i.task_id, i.run_id, i.map_index, *key) in saved}

    def naming(self, namespace: str | None, name: str, dag_ids: Any) -> list[Identity]:
        return [i for i, v in self.rows if v["name"] == name and v["namespace"] == namespace and i.dag_id in dag_ids]


def _matches(identity: Identity, query: sources.SummaryQuery) -> bool:
    """What the real query's filters on the task instance's keys do."""
    keys = {"dag_id": query.dag_id, "run_id": query.run_id, "task_id": query.task_id, "map_index": query.map_index}
    wanted = all(value is None or getattr(identity, key) == value for key, value in keys.items())
    return wanted and identity.dag_id in query.dag_ids


class FakeViewer:
    """A user who may read ``dags`` (their logs only where ``logs``), and the UI's connection if ``admin``."""

    def __init__(self, dags: set[str], *, logs: set[str] | None = None, admin: bool = False) -> None:
        self.dags, self.logs, self.admin = dags, dags if logs is None else logs, admin

    def readable(self, dag_ids: set[str]) -> set[str]:
        return dag_ids & self.dags

    def can_read(self, dag_id: str) -> bool:
        return dag_id in self.dags

    def can_read_logs(self, dag_id: str) -> bool:
        return dag_id in self.logs

    def sees_kubernetes_errors(self) -> bool:
        return self.admin


def _service(kube: CountingKube, summaries: FakeSummaries | None = None) -> JobsService:
    return JobsService(kube, summaries or FakeSummaries())  # type: ignore[arg-type]


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, CountingKube]]:
    """The plugin's app mounted at /torch-elastic, over a counting Kubernetes and a user who may read everything."""
    kube = CountingKube({"ml": [_live("team_a")]})
    monkeypatch.setattr(plugin_app, "_SERVICE", _service(kube))
    monkeypatch.setattr(plugin_app, "_viewer", lambda user: FakeViewer({"team_a"}, admin=True))
    app = plugin_app.create_app()
    app.dependency_overrides[plugin_app.current_user] = lambda: "someone"
    server = FastAPI()
    server.mount("/torch-elastic", app)
    with TestClient(server) as test_client:
        yield test_client, kube


# --- 1. URL segments that are no Kubernetes names -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/torch-elastic/api/jobs/../x",
        "/torch-elastic/api/jobs/%2e%2e/x",
        "/torch-elastic/api/jobs/%2E%2E/x",
        "/torch-elastic/api/jobs/ml/%2e%2e",
        "/torch-elastic/api/jobs/ml%3FlabelSelector%3D/x",
        "/torch-elastic/api/jobs/ml%2F..%2F/x",
        "/torch-elastic/api/jobs/ML/x",
        "/torch-elastic/api/jobs/ml/x%3Fwatch%3Dtrue",
        "/torch-elastic/api/jobs/a..b/x",
    ],
)
def test_a_segment_that_is_no_kubernetes_name_makes_no_kubernetes_call(
    client: tuple[TestClient, CountingKube], path: str
) -> None:
    test_client, kube = client
    answer = test_client.get(path)
    assert answer.status_code in (400, 404), answer.text
    assert kube.calls == []


def test_a_valid_job_path_does_reach_kubernetes(client: tuple[TestClient, CountingKube]) -> None:
    """The control for the test above: the same client does make calls for a name Kubernetes could have."""
    test_client, kube = client
    name = _live("team_a").name
    answer = test_client.get(f"/torch-elastic/api/jobs/ml/{name}")
    assert answer.status_code == 200, answer.text
    assert ("list", "ml") in kube.calls


def test_a_raw_dot_dot_segment_as_the_server_passes_it_makes_no_kubernetes_call(
    client: tuple[TestClient, CountingKube],
) -> None:
    """``curl --path-as-is`` sends ``..`` as is, and uvicorn hands it to the app unnormalised (httpx, under the
    TestClient, would resolve it first): the ASGI app is called with that path itself."""
    import asyncio

    test_client, kube = client
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = "/torch-elastic/api/jobs/../x"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    asyncio.run(test_client.app(scope, receive, send))  # type: ignore[arg-type]
    [start] = [message for message in sent if message["type"] == "http.response.start"]
    assert start["status"] in (400, 404)
    assert kube.calls == []


@pytest.mark.parametrize(("namespace", "name"), [("..", "x"), ("ml", ".."), ("a/b", "x"), ("ml", "x?watch=1")])
def test_the_service_refuses_such_segments_before_any_read(namespace: str, name: str) -> None:
    kube = CountingKube({"ml": [_live("team_a")]})
    assert _service(kube).job(namespace, name, FakeViewer({"team_a"})) is None
    assert kube.calls == []


def test_the_kubernetes_reads_check_names_before_building_a_path() -> None:
    kube = sources.KubeJobs("torch_elastic_no_such_connection")
    for bad in ("..", "%2e%2e", "ml/../kube-system", "ml?x=1", ""):
        with pytest.raises(ValueError, match="DNS-1123"):
            kube.jobs(bad)
        with pytest.raises(ValueError, match="DNS-1123"):
            kube.read_log_tail(bad, "pod")
    with pytest.raises(ValueError, match="DNS-1123"):
        kube.read_log_tail("ml", "../../nodes")
    assert kube.log_tail("ml", "../../nodes") == "" and kube.log_tail("..", "pod") == ""
    assert kube.calls == 0
    assert views.is_namespace("team-a-1") and not views.is_namespace("-a") and not views.is_namespace("a" * 64)
    assert views.is_object_name("job.worker-0") and not views.is_object_name("a..b")


# --- 2. which namespaces are listed, and one failing namespace ------------------------------------------------------


def test_only_namespaces_of_readable_dags_are_listed() -> None:
    """Any task can push a ``job_namespace`` XCom: one of a DAG the user may not read makes the UI query nothing."""
    kube = CountingKube({"ml": [_live("team_a")], "team-a": [_live("team_a", "team-a")]})
    summaries = FakeSummaries(namespaces={"team-a": {"team_a"}, "kube-system": {"intruder"}})
    page = _service(kube, summaries).list_jobs(FakeViewer({"team_a"}))
    assert sorted(namespace for verb, namespace in kube.calls if verb == "list") == ["ml", "team-a"]
    assert {row["namespace"] for row in page["jobs"]} == {"ml", "team-a"}


def test_a_namespace_that_cannot_be_listed_hides_only_its_own_jobs() -> None:
    kube = CountingKube({"ml": [_live("team_a")]}, failing=("team-b",))
    summaries = FakeSummaries(namespaces={"team-b": {"team_a"}})
    page = _service(kube, summaries).list_jobs(FakeViewer({"team_a"}))
    assert [row["namespace"] for row in page["jobs"]] == ["ml"]
    assert list(page["kubernetes_errors"]) == ["team-b"]
    assert "team-b" in page["kubernetes_error"]


def test_the_lines_on_missing_running_jobs_name_the_namespace_and_say_finished_jobs_still_show() -> None:
    class NoCluster(CountingKube):
        @property
        def default_namespace(self) -> str:  # type: ignore[override]
            raise ValueError("Invalid kube-config file. No configuration found.")

    admin = FakeViewer({"team_a"}, admin=True)
    page = _service(NoCluster()).list_jobs(admin)
    # No cluster at all (a local-only deployment): one line, no empty namespace in it.
    assert page["kubernetes_errors"] == {
        "": "Running jobs are not shown, finished ones are: Kubernetes (kubernetes_default) could not be read: "
        "Invalid kube-config file. No configuration found."
    }
    line = _service(CountingKube(failing=("ml",))).list_jobs(admin)["kubernetes_errors"]["ml"]
    assert line.startswith("Running jobs in namespace ml are not shown, finished ones are: Kubernetes ")


def test_kubernetes_words_reach_only_users_who_may_read_the_connection() -> None:
    kube = CountingKube(failing=("ml",))
    viewer_page = _service(kube).list_jobs(FakeViewer({"team_a"}))
    admin_page = _service(kube).list_jobs(FakeViewer({"team_a"}, admin=True))
    assert RBAC_REFUSAL not in viewer_page["kubernetes_error"] and GENERIC_KUBE_ERROR in viewer_page["kubernetes_error"]
    assert RBAC_REFUSAL in admin_page["kubernetes_error"]


def test_the_detail_of_an_unreadable_cluster_says_why_only_to_who_may_see_it(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = CountingKube(failing=("ml",))
    monkeypatch.setattr(plugin_app, "_SERVICE", _service(kube))
    app = plugin_app.create_app()
    app.dependency_overrides[plugin_app.current_user] = lambda: "someone"
    name = _live("team_a").name
    for admin in (False, True):
        monkeypatch.setattr(plugin_app, "_viewer", lambda user, admin=admin: FakeViewer({"team_a"}, admin=admin))
        with TestClient(app) as test_client:
            answer = test_client.get(f"/api/jobs/ml/{name}")
        assert answer.status_code == 503
        assert (RBAC_REFUSAL in answer.json()["detail"]) is admin


# --- 3. per-namespace locks and bounded caches ----------------------------------------------------------------------


class SlowClient:
    """SyncKube's list_kind; the namespace ``slow`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def list_kind(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        if namespace == "slow":
            self.entered.set()
            assert self.release.wait(10)
        return []


def _kube_over(client: SlowClient) -> sources.KubeJobs:
    kube = sources.KubeJobs("unused")
    kube._kube_client = client  # type: ignore[assignment]
    kube._default_namespace = "ml"
    return kube


def test_a_slow_namespace_holds_up_no_other() -> None:
    client = SlowClient()
    kube = _kube_over(client)
    slow = threading.Thread(target=kube.jobs, args=("slow",))
    slow.start()
    try:
        assert client.entered.wait(10)
        done = threading.Event()
        fast = threading.Thread(target=lambda: (kube.jobs("fast"), done.set()))
        fast.start()
        # With one lock for every namespace, this list would wait for the slow one.
        assert done.wait(5), "listing one namespace waited for another's API call"
        fast.join()
    finally:
        client.release.set()
        slow.join()


def test_the_caches_stay_bounded_whatever_is_asked() -> None:
    kube = _kube_over(SlowClient())
    for index in range(sources.MAX_NAMESPACES + 20):
        kube.jobs(f"ns-{index}")
    assert len(kube._listings) == sources.MAX_NAMESPACES
    assert len(kube._namespace_locks) == sources.MAX_NAMESPACES
    for index in range(sources.MAX_CACHED_LOGS + 20):
        kube._logs.put(("ml", f"pod-{index}"), (0.0, ""))
    assert len(kube._logs) == sources.MAX_CACHED_LOGS


# --- 5. a summary counts only for its own task's job --------------------------------------------------------------


def test_a_summary_belongs_only_to_the_job_its_own_row_names() -> None:
    mine = _identity("team_a")
    assert views.summary_belongs_to({"name": job_name(mine)}, _row_identity(mine))
    # The next try's row, before that try cleared the XComs of the previous one.
    retried = _row_identity(_identity("team_a", try_number=2))
    assert views.summary_belongs_to({"name": job_name(mine)}, retried)
    assert not views.summary_belongs_to({"name": job_name(mine)}, _row_identity(_identity("intruder")))
    assert not views.summary_belongs_to({"name": job_name(mine)}, Identity(dag_id="team_a", task_id="t", run_id="r"))


def test_another_dags_summary_neither_hides_nor_replaces_a_job() -> None:
    """DAG ``intruder`` saves a summary that names team_a's running job: the list still shows the running job, and
    its detail comes from Kubernetes, not from the forged summary."""
    live = _live("team_a")
    forged = (_row_identity(_identity("intruder")), _summary(live.name, root_cause="forged"))
    kube = CountingKube({"ml": [live]})
    service = _service(kube, FakeSummaries([forged]))
    viewer = FakeViewer({"team_a", "intruder"})
    rows = service.list_jobs(viewer)["jobs"]
    assert [(row["name"], row["dag_id"], row["source"]) for row in rows] == [(live.name, "team_a", "kubernetes")]
    detail = service.job("ml", live.name, viewer)
    assert detail is not None and (detail["dag_id"], detail["source"]) == ("team_a", "kubernetes")


def test_a_jobs_own_summary_still_replaces_it_once_saved() -> None:
    live = _live("team_a")
    own = (_row_identity(_identity("team_a")), _summary(live.name))
    service = _service(CountingKube({"ml": [live]}), FakeSummaries([own]))
    rows = service.list_jobs(FakeViewer({"team_a"}))["jobs"]
    assert [(row["name"], row["source"]) for row in rows] == [(live.name, "summary")]
    detail = service.job("ml", live.name, FakeViewer({"team_a"}))
    assert detail is not None and detail["source"] == "summary"


# --- 6. no docs routes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_the_app_serves_no_docs_and_no_schema(path: str) -> None:
    with TestClient(plugin_app.create_app()) as test_client:
        assert test_client.get(path).status_code == 404


# --- 7 and 8. log tails: TASK_LOGS, and masked ----------------------------------------------------------------------


def test_log_tails_need_task_logs_and_are_not_even_read_without() -> None:
    kube = CountingKube({"ml": [_live("team_a")]})
    name = _live("team_a").name
    detail = _service(kube).job("ml", name, FakeViewer({"team_a"}, logs=set()))
    assert detail is not None and detail["logs_hidden"] is True
    assert [pod["log_tail"] for pod in detail["pods"]] == [""]
    assert ("logs", "ml") not in kube.calls
    finished = _service(kube, FakeSummaries([(_row_identity(_identity("team_a")), _summary(name, log_tail="x"))]))
    detail = finished.job("ml", name, FakeViewer({"team_a"}, logs=set()))
    assert detail is not None and [pod["log_tail"] for pod in detail["pods"]] == [""]


def test_secrets_the_api_server_knows_are_masked_too() -> None:
    """The api-server, where the plugin runs, registers the connections and variables it reads with the core's
    masker, not the task SDK's: a secret only it knows is masked as well."""
    from airflow._shared.secrets_masker import _secrets_masker

    core_only = "api-server-only-secret-5678"
    _secrets_masker().add_mask(core_only)
    saved = _summary("j", log_tail=f"pw {core_only}", root_cause=f"refused {core_only}")
    service = _service(CountingKube(), FakeSummaries([(_row_identity(_identity("team_a")), saved)]))
    assert core_only not in str(service.list_jobs(FakeViewer({"team_a"})))
    assert plugin_service.mask(f"x {core_only}") == "x ***"


def test_log_tails_and_root_causes_are_masked_by_airflows_secrets_masker() -> None:
    from airflow.sdk.log import mask_secret

    # What the task SDK does with a connection's password, and a Variable's value under a sensitive key.
    mask_secret(SECRET)
    mask_secret("a-variable-value-1234", "api_token")
    name = _live("team_a").name
    live_detail = _service(CountingKube({"ml": [_live("team_a")]})).job("ml", name, FakeViewer({"team_a"}))
    assert live_detail is not None and live_detail["pods"][0]["log_tail"]
    assert SECRET not in str(live_detail) and "***" in live_detail["pods"][0]["log_tail"]
    saved = _summary(name, log_tail=f"token {SECRET}", root_cause="auth failed with a-variable-value-1234")
    service = _service(CountingKube(), FakeSummaries([(_row_identity(_identity("team_a")), saved)]))
    assert SECRET not in str(service.job("ml", name, FakeViewer({"team_a"})))
    assert SECRET not in str(service.list_jobs(FakeViewer({"team_a"})))
    assert plugin_service.mask(f"x {SECRET}") == "x ***"


def test_a_running_jobs_tail_is_masked_with_the_trys_own_sensitive_env_values() -> None:
    """A value that only the task's masker knows (a plain env value with a sensitive name, which the task masks in
    its log and summary) was shown in clear in the live tail until the job ended: the api-server's masker never saw
    it. The tail is now masked with the sensitive env values of the job's own specs (issue 34, item 6)."""
    token = "live-only-token-90817263"
    job = _live("team_a")
    job.obj["spec"]["containers"][0]["env"] = [
        {"name": "API_TOKEN", "value": token},
        {"name": "EPOCHS", "value": "3"},
    ]

    class PrintingKube(CountingKube):
        def log_tails(self, job: LiveJob) -> dict[str, str]:
            return {pod["metadata"]["name"]: f"using token {token} for 3 epochs\n" for pod in job.pods}

    detail = _service(PrintingKube({"ml": [job]})).job("ml", job.name, FakeViewer({"team_a"}))
    assert detail is not None
    (tail,) = [pod["log_tail"] for pod in detail["pods"]]
    assert token not in str(detail) and "using token *** for 3 epochs" in tail

"""The UI finds a job's summary by the job's identity, not by its name (security issue 34, item 7), written as the
attacks: a DAG that pushes summaries naming another DAG's job cannot hide that job's detail view, and a TrainJob whose
name was cut to the kind's 44 characters still shows its saved summary once the job is deleted.

Real pieces short of a running api-server: the plugin's app mounted at ``/torch-elastic``, the real
:class:`~airflow_provider_torchelastic.plugin.sources.Summaries` over Airflow's metadata database, with the summaries
saved as a task saves them (an XCom row of its task instance). Kubernetes and the user are fakes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_provider_torchelastic.core.naming import (
    MAX_JOB_NAME_LENGTH,
    RunIdentity,
    fit_job_name,
    is_job_name_of,
    job_name,
)
from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary, PodSummary
from airflow_provider_torchelastic.kubernetes.kinds.trainjob import TORCH_DISTRIBUTED, trainjob_name
from airflow_provider_torchelastic.plugin import app as plugin_app
from airflow_provider_torchelastic.plugin import sources
from airflow_provider_torchelastic.plugin.service import JobsService
from tests.unit.test_ui_hardening import CountingKube, FakeViewer, _live

VICTIM = "ui_identity_victim"
INTRUDER = "ui_identity_intruder"
#: Long enough that the TrainJob's name is cut (``job_name`` gives 50 characters, the kind allows 44).
LONG_DAG = "ui_identity_nightly_foundation_model_pretraining_on_the_big_cluster"
LONG_TASK = "train_the_model_with_fsdp_and_activation_checkpointing"
OUR_DAGS = (VICTIM, INTRUDER, LONG_DAG)


# --- builders -----------------------------------------------------------------------------------------------------


def _summary(kind: str, name: str, *, root_cause: str) -> dict[str, Any]:
    pod = PodSummary(name=f"{name}-0", replica_type="pod", replica_index=0, phase="Failed")
    return JobSummary(
        kind=kind,
        namespace="ml",
        name=name,
        phase="failed",
        created=1_800_000_000.0,
        finished=1_800_000_090.0,
        root_cause=root_cause,
        pods=(pod,),
    ).to_dict()


def _save(identity: RunIdentity, summary: dict[str, Any]) -> None:
    """What the operator's ``xcom_push`` leaves in the database: the task instance try, its run, its summary row."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunType
    from sqlalchemy import insert, select

    with create_session() as session:
        run = select(DagRun.id).where(DagRun.dag_id == identity.dag_id, DagRun.run_id == identity.run_id)
        if session.scalar(run) is None:
            session.add(DagRun(dag_id=identity.dag_id, run_id=identity.run_id, run_type=DagRunType.MANUAL))
            session.flush()
        session.execute(
            insert(TaskInstance.__table__).values(
                dag_id=identity.dag_id,
                task_id=identity.task_id,
                run_id=identity.run_id,
                map_index=identity.map_index,
                try_number=identity.try_number,
                state="failed",
                pool="default_pool",
            )
        )
        XComModel.set(
            XCOM_KEY,
            summary,
            dag_id=identity.dag_id,
            task_id=identity.task_id,
            run_id=identity.run_id,
            map_index=identity.map_index,
            # As the execution API stores what the task SDK sends: the JSON object itself, not a string of it.
            serialize=False,
            session=session,
        )


def _forget_our_rows() -> None:
    """This module's rows only: the session's database holds other tests' runs."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import delete

    with create_session() as session:
        for model in (XComModel, TaskInstance, DagRun):
            session.execute(delete(model).where(model.dag_id.in_(OUR_DAGS)))


@pytest.fixture
def database(airflow_db: None) -> Iterator[None]:
    _forget_our_rows()
    yield
    _forget_our_rows()


def _client(monkeypatch: pytest.MonkeyPatch, kube: CountingKube, viewer: FakeViewer) -> TestClient:
    """The plugin's app at /torch-elastic, over the real summaries and a fake Kubernetes, as ``viewer``."""
    monkeypatch.setattr(plugin_app, "_SERVICE", JobsService(kube, sources.Summaries()))  # type: ignore[arg-type]
    monkeypatch.setattr(plugin_app, "_viewer", lambda user: viewer)
    app = plugin_app.create_app()
    app.dependency_overrides[plugin_app.current_user] = lambda: "someone"
    server = FastAPI()
    server.mount("/torch-elastic", app)
    return TestClient(server)


def _victim_and_forgeries(count: int) -> tuple[str, str]:
    """The victim's finished job with its own summary, then ``count`` newer summaries of another DAG (one per task
    instance of a mapped task: a row per task instance is all Airflow keeps) naming the same job."""
    victim = RunIdentity(dag_id=VICTIM, task_id="train", run_id="manual__1")
    name = job_name(victim)
    _save(victim, _summary("Pod", name, root_cause="the victim's own verdict"))
    for index in range(count):
        forger = RunIdentity(dag_id=INTRUDER, task_id="push", run_id="manual__1", map_index=index)
        _save(forger, _summary("Pod", name, root_cause="forged"))
    return name, "the victim's own verdict"


# --- (a) summaries of another DAG naming the job --------------------------------------------------------------------


@pytest.mark.parametrize("readable", [{VICTIM}, {VICTIM, INTRUDER}], ids=["victim-only", "both-dags"])
def test_sixty_summaries_of_another_dag_naming_a_job_do_not_hide_its_detail(
    database: None, monkeypatch: pytest.MonkeyPatch, readable: set[str]
) -> None:
    """60 newer rows of DAG ``intruder`` name the victim's deleted job: the detail view still shows the job from its
    own task's summary, whether or not the user may read the intruder's DAG."""
    name, verdict = _victim_and_forgeries(60)
    with _client(monkeypatch, CountingKube(), FakeViewer(readable)) as client:
        answer = client.get(f"/torch-elastic/api/jobs/ml/{name}")
    assert answer.status_code == 200, answer.text
    detail = answer.json()
    assert (detail["dag_id"], detail["source"], detail["root_cause"]) == (VICTIM, "summary", verdict)


def test_a_live_job_finds_its_own_summary_by_the_identity_it_carries(
    database: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of a DAG the user may read fill every slot of the name's lookup: the job, not deleted yet, still shows its
    task's verdict, found by the task instance its object's annotations name."""
    monkeypatch.setattr(sources, "MAX_NAME_MATCHES", 5)
    name, verdict = _victim_and_forgeries(6)
    live = _live(VICTIM)
    assert live.name == name
    with _client(monkeypatch, CountingKube({"ml": [live]}), FakeViewer({VICTIM, INTRUDER})) as client:
        answer = client.get(f"/torch-elastic/api/jobs/ml/{name}")
    assert answer.status_code == 200, answer.text
    detail = answer.json()
    assert (detail["dag_id"], detail["source"], detail["root_cause"]) == (VICTIM, "summary", verdict)


def test_the_intruders_rows_still_show_nothing_to_whoever_may_not_read_the_victims_dag(
    database: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: resolving a name through readable DAGs' rows gives no job to a user of the intruder's DAG alone,
    since none of its rows could have run the job."""
    name, _ = _victim_and_forgeries(3)
    with _client(monkeypatch, CountingKube(), FakeViewer({INTRUDER})) as client:
        assert client.get(f"/torch-elastic/api/jobs/ml/{name}").status_code == 404
        assert client.get("/torch-elastic/api/jobs").json()["jobs"] == []


# --- (b) a TrainJob's cut name -------------------------------------------------------------------------------------


def test_a_trainjob_whose_name_was_cut_shows_its_summary_once_deleted(
    database: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = RunIdentity(dag_id=LONG_DAG, task_id=LONG_TASK, run_id="manual__1")
    name = trainjob_name(identity)
    assert len(name) == TORCH_DISTRIBUTED.max_job_name_length < len(job_name(identity)), "the name must be cut"
    _save(identity, _summary("TrainJob", name, root_cause="node 1 ran out of memory"))
    # Deleted: Kubernetes has no job of that name any more.
    with _client(monkeypatch, CountingKube(), FakeViewer({LONG_DAG})) as client:
        detail = client.get(f"/torch-elastic/api/jobs/ml/{name}")
        listed = client.get("/torch-elastic/api/jobs", params={"dag_id": LONG_DAG})
    assert detail.status_code == 200, detail.text
    assert (detail.json()["dag_id"], detail.json()["kind"], detail.json()["source"]) == (
        LONG_DAG,
        "TrainJob",
        "summary",
    )
    assert [(row["name"], row["source"]) for row in listed.json()["jobs"]] == [(name, "summary")]


def test_every_cut_of_a_job_name_is_that_try_s_and_no_other_s() -> None:
    """A kind's runtime decides the cut (44 for ``torch-distributed``): whatever the length, the cut name answers
    for its own try only."""
    identity = RunIdentity(dag_id=LONG_DAG, task_id=LONG_TASK, run_id="manual__1", try_number=2)
    next_try = RunIdentity(dag_id=LONG_DAG, task_id=LONG_TASK, run_id="manual__1", try_number=3)
    for length in range(12, MAX_JOB_NAME_LENGTH + 1):
        cut = fit_job_name(job_name(identity), length)
        assert is_job_name_of(cut, identity), cut
        assert not is_job_name_of(cut, next_try), cut
    assert not is_job_name_of(job_name(identity)[:44], identity), "a cut keeps the hash whole"
    assert not is_job_name_of(None, identity)

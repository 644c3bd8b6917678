"""The UI plugin's API as a non-admin user of one team sees it (issue 20: a user who may read one DAG sees nothing of
another). Real pieces, short of a running api-server: Airflow's SimpleAuthManager under ``[core] multi_team`` with
two viewers, each of one team; tokens it signs, sent as a browser's API calls send them; the DAGs' teams from the
metadata database (DAG -> bundle -> team, the lookup Airflow's own routes make). Only Kubernetes is a fake: it holds
one running job of each team's DAG."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_provider_torchelastic.plugin import app as plugin_app
from airflow_provider_torchelastic.plugin.service import JobsService
from tests.unit.test_ui_hardening import CountingKube, FakeSummaries, _live

TEAMS = {"team-a": "a_train", "team-b": "b_train"}


BUNDLES = {team: f"ui-teams-bundle-{team}" for team in TEAMS} | {None: "ui-teams-bundle-shared"}


def _clear_teams(session: Any) -> None:
    """This module's rows only: the session's database holds other tests' DAGs and runs."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.team import Team

    session.query(DagModel).filter(DagModel.dag_id.in_([*TEAMS.values(), "untagged"])).delete()
    for bundle in session.query(DagBundleModel).filter(DagBundleModel.name.in_(BUNDLES.values())):
        bundle.teams.clear()
        session.delete(bundle)
    session.flush()
    session.query(Team).filter(Team.name.in_(TEAMS)).delete()


@pytest.fixture
def teams_db(airflow_db: None) -> Iterator[None]:
    """Each team's DAG in a bundle of that team, and a DAG of no team."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.team import Team
    from airflow.utils.session import create_session

    with create_session() as session:
        _clear_teams(session)
        for team, dag_id in TEAMS.items():
            bundle = DagBundleModel(name=BUNDLES[team])
            bundle.teams.append(Team(name=team))
            session.add(bundle)
            session.flush()
            session.add(DagModel(dag_id=dag_id, bundle_name=bundle.name))
        session.add(DagBundleModel(name=BUNDLES[None]))
        session.flush()
        session.add(DagModel(dag_id="untagged", bundle_name=BUNDLES[None]))
    yield
    with create_session() as session:
        _clear_teams(session)


@pytest.fixture
def api(teams_db: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[TestClient, Any]]:
    """The plugin's app mounted at /torch-elastic; returns the client and a token for a username."""
    from airflow.api_fastapi import app as airflow_app

    env = {
        "AIRFLOW__CORE__MULTI_TEAM": "True",
        "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "alice:viewer:team-a,bob:viewer:team-b",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(tmp_path / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": "a-test-secret-of-enough-length-for-hs512-0123456789",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    airflow_app.purge_cached_app()
    manager = airflow_app.init_auth_manager()
    kube = CountingKube({"ml": [_live(dag_id) for dag_id in (*TEAMS.values(), "untagged")]})
    monkeypatch.setattr(plugin_app, "_SERVICE", JobsService(kube, FakeSummaries()))  # type: ignore[arg-type]
    # The users as the manager reads them from [core] simple_auth_manager_users: "name:role:team".
    users = {user.username: user for user in manager.get_users()}

    def token(username: str) -> str:
        return str(manager.generate_jwt(users[username]))

    server = FastAPI()
    server.mount("/torch-elastic", plugin_app.create_app())
    try:
        with TestClient(server) as client:
            yield client, token
    finally:
        airflow_app.purge_cached_app()


def _get(client: TestClient, path: str, token: str | None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.get(f"/torch-elastic/api/{path}", headers=headers)


@pytest.mark.parametrize(("user", "team"), [("alice", "team-a"), ("bob", "team-b")])
def test_a_viewer_of_one_team_lists_and_opens_only_that_teams_jobs(
    api: tuple[TestClient, Any], user: str, team: str
) -> None:
    client, token = api
    # The other team's DAG is not there; a DAG of no team is every viewer's, as in Airflow's own DAG list.
    readable = {TEAMS[team], "untagged"}
    answer = _get(client, "jobs", token(user))
    assert answer.status_code == 200, answer.text
    assert sorted(job["dag_id"] for job in answer.json()["jobs"]) == sorted(readable)
    for dag_id in (*TEAMS.values(), "untagged"):
        opened = _get(client, f"jobs/ml/{_live(dag_id).name}", token(user))
        # The other team's job answers as a job that does not exist: not even its existence shows.
        assert opened.status_code == (200 if dag_id in readable else 404), (dag_id, opened.text)
        if dag_id not in readable:
            assert dag_id not in opened.text


def test_no_token_or_a_forged_one_sees_nothing(api: tuple[TestClient, Any]) -> None:
    client, token = api
    assert _get(client, "jobs", None).status_code == 401
    forged = token("alice")[:-4] + "AAAA"
    assert _get(client, "jobs", forged).status_code in (401, 403)

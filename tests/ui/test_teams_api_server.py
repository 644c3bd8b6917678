"""The UI plugin through a real ``airflow api-server`` under ``[core] multi_team`` (issue 20: a user who may read one
DAG sees nothing of another).

A second api-server of the test deployment, on the same PostgreSQL database, with two viewers of one team each
(SimpleAuthManager's ``name:role:team`` users). Each team has a DAG in a bundle of its own, as the DAG processor
records a team's bundle; each DAG has a job on the local cluster, rendered with the provider's own names, labels and
annotations. The users log in at ``/auth/token`` and read the plugin's API as the pages do. Nothing is faked: the
auth manager, the DAG-to-team lookup and the Kubernetes listing are the api-server process's own.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from airflow_provider_torchelastic.core.naming import (
    RunIdentity,
    identity_annotations,
    identity_labels,
    job_name,
)
from tests.airflow_services import postgres
from tests.airflow_services.services import AirflowServices

pytestmark = pytest.mark.cluster

API = "/torch-elastic/api/jobs"
USERS = {"alice": "team-a", "bob": "team-b"}
#: Each team's DAG, in a bundle of that team (the test deployment's own DAGs are in ``dags-folder``, of no team).
DAGS = {"team-a": "teams_a_train", "team-b": "teams_b_train"}
BUNDLES = {team: f"teams-bundle-{team}" for team in DAGS}


def _identity(dag_id: str) -> RunIdentity:
    return RunIdentity(dag_id=dag_id, task_id="train", run_id="manual__teams")


def _pending_pod(dag_id: str, namespace: str) -> dict[str, Any]:
    """A single-pod job of ``dag_id``'s task as the provider names and labels it; it never schedules (the real node
    lacks the selector's label, so kube-scheduler leaves it Pending), so it stays listed while the test reads."""
    identity = _identity(dag_id)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": job_name(identity),
            "namespace": namespace,
            "labels": identity_labels(identity),
            "annotations": identity_annotations(identity),
        },
        "spec": {
            "nodeSelector": {"torchelastic.dev/test-no-such-node": "true"},
            "containers": [{"name": "pytorch", "image": "local/torchelastic-runner:test"}],
        },
    }


def _seed_teams(url: str) -> None:
    """Teams, their bundles and their DAGs, as the DAG processor of a multi-team deployment records them."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.team import Team
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            _clear_teams(session)
            for team, dag_id in DAGS.items():
                bundle = DagBundleModel(name=BUNDLES[team])
                bundle.teams.append(Team(name=team))
                session.add(bundle)
                session.flush()
                session.add(DagModel(dag_id=dag_id, bundle_name=bundle.name))
    finally:
        engine.dispose()


def _clear_teams(session: Any) -> None:
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.team import Team

    session.query(DagModel).filter(DagModel.dag_id.in_(DAGS.values())).delete()
    for bundle in session.query(DagBundleModel).filter(DagBundleModel.name.in_(BUNDLES.values())):
        bundle.teams.clear()
        session.delete(bundle)
    session.flush()
    session.query(Team).filter(Team.name.in_(DAGS)).delete()


def _unseed_teams(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            _clear_teams(session)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def teams_server(
    airflow_services: AirflowServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """The multi-team api-server's base URL and each user's token."""
    from kubernetes import client, config

    info = airflow_services.info
    db_url = postgres.sqlalchemy_url(info.pg_port)
    passwords = {user: secrets.token_urlsafe(12) for user in USERS}
    passwords_file = tmp_path_factory.mktemp("teams") / "passwords.json"
    passwords_file.write_text(json.dumps(passwords))
    core = client.CoreV1Api(config.new_client_from_config(str(info.kubeconfig)))
    pods = [_pending_pod(dag_id, info.namespace) for dag_id in DAGS.values()]

    _seed_teams(db_url)
    try:
        for pod in pods:
            core.create_namespaced_pod(info.namespace, pod)
        base_url = airflow_services.deployment.start_api_server(
            "api-server-teams",
            {
                "AIRFLOW__CORE__MULTI_TEAM": "True",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:viewer:{t}" for u, t in USERS.items()),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file),
            },
        )
        tokens = {}
        for user, password in passwords.items():
            answer = httpx.post(f"{base_url}/auth/token", json={"username": user, "password": password}, timeout=30)
            assert answer.status_code == 201, answer.text
            tokens[user] = answer.json()["access_token"]
        yield base_url, tokens
    finally:
        airflow_services.deployment.stop_process("api-server-teams")
        for pod in pods:
            core.delete_namespaced_pod(pod["metadata"]["name"], info.namespace, grace_period_seconds=0)
        _unseed_teams(db_url)


def _get(base_url: str, path: str, token: str) -> httpx.Response:
    return httpx.get(f"{base_url}{API}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.parametrize("user", sorted(USERS))
def test_a_viewer_of_one_team_sees_only_that_teams_jobs_through_the_api_server(
    teams_server: tuple[str, dict[str, str]], airflow_services: AirflowServices, user: str
) -> None:
    base_url, tokens = teams_server
    mine, other = DAGS[USERS[user]], next(d for t, d in DAGS.items() if t != USERS[user])
    listed = _get(base_url, "", tokens[user])
    assert listed.status_code == 200, listed.text
    dag_ids = {job["dag_id"] for job in listed.json()["jobs"]}
    assert mine in dag_ids, listed.json()
    assert other not in dag_ids and other not in listed.text, "the other team's job does not show, not even its name"

    namespace = airflow_services.info.namespace
    opened = _get(base_url, f"/{namespace}/{job_name(_identity(mine))}", tokens[user])
    assert opened.status_code == 200, opened.text
    assert opened.json()["dag_id"] == mine
    hidden = _get(base_url, f"/{namespace}/{job_name(_identity(other))}", tokens[user])
    # As a job that does not exist: its existence does not show either.
    assert hidden.status_code == 404, hidden.text
    assert other not in hidden.text


def test_the_deployments_admin_still_sees_both_teams_jobs(
    teams_server: tuple[str, dict[str, str]], airflow_services: AirflowServices
) -> None:
    """The same jobs through the deployment's own api-server (no teams): the viewers' lists above are filtered,
    not empty for another reason."""
    answer = airflow_services.api.get(f"{airflow_services.base_url}{API}")
    assert answer.status_code == 200, answer.text
    assert set(DAGS.values()) <= {job["dag_id"] for job in answer.json()["jobs"]}

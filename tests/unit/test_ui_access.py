"""The UI plugin's authorization at the function that decides (issue 20, item 3): every DAG question names the DAG's
team, as Airflow 3.3's own routes ask (``DagDetails(id=..., team_name=...)``), log tails are asked as ``TASK_LOGS``,
and Kubernetes' error messages are for users who may read the UI's connection. Once with a recording fake auth
manager, once with Airflow's own SimpleAuthManager under teams."""

from __future__ import annotations

from typing import Any

from airflow_provider_torchelastic.plugin.access import UserAccess

# --- 7. team-aware authorization, at the function that decides ------------------------------------------------------


class TeamAuthManager:
    """The auth manager's DAG questions; grants (team, dag_id, entity) triples and records each question."""

    def __init__(
        self, grants: set[tuple[str | None, str, str | None]], connections: frozenset[str] = frozenset()
    ) -> None:
        self.grants, self.connections = grants, connections
        self.asked: list[tuple[str | None, str | None, str | None]] = []

    def is_authorized_dag(self, *, method: str, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        entity = None if access_entity is None else access_entity.name
        self.asked.append((details.team_name, details.id, entity))
        return method == "GET" and (details.team_name, details.id, entity) in self.grants

    def filter_authorized_dag_ids(
        self, *, dag_ids: set[str], user: Any, method: str = "GET", team_name: str | None = None
    ) -> set[str]:
        return {dag_id for dag_id in dag_ids if (team_name, dag_id, None) in self.grants}

    def is_authorized_connection(self, *, method: str, user: Any, details: Any = None) -> bool:
        return details.conn_id in self.connections


def test_authorization_names_each_dags_team_and_asks_for_task_logs() -> None:
    teams = {"a_train": "team-a", "b_train": "team-b"}
    manager = TeamAuthManager(
        {
            ("team-a", "a_train", None),
            ("team-a", "a_train", "TASK_INSTANCE"),
            # b_train is granted only as if it had no team: a question without the team must not find it.
            (None, "b_train", None),
            (None, "b_train", "TASK_INSTANCE"),
            ("team-a", "a_train", "TASK_LOGS"),
        },
        connections=frozenset({"kubernetes_default"}),
    )
    access = UserAccess(
        "viewer",
        conn_id="kubernetes_default",
        auth_manager=manager,
        teams_of=lambda ids: {i: teams[i] for i in ids if i in teams},
    )
    assert access.readable({"a_train", "b_train", "untagged"}) == {"a_train"}
    assert access.can_read("a_train") and not access.can_read("b_train")
    assert ("team-b", "b_train", "TASK_INSTANCE") in manager.asked
    assert access.can_read_logs("a_train") and not access.can_read_logs("untagged")
    assert access.sees_kubernetes_errors()
    other = UserAccess("viewer", conn_id="other", auth_manager=manager, teams_of=lambda ids: {})
    assert not other.sees_kubernetes_errors()


def test_airflows_simple_auth_manager_under_teams_grants_a_user_only_their_teams_dags() -> None:
    """Airflow's own SimpleAuthManager refuses a DAG of another team only when it is told the DAG's team: without
    ``team_name`` (the question this plugin asked before), a viewer of team-a would read team-b's jobs too."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    teams = {"a_train": "team-a", "b_train": "team-b"}

    def teams_of(dag_ids: Any) -> dict[str, str | None]:
        return {dag_id: teams[dag_id] for dag_id in dag_ids if dag_id in teams}

    manager = SimpleAuthManager()
    viewer = SimpleAuthManagerUser(username="alice", role="viewer", teams=["team-a"])
    access = UserAccess(viewer, conn_id="kubernetes_default", auth_manager=manager, teams_of=teams_of)
    assert access.readable({"a_train", "b_train"}) == {"a_train"}
    assert access.can_read("a_train") and not access.can_read("b_train")
    assert access.can_read_logs("a_train") and not access.can_read_logs("b_train")
    # Reading a connection takes the op role: a viewer gets the generic message, an op Kubernetes' own.
    assert not access.sees_kubernetes_errors()
    op = SimpleAuthManagerUser(username="olga", role="op", teams=["team-a"])
    assert UserAccess(
        op, conn_id="kubernetes_default", auth_manager=manager, teams_of=teams_of
    ).sees_kubernetes_errors()

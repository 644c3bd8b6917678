"""Who may see which job: Airflow's auth manager decides, as for the REST API. Users come from the request's JWT
(the ``Authorization: Bearer`` header or the UI's ``_token`` cookie) through :func:`get_auth_manager`, which works
inside a mounted plugin app (``request.app`` is the plugin's own app there, without Airflow's ``app.state``).

Every question names the DAG's team (``DagDetails(id=..., team_name=...)``), as Airflow's own routes do: under
``[core] multi_team`` an auth manager grants a DAG through its bundle's team. Log tails need the ``TASK_LOGS``
entity, as task logs do in Airflow's UI; Kubernetes' own error messages (which name the cluster, its identities and
its RBAC) are for users who may read the UI's Kubernetes connection.

Airflow is imported on first use: loading the plugin must stay cheap in every Airflow process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

__all__ = ["UserAccess", "can_read_dag", "dag_teams", "readable_dag_ids", "user_from_request"]

#: ``{dag_id: team}`` for the DAGs that belong to a team (the others have none).
TeamsOf = Callable[[Collection[str]], Mapping[str, str | None]]


async def user_from_request(authorization: str | None, cookie_token: str | None) -> Any:
    """The authenticated user; HTTP 401 without a token, 403 (or 401 when expired) for a bad one."""
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    token = None
    if authorization and authorization.lower().startswith("bearer "):
        token = authorization[7:].strip()
    return await resolve_user_from_token(token or cookie_token)


def _auth_manager() -> Any:
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


def dag_teams(dag_ids: Collection[str]) -> Mapping[str, str | None]:
    """The teams of these DAGs (through their bundles), as Airflow's routes look them up."""
    from airflow.models.dag import DagModel

    return DagModel.get_dag_id_to_team_name_mapping(sorted(dag_ids)) if dag_ids else {}


def readable_dag_ids(
    dag_ids: Iterable[str], user: Any, auth_manager: Any = None, teams_of: TeamsOf = dag_teams
) -> set[str]:
    """Those of ``dag_ids`` that ``user`` may read (a DAG-level GET, as the REST API's lists filter DAGs), asked
    team by team as ``BaseAuthManager.get_authorized_dag_ids`` does."""
    manager = auth_manager or _auth_manager()
    wanted = set(dag_ids)
    teams = teams_of(wanted)
    by_team: dict[str | None, set[str]] = {}
    for dag_id in wanted:
        by_team.setdefault(teams.get(dag_id), set()).add(dag_id)
    readable: set[str] = set()
    for team, ids in by_team.items():
        readable |= set(manager.filter_authorized_dag_ids(dag_ids=ids, user=user, method="GET", team_name=team))
    return readable


def can_read_dag(
    dag_id: str, user: Any, auth_manager: Any = None, teams_of: TeamsOf = dag_teams, *, entity: str = "TASK_INSTANCE"
) -> bool:
    """Whether ``user`` may GET the DAG's ``entity`` (a ``DagAccessEntity`` name): its task instances, or its logs."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    manager = auth_manager or _auth_manager()
    details = DagDetails(id=dag_id, team_name=teams_of({dag_id}).get(dag_id))
    return bool(
        manager.is_authorized_dag(method="GET", access_entity=DagAccessEntity[entity], details=details, user=user)
    )


class UserAccess:
    """What one request's user may see, asked of the auth manager (each answer kept for the request's life)."""

    def __init__(self, user: Any, *, conn_id: str, auth_manager: Any = None, teams_of: TeamsOf = dag_teams) -> None:
        self.user = user
        self.conn_id = conn_id
        self._manager = auth_manager
        self._teams_of = teams_of
        self._answers: dict[tuple[str, str], bool] = {}

    @property
    def manager(self) -> Any:
        if self._manager is None:
            self._manager = _auth_manager()
        return self._manager

    def readable(self, dag_ids: set[str]) -> set[str]:
        return readable_dag_ids(dag_ids, self.user, self.manager, self._teams_of)

    def _ask(self, dag_id: str, entity: str) -> bool:
        key = (dag_id, entity)
        if key not in self._answers:
            self._answers[key] = can_read_dag(dag_id, self.user, self.manager, self._teams_of, entity=entity)
        return self._answers[key]

    def can_read(self, dag_id: str) -> bool:
        return self._ask(dag_id, "TASK_INSTANCE")

    def can_read_logs(self, dag_id: str) -> bool:
        return self._ask(dag_id, "TASK_LOGS")

    def sees_kubernetes_errors(self) -> bool:
        """Whether the user may read the connection the UI reads Kubernetes through (its errors are about it)."""
        from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

        key = (self.conn_id, "connection")
        if key not in self._answers:
            details = ConnectionDetails(conn_id=self.conn_id)
            self._answers[key] = bool(
                self.manager.is_authorized_connection(method="GET", details=details, user=self.user)
            )
        return self._answers[key]

"""Who may see which job: Airflow's auth manager decides, as for the REST API. Users come from the request's JWT
(the ``Authorization: Bearer`` header or the UI's ``_token`` cookie) through :func:`get_auth_manager`, which works
inside a mounted plugin app (``request.app`` is the plugin's own app there, without Airflow's ``app.state``).

Airflow is imported on first use: loading the plugin must stay cheap in every Airflow process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["can_read_dag", "readable_dag_ids", "user_from_request"]


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


def readable_dag_ids(dag_ids: Iterable[str], user: Any, auth_manager: Any = None) -> set[str]:
    """Those of ``dag_ids`` that ``user`` may read (a DAG-level GET, as the REST API's lists filter DAGs)."""
    manager = auth_manager or _auth_manager()
    return set(manager.filter_authorized_dag_ids(dag_ids=set(dag_ids), user=user, method="GET"))


def can_read_dag(dag_id: str, user: Any, auth_manager: Any = None) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    manager = auth_manager or _auth_manager()
    return bool(
        manager.is_authorized_dag(
            method="GET", access_entity=DagAccessEntity.TASK_INSTANCE, details=DagDetails(id=dag_id), user=user
        )
    )

"""The plugin's FastAPI app, mounted by Airflow's api-server at ``/torch-elastic``: a JSON API for the pages and the
pages' built bundle.

- ``GET /api/jobs?limit&offset&dag_id&phase`` (and ``run_id``, ``task_id``, ``map_index`` for the task tab):
  ``{"jobs": [...]}``, newest first;
- ``GET /api/jobs/{namespace}/{name}``: one job with its pods and metric series;
- ``/static/...``: the React bundle (built by ``npm run build`` in ``ui/``).

Plugin apps are not behind Airflow's auth: every API route asks for an authenticated user and shows only jobs of
DAGs the user may read (:mod:`.access`).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Annotated, Any, Final

from fastapi import Cookie, Depends, FastAPI, Header, HTTPException, Query
from fastapi.staticfiles import StaticFiles

from airflow_provider_torchelastic.plugin import access
from airflow_provider_torchelastic.plugin.views import PHASES

__all__ = ["STATIC_DIR", "create_app"]

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
#: The largest page of jobs one request may ask for.
MAX_LIMIT: Final = 200

# Browsers refuse a module script served as text/plain; some systems' mime tables know neither extension.
mimetypes.add_type("application/javascript", ".js")
mimetypes.add_type("application/javascript", ".cjs")
mimetypes.add_type("image/svg+xml", ".svg")


async def current_user(
    authorization: Annotated[str | None, Header()] = None,
    token: Annotated[str | None, Cookie(alias="_token")] = None,
) -> Any:
    return await access.user_from_request(authorization, token)


User = Annotated[Any, Depends(current_user)]


def _service() -> Any:
    """One service per api-server process (its caches are what keeps API calls per page view bounded)."""
    global _SERVICE
    if _SERVICE is None:
        from airflow.configuration import conf

        from airflow_provider_torchelastic.plugin.service import JobsService
        from airflow_provider_torchelastic.plugin.sources import KubeJobs, Summaries

        conn_id = conf.get("torch_elastic", "ui_kubernetes_conn_id", fallback="kubernetes_default")
        base_url = conf.get("api", "base_url", fallback="") or ""
        _SERVICE = JobsService(KubeJobs(conn_id), Summaries(), base_path=_path_of(base_url))
    return _SERVICE


_SERVICE: Any = None


def _path_of(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).path.rstrip("/")


def create_app() -> FastAPI:
    app = FastAPI(
        title="Torch Elastic training jobs",
        description="Training jobs run by airflow-provider-torchelastic, for the Airflow UI plugin pages.",
    )

    @app.get("/api/jobs")
    def list_jobs(
        user: User,
        limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
        offset: Annotated[int, Query(ge=0)] = 0,
        dag_id: str | None = None,
        phase: str | None = None,
        run_id: str | None = None,
        task_id: str | None = None,
        map_index: int | None = None,
    ) -> dict[str, Any]:
        if phase is not None and phase not in PHASES:
            raise HTTPException(422, f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")

        return _service().list_jobs(
            lambda dag_ids: access.readable_dag_ids(dag_ids, user),
            dag_id=dag_id,
            phase=phase,
            run_id=run_id,
            task_id=task_id,
            map_index=map_index,
            offset=offset,
            limit=limit,
        )

    @app.get("/api/jobs/{namespace}/{name}")
    def get_job(namespace: str, name: str, user: User) -> dict[str, Any]:
        from airflow_provider_torchelastic.plugin.service import KubernetesUnavailable

        try:
            job = _service().job(namespace, name, lambda dag_id: access.can_read_dag(dag_id, user))
        except KubernetesUnavailable as e:
            # A finished job would have come from its summary: this one is live, and the cluster cannot be read.
            raise HTTPException(503, f"cannot read {namespace}/{name} from Kubernetes: {e}") from e
        if job is None:
            # The same answer whether it does not exist or the user may not read its DAG: no existence leak.
            raise HTTPException(404, f"no training job {namespace}/{name}")
        return dict(job)

    # check_dir=False: a checkout whose bundle was not built yet still serves the API (the pages then say so).
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
    return app

"""The plugin's FastAPI app, mounted by Airflow's api-server at ``/torch-elastic``: a JSON API for the pages and the
pages' built bundle.

- ``GET /api/jobs?limit&offset&dag_id&phase`` (and ``run_id``, ``task_id``, ``map_index`` for the task tab):
  ``{"jobs": [...]}``, newest first;
- ``GET /api/jobs/{namespace}/{name}``: one job with its pods and metric series;
- ``/static/...``: the React bundle (built by ``npm run build`` in ``ui/``, and while a wheel is built). Where it
  is missing (a checkout where npm never ran) the pages say so and how to build it, and the navigation keeps its
  icon.

Plugin apps are not behind Airflow's auth: every API route asks for an authenticated user and shows only jobs of
DAGs the user may read (:mod:`.access`).
"""

from __future__ import annotations

import json
import logging
import mimetypes
from pathlib import Path
from typing import Annotated, Any, Final

from fastapi import Cookie, Depends, FastAPI, Header, HTTPException, Query
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from airflow_provider_torchelastic.plugin import access
from airflow_provider_torchelastic.plugin.views import PHASES

__all__ = ["STATIC_DIR", "create_app"]

log = logging.getLogger(__name__)

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
#: What ``npm run build`` in ui/ writes into STATIC_DIR.
BUNDLE: Final = "torch-elastic.js"
ICON: Final = "icon.svg"
#: The react apps' names (the plugin's react_apps), each a component the bundle defines on globalThis.
PAGES: Final = ("Training jobs", "Training job")
MISSING_BUNDLE: Final = (
    "The torch_elastic plugin's pages are not built in this installation of airflow-provider-torchelastic: "
    f"airflow_provider_torchelastic/plugin/static/{BUNDLE} is missing. It is built from ui/ with npm (Node.js): "
    "in a checkout, run `make setup` (or `cd ui && npm ci && npm run build`), then reload the page; a wheel built "
    "with `python -m build` or installed with `pip install` from the source includes it."
)
#: ui/src/icon.svg, for a checkout whose bundle (which copies it into STATIC_DIR) is not built.
FALLBACK_ICON: Final = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="currentColor" '
    'stroke-width="2" stroke-linecap="round" stroke-linejoin="round"><polyline points="3 17 9 11 13 15 21 7"/>'
    '<polyline points="15 7 21 7 21 13"/></svg>\n'
)
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
        from airflow_provider_torchelastic.settings import read_ui_kubernetes_conn_id

        conn_id = read_ui_kubernetes_conn_id()
        base_url = conf.get("api", "base_url", fallback="") or ""
        _SERVICE = JobsService(KubeJobs(conn_id), Summaries(), base_path=_path_of(base_url))
    return _SERVICE


def _viewer(user: Any) -> access.UserAccess:
    return access.UserAccess(user, conn_id=_service().kube.conn_id)


_SERVICE: Any = None


def _path_of(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).path.rstrip("/")


def _missing_bundle_module() -> str:
    """A module that stands in for the bundle: each page renders what is missing and how to build it."""
    return f"""// {MISSING_BUNDLE}
(() => {{
  const message = {json.dumps(MISSING_BUNDLE)};
  console.error(message);
  const React = globalThis.React;
  if (!React) throw new Error(message);
  const Missing = () =>
    React.createElement(
      "div",
      {{ role: "alert", style: {{ padding: "24px", maxWidth: "720px", lineHeight: 1.5 }} }},
      React.createElement("h2", {{ style: {{ fontSize: "20px", fontWeight: 600, marginBottom: "8px" }} }},
        "The Training jobs pages are not built"),
      React.createElement("p", null, message),
    );
  for (const name of {json.dumps(list(PAGES))}) globalThis[name] = Missing;
}})();
"""


_warned_missing = False


def _bundle_response(sec_fetch_dest: str | None) -> Response:
    path = STATIC_DIR / BUNDLE
    if path.is_file():
        return FileResponse(path, media_type="application/javascript")
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        log.warning("%s", MISSING_BUNDLE)
    # Not cached: once it is built, the next page load gets the real bundle.
    headers = {"Cache-Control": "no-store", "Vary": "Sec-Fetch-Dest"}
    if sec_fetch_dest == "script":
        # The UI's import() of the bundle: a failed import shows only the UI's generic "failed to load", so the
        # browser gets a module that puts the message in the page. Anything else (curl, a health check) gets 503.
        return Response(_missing_bundle_module(), media_type="application/javascript", headers=headers)
    return PlainTextResponse(MISSING_BUNDLE, status_code=503, headers=headers)


def create_app() -> FastAPI:
    app = FastAPI(
        title="Torch Elastic training jobs",
        description="Training jobs run by airflow-provider-torchelastic, for the Airflow UI plugin pages.",
        # Off: they would answer without authentication, and the docs pages load their scripts from a CDN.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
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

        jobs: dict[str, Any] = _service().list_jobs(
            _viewer(user),
            dag_id=dag_id,
            phase=phase,
            run_id=run_id,
            task_id=task_id,
            map_index=map_index,
            offset=offset,
            limit=limit,
        )
        return jobs

    @app.get("/api/jobs/{namespace}/{name}")
    def get_job(namespace: str, name: str, user: User) -> dict[str, Any]:
        from airflow_provider_torchelastic.plugin.service import GENERIC_KUBE_ERROR, KubernetesUnavailable
        from airflow_provider_torchelastic.plugin.views import LOCAL_NAMESPACE, is_namespace, is_object_name

        if not (is_object_name(name) and (namespace == LOCAL_NAMESPACE or is_namespace(namespace))):
            # Decided before anything is read: such a segment (`..`, a query string) never reaches an API path.
            raise HTTPException(404, "no training job: expected a namespace (a DNS-1123 label) and a job name")
        viewer = _viewer(user)
        try:
            job = _service().job(namespace, name, viewer)
        except KubernetesUnavailable as e:
            # A finished job would have come from its summary: this one is live, and the cluster cannot be read.
            log.warning("torch_elastic UI: cannot read %s/%s from Kubernetes: %s", namespace, name, e)
            why = str(e) if viewer.sees_kubernetes_errors() else GENERIC_KUBE_ERROR
            raise HTTPException(503, f"cannot read {namespace}/{name} from Kubernetes: {why}") from e
        if job is None:
            # The same answer whether it does not exist or the user may not read its DAG: no existence leak.
            raise HTTPException(404, f"no training job {namespace}/{name}")
        return dict(job)

    # Before the mount, which would answer 404 (500 without the directory) where the bundle was never built.
    @app.api_route(f"/static/{BUNDLE}", methods=["GET", "HEAD"], include_in_schema=False)
    def bundle(sec_fetch_dest: Annotated[str | None, Header()] = None) -> Response:
        return _bundle_response(sec_fetch_dest)

    @app.api_route(f"/static/{ICON}", methods=["GET", "HEAD"], include_in_schema=False)
    def icon() -> Response:
        path = STATIC_DIR / ICON
        if path.is_file():
            return FileResponse(path, media_type="image/svg+xml")
        return Response(FALLBACK_ICON, media_type="image/svg+xml")

    # check_dir=False: a checkout whose bundle was not built yet still serves the API (the pages then say so).
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
    return app

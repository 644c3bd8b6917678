"""Loads the cluster and Airflow-deployment plugins (as tests/deployment/conftest.py does), and gives the browser and
a page of it logged in to the deployment."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.airflow_services.services import AirflowServices

PLUGINS = ("tests.cluster.pytest_plugin", "tests.airflow_services.pytest_plugin")
#: Where screenshots go (a test artifact): TORCHELASTIC_UI_ARTIFACTS, else pytest's temporary dir.
ARTIFACTS_ENV = "TORCHELASTIC_UI_ARTIFACTS"
#: The plugin's API of jobs, under the deployment's base URL.
API = "/torch-elastic/api/jobs"
#: Milliseconds a page may take to show what the API has (it refreshes every 5 s while jobs run).
SHOWN_WITHIN = 30_000


def pytest_configure(config: pytest.Config) -> None:
    for plugin in PLUGINS:
        if not config.pluginmanager.has_plugin(plugin):
            config.pluginmanager.import_plugin(plugin)


def chromium_path() -> str | None:
    """Debian's chromium (scripts/test.sh installs it); playwright drives it, and downloads no browser of its own."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


# Module scope, not session: while playwright's sync API is open, its event loop counts as running in this thread,
# and every later test that calls asyncio.run() would fail.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium: `apt-get install chromium` (scripts/test.sh does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(airflow_services: AirflowServices, browser: Any) -> Iterator[Any]:
    """A page of the ``browser``, logged in to the deployment as its admin; an error at teardown if a page raised in
    the browser."""
    token = str(airflow_services.api.headers["Authorization"]).split(" ", 1)[1]
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    # What the UI's login leaves in the browser: the JWT in the `_token` cookie.
    context.add_cookies([{"name": "_token", "value": token, "url": airflow_services.base_url}])
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the pages raised in the browser: {errors}"


def tab_url(base: str, dag_id: str, run_id: str, task_id: str) -> str:
    """The "Training job" tab of a task instance in Airflow's UI."""
    return f"{base}/dags/{dag_id}/runs/{quote(run_id, safe='')}/tasks/{task_id}/plugin/training-job"


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get(ARTIFACTS_ENV)
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("ui-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder

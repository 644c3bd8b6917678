"""Loads the cluster and Airflow-deployment plugins (as tests/deployment/conftest.py does), and gives the browser."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PLUGINS = ("tests.cluster.pytest_plugin", "tests.airflow_services.pytest_plugin")
#: Where screenshots go (a test artifact): TORCHELASTIC_UI_ARTIFACTS, else pytest's temporary dir.
ARTIFACTS_ENV = "TORCHELASTIC_UI_ARTIFACTS"


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


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get(ARTIFACTS_ENV)
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("ui-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder

"""What the distribution declares (the Airflow floor that the trigger's behaviour relies on), and what the plugin
serves where the package's UI bundle was not built. What a built wheel holds: test_wheel_contents.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from importlib.metadata import requires
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from airflow_provider_torchelastic.plugin import PREFIX, TorchElasticPlugin
from airflow_provider_torchelastic.plugin import app as app_module

REPO = Path(__file__).resolve().parents[2]


def test_airflow_floor_is_the_first_triggerer_that_calls_on_kill() -> None:
    # Airflow 3.3's triggerer is the first to call BaseTrigger.on_kill (mark failed / clear of a deferred task):
    # on an older one a killed deferred task would leave its job running on the cluster.
    reqs = {r.name: r for r in map(Requirement, requires("airflow-provider-torchelastic") or []) if not r.marker}
    airflow = reqs["apache-airflow"]
    assert not airflow.specifier.contains(Version("3.2.9")), airflow
    assert airflow.specifier.contains(Version("3.3.0")), airflow
    assert {"pyyaml", "tenacity"} <= set(reqs), "imported by the provider, so declared"


# The plugin's app where the UI bundle was not built (an editable checkout where npm never ran): its pages say what is
# missing and how to build it, rather than a 404 (a 500 without the static directory) and a broken navigation icon.


def _get(path: str, **headers: str) -> httpx.Response:
    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app_module.create_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://api-server") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(get())


@pytest.fixture
def unbuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(app_module, "STATIC_DIR", tmp_path / "static")  # not even the directory
    return tmp_path / "static"


def test_without_the_bundle_a_request_for_it_answers_503_with_how_to_build_it(unbuilt: Path) -> None:
    answer = _get(f"/static/{app_module.BUNDLE}")
    assert answer.status_code == 503
    assert "not built" in answer.text and "npm ci && npm run build" in answer.text and "make setup" in answer.text
    assert answer.headers["cache-control"] == "no-store"


def test_without_the_bundle_the_uis_import_gets_a_module_whose_pages_say_how_to_build_it(unbuilt: Path) -> None:
    # What the browser sends for the UI's import() of a plugin bundle.
    answer = _get(f"/static/{app_module.BUNDLE}", **{"Sec-Fetch-Dest": "script"})
    assert answer.status_code == 200 and "javascript" in answer.headers["content-type"]
    assert answer.headers["cache-control"] == "no-store"
    # Run as the UI does: globalThis.React set by the host page, then each react app's component rendered.
    node = shutil.which("node")
    assert node, "node is needed to run the module (make setup installs it)"
    harness = (
        "globalThis.React = {createElement: (type, props, ...children) => ({type, props, children})};\n"
        "console.error = () => {};\n"
        f"{answer.text}\n"
        "const text = (el) => typeof el === 'string' ? el : el.children.map(text).join(' ');\n"
        f"for (const name of {json.dumps([app['name'] for app in TorchElasticPlugin.react_apps])})\n"
        "  console.log(name + ': ' + text(globalThis[name]()));\n"
    )
    shown = subprocess.run([node, "-e", harness], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = shown.splitlines()
    assert [line.split(":")[0] for line in lines] == ["Training jobs", "Training job"], shown
    assert all("not built" in line and "npm ci && npm run build" in line for line in lines), shown


def test_without_the_bundle_the_navigation_keeps_its_icon(unbuilt: Path) -> None:
    [nav] = [app for app in TorchElasticPlugin.react_apps if app["destination"] == "nav"]
    assert nav["icon"] == f"{PREFIX}/static/{app_module.ICON}"
    answer = _get(f"/static/{app_module.ICON}")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("image/svg+xml")
    # The same icon as the one the bundle's build copies.
    assert answer.text == (REPO / "ui" / "src" / "icon.svg").read_text()


def test_a_built_bundle_is_served_as_it_is(unbuilt: Path) -> None:
    unbuilt.mkdir()
    (unbuilt / app_module.BUNDLE).write_text('globalThis["Training jobs"] = () => null;\n')
    (unbuilt / app_module.ICON).write_text("<svg/>\n")
    for fetch_dest in ("script", "empty"):
        answer = _get(f"/static/{app_module.BUNDLE}", **{"Sec-Fetch-Dest": fetch_dest})
        assert answer.status_code == 200 and "javascript" in answer.headers["content-type"]
        assert answer.text == 'globalThis["Training jobs"] = () => null;\n'
    assert _get(f"/static/{app_module.ICON}").text == "<svg/>\n"
    bundle_urls = {app["bundle_url"] for app in TorchElasticPlugin.react_apps}
    assert bundle_urls == {f"{PREFIX}/static/{app_module.BUNDLE}"}
    assert {app["name"] for app in TorchElasticPlugin.react_apps} == set(app_module.PAGES)

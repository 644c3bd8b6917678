"""The "Training jobs" page and the "Training job" tab as a person uses them: a real Airflow deployment
(tests/airflow_services) on the local cluster runs a job that reports metrics and one that fails; headless Chromium
(Debian's, driven by playwright) logs in with the UI's ``_token`` cookie and opens both pages.

Screenshots are saved as test artifacts (``$TORCHELASTIC_UI_ARTIFACTS``, else pytest's temporary dir); the ones in
docs/ are taken from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.airflow_services.services import AirflowServices
from tests.ui.conftest import API, SHOWN_WITHIN, tab_url

pytestmark = pytest.mark.cluster

#: Steps that ui_metrics reports (tests/deployment_dags/ui_training.py: STEPS; a DAG file is not imported here).
STEPS = 12
#: Elements of the tensor ui_metrics returns (WEIGHTS there).
WEIGHTS = 1000


def test_the_api_refuses_anonymous_and_bad_tokens(airflow_services: AirflowServices) -> None:
    base = airflow_services.base_url
    assert httpx.get(f"{base}{API}", timeout=30).status_code == 401
    forged = httpx.get(f"{base}{API}", headers={"Authorization": "Bearer forged"}, timeout=30)
    assert forged.status_code in (401, 403)
    cookie = httpx.get(f"{base}{API}/default/some-job", cookies={"_token": "forged"}, timeout=30)
    assert cookie.status_code in (401, 403)
    # The bundle itself is public (as Airflow's own assets are), with a type a module import accepts.
    bundle = httpx.get(f"{base}/torch-elastic/static/torch-elastic.js", timeout=30)
    assert bundle.status_code == 200, "the UI bundle is missing: run scripts/setup.sh (npm run build in ui/)"
    assert "javascript" in bundle.headers["content-type"]


def _wait_for_job(
    services: AirflowServices, dag_id: str, until: Callable[[dict[str, Any]], Any], timeout: float = 180
) -> dict[str, Any]:
    """The DAG's job in the plugin's API once ``until(job)``; the API answers with the admin's token."""
    deadline = time.monotonic() + timeout
    while True:
        answer = services.api.get(f"{services.base_url}{API}", params={"dag_id": dag_id})
        assert answer.status_code == 200, answer.text
        found = [job for job in answer.json()["jobs"] if until(job)]
        if found:
            return dict(found[0])
        assert time.monotonic() < deadline, f"{dag_id}: no job such that {until} in {answer.json()}"
        time.sleep(1)


def _screenshot_of_table(page: Any, path: Path) -> None:
    """The page down to the end of the jobs table (Airflow's navigation included), not the empty rest of it."""
    box = page.locator("[data-testid=training-jobs]").bounding_box()
    height = max(300, int(box["y"] + box["height"]) + 24)
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": page.viewport_size["width"], "height": height})


def test_training_jobs_page_and_tab(airflow_services: AirflowServices, page: Any, artifacts: Path) -> None:
    base = airflow_services.base_url
    ok_run = airflow_services.trigger_dag("ui_metrics")
    bad_run = airflow_services.trigger_dag("ui_failure")

    # While the job runs it comes from Kubernetes: its state, and its loss so far from rank 0's log.
    live = _wait_for_job(airflow_services, "ui_metrics", lambda job: job["phase"] == "running" and job["sparkline"])
    assert live["source"] == "kubernetes" and live["pods_total"] == 2
    page.goto(f"{base}/plugin/training-jobs")
    running = page.locator("[data-testid=job-row][data-phase=running]", has_text="ui_metrics")
    running.wait_for(timeout=SHOWN_WITHIN)
    running.locator("[data-testid=sparkline]").wait_for(timeout=SHOWN_WITHIN)
    _screenshot_of_table(page, artifacts / "training-jobs-running.png")

    assert airflow_services.wait_for_run("ui_metrics", ok_run, timeout=240) == "success", airflow_services.describe()
    assert airflow_services.wait_for_run("ui_failure", bad_run, timeout=240) == "failed", airflow_services.describe()

    # Ended: from the summaries the tasks saved (the succeeded PyTorchJob is deleted by then).
    page.goto(f"{base}/plugin/training-jobs")
    done = page.locator("[data-testid=job-row][data-phase=succeeded]", has_text="ui_metrics")
    failed = page.locator("[data-testid=job-row][data-phase=failed]", has_text="ui_failure")
    done.wait_for(timeout=SHOWN_WITHIN)
    failed.wait_for(timeout=SHOWN_WITHIN)
    assert done.locator("[data-testid=sparkline]").get_attribute("data-points") == str(STEPS)
    assert done.locator("[data-testid=pods]").inner_text() == "0/2"
    assert "diverged" in failed.inner_text()
    _screenshot_of_table(page, artifacts / "training-jobs.png")

    # The tab of the reporting task: one chart per metric, one point per reported step.
    page.goto(tab_url(base, "ui_metrics", ok_run, "train"))
    page.locator("[data-testid=training-job]").wait_for(timeout=SHOWN_WITHIN)
    for metric in ("loss", "accuracy"):
        chart = page.locator(f"[data-testid=metric-chart][data-metric={metric}]")
        assert chart.locator("circle").count() == STEPS, metric
    steps = page.locator("[data-testid=metric-chart][data-metric=loss] circle").evaluate_all(
        "circles => circles.map(c => Number(c.dataset.step))"
    )
    assert steps == list(range(1, STEPS + 1))
    assert page.locator("[data-testid=pod-row]").count() == 2
    # Rank 0's tensor: an artifact in the summary, listed with where it is in the value and its size.
    row = page.locator("[data-testid=artifact-row]")
    assert row.count() == 1 and row.get_attribute("data-kind") == "tensor"
    assert int(row.get_attribute("data-bytes") or 0) > WEIGHTS * 4
    assert "weights" in row.inner_text() and "/artifacts/" in row.inner_text()
    page.screenshot(path=str(artifacts / "training-job-tab-metrics.png"), full_page=True)

    # The tab of the failed task: its pods, which one failed, and the root cause.
    page.goto(tab_url(base, "ui_failure", bad_run, "train_diverges"))
    cause = page.locator("[data-testid=root-cause]")
    cause.wait_for(timeout=SHOWN_WITHIN)
    assert "loss diverged to nan at step 6" in cause.inner_text()
    assert page.locator("[data-testid=pod-row]").count() == 2
    assert page.locator("[data-testid=pod-row][data-phase=Failed]").count() >= 1
    page.screenshot(path=str(artifacts / "training-job-tab.png"), full_page=True)

    # Another task's tab: one line saying there is no training job (the tab shows on every task in Airflow 3.3).
    page.goto(tab_url(base, "ui_metrics", ok_run, "publish"))
    page.locator("[data-testid=no-training-job]").wait_for(timeout=SHOWN_WITHIN)

"""What each training framework logs, in the "Training job" tab: the deployment (tests/airflow_services) runs the
Hugging Face Trainer, Lightning and accelerate examples of example_dags/framework_training.py once, locally on 2
workers (tests/deployment_dags/ui_frameworks.py), and headless Chromium opens each task's tab.

The tab must show the job summary's series under the framework's own metric names, point for point: a chart per
metric logged along the way, the loss first, and a table of the values logged once (the Trainer's end-of-training
totals). The jobs list's sparkline shows the framework's loss. Screenshots ``training-job-tab-<framework>.png`` are
saved as test artifacts (``$TORCHELASTIC_UI_ARTIFACTS``, else pytest's temporary dir).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary
from tests.airflow_services.services import AirflowServices
from tests.ui.conftest import API, SHOWN_WITHIN, tab_url

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DAG_ID = "ui_frameworks"


@dataclass(frozen=True, kw_only=True)
class Logged:
    """What one framework's example logs (tests/deployment_dags/ui_frameworks.py runs it for ``steps`` steps)."""

    #: Metrics logged at every step, at these steps (Lightning and accelerate count from 0, the Trainer from 1).
    every_step: tuple[str, ...]
    steps: tuple[int, ...]
    #: Its loss, which the list's sparkline shows and the tab charts first.
    loss: str
    #: Metrics logged once, at the end: shown as values, not as one-point charts.
    once: tuple[str, ...] = ()


LOGGED = {
    "transformers": Logged(
        every_step=("loss", "learning_rate", "grad_norm", "epoch"),
        steps=tuple(range(1, 7)),
        loss="loss",
        once=("train_loss", "train_runtime"),
    ),
    "lightning": Logged(every_step=("train_loss", "epoch"), steps=tuple(range(8)), loss="train_loss"),
    "accelerate": Logged(every_step=("loss",), steps=tuple(range(8)), loss="loss"),
}
#: Seconds the three trainings may take together: each imports its framework in 2 workers, on 2 shared cores.
RUN_TIMEOUT = 420


@pytest.fixture(scope="module")
def framework_run(airflow_services: AirflowServices) -> str:
    """The run of ui_frameworks, once for the module: its three tasks train at the same time (about a minute)."""
    run_id = airflow_services.trigger_dag(DAG_ID)
    state = airflow_services.wait_for_run(DAG_ID, run_id, timeout=RUN_TIMEOUT)
    assert state == "success", _task_logs(airflow_services, run_id) or airflow_services.describe()
    return run_id


def _task_logs(services: AirflowServices, run_id: str, tail: int = 4000) -> str:
    """The tail of each task's log, for a failure message."""
    folder = services.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-tail:]}" for log in sorted(folder.glob("*/*.log")))


def _screenshot_of_tab(page: Any, path: Path) -> None:
    """The tab down to its pods table: the window made as tall as that first, since Airflow's page scrolls inside a
    panel, which a full-page screenshot would cut at the window's height."""
    viewport = page.viewport_size
    box = page.locator("[data-testid=pods-table]").bounding_box()
    bottom = int(box["y"] + box["height"]) + 24 if box else viewport["height"]
    page.set_viewport_size({"width": viewport["width"], "height": max(viewport["height"], bottom)})
    try:
        page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": viewport["width"], "height": bottom})
    finally:
        page.set_viewport_size(viewport)


@pytest.mark.parametrize("framework", list(LOGGED))
def test_the_tab_charts_what_the_framework_logged(
    framework: str, framework_run: str, airflow_services: AirflowServices, page: Any, artifacts: Path
) -> None:
    logged = LOGGED[framework]
    summary = JobSummary.from_json(airflow_services.xcom(DAG_ID, framework_run, framework, XCOM_KEY))
    assert summary.phase == "succeeded", summary
    assert {*logged.every_step, *logged.once} <= set(summary.metrics), summary.metrics
    (row,) = airflow_services.api.get(
        f"{airflow_services.base_url}{API}", params={"dag_id": DAG_ID, "task_id": framework}
    ).json()["jobs"]
    assert row["sparkline"]["metric"] == logged.loss, row["sparkline"]

    page.goto(tab_url(airflow_services.base_url, DAG_ID, framework_run, framework))
    try:
        page.locator("[data-testid=pods-table]").wait_for(timeout=SHOWN_WITHIN)
    finally:  # what a person sees, also when the tab never came
        _screenshot_of_tab(page, artifacts / f"training-job-tab-{framework}.png")
    charts = page.locator("[data-testid=metric-chart]")
    drawn = {
        chart.get_attribute("data-metric"): chart.locator("circle").evaluate_all(
            "circles => circles.map(c => [Number(c.dataset.step), Number(c.dataset.value)])"
        )
        for chart in charts.all()
    }
    values = {
        value.get_attribute("data-metric"): [[float(value.get_attribute(f"data-{key}")) for key in ("step", "value")]]
        for value in page.locator("[data-testid=metric-value]").all()
    }
    # Every series of the summary is shown under the framework's own name, point for point: a curve as a chart, a
    # value reported once in the table under the charts.
    assert set(drawn) | set(values) == set(summary.metrics), (drawn, values, summary.metrics)
    for name, points in summary.metrics.items():
        assert {**drawn, **values}[name] == [[step, value] for step, value in points], name
    assert set(logged.once) <= set(values), values
    for name in logged.every_step:
        # One point a step (the Trainer logs `epoch` once more with its end-of-training totals, at the last step).
        assert sorted({step for step, _ in drawn[name]}) == list(logged.steps), (name, drawn[name])
        assert all(math.isfinite(value) for _, value in drawn[name]), (name, drawn[name])
    assert charts.first.get_attribute("data-metric") == logged.loss
    loss = drawn[logged.loss]
    assert loss[-1][1] < loss[0][1], f"{framework}: the loss did not fall: {loss}"
    # One local node, whose 2 workers trained.
    assert page.locator("[data-testid=pod-row]").count() == 1

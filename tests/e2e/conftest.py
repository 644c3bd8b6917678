"""End-to-end DAG files are parsed as a folder: every Kubernetes task in it needs an image where it is parsed."""

from __future__ import annotations

import pytest

from tests.dag_support import SIM_IMAGE

#: The runner image of the local test cluster (its kubelet runs the runner env; the name only has to be valid).
RUNNER_IMAGE = SIM_IMAGE


@pytest.fixture(autouse=True)
def _configured_image(monkeypatch: pytest.MonkeyPatch) -> None:
    # DAGs that name no image (te_execution_from_config, the quickstart) take [torch_elastic] image, as a
    # deployment's dag-processor and workers would; a test that wants none deletes it.
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__IMAGE", RUNNER_IMAGE)

"""A DAG for the browser test of framework metrics (tests/ui/test_framework_metrics.py): the training functions of
example_dags/framework_training.py (Hugging Face Trainer, Lightning, accelerate, each with the provider's integration)
run once each, locally on 2 workers in the deployment's worker, so that the Training job tab shows what each
framework really logged.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator

#: The checkout, where example_dags is: a folder, not an installed package, and neither the deployment's processes
#: nor the workers they start have it on their path.
REPO_ROOT = str(Path(__file__).resolve().parents[2])
#: The examples' arguments (their own defaults: the same steps as tests/dags/frameworks_e2e.py, no interruption).
FRAMEWORKS: dict[str, dict[str, Any]] = {
    "transformers": {"steps": 6, "save_steps": 2},
    "lightning": {"steps": 8, "save_every": 4},
    "accelerate": {"steps": 8, "save_every": 4},
}


def train_example(framework: str, **kwargs: Any) -> dict[str, Any]:
    import sys

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    from example_dags import framework_training

    result: dict[str, Any] = getattr(framework_training, f"train_{framework}")(**kwargs)
    return result


with DAG(
    "ui_frameworks",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 0, "execution_timeout": timedelta(minutes=4)},
):
    for name, kwargs in FRAMEWORKS.items():
        TorchElasticOperator(
            task_id=name,
            python_callable=train_example,
            op_kwargs={"framework": name, **kwargs},
            task_config=Elastic(nproc_per_node=2, monitor_interval=0.5),
            execution="local",
        )

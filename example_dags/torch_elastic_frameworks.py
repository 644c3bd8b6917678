"""Hugging Face ``transformers``, Lightning and ``accelerate`` under torch_elastic tasks, each with the provider's
integration (``airflow_provider_torchelastic.integrations``): their metrics in the job summary and the UI, their
checkpoints in the task's checkpoint location, so that a retry resumes from the newest complete one.

The training functions are in example_dags/framework_training.py. Set ``[torch_elastic] checkpoint_root`` (or the
tasks' ``checkpoint_uri=``) so that checkpoints outlive a try. ``interrupt`` (a DAG param) makes each task's first try
fail recoverably right after its first checkpoint, to show a retry resuming. docs/guides/integrations.md shows it.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

# A module beside the DAG file: Airflow puts the DAG bundle's folder on sys.path while it parses and runs the file, and
# the provider ships such a module with the payload, so the pods need no copy of it.
from framework_training import train_accelerate, train_lightning, train_transformers

from airflow_provider_torchelastic import Elastic, TorchElasticOperator

with DAG(
    "torch_elastic_frameworks",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=0)},
    params={"interrupt": False},
    render_template_as_native_obj=True,
    tags=["example", "torch_elastic"],
):
    for function, config in (
        (train_transformers, Elastic(nproc_per_node=2)),
        (train_lightning, Elastic(nnodes="1:2", nproc_per_node=1)),
        (train_accelerate, Elastic(nproc_per_node=2)),
    ):
        TorchElasticOperator(
            task_id=function.__name__,
            python_callable=function,
            op_kwargs={"interrupt": "{{ params.interrupt }}"},
            task_config=config,
        )

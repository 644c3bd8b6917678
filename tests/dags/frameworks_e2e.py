"""DAGs for tests/e2e/test_local_frameworks.py: the examples of example_dags/framework_training.py (Hugging Face
Trainer, Lightning, accelerate with the provider's integrations) on 2 workers each, locally.

Each ``train`` task's first try fails recoverably right after its first checkpoint; the second resumes from it, trains
to the end, and then, in the same processes (the frameworks' imports are most of a task's time), trains the same
model uninterrupted under another run's context (its own checkpoint location and local folders, its metrics not
reported), so that the test can compare the two final losses.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from example_dags.framework_training import train_accelerate, train_lightning, train_transformers
from tests.dag_support import recording_dag

EXAMPLES = {"transformers": train_transformers, "lightning": train_lightning, "accelerate": train_accelerate}
#: The reference run's suffix of the run id and of the checkpoint location.
REFERENCE = "-reference"


def resumed_then_uninterrupted(framework: str, **kwargs: Any) -> dict[str, Any]:
    import dataclasses
    import os
    from unittest import mock

    from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext

    train = EXAMPLES[framework]
    resumed = train(interrupt=True, **kwargs)
    task = TaskContext.from_env_value(os.environ[CONTEXT_ENV])
    assert task.checkpoint_uri is not None
    other = dataclasses.replace(
        task, run_id=task.run_id + REFERENCE, checkpoint_uri=task.checkpoint_uri + REFERENCE, try_number=1
    )
    os.environ[CONTEXT_ENV] = other.to_env_value()
    try:
        with mock.patch(f"airflow_provider_torchelastic.integrations.{framework}.report"):
            uninterrupted = train(interrupt=False, **kwargs)
    finally:
        os.environ[CONTEXT_ENV] = task.to_env_value()
    return {"resumed": resumed, "uninterrupted": uninterrupted, "location": task.checkpoint_uri}


def misconfigured_lightning() -> None:
    """A LightningModule without training_step: Lightning's MisconfigurationException, which no retry fixes."""
    import lightning.pytorch as pl
    import torch

    from airflow_provider_torchelastic.integrations import lightning as te_lightning

    class NoTrainingStep(pl.LightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), batch_size=2)
    pl.Trainer(max_steps=1, accelerator="cpu", enable_progress_bar=False, **te_lightning.trainer_kwargs()).fit(
        NoTrainingStep(), data
    )


LOCAL = {"execution": "local"}
TWO_WORKERS = Elastic(nproc_per_node=2, monitor_interval=0.5)

with recording_dag("te_frameworks_transformers", execution_timeout_minutes=4, retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=resumed_then_uninterrupted,
        op_kwargs={"framework": "transformers", "steps": 6, "save_steps": 2},
        task_config=TWO_WORKERS,
        **LOCAL,
    )

with recording_dag("te_frameworks_lightning", execution_timeout_minutes=4, retries=1, retry_delay=timedelta(0)):
    # Elastic, 1 to 2 nodes: locally it starts 2 nodes of 1 worker, and num_nodes=2, devices=1 come from the job.
    TorchElasticOperator(
        task_id="train",
        python_callable=resumed_then_uninterrupted,
        # A checkpoint at the end of an epoch (4 batches a rank): Lightning's resume is exact there, not mid-epoch.
        op_kwargs={"framework": "lightning", "steps": 8, "save_every": 4},
        task_config=Elastic(nnodes="1:2", nproc_per_node=1, monitor_interval=0.5),
        **LOCAL,
    )
    # The same code on 1 node of 2 workers: num_nodes=1, devices=2.
    TorchElasticOperator(
        task_id="one_node",
        python_callable=train_lightning,
        op_kwargs={"steps": 4, "save_every": 2},
        task_config=TWO_WORKERS,
        **LOCAL,
    )
    TorchElasticOperator(
        task_id="misconfigured",
        python_callable=misconfigured_lightning,
        task_config=Elastic(nproc_per_node=1, monitor_interval=0.5),
        **LOCAL,
    )

with recording_dag("te_frameworks_accelerate", execution_timeout_minutes=4, retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=resumed_then_uninterrupted,
        op_kwargs={"framework": "accelerate", "steps": 8, "save_every": 2},
        task_config=TWO_WORKERS,
        **LOCAL,
    )

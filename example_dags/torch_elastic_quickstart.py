"""Quickstart: train a small classifier with DistributedDataParallel on 2 workers, then print rank 0's result.

Runs locally (``AIRFLOW__TORCH_ELASTIC__EXECUTION=local``) or on Kubernetes (the default) without a change: on
Kubernetes the pod runs the image of the Airflow option ``[torch_elastic] image`` (``AIRFLOW__TORCH_ELASTIC__IMAGE``),
which must then be set where the DAG is parsed and where it runs. Nothing is downloaded: the data set is generated,
with a fixed seed, inside the training function. The function and the helpers beside it are shipped to the workers
by value, so they need not exist where training runs.

Retries resume: with a checkpoint location (the Airflow option ``[torch_elastic] checkpoint_root``; the quickstart
script sets one under ``.demo/``), every epoch is checkpointed and a retried try continues after the last complete
checkpoint instead of starting over. ``interrupt_at_epoch`` (a DAG param) makes the first try fail recoverably after
that epoch, to show it: ``python scripts/quickstart.py --interrupt-at 10``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchelastic import Elastic

N_CLASSES = 4
N_FEATURES = 16


def make_dataset(n_samples: int, seed: int):  # -> tuple[Tensor, Tensor]
    """Four classes on a noisy nonlinear manifold: a linear model cannot solve it, a small MLP can."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, N_CLASSES, (n_samples,), generator=gen)
    angle = labels.float() * (2 * torch.pi / N_CLASSES) + 0.35 * torch.randn(n_samples, generator=gen)
    radius = 1.0 + 0.25 * torch.randn(n_samples, generator=gen)
    plane = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    # Embed the 2-D structure in N_FEATURES dimensions through a fixed random nonlinear map, plus noise.
    mix = torch.randn(2, N_FEATURES, generator=torch.Generator().manual_seed(0))
    features = torch.tanh(plane @ mix) + 0.1 * torch.randn(n_samples, N_FEATURES, generator=gen)
    return features, labels


@task.torch_elastic(task_config=Elastic(nnodes=1, nproc_per_node=2), retries=1, retry_delay=timedelta(seconds=1))
def train(epochs: int = 30, lr: float = 0.05, interrupt_at_epoch: int | str = -1) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_torchelastic import RecoverableError, checkpoint, context, report

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)

    x_train, y_train = make_dataset(4096, seed=1)
    x_test, y_test = make_dataset(1024, seed=2)
    # Each rank trains on its own shard; DDP averages the gradients.
    x_shard, y_shard = x_train[rank::world_size].to(device), y_train[rank::world_size].to(device)

    model = nn.Sequential(nn.Linear(N_FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))
    ddp = DistributedDataParallel(model.to(device))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.zeros((), device=device)

    ctx = context.current()
    # A retried try (or one the node's agent restarted) continues after the last complete checkpoint of this task
    # instance; the first try of a run finds none. Every rank loads it, so the replicas start equal.
    loaded = checkpoint.load_latest(map_location=device) if ctx.checkpoint_uri else None
    first_epoch = 0
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        first_epoch = loaded.step + 1
        if rank == 0:
            print(f"try {ctx.try_number}: resuming after epoch {loaded.step} from {loaded.uri}")
    for epoch in range(first_epoch, epochs):
        for start in range(0, len(x_shard), 128):
            optimizer.zero_grad()
            loss = loss_fn(ddp(x_shard[start : start + 128]), y_shard[start : start + 128])
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            epoch_accuracy = (model(x_test.to(device)).argmax(dim=1) == y_test.to(device)).float().mean()
        # Rank 0's values become progress lines in the task log and charts in the Airflow UI (other ranks: no-op).
        report(step=epoch, loss=loss, accuracy=epoch_accuracy)
        if ctx.checkpoint_uri:
            # Rank 0 writes (the replicas are equal); a write cut off midway is never taken as the latest.
            checkpoint.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step=epoch)
        if ctx.try_number == 1 and epoch == int(interrupt_at_epoch):
            raise RecoverableError(f"interrupted after epoch {epoch} (interrupt_at_epoch), to show a retry resuming")

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # average the last batch loss over ranks
    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(dim=1) == y_test.to(device)).float().mean().item()
    dist.destroy_process_group()
    return {
        "world_size": world_size,
        "final_loss": round(mean_loss.item() / world_size, 4),
        "accuracy": round(accuracy, 4),
        "epochs": epochs,
        "try_number": ctx.try_number,
        "resumed_after_epoch": loaded.step if loaded is not None else None,
    }


@task
def report(metrics: dict) -> None:
    print(
        f"Trained on {metrics['world_size']} workers: held-out accuracy {metrics['accuracy']:.1%}, "
        f"final loss {metrics['final_loss']}"
    )


@dag(
    dag_id="torch_elastic_quickstart",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1),
    catchup=False,
    tags=["example", "torch_elastic"],
    params={"interrupt_at_epoch": -1},
)
def torch_elastic_quickstart():
    report(train(interrupt_at_epoch="{{ params.interrupt_at_epoch }}"))


torch_elastic_quickstart()

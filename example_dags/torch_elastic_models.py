"""Models between tasks: ``init_model -> train(config, model) -> evaluate(model)``.

``init_model`` (a training task on one worker) returns a freshly initialised Module and a dataclass config; the Module
travels as an artifact (its state dict, in safetensors, under ``[torch_elastic] artifact_storage``, which defaults to
``result_storage``) and the XCom holds a plain-JSON reference to it. ``train`` gets the model's state dict
materialized in its workers (nothing is loaded on the Airflow worker), trains with DistributedDataParallel on 2
workers, and returns the trained Module. ``evaluate`` (a plain task) loads it with ``artifacts.load(..., into=...)``
and emits an event of the fixed asset ``torchelastic-models/classifier`` whose extra carries the model's URL and
sha256, so that a downstream DAG scheduled on that asset gets each new model.

Runs locally (``AIRFLOW__TORCH_ELASTIC__EXECUTION=local``) or on Kubernetes (the default, with
``[torch_elastic] image``); either way it needs artifact storage reachable from the workers and the Airflow side.
"""

from __future__ import annotations

import dataclasses

import pendulum
from airflow.sdk import Asset, dag, task

from airflow_provider_torchelastic import Elastic

#: Each run's evaluation emits an event of this asset, its extra naming the trained model's artifact.
MODEL_ASSET = Asset("torchelastic-models/classifier")
N_FEATURES = 16
N_CLASSES = 4


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 20
    lr: float = 0.05
    hidden: int = 32


def make_model(hidden: int):  # -> torch.nn.Module (torch is imported where it runs, never at parse)
    from torch import nn

    return nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


def make_dataset(n_samples: int, seed: int):  # -> tuple[Tensor, Tensor]
    import torch

    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, N_CLASSES, (n_samples,), generator=gen)
    centers = torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(0))
    return centers[labels] + 0.5 * torch.randn(n_samples, N_FEATURES, generator=gen), labels


@task.torch_elastic(task_config=Elastic(nproc_per_node=1))
def init_model() -> dict:
    import torch

    config = TrainConfig()
    torch.manual_seed(0)
    # A Module anywhere in rank 0's value becomes an artifact; the dataclass becomes a JSON object of its fields.
    return {"model": make_model(config.hidden), "config": config}


@task.torch_elastic(task_config=Elastic(nproc_per_node=2))
def train(config: dict, model: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    net = make_model(config["hidden"])
    net.load_state_dict(model)  # the upstream Module, materialized as its state dict in every worker
    ddp = DistributedDataParallel(net)
    features, labels = make_dataset(2048, seed=1 + dist.get_rank())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config["lr"])
    for _ in range(config["epochs"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(features), labels)
        loss.backward()
        optimizer.step()
    # Rank 0's value: the DDP wrapper is unwrapped, the Module saved as its state dict plus its class path.
    return {"model": ddp, "loss": loss.item()}


@task(outlets=[MODEL_ASSET])
def evaluate(config: dict, trained: dict, *, outlet_events=None) -> dict:
    import torch

    from airflow_provider_torchelastic import artifacts

    net = artifacts.load(trained["model"], into=make_model(config["hidden"]))
    features, labels = make_dataset(1024, seed=99)
    with torch.no_grad():
        accuracy = (net(features).argmax(dim=1) == labels).float().mean().item()
    if outlet_events is not None:
        outlet_events[MODEL_ASSET].extra = {"model_url": trained["model"]["url"], "sha256": trained["model"]["sha256"]}
    return {"accuracy": accuracy, "train_loss": trained["loss"], "model_url": trained["model"]["url"]}


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False, tags=["torch_elastic"])
def torch_elastic_models():
    first = init_model()
    evaluate(first["config"], train(first["config"], first["model"]))


torch_elastic_models()

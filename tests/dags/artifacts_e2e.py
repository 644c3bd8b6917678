"""The DAGs of tests/e2e/test_local_artifacts.py and test_kubernetes_artifacts.py (issue 23): models and tensors
between tasks, locally (``te_artifacts``) and on the real node of the local cluster (``k8s_artifacts``), the same
tasks.

``init_model`` (a training task) returns a Module, a 100 MB state dict, a numpy array, a dataclass and a state dict
of 300 small tensors, whose references alone outgrow the 4096-byte result file (so the value travels through result
storage); ``train(config, model, sample)`` (two workers, DDP) gets the model's state dict materialized in its workers
and a 5 MB tensor argument, and returns the trained Module DDP-wrapped; ``evaluate`` (a plain task) loads every
artifact with ``artifacts.load`` and returns plain JSON the test checks. Artifact storage comes from the Airflow
options the test sets. On Kubernetes ``train`` is a PyTorchJob (Master and one Worker: rank 0 on the master), and
the pods get the S3 server's endpoint and credentials through their env (PodOptions), read from
TORCHELASTIC_TEST_POD_ENV when the file is parsed, as they would get them from a Secret, and mount the folder the
file:// store is in (tests/dag_support.py's shared_folder_mount).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_torchelastic import Elastic, Master, PyTorch, Worker
from airflow_provider_torchelastic.pod import PodOptions
from tests.dag_support import pod_image, shared_folder_mount

START = pendulum.datetime(2026, 1, 1, tz="UTC")
#: 4 tensors of 25 MB: a 100 MB state dict.
BIG_TENSORS, BIG_ELEMENTS = 4, 25 * (1 << 20) // 4
#: A 5 MB tensor argument, over the payload's limit.
SAMPLE_ELEMENTS = 5 * (1 << 20) // 8
#: A state dict of 300 two-element tensors: its reference lists each tensor, about 10 kB of JSON.
WIDE_TENSORS = 300


@dataclasses.dataclass
class TrainConfig:
    lr: float
    steps: int


def make_net():  # torch is imported where it runs (workers, the evaluating task), never at parse
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 2)

    torch.manual_seed(0)
    return Net()


def big_state_dict() -> dict:
    import torch

    return {f"layer{i}.weight": torch.full((BIG_ELEMENTS,), float(i) + 0.5) for i in range(BIG_TENSORS)}


def wide_state_dict() -> dict:
    import torch

    return {f"w{i}": torch.full((2,), float(i)) for i in range(WIDE_TENSORS)}


def sample() -> object:
    import torch

    return torch.arange(SAMPLE_ELEMENTS, dtype=torch.float64)


def pod_env() -> dict[str, str]:
    return dict(json.loads(os.environ.get("TORCHELASTIC_TEST_POD_ENV") or "{}"))


def artifacts_dag(dag_id: str, init_config: Any, train_config: Any, **settings: Any) -> DAG:
    """The three tasks; ``settings`` (execution, image, ...) go to both training tasks."""
    with DAG(dag_id, start_date=START, schedule=None, catchup=False) as dag:

        @task.torch_elastic(task_config=init_config, **settings)
        def init_model() -> dict:
            import numpy as np

            return {
                "model": make_net(),
                "big": big_state_dict(),
                "array": np.arange(12, dtype=np.float64).reshape(3, 4),
                "config": TrainConfig(lr=0.5, steps=2),
                "wide": wide_state_dict(),
            }

        @task.torch_elastic(task_config=train_config, **settings)
        def train(config: dict, model: dict, sample: object) -> dict:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            net = make_net()
            with torch.no_grad():
                net.fc.weight.zero_()
            # The reference arrived materialized: the workers got the upstream model's state dict.
            net.load_state_dict(model)
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            with torch.no_grad():
                for _ in range(config["steps"]):
                    net.fc.bias.add_(config["lr"])
            received = float(sample.sum()) if isinstance(sample, torch.Tensor) else -1.0
            dist.barrier()
            return {"model": ddp, "sample_sum": received, "sample_type": type(sample).__name__, "rank": dist.get_rank()}

        @task
        def evaluate(init: dict, trained: dict) -> dict:
            import numpy as np
            import torch

            from airflow_provider_torchelastic import artifacts

            upstream = artifacts.load(init)
            big = upstream["big"]
            net = artifacts.load(trained["model"], into=make_net())
            return {
                "model_keys": sorted(upstream["model"]),
                "model_equal": bool(torch.equal(upstream["model"]["fc.weight"], make_net().fc.weight.detach())),
                "big_ok": all(
                    bool(torch.all(big[f"layer{i}.weight"] == i + 0.5))
                    and big[f"layer{i}.weight"].numel() == BIG_ELEMENTS
                    for i in range(BIG_TENSORS)
                ),
                "wide_ok": list(upstream["wide"]) == [f"w{i}" for i in range(WIDE_TENSORS)]
                and all(bool(torch.all(tensor == i)) for i, tensor in enumerate(upstream["wide"].values())),
                "array": np.asarray(upstream["array"]).tolist(),
                "config": upstream["config"],
                "trained_bias": net.fc.bias.tolist(),
                "sample_sum": trained["sample_sum"],
                "sample_type": trained["sample_type"],
            }

        first = init_model()
        trained = train(first["config"], first["model"], sample())
        evaluate(first, trained)
    return dag


# fork: the workers start without importing torch again (the e2e tests' time); spawn is the runner tests' business.
artifacts_dag(
    "te_artifacts",
    Elastic(nproc_per_node=1, start_method="fork"),
    Elastic(nproc_per_node=2, start_method="fork"),
    execution="local",
)
# On the cluster the pods keep the default spawn (tests/dags/k8s_e2e.py says why); train is two pods.
artifacts_dag(
    "k8s_artifacts",
    Elastic(nproc_per_node=1, monitor_interval=0.5),
    PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
    execution="kubernetes",
    image=pod_image(),
    poll_interval=1,
    pending_grace_seconds=5,
    # On the real node the pods mount the folder the file:// test stores in (shared_folder_mount).
    pod_options=PodOptions(env=pod_env(), **shared_folder_mount()),
)

"""DAGs for tests/e2e/test_trainjob.py (the simulated kubelet) and tests/e2e/test_trainjob_on_node.py (the real node):
tasks run as Kubeflow Trainer v2 TrainJobs on the local cluster, whose simulated Trainer controller
(tests/cluster/sim_trainer.py) goes TrainJob -> JobSet -> indexed Job -> pods. The simulated kubelet runs each node's
pod as local processes; the real node runs the runner image (tests/dag_support.pod_image), and the rendezvous at
``<tj>-node-0-0.<tj>`` goes through the cluster DNS to a pod IP."""

from __future__ import annotations

import os

from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.pod import JobOptions, PodOptions
from tests.dag_support import fail_on_rank_1, pod_image, recording_dag

IMAGE = pod_image()
FAST = {"image": IMAGE, "execution": "kubernetes", "poll_interval": 1, "pending_grace_seconds": 5}


def _dag(dag_id: str, **default_args: object) -> DAG:
    return recording_dag(dag_id, execution_timeout_minutes=4, **default_args)


def two_nodes() -> Elastic:
    return Elastic(nnodes=2, nproc_per_node=1, monitor_interval=0.5)


def train_ddp(steps: int) -> dict:
    """A small DDP regression on every node: the loss rank 0 ends with, the world it ran in, and where it ran."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(64, 4, generator=data)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    return {"world_size": world, "rank": rank, "loss": float(loss), "node_rank": int(os.environ["GROUP_RANK"])}


# No job_kind: [torch_elastic] job_kind decides (the test changes only that option).
with _dag("k8s_two_node_training"):
    TorchElasticOperator(task_id="train", python_callable=train_ddp, op_args=[40], task_config=two_nodes(), **FAST)

# Node 1's function raises: the task fails at once (the runtime would restart the node in place), naming the pod.
# Node 0's rank returns at once, and its agent then waits in torch elastic's exit barrier for node 1's, which never
# comes (300 s): deleted with the TrainJob, a real node's pod ends only when its grace period does, so keep it short.
with _dag("k8s_trainjob_node_fails", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=fail_on_rank_1,
        task_config=two_nodes(),
        job_kind="trainjob",
        termination_grace_period=5,
        **FAST,
    )

# One node OOM-killed on the first try (the fault counts per DAG run): recoverable, the retry's new TrainJob succeeds.
# Twice: the runtime restarts a failed node in place (OnFailure), and a node restarted once, early, can still join
# its peers' rendezvous and complete the job inside the wait's 5 s settle; the second kill and the doubled restart
# backoff keep the first TrainJob from completing before the wait fails it.
with _dag("k8s_trainjob_oom_retried", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=train_ddp,
        op_args=[5],
        task_config=two_nodes(),
        job_kind="trainjob",
        deferrable=True,
        pod_options=PodOptions(
            annotations={
                "sim.torchelastic.dev/fail": "OOMKilled",
                # The whole container, as cgroup v2's group kill does: 0.5 s in, before or after the runner started
                # its worker, the same shape (a kernel's kill of one worker is tests/e2e/test_root_cause_on_node.py's).
                "sim.torchelastic.dev/oom-kills": "whole-container",
                "sim.torchelastic.dev/fail-after-seconds": "0.5",
                "sim.torchelastic.dev/fail-times": "2",
                "sim.torchelastic.dev/fail-times-scope": "torchelastic.airflow.apache.org/run-id",
            }
        ),
        **FAST,
    )

# Created suspended (as Kueue's webhook does): waits as queued until the test resumes it.
with _dag("k8s_trainjob_suspended"):
    TorchElasticOperator(
        task_id="train",
        python_callable=train_ddp,
        op_args=[5],
        task_config=two_nodes(),
        job_kind="trainjob",
        deferrable=True,
        job_options=JobOptions(suspend=True),
        **FAST,
    )

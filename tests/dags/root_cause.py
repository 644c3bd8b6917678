"""DAGs for the root-cause tests (tests/e2e/test_root_cause.py): failures that come close together.

When one rank or pod fails, its peers fail within milliseconds (a collective's closed connection, a lost rendezvous
store); the task must blame the cause and retry when the cause is worth a retry.

* ``rc_local_recoverable_after_collective``: local, one node with 2 ranks that pass an all_reduce and then both
  raise ``RecoverableError`` on try 1. The agent polls every 2 s, so it finds both failed at once.
* ``rc_k8s_oom_worker_0`` / ``rc_k8s_oom_worker_1``: an elastic 2-node PyTorchJob whose pod of that replica index is
  OOMKilled (the simulated kubelet's fault) on try 1 while both ranks are in a loop of barriers; the other pod then
  fails in the same second (a closed connection, or a lost c10d store when the killed pod hosted it). Worker 0 has
  one worker killed, as cgroup v1's kernel does (its runner reports the rank's SIGKILL); worker 1 its whole
  container, as cgroup v2's group kill does (exit 137, no report).
* ``rc_node_oom`` (the real node, tests/e2e/test_root_cause_on_node.py): the same job with a real memory limit on
  both pods; on try 1 the worker of one pod fills memory past it and the kernel's OOM killer ends it, on the store
  host (task ``store_host``) and on the other pod (task ``other_pod``).

Training functions live in this file and travel by value. Everything is kept cheap: one process per node where a
Kubernetes pod runs it, tiny collectives.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, RecoverableError, TorchElasticOperator
from airflow_provider_torchelastic.core.naming import LABEL_RUN_ID
from airflow_provider_torchelastic.pod import PodOptions
from tests.dag_support import pod_image, record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
IMAGE = "local/torchelastic-runner:test"
#: The faulted pod is OOMKilled this many seconds after it says it joined the process group: while both ranks run
#: their barriers, on a fast machine and a slow one alike.
JOINED = "joined the process group"
OOM_AFTER_SECONDS = 2
#: How long try 1's ranks run their barriers if nothing kills them (the test then fails on its assertions).
TRAIN_SECONDS = 120


class ShardUnavailableError(RecoverableError):
    """A recoverable error of the DAG author's own."""


def recoverable_on_every_rank_after_a_collective(try_number: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    if int(try_number) == 1:
        raise ShardUnavailableError(f"rank {rank}: shard server unavailable on try {try_number}")
    dist.destroy_process_group()
    return {"try_number": int(try_number), "rank": rank, "sum": value.item()}


def rank_1_fails_while_rank_0_waits_in_a_collective(try_number: str) -> dict:
    """Try 1: rank 1 raises ``RecoverableError`` right after a barrier; rank 0 enters a second barrier that rank 1
    never joins, so it is held there until rank 1's process has exited, and then fails of the closed connection (a
    consequence, and the later failure, whatever order the agent finds them in). Later tries: one barrier."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if int(try_number) == 1:
        if rank == 1:
            raise ShardUnavailableError(f"rank 1: checkpoint shard unavailable on try {try_number}")
        dist.barrier()  # returns only with the error of rank 1's exit
        raise AssertionError("rank 0 passed a barrier that rank 1 never entered")
    dist.destroy_process_group()
    return {"try_number": int(try_number), "rank": rank}


def barriers_until_killed(try_number: str) -> dict:
    """Try 1: barriers, every 0.1 s, until a pod is killed (the peers then fail in theirs). Later tries: one."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} {JOINED}", flush=True)
    deadline = time.monotonic() + (TRAIN_SECONDS if int(try_number) == 1 else 0)
    dist.barrier()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        dist.barrier()
    dist.destroy_process_group()
    return {"try_number": int(try_number), "rank": rank, "pod": os.environ.get("HOSTNAME", "")}


def _dag(dag_id: str, **default_args: object) -> DAG:
    args = {
        "retries": 1,
        "retry_delay": timedelta(0),
        "on_failure_callback": record_failure,
        "on_retry_callback": record_failure,
        # A hang fails the task (and deletes its job) instead of stalling the suite.
        "execution_timeout": timedelta(minutes=4),
        **default_args,
    }
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


with _dag("rc_local_recoverable_after_collective"):
    TorchElasticOperator(
        task_id="train",
        python_callable=recoverable_on_every_rank_after_a_collective,
        op_kwargs={"try_number": "{{ ti.try_number }}"},
        # spawn, as the other local DAGs; the 2 s poll lets both ranks fail before the agent looks.
        task_config=Elastic(nproc_per_node=2, start_method="spawn", monitor_interval=2),
        execution="local",
    )


# The race of issue 31: the cause (rank 1's recorded RecoverableError) must outrank its victim (rank 0's closed
# connection), on one node with either start method, and across pods.
for _method in ("spawn", "fork"):
    with _dag(f"rc_local_victim_after_cause_{_method}"):
        TorchElasticOperator(
            task_id="train",
            python_callable=rank_1_fails_while_rank_0_waits_in_a_collective,
            op_kwargs={"try_number": "{{ ti.try_number }}"},
            task_config=Elastic(nproc_per_node=2, start_method=_method, monitor_interval=0.1),
            execution="local",
        )

with _dag("rc_k8s_victim_after_cause"):
    TorchElasticOperator(
        task_id="train",
        python_callable=rank_1_fails_while_rank_0_waits_in_a_collective,
        op_kwargs={"try_number": "{{ ti.try_number }}"},
        task_config=Elastic(nnodes="2:2", nproc_per_node=1, monitor_interval=0.5),
        image=IMAGE,
        execution="kubernetes",
        poll_interval=1,
        pending_grace_seconds=5,
        deferrable=False,
    )


def _oom_on(index: int, oom_kills: str) -> dict[str, str]:
    """The OOM kill aimed at one replica index, on try 1 of a DAG run only (the retry is a new PyTorchJob with the
    same run-id label), killing what ``oom_kills`` says (one worker, or the whole container). No start delay:
    whichever pod starts first may host the c10d store."""
    return {
        "sim.torchelastic.dev/fail": "OOMKilled",
        "sim.torchelastic.dev/oom-kills": oom_kills,
        "sim.torchelastic.dev/fail-after-log-line": JOINED,
        "sim.torchelastic.dev/fail-after-seconds": str(OOM_AFTER_SECONDS),
        "sim.torchelastic.dev/fail-indexes": str(index),
        "sim.torchelastic.dev/fail-times": "1",
        "sim.torchelastic.dev/fail-times-scope": LABEL_RUN_ID,
    }


#: What the simulated OOM kills on each replica index: the two shapes of real nodes (cgroup v1, cgroup v2's group kill).
OOM_KILLS = {0: "worker", 1: "whole-container"}

for _index, _oom_kills in OOM_KILLS.items():
    with _dag(f"rc_k8s_oom_worker_{_index}"):
        TorchElasticOperator(
            task_id="train",
            python_callable=barriers_until_killed,
            op_kwargs={"try_number": "{{ ti.try_number }}"},
            task_config=Elastic(nnodes="2:2", nproc_per_node=1, monitor_interval=0.5),
            pod_options=PodOptions(annotations=_oom_on(_index, _oom_kills)),
            image=IMAGE,
            execution="kubernetes",
            poll_interval=1,
            pending_grace_seconds=5,
            deferrable=False,
        )


# --- the real node: the kernel's OOM killer, under a real memory limit (cgroup v1) ------------------------------------

#: Both pods' memory limit: room for the runner's agent and a worker importing torch, not for a worker filling memory.
NODE_MEMORY_LIMIT = "768Mi"
#: The pods' names end so: worker 0 hosts the c10d store (PET_RDZV_ENDPOINT), worker 1 does not.
STORE_HOST, OTHER_POD = "-worker-0", "-worker-1"


def fill_memory_on_one_pod(try_number: str, pod_suffix: str) -> dict:
    """Try 1: both ranks join and pass a barrier; then the worker of the pod whose name ends with ``pod_suffix`` fills
    memory, a MiB at a time, until the kernel's OOM killer ends it (the largest process of its container's cgroup),
    while the other pod's rank runs barriers it never joins, and so fails when its connection closes. Later tries:
    one barrier."""
    import socket
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} {JOINED}", flush=True)
    dist.barrier()
    if int(try_number) == 1:
        if socket.gethostname().endswith(pod_suffix):
            chunks = []
            while True:
                chunks.append(bytearray(b"\x01") * (1 << 20))
        deadline = time.monotonic() + TRAIN_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.1)
            dist.barrier()
    dist.destroy_process_group()
    return {"try_number": int(try_number), "rank": rank, "pod": socket.gethostname()}


with _dag("rc_node_oom"):
    for _task, _suffix in (("store_host", STORE_HOST), ("other_pod", OTHER_POD)):
        TorchElasticOperator(
            task_id=_task,
            python_callable=fill_memory_on_one_pod,
            op_kwargs={"try_number": "{{ ti.try_number }}", "pod_suffix": _suffix},
            task_config=Elastic(nnodes="2:2", nproc_per_node=1, monitor_interval=0.5),
            pod_options=PodOptions(requests={"memory": NODE_MEMORY_LIMIT}, limits={"memory": NODE_MEMORY_LIMIT}),
            image=pod_image(),
            execution="kubernetes",
            poll_interval=1,
            pending_grace_seconds=5,
            deferrable=False,
        )

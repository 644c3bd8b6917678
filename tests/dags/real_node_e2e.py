"""DAGs for tests/e2e/test_real_node_e2e.py: the provider on the real node (kubelet, scheduler, controller-manager,
containerd), not the simulated kubelet. Every pod runs the runner image built from docker/Dockerfile.

What the test sets before the folder is parsed (the defaults only let the folder parse elsewhere):

- ``TORCHELASTIC_TEST_RUNNER_IMAGE``: the runner image's reference (tests/cluster/image.py), imported into the node's
  containerd at ``up``; ``imagePullPolicy: Never``, so a pod that does not find it there fails instead of pulling;
- ``TORCHELASTIC_TEST_SHARED_DIR``: a folder of this machine that the pods mount by hostPath at the same path, the
  storage they really share with each other and with the Airflow side (checkpoints, large results, markers).

Functions live in this file and travel by value. Each failure case is its own task of one DAG run
(``real_node_failures``): the tasks do not depend on each other, so one run shows all four.
"""

from __future__ import annotations

import os

from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from airflow_provider_torchelastic.pod import PodOptions
from tests.cluster.image import runner_image_ref
from tests.dag_support import IMAGE_ENV, SHARED_DIR_ENV, recording_dag

IMAGE = os.environ.get(IMAGE_ENV) or runner_image_ref()
SHARED_DIR = os.environ.get(SHARED_DIR_ENV) or "/tmp/torchelastic-real-node-shared"
#: An image no registry serves: the pull goes to a registry named localhost, which refuses at once.
MISSING_IMAGE = "localhost/torchelastic-no-such-image:0"
MISSING_SECRET = "no-such-secret"
#: Small enough that a worker filling memory is killed soon, large enough for the agent and a worker importing torch.
MEMORY_LIMIT = "768Mi"
#: The deleted pod's grace period: its worker ignores SIGTERM, so the kubelet's SIGKILL after it ends the pod.
GRACE_SECONDS = 5
UNSHARED_CHECKPOINTS = "file:///tmp/checkpoints"  # the container's own file system: gone with the pod
STEPS, FAIL_AFTER = 5, 2

#: The imported image, never pulled; the shared folder mounted where it is on this machine.
SHARED = PodOptions(
    image_pull_policy="Never",
    volumes=[{"name": "shared", "hostPath": {"path": SHARED_DIR, "type": "Directory"}}],
    volume_mounts=[{"name": "shared", "mountPath": SHARED_DIR}],
)
#: Every task: fast polls, fast failure of stuck pods.
FAST = {"image": IMAGE, "execution": "kubernetes", "poll_interval": 1, "pending_grace_seconds": 3}


def small(**overrides: object) -> Elastic:
    values: dict = {"nproc_per_node": 1, "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


def options(**changes: object) -> PodOptions:
    from dataclasses import replace

    return replace(SHARED, **changes)


def _dag(dag_id: str, **default_args: object) -> DAG:
    return recording_dag(dag_id, execution_timeout_minutes=3, **default_args)


# --- training functions (shipped by value) ---------------------------------------------------------------------------


def all_reduce_ranks() -> dict:
    """Every rank joins one gloo group across the pods; rank 0 returns what they summed, and where it ran."""
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    result = {"rank": rank, "world_size": dist.get_world_size(), "sum": value.item(), "pod": socket.gethostname()}
    dist.destroy_process_group()
    return result


def fill_memory(mib: int) -> None:
    """Touch ``mib`` MiB, a page at a time: the container's memory limit stops it first."""
    chunks = []
    for _ in range(mib):
        chunks.append(bytearray(b"\x01") * (1 << 20))


def never_runs() -> None:
    raise AssertionError("this pod was not expected to start")


def outlive_sigterm(marker_dir: str) -> None:
    """Note SIGTERM in the shared folder and keep running: only the kubelet's SIGKILL after the grace period ends it."""
    import signal
    import time
    from pathlib import Path

    folder = Path(marker_dir)
    folder.mkdir(parents=True, exist_ok=True)

    def note(signum: int, frame: object) -> None:
        (folder / "sigterm").write_text(f"{time.time()}\n")

    signal.signal(signal.SIGTERM, note)
    (folder / "started").write_text(f"{time.time()}\n")
    time.sleep(600)


def checkpoint_then_fail() -> dict:
    """Try 1 checkpoints steps 0..FAIL_AFTER and fails recoverably; the retry resumes from what it finds."""
    from airflow_provider_torchelastic import RecoverableError, checkpoint, context

    ctx = context.current()
    loaded = checkpoint.load_latest()
    start = loaded.step + 1 if loaded else 0
    total = loaded.state["total"] if loaded else 0
    for step in range(start, STEPS):
        total += step
        checkpoint.save({"total": total}, step=step)
        if ctx.try_number == 1 and step == FAIL_AFTER:
            raise RecoverableError(f"preempted after step {step}")
    return {
        "try_number": ctx.try_number,
        "resumed_from": loaded.step if loaded else None,
        "total": total,
        "checkpoint_uri": ctx.checkpoint_uri,
    }


def large_result(characters: int) -> dict:
    """Too large for the termination message (4096 bytes): it travels through result storage."""
    return {"rank": int(os.environ["RANK"]), "text": "".join(chr(65 + i % 26) for i in range(characters))}


# --- results: elastic 2 pods on the one node, Master + Worker -------------------------------------------------------

# Kept, so that the test can read each pod's node and termination message.
with _dag("real_node_elastic"):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        task_config=small(nnodes="2:2"),
        deferrable=True,
        on_finish_action="keep",
        pod_options=SHARED,
        **FAST,
    )

with _dag("real_node_master_worker"):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        task_config=PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
        deferrable=False,
        on_finish_action="keep",
        pod_options=SHARED,
        **FAST,
    )

# --- failures the node produces itself, one task each -----------------------------------------------------------------

with _dag("real_node_failures"):
    TorchElasticOperator(
        task_id="oom",
        python_callable=fill_memory,
        op_kwargs={"mib": 4096},
        task_config=small(),
        deferrable=False,
        pod_options=options(limits={"memory": MEMORY_LIMIT}, requests={"memory": MEMORY_LIMIT}),
        **FAST,
    )
    TorchElasticOperator(
        task_id="image_pull",
        python_callable=never_runs,
        task_config=small(),
        deferrable=False,
        pod_options=options(image_pull_policy="IfNotPresent"),
        **{**FAST, "image": MISSING_IMAGE},
    )
    TorchElasticOperator(
        task_id="missing_secret",
        python_callable=never_runs,
        task_config=small(),
        deferrable=False,
        pod_options=options(env_from=[{"secretRef": {"name": MISSING_SECRET}}]),
        **FAST,
    )
    TorchElasticOperator(
        task_id="unschedulable",
        python_callable=never_runs,
        task_config=small(),
        deferrable=False,
        scheduling_timeout=5,
        pod_options=options(limits={"nvidia.com/gpu": 1}),
        **FAST,
    )

# --- deletion: the real grace period, and the payload Secret collected with its pod ----------------------------------

with _dag("real_node_deleted_pod"):
    TorchElasticOperator(
        task_id="train",
        python_callable=outlive_sigterm,
        op_kwargs={"marker_dir": f"{SHARED_DIR}/deleted-pod"},
        task_config=small(),
        deferrable=True,
        pod_options=options(pod_template={"spec": {"terminationGracePeriodSeconds": GRACE_SECONDS}}),
        **FAST,
    )

# --- checkpoints and results on storage the pods share, and a checkpoint that is not ---------------------------------

with _dag("real_node_storage", retries=1):
    TorchElasticOperator(
        task_id="shared_checkpoint",
        python_callable=checkpoint_then_fail,
        task_config=small(),
        deferrable=False,
        checkpoint_uri=f"file://{SHARED_DIR}/checkpoints",
        pod_options=SHARED,
        **FAST,
    )
    TorchElasticOperator(
        task_id="unshared_checkpoint",
        python_callable=checkpoint_then_fail,
        task_config=small(),
        deferrable=False,
        checkpoint_uri=UNSHARED_CHECKPOINTS,
        pod_options=SHARED,
        **FAST,
    )
    TorchElasticOperator(
        task_id="large_result",
        python_callable=large_result,
        op_kwargs={"characters": 64 * 1024},
        task_config=small(),
        deferrable=False,
        pod_options=SHARED,
        **FAST,
    )

"""DAGs for tests/e2e/test_real_node_e2e.py: the provider on the real node (kubelet, scheduler, controller-manager,
containerd), not the simulated kubelet. Every pod runs the runner image built from docker/Dockerfile.

What the test sets before the folder is parsed (the defaults only let the folder parse elsewhere):

- ``TORCHELASTIC_TEST_RUNNER_IMAGE``: the runner image's reference (tests/cluster/image.py), imported into the node's
  local registry at ``up`` (tests/cluster/registry.py), from which the first pod that needs it pulls it;
- ``TORCHELASTIC_TEST_SHARED_DIR``: a folder of this machine that the pods mount by hostPath at the same path, the
  storage they really share with each other and with the Airflow side (checkpoints, large results, markers).

Functions live in this file and travel by value. Each failure case is its own task of one DAG run
(``real_node_failures``): the tasks do not depend on each other, so one run shows them all.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, ExceptionRetryPolicy, RetryAction, RetryRule

from airflow_provider_torchelastic import (
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    TorchElasticOperator,
    Worker,
)
from airflow_provider_torchelastic.operators import OutOfMemoryError
from airflow_provider_torchelastic.pod import PodOptions
from tests.cluster.image import runner_image_ref
from tests.dag_support import IMAGE_ENV, SHARED_DIR_ENV, recording_dag

IMAGE = os.environ.get(IMAGE_ENV) or runner_image_ref()
SHARED_DIR = os.environ.get(SHARED_DIR_ENV) or "/tmp/torchelastic-real-node-shared"


def _missing_tag(image: str) -> str:
    name, _, tag = image.rpartition(":")
    return f"{name if name and '/' not in tag else image}:no-such-tag"


#: A tag the local cluster's registry does not have: it answers "not found", a failure no retry can mend (a registry
#: that refuses the connection may come back, so that waits for image_pull_timeout instead).
MISSING_IMAGE = _missing_tag(IMAGE)
MISSING_SECRET = "no-such-secret"
#: Small enough that a worker filling memory is killed soon, large enough for the agent and a worker importing torch.
MEMORY_LIMIT = "768Mi"
#: The deleted pod's grace period, as a preemption or a drain gives it: the function saves after stop_requested().
GRACE_SECONDS = 60
#: How long the function's "save" takes after the stop request: at least 45 s of the 60 must be the function's.
SAVE_SECONDS = 46
UNSHARED_CHECKPOINTS = "file:///tmp/checkpoints"  # the container's own file system: gone with the pod
STEPS, FAIL_AFTER = 5, 2

#: The runner image, pulled from the local cluster's registry the first time a pod needs it (tests/cluster/registry.py)
#: and then found on the node; the shared folder mounted where it is on this machine.
SHARED = PodOptions(
    image_pull_policy="IfNotPresent",
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


def fill_memory(mib: int, try_number: str = "1") -> dict:
    """Touch ``mib`` MiB, a page at a time, on try 1: the container's memory limit stops it first. A retry (the
    memory freed, or the limit raised) touches 1 MiB and succeeds."""
    chunks = []
    for _ in range(mib if int(try_number) == 1 else 1):
        chunks.append(bytearray(b"\x01") * (1 << 20))
    return {"try_number": int(try_number)}


def fail_then_wait(marker_dir: str) -> None:
    """The container's first run raises a ValueError; the kubelet restarts it in place (OnFailure), which reaches
    backoff_limit=1 and fails the job while the second run waits: the first run's exception and log are then only
    in the previous container's termination message and log."""
    import time
    from pathlib import Path

    first = Path(marker_dir) / f"first-run-{os.environ['HOSTNAME']}"
    if not first.exists():
        first.parent.mkdir(parents=True, exist_ok=True)
        first.write_text("ran")
        print(f"first run of rank {os.environ['RANK']}: reading shard 3 of 8", flush=True)
        raise ValueError(f"first run of rank {os.environ['RANK']}: shard 3 has a corrupt header")
    print("second run: waiting for the shard cache", flush=True)
    time.sleep(120)


def never_runs() -> None:
    raise AssertionError("this pod was not expected to start")


def save_when_stopped(marker_dir: str, save_seconds: float) -> dict | None:
    """Train until the pod is deleted, then take ``save_seconds`` to save a checkpoint of the step reached, and
    return: the try fails as preempted, and the next one resumes from that step."""
    import time
    from pathlib import Path

    from airflow_provider_torchelastic import checkpoint, context

    ctx = context.current()
    loaded = checkpoint.load_latest()
    if ctx.try_number > 1:
        return {"resumed_from": loaded.step if loaded else None, "try_number": ctx.try_number}
    folder = Path(marker_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "started").write_text(f"{time.time()}\n")
    step = 0
    while not ctx.stop_requested():
        step += 1
        time.sleep(0.1)
    (folder / "stop_seen").write_text(f"{time.time()}\n")
    time.sleep(save_seconds)  # a slow save of a large model
    checkpoint.save({"step": step}, step=step)
    (folder / "saved").write_text(f"{step} {time.time()}\n")
    return None


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

#: retry_policy rules against the failure classes (issue 31): an OOM retried after the rule's 2 s, not the task's
#: ten minutes; the missing Secret's ConfigurationError has no rule, so it fails at try 1 despite retries=3.
OOM_RULE_DELAY = timedelta(seconds=2)
OOM_POLICY = ExceptionRetryPolicy(
    rules=[
        RetryRule(
            exception=OutOfMemoryError,
            action=RetryAction.RETRY,
            retry_delay=OOM_RULE_DELAY,
            reason="out of memory: retry once the node has room",
        )
    ]
)
_RETRIED = {"retries": 3, "retry_delay": timedelta(minutes=10), "retry_policy": OOM_POLICY}

with _dag("real_node_failures"):
    TorchElasticOperator(
        task_id="oom",
        python_callable=fill_memory,
        op_kwargs={"mib": 4096, "try_number": "{{ ti.try_number }}"},
        task_config=small(),
        deferrable=False,
        pod_options=options(limits={"memory": MEMORY_LIMIT}, requests={"memory": MEMORY_LIMIT}),
        **_RETRIED,
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
        **_RETRIED,
        **FAST,
    )
    # Each pod restarted in place once (OnFailure, backoff_limit=1): the wait reads the previous container's log.
    TorchElasticOperator(
        task_id="restarted",
        python_callable=fail_then_wait,
        op_kwargs={"marker_dir": f"{SHARED_DIR}/restarted"},
        task_config=PyTorch(
            master=Master(restart_policy=RestartPolicy.ON_FAILURE),
            worker=Worker(replicas=1, restart_policy=RestartPolicy.ON_FAILURE),
            run_policy=RunPolicy(backoff_limit=1),
            nproc_per_node=1,
        ),
        deferrable=False,
        on_finish_action="delete",  # the second run is still waiting: nothing is left running
        pod_options=SHARED,
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

# --- torchrun programs (issue 32): tests/programs copied into the shared folder, as an image would hold them ---------

PROGRAMS = f"{SHARED_DIR}/programs"
_ON_PYTHONPATH = options(env=[{"name": "PYTHONPATH", "value": PROGRAMS}])

with _dag("real_node_programs", retries=1):
    # `torchrun -m team.train ...` on 2 workers: try 1 raises a RecoverableError, try 2 sets its result.
    TorchElasticOperator(
        task_id="module",
        module="team.train",
        args=["recoverable-on-try-1", "--steps", "2", "--try-number", "{{ ti.try_number }}"],
        task_config=small(nproc_per_node=2),
        deferrable=False,
        pod_options=_ON_PYTHONPATH,
        **FAST,
    )
    # `torchrun train.py fail`: rank 1's ValueError, named with its traceback, not retried.
    TorchElasticOperator(
        task_id="script",
        script=f"{PROGRAMS}/team/train.py",
        args=["fail"],
        task_config=small(nproc_per_node=2),
        deferrable=True,
        pod_options=_ON_PYTHONPATH,
        **FAST,
    )
    # exit(0) after set_result(): the value stands.
    TorchElasticOperator(
        task_id="exit",
        module="team.train",
        args=["exit"],
        task_config=small(),
        deferrable=False,
        pod_options=_ON_PYTHONPATH,
        **FAST,
    )

# --- deletion: the real grace period, and the payload Secret collected with its pod ----------------------------------

with _dag("real_node_deleted_pod", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=save_when_stopped,
        op_kwargs={"marker_dir": f"{SHARED_DIR}/deleted-pod", "save_seconds": SAVE_SECONDS},
        task_config=small(),
        deferrable=True,
        termination_grace_period=GRACE_SECONDS,
        checkpoint_uri=f"file://{SHARED_DIR}/deleted-pod-checkpoints",
        pod_options=options(),
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

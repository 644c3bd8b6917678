"""DAGs for the PyTorchJob failure tests (tests/e2e/test_pytorchjob_failures.py), run against the local test cluster.

Each DAG makes one multi-pod PyTorchJob fail in one way: a worker's exception, a worker OOM-killed or evicted (the
simulated kubelet's fault annotations, aimed at one replica with ``fail-indexes``), a missing Secret, the job's
active deadline, its backoff limit. The tests read the task's exception (``record_failure``) and its try count.
The training functions live in this file and travel by value, as a DAG author's would. Everything is kept cheap:
one process per node, tiny functions, one-second polls.
"""

from __future__ import annotations

import os

from airflow.sdk import DAG

from airflow_provider_torchelastic import (
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    TorchElasticOperator,
    Worker,
)
from airflow_provider_torchelastic.core.naming import LABEL_RUN_ID
from airflow_provider_torchelastic.pod import PodOptions, secret_key_ref
from tests.dag_support import recording_dag

IMAGE = "local/torchelastic-runner:test"
#: Every Kubernetes task: fast polls, fast failure of stuck pods.
FAST = {"image": IMAGE, "execution": "kubernetes", "poll_interval": 1, "pending_grace_seconds": 5}
#: The pod the worker-side failure is aimed at, and the Secret that does not exist.
FAILING_POD_SUFFIX = "-worker-0"
MISSING_SECRET = "no-such-secret"


def small(**overrides: object) -> Elastic:
    values: dict = {"nproc_per_node": 1, "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


def _dag(dag_id: str, **default_args: object) -> DAG:
    return recording_dag(dag_id, execution_timeout_minutes=3, **default_args)


def _one_worker_fault(**fault: str) -> dict[str, str]:
    """Annotations that aim ``fault`` at worker 1 only, once per DAG run: try 1's worker-1 is hit, the retry's (a new
    PyTorchJob, new pod names, the same run-id label) is not. Worker 1 also starts 2 s late, so that worker 0 hosts
    the c10d store and the fault never takes the rendezvous down with it."""
    return {
        "sim.torchelastic.dev/fail-indexes": "1",
        "sim.torchelastic.dev/fail-times": "1",
        "sim.torchelastic.dev/fail-times-scope": LABEL_RUN_ID,
        "sim.torchelastic.dev/start-delay-seconds": "2",
        **fault,
    }


# --- training functions (shipped by value) ---------------------------------------------------------------------------


def fail_on_one_pod(pod_suffix: str) -> dict:
    """Every rank joins a gloo group; the rank on the pod named ``*<pod_suffix>`` raises, the others then fail in the
    barrier it never reaches (or are stopped)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if os.environ.get("HOSTNAME", "").endswith(pod_suffix):
        raise ValueError(f"shard {rank} has a corrupt header")
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank}


#: What each rank says once its function runs: a worker process exists from then on (see the OOM DAG below).
TRAINING = "training started"


def sleep_and_report(seconds: float) -> dict:
    import time

    print(f"rank {os.environ['RANK']}: {TRAINING}", flush=True)
    time.sleep(seconds)
    return {"rank": int(os.environ["RANK"]), "pod": os.environ.get("HOSTNAME", "")}


def always_fail() -> None:
    raise ValueError(f"rank {os.environ['RANK']} cannot open its checkpoint")


# --- (a) a permanent exception on one Worker of a Master + Worker job ----------------------------------------------
with _dag("k8s_fail_worker_exception", retries=2):
    TorchElasticOperator(
        task_id="train",
        python_callable=fail_on_one_pod,
        op_kwargs={"pod_suffix": FAILING_POD_SUFFIX},
        task_config=PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
        deferrable=True,
        **FAST,
    )

# --- (b) one worker of an elastic job OOMKilled on try 1: recoverable, the retry succeeds ---------------------------
# Killed once its function runs, so that the kill takes the training worker as the kernel would (cgroup v1), not the
# runner before it started one: the runner reports the rank's SIGKILL.
with _dag("k8s_fail_oom_worker", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_and_report,
        op_kwargs={"seconds": 2},
        task_config=small(nnodes="2:2"),
        deferrable=False,
        pod_options=PodOptions(
            annotations=_one_worker_fault(
                **{
                    "sim.torchelastic.dev/fail": "OOMKilled",
                    "sim.torchelastic.dev/fail-after-log-line": TRAINING,
                    "sim.torchelastic.dev/fail-after-seconds": "0.3",
                }
            )
        ),
        **FAST,
    )

# --- (c) one worker of an elastic job evicted on try 1: recoverable, the retry succeeds -----------------------------
with _dag("k8s_fail_evicted_worker", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_and_report,
        op_kwargs={"seconds": 1},
        task_config=small(nnodes="2:2"),
        deferrable=True,
        pod_options=PodOptions(annotations=_one_worker_fault(**{"sim.torchelastic.dev/evict-after-seconds": "1"})),
        **FAST,
    )

# --- (d) the Worker's env names a Secret that does not exist: CreateContainerConfigError, no retry ------------------
with _dag("k8s_fail_missing_secret", retries=2):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_and_report,
        op_kwargs={"seconds": 0},
        task_config=PyTorch(
            master=Master(),
            worker=Worker(
                replicas=1,
                pod=PodOptions(env=[{"name": "HF_TOKEN", "valueFrom": secret_key_ref(MISSING_SECRET, "token")}]),
            ),
            nproc_per_node=1,
        ),
        deferrable=False,
        **{**FAST, "pending_grace_seconds": 3},
    )

# --- (e) the job runs past run_policy.active_deadline_seconds, quietly: the training operator would notice only on
# an event (kubeflow/trainer v1.9 checks the deadline on reconcile only), so the wait enforces it, on both paths ----
for _deferrable, _suffix in ((True, ""), (False, "_sync")):
    with _dag(f"k8s_fail_deadline{_suffix}", retries=1):
        TorchElasticOperator(
            task_id="train",
            python_callable=sleep_and_report,
            op_kwargs={"seconds": 120},
            task_config=small(nnodes="2:2", run_policy=RunPolicy(active_deadline_seconds=5)),
            deferrable=_deferrable,
            **FAST,
        )

# --- (f) OnFailure restarts in place until run_policy.backoff_limit fails the job ------------------------------------
with _dag("k8s_fail_backoff_limit", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=always_fail,
        task_config=PyTorch(
            master=Master(restart_policy=RestartPolicy.ON_FAILURE),
            worker=Worker(replicas=1, restart_policy=RestartPolicy.ON_FAILURE),
            run_policy=RunPolicy(backoff_limit=1),
            nproc_per_node=1,
        ),
        deferrable=False,
        **FAST,
    )

"""DAGs for tests/e2e/test_retries_and_checkpoints.py: a try that checkpoints then fails resumes in the next try,
and a 1 MB result travels through result storage; each locally and on the real node of the local cluster.

The checkpoint root and result storage come from the Airflow options the test sets ([torch_elastic] checkpoint_root,
result_storage). Pods get the S3 server's endpoint and credentials through their env (PodOptions), as they would get
them from a Secret; the test puts them in TORCHELASTIC_TEST_POD_ENV before the DAG file is parsed. They mount the
folder a file:// checkpoint root is in (tests/dag_support.py's shared_folder_mount).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.pod import PodOptions
from tests.dag_support import pod_image, record_failure, shared_folder_mount

START = pendulum.datetime(2026, 1, 1, tz="UTC")
STEPS = 5
FAIL_AFTER = 2
#: A 1 MiB result, the same on both sides: what arrives must be exactly this.
RESULT_CHARACTERS = 1 << 20


def pod_env() -> dict[str, str]:
    return dict(json.loads(os.environ.get("TORCHELASTIC_TEST_POD_ENV") or "{}"))


def one_megabyte() -> str:
    return "".join(chr(65 + (i * 7 + i // 26) % 26) for i in range(RESULT_CHARACTERS))


def train_with_checkpoints(steps: int, fail_after: int) -> dict:
    """Sums the steps, checkpointing each; the first try dies after ``fail_after`` (with a torn save of the next)."""
    import contextlib

    from airflow_provider_torchelastic import RecoverableError, checkpoint, context

    ctx = context.current()
    had_checkpoint = ctx.has_checkpoint()
    loaded = checkpoint.load_latest()
    start = loaded.step + 1 if loaded else 0
    total = loaded.state["total"] if loaded else 0
    for step in range(start, steps):
        total += step
        checkpoint.save({"total": total}, step=step)
        if ctx.try_number == 1 and step == fail_after:

            class Unwritable:
                def __reduce__(self) -> tuple:
                    raise OSError("preempted in the middle of a checkpoint write")

            # The next step's save is cut off midway: it must never be taken as the latest.
            with contextlib.suppress(OSError):
                checkpoint.save({"total": -1, "cut": Unwritable()}, step=step + 1)
            raise RecoverableError(f"preempted after step {step}")
    return {
        "resumed_from": loaded.step if loaded else None,
        "had_checkpoint": had_checkpoint,
        "total": total,
        "try_number": ctx.try_number,
        "max_tries": ctx.max_tries,
        "identity": [ctx.dag_id, ctx.task_id, ctx.run_id, ctx.map_index],
        "logical_date": ctx.logical_date,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "node": ctx.node,
        "restart_count": ctx.restart_count,
        "checkpoint_uri": ctx.checkpoint_uri,
        "airflow_ctx": sorted(key for key in os.environ if key.startswith("AIRFLOW_CTX_")),
    }


def large_result() -> dict:
    return {"text": one_megabyte(), "rank": int(os.environ["RANK"])}


def _dag(dag_id: str) -> DAG:
    return DAG(
        dag_id,
        schedule=None,
        start_date=START,
        catchup=False,
        default_args={"retries": 1, "retry_delay": timedelta(0), "on_failure_callback": record_failure},
    )


KUBERNETES = {"image": pod_image(), "execution": "kubernetes", "poll_interval": 1, "pending_grace_seconds": 5}
CONFIG = Elastic(nproc_per_node=1, monitor_interval=0.5)

for prefix, settings in (("te", {"execution": "local"}), ("k8s", KUBERNETES)):
    # On the real node the pods mount the folder the file:// tests store in (shared_folder_mount).
    options = PodOptions(env=pod_env(), **shared_folder_mount()) if prefix == "k8s" else None
    with _dag(f"{prefix}_checkpoint_resume"):
        TorchElasticOperator(
            task_id="train",
            python_callable=train_with_checkpoints,
            op_kwargs={"steps": STEPS, "fail_after": FAIL_AFTER},
            task_config=CONFIG,
            pod_options=options,
            on_retry_callback=record_failure,
            **settings,
        )
    with _dag(f"{prefix}_large_result"):
        TorchElasticOperator(
            task_id="train", python_callable=large_result, task_config=CONFIG, pod_options=options, **settings
        )

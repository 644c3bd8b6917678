"""DAGs for tests/e2e/test_stalls.py: a try whose rank 1 gets stuck before a collective is stopped as stalled within
``stall_timeout`` and retried, and the retry resumes from the checkpoint the stalled try saved."""

from __future__ import annotations

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from tests.dag_support import recording_dag

STEPS = 4
STUCK_AFTER = 1


def train_until_stuck(steps: int, stuck_after: int) -> dict:
    """Sums all-reduced steps, checkpointing each; in the first try rank 1 hangs after ``stuck_after`` while rank 0
    waits for it in the next all_reduce (neither can ever finish: only the runner's stall detection ends it)."""
    import time

    import torch
    import torch.distributed as dist

    from airflow_provider_torchelastic import checkpoint, context

    dist.init_process_group("gloo")
    ctx = context.current()
    loaded = checkpoint.load_latest()
    start = loaded.step + 1 if loaded else 0
    total = loaded.state["total"] if loaded else 0.0
    for step in range(start, steps):
        if ctx.try_number == 1 and step == stuck_after + 1 and ctx.rank == 1:
            time.sleep(600)
        value = torch.tensor([float(step)])
        dist.all_reduce(value)
        total += float(value.item())
        checkpoint.save({"total": total}, step=step)
        dist.barrier()
    return {"resumed_from": loaded.step if loaded else None, "total": total, "try_number": ctx.try_number}


with recording_dag("te_stall_resume", execution_timeout_minutes=4, retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=train_until_stuck,
        op_kwargs={"steps": STEPS, "stuck_after": STUCK_AFTER},
        task_config=Elastic(nproc_per_node=2, monitor_interval=0.5),
        execution="local",
        stall_timeout=8,
    )

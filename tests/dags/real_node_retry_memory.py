"""DAG for tests/e2e/test_real_node_retry_memory.py: ``retry_resources=2.0`` on the real node, where the memory limit
is the kernel's (the container's cgroup), not a simulated kill.

The test sets ``TORCHELASTIC_TEST_RUNNER_IMAGE`` and ``TORCHELASTIC_TEST_SHARED_DIR`` before the folder is parsed, as
for tests/dags/real_node_e2e.py; they are read here, at parse time, not imported from that module (whose values are
those of its first import).
"""

from __future__ import annotations

import os

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.pod import PodOptions
from tests.cluster.image import runner_image_ref
from tests.dag_support import IMAGE_ENV, recording_dag

IMAGE = os.environ.get(IMAGE_ENV) or runner_image_ref()
#: The training container's memory request and limit on try 1; retry_resources=2.0 doubles both for try 2.
FIRST_LIMIT = "1Gi"
#: What the training function touches on every try: more than FIRST_LIMIT, so try 1 is OOM-killed whatever else the
#: container holds; with the runner, the elastic agent and the worker (under 768Mi together: real_node_e2e's
#: MEMORY_LIMIT) still under twice it, so try 2 fits.
NEEDS_MIB = 1200


def need_memory(mib: int, try_number: str) -> dict:
    """Touch ``mib`` MiB, a page at a time, on every try: only the limit decides whether it fits."""
    chunks = [bytearray(b"\x01") * (1 << 20) for _ in range(mib)]
    return {"try_number": int(try_number), "mib": len(chunks)}


with recording_dag("real_node_retry_memory", execution_timeout_minutes=3, retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=need_memory,
        op_kwargs={"mib": NEEDS_MIB, "try_number": "{{ ti.try_number }}"},
        task_config=Elastic(nproc_per_node=1, monitor_interval=0.5),
        image=IMAGE,
        execution="kubernetes",
        poll_interval=1,
        pending_grace_seconds=3,
        deferrable=False,
        retry_resources=2.0,
        # Pulled once from the node's registry where containerd does not hold it yet.
        pod_options=PodOptions(
            image_pull_policy="IfNotPresent",
            requests={"memory": FIRST_LIMIT},
            limits={"memory": FIRST_LIMIT},
        ),
    )

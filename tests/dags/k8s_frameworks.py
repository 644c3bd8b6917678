"""DAGs for tests/e2e/test_frameworks_on_node.py: the framework examples of example_dags/framework_training.py on the
real node, in the runner image built with ``STORAGE=1 FRAMEWORKS=1`` (tests/cluster/image.py).

- ``k8s_frameworks_transformers``: the Hugging Face ``Trainer`` on 1 node of 2 workers, one Pod; its first try fails
  recoverably right after its first checkpoint, and the retry, in a new Pod, resumes from it. The checkpoint root is
  a ``file://`` folder the pods mount by hostPath (tests/dag_support.py's ``shared_folder_mount``).
- ``k8s_frameworks_accelerate``: ``accelerate`` on 1 node of 2 workers, checkpointing to ``s3://``: the S3 server on
  the node's address, whose endpoint and credentials reach the pods through their env (``TORCHELASTIC_TEST_POD_ENV``,
  read when the file is parsed), as a Secret's would.

What the test sets before the file is parsed: the image (``TORCHELASTIC_TEST_RUNNER_IMAGE``), the shared folder and
the checkpoint root (``[torch_elastic] checkpoint_root``); the defaults only let the folder parse elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.pod import PodOptions
from example_dags.framework_training import train_accelerate, train_transformers
from tests.dag_support import pod_image, recording_dag, shared_folder_mount

#: One node of two workers: one Pod of the 2-core node, which holds one agent and two workers importing a framework
#: better than two Pods (two agents, init-pytorch's name lookups); DDP sees 2 ranks either way, and the rendezvous of
#: two Pods on the node is tests/e2e/test_real_node_e2e.py's.
TWO_WORKERS = Elastic(nproc_per_node=2, monitor_interval=0.5)
_SHARED = shared_folder_mount()
POD_OPTIONS = PodOptions(
    image_pull_policy="IfNotPresent",
    env=json.loads(os.environ.get("TORCHELASTIC_TEST_POD_ENV") or "{}"),
    volumes=_SHARED.get("volumes", ()),
    volume_mounts=_SHARED.get("volume_mounts", ()),
)


def train_on_node(python_callable: Callable[..., Any], **op_kwargs: Any) -> TorchElasticOperator:
    return TorchElasticOperator(
        task_id="train",
        python_callable=python_callable,
        op_kwargs=op_kwargs,
        task_config=TWO_WORKERS,
        pod_options=POD_OPTIONS,
        image=pod_image(),
        execution="kubernetes",
        poll_interval=1,
        pending_grace_seconds=5,
    )


with recording_dag("k8s_frameworks_transformers", execution_timeout_minutes=4, retries=1):
    # A checkpoint at step 2, then the interruption; the retry trains steps 3 and 4 and saves checkpoint-4.
    train_on_node(train_transformers, steps=4, save_steps=2, interrupt=True)

with recording_dag("k8s_frameworks_accelerate", execution_timeout_minutes=4):
    # Checkpoints after steps 1 and 3, each with both ranks' random states.
    train_on_node(train_accelerate, steps=4, save_every=2)

"""The folder the deployment's pods share with it (no DAG here; the DAG files import it from the DAGs folder, which
Airflow puts on ``sys.path``).

On the real node a pod has its own file system, so rank 0's artifacts (``[torch_elastic] artifact_storage``, a
``file://`` URL) reach the Airflow worker only through a folder both see: the deployment (tests/airflow_services)
sets ``TORCHELASTIC_TEST_SHARED_DIR`` to one, and :data:`SHARED` mounts it into every pod by hostPath at the same
path. Unset (a deployment on the simulated kubelet, whose pods are processes of this machine), there is nothing to
mount. (tests/dag_support.py's ``shared_folder_mount`` does the same for the ``dag.test()`` tiers; the deployment's
processes cannot import ``tests``, so this folder has its own.)
"""

from __future__ import annotations

import os

from airflow_provider_torchelastic.pod import PodOptions

SHARED_DIR_ENV = "TORCHELASTIC_TEST_SHARED_DIR"
SHARED_DIR = os.environ.get(SHARED_DIR_ENV)
SHARED: PodOptions | None = (
    PodOptions(
        volumes=[{"name": "shared", "hostPath": {"path": SHARED_DIR, "type": "Directory"}}],
        volume_mounts=[{"name": "shared", "mountPath": SHARED_DIR}],
    )
    if SHARED_DIR
    else None
)

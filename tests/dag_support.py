"""Pieces shared by the end-to-end DAG files in tests/dags (local and Kubernetes).

Kept outside the dags folder so Airflow does not parse it as a DAG file. The training functions here come from an
importable sibling module, not from the DAG file itself, so they also exercise the payload's by-value pickling of
helper modules that do not exist where the workers run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow_provider_torchelastic import RecoverableError

#: Where the tests read what the failure callbacks saw (set by the test, read when a task fails).
OUT_DIR_ENV = "TORCHELASTIC_E2E_OUT"
#: Set before a DAG file is parsed by the tests that run on the real node (tests/e2e/real_node_support.py): the runner
#: image's reference, imported into the node's containerd, and a folder of this machine that the pods mount by
#: hostPath at the same path, the storage they really share with each other and with the Airflow side.
IMAGE_ENV = "TORCHELASTIC_TEST_RUNNER_IMAGE"
SHARED_DIR_ENV = "TORCHELASTIC_TEST_SHARED_DIR"
#: The image of the simulated kubelet's pods, which run every image as the runner env (the name only has to be valid).
SIM_IMAGE = "local/torchelastic-runner:test"


def pod_image() -> str:
    """The image the DAGs' pods run: the runner image on the real node, else :data:`SIM_IMAGE`."""
    return os.environ.get(IMAGE_ENV) or SIM_IMAGE


def shared_folder_mount() -> dict[str, list[dict[str, Any]]]:
    """``PodOptions`` fields that mount the shared folder (:data:`SHARED_DIR_ENV`) where it is on this machine; none
    where it is unset (the simulated kubelet's pods are processes of this machine and see every folder)."""
    folder = os.environ.get(SHARED_DIR_ENV)
    if not folder:
        return {}
    return {
        "volumes": [{"name": "shared", "hostPath": {"path": folder, "type": "Directory"}}],
        "volume_mounts": [{"name": "shared", "mountPath": folder}],
    }


class TransientStorageError(RecoverableError):
    """A recoverable error of the DAG author's own."""


def flaky_on_first_try(try_number: str) -> dict:
    if int(try_number) == 1:
        raise TransientStorageError(f"object store unavailable on try {try_number}")
    return {"try_number": int(try_number), "rank": int(os.environ["RANK"])}


def fail_on_rank_1() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("shard 3 has a corrupt header")
    return "rank 0 done"


def record_failure(context: Any) -> None:
    """Keep the task's exception where the test can read it (the callback runs in the task's process)."""
    out = os.environ.get(OUT_DIR_ENV)
    if not out:
        return
    ti, error = context["ti"], context.get("exception")
    path = Path(out) / f"{ti.dag_id}.{ti.task_id}.try{ti.try_number}.txt"
    path.write_text(f"{type(error).__module__}.{type(error).__qualname__}: {error}")


def recording_dag(dag_id: str, *, execution_timeout_minutes: float, **default_args: Any) -> Any:
    """A manual DAG whose tasks record each failed try (:func:`record_failure`) and do not retry unless
    ``default_args`` says so; a hang fails the task (and deletes its job) after ``execution_timeout_minutes`` instead
    of stalling the suite. Airflow is imported here, not at the top: the workers unpickle this module's functions."""
    from datetime import timedelta

    import pendulum
    from airflow.sdk import DAG

    args = {
        "retries": 0,
        "retry_delay": timedelta(0),
        "on_failure_callback": record_failure,
        "on_retry_callback": record_failure,
        "execution_timeout": timedelta(minutes=execution_timeout_minutes),
        **default_args,
    }
    start = pendulum.datetime(2026, 1, 1, tz="UTC")
    return DAG(dag_id, schedule=None, start_date=start, catchup=False, default_args=args)

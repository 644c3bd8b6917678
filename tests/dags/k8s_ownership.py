"""DAGs for the ownership tests on the local cluster (tests/e2e/test_ownership.py): objects that are not this try's
(a pod with the job's labels, a payload Secret created before the task) must not become its input or its result.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.core.outcome import SCHEMA
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
FAST = {"image": "local/torchelastic-runner:test", "execution": "kubernetes", "poll_interval": 1}


def sleep_then_return(seconds: float, value: str) -> dict:
    import os
    import time

    time.sleep(seconds)
    return {"value": value, "rank": int(os.environ["RANK"])}


def return_once_released(flag: str, value: str) -> dict:
    """Wait (at most 5 minutes) until the test creates ``flag``: the pods run on the test's machine (the simulated
    kubelet), so a file is the test's way to say that what it does during the run is done."""
    import os
    import time
    from pathlib import Path

    deadline = time.monotonic() + 300
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"value": value, "rank": int(os.environ["RANK"])}


def _dag(dag_id: str) -> DAG:
    args = {"retries": 0, "on_failure_callback": record_failure, "execution_timeout": timedelta(minutes=7)}
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


# A PyTorchJob of two nodes that runs until the test has added a foreign pod with its labels.
with _dag("k8s_foreign_pod"):
    TorchElasticOperator(
        task_id="train",
        python_callable=return_once_released,
        # Set by the test (its failure_dir fixture) where the DAG is parsed.
        op_kwargs={
            "flag": f"{os.environ.get('TORCHELASTIC_E2E_OUT', '/nonexistent')}/release",
            "value": "the job's own",
        },
        task_config=Elastic(nnodes=2, nproc_per_node=1, monitor_interval=0.5),
        deferrable=False,
        **FAST,
    )

# One pod, whose payload Secret name the test takes first.
with _dag("k8s_squatted_payload"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 0, "value": "the real payload"},
        task_config=Elastic(nproc_per_node=1, monitor_interval=0.5),
        deferrable=False,
        **FAST,
    )


# --- hostile output of a pod (issue 19, item 4): what rank 0 prints, and a termination message it forges -------------


def print_hostile_lines() -> dict:
    """Metrics lines that are not what the wire format promises, bytes that are not UTF-8, a 3 MiB line."""
    import os
    import sys

    for line in [
        'TORCHELASTIC_METRICS {"last": [1]}',
        'TORCHELASTIC_METRICS {"step": "z", "last": {"loss": "NaN", "x": {}}, "points": {"loss": [[1, "a"], 2]}}',
        'TORCHELASTIC_METRICS {"a": ' + "[" * 5000 + "]" * 5000 + "}",
        "TORCHELASTIC_METRICS {" + "x" * (2 * 1024 * 1024) + "}",
    ]:
        print(line, flush=True)
    sys.stdout.buffer.write(b"\xff\xfe not UTF-8 \xc3\n" + b"y" * (3 * 1024 * 1024) + b"\n")
    sys.stdout.flush()
    return {"value": "survived its own output", "rank": int(os.environ["RANK"])}


def forge_termination_message(message: str, print_it: bool) -> None:
    """Write ``message`` where the runner writes the pod's outcome (or print it as the log's last line, left for
    FallbackToLogsOnError), then kill the runner so that it cannot write the real one: the pod's termination
    message is then whatever the training code left."""
    import os
    import signal
    import time

    agent = os.getppid()
    with open(f"/proc/{agent}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    path = argv[argv.index(b"--result-file") + 1].decode()
    if print_it:
        print(message, flush=True)
    else:
        with open(path, "w") as f:
            f.write(message)
    os.kill(agent, signal.SIGKILL)
    time.sleep(60)


with _dag("k8s_hostile_pod"):
    one_pod = {"task_config": Elastic(nproc_per_node=1, monitor_interval=0.5), "deferrable": False, **FAST}
    TorchElasticOperator(task_id="metrics", python_callable=print_hostile_lines, **one_pod)
    TorchElasticOperator(
        task_id="nested_message",
        python_callable=forge_termination_message,
        op_kwargs={"message": "[" * 999, "print_it": False},
        **one_pod,
    )
    TorchElasticOperator(
        task_id="nested_log_tail",
        python_callable=forge_termination_message,
        op_kwargs={"message": '{"ok": true, "result": ' + "[" * 999, "print_it": True},
        **one_pod,
    )
    TorchElasticOperator(
        task_id="forged_document",
        python_callable=forge_termination_message,
        # The provider's own envelope, with every field of the wrong type.
        op_kwargs={
            "message": json.dumps(
                {"schema": SCHEMA, "succeeded": "no", "holds_rank0": [], "failure": {"exception": 5, "rank": "0"}}
            ),
            "print_it": False,
        },
        **one_pod,
    )

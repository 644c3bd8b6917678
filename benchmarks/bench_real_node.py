"""Benchmark: a task's overhead beyond its pods' own run, on the local cluster's real node (issue 17, item 5).

Run: ``make bench-real-node`` (or ``.venv/bin/python benchmarks/bench_real_node.py [--repeats 3]
[--train-seconds 5]``); root, cgroup v1, and the node and runner image built (``make test`` builds both). Results
are appended to ``benchmarks/results.md``.

What runs: a fresh local cluster with the real node (tests/cluster: kube-apiserver, kubelet, scheduler,
controller-manager, containerd; the simulated training operator), the runner image built from docker/Dockerfile, and
Airflow's ``dag.test()`` on a throwaway sqlite home. The same training body (2 processes, gloo, all-reduce steps for
``--train-seconds``) runs as:

* a ``@task.torch_elastic`` on one node (a Pod) and on two nodes (a PyTorchJob of 2 pods, 1 process each), each
  waited for in the worker (``deferrable=False``) and by the trigger (``deferrable=True``), ``poll_interval=2``;
* cncf.kubernetes' ``KubernetesPodOperator`` running that body through ``torchrun --standalone --nproc-per-node 2``
  in the same image, waited for in the worker and deferred (its defaults otherwise);
* and the Pod once more with ``monitor_interval=5``, the default before it became torchrun's 0.1 s.

Rank 0 stamps the body's first and last line with the wall clock (host and containers share it). Per run:

* **to first line**: the task instance's start -> the body's first line, printed once torch is imported and the
  process group is up (render, submit, schedule, container start, the launch of the workers, their imports);
* **after last line**: the body's last line -> the task instance's end (exit, status seen, result read, clean-up);
* the body itself, for reference.

Medians over ``--repeats`` runs of each (7 by default), all measured in one run of this script, so their ratios
compare.

**Where each second goes** (issue 39): the same runs cut into phases from the API server's audit log (the request
bodies of the kubelet's pods/status patches, the rest at Metadata level) and the body's own stamps, not from the
provider's log. Every time is when the API server had it, in ms:

* *created*: the task's ``create`` of its job object (the Pod, or the PyTorchJob), after the payload Secret's;
* *scheduled*: the scheduler's last pod binding (every pod placed);
* *started*: the kubelet's first status patch that shows the training container running, in the last pod to start;
* *first line* and *last line*: the body's stamps;
* *terminated*: the kubelet's first status patch that shows the container terminated, in the last pod to end;
* *seen*: the task's first request after that (it acts on the terminal state: the final log read, the delete);
* *clean-up done*: the end of the task's last ``delete`` (KubernetesPodOperator keeps its pod here: none);
* *end*: the task instance's end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_HOME = tempfile.mkdtemp(prefix="bench-real-node-airflow-home-")
os.environ.setdefault("AIRFLOW_HOME", _HOME)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_HOME}/airflow.db")
#: The benchmark's DAG file goes here: dag.test() runs only DAGs of a bundle it has synced.
DAGS = Path(_HOME) / "dags"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS)
os.environ["AIRFLOW__TORCH_ELASTIC__JOB_KIND"] = "pytorchjob"  # the local cluster serves TrainJob too

#: The training body, the same in both: rank 0 prints its first and last line's wall-clock time.
BODY = """
def body(seconds):
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # The first training line: after the imports and the process group, where training itself starts.
    first = time.time()
    if os.environ.get("RANK", "0") == "0":
        print(f"BENCH first={first:.3f}", flush=True)
    value = torch.ones(1024)
    steps = max(1, round(seconds / 0.05))  # the same count on every rank: each all-reduce needs them all
    for _ in range(steps):
        dist.all_reduce(value)
        value /= dist.get_world_size()
        time.sleep(0.05)
    dist.destroy_process_group()
    last = time.time()
    if os.environ.get("RANK", "0") == "0":
        print(f"BENCH last={last:.3f} steps={steps}", flush=True)
    return {"first": first, "last": last, "steps": steps}
"""

DAG_FILE = """
import os

import pendulum
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG, task

from airflow_provider_torchelastic import Elastic

IMAGE = os.environ["BENCH_IMAGE"]
NAMESPACE = os.environ["BENCH_NAMESPACE"]
SECONDS = float(os.environ["BENCH_TRAIN_SECONDS"])
START = pendulum.datetime(2026, 1, 1, tz="UTC")
BODY = {body!r}
exec(BODY)
SCRIPT = BODY + "\\nbody(float(__import__('sys').argv[1]))\\n"
TORCHRUN = (
    f"cat > /tmp/train.py <<'EOF'\\n{{SCRIPT}}EOF\\n"
    f"exec torchrun --standalone --nproc-per-node 2 /tmp/train.py {{SECONDS}}"
)

for deferrable in (False, True):
    suffix = "deferred" if deferrable else "sync"
    configs = (
        ("pod", Elastic(nproc_per_node=2)),
        ("pytorchjob", Elastic(nnodes=2, nproc_per_node=1)),
        # The monitor interval's default until 2026-12 (Flyte's): the agent saw its workers end up to 5 s late.
        ("pod5", Elastic(nproc_per_node=2, monitor_interval=5)),
    )
    for kind, config in configs:
        with DAG(f"bench_{{kind}}_{{suffix}}", schedule=None, start_date=START, catchup=False):
            task.torch_elastic(
                body,
                task_id="train",
                task_config=config,
                image=IMAGE,
                namespace=NAMESPACE,
                execution="kubernetes",
                deferrable=deferrable,
                poll_interval=2,
            )(SECONDS)
    with DAG(f"bench_kpo_{{suffix}}", schedule=None, start_date=START, catchup=False):
        KubernetesPodOperator(
            task_id="train",
            name="bench-kpo",
            image=IMAGE,
            cmds=["sh", "-c", TORCHRUN],
            namespace=NAMESPACE,
            kubernetes_conn_id="kubernetes_default",
            get_logs=True,
            on_finish_action="keep_pod",
            deferrable=deferrable,
        )
"""

#: The object each case's task creates for its job.
JOB_RESOURCE = {"pod": "pods", "pod5": "pods", "kpo": "pods", "pytorchjob": "pytorchjobs"}

CASES = (
    ("pod", "sync"),
    ("pod", "deferred"),
    ("pytorchjob", "sync"),
    ("pytorchjob", "deferred"),
    ("kpo", "sync"),
    ("kpo", "deferred"),
    ("pod5", "sync"),
)


def log(msg: str) -> None:
    print(f"[bench-real-node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stamps_from_log(text: str) -> tuple[float, float]:
    first = last = None
    for line in text.splitlines():
        if "BENCH first=" in line:
            first = float(line.split("BENCH first=", 1)[1].split()[0])
        elif "BENCH last=" in line:
            last = float(line.split("BENCH last=", 1)[1].split()[0])
    if first is None or last is None:
        raise RuntimeError(f"the pod's log has no BENCH lines:\n{text[-2000:]}")
    return first, last


#: The audit policy: the kubelet's status patches with their bodies (which say when a container ran and ended), every
#: other request at Metadata level (who, what, when).
AUDIT_RULES = (
    {"level": "Request", "verbs": ["patch", "update"], "resources": [{"group": "", "resources": ["pods/status"]}]},
    {"level": "Metadata"},
)
#: The phases, in order: each is the time from the previous one (``body``: first line -> last line).
PHASES = ("created", "scheduled", "started", "first line", "body", "terminated", "seen", "end")


@dataclass(frozen=True)
class AuditEvent:
    user: str
    verb: str
    resource: str  # "pods", "pods/binding", "pods/status", "pytorchjobs", "secrets", ...
    name: str
    received: float
    completed: float
    body: Any

    @classmethod
    def from_json(cls, event: Mapping[str, Any]) -> AuditEvent:
        ref = event.get("objectRef") or {}
        sub = ref.get("subresource")
        return cls(
            user=(event.get("user") or {}).get("username", ""),
            verb=event.get("verb", ""),
            resource=ref.get("resource", "") + (f"/{sub}" if sub else ""),
            name=ref.get("name", ""),
            received=_timestamp(event["requestReceivedTimestamp"]),
            completed=_timestamp(event["stageTimestamp"]),
            body=event.get("requestObject"),
        )


def _timestamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def read_audit(path: Path) -> list[AuditEvent]:
    with path.open() as f:
        return sorted((AuditEvent.from_json(json.loads(line)) for line in f if line.strip()), key=lambda e: e.received)


def _container_states(body: Any) -> set[str]:
    """The states (``running``, ``terminated``) a kubelet status patch reports for the pod's containers."""
    status = body.get("status") if isinstance(body, dict) else None
    found: set[str] = set()
    for container in (status or {}).get("containerStatuses") or ():
        found.update((container.get("state") or {}).keys())
    return found


def phases(events: Iterable[AuditEvent], run: Mapping[str, float], job_resource: str) -> dict[str, float | None]:
    """One run's phase times (absolute), from the audit events while its task ran (``run``: start, end, first and
    last line). Only this run's pods count: those the scheduler bound while it ran."""
    # Runs follow each other within a second: only what the API received while this task ran is this run's (the
    # harness deletes KubernetesPodOperator's pod after the task's end, outside the window).
    window = [e for e in events if run["start"] <= e.received <= run["end"]]
    bindings = [e for e in window if e.verb == "create" and e.resource == "pods/binding"]
    pods = {e.name for e in bindings}
    task_user = next(
        (
            e.user
            for e in window
            if e.verb == "create" and e.resource == job_resource and not e.user.startswith("system:")
        ),
        None,
    )
    created = next(
        (e.completed for e in window if e.user == task_user and e.verb == "create" and e.resource == job_resource), None
    )

    def first_patch(pod: str, state: str) -> float | None:
        return next(
            (e.completed for e in window
             if e.resource == "pods/status" and e.name == pod and e.user.startswith("system:node:")
             and state in _container_states(e.body)),
            None,
        )  # fmt: skip

    def last_of(values: Iterable[float | None]) -> float | None:
        found = list(values)
        return None if not found or None in found else max(v for v in found if v is not None)

    terminated = last_of(first_patch(pod, "terminated") for pod in pods)
    seen = None
    if terminated is not None:
        seen = next((e.received for e in window if e.user == task_user and e.received >= terminated), None)
    deletes = [e.completed for e in window if e.user == task_user and e.verb == "delete"]
    return {
        "start": run["start"],
        "created": created,
        "scheduled": max((e.completed for e in bindings), default=None),
        "started": last_of(first_patch(pod, "running") for pod in pods),
        "first line": run["first"],
        "body": run["last"],
        "terminated": terminated,
        "seen": seen,
        "end": run["end"],
        "cleanup": max(deletes) if deletes else None,
    }


def durations(times: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each phase's length (from the previous), and where the clean-up ended relative to the task's end."""
    out: dict[str, float | None] = {}
    previous: float | None = times["start"]
    for name in PHASES:
        at = times[name]
        out[name] = None if at is None or previous is None else at - previous
        previous = at
    cleanup = times["cleanup"]
    out["cleanup vs end"] = None if cleanup is None else cleanup - times["end"]  # type: ignore[operator]
    return out


def run_case(dag_folder: Path, dag_id: str, namespace: str) -> dict[str, float]:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from kubernetes import client as k8s
    from sqlalchemy import select

    bag = DagBag(dag_folder=str(dag_folder), safe_mode=False)
    assert not bag.import_errors, bag.import_errors
    dag_run = bag.dags[dag_id].test()
    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == dag_run.run_id)
        ).one()
        if str(ti.state) != "success":
            raise RuntimeError(f"{dag_id}: task {ti.state}; see the output above")
        start, end = ti.start_date.timestamp(), ti.end_date.timestamp()
        if dag_id.startswith("bench_kpo"):
            core = k8s.CoreV1Api()
            pods = core.list_namespaced_pod(namespace, label_selector=f"dag_id={dag_id}").items
            pod = max(pods, key=lambda p: p.metadata.creation_timestamp)
            # The raw bytes: the client's decoded str of a log can come back escaped.
            raw = core.read_namespaced_pod_log(pod.metadata.name, namespace, container="base", _preload_content=False)
            first, last = stamps_from_log(raw.data.decode())
            for p in pods:
                core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
        else:
            rows = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_id, key="return_value"))
            value = XComModel.deserialize_value(rows.one())
            first, last = float(value["first"]), float(value["last"])
    return {
        "to_first": first - start,
        "after_last": end - last,
        "body": last - first,
        "total": end - start,
        # The absolute times, for the phases.
        "start": start,
        "end": end,
        "first": first,
        "last": last,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--train-seconds", type=float, default=5.0)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results.md")
    args = parser.parse_args()

    from tests.cluster import control_plane as cp
    from tests.cluster import image
    from tests.cluster.pytest_plugin import airflow_connection_json

    # `make bench-real-node` builds (or reuses) the node and the runner image first; `up` imports the image.
    reference = image.runner_image_ref()
    work = Path(tempfile.mkdtemp(prefix="bench-real-node-"))
    audit = work / "audit.log"
    plane = cp.ControlPlane(work / "cluster", log=log, node="real", audit_log=audit, audit_rules=AUDIT_RULES)
    started = time.monotonic()
    info = plane.start()
    log(f"cluster with the real node up in {time.monotonic() - started:.0f}s; image {reference}")
    try:
        from airflow.utils import db
        from kubernetes import config as k8s_config

        db.resetdb()
        k8s_config.load_kube_config(str(info.kubeconfig))
        os.environ["AIRFLOW_CONN_KUBERNETES_DEFAULT"] = airflow_connection_json(info.kubeconfig, info.namespace)
        os.environ.update(BENCH_IMAGE=reference, BENCH_NAMESPACE=info.namespace)
        os.environ["BENCH_TRAIN_SECONDS"] = f"{args.train_seconds:g}"
        dags = DAGS
        dags.mkdir(exist_ok=True)
        (dags / "bench_real_node_dags.py").write_text(textwrap.dedent(DAG_FILE.format(body=BODY)))
        measured: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in CASES}
        for _ in range(args.repeats):
            for case in CASES:  # interleaved, so that a slow spell of the machine spreads over every case
                dag_id = f"bench_{case[0]}_{case[1]}"
                result = run_case(dags, dag_id, info.namespace)
                log(f"{dag_id}: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.items()))
                measured[case].append(result)
        time.sleep(3)  # the audit log is written in batches, at most a second apart
        events = read_audit(audit)
    finally:
        plane.stop()
    split: dict[tuple[str, str], list[dict[str, float | None]]] = {
        case: [durations(phases(events, run, JOB_RESOURCE[case[0]])) for run in runs] for case, runs in measured.items()
    }
    record(args, measured, split)


def record(
    args: argparse.Namespace,
    measured: dict[tuple[str, str], list[dict[str, float]]],
    split: dict[tuple[str, str], list[dict[str, float | None]]],
) -> None:
    def median(case: tuple[str, str], key: str) -> float:
        return statistics.median(run[key] for run in measured[case])

    names = {"pod": "torch_elastic, 1 node (Pod)", "pytorchjob": "torch_elastic, 2 nodes (PyTorchJob)",
             "kpo": "KubernetesPodOperator + torchrun",
             "pod5": "torch_elastic, 1 node, monitor_interval=5 (the old default)"}  # fmt: skip
    lines = [
        f"\n## Real node: task overhead beyond the pods' run ({datetime.date.today().isoformat()})\n",
        f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; real kubelet/containerd node, runner "
        f"image from docker/Dockerfile; body {args.train_seconds:g} s of gloo all-reduce on 2 processes; median of "
        f"{args.repeats} interleaved runs (`benchmarks/bench_real_node.py`). Ratios are to KubernetesPodOperator "
        "waiting the same way.\n",
        "| task | wait | to first line | after last line | body | total | overhead vs KPO |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, wait in CASES:
        case = (kind, wait)
        overhead = median(case, "to_first") + median(case, "after_last")
        kpo = median(("kpo", wait), "to_first") + median(("kpo", wait), "after_last")
        lines.append(
            f"| {names[kind]} | {wait} | {median(case, 'to_first'):.1f} s | {median(case, 'after_last'):.1f} s | "
            f"{median(case, 'body'):.1f} s | {median(case, 'total'):.1f} s | {overhead / kpo:.2f}x |"
        )
    lines += [
        "",
        f"Where each second goes: phases from the API server's audit log (kubelet status patches, bindings, the "
        f"task's requests) and the body's stamps, each from the one before, medians of {args.repeats}; (n/m): the "
        "phase was found in n of m runs. *clean-up vs end*: when the task's last delete ended, against the task's "
        "end (negative: before it).\n",
        "| task | wait | " + " | ".join(PHASES) + " | clean-up vs end |",
        "|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    for kind, wait in CASES:
        runs = split[(kind, wait)]
        cells = []
        for name in (*PHASES, "cleanup vs end"):
            found = [at for run in runs if (at := run[name]) is not None]
            cell = f"{statistics.median(found):.2f}" if found else "-"
            cells.append(cell if len(found) in (0, len(runs)) else f"{cell} ({len(found)}/{len(runs)})")
        lines.append(f"| {names[kind]} | {wait} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with args.results.open("a") as out:
        out.write(text)
    log(f"appended to {args.results}")


if __name__ == "__main__":
    main()

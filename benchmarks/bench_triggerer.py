"""Benchmark: hundreds of deferred training jobs waited on in one triggerer, against the local cluster.

Run: ``make bench-triggerer`` (or ``.venv/bin/python benchmarks/bench_triggerer.py [--sizes 50,200,500]
[--window 60] [--no-pod-trigger]``). Results are appended to ``benchmarks/results.md``.

What runs: a fresh local cluster (tests/cluster) with an apiserver audit log; the Airflow identity is the
ServiceAccount bound to ``deploy/rbac.yaml``. For each N, N PyTorchJobs with held pods (tests/cluster/held_jobs.py:
pods that run no process and end when told), half running and half suspended (queued, as Kueue holds them), are
waited on by N ``TorchElasticJobTrigger`` s in Airflow's own ``TriggerRunner`` in a child process, fed trigger rows as
the ``airflow triggerer`` process feeds it (tests/triggerer.py). Measured:

* API requests per waiting job per minute, counted by the apiserver (audit log) for the Airflow identity over a
  steady window (``--window`` seconds, after a warm-up);
* the child's CPU (share of one core) and RSS over the same window, next to the same number of trivial triggers
  (``DateTimeTrigger`` an hour away) as the baseline of Airflow's own overhead;
* then all jobs complete (the queued ones are admitted, every pod is released): the delay from the job's completion
  (the Succeeded condition, as the harness's own watch sees it, ms timestamps) to the trigger's event, p50/p95; and,
  for reference, from the moment the harness released the pod (kubelet + operator + trigger).

Afterwards, separately: cncf.kubernetes' ``KubernetesPodTrigger`` (the deferrable KubernetesPodOperator's trigger,
its defaults: poll every 2 s, logs on) waiting on N single held pods, measured the same way.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_HOME = tempfile.mkdtemp(prefix="bench-triggerer-airflow-home-")
os.environ.setdefault("AIRFLOW_HOME", _HOME)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_HOME}/airflow.db")

#: Warm-up before the window: long enough for the provider's log reads of quiet pods to back off to their steady
#: pace (after 10 and 30 s, then every 60 s); the whole wait, warm-up included, is reported too.
WARMUP_SECONDS = 75.0
#: Trivial triggers and KubernetesPodTrigger have no warm-up behaviour to wait out.
SHORT_WARMUP_SECONDS = 15.0


def log(msg: str) -> None:
    print(f"[bench-triggerer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the child: Airflow's TriggerRunner with N triggers ---------------------------------------------------------


def child(spec_path: Path) -> None:
    """Run the triggers of a spec until all fired or the stop file appears; events go to ``events.jsonl``."""
    import asyncio

    spec = json.loads(spec_path.read_text())
    workdir = spec_path.parent

    async def main() -> None:
        from tests.triggerer import InProcessTriggerer

        t = InProcessTriggerer()
        fired: dict[int, float] = {}

        class Stamped(collections.deque[Any]):
            """The runner's outbound event queue: timestamped as each trigger yields its event."""

            def append(self, entry: Any) -> None:
                fired.setdefault(entry.trigger_id, time.time())
                super().append(entry)

        t.runner.events = Stamped()
        names = {t.add(make_trigger(spec, item)): item["name"] for item in spec["items"]}
        await t.step()
        (workdir / "started").write_text(str(len(names)))
        written: set[int] = set()
        with (workdir / "events.jsonl").open("a") as out:
            while not (workdir / "stop").exists():
                await t.step()
                for trigger_id, at in list(fired.items()):
                    if trigger_id not in written:
                        written.add(trigger_id)
                        payload = t.events.get(trigger_id, [({}, 0.0)])[0][0]
                        out.write(json.dumps({"name": names[trigger_id], "at": at, "event": payload}) + "\n")
                        out.flush()
                # The triggerer's own loop sleeps a second between passes; events are stamped when yielded.
                await asyncio.sleep(1.0)
        await t.close()

    asyncio.run(main())


def make_trigger(spec: dict[str, Any], item: dict[str, Any]) -> Any:
    extras = {"kube_config_path": spec["kubeconfig"]}
    if spec["mode"] == "torchelastic":
        from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger

        return TorchElasticJobTrigger(
            kind=item["kind"],
            name=item["name"],
            namespace=spec["namespace"],
            connection_extras=extras,
            finish_action="keep",
        )
    if spec["mode"] == "kpo":
        from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

        return KubernetesPodTrigger(
            pod_name=item["name"],
            pod_namespace=spec["namespace"],
            trigger_start_time=datetime.datetime.now(datetime.UTC),
            base_container_name="pytorch",
            connection_extras=extras,
            on_finish_action="keep_pod",
        )
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    return DateTimeTrigger(moment=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1))


# --- the parent: cluster, jobs, measurements ----------------------------------------------------------------------


class Cluster:
    def __init__(self, state_dir: Path) -> None:
        from tests.cluster import control_plane as cp

        self.audit = state_dir / "audit.log"
        self.plane = cp.ControlPlane(state_dir, log=log, audit_log=self.audit)
        self.info = self.plane.start()
        from kubernetes import client, config

        api = config.new_client_from_config(str(self.info.kubeconfig))
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.ns = self.info.namespace
        self.sa_user = cp.SA_USER
        self._bind_role()

    def _bind_role(self) -> None:
        import yaml

        docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text())}
        self.rbac.create_namespaced_role(self.ns, docs["Role"])
        self.rbac.create_namespaced_role_binding(self.ns, docs["RoleBinding"])
        # KubernetesPodTrigger reads the pod's events too: give it what it asks for, so that it is measured as
        # deployed, not failing.
        extra = {"metadata": {"name": "bench-events"}, "rules": [_rule("", "events", ["get", "list", "watch"])]}
        self.rbac.create_namespaced_role(self.ns, extra)
        binding = dict(docs["RoleBinding"])
        binding = {
            **binding,
            "metadata": {"name": "bench-events"},
            "roleRef": {**binding["roleRef"], "name": "bench-events"},
        }
        self.rbac.create_namespaced_role_binding(self.ns, binding)

    def stop(self) -> None:
        self.plane.stop()

    # -- jobs --

    def create_jobs(self, n: int) -> tuple[list[str], list[str]]:
        from tests.cluster import held_jobs

        running = [f"bench-{i:04d}" for i in range(n // 2)]
        queued = [f"bench-{i:04d}" for i in range(n // 2, n)]
        for name in running + queued:
            body = held_jobs.held_pytorchjob(name, self.ns, suspended=name in set(queued))
            self.custom.create_namespaced_custom_object(
                held_jobs.GROUP, held_jobs.VERSION, self.ns, "pytorchjobs", body
            )
        return running, queued

    def create_pods(self, n: int) -> list[str]:
        from tests.cluster import held_jobs

        names = [f"bench-pod-{i:04d}" for i in range(n)]
        for name in names:
            self.core.create_namespaced_pod(self.ns, held_jobs.held_pod(name, self.ns))
        return names

    def running_pods(self) -> set[str]:
        pods = self.core.list_namespaced_pod(self.ns).items
        return {p.metadata.name for p in pods if p.status and p.status.phase == "Running"}

    def wait_running(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not set(names) <= (running := self.running_pods()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(set(names) - running)} of {len(names)} pods not running after {timeout} s")
            time.sleep(2)

    def admit(self, jobs: list[str]) -> None:
        for name in jobs:
            body = {"spec": {"runPolicy": {"suspend": False}}}
            self.custom.patch_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs", name, body)

    def release(self, pods: list[str]) -> dict[str, float]:
        from tests.cluster import held_jobs

        released = {}
        for pod in pods:
            released[pod] = time.time()
            self.core.patch_namespaced_pod(pod, self.ns, held_jobs.release_patch(0))
        return released

    def clean(self) -> None:
        from kubernetes.client.exceptions import ApiException

        def quietly(fn: Any, *args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except ApiException as e:
                if e.status != 404:  # already gone (garbage-collected with its job)
                    raise

        for job in self.custom.list_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs")["items"]:
            name = job["metadata"]["name"]
            quietly(self.custom.delete_namespaced_custom_object, "kubeflow.org", "v1", self.ns, "pytorchjobs", name)
        for pod in self.core.list_namespaced_pod(self.ns).items:
            quietly(self.core.delete_namespaced_pod, pod.metadata.name, self.ns, grace_period_seconds=0)
        deadline = time.monotonic() + 300
        while (
            self.core.list_namespaced_pod(self.ns).items
            or self.custom.list_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs")["items"]
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("namespace did not empty")
            time.sleep(2)

    def _airflow_events(self) -> Iterator[dict[str, Any]]:
        """The audit log's events of the Airflow identity."""
        with self.audit.open() as f:
            for line in f:
                event = json.loads(line)
                if event.get("user", {}).get("username") == self.sa_user:
                    yield event

    def requests_by_airflow(self, start: float, end: float) -> collections.Counter[str]:
        """The Airflow identity's requests that completed in [start, end], by verb and resource."""
        counts: collections.Counter[str] = collections.Counter()
        for event in self._airflow_events():
            if start <= audit_time(event["stageTimestamp"]) <= end:
                ref = event.get("objectRef") or {}
                resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
                counts[f"{event.get('verb')} {resource}"] += 1
        return counts

    def log_reads_by_airflow(self) -> dict[str, list[tuple[float, float]]]:
        """Each pod's log reads by the Airflow identity: (received, completed) by the apiserver, in order."""
        reads: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for event in self._airflow_events():
            ref = event.get("objectRef") or {}
            if ref.get("subresource") == "log":
                received, completed = audit_time(event["requestReceivedTimestamp"]), audit_time(event["stageTimestamp"])
                reads[ref.get("name", "?")].append((received, completed))
        return {pod: sorted(r) for pod, r in reads.items()}


def audit_time(stamp: str) -> float:
    """An audit event's timestamp (RFC 3339, microseconds) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def split_delay(seen: float, event: float, reads: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """A job's delay from its Succeeded condition to its event, in three parts, around the trigger's final log read
    (the last one the apiserver completed before the event): until the apiserver received it (the trigger's wake-up,
    the stream's broadcast gap, the queue for the stream's request slots), the read itself, and from its response to
    the event (the trigger's end and Airflow's). None without such a read."""
    final = [r for r in reads if r[1] <= event]
    if not final:
        return None
    received, completed = final[-1]
    return received - seen, completed - received, event - completed


def _rule(group: str, resource: str, verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": [resource], "verbs": verbs}


class Completions:
    """The harness's own watch (admin identity, not counted): when each job (or pod) was seen finished."""

    def __init__(self, cluster: Cluster, kind: str) -> None:
        self.cluster, self.kind = cluster, kind
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        c = self.cluster
        while not self._stop.is_set():
            w = watch.Watch()
            args: tuple[str, ...]
            if self.kind == "PyTorchJob":
                fn, args = c.custom.list_namespaced_custom_object, ("kubeflow.org", "v1", c.ns, "pytorchjobs")
            else:
                fn, args = c.core.list_namespaced_pod, (c.ns,)
            try:
                for event in w.stream(fn, *args, timeout_seconds=30):
                    obj = event["object"]
                    if self.kind == "PyTorchJob":
                        name = obj["metadata"]["name"]
                        conditions = (obj.get("status") or {}).get("conditions") or []
                        done = any(x["type"] in ("Succeeded", "Failed") and x["status"] == "True" for x in conditions)
                    else:
                        name = obj.metadata.name
                        done = bool(obj.status and obj.status.phase in ("Succeeded", "Failed"))
                    if done:
                        self.seen.setdefault(name, time.time())
                    if self._stop.is_set():
                        return
            except Exception as e:  # a broken watch: start another
                log(f"completion watch: {e}")

    def stop(self) -> None:
        self._stop.set()


class Child:
    def __init__(self, workdir: Path, spec: dict[str, Any]) -> None:
        import psutil

        workdir.mkdir(parents=True)
        self.workdir = workdir
        (workdir / "spec.json").write_text(json.dumps(spec))
        self.log_file = (workdir / "triggerer.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(workdir / "spec.json")],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.ps = psutil.Process(self.proc.pid)
        self.started_at = time.time()
        deadline = time.monotonic() + 300
        while not (workdir / "started").exists():  # every trigger handed to the runner
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the triggerer child did not start; see {workdir / 'triggerer.log'}")
            time.sleep(0.5)

    def cpu(self) -> float:
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def events(self) -> dict[str, float]:
        path = self.workdir / "events.jsonl"
        if not path.exists():
            return {}
        return {e["name"]: e["at"] for e in map(json.loads, path.read_text().splitlines())}

    def stop(self) -> None:
        (self.workdir / "stop").write_text("")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def measure_window(child: Child, cluster: Cluster | None, window: float, warmup: float) -> dict[str, Any]:
    time.sleep(warmup)
    start, cpu0 = time.time(), child.cpu()
    time.sleep(window)
    end, cpu1 = time.time(), child.cpu()
    result: dict[str, Any] = {"cpu": (cpu1 - cpu0) / (end - start), "rss": child.rss_mib()}
    if cluster is not None:
        time.sleep(3)  # the audit log is written in batches
        result["requests"] = cluster.requests_by_airflow(start, end)
        result["minutes"] = (end - start) / 60
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_provider(cluster: Cluster, n: int, window: float, workdir: Path) -> dict[str, Any]:
    from tests.cluster import held_jobs

    log(f"N={n}: creating {n // 2} running and {n - n // 2} queued PyTorchJobs")
    running, queued = cluster.create_jobs(n)
    cluster.wait_running([held_jobs.master_pod(j) for j in running], 600)
    spec = {
        "mode": "torchelastic",
        "namespace": cluster.ns,
        "kubeconfig": str(cluster.info.sa_kubeconfig),
        "items": [{"kind": "PyTorchJob", "name": j} for j in running + queued],
    }
    completions = Completions(cluster, "PyTorchJob")
    child = Child(workdir / f"torchelastic-{n}", spec)
    try:
        log(f"N={n}: {n} triggers started; warm-up {WARMUP_SECONDS:.0f} s, window {window:.0f} s")
        result = measure_window(child, cluster, window, WARMUP_SECONDS)
        result["whole"] = cluster.requests_by_airflow(child.started_at, time.time())
        result["whole_minutes"] = (time.time() - child.started_at) / 60
        log(f"N={n}: admitting the queued jobs, then releasing every pod")
        cluster.admit(queued)
        cluster.wait_running([held_jobs.master_pod(j) for j in queued], 600)
        released = cluster.release([held_jobs.master_pod(j) for j in running + queued])
        events = wait_for_events(child, n)
    finally:
        child.stop()
        completions.stop()
    result["fired"] = len(events)
    result["delay_job"] = [events[j] - completions.seen[j] for j in events if j in completions.seen]
    result["delay_release"] = [events[j] - released[held_jobs.master_pod(j)] for j in events]
    reads = cluster.log_reads_by_airflow()
    splits = [
        split_delay(completions.seen[j], events[j], reads.get(held_jobs.master_pod(j), []))
        for j in events
        if j in completions.seen
    ]
    result["delay_split"] = [s for s in splits if s is not None]
    cluster.clean()
    return result


def wait_for_events(child: Child, n: int, timeout: float = 600) -> dict[str, float]:
    """The triggers' events (time fired, by item) once all ``n`` fired, or what fired within ``timeout``."""
    deadline = time.monotonic() + timeout
    while len(child.events()) < n and time.monotonic() < deadline:
        time.sleep(2)
    return child.events()


def run_trivial(n: int, window: float, workdir: Path) -> dict[str, Any]:
    spec = {"mode": "trivial", "namespace": "", "kubeconfig": "", "items": [{"name": f"t{i}"} for i in range(n)]}
    child = Child(workdir / f"trivial-{n}", spec)
    try:
        return measure_window(child, None, window, SHORT_WARMUP_SECONDS)
    finally:
        child.stop()


def run_kpo(cluster: Cluster, n: int, window: float, workdir: Path) -> dict[str, Any]:
    log(f"N={n}: KubernetesPodTrigger on {n} single held pods")
    pods = cluster.create_pods(n)
    cluster.wait_running(pods, 600)
    spec = {
        "mode": "kpo",
        "namespace": cluster.ns,
        "kubeconfig": str(cluster.info.sa_kubeconfig),
        "items": [{"name": p} for p in pods],
    }
    completions = Completions(cluster, "Pod")
    child = Child(workdir / f"kpo-{n}", spec)
    try:
        result = measure_window(child, cluster, window, SHORT_WARMUP_SECONDS)
        result["whole"] = cluster.requests_by_airflow(child.started_at, time.time())
        result["whole_minutes"] = (time.time() - child.started_at) / 60
        released = cluster.release(pods)
        events = wait_for_events(child, n)
    finally:
        child.stop()
        completions.stop()
    result["fired"] = len(events)
    result["delay_job"] = [events[p] - completions.seen[p] for p in events if p in completions.seen]
    result["delay_release"] = [events[p] - released[p] for p in events]
    cluster.clean()
    return result


def report(rows: list[tuple[str, int, dict[str, Any], dict[str, Any] | None]], window: float, sizes: list[int]) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## Triggerer at scale, {now}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "",
        f"`make bench-triggerer` (benchmarks/bench_triggerer.py): N = {', '.join(map(str, sizes))} deferred jobs in "
        "one Airflow `TriggerRunner` fed trigger rows, on the local cluster (one kube-apiserver 1.20, simulated "
        f"operator and kubelet on this machine). Requests: apiserver audit log, Airflow's identity, over a {window:.0f}"
        f" s window after {WARMUP_SECONDS:.0f} s of warm-up ({SHORT_WARMUP_SECONDS:.0f} s for the others), and in "
        "brackets over the whole wait, from the start of the triggers until the jobs are released; half of the "
        "jobs running (held pods) "
        "and half queued (suspended). CPU: the triggerer process over the same window, in % of one core, next to N "
        "`DateTimeTrigger`s (Airflow's own overhead). Delay: from the job's Succeeded condition as the harness's own "
        "watch saw it (ms timestamps) to the trigger's event; in brackets, from the harness releasing the pod "
        "(includes the simulated kubelet and operator).",
        "",
        "| triggers | N | requests/job/min, window (whole wait) | CPU % of a core (trivial baseline) | above "
        "baseline | RSS MiB (baseline) | delay p50 / p95 s | [from release p50 / p95 s] | events |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, n, r, base in rows:
        per_min = sum(r["requests"].values()) / n / r["minutes"]
        whole = sum(r["whole"].values()) / n / r["whole_minutes"]
        base_cpu = base["cpu"] * 100 if base else float("nan")
        base_rss = base["rss"] if base else float("nan")
        lines.append(
            f"| {label} | {n} | {per_min:.2f} ({whole:.2f}) | {r['cpu'] * 100:.1f} ({base_cpu:.1f}) | "
            f"{r['cpu'] * 100 - base_cpu:.1f} | {r['rss']:.0f} ({base_rss:.0f}) | "
            f"{pct(r['delay_job'], 0.5):.2f} / {pct(r['delay_job'], 0.95):.2f} | "
            f"[{pct(r['delay_release'], 0.5):.2f} / {pct(r['delay_release'], 0.95):.2f}] | {r['fired']}/{n} |"
        )
    split_rows = [(label, n, r["delay_split"]) for label, n, r, _ in rows if r.get("delay_split")]
    if split_rows:
        lines += [
            "",
            "The delay in three parts, around each trigger's final log read (apiserver audit timestamps): until the "
            "apiserver received it (wake-up, broadcast gap, the stream's request slots), the read, then to the event.",
            "",
            "| triggers | N | to the read p50 / p95 s | read p50 / p95 s | read to event p50 / p95 s | jobs |",
            "|---|---|---|---|---|---|",
        ]
        for label, n, parts in split_rows:
            cells = " | ".join(
                f"{pct([p[i] for p in parts], 0.5):.2f} / {pct([p[i] for p in parts], 0.95):.2f}" for i in range(3)
            )
            lines.append(f"| {label} | {n} | {cells} | {len(parts)} |")
    lines.append("")
    lines.append("Requests in the window, by verb and resource:")
    lines.append("")
    for label, n, r, _ in rows:
        top = ", ".join(f"{k}: {v}" for k, v in r["requests"].most_common(6))
        lines.append(f"- {label}, N={n}: {top or 'none'}")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="50,200,500")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of steady waiting measured per case")
    parser.add_argument("--no-pod-trigger", action="store_true", help="skip cncf.kubernetes' KubernetesPodTrigger")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results.md")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="bench-triggerer-"))
    log(f"work dir {workdir}; starting the local cluster with an audit log")
    cluster = Cluster(workdir / "cluster")
    rows: list[tuple[str, int, dict[str, Any], dict[str, Any] | None]] = []
    try:
        for n in sizes:
            base = run_trivial(n, args.window, workdir)
            rows.append(
                ("TorchElasticJobTrigger (shared watch)", n, run_provider(cluster, n, args.window, workdir), base)
            )
            log(report(rows[-1:], args.window, sizes))
        if not args.no_pod_trigger:
            for n in sizes:
                # The trivial-trigger baseline measured beside the provider's run of the same size.
                base = next(r[3] for r in rows if r[1] == n and r[3] is not None)
                rows.append(
                    ("KubernetesPodTrigger (cncf.kubernetes)", n, run_kpo(cluster, n, args.window, workdir), base)
                )
                log(report(rows[-1:], args.window, sizes))
    finally:
        cluster.stop()
    text = report(rows, args.window, sizes)
    print(text)
    with args.out.open("a") as f:
        f.write("\n" + text)
    log(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

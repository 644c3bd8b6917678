"""The simulated kubelet: pure rules, then real pods through a real kube-apiserver (``@pytest.mark.cluster``).

The cluster tests create bare Pods (no operator involved) and check what a client sees: pod status in the shape a
real kubelet writes (validated against the 1.33 Pod schema), logs through the apiserver's pods/log proxy with both
Python clients, restarts, termination messages, deletion, and the injected faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.cluster import sim_kubelet as sk

T = TypeVar("T")

PY = "python"  # the kubelet runs container Pythons with the runner env's interpreter
IMAGE = "registry.example/torchelastic-test:1"


# ----------------------------------------------------------------------------------------------------------------
# Pure rules
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # unknown references stay
        ("cost $5", "cost $5"),
        ("$(A", "$(A"),
    ],
)
def test_expand_vars_follows_kubernetes(value: str, expected: str) -> None:
    assert sk.expand_vars(value, {"A": "1", "B": "two"}) == expected


def test_rewrite_path_value_maps_mounts_flags_and_lists() -> None:
    mounts = [("/etc/payload", "/w/ns/p/volumes/payload"), ("/dev/termination-log", "/w/ns/p/termination/pytorch")]
    assert sk.rewrite_path_value("/etc/payload/run.py", mounts, split_colons=False) == "/w/ns/p/volumes/payload/run.py"
    assert sk.rewrite_path_value("/etc/payload", mounts, split_colons=False) == "/w/ns/p/volumes/payload"
    assert sk.rewrite_path_value("/etc/payloadx", mounts, split_colons=False) == "/etc/payloadx"
    assert (
        sk.rewrite_path_value("--result=/dev/termination-log", mounts, False) == "--result=/w/ns/p/termination/pytorch"
    )
    assert (
        sk.rewrite_path_value("/etc/payload:/usr/lib", mounts, split_colons=True) == "/w/ns/p/volumes/payload:/usr/lib"
    )


def test_rewrite_hosts_maps_cluster_names_only() -> None:
    known = {"job-worker-0": ("ns", "job-worker-0"), "job-master-0.ns.svc.cluster.local": ("ns", "job-master-0")}
    ports = {("ns", "job-worker-0", 23456): 20001, ("ns", "job-master-0", 23456): 20002}

    def resolve(host: str) -> tuple[str, str] | None:
        return known.get(host)

    def map_port(ns: str, name: str, port: int) -> int:
        return ports[(ns, name, port)]

    assert sk.rewrite_hosts("job-worker-0:23456", resolve, map_port, bare=False) == "127.0.0.1:20001"
    assert sk.rewrite_hosts("tcp://job-master-0.ns.svc.cluster.local:23456", resolve, map_port, False) == (
        "tcp://127.0.0.1:20002"
    )
    assert sk.rewrite_hosts("job-worker-0", resolve, map_port, bare=True) == "127.0.0.1"
    assert sk.rewrite_hosts("job-worker-0", resolve, map_port, bare=False) == "job-worker-0"
    assert sk.rewrite_hosts("2:2", resolve, map_port, bare=False) == "2:2"  # PET_NNODES is no host:port
    assert sk.rewrite_hosts("elsewhere:80", resolve, map_port, bare=False) == "elsewhere:80"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("a-0", ("ns", "a-0")),
        ("a-0.other", ("other", "a-0")),
        ("a-0.other.svc", ("other", "a-0")),
        ("a-0.other.svc.cluster.local", ("other", "a-0")),
        ("example.com.au.x", None),
        ("127.0.0.1", None),
        ("Upper", None),
    ],
)
def test_split_cluster_host(host: str, expected: tuple[str, str] | None) -> None:
    assert sk.split_cluster_host(host, "ns") == expected


@pytest.mark.parametrize(
    ("policy", "codes", "pending_restart", "phase"),
    [
        ("Never", [0, 0], False, "Succeeded"),
        ("Never", [0, 1], False, "Failed"),
        ("Never", [None, 1], False, "Running"),
        ("OnFailure", [0], False, "Succeeded"),
        ("OnFailure", [1], True, "Running"),
        ("Always", [0], True, "Running"),
    ],
)
def test_decide_pod_phase(policy: str, codes: list[int | None], pending_restart: bool, phase: str) -> None:
    assert sk.decide_pod_phase(policy, codes, pending_restart) == phase


def test_python_argv_uses_the_runner_interpreter() -> None:
    env = "/env/bin/python"
    assert sk.python_argv(["python3.11", "-c", "x"], env) == [env, "-c", "x"]
    assert sk.python_argv(["/usr/local/bin/python", "m.py"], env) == [env, "m.py"]
    assert sk.python_argv(["torchrun", "t.py"], env) == [env, "-m", "torch.distributed.run", "t.py"]
    assert sk.python_argv(["sh", "-c", "true"], env) == ["sh", "-c", "true"]


RUNNER_PYTHON = Path("/runner-env/bin/python")


def offline_kubelet(workdir: Path) -> sk.Kubelet:
    """A kubelet whose API client points at an API server that is never called (the env built here needs none)."""
    from kubernetes import client

    return sk.Kubelet(client.ApiClient(client.Configuration(host="https://127.0.0.1:6443")), workdir, RUNNER_PYTHON)


def bare_pod(name: str, spec: dict[str, Any], volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": "uid-1"},
        "spec": {"containers": [spec], "volumes": volumes or []},
    }


def test_container_env_holds_only_what_a_kubelet_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the test process (and so the simulated kubelet's own process) has must not reach a pod.
    monkeypatch.setenv("TORCHELASTIC_LEAK_MARKER", "from-the-test-process")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    spec = container(
        [PY, "-c", "pass", "--out=/workspace/out.json", "$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"],
        env=[
            {"name": "GREETING", "value": "hi"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "API", "value": "$(KUBERNETES_SERVICE_HOST)"},
        ],
        workingDir="/workspace",
    )
    pod_dir = tmp_path / "ns" / "trainer-0"
    config = offline_kubelet(tmp_path).container_process_config(bare_pod("trainer-0", spec), spec, pod_dir)
    own = pod_dir / "containers" / "main"
    assert config.env == {
        # the image's ENV
        "PATH": f"{RUNNER_PYTHON.parent}:{sk.IMAGE_PATH}",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "HOME": str(own / "home"),
        # the runtime's and the kubelet's (TMPDIR: the container's own /tmp, which a process here lacks)
        "TMPDIR": str(own / "tmp"),
        "HOSTNAME": "trainer-0",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": "6443",
        # the manifest's
        "GREETING": "hi",
        "POD_NAME": "trainer-0",
        "API": "127.0.0.1",
    }
    assert config.argv == [str(RUNNER_PYTHON), "-c", "pass", f"--out={own}/workdir/out.json", "127.0.0.1:6443"]
    assert (config.cwd, config.home, config.tmp, config.container_dir) == (
        own / "workdir",
        own / "home",
        own / "tmp",
        own,
    )


def test_manifest_env_wins_and_a_working_dir_on_a_volume_is_that_volume(tmp_path: Path) -> None:
    spec = container(
        ["sh", "-c", "true"],
        env=[{"name": "HOSTNAME", "value": "custom"}, {"name": "PATH", "value": "/opt/bin"}],
        workingDir="/data/run",
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
    )
    pod_dir = tmp_path / "ns" / "p"
    pod = bare_pod("p", spec, volumes=[{"name": "data", "emptyDir": {}}])
    config = offline_kubelet(tmp_path).container_process_config(pod, spec, pod_dir)
    assert (config.env["HOSTNAME"], config.env["PATH"]) == ("custom", "/opt/bin")
    assert config.cwd == pod_dir / "volumes" / "data" / "run"
    assert config.argv == ["sh", "-c", "true"]


def test_no_working_dir_is_an_empty_directory_of_the_container(tmp_path: Path) -> None:
    spec = container([])
    config = offline_kubelet(tmp_path).container_process_config(bare_pod("p", spec), spec, tmp_path / "p")
    assert config.cwd == tmp_path / "p" / "containers" / "main" / "workdir"
    assert config.argv == [str(RUNNER_PYTHON), "-c", "pass"]


def test_select_log_lines_applies_since_then_tail() -> None:
    lines = [b"2024-01-01T00:00:00.000000001Z a", b"2024-01-01T00:00:05.5Z b", b"2024-01-01T00:00:09.000000000Z c"]
    since = sk.parse_timestamp("2024-01-01T00:00:05Z")
    assert sk.select_log_lines(lines, sk.LogQuery(since=since)) == [b"b", b"c"]
    assert sk.select_log_lines(lines, sk.LogQuery(tail_lines=1, timestamps=True)) == [lines[2]]
    assert sk.select_log_lines(lines, sk.LogQuery(tail_lines=0)) == []


def test_qos_class() -> None:
    def pod(resources: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": "c", "resources": resources}]}}

    assert sk.qos_class(pod({})) == "BestEffort"
    assert sk.qos_class(pod({"limits": {"cpu": "1", "memory": "1Gi"}})) == "Guaranteed"
    assert sk.qos_class(pod({"requests": {"cpu": "1"}})) == "Burstable"


def test_crash_loop_backoff_is_the_real_kubelets() -> None:
    """kubelet.go: backOffPeriod 10 s, MaxContainerBackOff 300 s; the first exit restarts at once (no entry yet)."""
    windows: list[float] = []
    previous = None
    for _ in range(7):
        previous = sk.next_restart_backoff(previous)
        windows.append(previous)
    assert windows == [10, 20, 40, 80, 160, 300, 300]
    assert sk.crash_loop_waits(8) == [0, 10, 20, 40, 80, 160, 300, 300]
    # The test-only speed-up multiplies every wait.
    assert sk.crash_loop_waits(8, 0.1) == pytest.approx([0, 1, 2, 4, 8, 16, 30, 30])
    assert sk.crash_loop_waits(3, sk.TEST_RESTART_BACKOFF_SCALE) == pytest.approx([0, 1, 2])


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_crash_loop_backoff_starts_over_after_ten_minutes(scale: float) -> None:
    backoff = sk.CrashLoopBackoff(scale)
    clock = 1000.0
    for _ in range(4):  # 0, 10, 20, 40 (scaled)
        clock += backoff.delay(clock) * scale
        backoff.restarted(clock)
    assert backoff.window == 80
    # An exit within 2 x MaxContainerBackOff (10 min, scaled) of the last restart waits the window in force ...
    assert backoff.delay(clock + 600 * scale) == 80
    # ... a later one restarts at once, and the next crash waits 10 s again.
    assert backoff.delay(clock + 601 * scale) == 0
    backoff.restarted(clock + 601 * scale)
    assert backoff.delay(clock + 602 * scale) == 10


def test_backoff_messages_use_gos_duration_format() -> None:
    assert [sk.go_duration(w) for w in (0, 10, 40, 80, 160, 300, 3600)] == [
        "0s",
        "10s",
        "40s",
        "1m20s",
        "2m40s",
        "5m0s",
        "1h0m0s",
    ]


def test_restart_backoff_scale_flag() -> None:
    base = ["--kubeconfig", "k", "--workdir", "w", "--runner-python", "p"]
    assert sk.build_parser().parse_args(base).restart_backoff_scale == 1.0  # a real kubelet by default
    assert sk.build_parser().parse_args([*base, "--restart-backoff-scale", "0.1"]).restart_backoff_scale == 0.1
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            sk.build_parser().parse_args([*base, "--restart-backoff-scale", bad])
    with pytest.raises(ValueError):
        sk.Kubelet(offline_kubelet(Path("/nonexistent")).api, Path("/nonexistent"), RUNNER_PYTHON, 0)
    kubelet = sk.Kubelet(offline_kubelet(Path("/x")).api, Path("/x"), RUNNER_PYTHON, restart_backoff_scale=0.1)
    runner = sk.PodRunner(kubelet, bare_pod("p", container([PY])), None)
    assert [c.backoff.scale for c in runner.main] == [0.1]


def test_control_plane_passes_the_test_speed_up() -> None:
    """The value the docs and the cluster tests' timings assume is what the control plane gives the kubelet."""
    from tests.cluster import control_plane

    passed = re.findall(r'"--restart-backoff-scale",\s*"([^"]*)"', Path(control_plane.__file__).read_text())
    assert [float(v) for v in passed] == [sk.TEST_RESTART_BACKOFF_SCALE]


# ----------------------------------------------------------------------------------------------------------------
# Who hosts the c10d rendezvous store
# ----------------------------------------------------------------------------------------------------------------


def test_rdzv_endpoint_and_conf_are_found_like_argparse_does() -> None:
    argv = ["torchrun", "--rdzv-endpoint", "a:1", "--rdzv_endpoint=b:2", "t.py"]
    assert sk.rdzv_endpoint(argv, {"PET_RDZV_ENDPOINT": "c:3"}) == "b:2"  # the last flag wins, over the env
    assert sk.rdzv_endpoint(["torchrun", "t.py"], {"PET_RDZV_ENDPOINT": "c:3"}) == "c:3"
    assert sk.rdzv_endpoint(["torchrun", "t.py"], {"PET_RDZV_ENDPOINT": " "}) is None
    assert sk.rdzv_endpoint(["torchrun", "--rdzv-endpoint"], {}) is None  # a dangling flag has no value
    assert [sk.endpoint_host(e) for e in ("j-worker-0:23456", "j-worker-0", "[::1]:29400", "h.ns.svc:1")] == [
        "j-worker-0",
        "j-worker-0",
        "::1",
        "h.ns.svc",
    ]


@pytest.mark.parametrize(
    ("argv", "env", "is_host", "expected_argv", "expected_conf"),
    [
        # The provider's runner: --rdzv-conf on the command line, which wins over PET_RDZV_CONF.
        (
            ["python", "-m", "r", "--rdzv-conf", "timeout=900,join_timeout=900"],
            {"PET_RDZV_CONF": "a=1"},
            True,
            ["python", "-m", "r", "--rdzv-conf", "timeout=900,join_timeout=900,is_host=1"],
            "a=1",
        ),
        (
            ["torchrun", "--rdzv_conf=read_timeout=5", "t.py"],
            {},
            False,
            ["torchrun", "--rdzv_conf=read_timeout=5,is_host=0", "t.py"],
            None,
        ),
        # torchrun from the operator's env alone: PET_RDZV_CONF is appended to, or created.
        (
            ["torchrun", "t.py"],
            {"PET_RDZV_CONF": "read_timeout=5"},
            False,
            ["torchrun", "t.py"],
            "read_timeout=5,is_host=0",
        ),
        (["torchrun", "t.py"], {}, True, ["torchrun", "t.py"], "is_host=1"),
        # A user's own is_host is kept, as torch would honour it on a real cluster.
        (["torchrun", "t.py"], {"PET_RDZV_CONF": "is_host=true"}, False, ["torchrun", "t.py"], "is_host=true"),
    ],
)
def test_with_is_host_says_it_where_the_config_is_read(
    argv: list[str], env: dict[str, str], is_host: bool, expected_argv: list[str], expected_conf: str | None
) -> None:
    new_argv, new_env = sk.with_is_host(argv, env, is_host)
    assert new_argv == expected_argv
    assert new_env.get("PET_RDZV_CONF") == expected_conf


@pytest.mark.parametrize("is_host", [True, False])
def test_injected_is_host_parses_for_torchrun_and_the_runner(is_host: bool) -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from airflow_provider_torchelastic.runner import _parse_rdzv_conf

    conf = sk.conf_with_is_host("timeout=900,join_timeout=900", is_host)
    for configs in (_parse_rendezvous_config(conf), _parse_rdzv_conf(conf)):  # torchrun's, then the runner's
        params = RendezvousParameters("c10d", "127.0.0.1:1", "run", 2, 2, **configs)
        assert params.get_as_bool("is_host") is is_host
        assert params.get_as_int("timeout") == 900


def test_only_the_endpoint_pod_is_told_to_host_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubelet = offline_kubelet(tmp_path)
    # Two pods, a headless Service "rdzv" that selects worker-1, and a ClusterIP Service "rdzv-clusterip".
    known = {("ns", "job-worker-0"), ("ns", "job-worker-1"), ("ns", "rdzv"), ("ns", "rdzv-clusterip")}
    headless = {"rdzv": {sk.LABEL_REPLICA_INDEX: "1"}}
    ports = {"job-worker-0": 20000, "rdzv": 20001, "rdzv-clusterip": 20002}

    def resolve(host: str, namespace: str) -> tuple[str, str] | None:
        target = sk.split_cluster_host(host, namespace)
        return target if target in known else None

    monkeypatch.setattr(kubelet, "resolve_cluster_host", resolve)
    monkeypatch.setattr(kubelet, "_headless_selector", lambda ns, name: headless.get(name))
    monkeypatch.setattr(kubelet.ports, "get", lambda ns, name, port: ports[name])

    def config_of(pod_name: str, endpoint: str, args: list[str]) -> sk.ProcessConfig:
        spec = container(["torchrun", *args], env=[{"name": "PET_RDZV_ENDPOINT", "value": endpoint}])
        pod = bare_pod(pod_name, spec)
        pod["metadata"]["labels"] = {sk.LABEL_REPLICA_INDEX: pod_name[-1]}
        return kubelet.container_process_config(pod, spec, tmp_path / pod_name)

    w0, w1 = (config_of(f"job-worker-{i}", "job-worker-0:23456", ["t.py"]) for i in (0, 1))
    assert (w0.env["PET_RDZV_CONF"], w1.env["PET_RDZV_CONF"]) == ("is_host=1", "is_host=0")
    assert w0.env["PET_RDZV_ENDPOINT"] == w1.env["PET_RDZV_ENDPOINT"] == "127.0.0.1:20000"  # rewritten after
    # The endpoint in the args, through $(VAR) expansion, and a --rdzv-conf there: that is where is_host goes.
    args = ["--rdzv-endpoint=$(PET_RDZV_ENDPOINT)", "--rdzv-conf", "read_timeout=5", "t.py"]
    w1 = config_of("job-worker-1", "job-worker-0.ns.svc.cluster.local:23456", args)
    assert w1.argv[-4:] == ["--rdzv-endpoint=127.0.0.1:20000", "--rdzv-conf", "read_timeout=5,is_host=0", "t.py"]
    assert "PET_RDZV_CONF" not in w1.env
    # A headless Service of another name: the pod it selects hosts; a ClusterIP Service: nobody does.
    assert config_of("job-worker-1", "rdzv:29400", ["t.py"]).env["PET_RDZV_CONF"] == "is_host=1"
    assert config_of("job-worker-0", "rdzv:29400", ["t.py"]).env["PET_RDZV_CONF"] == "is_host=0"
    assert config_of("job-worker-0", "rdzv-clusterip:29400", ["t.py"]).env["PET_RDZV_CONF"] == "is_host=0"
    # An endpoint outside the cluster: torch decides, as it would.
    assert "PET_RDZV_CONF" not in config_of("job-worker-0", "etcd.example.com:2379", ["t.py"]).env


# ----------------------------------------------------------------------------------------------------------------
# Cluster helpers
# ----------------------------------------------------------------------------------------------------------------


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def container(command: list[str], name: str = "main", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": IMAGE, "command": command, **extra}


def pod_manifest(
    name: str,
    containers: list[dict[str, Any]],
    *,
    restart_policy: str = "Never",
    annotations: dict[str, str] | None = None,
    volumes: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": containers,
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": 3,
    }
    if volumes:
        spec["volumes"] = volumes
    if init_containers:
        spec["initContainers"] = init_containers
    meta: dict[str, Any] = {"name": name, "labels": {"app": "sim-kubelet-test"}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


class Pods:
    """Creates pods in the test namespace and deletes what it created when the test ends."""

    def __init__(self, core: Any, namespace: str) -> None:
        self.core = core
        self.namespace = namespace
        self.created: list[str] = []

    def create(self, manifest: dict[str, Any]) -> str:
        self.core.create_namespaced_pod(self.namespace, manifest, _preload_content=False)
        self.created.append(manifest["metadata"]["name"])
        return str(manifest["metadata"]["name"])

    def get(self, name: str) -> dict[str, Any]:
        return json.loads(self.core.read_namespaced_pod(name, self.namespace, _preload_content=False).data)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def wait_phase(self, name: str, phases: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = self.status(name)
            return status if status.get("phase") in phases else None

        return wait_for(check, timeout, f"{name} in {phases}")

    def container_status(self, name: str, container_name: str = "main") -> dict[str, Any]:
        for cs in self.status(name).get("containerStatuses") or []:
            if cs["name"] == container_name:
                return dict(cs)
        return {}

    def waiting_reason(self, name: str, container_name: str = "main") -> str | None:
        state = self.container_status(name, container_name).get("state") or {}
        return (state.get("waiting") or {}).get("reason")

    def log(self, name: str, **kwargs: Any) -> str:
        resp = self.core.read_namespaced_pod_log(name, self.namespace, _preload_content=False, **kwargs)
        return str(resp.data.decode())

    def exists(self, name: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            self.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def cleanup(self) -> None:
        from kubernetes.client.rest import ApiException

        for name in self.created:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0, _preload_content=False)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[Any]:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube_cluster.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def core(api: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(api)


@pytest.fixture
def pods(core: Any, kube_cluster: Any) -> Iterator[Pods]:
    helper = Pods(core, kube_cluster.namespace)
    yield helper
    helper.cleanup()


def validate_pod(pod: dict[str, Any]) -> None:
    """The whole object, as read from the apiserver, against the 1.33 Pod schema (no unknown fields)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(pod, "1.33", strict=True)


def pgid_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# Running containers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_pod_runs_and_reports_a_real_kubelet_status(pods: Pods, core: Any) -> None:
    script = (
        "import os, sys\n"
        "print('hello from', os.environ['POD_NAME'], sys.argv[1], flush=True)\n"
        "open(os.environ['RESULT'], 'w').write('{\"ok\": true}')\n"
    )
    name = unique("basic")
    pods.create(
        pod_manifest(
            name,
            [
                container(
                    [PY, "-c", script],
                    args=["$(GREETING)-$(POD_NAME)"],
                    env=[
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "GREETING", "value": "hi"},
                        {"name": "RESULT", "value": "/dev/termination-log"},
                    ],
                )
            ],
        )
    )
    pods.wait_phase(name, ("Succeeded", "Failed"))
    pod = pods.get(name)
    status = pod["status"]
    assert status["phase"] == "Succeeded"
    assert status["hostIP"] == status["podIP"] == "127.0.0.1"
    assert pod["spec"]["nodeName"] == sk.NODE_NAME  # bound through pods/binding
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Initialized": "True",
        "Ready": "False",
        "ContainersReady": "False",
        "PodScheduled": "True",
    }
    (cs,) = status["containerStatuses"]
    term = cs["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (0, "Completed")
    assert term["message"] == '{"ok": true}'  # read from the mapped terminationMessagePath
    assert cs["imageID"].startswith(f"docker-pullable://{IMAGE.split(':')[0]}") and cs["containerID"].startswith(
        "docker://"
    )
    assert pods.log(name) == f"hello from {name} hi-{name}\n"
    validate_pod(pod)
    # The typed client deserializes it (it refuses e.g. a missing imageID).
    assert core.read_namespaced_pod(name, pods.namespace).status.container_statuses[0].state.terminated.exit_code == 0


@pytest.mark.cluster
def test_configmap_volume_and_env_sources(pods: Pods, core: Any) -> None:
    cm = unique("cm")
    core.create_namespaced_config_map(
        pods.namespace,
        {
            "metadata": {"name": cm},
            "data": {
                "script.py": "import os\nprint(os.environ['FROM_KEY'], os.environ['P_greeting'])\n",
                "greeting": "hey",
            },
            "binaryData": {"blob.bin": "AAEC"},  # bytes 0, 1, 2
        },
    )
    try:
        check = (
            "import os, sys, runpy\n"
            "d = '/opt/payload'\n"
            "print(sorted(os.listdir(d)), open(d + '/data/blob', 'rb').read(), os.listdir('.'))\n"
            "runpy.run_path(d + '/script.py')\n"
        )
        name = unique("cmvol")
        pods.create(
            pod_manifest(
                name,
                [
                    container(
                        [PY, "-c", check.replace("/opt/payload", "$(PAYLOAD)")],
                        env=[
                            {"name": "PAYLOAD", "value": "/opt/payload"},
                            {"name": "FROM_KEY", "valueFrom": {"configMapKeyRef": {"name": cm, "key": "greeting"}}},
                        ],
                        envFrom=[{"prefix": "P_", "configMapRef": {"name": cm}}],
                        volumeMounts=[{"name": "payload", "mountPath": "/opt/payload"}],
                    )
                ],
                volumes=[
                    {
                        "name": "payload",
                        "configMap": {
                            "name": cm,
                            "items": [
                                {"key": "script.py", "path": "script.py"},
                                {"key": "blob.bin", "path": "data/blob"},
                            ],
                        },
                    }
                ],
            )
        )
        pods.wait_phase(name, ("Succeeded", "Failed"))
        assert pods.log(name) == "['data', 'script.py'] b'\\x00\\x01\\x02' []\nhey hey\n"
    finally:
        core.delete_namespaced_config_map(cm, pods.namespace)


IMAGE_PROBE = """
import importlib.util, json, os, sys
open("written-here", "w").close()
print(json.dumps({
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "files": os.listdir("."),
    "argv": sys.argv[1:],
    "executable": sys.executable,
    "path": sys.path,
    "importable": {m: importlib.util.find_spec(m) is not None for m in (
        "airflow", "kubernetes", "tests", "torch", "cloudpickle", "numpy", "airflow_provider_torchelastic.runner"
    )},
}))
"""


@pytest.mark.cluster
def test_containers_run_like_the_runner_image(pods: Pods, kube_cluster: Any) -> None:
    """The runner env's Python, the container's own working dir, and nothing of the test process's environment
    (which the simulated kubelet inherited: AIRFLOW_HOME, PYTHONPATH to the checkout, ...)."""
    from tests.cluster.control_plane import REPO_ROOT

    name = unique("image")
    pods.create(
        pod_manifest(
            name,
            [
                container(
                    ["python3", "-c", IMAGE_PROBE],
                    args=["--out=/workspace/result.json"],
                    workingDir="/workspace",
                    env=[{"name": "GREETING", "value": "hi"}],
                )
            ],
        )
    )
    status = pods.wait_phase(name, ("Succeeded", "Failed"))
    assert status["phase"] == "Succeeded", pods.log(name)
    seen = json.loads(pods.log(name))
    env = seen["env"]
    assert sorted(env) == [
        "GREETING",
        "HOME",
        "HOSTNAME",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "LANG",
        "PATH",
        "PYTHONUNBUFFERED",
        "TMPDIR",
    ]
    assert env["HOSTNAME"] == name
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == (
        "127.0.0.1",
        str(kube_cluster.info.api_port),
    )
    assert env["PATH"].split(":")[0] == str(kube_cluster.runner_python.parent)
    own = kube_cluster.state_dir / "kubelet" / pods.namespace / name / "containers" / "main"
    assert Path(seen["cwd"]) == own / "workdir"
    assert seen["files"] == ["written-here"]  # it started empty
    assert seen["argv"] == [f"--out={own}/workdir/result.json"]  # workingDir paths map like mount paths
    assert seen["executable"] == str(kube_cluster.runner_python)
    assert not [p for p in seen["path"] if p.startswith(str(REPO_ROOT))], seen["path"]
    assert seen["importable"] == {
        "airflow": False,
        "kubernetes": False,
        "tests": False,
        "torch": True,
        "cloudpickle": True,
        "numpy": True,
        "airflow_provider_torchelastic.runner": True,
    }


@pytest.mark.cluster
def test_missing_configmap_key_is_a_create_container_config_error(pods: Pods) -> None:
    name = unique("nokey")
    pods.create(
        pod_manifest(
            name,
            [
                container(
                    [PY, "-c", "pass"],
                    env=[{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "does-not-exist", "key": "k"}}}],
                )
            ],
        )
    )
    wait_for(lambda: pods.waiting_reason(name) == "CreateContainerConfigError", 30, "CreateContainerConfigError")
    cs = pods.container_status(name)
    assert cs["state"]["waiting"]["message"] == 'configmap "does-not-exist" not found'
    assert pods.phase(name) == "Pending"
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_restart_on_failure_restarts_in_place(pods: Pods) -> None:
    # Fails on the first run (no marker yet in the emptyDir), succeeds on the second.
    script = (
        "import os, sys\n"
        "m = os.path.join(os.environ['SCRATCH'], 'ran')\n"
        "first = not os.path.exists(m)\n"
        "open(m, 'w').close()\n"
        "print('first run' if first else 'second run', flush=True)\n"
        "sys.exit(2 if first else 0)\n"
    )
    name = unique("restart")
    pods.create(
        pod_manifest(
            name,
            [
                container(
                    [PY, "-c", script],
                    env=[{"name": "SCRATCH", "value": "/scratch"}],
                    volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
                )
            ],
            restart_policy="OnFailure",
            volumes=[{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        )
    )
    pods.wait_phase(name, ("Succeeded", "Failed"), timeout=60)
    cs = pods.container_status(name)
    assert cs["restartCount"] == 1
    assert cs["lastState"]["terminated"]["exitCode"] == 2
    assert cs["lastState"]["terminated"]["reason"] == "Error"
    assert pods.phase(name) == "Succeeded"
    assert pods.log(name) == "second run\n"
    assert pods.log(name, previous=True) == "first run\n"
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_crash_loop_backoff_timing_and_status(pods: Pods) -> None:
    """Three crashes, then success: restarted at once, then after 1 s and 2 s (the real 10 s and 20 s at the test
    cluster's --restart-backoff-scale 0.1), with the real numbers in the CrashLoopBackOff message."""
    # Each run notes when it started and, last thing, when it ends; the fourth prints both lists and succeeds.
    script = (
        "import json, os, sys, time\n"
        "def note(kind):\n"
        "    open(os.path.join(os.environ['SCRATCH'], kind), 'a').write(f'{time.time()}\\n')\n"
        "def times(kind):\n"
        "    return [float(t) for t in open(os.path.join(os.environ['SCRATCH'], kind)).read().split()]\n"
        "note('starts')\n"
        "starts = times('starts')\n"
        "if len(starts) >= 4:\n"
        "    print(json.dumps({'starts': starts, 'ends': times('ends')}), flush=True)\n"
        "    sys.exit(0)\n"
        "note('ends')\n"
        "sys.exit(1)\n"
    )
    name = unique("crashloop")
    pods.create(
        pod_manifest(
            name,
            [
                container(
                    [PY, "-c", script],
                    env=[{"name": "SCRATCH", "value": "/scratch"}],
                    volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
                )
            ],
            restart_policy="OnFailure",
            volumes=[{"name": "scratch", "emptyDir": {}}],
        )
    )
    uid = pods.get(name)["metadata"]["uid"]
    seen: set[tuple[int, str]] = set()  # (restartCount, waiting message) while in CrashLoopBackOff

    def done() -> bool:
        status = pods.status(name)
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff":
                seen.add((cs["restartCount"], waiting["message"]))
        return status.get("phase") in ("Succeeded", "Failed")

    wait_for(done, 60, "the pod to end", interval=0.05)
    assert pods.phase(name) == "Succeeded"
    runs = json.loads(pods.log(name))
    # From a run's end to the next run's start: the kubelet's back-off (0, then 1 s, then 2 s) plus the next
    # interpreter's start, which a loaded machine can stretch past 2 s (CI saw 2.2 s for a restart without back-off).
    # So the back-offs are lower bounds here, and "at once" is the status's: no CrashLoopBackOff before the first
    # restart (`seen` below holds restart counts 1 and 2 only).
    waits = [start - end for end, start in zip(runs["ends"], runs["starts"][1:], strict=True)]
    assert len(waits) == 3 and waits[1] >= 1.0 and waits[2] >= 2.0, runs
    assert max(waits) < 2.0 + 6, runs
    message = "back-off {}s restarting failed container=main pod=" + f"{name}_{pods.namespace}({uid})"
    # restartCount counts restarts done: 1 while waiting before the second restart, 2 before the third.
    assert seen <= {(1, message.format(10)), (2, message.format(20))}, seen
    assert (2, message.format(20)) in seen, seen  # the 2 s window is long enough to be seen
    cs = pods.container_status(name)
    assert cs["restartCount"] == 3
    assert cs["lastState"]["terminated"]["exitCode"] == 1 and cs["state"]["terminated"]["exitCode"] == 0
    backoffs = [
        e
        for e in json.loads(
            pods.core.list_namespaced_event(
                pods.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
            ).data
        )["items"]
        if e["reason"] == "BackOff"
    ]
    assert len(backoffs) == 2, backoffs  # none for the first restart, which did not wait
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_fallback_to_logs_on_error_uses_the_log_tail(pods: Pods) -> None:
    name = unique("fallback")
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)\n"
    pods.create(pod_manifest(name, [container([PY, "-c", script], terminationMessagePolicy="FallbackToLogsOnError")]))
    status = pods.wait_phase(name, ("Succeeded", "Failed"))
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert (status["phase"], term["exitCode"], term["reason"]) == ("Failed", 3, "Error")
    lines = term["message"].splitlines()
    assert len(lines) == 80 and lines[-1] == "line 99" and lines[0] == "line 20"


@pytest.mark.cluster
def test_missing_executable_is_a_start_error(pods: Pods) -> None:
    name = unique("noexec")
    pods.create(pod_manifest(name, [container(["/definitely/not/here"])]))
    status = pods.wait_phase(name, ("Succeeded", "Failed"))
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (128, "StartError")
    validate_pod(pods.get(name))


# ----------------------------------------------------------------------------------------------------------------
# Logs through the apiserver
# ----------------------------------------------------------------------------------------------------------------

SLOW_PRINTER = "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.4)\n"


@pytest.mark.cluster
def test_log_options_through_the_apiserver(pods: Pods) -> None:
    name = unique("logs")
    pods.create(pod_manifest(name, [container([PY, "-c", SLOW_PRINTER])]))
    wait_for(lambda: pods.phase(name) == "Running", 30, "Running")
    # follow streams until the container exits, chunk by chunk
    resp = pods.core.read_namespaced_pod_log(name, pods.namespace, follow=True, _preload_content=False)
    streamed = b"".join(resp.stream(amt=None, decode_content=False)).decode()
    assert streamed == "".join(f"tick {i}\n" for i in range(6))
    pods.wait_phase(name, ("Succeeded",))
    assert pods.log(name, tail_lines=2) == "tick 4\ntick 5\n"
    assert pods.log(name, limit_bytes=9) == "tick 0\nti"
    stamped = pods.log(name, timestamps=True).splitlines()
    assert len(stamped) == 6 and stamped[0].endswith("Z tick 0")
    sk.parse_timestamp(stamped[0].split(" ")[0])
    assert pods.log(name, since_seconds=3600).count("tick") == 6


@pytest.mark.cluster
def test_logs_with_the_async_client(pods: Pods, kube_cluster: Any) -> None:
    kubernetes_asyncio = pytest.importorskip("kubernetes_asyncio")
    name = unique("alogs")
    pods.create(pod_manifest(name, [container([PY, "-c", SLOW_PRINTER])]))
    wait_for(lambda: pods.phase(name) == "Running", 30, "Running")

    async def read() -> tuple[str, str]:
        from kubernetes_asyncio import client, config

        api = await config.new_client_from_config(config_file=str(kube_cluster.kubeconfig))
        async with api:
            core = client.CoreV1Api(api)
            resp: Any = await core.read_namespaced_pod_log(name, pods.namespace, follow=True, _preload_content=False)
            chunks = []
            async for line in resp.content:
                chunks.append(line.decode())
            whole = await core.read_namespaced_pod_log(name, pods.namespace, tail_lines=1)
            return "".join(chunks), whole

    followed, last = asyncio.run(read())
    assert kubernetes_asyncio is not None
    assert followed == "".join(f"tick {i}\n" for i in range(6))
    assert last == "tick 5\n"


@pytest.mark.cluster
def test_logs_of_a_container_that_has_not_started(pods: Pods) -> None:
    from kubernetes.client.rest import ApiException

    name = unique("waitlog")
    pods.create(pod_manifest(name, [container([PY, "-c", "pass"])], annotations={sk.ANN_FAIL: "ImagePullBackOff"}))
    wait_for(lambda: pods.container_status(name).get("state", {}).get("waiting"), 30, "waiting state")
    with pytest.raises(ApiException) as err:
        pods.log(name)
    assert err.value.status == 400
    assert "is waiting to start" in json.loads(err.value.body)["message"]


# ----------------------------------------------------------------------------------------------------------------
# Deletion
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_deleting_a_pod_kills_its_process_group(pods: Pods) -> None:
    # The container forks a child that ignores nothing: both must die with the pod.
    script = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "print(os.getpgid(0), flush=True)\n"
        "time.sleep(300)\n"
    )
    name = unique("kill")
    pods.create(pod_manifest(name, [container([PY, "-c", script])]))
    pgid = int(wait_for(lambda: pods.log(name).strip() if pods.phase(name) == "Running" else None, 30, "the pgid"))
    assert pgid_alive(pgid)
    start = time.monotonic()
    pods.core.delete_namespaced_pod(name, pods.namespace, _preload_content=False)  # default grace (capped at 10 s)
    wait_for(lambda: not pods.exists(name), 20, "the pod object to go")
    assert time.monotonic() - start < 15
    wait_for(lambda: not pgid_alive(pgid), 5, "the process group to die")


# ----------------------------------------------------------------------------------------------------------------
# Injected faults
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_image_pull_backoff(pods: Pods) -> None:
    name = unique("pull")
    pods.create(pod_manifest(name, [container([PY, "-c", "pass"])], annotations={sk.ANN_FAIL: "ImagePullBackOff"}))
    wait_for(lambda: pods.waiting_reason(name) == "ImagePullBackOff", 30, "ImagePullBackOff")
    cs = pods.container_status(name)
    assert cs["state"]["waiting"]["message"] == f'Back-off pulling image "{IMAGE}"'
    assert (cs["ready"], cs["restartCount"], cs["imageID"]) == (False, 0, "")
    status = pods.status(name)
    assert status["phase"] == "Pending"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ContainersNotReady")
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_unschedulable(pods: Pods) -> None:
    name = unique("unsched")
    pods.create(pod_manifest(name, [container([PY, "-c", "pass"])], annotations={sk.ANN_FAIL: "Unschedulable"}))
    status = wait_for(lambda: (s := pods.status(name)).get("conditions") and s, 30, "a condition")
    (cond,) = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("PodScheduled", "False", "Unschedulable")
    assert cond["message"].startswith("0/1 nodes are available")
    assert status["phase"] == "Pending" and "containerStatuses" not in status
    assert not pods.get(name)["spec"].get("nodeName")
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_create_container_config_error_injection(pods: Pods) -> None:
    name = unique("ccce")
    pods.create(
        pod_manifest(name, [container([PY, "-c", "pass"])], annotations={sk.ANN_FAIL: "CreateContainerConfigError"})
    )

    # The container waits ContainerCreating first, as on a real node, then with the config error.
    def config_error() -> dict | None:
        waiting = pods.container_status(name).get("state", {}).get("waiting")
        return waiting if waiting and waiting.get("reason") != "ContainerCreating" else None

    cs = wait_for(config_error, 30, "waiting with a reason other than ContainerCreating")
    assert cs["reason"] == "CreateContainerConfigError" and "not found" in cs["message"]


@pytest.mark.cluster
def test_oom_killed(pods: Pods) -> None:
    name = unique("oom")
    pods.create(
        pod_manifest(
            name,
            [container([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"])],
            annotations={sk.ANN_FAIL: "OOMKilled", sk.ANN_FAIL_AFTER: "0.5"},
        )
    )
    status = pods.wait_phase(name, ("Succeeded", "Failed"), timeout=30)
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert (status["phase"], term["exitCode"], term["reason"]) == ("Failed", 137, "OOMKilled")
    validate_pod(pods.get(name))


#: A main process that starts a worker and exits with 3 once the worker is gone (as the runner reports a killed rank).
SUPERVISOR = (
    "import subprocess, sys; "
    "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('worker up', flush=True); worker.wait(); print(f'worker ended {worker.returncode}', flush=True); exit(3)"
)


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("oom_kills", "code", "last_line"),
    [("worker", 3, "worker ended -9"), ("whole-container", 137, "worker up")],
)
def test_an_oom_kills_one_worker_or_the_whole_container(pods: Pods, oom_kills: str, code: int, last_line: str) -> None:
    """cgroup v1's kernel kills the largest process, a worker: its supervisor lives on, says so and exits with its own
    code. cgroup v2's group kill (kubelet >= 1.28) takes the whole container: 137. Either way containerd says
    OOMKilled."""
    name = unique("oom-shape")
    annotations = {
        sk.ANN_FAIL: "OOMKilled",
        sk.ANN_FAIL_AFTER: "0.5",
        sk.ANN_FAIL_AFTER_LOG_LINE: "worker up",
        sk.ANN_OOM_KILLS: oom_kills,
    }
    pods.create(pod_manifest(name, [container([PY, "-c", SUPERVISOR])], annotations=annotations))
    status = pods.wait_phase(name, ("Succeeded", "Failed"), timeout=30)
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert (status["phase"], term["exitCode"], term["reason"]) == ("Failed", code, "OOMKilled")
    log = pods.log(name)
    assert log.strip().splitlines()[-1].endswith(last_line), log


@pytest.mark.cluster
def test_oom_killed_after_a_log_line_counts_from_that_line(pods: Pods) -> None:
    name = unique("oom-line")
    program = (
        "import time; print('warming up', flush=True); time.sleep(3); print('ready now', flush=True); time.sleep(60)"
    )
    pods.create(
        pod_manifest(
            name,
            [container([PY, "-c", program])],
            annotations={sk.ANN_FAIL: "OOMKilled", sk.ANN_FAIL_AFTER: "0.2", sk.ANN_FAIL_AFTER_LOG_LINE: "ready now"},
        )
    )
    status = pods.wait_phase(name, ("Succeeded", "Failed"), timeout=30)
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert (status["phase"], term["exitCode"], term["reason"]) == ("Failed", 137, "OOMKilled")
    # Killed after the line, not 0.2 s after the start: the program's 3 s before it are in the container's life.
    lived = datetime.fromisoformat(term["finishedAt"]) - datetime.fromisoformat(term["startedAt"])
    assert lived.total_seconds() >= 2, term


@pytest.mark.cluster
def test_eviction(pods: Pods) -> None:
    name = unique("evict")
    pods.create(
        pod_manifest(
            name,
            [container([PY, "-c", "import time; time.sleep(60)"])],
            restart_policy="OnFailure",
            annotations={sk.ANN_EVICT_AFTER: "1"},
        )
    )
    status = pods.wait_phase(name, ("Failed",), timeout=30)
    assert status["reason"] == "Evicted"
    assert status["message"].startswith("The node was low on resource: memory.")
    disruption = next(c for c in status["conditions"] if c["type"] == "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "TerminationByKubelet")
    term = status["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 143  # SIGTERM; evicted pods are not restarted even under OnFailure
    assert status["containerStatuses"][0]["restartCount"] == 0
    validate_pod(pods.get(name))


@pytest.mark.cluster
def test_start_delay_keeps_the_pod_creating(pods: Pods) -> None:
    name = unique("delay")
    pods.create(pod_manifest(name, [container([PY, "-c", "pass"])], annotations={sk.ANN_START_DELAY: "2"}))
    cs = wait_for(lambda: pods.container_status(name), 10, "a container status")
    assert cs["state"]["waiting"]["reason"] == "ContainerCreating"
    assert pods.phase(name) == "Pending"
    start = time.monotonic()
    pods.wait_phase(name, ("Succeeded",), timeout=30)
    assert time.monotonic() - start >= 1.0


@pytest.mark.cluster
def test_fail_times_limits_injection_per_pod_name(pods: Pods) -> None:
    annotations = {sk.ANN_FAIL: "OOMKilled", sk.ANN_FAIL_AFTER: "0.3", sk.ANN_FAIL_TIMES: "1"}
    name = unique("once")
    script = "import time; time.sleep(1.0); print('done', flush=True)"
    pods.create(
        pod_manifest(name, [container([PY, "-c", script])], restart_policy="OnFailure", annotations=annotations)
    )
    pods.wait_phase(name, ("Succeeded",), timeout=40)
    cs = pods.container_status(name)
    assert cs["restartCount"] == 1
    assert (cs["lastState"]["terminated"]["exitCode"], cs["lastState"]["terminated"]["reason"]) == (137, "OOMKilled")


def replica_pod(name: str, index: int | None, annotations: dict[str, str], command: list[str]) -> dict[str, Any]:
    """A bare pod labelled like replica ``index`` of a PyTorchJob's Worker (no label when None)."""
    manifest = pod_manifest(name, [container(command)], annotations=annotations)
    if index is not None:
        manifest["metadata"]["labels"].update({sk.LABEL_REPLICA_TYPE: "worker", sk.LABEL_REPLICA_INDEX: str(index)})
    return manifest


@pytest.mark.cluster
def test_fail_indexes_aims_faults_at_listed_replicas(pods: Pods) -> None:
    annotations = {sk.ANN_FAIL: "OOMKilled", sk.ANN_FAIL_AFTER: "0.3", sk.ANN_FAIL_INDEXES: "1, 3"}
    script = [PY, "-c", "import time; time.sleep(1.5); print('done', flush=True)"]
    names = {index: pods.create(replica_pod(unique(f"idx{index}"), index, annotations, script)) for index in (0, 1, 2)}
    unlabelled = pods.create(replica_pod(unique("nolabel"), None, annotations, script))
    for index, name in names.items():
        status = pods.wait_phase(name, ("Succeeded", "Failed"), timeout=40)
        term = status["containerStatuses"][0]["state"]["terminated"]
        if index == 1:
            assert (status["phase"], term["exitCode"], term["reason"]) == ("Failed", 137, "OOMKilled"), index
        else:
            assert (status["phase"], term["exitCode"], term["reason"]) == ("Succeeded", 0, "Completed"), index
    assert pods.wait_phase(unlabelled, ("Succeeded", "Failed"), timeout=40)["phase"] == "Succeeded"


@pytest.mark.cluster
def test_fail_indexes_also_aims_eviction_and_start_delay(pods: Pods) -> None:
    annotations = {sk.ANN_EVICT_AFTER: "0.5", sk.ANN_START_DELAY: "3", sk.ANN_FAIL_INDEXES: "0"}
    script = [PY, "-c", "import time; time.sleep(2)"]
    hit = pods.create(replica_pod(unique("evict0"), 0, annotations, script))
    spared = pods.create(replica_pod(unique("evict1"), 1, annotations, script))
    # The spared pod neither waits nor is evicted: it runs at once.
    wait_for(lambda: pods.phase(spared) == "Running" and pods.phase(hit) == "Pending", 15, "only index 0 delayed")
    assert pods.wait_phase(hit, ("Failed",), timeout=30)["reason"] == "Evicted"
    assert pods.wait_phase(spared, ("Succeeded", "Failed"), timeout=30)["phase"] == "Succeeded"


@pytest.mark.cluster
def test_fail_times_scope_counts_across_pod_names(pods: Pods) -> None:
    """A retried task submits a new job: same run label and replica index, new pod names; it fails only once."""
    run = unique("run")
    annotations = {
        sk.ANN_FAIL: "OOMKilled",
        sk.ANN_FAIL_AFTER: "0.3",
        sk.ANN_FAIL_TIMES: "1",
        sk.ANN_FAIL_TIMES_SCOPE: "example.com/run",
        sk.ANN_FAIL_INDEXES: "1",
    }
    script = [PY, "-c", "import time; time.sleep(1.0)"]
    phases = []
    for attempt in (1, 2):
        manifest = replica_pod(unique(f"try{attempt}"), 1, annotations, script)
        manifest["metadata"]["labels"]["example.com/run"] = run
        phases.append(pods.wait_phase(pods.create(manifest), ("Succeeded", "Failed"), timeout=40)["phase"])
    assert phases == ["Failed", "Succeeded"]


def test_fault_targeting_rules() -> None:
    assert sk.parse_indexes(" 1,3 ,x,-2,") == frozenset({1, 3})

    def meta(annotations: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
        return {"name": "job-worker-1", "namespace": "ns", "annotations": annotations, "labels": labels}

    index1 = {sk.LABEL_REPLICA_TYPE: "worker", sk.LABEL_REPLICA_INDEX: "1"}
    assert sk.faults_target(meta({}, {}))
    assert sk.faults_target(meta({sk.ANN_FAIL_INDEXES: "0,1"}, index1))
    assert not sk.faults_target(meta({sk.ANN_FAIL_INDEXES: "0,2"}, index1))
    assert not sk.faults_target(meta({sk.ANN_FAIL_INDEXES: "0"}, {}))
    assert sk.fault_budget_key(meta({}, index1), "fail") == ("ns", "pod", "job-worker-1", "fail")
    scoped = meta({sk.ANN_FAIL_TIMES_SCOPE: "run"}, {**index1, "run": "r1"})
    assert sk.fault_budget_key(scoped, "evict") == ("ns", "scope", "run", "r1", "worker", "1", "evict")


def test_workdir_paths_are_documented() -> None:
    doc = sk.__doc__ or ""
    for key in (
        sk.ANN_FAIL,
        sk.ANN_FAIL_AFTER,
        sk.ANN_FAIL_CONTAINER,
        sk.ANN_FAIL_TIMES,
        sk.ANN_FAIL_TIMES_SCOPE,
        sk.ANN_FAIL_INDEXES,
        sk.ANN_EVICT_AFTER,
        sk.ANN_START_DELAY,
    ):
        assert key in doc, key
    assert Path(sk.__file__).name == "sim_kubelet.py"


def test_backoff_and_store_host_rules_are_documented() -> None:
    doc = " ".join((sk.__doc__ or "").split())
    for phrase in (
        "--restart-backoff-scale F",
        "test-only speed-up",
        "passes 0.1",
        "10, 20, 40, 80, 160, then 300 s",
        "back-off 1m20s restarting failed container=",
        "is_host=1",
        "is_host=0",
        "PET_RDZV_CONF",
        "--rdzv-conf",
        'fail-indexes: "0"',
    ):
        assert phrase in doc, phrase

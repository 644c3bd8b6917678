"""The provider end to end on the real node: a kubelet, kube-scheduler and kube-controller-manager 1.20.2 with
containerd (tests/cluster/real_node.py), running the runner image built from docker/Dockerfile. Runs by default.

The DAGs (``tests/dags/real_node_e2e.py``) run through ``dag.test()`` as in tests/e2e/test_kubernetes.py, against
the session's real-node cluster (fixture ``real_node_cluster``, which the Airflow deployment's tests use too), which
is stopped after the last test that uses it, checking that nothing survives. What the
simulated kubelet plays elsewhere happens for real here: two elastic pods rendezvous on the one node, rank 0's
result comes from a real termination message, the memory limit kills, the image cannot be pulled, the missing
Secret stops the container's creation, the scheduler finds no GPU, a deleted pod gets its grace period and the
controller-manager's garbage collector removes its payload Secret, and checkpoints and results go to a hostPath
folder the pods share with the Airflow side, while a checkpoint on a pod's own file system is not found by the
retry. Every test that uses the node runs in one pytest worker (tests/conftest.py): one worker owns the node.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import real_node as rn
from tests.cluster.pytest_plugin import RealNodeCluster
from tests.dags import real_node_e2e as dags
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import (
    GROUP,
    PLURAL,
    VERSION,
    Cluster,
    DagRunResult,
    _replace_inline_trigger,
    run_dag,
    training_container_status,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them (names, not imports: tests take them as arguments).
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image

OUT_OF_MEMORY = "airflow_provider_torchelastic.operators.OutOfMemoryError: "
IMAGE_UNAVAILABLE = "airflow_provider_torchelastic.operators.ImageUnavailableError: "
CONFIGURATION = "airflow_provider_torchelastic.operators.ConfigurationError: "
CAPACITY_TIMEOUT = "airflow_provider_torchelastic.operators.CapacityTimeoutError: "
INFRASTRUCTURE = "airflow_provider_torchelastic.operators.InfrastructureError: "
PREEMPTED = "airflow_provider_torchelastic.operators.PreemptedError: "
JOB_NAME_LABEL = "training.kubeflow.org/job-name"


def say(message: str) -> None:
    """Timings, outside pytest's capture: what the module costs is part of what it reports."""
    print(f"\n[real node e2e] {message}", file=sys.__stderr__, flush=True)


def timed_run(dag_id: str) -> DagRunResult:
    started = time.monotonic()
    result = run_dag(dag_id)
    say(f"{dag_id}: {time.monotonic() - started:.1f} s")
    return result


def job_of(result: DagRunResult, task_id: str = "train", try_number: int = 1) -> str:
    from airflow_provider_torchelastic.core.naming import job_name

    return job_name(result.identity(try_number, task_id=task_id))


def error_of(failure_dir: Path, dag_id: str, task_id: str = "train", try_number: int = 1) -> str:
    return (failure_dir / f"{dag_id}.{task_id}.try{try_number}.txt").read_text()


def rank0_holder(pods: list[Any]) -> tuple[str, Any]:
    """The one pod whose real termination message carries rank 0's result, and that outcome."""
    from airflow_provider_torchelastic.core.outcome import decode_outcome

    outcomes = {}
    for pod in pods:
        terminated = training_container_status(pod).state.terminated
        assert terminated is not None and terminated.exit_code == 0, pod.status
        outcomes[pod.metadata.name] = decode_outcome(terminated.message)
    holders = [(name, outcome) for name, outcome in outcomes.items() if outcome.holds_rank0]
    assert len(holders) == 1, outcomes
    return holders[0]


# --- results ----------------------------------------------------------------------------------------------------------


def test_elastic_two_pods_on_the_one_node_return_rank_0_from_a_real_termination_message(
    real_node_cluster: RealNodeCluster, cluster: Cluster
) -> None:
    result = timed_run("real_node_elastic")
    assert result.state == "success", result
    name = result.xcom(key="job_name")
    pods = cluster.pods(f"{JOB_NAME_LABEL}={name}")
    assert sorted(p.metadata.name for p in pods) == [f"{name}-worker-0", f"{name}-worker-1"]
    # Bound by the real scheduler to the one real node, run there by containerd.
    assert {p.spec.node_name for p in pods} == {real_node_cluster.layout.node_name}
    assert all(training_container_status(p).image_id for p in pods), "no container ran from an image"
    value = result.xcom()
    assert {k: value[k] for k in ("rank", "world_size", "sum")} == {"rank": 0, "world_size": 2, "sum": 3.0}
    holder, outcome = rank0_holder(pods)
    assert outcome.result == value and value["pod"] == holder  # the container's host name is its pod's


def test_master_and_worker_rendezvous_through_the_cluster_dns(
    real_node_cluster: RealNodeCluster, cluster: Cluster
) -> None:
    result = timed_run("real_node_master_worker")
    assert result.state == "success", result
    name = result.xcom(key="job_name")
    pods = cluster.pods(f"{JOB_NAME_LABEL}={name}")
    assert sorted(p.metadata.name for p in pods) == [f"{name}-master-0", f"{name}-worker-0"]
    assert {p.spec.node_name for p in pods} == {real_node_cluster.layout.node_name}
    value = result.xcom()
    assert {k: value[k] for k in ("rank", "world_size", "sum")} == {"rank": 0, "world_size": 2, "sum": 3.0}
    holder, outcome = rank0_holder(pods)
    assert holder == f"{name}-master-0" and outcome.result == value  # the Master is rank 0
    # Kept (on_finish_action="keep"); deleted here as `kubectl delete pytorchjob` does. Its pods, Services and payload
    # Secret are then the controller-manager's garbage collector's to remove: the simulated operator collects nothing
    # on the real node. (The namespace is emptied after every test: whatever is in it is this job's.)
    services = sorted(s.metadata.name for s in cluster.core.list_namespaced_service(cluster.namespace).items)
    assert services == [f"{name}-master-0", f"{name}-worker-0"], services
    (payload,) = [s.metadata.name for s in cluster.payloads()]
    cluster.custom.delete_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, PLURAL, name, body={"propagationPolicy": "Background"}
    )

    def dependents() -> list[str]:
        found = [f"pod/{p.metadata.name}" for p in cluster.pods()]
        found += [f"service/{s.metadata.name}" for s in cluster.core.list_namespaced_service(cluster.namespace).items]
        return found + [f"secret/{s.metadata.name}" for s in cluster.payloads()]

    wait_for(lambda: not dependents(), 90, f"the garbage collector to remove {name}'s dependents")
    for resource, dependent in [("services", s) for s in services] + [("secrets", payload)]:
        users = wait_for(
            lambda r=resource, d=dependent: real_node_cluster.deleted_by(r, d), 10, "the audit log's deletion"
        )
        assert users == [rn.CONTROLLER_MANAGER_USER], (dependent, users)


# --- failures the node produces itself: one DAG run, one task per case -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class FailuresRun:
    result: DagRunResult
    errors: dict[str, str]
    #: The training container's status of each task's pod, read before the namespace is emptied.
    pods: dict[str, Any]
    #: Each task's tries, from the task instance history (test_retry_policies.history).
    history: dict[str, list[dict[str, Any]]]


def policy_history(task_id: str) -> list[dict[str, Any]]:
    from tests.e2e.test_retry_policies import history

    return history("real_node_failures", task_id)


@pytest.fixture(scope="module")
def failures(
    real_node_cluster: RealNodeCluster, cluster: Cluster, airflow_db: None, tmp_path_factory: pytest.TempPathFactory
) -> FailuresRun:
    out = tmp_path_factory.mktemp("real-node-failures")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in on_node.node_env(real_node_cluster, out, real_node_cluster.image).items():
            patch.setenv(key, value)
        result = timed_run("real_node_failures")
    tasks = ("oom", "image_pull", "missing_secret", "unschedulable", "restarted")
    errors = {task: error_of(out, "real_node_failures", task) for task in tasks}
    pods = {task: cluster.get_pod(job_of(result, task)) for task in tasks}
    return FailuresRun(result=result, errors=errors, pods=pods, history={t: policy_history(t) for t in tasks})


def test_a_real_memory_limit_oom_kills_and_a_retry_rule_retries_it_after_its_own_delay(failures: FailuresRun) -> None:
    error, pod = failures.errors["oom"], failures.pods["oom"]
    assert failures.result.tasks[("oom", -1)] == ("success", 2), "OutOfMemoryError's rule retried it"
    assert failures.result.xcom("oom") == {"try_number": 2}
    assert error.startswith(OUT_OF_MEMORY), error
    assert pod is not None and pod.metadata.name in error, error
    terminated = training_container_status(pod).state.terminated
    assert terminated is not None and terminated.reason == "OOMKilled", pod.status  # containerd's, not ours
    # The kernel killed the worker filling memory, not the container's main process: the runner lived to report
    # its rank as killed by SIGKILL, and the error adds what the container status says.
    assert "rank 0" in error and "SIGKILL" in error, error
    assert "its container ended OOMKilled (out of memory" in error, error
    # Airflow's task runner applied the rule: its reason, and its 2 s instead of the task's 10 minutes.
    tries = failures.history["oom"]
    assert [t["try"] for t in tries] == [1, 2], tries
    assert tries[0]["retry_reason"] == "out of memory: retry once the node has room", tries
    gap = (tries[1]["start"] - tries[0]["end"]).total_seconds()
    assert dags.OOM_RULE_DELAY.total_seconds() <= gap < 120, tries


def test_an_image_that_does_not_exist_fails_fast_without_a_retry(failures: FailuresRun) -> None:
    error = failures.errors["image_pull"]
    assert error.startswith(IMAGE_UNAVAILABLE), error
    assert job_of(failures.result, "image_pull") in error, error
    assert "ImagePullBackOff" in error or "ErrImagePull" in error, error
    # The registry's own answer, naming the image (the DAG file read the registry's address from the environment
    # when it was parsed: this module's copy of MISSING_IMAGE may name another host).
    missing = ":".join(dags.MISSING_IMAGE.rsplit("/", 1)[-1:])  # torchelastic-runner:no-such-tag
    assert missing in error and "not found" in error, error


def test_a_missing_secret_is_a_create_container_config_error(failures: FailuresRun) -> None:
    error = failures.errors["missing_secret"]
    # retries=3 and a retry_policy with no rule for it: a configuration error still fails at try 1.
    assert failures.result.tasks[("missing_secret", -1)] == ("failed", 1)
    assert [t["try"] for t in failures.history["missing_secret"]] == [1]
    assert error.startswith(CONFIGURATION), error
    assert job_of(failures.result, "missing_secret") in error, error
    assert "CreateContainerConfigError" in error and f'secret "{dags.MISSING_SECRET}" not found' in error, error


def test_a_gpu_request_is_unschedulable_with_the_real_schedulers_message(failures: FailuresRun) -> None:
    error, pod = failures.errors["unschedulable"], failures.pods["unschedulable"]
    assert error.startswith(CAPACITY_TIMEOUT), error  # capacity may free up
    assert "scheduling_timeout=5" in error and "Unschedulable" in error, error
    assert "Insufficient nvidia.com/gpu" in error, error  # kube-scheduler's own words
    assert pod is not None and not pod.spec.node_name


def test_a_container_restarted_in_place_keeps_its_first_runs_exception_and_log(failures: FailuresRun) -> None:
    """OnFailure: the kubelet restarts the container in the same pod, so the pod is never Failed and its log
    starts again; the backoff limit fails the job while the second run waits. The first run's exception is in the
    previous container's termination message, and its log in the previous container's log (previous=true)."""
    import re

    from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary

    error = failures.errors["restarted"]
    assert failures.result.tasks[("restarted", -1)] == ("failed", 1)
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    found = re.search(r"ValueError: first run of rank (\d): shard 3 has a corrupt header", error)
    assert found is not None and "backoff limit" in error, error
    job = job_of(failures.result, "restarted")
    name = next(n for n in (f"{job}-master-0", f"{job}-worker-0") if n in error)  # the pod of the earliest failure
    summary = JobSummary.from_json(failures.result.xcom("restarted", XCOM_KEY))
    assert found.group(0) in (summary.root_cause or ""), summary
    (pod,) = [p for p in summary.pods if p.name == name]
    assert pod.restarts >= 1, pod
    # The previous run's lines, read with previous=true, are in the pod's log tail, after the wait's header.
    tail = pod.log_tail
    assert "restart 1: its previous pytorch container ended (exit code " in tail, tail
    assert found.group(0) in tail and "fail_then_wait" in tail, tail  # its exception, with the traceback


def test_a_torchrun_module_and_script_run_on_the_node(real_node_cluster: RealNodeCluster, failure_dir: Path) -> None:
    """Issue 32: a module and a script in the image (here the shared folder every pod mounts), with args, their
    set_result value as the XCom, a RecoverableError retried, a permanent error with its traceback, and exit()."""
    import shutil

    programs = real_node_cluster.shared_dir / "programs"
    shutil.rmtree(programs, ignore_errors=True)
    shutil.copytree(Path(__file__).parents[1] / "programs", programs)
    result = timed_run("real_node_programs")
    assert result.tasks == {
        ("module", -1): ("success", 2),
        ("script", -1): ("failed", 1),
        ("exit", -1): ("success", 1),
    }, result
    value = result.xcom("module")
    assert value["argv"] == ["recoverable-on-try-1", "--steps", "2", "--try-number", "2"], value
    assert (value["total"], value["main"], value["main_file"]) == (4.0, "__main__", "train.py"), value
    first = error_of(failure_dir, "real_node_programs", "module")
    assert first.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), first
    assert "ShardServerDown" in first and job_of(result, "module") in first, first
    error = error_of(failure_dir, "real_node_programs", "script")
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "rank 1" in error and "ValueError: label 7 is out of range in shard 3" in error, error
    assert result.xcom("exit") == {"stopped": "early", "rank": 0}


# --- service account tokens -------------------------------------------------------------------------------------------


def _admitted_token_mounts(cluster: Cluster, spec: dict[str, Any]) -> list[str]:
    """The containers of a pod with ``spec`` that the real API server's ServiceAccount admission (which a real node's
    cluster runs) gives the token at its path: a dry run, which admits and mutates but stores nothing."""
    from airflow_provider_torchelastic.kubernetes.kinds.trainjob import TOKEN_MOUNT_PATH

    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "token-probe-"}, "spec": spec}
    admitted = cluster.api_client.sanitize_for_serialization(
        cluster.core.create_namespaced_pod(cluster.namespace, body, dry_run="All")
    )
    tokens = {v["name"] for v in admitted["spec"].get("volumes") or [] if "secret" in v or "projected" in v}
    return [
        container["name"]
        for container in admitted["spec"]["containers"]
        for mount in container.get("volumeMounts") or []
        if mount["mountPath"] == TOKEN_MOUNT_PATH and mount["name"] in tokens
    ]


def test_a_trainjobs_pods_get_no_token_from_the_real_service_account_admission(cluster: Cluster) -> None:
    """A runtime patch cannot say automountServiceAccountToken: false; the provider masks the token's path instead
    (kinds/trainjob.py), which the real admission honours. The control: the same pod without the mask gets one."""
    from airflow_provider_torchelastic import Elastic
    from tests.contract.builders import trainjob_pods_of

    _, [pod, *_] = trainjob_pods_of(Elastic(nnodes=2))
    assert _admitted_token_mounts(cluster, pod["spec"]) == []
    unmasked = {
        **pod["spec"],
        "volumes": [v for v in pod["spec"]["volumes"] if v["name"] != "torchelastic-no-token"],
        "containers": [
            {**c, "volumeMounts": [m for m in c["volumeMounts"] if m["name"] != "torchelastic-no-token"]}
            for c in pod["spec"]["containers"]
        ],
    }
    assert _admitted_token_mounts(cluster, unmasked) == [c["name"] for c in pod["spec"]["containers"]]


# --- deletion ---------------------------------------------------------------------------------------------------------


def test_a_deleted_pod_gets_its_grace_period_and_the_garbage_collector_takes_its_payload(
    real_node_cluster: RealNodeCluster, cluster: Cluster, failure_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchelastic.kubernetes.render import payload_secret_name

    marker = real_node_cluster.shared_dir / "deleted-pod"
    seen: dict[str, Any] = {}

    def delete_while_deferred(trigger: Any, ti: Any, run_to_event: Callable[..., Any]) -> Any:
        if "name" in seen:  # the retry: left to finish
            return run_to_event(trigger, ti)
        name = trigger.serialize()[1]["name"]
        wait_for(lambda: (marker / "started").is_file(), 120, "the worker to start", interval=0.5)
        # As `kubectl delete pod` (or a drain) would: the pod's own grace period, dependents left to the garbage
        # collector.
        deleted_at = time.time()
        cluster.core.delete_namespaced_pod(name, cluster.namespace, body={"propagationPolicy": "Background"})
        terminating = cluster.get_pod(name)
        seen["grace"] = terminating.metadata.deletion_grace_period_seconds if terminating else None
        wait_for(lambda: cluster.get_pod(name) is None, dags.GRACE_SECONDS + 60, f"pod {name} to go")
        seen["gone_after"] = time.time() - deleted_at
        seen["stop_seen_after"] = float((marker / "stop_seen").read_text()) - deleted_at
        saved_step, saved_at = (marker / "saved").read_text().split()
        seen["saved_step"], seen["saved_after"] = int(saved_step), float(saved_at) - deleted_at
        seen["name"] = name
        return run_to_event(trigger, ti)  # the trigger sees the pod gone and fires

    _replace_inline_trigger(monkeypatch, delete_while_deferred)
    result = timed_run("real_node_deleted_pod")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    name = seen["name"]
    assert seen["grace"] == dags.GRACE_SECONDS  # the rendered terminationGracePeriodSeconds, from the operator
    # The runner got SIGTERM and at once turned stop_requested() True (no SIGTERM reached the worker itself).
    assert seen["stop_seen_after"] < 5, seen
    # The function then had its 46 s (of the 60) to save: it did, before the kubelet's SIGKILL.
    assert seen["saved_after"] - seen["stop_seen_after"] >= dags.SAVE_SECONDS, seen
    assert seen["saved_after"] < dags.GRACE_SECONDS, seen
    # The pod ended when the runner reported, not at the SIGKILL.
    assert seen["gone_after"] < dags.GRACE_SECONDS + 60, seen
    error = error_of(failure_dir, "real_node_deleted_pod")
    # A recoverable failure: the runner's report says preempted; a wait that saw only the pod go says so instead.
    assert error.startswith((PREEMPTED, INFRASTRUCTURE)), error
    # The retry resumed from the exact step the stopped try saved.
    assert result.xcom() == {"resumed_from": seen["saved_step"], "try_number": 2}, result.xcom()
    # The payload Secret is owned by the pod: the failed job is kept (on_finish_action), so nothing of the provider
    # deletes it, and the simulated operator collects only PyTorchJobs' dependents. The controller-manager does.
    secret = payload_secret_name(name)
    wait_for(lambda: cluster.get_payload(secret) is None, 60, f"the payload Secret {secret} to be collected")
    users = wait_for(lambda: real_node_cluster.deleted_by("secrets", secret), 10, "the audit log's deletion")
    assert users == [rn.CONTROLLER_MANAGER_USER], users
    say(f"deleted pod: stop seen after {seen['stop_seen_after']:.1f} s, saved after {seen['saved_after']:.1f} s")


# --- storage the pods share, and storage they do not -----------------------------------------------------------------


def test_checkpoints_and_results_on_a_shared_hostpath_and_a_pods_own_checkpoint_is_not_found(
    real_node_cluster: RealNodeCluster, failure_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = real_node_cluster.shared_dir / "results"
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", f"file://{results}")
    result = timed_run("real_node_storage")
    assert result.state == "success", result
    total = sum(range(dags.STEPS))
    # On the hostPath folder: try 2, a new pod, resumes after the step try 1 saved last.
    shared = result.xcom("shared_checkpoint")
    assert result.tasks[("shared_checkpoint", -1)] == ("success", 2)
    assert (shared["try_number"], shared["resumed_from"], shared["total"]) == (2, dags.FAIL_AFTER, total), shared
    saved = sorted(p.name.split("-")[1] for p in (real_node_cluster.shared_dir / "checkpoints").glob("step-*"))
    assert saved == [f"{step:012d}" for step in range(dags.STEPS)], saved  # written by the pods, seen here
    # On the pod's own file system: gone with try 1's pod, so try 2 starts over.
    unshared = result.xcom("unshared_checkpoint")
    assert result.tasks[("unshared_checkpoint", -1)] == ("success", 2)
    assert (unshared["try_number"], unshared["resumed_from"], unshared["total"]) == (2, None, total), unshared
    assert "preempted after step 2" in error_of(failure_dir, "real_node_storage", "unshared_checkpoint")
    # 64 KiB through result storage on the same folder: written by the pod, read (and then deleted) here.
    large = result.xcom("large_result")
    assert large["rank"] == 0 and len(large["text"]) == 64 * 1024
    assert large["text"] == "".join(chr(65 + i % 26) for i in range(64 * 1024))
    assert results.is_dir() and not [p for p in results.rglob("*") if p.is_file()], "read, so deleted"

"""The root cause when failures come close together, through Airflow's ``dag.test()``: the task blames the cause,
not the ranks or pods that failed a moment later because of it, and retries when the cause is worth a retry.

The DAGs are in ``tests/dags/root_cause.py``. Locally, 2 ranks both raise ``RecoverableError`` right after a
collective (one of them may instead see the other's exit as a closed connection). On the local test cluster, an
elastic 2-node PyTorchJob has one pod OOMKilled while both ranks run barriers: the other pod then fails in the same
second, of a closed connection or of the c10d store it lost (whichever pod hosted it), and ends without a report or
with a victim's one. Whichever pod was killed, the task names it and is retried. The kill takes one worker of pod 0
(cgroup v1's kernel: its runner reports the rank's SIGKILL) and the whole container of pod 1 (cgroup v2's group kill:
137, no report); the real kernel's, under a real memory limit, is tests/e2e/test_root_cause_on_node.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import test_kubernetes as k8s
from tests.e2e.test_kubernetes import Cluster, training_container_status, wait_for

pytestmark = [pytest.mark.usefixtures("airflow_db")]

# The Kubernetes tests' fixtures that are not autouse: the session's cluster, and an emptied namespace after a test.
cluster = k8s.cluster
clean_namespace = k8s.clean_namespace

USER_RECOVERABLE = "airflow_provider_torchelastic.operators.UserCodeRecoverableError: "
OUT_OF_MEMORY = "airflow_provider_torchelastic.operators.OutOfMemoryError: "


@pytest.fixture
def failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where the DAGs' failure and retry callbacks write the task's exception, one file per try."""
    out = tmp_path / "failures"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(out))
    yield out


def errors(failure_dir: Path, dag_id: str) -> dict[int, str]:
    prefix = f"{dag_id}.train.try"
    found = {}
    for path in failure_dir.iterdir():
        assert path.name.startswith(prefix), path.name
        found[int(path.name[len(prefix) : -len(".txt")])] = path.read_text()
    return found


def timed(run, dag_id: str):
    started = time.monotonic()
    result = run(dag_id)
    print(f"{dag_id}: {time.monotonic() - started:.1f} s")
    return result


@pytest.mark.slow
def test_two_local_ranks_raising_recoverable_errors_after_a_collective_are_retried(failure_dir: Path) -> None:
    from tests.e2e.test_local_execution import run_dag

    result = timed(run_dag, "rc_local_recoverable_after_collective")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "a RecoverableError on every rank is worth a retry"
    assert result.xcom() == {"try_number": 2, "rank": 0, "sum": 3.0}
    tries = errors(failure_dir, "rc_local_recoverable_after_collective")
    assert list(tries) == [1], tries
    error = tries[1]
    assert error.startswith(USER_RECOVERABLE), error
    assert "ShardUnavailableError: rank " in error and "shard server unavailable on try 1" in error, error
    assert "Connection closed" not in error and "consequence" not in error, error


@pytest.mark.cluster
@pytest.mark.usefixtures("kubernetes_default_connection", "clean_namespace")
@pytest.mark.parametrize("killed_index", [0, 1], ids=["one-worker-of-worker-0", "whole-container-of-worker-1"])
def test_an_oom_killed_pod_is_the_root_cause_not_its_peer_that_failed_because_of_it(
    cluster: Cluster, failure_dir: Path, killed_index: int
) -> None:
    from airflow_provider_torchelastic.core.naming import job_name
    from airflow_provider_torchelastic.core.outcome import decode_outcome
    from airflow_provider_torchelastic.errors import EXIT_RECOVERABLE
    from tests.dags.root_cause import OOM_KILLS
    from tests.e2e.test_kubernetes import run_dag

    dag_id = f"rc_k8s_oom_worker_{killed_index}"
    one_worker = OOM_KILLS[killed_index] == "worker"
    result = timed(run_dag, dag_id)
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "an OOM kill is worth a retry"
    assert result.xcom()["try_number"] == 2 and result.xcom()["rank"] == 0
    tries = errors(failure_dir, dag_id)
    assert list(tries) == [1], tries
    first = job_name(result.identity(1))
    killed, peer = f"{first}-worker-{killed_index}", f"{first}-worker-{1 - killed_index}"
    error = tries[1]
    assert error.startswith(OUT_OF_MEMORY), error
    if one_worker:
        # The runner lived on to report its rank's SIGKILL; only the container's status says who sent it.
        assert f"{killed}: rank " in error and "SIGKILL" in error, error
        assert "its container ended OOMKilled (out of memory" in error, error
    else:
        assert f"{killed} exited with code 137 (OOMKilled)" in error, error
    assert peer not in error, "the peer that failed because of the kill is blamed"

    # Try 1's job was kept (it failed). The kubelet killed one pod; the other one failed too, a moment later (the
    # case that used to tie on the second, or let a bare exit 1 win, and blame the peer).
    killed_pod = cluster.get_pod(killed)
    assert killed_pod is not None, killed
    oom = training_container_status(killed_pod).state.terminated
    assert (oom.exit_code, oom.reason) == (EXIT_RECOVERABLE if one_worker else 137, "OOMKilled")
    peer_pod = wait_for(
        lambda: (pod := cluster.get_pod(peer)) is not None and pod.status.phase in ("Succeeded", "Failed") and pod,
        60,
        "the peer's pod to end",
    )
    ended = training_container_status(peer_pod).state.terminated
    assert peer_pod.status.phase == "Failed" and ended.exit_code != 0, peer_pod.status
    # It failed because of the kill, not of a timeout (its runner may take a few seconds more to exit). When the kill
    # took one worker, the killed pod's runner reports when its agent found the worker dead (torch's whole seconds,
    # late on a loaded machine: 11 s after the peer saw the connection close, in one CI run on 2 slow cores) and may
    # exit well after that. So that time bounds the peer's failure from above; from below only loosely.
    killed_report = decode_outcome(oom.message)
    if one_worker:
        assert killed_report is not None and killed_report.failure is not None, oom
        oom_at = killed_report.failure.timestamp
    else:
        oom_at = oom.finished_at.timestamp()
    assert ended.finished_at.timestamp() - oom_at <= 30, (ended.finished_at, oom_at)
    outcome = decode_outcome(ended.message)
    if outcome is not None and outcome.failure is not None:
        # What it reported is a victim's failure (a closed or reset connection, a lost store), seen as one, and
        # it came within moments of the kill (the OOM's time is whole seconds, and a report's may come late).
        assert outcome.failure.is_consequence, outcome.failure
        earliest = oom_at - (30 if one_worker else 1)
        assert earliest <= outcome.failure.timestamp <= oom_at + 10, (outcome.failure.timestamp, oom_at)


# --- the cause, never its victim, whatever the order (issue 31, item 4) -----------------------------------------------


def _assert_the_cause_is_rank_1s(result, tries: dict[int, str]) -> None:
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "rank 1's RecoverableError is worth a retry"
    assert list(tries) == [1], tries
    error = tries[1]
    assert error.startswith(USER_RECOVERABLE), error
    assert "rank 1" in error and "ShardUnavailableError: rank 1: checkpoint shard unavailable on try 1" in error, error
    # Rank 0 failed too, later, held in a collective until rank 1 had exited: a victim, never the cause.
    assert "Connection closed" not in error and "AssertionError" not in error, error


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_rank_held_in_a_collective_until_its_peer_exited_is_not_blamed(failure_dir: Path, method: str) -> None:
    from tests.e2e.test_local_execution import run_dag

    dag_id = f"rc_local_victim_after_cause_{method}"
    result = timed(run_dag, dag_id)
    _assert_the_cause_is_rank_1s(result, errors(failure_dir, dag_id))
    assert result.xcom() == {"try_number": 2, "rank": 0}


@pytest.mark.cluster
@pytest.mark.usefixtures("kubernetes_default_connection", "clean_namespace")
def test_across_pods_the_cause_outranks_the_pod_that_failed_because_of_it(cluster: Cluster, failure_dir: Path) -> None:
    from tests.e2e.test_kubernetes import run_dag

    result = timed(run_dag, "rc_k8s_victim_after_cause")
    _assert_the_cause_is_rank_1s(result, errors(failure_dir, "rc_k8s_victim_after_cause"))

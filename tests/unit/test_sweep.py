"""The backstop for jobs that outlived their task instance (issue 19, item 7): what the sweep deletes, and what it
leaves, decided from the object alone."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds, sweep
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

NOW = 2_000_000_000.0


def job(kind: str = "PyTorchJob", *, deadline: str | None = None, done: bool = False, ours: bool = True) -> dict:
    labels = {LABEL_MANAGED_BY: MANAGED_BY} if ours else {}
    if deadline is not None:
        labels[sweep.NOT_AFTER_LABEL] = deadline
    obj: dict[str, Any] = {"kind": kind, "metadata": {"name": f"{kind.lower()}-j", "labels": labels}}
    if kind == "Pod":
        obj["status"] = {"phase": "Succeeded" if done else "Running"}
    elif done:
        obj["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}]}
    return obj


def test_the_deadline_label_is_whole_seconds_and_round_trips() -> None:
    labelled = sweep.with_deadline({"metadata": {"name": "j", "labels": {"a": "b"}}}, NOW + 0.2)
    assert labelled["metadata"]["labels"] == {"a": "b", sweep.NOT_AFTER_LABEL: str(int(NOW) + 1)}
    assert sweep.not_after(labelled) == NOW + 1
    assert sweep.with_deadline({"metadata": {"name": "j"}}, None) == {"metadata": {"name": "j"}}
    for raw in ("soon", "-5", "1e9", "", "9" * 20):
        assert sweep.not_after(job(deadline=raw)) is None, raw


@pytest.mark.parametrize(
    ("obj", "swept"),
    [
        (job(deadline=str(int(NOW - sweep.GRACE_SECONDS))), True),
        (job("Pod", deadline=str(int(NOW - sweep.GRACE_SECONDS - 60))), True),
        (job(deadline=str(int(NOW - sweep.GRACE_SECONDS + 60))), False),  # the waiter deletes it itself at first
        (job(deadline=str(int(NOW - 3600)), done=True), False),  # finished: kept as on_finish_action left it
        (job("Pod", deadline=str(int(NOW - 3600)), done=True), False),
        (job(deadline=str(int(NOW - 3600)), ours=False), False),  # not the provider's
        (job(), False),  # no deadline (a task without execution_timeout)
    ],
)
def test_only_the_providers_running_jobs_well_past_their_deadline_are_swept(obj: dict, swept: bool) -> None:
    assert sweep.overdue(kinds.get(obj["kind"]), obj, now=NOW) is swept


class Kube:
    def __init__(
        self, objects: dict[str, list[dict]], missing: tuple[str, ...] = (), denied: tuple[str, ...] = ()
    ) -> None:
        self.objects, self.missing, self.denied, self.deleted, self.selectors = objects, missing, denied, [], []

    def list_kind(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        self.selectors.append(label_selector)
        if kind in self.missing:
            raise KubeError(404, "NotFound", "the server could not find the requested resource")
        if kind in self.denied:
            raise KubeError(403, "Forbidden", f"cannot list resource {kind.lower()}s")
        return self.objects.get(kind, [])

    def delete_job(self, ref: JobRef) -> bool:
        self.deleted.append(ref)
        return True


def test_a_sweep_lists_each_kind_once_and_deletes_only_what_is_overdue() -> None:
    late = str(int(NOW - 3600))
    kube = Kube({"PyTorchJob": [job(deadline=late), job(deadline=late, done=True)], "Pod": [job("Pod", deadline=late)]})
    lines: list[str] = []
    swept = sweep.sweep_namespace(kube, "ml", now=NOW, info=lambda m, *a: lines.append(m % a), warning=print)
    assert swept == kube.deleted
    assert sorted(swept, key=lambda ref: ref.kind) == [
        JobRef(kind="Pod", name="pod-j", namespace="ml"),
        JobRef(kind="PyTorchJob", name="pytorchjob-j", namespace="ml"),
    ]
    assert set(kube.selectors) == {sweep.SELECTOR} and len(kube.selectors) == len(kinds.registered())
    assert all("past its task's deadline or lease: deleting it" in line for line in lines), lines
    dry = Kube({"PyTorchJob": [job(deadline=late)]})
    assert sweep.sweep_namespace(dry, "ml", now=NOW, dry_run=True, info=print, warning=print) and not dry.deleted


def test_a_kind_the_cluster_does_not_serve_is_skipped_not_an_error() -> None:
    kube = Kube({"Pod": [job("Pod", deadline=str(int(NOW - 3600)))]}, missing=("PyTorchJob",))
    assert [ref.kind for ref in sweep.sweep_namespace(kube, "ml", now=NOW, info=print, warning=print)] == ["Pod"]


def test_a_custom_kind_the_role_may_not_list_is_warned_about_and_the_others_are_swept() -> None:
    # A Role from before TrainJob was a kind (no trainjobs rule): the PyTorchJobs and Pods are still swept.
    late = str(int(NOW - 3600))
    kube = Kube({"PyTorchJob": [job(deadline=late)]}, denied=("TrainJob",))
    warnings: list[str] = []
    swept = sweep.sweep_namespace(kube, "ml", now=NOW, info=print, warning=lambda m, *a: warnings.append(m % a))
    assert [ref.kind for ref in swept] == ["PyTorchJob"]
    assert len(warnings) == 1 and "Cannot list TrainJob in ml" in warnings[0] and "not swept" in warnings[0]
    with pytest.raises(KubeError):
        sweep.sweep_namespace(Kube({}, denied=("Pod",)), "ml", now=NOW, info=print, warning=print)


# --- the lease of a job whose task has no execution_timeout ---------------------------------------------------------


def test_a_lease_is_due_past_its_half_and_only_on_a_job_that_has_one() -> None:
    lease = 3600.0
    assert not sweep.lease_due(job(deadline=str(int(NOW + 3000))), lease=lease, now=NOW)
    assert sweep.lease_due(job(deadline=str(int(NOW + 1800))), lease=lease, now=NOW)
    assert sweep.lease_due(job(deadline=str(int(NOW - 10))), lease=lease, now=NOW)  # ran out: renew at once
    assert not sweep.lease_due(job(), lease=lease, now=NOW)
    assert sweep.lease_labels(NOW + 0.2) == {sweep.NOT_AFTER_LABEL: str(int(NOW) + 1)}


class LeasedSource:
    """A running job whose labels the wait may patch; every ``polls`` polls it has moved on ``step`` seconds. Its
    ``label_job`` fails while ``failing`` holds errors."""

    def __init__(self, job: dict, *, end_after: int, failing: list[KubeError] | None = None) -> None:
        self.job, self.clock, self.polls, self.end_after = job, [NOW], 0, end_after
        self.failing = failing or []
        self.renewed: list[float] = []

    def snapshot(self, ref: JobRef) -> Any:
        from airflow_provider_torchelastic.kubernetes.wait_types import Snapshot

        self.polls += 1
        if self.polls > self.end_after:
            self.job["status"] = {"phase": "Succeeded"}
        return Snapshot(job=self.job, pods=[], now=self.clock[0])

    def read_log(self, request: Any) -> str:
        return ""

    def delete_job(self, ref: JobRef) -> bool:
        return True

    def label_job(self, ref: JobRef, labels: dict[str, str]) -> None:
        if self.failing:
            raise self.failing.pop(0)
        self.job["metadata"]["labels"].update(labels)
        self.renewed.append(self.clock[0])

    def sleep(self, seconds: float) -> None:
        self.clock[0] += seconds


def _wait_leased(source: LeasedSource, lease: float | None) -> list[str]:
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
    from airflow_provider_torchelastic.kubernetes.wait_types import WaitPolicy

    lines: list[str] = []
    policy = WaitPolicy(poll_interval=600, lease_seconds=lease, finish_action="keep")
    drive_sync(
        wait_for_job(JobRef(kind="Pod", name="pod-j", namespace="ml"), policy), source, lines.append, sleep=source.sleep
    )
    return lines


def test_the_wait_renews_the_lease_at_half_of_it_while_the_job_runs_and_not_once_it_ended() -> None:
    # Created with a lease of an hour; polled every 10 minutes for 3 hours, then it ends.
    source = LeasedSource(job("Pod", deadline=str(int(NOW + 3600))), end_after=18)
    _wait_leased(source, lease=3600)
    # Due at NOW+1800 (half of the first lease), then every 30 minutes: never closer than half a lease to its end.
    assert source.renewed == [NOW + 1800 * k for k in range(1, 6)]
    assert sweep.not_after(source.job) == NOW + 1800 * 5 + 3600
    assert source.polls == 19


def test_a_failed_renewal_is_logged_and_tried_again_at_the_next_poll() -> None:
    source = LeasedSource(
        job("Pod", deadline=str(int(NOW + 1000))), end_after=3, failing=[KubeError(503, "Unavailable", "down")]
    )
    lines = _wait_leased(source, lease=3600)
    assert any(line.startswith("Could not renew the lease of Pod ml/pod-j: 503") for line in lines), lines
    assert source.renewed == [NOW + 600]


def test_a_try_with_a_deadline_renews_nothing() -> None:
    source = LeasedSource(job("Pod", deadline=str(int(NOW + 10))), end_after=3)
    _wait_leased(source, lease=None)
    assert source.renewed == []

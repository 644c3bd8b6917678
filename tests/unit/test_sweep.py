"""The backstop for jobs that outlived their task instance (issue 19, item 7): what the sweep deletes, and what it
leaves, decided from the object alone."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds, sweep
from airflow_provider_torchelastic.kubernetes.status import JobRef

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
    def __init__(self, objects: dict[str, list[dict]], missing: tuple[str, ...] = ()) -> None:
        self.objects, self.missing, self.deleted, self.selectors = objects, missing, [], []

    def list_kind(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        self.selectors.append(label_selector)
        if kind in self.missing:
            raise KubeError(404, "NotFound", "the server could not find the requested resource")
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
    assert all("past its task's deadline: deleting it" in line for line in lines), lines
    dry = Kube({"PyTorchJob": [job(deadline=late)]})
    assert sweep.sweep_namespace(dry, "ml", now=NOW, dry_run=True, info=print, warning=print) and not dry.deleted


def test_a_kind_the_cluster_does_not_serve_is_skipped_not_an_error() -> None:
    kube = Kube({"Pod": [job("Pod", deadline=str(int(NOW - 3600)))]}, missing=("PyTorchJob",))
    assert [ref.kind for ref in sweep.sweep_namespace(kube, "ml", now=NOW, info=print, warning=print)] == ["Pod"]

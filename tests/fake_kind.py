"""A job kind that exists only in the tests, plugged in the way another package would plug one in: through the
``airflow_provider_torchelastic.job_kinds`` entry-point group, from a distribution's metadata on ``sys.path``.

:func:`plugged` writes that metadata (a ``.dist-info`` folder with an ``entry_points.txt``) into a folder and puts
the folder on ``sys.path``; a process started with the folder of :func:`write_importable_distribution` on its
``PYTHONPATH`` sees the kind as well (the Airflow deployment's processes do: tests/airflow_services).
:data:`FAKE_JOB` is the kind: ``example.dev/v1`` ``FakeJob`` objects whose ``status.state`` is ``Done`` when they
ended, with pods labelled :data:`POD_LABEL` whose termination messages carry the runner's reports, as the built-in
kinds' do; it claims an ``Elastic`` config with ``nproc_per_node=3`` (so that a test can choose it) and nothing else.
What it decides is up to the test: set :data:`behaviour`. A cluster serves it once :data:`CRD` is installed; nothing
runs it there (a test plays its controller).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from airflow_provider_torchelastic import Elastic
from airflow_provider_torchelastic.core.outcome import decide_run
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.pod_template import RenderInputs, job_metadata
from airflow_provider_torchelastic.kubernetes.status import Observed, job_gone, phase_of, with_pods
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

ENTRY_POINT = "fakejob = tests.fake_kind:FAKE_JOB"
GROUP: Final = "example.dev"
VERSION: Final = "v1"
PLURAL: Final = "fakejobs"
#: The label with the job's name that its controller puts on the job's pods (what a watch of all pods files them by).
POD_LABEL: Final = "example.dev/job"


def state_of(job: Mapping[str, Any]) -> str | None:
    """``status.state``; None while the controller has written no status (a job just created has none)."""
    state = (job.get("status") or {}).get("state")
    return None if state is None else str(state)


def _done(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """Running until ``status.state`` is ``Done``; then, as for the built-in kinds, the verdict of its pods' reports
    (rank 0's result is in its pod's termination message), once rank 0's pod or every pod has reported."""
    job = snapshot.job
    if job is None:
        return job_gone(ref)
    seen = Observed(ref=ref, job=job, pods=list(snapshot.pods), total=max(1, len(snapshot.pods)), now=snapshot.now)
    state = state_of(job) or "Pending"
    reports = seen.reports()
    holds_rank0 = any(report.outcome is not None and report.outcome.holds_rank0 for report in reports)
    if state != "Done" or not (holds_rank0 or len(reports) >= len(seen.pods)):
        # The job and its pods are watched apart: "Done" may arrive before rank 0's pod says it ended.
        return seen.decision(Phase.RUNNING, state)
    verdict = decide_run(reports)
    return with_pods(seen.decision(phase_of(verdict), state, verdict=verdict), snapshot, seen.pods)


#: The decision the kind makes; a test replaces it (and puts it back) with :func:`deciding`.
behaviour: Callable[[JobRef, Snapshot, WaitPolicy], WaitDecision] = _done


def _render(inputs: RenderInputs) -> dict[str, Any]:
    # The shared metadata (the provider's labels and the task's identity): what the UI lists, the sweep finds and a
    # re-attach proves ownership by. No pod template: nothing runs a FakeJob (a test plays its controller).
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FakeJob", "metadata": job_metadata(inputs), "spec": {}}


FAKE_JOB = kinds.JobKind(
    kind="FakeJob",
    group=GROUP,
    version=VERSION,
    plural=PLURAL,
    accepts=lambda config: isinstance(config, Elastic) and config.nproc_per_node == 3,
    render=_render,
    pod_selector=lambda name: f"{POD_LABEL}={name}",
    pod_owner_label=POD_LABEL,
    decide=lambda ref, snapshot, policy: behaviour(ref, snapshot, policy),
    is_finished=lambda job: state_of(job) == "Done",
)


#: What a cluster needs to serve FakeJobs (apiextensions.k8s.io/v1, as a 1.20 API server takes it): ``spec`` and
#: ``status`` without a schema, ``status`` a subresource, written apart from the object as a controller writes it.
CRD: Final[dict[str, Any]] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"kind": "FakeJob", "listKind": "FakeJobList", "plural": PLURAL, "singular": "fakejob"},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def write_distribution(folder: Path, entry_points: tuple[str, ...] = (ENTRY_POINT,)) -> Path:
    """A distribution's metadata in ``folder`` whose entry points plug in ``entry_points``; returns ``folder``."""
    dist = folder / "torchelastic_test_kinds-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchelastic-test-kinds\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{kinds.ENTRY_POINT_GROUP}]\n" + "".join(f"{p}\n" for p in entry_points))
    return folder


def write_importable_distribution(folder: Path) -> Path:
    """:func:`write_distribution` for processes whose path has ``folder`` but not the checkout (the Airflow
    deployment's): the entry point names ``tests.fake_kind``, so this checkout's ``tests`` package goes beside the
    metadata, as a symlink. Not the checkout's root on their path: it holds a build's ``.egg-info``, which would make
    the provider's own distribution appear twice to every entry-point scan."""
    write_distribution(folder)
    link = folder / "tests"
    if link.is_symlink():  # a state dir reused by another checkout
        link.unlink()
    link.symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
    return folder


@contextmanager
def plugged(folder: Path, entry_points: tuple[str, ...] = (ENTRY_POINT,)) -> Iterator[None]:
    """The kinds of ``entry_points`` plugged in for the block: on ``sys.path``, the table read again (and after)."""
    path = str(write_distribution(folder, entry_points))
    sys.path.insert(0, path)
    kinds.registered.cache_clear()
    try:
        yield
    finally:
        sys.path.remove(path)
        kinds.registered.cache_clear()


@contextmanager
def deciding(decide: Callable[[JobRef, Snapshot, WaitPolicy], WaitDecision]) -> Iterator[None]:
    global behaviour
    before, behaviour = behaviour, decide
    try:
        yield
    finally:
        behaviour = before

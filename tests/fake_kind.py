"""A job kind that exists only in the tests, plugged in the way another package would plug one in: through the
``airflow_provider_torchelastic.job_kinds`` entry-point group, from a distribution's metadata on ``sys.path``.

:func:`plugged` writes that metadata (a ``.dist-info`` folder with an ``entry_points.txt``) into a folder and puts
the folder on ``sys.path``; a process started with the folder on its ``PYTHONPATH`` sees the kind as well.
:data:`FAKE_JOB` is the kind: ``example.dev/v1`` ``FakeJob`` objects whose ``status.state`` is ``Done`` when they
ended; it claims an ``Elastic`` config with ``nproc_per_node=3`` (so that a test can choose it) and nothing else.
What it decides is up to the test: set :data:`behaviour`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from airflow_provider_torchelastic import Elastic
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.status import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

ENTRY_POINT = "fakejob = tests.fake_kind:FAKE_JOB"


def _done(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    done = snapshot.job is not None and snapshot.job["status"]["state"] == "Done"
    return WaitDecision(phase=Phase.SUCCEEDED if done else Phase.RUNNING, progress="fake")


#: The decision the kind makes; a test replaces it (and puts it back) with :func:`deciding`.
behaviour: Callable[[JobRef, Snapshot, WaitPolicy], WaitDecision] = _done


def _render(inputs: Any) -> dict[str, Any]:
    return {"apiVersion": "example.dev/v1", "kind": "FakeJob", "metadata": {"name": inputs.name}, "spec": {}}


FAKE_JOB = kinds.JobKind(
    kind="FakeJob",
    group="example.dev",
    version="v1",
    plural="fakejobs",
    accepts=lambda config: isinstance(config, Elastic) and config.nproc_per_node == 3,
    render=_render,
    pod_selector=lambda name: f"example.dev/job={name}",
    decide=lambda ref, snapshot, policy: behaviour(ref, snapshot, policy),
    is_finished=lambda job: job["status"]["state"] == "Done",
)


def write_distribution(folder: Path, entry_points: tuple[str, ...] = (ENTRY_POINT,)) -> Path:
    """A distribution's metadata in ``folder`` whose entry points plug in ``entry_points``; returns ``folder``."""
    dist = folder / "torchelastic_test_kinds-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchelastic-test-kinds\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{kinds.ENTRY_POINT_GROUP}]\n" + "".join(f"{p}\n" for p in entry_points))
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

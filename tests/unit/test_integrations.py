"""The framework-independent parts of airflow_provider_torchelastic.integrations (the job's size, the metrics filter,
the folder mirror) and ``resume_from`` (parse-time refusals, where the workers look): no framework imported here; the
frameworks themselves run in tests/e2e/test_local_frameworks.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from airflow_provider_torchelastic.core.run_context import (
    CONTEXT_ENV,
    TaskContext,
    checkpoint_location,
    other_run_location,
)
from airflow_provider_torchelastic.integrations.common import JobSize, job_size, numbers
from airflow_provider_torchelastic.integrations.mirror import FolderMirror
from airflow_provider_torchelastic.worker import checkpoint

MANAGED = re.compile(r"checkpoint-(\d+)")
RANK_FILE = re.compile(r"rng_state_(\d+)\.pth")


def test_importing_the_integrations_package_imports_no_framework() -> None:
    import subprocess

    code = (
        "import sys, airflow_provider_torchelastic.integrations, airflow_provider_torchelastic.integrations.mirror\n"
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate', 'airflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("env", "size"),
    [
        ({}, JobSize(nodes=1, procs_per_node=1, world_size=1)),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}, JobSize(2, 2, 4)),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2"}, JobSize(2, 1, 2)),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, JobSize(1, 2, 2)),
    ],
)
def test_the_job_size_comes_from_torch_elastics_variables(env: dict[str, str], size: JobSize) -> None:
    assert job_size(env) == size


def test_nodes_of_different_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE=3 is not GROUP_WORLD_SIZE=2 x LOCAL_WORLD_SIZE=2"):
        job_size({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"})


def test_only_finite_numbers_are_metrics() -> None:
    import torch

    logs = {"loss": torch.tensor(0.5), "lr": 1e-3, "epoch": 1, "name": "x", "flag": True, "total_flos": 9.0}
    assert numbers({**logs, "nan": float("nan"), "vector": torch.ones(2)}) == {"loss": 0.5, "lr": 1e-3, "epoch": 1.0}


def _save(local: Path, name: str, files: dict[str, bytes]) -> None:
    for relative, data in files.items():
        path = local / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_a_mirror_publishes_complete_checkpoints_mirrors_deletions_and_restores(tmp_path: Path) -> None:
    location, local = str(tmp_path / "store"), tmp_path / "node-0"
    mirror = FolderMirror(local, location, kind="test", managed=MANAGED, rank_file=RANK_FILE)
    _save(local, "checkpoint-2", {"model.bin": b"2", "rng_state_0.pth": b"r0", "sub/x.json": b"{}"})
    first = mirror.publish("checkpoint-2", step=2)
    assert first is not None and first.step == 2 and first.kind == "test"
    assert (Path(first.uri) / "checkpoint-2" / "sub" / "x.json").read_bytes() == b"{}"
    # The framework saved step 4 and rotated step 2 out: the location follows once step 4 is committed.
    _save(local, "checkpoint-4", {"model.bin": b"4", "rng_state_0.pth": b"r0", "rng_state_1.pth": b"r1"})
    (local / "checkpoint-2" / "model.bin").unlink()
    (local / "checkpoint-2" / "rng_state_0.pth").unlink()
    (local / "checkpoint-2" / "sub" / "x.json").unlink()
    (local / "checkpoint-2" / "sub").rmdir()
    (local / "checkpoint-2").rmdir()
    second = mirror.publish("checkpoint-4", step=4)
    assert second is not None and [c.step for c in checkpoint.complete(location, kind="test")] == [4]
    # Rank 1's own file is rank 1's to upload: a single rank 0 leaves it out.
    assert sorted(p.name for p in (Path(second.uri) / "checkpoint-4").iterdir()) == ["model.bin", "rng_state_0.pth"]
    # A torn save in the location and a stale local folder: neither survives a restore.
    torn = Path(location) / checkpoint.folder_name(6) / "checkpoint-6"
    torn.mkdir(parents=True)
    (torn / "model.bin").write_bytes(b"half")
    fresh = tmp_path / "node-1"
    _save(fresh, "checkpoint-9", {"model.bin": b"from another try"})
    (fresh / "runs").mkdir()  # not a checkpoint: left alone
    restored = FolderMirror(fresh, location, kind="test", managed=MANAGED, rank_file=RANK_FILE).restore()
    assert restored == ["checkpoint-4"]
    assert sorted(p.name for p in fresh.iterdir()) == ["checkpoint-4", "runs"]
    assert (fresh / "checkpoint-4" / "model.bin").read_bytes() == b"4"


def test_a_mirror_without_a_location_keeps_everything_local(tmp_path: Path) -> None:
    mirror = FolderMirror(tmp_path, None, kind="test", managed=MANAGED, rank_file=RANK_FILE)
    _save(tmp_path, "checkpoint-1", {"a": b"1"})
    assert mirror.publish("checkpoint-1", step=1) is None and mirror.restore() == []
    assert (tmp_path / "checkpoint-1" / "a").is_file()


# --- resume_from -----------------------------------------------------------------------------------------------------


def _run_context(monkeypatch: pytest.MonkeyPatch, root: Path, run_id: str, resume_from: str | None) -> str:
    location = checkpoint_location(str(root), dag_id="dag", run_id=run_id, task_id="train", map_index=-1)
    task = TaskContext(dag_id="dag", task_id="train", run_id=run_id, checkpoint_uri=location, resume_from=resume_from)
    monkeypatch.setenv(CONTEXT_ENV, task.to_env_value())
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    return location


def test_resume_from_reads_another_runs_checkpoint_until_the_run_has_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    old = checkpoint_location(str(root), dag_id="dag", run_id="manual__2026-01-01", task_id="train", map_index=-1)
    older = checkpoint_location(str(root), dag_id="dag", run_id="scheduled__2025", task_id="train", map_index=-1)
    checkpoint.save({"w": 1}, step=7, uri=older)
    checkpoint.save({"w": 2}, step=3, uri=old)  # committed last: the newest of the earlier runs
    own = _run_context(monkeypatch, root, "manual__2026-02-01", "latest")
    assert checkpoint.resume_location() == old
    loaded = checkpoint.load_latest()
    assert loaded is not None and (loaded.step, loaded.state, loaded.uri.startswith(old)) == (3, {"w": 2}, True)
    _run_context(monkeypatch, root, "manual__2026-02-01", "scheduled__2025")
    found = checkpoint.latest()
    assert found is not None and found.step == 7 and found.uri.startswith(older)
    # Once the run saved its own, its own wins (a retry resumes from its own progress), and nothing was written
    # into the other run's location.
    checkpoint.save({"w": 3}, step=1)
    found = checkpoint.latest()
    assert found is not None and found.uri.startswith(own) and found.step == 1
    assert [c.step for c in checkpoint.complete(older)] == [7]
    # A run id that has no checkpoint: nothing to resume from.
    _run_context(monkeypatch, root, "manual__2026-03-01", "manual__1999")
    assert checkpoint.resume_location() is None and checkpoint.load_latest() is None


def test_other_run_location_escapes_the_run_id_as_checkpoint_location_does() -> None:
    own = checkpoint_location(
        "s3://b/p", dag_id="d", run_id="manual__2026-01-01T00:00:00+00:00", task_id="t", map_index=2
    )
    other = other_run_location(own, run_id="scheduled__2026-01-02T00:00:00+00:00", task_id="t", map_index=2)
    assert other == checkpoint_location(
        "s3://b/p", dag_id="d", run_id="scheduled__2026-01-02T00:00:00+00:00", task_id="t", map_index=2
    )


def test_the_run_context_carries_resume_from_only_when_set() -> None:
    plain = TaskContext(dag_id="d", task_id="t", run_id="r")
    assert "resume_from" not in json.loads(plain.to_env_value())
    given = TaskContext(dag_id="d", task_id="t", run_id="r", resume_from="latest")
    assert TaskContext.from_env_value(given.to_env_value()).resume_from == "latest"


@pytest.mark.parametrize(
    ("value", "error"),
    [("", ValueError), (" latest", ValueError), ("x" * 251, ValueError), (3, TypeError), (["latest"], TypeError)],
)
def test_resume_from_that_names_nothing_is_refused_when_the_dag_is_parsed(value: object, error: type) -> None:
    from airflow_provider_torchelastic import TorchElasticOperator

    with pytest.raises(error, match="resume_from"):
        TorchElasticOperator(task_id="t", python_callable=print, execution="local", resume_from=value)  # type: ignore[arg-type]


def test_resume_from_with_a_checkpoint_uri_of_its_own_is_refused() -> None:
    from airflow_provider_torchelastic import TorchElasticOperator

    with pytest.raises(ValueError, match="pass one of the two"):
        TorchElasticOperator(
            task_id="t", python_callable=print, execution="local", resume_from="latest", checkpoint_uri="/mnt/x"
        )
    for value in ("latest", "manual__2026-01-01T00:00:00+00:00", "{{ params.resume_from }}", None):
        op = TorchElasticOperator(task_id="t", python_callable=print, execution="local", resume_from=value)
        assert op.resume_from == value and "resume_from" in op.template_fields


def test_a_sigterm_to_a_worker_becomes_a_stop_request_not_an_exit() -> None:
    """What replaces Lightning's SIGTERM handler (whose SIGTERMException is a SystemExit, a permanent failure)."""
    import os
    import signal

    from airflow_provider_torchelastic.integrations import common

    before = signal.getsignal(signal.SIGTERM)
    try:
        common.watch_sigterm()
        assert not common.stop_agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert common.stop_agreed()
    finally:
        signal.signal(signal.SIGTERM, before)
        common._sigterm.clear()


def test_the_images_framework_packages_are_the_frameworks_extra() -> None:
    import tomllib

    from tests.conftest import REPO_ROOT

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["frameworks"]
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r'^ARG FRAMEWORKS_PACKAGES="([^"]*)"', dockerfile, re.MULTILINE)
    assert match is not None, "docker/Dockerfile declares ARG FRAMEWORKS_PACKAGES"
    assert match.group(1).split() == extra

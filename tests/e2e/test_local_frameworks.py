"""The training frameworks with the provider's integrations (airflow_provider_torchelastic.integrations), for real:
Hugging Face transformers' Trainer, Lightning and accelerate train the tiny models of
example_dags/torch_elastic_frameworks.py on 2 workers through ``dag.test()`` with local execution
(tests/dags/frameworks_e2e.py).

For each: its logged metrics reach the job summary; the first try fails recoverably right after its first checkpoint
(a ``RecoverableError`` raised from a framework callback stays recoverable) and the second try starts at the step
after that checkpoint; its final loss is within a tolerance of an uninterrupted run's (mid-epoch resume is not
bit-exact: data order and RNG streams may differ after a resume). Lightning also runs on 2 nodes and on 1 with
``num_nodes``/``devices`` from the job, and its ``MisconfigurationException`` fails the task without a retry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary
from tests.conftest import TEST_DAGS
from tests.e2e.test_local_execution import DagRunResult
from tests.e2e.test_local_execution import run_dag as run_dag_in
from tests.s3_server import S3Server, s3, s3_env  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]

#: The one DAG file these tests parse (not the folder: parsing a file is quicker, and what another file does to the
#: folder's parse is another test's business).
DAG_FILE = TEST_DAGS / "frameworks_e2e.py"

#: How far a resumed run's final loss may be from an uninterrupted one's: relative, plus an absolute floor for losses
#: near zero. The runs see the same data and start from the same weights; what may differ is the RNG state and data
#: order after the resume. Lightning's and transformers' examples once built their models before seeding, so each run
#: started from other weights: CI saw Lightning's resume end 0.13 from its uninterrupted run (0.18 against 0.31).
#: Seeded first, the three frameworks' resumes ended within 1% of their uninterrupted runs (2026-12-04, one run);
#: the tolerance stays loose for the RNG and data order, since a resume that lost its weights ends far further off.
RELATIVE_TOLERANCE = 0.25
ABSOLUTE_TOLERANCE = 0.1


@pytest.fixture
def checkpoint_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "checkpoints"
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", f"file://{root}")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL", "0.5")
    # The workers' node-local folders (te_transformers.output_dir() ...) go under the system's temporary folder.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    out = tmp_path / "failures"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(out))
    return root


def run_dag(dag_id: str) -> DagRunResult:
    return run_dag_in(dag_id, DAG_FILE)


def first_try_error(root: Path, dag_id: str, task_id: str = "train") -> str:
    return (root.parent / "failures" / f"{dag_id}.{task_id}.try1.txt").read_text()


def check_resumed(
    result: DagRunResult, root: Path, dag_id: str, *, metric: str, checkpoint_steps: int = 2
) -> dict[str, Any]:
    """What every framework's ``train`` task must show; returns its value."""
    assert result.tasks[("train", -1)] == ("success", 2), result
    error = first_try_error(root, dag_id)
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), error
    assert "RecoverableError: interrupted after the checkpoint of step" in error, error
    value = result.xcom()
    resumed, uninterrupted = value["resumed"], value["uninterrupted"]
    # The checkpoint of the first try held its first steps: the second try started at the next one.
    assert resumed["first_step"] == checkpoint_steps and uninterrupted["first_step"] == 0, value
    assert resumed["steps"] == uninterrupted["steps"], value
    allowed = max(ABSOLUTE_TOLERANCE, RELATIVE_TOLERANCE * abs(uninterrupted["loss"]))
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= allowed, (resumed["loss"], uninterrupted["loss"], value)
    summary = JobSummary.from_json(result.xcom("train", XCOM_KEY))
    assert summary.phase == "succeeded" and metric in summary.last_metrics, summary.last_metrics
    steps = [step for step, _ in summary.metrics[metric]]
    assert steps and steps[-1] == max(steps), summary.metrics
    return value


def test_transformers_trainer_reports_checkpoints_and_resumes(checkpoint_root: Path) -> None:
    result = run_dag("te_frameworks_transformers")
    value = check_resumed(result, checkpoint_root, "te_frameworks_transformers", metric="loss")
    assert value["resumed"]["steps"] == 6, value
    summary = JobSummary.from_json(result.xcom("train", XCOM_KEY))
    assert {"loss", "learning_rate", "grad_norm", "epoch"} <= set(summary.last_metrics), summary.last_metrics
    assert summary.metrics["loss"][-1][0] == 6.0, summary.metrics["loss"]
    # save_total_limit=2 rotated checkpoint-2 out locally: the location mirrors it (steps 4 and 6, complete).
    (location,) = checkpoint_root.glob("te_frameworks_transformers/*/train/-1/transformers")
    folders = sorted(p for p in location.iterdir() if (p / "COMMITTED").is_file())
    assert [sorted(c.name for c in f.iterdir() if c.is_dir()) for f in folders] == [["checkpoint-4"], ["checkpoint-6"]]
    checkpoint = folders[-1] / "checkpoint-6"
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= {
        p.name for p in checkpoint.iterdir()
    }


def test_lightning_reports_resumes_and_takes_its_size_from_the_job(checkpoint_root: Path) -> None:
    result = run_dag("te_frameworks_lightning")
    value = check_resumed(result, checkpoint_root, "te_frameworks_lightning", metric="train_loss", checkpoint_steps=4)
    assert value["resumed"]["steps"] == 8 and (value["resumed"]["num_nodes"], value["resumed"]["devices"]) == (2, 1)
    one_node = result.xcom("one_node")
    assert (one_node["num_nodes"], one_node["devices"], one_node["steps"]) == (1, 2, 4), one_node
    (location,) = checkpoint_root.glob("te_frameworks_lightning/*/train/-1/lightning")
    assert (location / "last.ckpt").is_file()
    # A Lightning MisconfigurationException: permanent, its class and message kept, retries=1 unused.
    assert result.tasks[("misconfigured", -1)] == ("failed", 1), result
    error = first_try_error(checkpoint_root, "te_frameworks_lightning", "misconfigured")
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "MisconfigurationException: No `training_step()` method defined" in error, error


@pytest.mark.parametrize("store", ["file", "s3"])
def test_accelerate_reports_checkpoints_and_resumes(
    store: str, checkpoint_root: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from airflow_provider_torchelastic.worker import checkpoint

    if store == "s3":  # the mirror through fsspec: an object store, no folders, no rename
        server: S3Server = request.getfixturevalue("s3_env")
        monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", server.url(checkpoint_root.parent.name))
    result = run_dag("te_frameworks_accelerate")
    value = check_resumed(result, checkpoint_root, "te_frameworks_accelerate", metric="loss")
    assert value["resumed"]["steps"] == 8, value
    assert value["location"].startswith("s3://" if store == "s3" else "file://"), value
    committed = checkpoint.complete(f"{value['location']}/accelerate", kind="accelerate")
    # keep=2: steps 5 and 7 remain (the others were deleted there too), each with both ranks' random states.
    assert [c.step for c in committed] == [5, 7], committed
    newest = checkpoint.open_store(committed[-1].uri)
    files = newest.files(newest.path("step-7"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(files), files


STOP_SCRIPT = """
import json, os, sys
sys.path.insert(0, os.environ["REPO_ROOT"])
from example_dags import framework_training
from airflow_provider_torchelastic.integrations.common import StopRequested

stopped = {}
for name in ("transformers", "lightning", "accelerate"):
    try:
        getattr(framework_training, "train_" + name)()
    except StopRequested as e:
        stopped[name] = str(e)
print("STOPPED " + json.dumps(stopped))
"""


def test_a_stop_request_saves_a_checkpoint_and_stops_each_framework(tmp_path: Path) -> None:
    """The runner's stop file exists from the start (a try asked to stop at its first step): each integration saves a
    complete checkpoint and raises StopRequested (recoverable). One process of a world of one, all three frameworks
    in it (the runner's stop handling itself is tests/runner's)."""
    import json
    import os
    import subprocess
    import sys

    from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext, checkpoint_location
    from airflow_provider_torchelastic.worker import checkpoint
    from airflow_provider_torchelastic.worker.liveness import STOP_FILE_ENV
    from tests.conftest import REPO_ROOT

    stop = tmp_path / "stop"
    stop.touch()
    location = checkpoint_location(str(tmp_path / "root"), dag_id="d", run_id="r", task_id="t", map_index=-1)
    env = {
        **os.environ,
        "REPO_ROOT": str(REPO_ROOT),
        CONTEXT_ENV: TaskContext(dag_id="d", task_id="t", run_id="r", checkpoint_uri=location).to_env_value(),
        STOP_FILE_ENV: str(stop),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "TORCHELASTIC_RUN_ID": "stop-test",
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("STOPPED ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-6000:]
    stopped = json.loads(line.removeprefix("STOPPED "))
    assert set(stopped) == {"transformers", "lightning", "accelerate"}, (stopped, proc.stderr[-6000:])
    assert "saved checkpoint-1" in stopped["transformers"] and "saved step 0" in stopped["accelerate"], stopped
    assert "last.ckpt" in stopped["lightning"], stopped
    for kind, subfolder in (("transformers.Trainer", "transformers"), ("accelerate", "accelerate")):
        (saved,) = checkpoint.complete(f"{location}/{subfolder}", kind=kind)
        assert saved.step in (0, 1), saved
    assert (Path(location) / "lightning" / "last.ckpt").is_file()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_lightnings_last_checkpoint_is_found_on_an_object_store_and_in_an_earlier_run(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """``ckpt_path()`` names ``last.ckpt`` by its full URL (Lightning's own ``"last"`` lists the folder and loses the
    ``s3://``), and falls back to the run that ``resume_from`` names while the task's own location has none."""
    import fsspec

    from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext, checkpoint_location
    from airflow_provider_torchelastic.integrations import lightning as te_lightning

    server: S3Server = request.getfixturevalue("s3_env")
    root = server.url("lightning-ckpt-path")
    own = checkpoint_location(root, dag_id="d", run_id="new", task_id="t", map_index=-1)
    old = checkpoint_location(root, dag_id="d", run_id="old", task_id="t", map_index=-1)
    context = TaskContext(dag_id="d", task_id="t", run_id="new", checkpoint_uri=own, resume_from="latest")
    for name, value in {CONTEXT_ENV: context.to_env_value(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    assert te_lightning.ckpt_path() is None  # a first try of a first run
    with fsspec.open(f"{old}/lightning/last.ckpt", "wb") as handle:
        handle.write(b"an earlier run's")
    assert te_lightning.ckpt_path() == f"{old}/lightning/last.ckpt"
    with fsspec.open(f"{own}/lightning/last.ckpt", "wb") as handle:
        handle.write(b"this run's own")
    assert te_lightning.ckpt_path() == f"{own}/lightning/last.ckpt"
    assert te_lightning.trainer_kwargs()["default_root_dir"] == f"{own}/lightning"

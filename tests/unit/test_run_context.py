"""The run context and the locations of checkpoints and results: read from the environment, rendered into every pod,
set the same way by local execution, and checked when the DAG is parsed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from airflow_provider_torchelastic import Elastic, PyTorch, Worker, context
from airflow_provider_torchelastic.core.launch import config_to_launch_spec, runner_command
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.run_context import (
    CONTEXT_ENV,
    NoRunContextError,
    TaskContext,
    checkpoint_location,
    result_location,
    safe_path_piece,
)
from airflow_provider_torchelastic.kubernetes.render import render_manifests
from airflow_provider_torchelastic.worker.context import RunContext

TASK = TaskContext(
    dag_id="nightly",
    task_id="train",
    run_id="scheduled__2026-01-01T00:00:00+00:00",
    map_index=3,
    try_number=2,
    max_tries=4,
    logical_date="2026-01-01T00:00:00+00:00",
    checkpoint_uri="s3://ckpt/nightly/run/train/3",
)
WORKER_ENV = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "HOSTNAME": "job-worker-1"}


def test_current_combines_the_rendered_task_context_with_torch_elastic_worker_env() -> None:
    env = {CONTEXT_ENV: TASK.to_env_value(), **WORKER_ENV, "TORCHELASTIC_RESTART_COUNT": "2"}
    ctx = context.current(env)
    assert isinstance(ctx, RunContext)
    assert (ctx.dag_id, ctx.task_id, ctx.run_id, ctx.map_index) == (TASK.dag_id, "train", TASK.run_id, 3)
    assert (ctx.try_number, ctx.max_tries, ctx.logical_date) == (2, 4, "2026-01-01T00:00:00+00:00")
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.node, ctx.restart_count) == (1, 0, 4, "job-worker-1", 2)
    assert ctx.checkpoint_uri == TASK.checkpoint_uri and not ctx.is_last_try


def test_without_a_checkpoint_location_there_is_no_checkpoint() -> None:
    task = TaskContext(dag_id="d", task_id="t", run_id="r")
    ctx = context.current({CONTEXT_ENV: task.to_env_value(), **WORKER_ENV})
    assert ctx.checkpoint_uri is None and ctx.logical_date is None and ctx.is_last_try
    assert ctx.has_checkpoint() is False


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "TORCHELASTIC_CONTEXT is not set: context.current\\(\\) works only inside the training function"),
        ({CONTEXT_ENV: "{not json"}, "TORCHELASTIC_CONTEXT: expected a JSON object"),
        ({CONTEXT_ENV: '{"dag_id": "d"}'}, "TORCHELASTIC_CONTEXT: .*missing 2 required keyword-only arguments"),
        ({CONTEXT_ENV: '{"dag_id": "d", "task_id": "", "run_id": "r"}'}, "TaskContext.task_id: expected a non-empty"),
        ({CONTEXT_ENV: TASK.to_env_value()}, "RANK is not set: the run context exists only in the workers"),
    ],
)
def test_outside_a_job_current_raises_a_clear_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(NoRunContextError, match=match):
        context.current(env)


def test_the_env_value_is_canonical_and_ignores_unknown_keys() -> None:
    text = TASK.to_env_value()
    assert text == TaskContext.from_env_value(text).to_env_value()
    newer = json.dumps({**json.loads(text), "added_later": 1})
    assert TaskContext.from_env_value(newer) == TASK


def test_locations_are_stable_per_task_instance_and_safe_for_object_stores() -> None:
    where = checkpoint_location("s3://bucket/ckpt/", dag_id="d", run_id=TASK.run_id, task_id="t", map_index=-1)
    # ':' and '+' are replaced (and the original hashed in), so the run id is one safe path segment.
    assert where.startswith("s3://bucket/ckpt/d/scheduled__2026-01-01T00_00_00_00_00-")
    assert where.endswith("/t/-1")
    assert where == checkpoint_location("s3://bucket/ckpt", dag_id="d", run_id=TASK.run_id, task_id="t", map_index=-1)
    assert safe_path_piece("a:b") != safe_path_piece("a+b")
    assert safe_path_piece("..") not in ("..", ".") and "/" not in safe_path_piece("a/../b")
    assert safe_path_piece("train.step_1") == "train.step_1"
    first = result_location("/results", TASK)
    assert first.startswith("/results/nightly/") and first.endswith("/train/3/2/result.json")
    with pytest.raises(ValueError, match="checkpoint root: expected a path or fsspec URL, got ' '"):
        checkpoint_location(" ", dag_id="d", run_id="r", task_id="t", map_index=0)


@pytest.mark.parametrize("config", [Elastic(), Elastic(nnodes="1:3"), PyTorch(worker=Worker(replicas=2))])
def test_the_context_is_rendered_into_every_pod_and_the_result_url_onto_every_command(config: object) -> None:
    identity = RunIdentity(dag_id=TASK.dag_id, task_id=TASK.task_id, run_id=TASK.run_id, map_index=3, try_number=2)
    # With every location a run adds: checkpoints and artifacts (a result_storage makes both).
    task = dataclasses.replace(TASK, artifact_uri="s3://results/nightly/run/train/3/2/artifacts")

    def render() -> list[dict]:
        return render_manifests(
            config,  # type: ignore[arg-type]
            identity=identity,
            namespace="ml",
            image="repo/train:1",
            payload=b"p",
            task_context=task,
            result_url="s3://results/x/result.json",
        )

    manifests = render()
    assert manifests == render(), "the same try renders the same objects"
    workload = manifests[1]
    specs = (
        [workload["spec"]]
        if workload["kind"] == "Pod"
        else [r["template"]["spec"] for r in workload["spec"]["pytorchReplicaSpecs"].values()]
    )
    for spec in specs:
        (container,) = spec["containers"]
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert env[CONTEXT_ENV] == task.to_env_value()
        command = container["command"]
        assert command[command.index("--result-url") + 1] == "s3://results/x/result.json"


def test_a_task_context_of_another_try_is_refused() -> None:
    identity = RunIdentity(dag_id=TASK.dag_id, task_id=TASK.task_id, run_id=TASK.run_id, map_index=3, try_number=1)
    with pytest.raises(ValueError, match="task_context: expected the task instance and try of the identity"):
        render_manifests(
            Elastic(), identity=identity, namespace="ml", image="repo/train:1", payload=b"", task_context=TASK
        )


def test_runner_command_carries_the_result_url_only_when_given() -> None:
    spec = config_to_launch_spec(Elastic())
    assert "--result-url" not in runner_command(spec, payload_path="p", result_file="r")
    command = runner_command(spec, payload_path="p", result_file="r", result_url="/results/r.json")
    assert command[command.index("--result-url") + 1] == "/results/r.json"


def test_local_execution_sets_the_context_and_drops_the_workers_airflow_ctx(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.local.run import _clean_env

    monkeypatch.setenv("AIRFLOW_CTX_DAG_ID", "the_worker_task")
    monkeypatch.setenv(CONTEXT_ENV, "stale")
    env = _clean_env(TASK)
    assert env[CONTEXT_ENV] == TASK.to_env_value()
    assert not [key for key in env if key.startswith("AIRFLOW_CTX_")]
    assert CONTEXT_ENV not in _clean_env(None)


def test_checkpoint_uri_is_checked_when_the_dag_is_parsed() -> None:
    from airflow_provider_torchelastic.operators import TorchElasticOperator

    def train() -> None:
        return None

    with pytest.raises(TypeError, match=r"checkpoint_uri: expected a path or fsspec URL .*, got 42"):
        TorchElasticOperator(task_id="t", python_callable=train, execution="local", checkpoint_uri=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"checkpoint_uri: expected a path or fsspec URL .*, got ''"):
        TorchElasticOperator(task_id="t", python_callable=train, execution="local", checkpoint_uri="")
    op = TorchElasticOperator(
        task_id="t", python_callable=train, execution="local", checkpoint_uri="s3://b/{{ run_id }}"
    )
    assert "checkpoint_uri" in op.template_fields


def test_checkpoint_root_gives_each_task_instance_its_location(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.operators import TorchElasticOperator

    def train() -> None:
        return None

    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", "s3://ckpt/root")
    op = TorchElasticOperator(task_id="t", python_callable=train, image="repo/train:1")
    manifests = op.render_manifests()
    env = {e["name"]: e.get("value") for e in manifests[1]["spec"]["containers"][0]["env"]}
    rendered = json.loads(env[CONTEXT_ENV])
    assert rendered["checkpoint_uri"] == "s3://ckpt/root/adhoc_airflow/manual__render/t/-1"
    own = TorchElasticOperator(task_id="u", python_callable=train, image="repo/train:1", checkpoint_uri="/mnt/c")
    env = {e["name"]: e.get("value") for e in own.render_manifests()[1]["spec"]["containers"][0]["env"]}
    assert json.loads(env[CONTEXT_ENV])["checkpoint_uri"] == "/mnt/c"


def test_the_images_storage_packages_are_the_storage_extra() -> None:
    import re
    import tomllib

    from tests.conftest import REPO_ROOT

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["storage"]
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r'^ARG STORAGE_PACKAGES="([^"]*)"', dockerfile, re.MULTILINE)
    assert match is not None, "docker/Dockerfile declares ARG STORAGE_PACKAGES"
    assert match.group(1).split() == extra


def test_a_checkpoint_uri_that_needs_the_run_is_named_in_the_render_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.operators import TorchElasticOperator

    def train() -> None:
        return None

    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", raising=False)
    op = TorchElasticOperator(
        task_id="t", python_callable=train, image="repo/train:1", checkpoint_uri="s3://b/{{ data_interval_start }}"
    )
    with pytest.warns(UserWarning, match=r"checkpoint_uri \(.*shown as the \[torch_elastic\] checkpoint_root"):
        manifests = op.render_manifests()
    env = {e["name"]: e.get("value") for e in manifests[1]["spec"]["containers"][0]["env"]}
    assert json.loads(env[CONTEXT_ENV])["checkpoint_uri"] is None


def test_path_pieces_are_injective_even_for_values_shaped_like_an_escaped_piece() -> None:
    # manual__...+00:00 is escaped; a run_id crafted to equal that escaped form must not land in the same folder.
    real = "manual__2026-01-01T00:00:00+00:00"
    crafted = safe_path_piece(real)
    assert safe_path_piece(crafted) != crafted, "a safe value shaped like an escaped piece is escaped too"
    assert safe_path_piece(crafted) != safe_path_piece(real)
    digits = safe_path_piece("::")  # nothing left after cleaning but the hash
    assert safe_path_piece(digits) != digits
    values = [real, crafted, digits, "a:b", "a+b", "a_b", "plain", "x-0123456789abcdef", ".", ".."]
    assert len({safe_path_piece(v) for v in values}) == len(values)
    assert safe_path_piece("x-0123456789abcdeg") == "x-0123456789abcdeg", "only the exact shape is escaped"

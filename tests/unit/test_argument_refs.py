"""Artifact references in a task's arguments (issue 34, item 1), written as the attack: whoever shapes the JSON that
reaches a training task's arguments (an upstream value, ``dag_run.conf``, another DAG's XCom, an asset event's
extra) must not make the workers fetch and unpickle what they choose.

The Airflow side pins the references it accepts (under the artifact storage or a root the task trusts; a pickled
module only when the task allows pickles) when it builds the payload; the workers load pinned references only, and
a dict that merely has a reference's shape reaches the function as the dict it is.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch

from airflow_provider_torchelastic import TorchElasticOperator
from airflow_provider_torchelastic.core.artifact_ref import ArtifactRef, PinnedRef, pin_argument_refs
from airflow_provider_torchelastic.core.payload import dump_payload, load_payload
from airflow_provider_torchelastic.core.run_context import TaskContext
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.operators.spill import dump_try_payload
from airflow_provider_torchelastic.runner import worker as runner_worker
from airflow_provider_torchelastic.settings import ArtifactStorage
from airflow_provider_torchelastic.worker.artifacts import fetch_arguments, save_value


class Planted:
    """What an attacker pickles: loading it creates a file (it could as well run a shell)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.marker,))


def planted_pickle(folder: Path, marker: Path) -> dict[str, Any]:
    """A well-formed reference, as JSON would carry it, to a pickled module whose loading touches ``marker``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.pt"
    torch.save(Planted(marker), path)
    data = path.read_bytes()
    ref = ArtifactRef(
        url=f"file://{path}",
        kind="pickled_module",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        class_path="torch.nn.Linear",
    )
    return json.loads(json.dumps(ref.to_json()))  # what json.loads of dag_run.conf or an XCom gives


def train(model: Any = None, **_: Any) -> Any:
    return model


def context(_: Path) -> TaskContext:
    return TaskContext(dag_id="d", task_id="t", run_id="r", map_index=-1, try_number=1, artifact_uri=None)


def payload_args(data: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
    payload = load_payload(data, fetch=fetch_arguments)
    return payload.args, dict(payload.kwargs)


# --- the attack ---------------------------------------------------------------------------------------------------


def test_a_reference_shaped_dict_outside_the_storage_is_refused_at_submit_naming_where_it_is(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = planted_pickle(tmp_path / "elsewhere", marker)
    storage = ArtifactStorage(url=f"file://{tmp_path}/store", conn_id=None)
    with pytest.raises(ConfigurationError, match=r"op_kwargs\['model'\]: .* not under an allowed root"):
        dump_try_payload(train, (), {"model": evil}, storage=storage, task_context=context(tmp_path))
    assert not marker.exists()


def test_a_pickled_module_under_the_storage_is_refused_unless_the_task_allows_pickles(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # Written where the storage is: another tenant's pod with the storage's credentials could do that.
    evil = planted_pickle(tmp_path / "store" / "other" / "artifacts", marker)
    storage = ArtifactStorage(url=f"file://{tmp_path}/store", conn_id=None)
    with pytest.raises(ConfigurationError, match=r"op_kwargs\['config'\]\['init'\]: .* is a pickled module"):
        dump_try_payload(train, (), {"config": {"init": evil}}, storage=storage, task_context=context(tmp_path))
    assert not marker.exists()
    data = dump_try_payload(
        train, (), {"model": evil}, storage=storage, task_context=context(tmp_path), allow_pickles=True
    )
    runner_worker._materialized(*payload_args(data))
    assert marker.exists(), "allowed and pinned: it loads (and runs), as the task asked"


def test_a_worker_leaves_an_unpinned_reference_shaped_dict_alone(tmp_path: Path) -> None:
    """The workers' side of the same attack: a payload whose arguments hold the JSON itself (not pinned: built
    without the operator's checks) gives the function the dict, and nothing is fetched or unpickled."""
    marker = tmp_path / "pwned"
    evil = planted_pickle(tmp_path / "store", marker)
    _, kwargs = runner_worker._materialized(*payload_args(dump_payload(train, (), {"model": evil})))
    assert kwargs["model"] == evil and not marker.exists()


# --- what keeps working -------------------------------------------------------------------------------------------


def test_a_reference_into_the_storage_or_a_trusted_root_is_pinned_and_loaded(tmp_path: Path) -> None:
    upstream = save_value({"w": torch.ones(3)}, f"file://{tmp_path}/store/dag/run/up/-1/1/artifacts")
    shared = save_value(torch.arange(4), f"file://{tmp_path}/models/base")
    storage = ArtifactStorage(url=f"file://{tmp_path}/store", conn_id=None)
    data = dump_try_payload(
        train,
        (shared,),
        {"model": upstream},
        storage=storage,
        task_context=context(tmp_path),
        trusted_roots=[f"file://{tmp_path}/models"],
    )
    (pinned,), kwargs = payload_args(data)
    assert isinstance(pinned, PinnedRef) and pinned.where == "op_args[0]" and not pinned.allow_pickle
    args, kwargs = runner_worker._materialized((pinned,), kwargs)
    assert torch.equal(args[0], torch.arange(4)) and torch.equal(kwargs["model"]["w"], torch.ones(3))


def test_the_pins_name_every_place_and_refuse_what_hides_too_deep(tmp_path: Path) -> None:
    ref = save_value(torch.ones(1), f"file://{tmp_path}/store/a")
    args, kwargs = pin_argument_refs(
        ([1, {"x": ref}],), {"k": (ref,)}, roots=[f"file://{tmp_path}/store"], allow_pickle=False
    )
    assert args[0][1]["x"].where == "op_args[0][1]['x']" and kwargs["k"][0].where == "op_kwargs['k'][0]"
    deep: Any = ref
    for _ in range(70):
        deep = [deep]
    with pytest.raises(ValueError, match=r"nested deeper than 64 levels"):
        pin_argument_refs((deep,), {}, roots=[f"file://{tmp_path}/store"], allow_pickle=False)


def test_without_artifact_storage_a_reference_needs_a_trusted_root(tmp_path: Path) -> None:
    ref = save_value(torch.ones(1), f"file://{tmp_path}/store/a")
    with pytest.raises(ConfigurationError, match=r"none: \[torch_elastic\] artifact_storage is unset"):
        dump_try_payload(train, (ref,), {}, storage=None, task_context=context(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"trusted_artifact_roots": "s3://models"}, TypeError, r"trusted_artifact_roots: expected a list of folder"),
        ({"trusted_artifact_roots": [" s3://models"]}, ValueError, r"trusted_artifact_roots: expected a list"),
        ({"trusted_artifact_roots": ["/"]}, ValueError, r"trusted_artifact_roots: expected a list"),
        ({"allow_pickled_artifacts": "yes"}, TypeError, r"allow_pickled_artifacts: expected True or False"),
    ],
)
def test_the_new_arguments_are_checked_when_the_dag_is_parsed(kwargs: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        TorchElasticOperator(task_id="t", python_callable=train, execution="local", **kwargs)

"""Models and tensors between tasks with local execution, through ``dag.test()`` (issue 23): a Module, a 100 MB state
dict, a numpy array and a 5 MB tensor argument round-trip through artifact storage, over file:// and an S3-compatible
server (moto); every XCom is plain JSON, and an artifact replaced in the store is refused by its sha256. One DAG run
per store covers all of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.artifact_ref import MARKER, iter_refs
from tests.dags.artifacts_e2e import BIG_ELEMENTS, BIG_TENSORS, SAMPLE_ELEMENTS
from tests.e2e.test_local_execution import run_dag
from tests.s3_server import S3Server, s3, s3_env  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """file://: through [torch_elastic] result_storage, which artifact storage defaults to; s3: its own options, with
    an aws connection to the server for the Airflow side."""
    if request.param == "file":
        root = f"file://{tmp_path / 'store'}"
        monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", root)
        return root
    server: S3Server = request.getfixturevalue("s3_env")
    root = server.url(tmp_path.name)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE", root)
    monkeypatch.setenv("AIRFLOW_CONN_ARTIFACTS_S3", server.connection_json())
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE_CONN_ID", "artifacts_s3")
    return root


def overwrite(url: str, data: bytes, request: pytest.FixtureRequest) -> None:
    if url.startswith("file://"):
        Path(url.removeprefix("file://")).write_bytes(data)
        return
    server: S3Server = request.getfixturevalue("s3")
    bucket, _, key = url.removeprefix("s3://").partition("/")
    server.client().put_object(Bucket=bucket, Key=key, Body=data)


def stored(root: str, request: pytest.FixtureRequest) -> list[str]:
    """Every object under ``root``, as paths relative to it."""
    if root.startswith("file://"):
        folder = Path(root.removeprefix("file://"))
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    server: S3Server = request.getfixturevalue("s3")
    prefix = root.removeprefix(f"s3://{server.bucket}/")
    return [key.removeprefix(prefix + "/") for key in server.keys(prefix)]


def test_a_model_a_state_dict_an_array_and_a_large_argument_round_trip(
    store: str, request: pytest.FixtureRequest
) -> None:
    result = run_dag("te_artifacts")
    assert result.state == "success", result
    init: dict[str, Any] = result.xcom("init_model")
    # Plain JSON with marked references; nothing pickled in any XCom.
    for (task_id, _, key), value in result.xcoms.items():
        assert json.loads(json.dumps(value)) == value, (task_id, key)
    assert {ref.kind for ref in iter_refs(init)} == {"module", "state_dict", "ndarray"}
    assert init["config"] == {"lr": 0.5, "steps": 2}
    big = init["big"]
    assert big[MARKER] == 1 and big["bytes"] > BIG_TENSORS * BIG_ELEMENTS * 4
    assert big["tensors"]["layer0.weight"] == {"dtype": "F32", "shape": [BIG_ELEMENTS]}
    assert all(ref.url.startswith(store) for ref in iter_refs(init))

    # The job summary (what the UI's tab shows) lists them: where each is in the value, its kind, size and URL.
    listed = {entry["path"]: entry for entry in result.xcom("init_model", key="torch_elastic_job")["artifacts"]}
    assert set(listed) == {path for path in init if isinstance(init[path], dict) and MARKER in init[path]}
    assert listed["big"] == {"path": "big", "kind": "state_dict", "url": big["url"], "bytes": big["bytes"]}

    summary = result.xcom("evaluate")
    assert summary["model_keys"] == ["fc.bias", "fc.weight"] and summary["model_equal"] is True
    assert summary["big_ok"] is True
    assert summary["array"] == [[float(4 * r + c) for c in range(4)] for r in range(3)]
    assert summary["config"] == {"lr": 0.5, "steps": 2}
    assert summary["sample_type"] == "Tensor"
    assert summary["sample_sum"] == float(SAMPLE_ELEMENTS * (SAMPLE_ELEMENTS - 1) // 2)
    trained = result.xcom("train")
    assert trained["model"]["kind"] == "module" and "module.fc.weight" not in trained["model"]["tensors"]
    assert summary["trained_bias"] == pytest.approx([1.0 + b for b in _initial_bias()])

    # The 5 MB tensor argument was over the payload's limit: spilled under train's try, as safetensors and a pickle.
    spilled = [name for name in stored(store, request) if "/train/-1/1/artifacts/arguments/" in name]
    assert [name.rsplit("/", 1)[1] for name in spilled] == ["0000-args.2.safetensors", "arguments.pkl"], spilled

    from airflow_provider_torchelastic import artifacts

    overwrite(init["array"]["url"], b"not the array", request)
    with pytest.raises(artifacts.ArtifactIntegrityError, match="sha256"):
        artifacts.load(init["array"])


def _initial_bias() -> list[float]:
    from tests.dags.artifacts_e2e import make_net

    return [float(b) for b in make_net().fc.bias.detach()]

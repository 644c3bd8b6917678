"""Models and tensors between tasks on the real node, through ``dag.test()`` (issue 23): the DAG of
test_local_artifacts.py as Kubernetes tasks (``k8s_artifacts``: ``init_model`` one Pod, ``train`` a PyTorchJob whose
rank 0 is on the master), in the runner image built with STORAGE=1. A Module, a 100 MB state dict, a numpy array and
a 5 MB tensor argument round-trip through artifact storage over file:// (a folder the pods mount by hostPath) and an
S3-compatible server (moto) on the node's address, whose credentials reach the pods through their env, never the
payload;
every XCom is plain JSON; an artifact replaced in the store is refused by its sha256. Only
``[torch_elastic] artifact_storage`` is set: ``init_model``'s references (a state dict of 300 tensors among them) are
larger than the termination message, and arrive through result storage, which defaults to artifact storage. One DAG
run per store covers all of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.artifact_ref import iter_refs
from airflow_provider_torchelastic.core.outcome import TERMINATION_MESSAGE_LIMIT
from airflow_provider_torchelastic.core.run_context import safe_path_piece
from tests.cluster.pytest_plugin import RealNodeCluster
from tests.dags.artifacts_e2e import BIG_ELEMENTS, BIG_TENSORS, SAMPLE_ELEMENTS, WIDE_TENSORS
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import run_dag
from tests.e2e.test_kubernetes_checkpoints import give_pods_the_s3_server
from tests.e2e.test_local_artifacts import overwrite, stored
from tests.s3_server import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them; s3 is the server on the node's address (and what
# stored() and overwrite() ask for), and the pods run the STORAGE=1 image (s3fs).
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, s3 = on_node.real_node_env, on_node.node_dag_env, on_node.s3
real_node_image = on_node.storage_image


@pytest.fixture(params=["file", "s3"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, real_node_cluster: RealNodeCluster, monkeypatch: pytest.MonkeyPatch
) -> str:
    """``[torch_elastic] artifact_storage`` alone (no result storage); s3: with an aws connection to the server for
    the Airflow side, and the server's endpoint and credentials in the pods' env (not in this process's: what the
    pods use cannot have come from the Airflow side)."""
    if request.param == "file":
        root = f"file://{real_node_cluster.shared_dir / tmp_path.name / 'store'}"
    else:
        server: S3Server = request.getfixturevalue("s3")
        give_pods_the_s3_server(server, monkeypatch)
        root = server.url(f"k8s-artifacts/{tmp_path.name}")
        monkeypatch.setenv("AIRFLOW_CONN_ARTIFACTS_S3", server.connection_json())
        monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE_CONN_ID", "artifacts_s3")
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", raising=False)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE", root)
    return root


def test_a_model_a_state_dict_an_array_and_a_large_argument_round_trip_on_kubernetes(
    store: str, request: pytest.FixtureRequest
) -> None:
    result = run_dag("k8s_artifacts")
    assert result.state == "success", result
    assert result.tasks == {(task, -1): ("success", 1) for task in ("init_model", "train", "evaluate")}
    # Plain JSON with marked references; nothing pickled in any XCom (manifests and job summaries included).
    for (task_id, _, key), value in result.xcoms.items():
        assert json.loads(json.dumps(value)) == value, (task_id, key)

    init: dict[str, Any] = result.xcom("init_model")
    assert {ref.kind for ref in iter_refs(init)} == {"module", "state_dict", "ndarray"}
    assert init["config"] == {"lr": 0.5, "steps": 2}
    assert init["big"]["bytes"] > BIG_TENSORS * BIG_ELEMENTS * 4
    assert len(init["wide"]["tensors"]) == WIDE_TENSORS
    # Too large for the termination message: it came through result storage, which only artifact_storage configured,
    # and result.json was deleted once read (the artifacts are kept).
    assert len(json.dumps(init)) > TERMINATION_MESSAGE_LIMIT
    names = stored(store, request)
    assert not [name for name in names if name.endswith("result.json")], names
    init_location = f"{store}/k8s_artifacts/{safe_path_piece(result.run_id)}/init_model/-1/1/artifacts/"
    assert all(ref.url.startswith(init_location) for ref in iter_refs(init))

    summary = result.xcom("evaluate")
    assert summary["model_keys"] == ["fc.bias", "fc.weight"] and summary["model_equal"] is True
    assert summary["big_ok"] is True and summary["wide_ok"] is True
    assert summary["array"] == [[float(4 * r + c) for c in range(4)] for r in range(3)]
    assert summary["config"] == {"lr": 0.5, "steps": 2}
    # Every rank loaded the spilled 5 MB tensor (DDP over two pods; rank 0 on the master returned the value).
    assert summary["sample_type"] == "Tensor"
    assert summary["sample_sum"] == float(SAMPLE_ELEMENTS * (SAMPLE_ELEMENTS - 1) // 2)
    trained = result.xcom("train")
    assert trained["rank"] == 0
    assert trained["model"]["kind"] == "module" and "module.fc.weight" not in trained["model"]["tensors"]
    assert summary["trained_bias"] == pytest.approx([1.0 + b for b in _initial_bias()])
    assert result.xcom("train", key="job_kind") == "PyTorchJob"
    assert sorted(result.xcom("train", key="manifests")[1]["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]

    # The 5 MB tensor argument was over the payload's limit: spilled under train's try, as safetensors and a pickle.
    spilled = [name for name in names if "/train/-1/1/artifacts/arguments/" in name]
    assert [name.rsplit("/", 1)[1] for name in spilled] == ["0000-args.2.safetensors", "arguments.pkl"], spilled

    if store.startswith("s3://"):
        assert_credentials_only_in_the_pods_env(result.xcom("init_model", key="manifests"))

    from airflow_provider_torchelastic import artifacts

    overwrite(init["array"]["url"], b"not the array", request)
    with pytest.raises(artifacts.ArtifactIntegrityError, match="sha256"):
        artifacts.load(init["array"])


def assert_credentials_only_in_the_pods_env(manifests: list[dict[str, Any]]) -> None:
    """The S3 secret is in the pod's env (masked in the manifests XCom: a sensitive name), not on its command line;
    the payload is the function and its arguments, which name no credentials."""
    container = manifests[1]["spec"]["containers"][0]
    assert {"name": "AWS_SECRET_ACCESS_KEY", "value": "***"} in container["env"]
    assert "testing" not in " ".join(container["command"])


def _initial_bias() -> list[float]:
    from tests.dags.artifacts_e2e import make_net

    return [float(b) for b in make_net().fc.bias.detach()]

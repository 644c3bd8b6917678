"""Artifacts (issue 23): the safetensors writer read back by the ``safetensors`` package, references that are plain
JSON and accepted only under the try's own location, loads that refuse bytes whose sha256 differs, and arguments
over the payload's limit spilled to the store and checked before they are unpickled."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pickle
import pickletools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy_file
from safetensors.torch import load_file

from airflow_provider_torchelastic import artifacts
from airflow_provider_torchelastic.core.artifact_ref import MARKER, ArtifactRef, ArtifactRefError, check_refs_under
from airflow_provider_torchelastic.core.encoding import value_to_json
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.payload import PayloadError, dump_payload, load_payload
from airflow_provider_torchelastic.core.run_context import TaskContext, artifact_location
from airflow_provider_torchelastic.operators import results
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.runner import worker as runner_worker
from airflow_provider_torchelastic.settings import ArtifactStorage
from airflow_provider_torchelastic.worker.artifacts import fetch_arguments, load, save_value, spill_arguments
from airflow_provider_torchelastic.worker.safetensors_io import read_safetensors_plain, write_safetensors

TRY_2 = TaskContext(dag_id="d", task_id="t", run_id="manual__1", try_number=2)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.tensor(7))


@dataclasses.dataclass
class Config:
    lr: float
    layers: list[int]


def every_dtype() -> dict[str, torch.Tensor]:
    base = torch.arange(-3, 9).reshape(3, 4)
    tensors = {str(dtype): base.to(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
    tensors |= {str(dtype): base.to(dtype) for dtype in (torch.int64, torch.int32, torch.int16, torch.int8)}
    tensors |= {"uint8": base.abs().to(torch.uint8), "bool": base > 2, "empty": torch.ones(0, 5), "scalar": base[1, 1]}
    tensors["strided"] = base.t()  # not contiguous: written row-major all the same
    return tensors


def test_the_writer_streams_a_file_that_safetensors_reads_back(tmp_path: Path) -> None:
    tensors = every_dtype()
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as handle:
        size, digest, infos = write_safetensors(handle, list(tensors.items()), metadata={"format": "pt"})
    data = path.read_bytes()
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0, "tensor data aligned, as safetensors writes it"
    back = load_file(path)
    assert list(back) == list(tensors) or set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
        assert list(infos[name].shape) == list(tensor.shape)
    # The fallback reader (a runner image without the safetensors package) reads the same tensors.
    plain = read_safetensors_plain(path, "pt")
    assert all(torch.equal(plain[name], tensor) for name, tensor in tensors.items())


def test_numpy_arrays_round_trip_big_endian_and_0_d_included(tmp_path: Path) -> None:
    arrays = {"f": np.arange(12, dtype=">f4").reshape(3, 4), "b": np.array([True, False]), "z": np.array(5, np.int16)}
    path = tmp_path / "a.safetensors"
    with open(path, "wb") as handle:
        write_safetensors(handle, list(arrays.items()))
    back = load_numpy_file(path)
    for name, array in arrays.items():
        assert back[name].shape == array.shape and np.array_equal(back[name], array), name
    assert np.array_equal(read_safetensors_plain(path, "np")["f"], arrays["f"])


def test_a_value_becomes_plain_json_references_and_loads_back(tmp_path: Path) -> None:
    net = Net()
    ddp_like = torch.nn.DataParallel(net)  # unwrapped: its keys have no "module." prefix
    value = {
        "model": ddp_like,
        "state": {"a": torch.randn(3, 2), "b": torch.zeros(4, dtype=torch.int64)},
        "array": np.linspace(0, 1, 7),
        "loss": torch.tensor(0.25),
        "metrics": {"acc": torch.tensor(0.5)},
        "scores": torch.tensor([0.25, 0.5]),
        "config": Config(lr=0.1, layers=[4, 3]),
        "tags": ["x", 1],
    }
    location = artifact_location(f"file://{tmp_path}", TRY_2)
    saved = save_value(value, location)
    text = value_to_json(saved)
    assert b"\x80" not in text.encode() and "pickle" not in text
    doc = json.loads(text)
    assert doc["config"] == {"lr": 0.1, "layers": [4, 3]} and doc["tags"] == ["x", 1]
    assert doc["loss"] == 0.25 and doc["metrics"] == {"acc": 0.5}, "0-d tensors stay numbers, as in JSON"
    model = ArtifactRef.from_json(doc["model"])
    assert model.kind == "module" and model.class_path == f"{Net.__module__}.Net"
    assert list(model.tensors) == list(net.state_dict()) == ["steps", "fc.weight", "fc.bias"]
    assert model.tensors["fc.weight"].dtype == "F32" and model.tensors["fc.weight"].shape == (3, 4)
    assert {ref.url for ref in check_refs_under(doc, location)} == {
        doc[key]["url"] for key in ("model", "state", "array", "scores")
    }

    loaded = artifacts.load(doc)
    assert torch.equal(loaded["model"]["fc.weight"], net.fc.weight.detach())
    assert torch.equal(loaded["state"]["b"], value["state"]["b"])
    assert isinstance(loaded["array"], np.ndarray) and np.array_equal(loaded["array"], value["array"])
    assert torch.equal(loaded["scores"], value["scores"]) and loaded["loss"] == 0.25
    fresh = Net()
    assert artifacts.load(doc["model"], into=fresh) is fresh
    assert torch.equal(fresh.fc.bias, net.fc.bias) and fresh.steps.item() == 7


def test_a_corrupted_artifact_is_refused_by_its_sha256(tmp_path: Path) -> None:
    saved = save_value({"w": torch.ones(8)}, f"file://{tmp_path}/artifacts")
    file = Path(saved["url"].removeprefix("file://"))
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(artifacts.ArtifactIntegrityError, match="sha256"):
        artifacts.load(saved)


def test_a_replaced_artifact_fetched_through_an_opener_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    saved = save_value(torch.ones(4), "memory://bucket/artifacts")
    assert saved["url"].startswith("memory://bucket/artifacts/")
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe(saved["url"].removeprefix("memory://"), b"x" * (saved["bytes"] * 100))
    with pytest.raises(artifacts.ArtifactIntegrityError, match="bytes"):
        load(saved)  # the workers' loader: fsspec, with the environment's credentials
    fs.rm("/bucket", recursive=True)


def test_a_pickled_module_loads_only_when_allowed(tmp_path: Path) -> None:
    saved = save_value({"m": artifacts.pickled(torch.nn.Linear(2, 2))}, f"file://{tmp_path}/artifacts")
    assert saved["m"]["kind"] == "pickled_module" and saved["m"]["class"] == "torch.nn.modules.linear.Linear"
    with pytest.raises(PermissionError, match="allow_pickle"):
        artifacts.load(saved)
    assert isinstance(artifacts.load(saved, allow_pickle=True)["m"], torch.nn.Linear)


def storage(root: Path) -> ArtifactStorage:
    return ArtifactStorage(url=f"file://{root}", conn_id=None)


@pytest.mark.parametrize(
    "url",
    [
        "{other_try}/0000-w.safetensors",
        "{here}/../../1/artifacts/0000-w.safetensors",
        "{here}/",
        "{here}x/0000-w.safetensors",
        "file:///etc/passwd",
    ],
)
def test_a_reference_outside_this_try_is_refused(tmp_path: Path, url: str) -> None:
    here = artifact_location(f"file://{tmp_path}", TRY_2)
    other_try = artifact_location(f"file://{tmp_path}", dataclasses.replace(TRY_2, try_number=1))
    ref = save_value(torch.ones(2), here)
    forged = {**ref, "url": url.format(here=here, other_try=other_try)}
    verdict = Verdict(succeeded=True, result={"model": [forged]})
    with pytest.raises(ConfigurationError, match="not under this try's artifact location"):
        results.result_or_raise(
            logging.getLogger(__name__), verdict, None, task_context=TRY_2, artifacts=storage(tmp_path)
        )


def test_references_need_this_try_to_have_an_artifact_location(tmp_path: Path) -> None:
    ref = save_value(torch.ones(2), f"file://{tmp_path}/artifacts")
    with pytest.raises(ConfigurationError, match="no artifact location"):
        results.result_or_raise(
            logging.getLogger(__name__), Verdict(succeeded=True, result=ref), None, task_context=TRY_2
        )


def test_this_trys_references_are_accepted(tmp_path: Path) -> None:
    ref = save_value(torch.ones(2), artifact_location(f"file://{tmp_path}", TRY_2))
    value = results.result_or_raise(
        logging.getLogger(__name__),
        Verdict(succeeded=True, result={"w": ref}),
        None,
        task_context=TRY_2,
        artifacts=storage(tmp_path),
    )
    assert value == {"w": ref}


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("sha256", "abc", "64 lowercase hex"),
        ("kind", "pickle", "expected one of"),
        ("bytes", -1, "int >= 0"),
        ("tensors", {"w": {"dtype": "F33", "shape": [1]}}, "safetensors dtype"),
        (MARKER, 2, "expected 1"),
    ],
)
def test_a_malformed_reference_names_its_field(tmp_path: Path, field: str, value: Any, expected: str) -> None:
    ref = save_value(torch.ones(2), f"file://{tmp_path}/a")
    with pytest.raises(ArtifactRefError, match=expected):
        ArtifactRef.from_json({**ref, field: value})


def test_the_worker_names_what_it_does_not_import_as_the_package_does() -> None:
    # The spawned worker keeps its own copies so that it imports none of these modules; a rename or a changed bound
    # on the other side would otherwise pass unnoticed (the worker finds a module in sys.modules by this name).
    from airflow_provider_torchelastic import errors
    from airflow_provider_torchelastic.core import artifact_ref, outcome, run_context
    from airflow_provider_torchelastic.worker import metrics

    assert runner_worker._CONTEXT_ENV == run_context.CONTEXT_ENV
    assert artifact_ref.__name__ == runner_worker._PINNED_MODULE and artifact_ref.PinnedRef.__name__ == "PinnedRef"
    assert runner_worker._MAX_BASES == outcome.MAX_BASES
    assert errors.__name__ == runner_worker._ERRORS_MODULE and callable(errors.RecoverableError)
    assert metrics.__name__ == runner_worker._METRICS_MODULE and callable(metrics.flush)


def test_no_pickle_opcode_in_a_reference() -> None:
    ref = ArtifactRef(url="s3://b/a/0000-w.safetensors", kind="tensor", bytes=1, sha256="0" * 64)
    text = json.dumps(ref.to_json())
    with pytest.raises(ValueError):
        list(pickletools.genops(text.encode()))


# --- arguments over the payload's limit (item 3) ----------------------------------------------------------------


def train_with(sample: Any, *, blob: bytes, config: Config) -> float:
    return float(sample.sum()) + len(blob) + config.lr


def spilled_payload(tmp_path: Path, max_bytes: int = 100_000) -> bytes:
    sample = torch.arange(300_000, dtype=torch.float64)
    spill = spill_arguments(f"file://{tmp_path}/arguments")
    kwargs = {"blob": b"x" * 200_000, "config": Config(lr=0.5, layers=[2])}
    return dump_payload(train_with, (sample,), kwargs, max_bytes=max_bytes, spill=spill)


def test_arguments_over_the_limit_spill_and_reach_the_function_whole(tmp_path: Path) -> None:
    data = spilled_payload(tmp_path)
    assert len(data) < 100_000
    files = sorted(p.name for p in (tmp_path / "arguments").iterdir())
    assert files == ["0000-args.0.safetensors", "arguments.pkl"], "the tensor as safetensors, the rest pickled"
    payload = load_payload(data, fetch=fetch_arguments)
    (sample_ref,) = payload.args
    assert sample_ref.ref["kind"] == "tensor" and isinstance(payload.kwargs["config"], Config)
    args, kwargs = runner_worker._materialized(payload.args, payload.kwargs)
    assert payload.fn(*args, **kwargs) == float(sum(range(300_000))) + 200_000 + 0.5


def test_a_payload_under_the_limit_spills_nothing(tmp_path: Path) -> None:
    data = spilled_payload(tmp_path, max_bytes=10_000_000)
    assert not (tmp_path / "arguments").exists()
    assert load_payload(data).kwargs["blob"] == b"x" * 200_000


def test_replaced_spilled_arguments_are_refused_before_they_are_unpickled(tmp_path: Path) -> None:
    data = spilled_payload(tmp_path)

    class Boom:
        def __reduce__(self) -> Any:
            return (exec, ("raise SystemExit('unpickled!')",))

    (tmp_path / "arguments" / "arguments.pkl").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(PayloadError, match="sha256"):
        load_payload(data, fetch=fetch_arguments)


def test_parts_are_small_but_a_file_fits_in_s3s_ten_thousand() -> None:
    from airflow_provider_torchelastic.worker.artifacts import MIN_PART_BYTES, part_bytes

    assert part_bytes(0) == part_bytes(1 << 30) == MIN_PART_BYTES
    huge = 200 << 30
    assert huge / part_bytes(huge) < 10_000 and part_bytes(huge) % (1 << 20) == 0


def test_a_remote_artifact_is_read_in_one_request_and_checked(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    saved = save_value({"w": torch.arange(6.0).reshape(2, 3), "a": np.arange(4)}, "memory://remote/artifacts")
    loaded = load(saved)
    assert torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3)) and np.array_equal(loaded["a"], np.arange(4))
    data = bytearray(fs.cat_file(saved["w"]["url"].removeprefix("memory://")))
    assert read_safetensors_plain(bytes(data), "pt")["value"].shape == (2, 3)
    data[-1] ^= 1  # same size, other bytes
    fs.pipe_file(saved["w"]["url"].removeprefix("memory://"), bytes(data))
    with pytest.raises(artifacts.ArtifactIntegrityError, match="sha256"):
        load(saved["w"])
    fs.rm("/remote", recursive=True)


def test_a_hostile_header_is_refused_before_it_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megabytes of header entries cost seconds of CPU to parse, before the digest could refuse them: a header longer
    than the reference's tensors can need is refused unread (issue 34, item 6)."""
    import struct

    from airflow_provider_torchelastic.worker import safetensors_io
    from airflow_provider_torchelastic.worker.artifact_streams import ArtifactIntegrityError

    ref = save_value(torch.ones(4), f"file://{tmp_path}/a")
    path = Path(ArtifactRef.from_json(ref).url[len("file://") :])
    entries = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(60_000)}
    header = json.dumps(entries, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)

    def parsed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the hostile header was parsed")

    monkeypatch.setattr(safetensors_io.json, "loads", parsed)
    with pytest.raises(ArtifactIntegrityError, match=r"more than the \d+ its reference's tensors need"):
        load({**ref, "bytes": path.stat().st_size})

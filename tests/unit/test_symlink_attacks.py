"""Local stores never follow a symbolic link below their root (issue 34, item 2).

Results, artifacts and spilled arguments may live on a shared file system (a path or a ``file://`` URL) that the
pods of other tries, and of other tenants, can write. Each test plants what such a pod could, and checks that the
Airflow side or the loader refuses it, naming the path, and leaves the link's target alone; the last ones check that
regular files under the root are read and written as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from airflow_provider_torchelastic.core import safe_files
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.payload import load_payload
from airflow_provider_torchelastic.core.run_context import TaskContext, artifact_location, result_location
from airflow_provider_torchelastic.operators import results
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.operators.spill import dump_try_payload
from airflow_provider_torchelastic.settings import ArtifactStorage, ResultStorage
from airflow_provider_torchelastic.worker import artifact_streams
from airflow_provider_torchelastic.worker.artifacts import (
    ArtifactIntegrityError,
    fetch_arguments,
    load,
    pickled,
    save_value,
)

LOG = logging.getLogger(__name__)
TRY_2 = TaskContext(dag_id="d", task_id="t", run_id="manual__1", try_number=2)
#: Arguments whose payload is over the Secret's limit, so that they spill; bytes only: one pickle, no safetensors.
LARGE = b"x" * (2 << 20)
#: What a swapped-in pickle did when it ran.
RAN: list[str] = []


def train(blob: bytes) -> int:
    return len(blob)


def _ran_swapped_pickle() -> str:
    RAN.append("swapped")
    return "swapped"


class Swapped:
    """Unpickled, it runs :func:`_ran_swapped_pickle`: the stand-in for a pickle that runs an attacker's code."""

    def __reduce__(self) -> Any:
        return (_ran_swapped_pickle, ())


def as_store_url(root: Path, scheme: str) -> str:
    return f"{scheme}{root}"


def stored_result(root: Path, scheme: str, value: Any = None) -> tuple[ResultStorage, Path]:
    """Result storage at ``root`` (a plain path or ``file://``), and where try 2's result file belongs in it."""
    store = ResultStorage(url=as_store_url(root, scheme), conn_id=None, keep=False)
    file = Path(str(safe_files.local_path(result_location(store.url, TRY_2))))
    file.parent.mkdir(parents=True, exist_ok=True)
    if value is not None:
        file.write_text(json.dumps(value))
    return store, file


def read_result(store: ResultStorage) -> Any:
    verdict = Verdict(succeeded=True, result_ref=result_location(store.url, TRY_2))
    return results.result_or_raise(LOG, verdict, store, task_context=TRY_2)


def spill_to(root: Path, scheme: str = "") -> tuple[ArtifactStorage, TaskContext, Path]:
    """Artifact storage at ``root``, try 2's context with its artifact location, and its spilled arguments' folder."""
    storage = ArtifactStorage(url=as_store_url(root, scheme), conn_id=None)
    context = TaskContext(
        dag_id="d", task_id="t", run_id="manual__1", try_number=2, artifact_uri=artifact_location(storage.url, TRY_2)
    )
    folder = Path(str(safe_files.local_path(f"{context.artifact_uri}/arguments")))
    return storage, context, folder


def saved_module(tmp_path: Path) -> tuple[dict[str, Any], Path, torch.nn.Module]:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    saved = save_value(pickled(module), f"file://{tmp_path}/store/artifacts")
    return saved, Path(saved["url"].removeprefix("file://")), module


# --- (a) a result.json planted as a link ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_result_file_planted_as_a_link_is_refused_naming_it(tmp_path: Path, scheme: str) -> None:
    secret = tmp_path / "only-the-airflow-worker-reads-this.json"
    secret.write_text('{"password": "hunter2"}')
    store, file = stored_result(tmp_path / "results", scheme)
    file.symlink_to(secret)
    with pytest.raises(ConfigurationError, match="is a symbolic link") as caught:
        read_result(store)
    assert str(file) in str(caught.value) and "hunter2" not in str(caught.value)
    assert secret.read_text() == '{"password": "hunter2"}'


def test_a_try_folder_planted_as_a_link_is_refused_naming_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "result.json").write_text('{"password": "hunter2"}')
    store, file = stored_result(tmp_path / "results", "")
    file.parent.rmdir()
    file.parent.symlink_to(elsewhere)  # .../{try}/ -> elsewhere: result.json itself is a regular file
    with pytest.raises(ConfigurationError, match="is a symbolic link") as caught:
        read_result(store)
    assert str(file.parent) in str(caught.value)
    assert (elsewhere / "result.json").exists()


@pytest.mark.timeout(20)
def test_a_result_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    store, file = stored_result(tmp_path / "results", "")
    os.mkfifo(file)
    with pytest.raises(ConfigurationError, match="is not a regular file") as caught:
        read_result(store)
    assert str(file) in str(caught.value) and "FIFO" in str(caught.value)


# --- (b) the spilled arguments' folder or file planted as a link ---------------------------------------------------


@pytest.mark.parametrize("planted", ["folder", "file"])
def test_spilled_arguments_never_write_through_a_planted_link(tmp_path: Path, planted: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "arguments.pkl").write_bytes(b"precious")
    storage, context, folder = spill_to(tmp_path / "store")
    if planted == "folder":  # try 1's pod: .../2/artifacts/arguments -> victim
        folder.parent.mkdir(parents=True)
        folder.symlink_to(victim)
        where = folder
    else:  # .../2/artifacts/arguments/arguments.pkl -> victim/arguments.pkl
        folder.mkdir(parents=True)
        (folder / "arguments.pkl").symlink_to(victim / "arguments.pkl")
        where = folder / "arguments.pkl"
    with pytest.raises(ConfigurationError, match="is a symbolic link") as caught:
        dump_try_payload(train, (LARGE,), {}, storage=storage, task_context=context)
    assert str(where) in str(caught.value)
    assert [path.name for path in victim.iterdir()] == ["arguments.pkl"]
    assert (victim / "arguments.pkl").read_bytes() == b"precious"


@pytest.mark.timeout(20)
def test_spilled_arguments_are_not_written_over_a_fifo(tmp_path: Path) -> None:
    storage, context, folder = spill_to(tmp_path / "store")
    folder.mkdir(parents=True)
    os.mkfifo(folder / "arguments.pkl")
    with pytest.raises(ConfigurationError, match="is not a regular file"):
        dump_try_payload(train, (LARGE,), {}, storage=storage, task_context=context)
    assert sorted(path.name for path in folder.iterdir()) == ["arguments.pkl"], "no temporary file left behind"


# --- (c) a pickled module swapped between its hash and its load ----------------------------------------------------


def test_a_pickled_module_swapped_after_it_was_hashed_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, file, module = saved_module(tmp_path)
    swapped = tmp_path / "swapped.pt"
    torch.save(Swapped(), swapped)
    real_sha256 = hashlib.sha256

    class SwapWhenDigested:
        """sha256 that, once the loader has its digest, swaps the file for another pickle (a pod racing it)."""

        def __init__(self, data: bytes = b"") -> None:
            self.inner = real_sha256(data)

        def update(self, data: bytes) -> None:
            self.inner.update(data)

        def hexdigest(self) -> str:
            if swapped.exists():
                os.replace(swapped, file)
            return self.inner.hexdigest()

    RAN.clear()
    monkeypatch.setattr(hashlib, "sha256", SwapWhenDigested)
    loaded = load(saved, allow_pickle=True)
    assert not swapped.exists(), "the file was swapped while it was loaded"
    assert RAN == [], "the swapped pickle ran"
    assert isinstance(loaded, torch.nn.Linear) and torch.equal(loaded.weight, module.weight)


# --- (d) an artifact linked to /dev/zero, or a FIFO ----------------------------------------------------------------


@pytest.mark.timeout(20)
def test_a_pickled_module_linked_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    saved, file, _ = saved_module(tmp_path)
    file.unlink()
    file.symlink_to("/dev/zero")
    started = time.monotonic()
    with pytest.raises(ArtifactIntegrityError, match="is a symbolic link") as caught:
        load(saved, allow_pickle=True)
    assert str(file) in str(caught.value) and time.monotonic() - started < 5


@pytest.mark.timeout(20)
def test_the_digest_of_a_link_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    link = tmp_path / "model.pt"
    link.symlink_to("/dev/zero")
    with pytest.raises(ArtifactIntegrityError, match="is a symbolic link"):
        artifact_streams.file_digest(link)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["pickled module", "tensor"])
def test_an_artifact_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, kind: str) -> None:
    if kind == "tensor":
        saved = save_value(torch.ones(4), f"file://{tmp_path}/store/artifacts")
        file = Path(saved["url"].removeprefix("file://"))
    else:
        saved, file, _ = saved_module(tmp_path)
    file.unlink()
    os.mkfifo(file)
    with pytest.raises(ArtifactIntegrityError, match="is not a regular file") as caught:
        load(saved, allow_pickle=True)
    assert str(file) in str(caught.value)


@pytest.mark.timeout(20)
def test_spilled_arguments_linked_to_dev_zero_are_refused_at_once(tmp_path: Path) -> None:
    file = tmp_path / "arguments.pkl"
    file.symlink_to("/dev/zero")
    ref = {"url": f"file://{file}", "bytes": 10, "sha256": "0" * 64}
    with pytest.raises(ArtifactIntegrityError, match="is a symbolic link"):
        fetch_arguments(ref)


# --- the helpers themselves ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("outside", ["../elsewhere/result.json", "/etc/hostname"])
def test_a_path_outside_the_root_is_refused(tmp_path: Path, outside: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    path = outside if outside.startswith("/") else f"{root}/{outside}"
    with pytest.raises(ValueError, match="resolves outside the store's root"):
        safe_files.read_regular(path, root=root, limit=10, error=ValueError)
    with pytest.raises(ValueError, match="resolves outside the store's root"):
        safe_files.open_replacing(path, root=root, error=ValueError)


def test_a_file_larger_than_allowed_is_refused_before_it_is_read(tmp_path: Path) -> None:
    file = tmp_path / "big.pt"
    file.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="100 bytes, more than the 10 allowed"):
        safe_files.open_regular(file, max_bytes=10, error=ValueError)


def test_a_write_that_fails_leaves_neither_the_file_nor_a_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b.bin"
    with pytest.raises(RuntimeError), safe_files.open_replacing(target, root=tmp_path, error=ValueError) as handle:
        handle.write(b"half")
        raise RuntimeError("the writer failed")
    assert list((tmp_path / "a").iterdir()) == []


# --- the normal path ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_regular_result_file_is_read_and_deleted(tmp_path: Path, scheme: str) -> None:
    store, file = stored_result(tmp_path / "results", scheme, {"loss": 0.5})
    assert read_result(store) == {"loss": 0.5}
    assert not file.exists()


def test_a_store_root_that_is_itself_a_link_is_followed(tmp_path: Path) -> None:
    # The root is the platform's configuration ([torch_elastic] result_storage), not something a pod planted.
    (tmp_path / "real").mkdir()
    (tmp_path / "results").symlink_to(tmp_path / "real")
    store, _ = stored_result(tmp_path / "results", "", {"loss": 0.5})
    assert read_result(store) == {"loss": 0.5}


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_regular_spilled_arguments_are_written_and_read_back(tmp_path: Path, scheme: str) -> None:
    storage, context, folder = spill_to(tmp_path / "store", scheme)
    folder.mkdir(parents=True)
    (folder / "arguments.pkl").write_bytes(b"an earlier, regular file: replaced")
    payload = load_payload(
        dump_try_payload(train, (LARGE,), {}, storage=storage, task_context=context), fetch=fetch_arguments
    )
    assert payload.fn(*payload.args, **payload.kwargs) == len(LARGE)
    assert sorted(path.name for path in folder.iterdir()) == ["arguments.pkl"], "no temporary file left behind"


def test_regular_artifacts_load_as_before(tmp_path: Path) -> None:
    saved, file, module = saved_module(tmp_path)
    loaded = load(saved, allow_pickle=True)
    assert torch.equal(loaded.weight, module.weight)
    tensor = save_value(torch.arange(6.0), f"file://{tmp_path}/store/artifacts")
    assert torch.equal(load(tensor), torch.arange(6.0))
    assert artifact_streams.file_digest(file) == (saved["bytes"], saved["sha256"])

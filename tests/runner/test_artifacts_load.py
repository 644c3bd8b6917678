"""Loading artifacts (issue 23): from an S3-compatible server with one streamed GET, straight into the tensors, the
sha256 checked while the bytes arrive; bytes that are not the reference's are refused and nothing read from them is
returned, whether they differ in a tensor, in the header, or in length."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from airflow_provider_torchelastic import artifacts
from airflow_provider_torchelastic.worker import artifact_streams
from airflow_provider_torchelastic.worker.artifacts import load, save_value
from airflow_provider_torchelastic.worker.safetensors_io import CHUNK_BYTES, read_safetensors_plain
from tests.s3_server import S3Server, s3, s3_env  # noqa: F401


@pytest.fixture
def server(request: pytest.FixtureRequest) -> S3Server:
    """The S3-compatible server, its credentials and endpoint in this process's environment."""
    found: S3Server = request.getfixturevalue("s3_env")
    return found


class CountingFs:
    """A file system that counts how it is read, passing everything to the real one."""

    def __init__(self, fs: Any) -> None:
        self.fs, self.calls = fs, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        if name in ("open", "open_async", "cat_file", "get_file"):
            self.calls.append(name)
        return getattr(self.fs, name)


def state_dict() -> dict[str, torch.Tensor]:
    # Larger than a chunk, so that it is read and hashed in several, and small, odd-sized ones.
    return {
        "big": torch.arange(CHUNK_BYTES // 4 + 1001, dtype=torch.float32),
        "half": torch.linspace(-1, 1, 77).to(torch.bfloat16).reshape(7, 11),
        "steps": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.ones(0, 3),
    }


def counting_locator(seen: list[CountingFs]) -> artifact_streams.Locator:
    def locate(url: str) -> tuple[Any, str]:
        fs, path = artifact_streams.default_locator(url)
        seen.append(CountingFs(fs))
        return seen[-1], path

    return locate


def test_an_s3_artifact_is_streamed_with_one_request_into_equal_tensors(server: S3Server) -> None:
    value = state_dict()
    ref = save_value(value, server.url("load/one"))
    seen: list[CountingFs] = []
    loaded = load(ref, locate=counting_locator(seen))
    assert list(loaded) == list(value)
    for name, tensor in value.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert [fs.calls for fs in seen] == [["open_async"]]  # one GET, not a ranged read per chunk


def test_an_s3_array_loads_without_torch_tensors(server: S3Server) -> None:
    array = np.arange(12, dtype=">i4").reshape(3, 4)  # big-endian: written little-endian
    ref = save_value(array, server.url("load/array"))
    loaded = load(ref)
    assert isinstance(loaded, np.ndarray) and loaded.dtype == np.int32 and np.array_equal(loaded, array)


def replace_object(server: S3Server, ref: dict[str, Any], data: bytes) -> None:
    key = ref["url"].removeprefix(f"s3://{server.bucket}/")
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data)


def fetch(server: S3Server, ref: dict[str, Any]) -> bytearray:
    key = ref["url"].removeprefix(f"s3://{server.bucket}/")
    return bytearray(server.client().get_object(Bucket=server.bucket, Key=key)["Body"].read())


def test_an_s3_object_changed_in_its_last_byte_is_refused(server: S3Server) -> None:
    ref = save_value(state_dict(), server.url("load/last-byte"))
    data = fetch(server, ref)
    data[-1] ^= 1  # "empty" has no bytes: this is the last of "mask"
    replace_object(server, ref, bytes(data))
    with pytest.raises(artifacts.ArtifactIntegrityError, match="sha256"):
        load(ref)


def with_header(data: bytes, change: Any) -> bytes:
    """``data`` with its header changed by ``change`` and padded back to its length: same size, same tensor bytes."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    return data[:8] + text + b" " * (length - len(text)) + data[8 + length :]


def swap_offsets(header: dict[str, Any]) -> None:
    header["big"]["data_offsets"], header["half"]["data_offsets"] = (
        header["half"]["data_offsets"],
        header["big"]["data_offsets"],
    )


def reshape(header: dict[str, Any]) -> None:
    header["half"]["shape"] = [11, 7]


def overlap(header: dict[str, Any]) -> None:
    header["half"]["data_offsets"][0] -= 2


@pytest.mark.parametrize("change", [swap_offsets, reshape, overlap], ids=["swapped", "reshaped", "overlapping"])
def test_a_changed_header_is_refused(tmp_path: Path, change: Any) -> None:
    ref = save_value(state_dict(), f"file://{tmp_path}/artifacts")
    file = Path(ref["url"].removeprefix("file://"))
    file.write_bytes(with_header(file.read_bytes(), change))
    with pytest.raises(artifacts.ArtifactIntegrityError):
        load(ref)


def test_a_reference_that_names_the_changed_bytes_still_needs_a_consistent_header(tmp_path: Path) -> None:
    # The sha256 matches (the reference was rewritten too), but the header names other shapes than the reference:
    # refused before a tensor is made of the bytes.
    ref = save_value(state_dict(), f"file://{tmp_path}/artifacts")
    file = Path(ref["url"].removeprefix("file://"))
    data = with_header(file.read_bytes(), reshape)
    file.write_bytes(data)
    forged = {**ref, "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(artifacts.ArtifactIntegrityError, match="other tensors than the reference"):
        load(forged)


def test_a_header_longer_than_the_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    ref = save_value(torch.ones(4), f"file://{tmp_path}/artifacts")
    file = Path(ref["url"].removeprefix("file://"))
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(artifacts.ArtifactIntegrityError, match="header of 1099511627776 bytes"):
        load(ref)


def test_a_stream_that_ends_early_is_refused(tmp_path: Path) -> None:
    ref = save_value(state_dict(), "memory://short/artifacts")
    import fsspec

    fs = fsspec.filesystem("memory")
    path = ref["url"].removeprefix("memory://")
    data = fs.cat_file(path)

    class Short:
        """Says the file has its size, then gives less."""

        def __getattr__(self, name: str) -> Any:
            return getattr(fs, name)

        def size(self, _: str) -> int:
            return len(data)

        def open(self, *args: Any, **kwargs: Any) -> Any:
            fs.pipe_file(path, data[: len(data) // 2])
            return fs.open(*args, **kwargs)

    with pytest.raises(artifacts.ArtifactIntegrityError, match="ended after"):
        load(ref, locate=lambda url: (Short(), path))
    fs.rm("/short", recursive=True)


def test_the_plain_reader_reads_what_the_writer_wrote(tmp_path: Path) -> None:
    value = state_dict()
    ref = save_value(value, f"file://{tmp_path}/artifacts")
    path = Path(ref["url"].removeprefix("file://"))
    for source in (path, path.read_bytes()):
        found = read_safetensors_plain(source, "pt")
        assert all(torch.equal(found[name], tensor) for name, tensor in value.items())

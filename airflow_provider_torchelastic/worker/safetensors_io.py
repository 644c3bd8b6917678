"""The safetensors format, written here and streamed: an 8-byte little-endian header length, the JSON header (dtype,
shape and byte offsets per tensor, padded to 8 bytes), then each tensor's bytes.

``safetensors.torch.save_file`` would first copy every tensor into one bytes object and can only write a local path;
:func:`write_safetensors` writes to any file object (a local file, an fsspec file on an object store), reading each
tensor's bytes in place from its memory (a tensor on a GPU is copied to the CPU one at a time). Reading uses the
``safetensors`` package where it is installed, else :func:`read_safetensors_plain` (a runner image with torch only).
Standard library; torch and numpy are recognised through ``sys.modules`` and imported only to read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from airflow_provider_torchelastic.core.artifact_ref import TensorInfo

__all__ = [
    "CHUNK_BYTES",
    "NUMPY_DTYPES",
    "HashingWriter",
    "data_bytes",
    "read_safetensors",
    "read_safetensors_plain",
    "write_safetensors",
]

#: Bytes written per call: a slice of a tensor's memory (no copy), so that a store's write buffer stays small (the
#: size of an object store's write block, ``artifacts.MIN_PART_BYTES``).
CHUNK_BYTES: Final = 8 << 20

#: The header's length is padded to a multiple of this, as safetensors' own writer does (aligned tensor data).
_ALIGN: Final = 8
_TORCH_DTYPES: Final = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
NUMPY_DTYPES: Final = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}


class HashingWriter:
    """Writes to ``handle`` and hashes what it writes. A large chunk is hashed on a thread of its own while it is
    written (hashlib releases the GIL), so that the sha256 costs little more than the slower of the two."""

    #: Smaller chunks are hashed inline: a thread's round trip would cost more than it saves.
    THREADED_BYTES: Final = 1 << 20

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle, self.sha256, self.count = handle, hashlib.sha256(), 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def write(self, data: bytes | memoryview) -> None:
        if len(data) < self.THREADED_BYTES:
            self.sha256.update(data)
            self.handle.write(data)
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")
            hashed = self._pool.submit(self.sha256.update, data)
            try:
                self.handle.write(data)
            finally:
                hashed.result()
        self.count += len(data)

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: Gives the bytes when they are to be written (a tensor on a GPU is copied to the CPU only then), and an object
    #: that keeps their memory alive while they are.
    buffer: Callable[[], tuple[memoryview, Any]]


def _entry(name: str, value: Any) -> _Entry:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor_entry(name, value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return _array_entry(name, value, numpy)
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def _tensor_entry(name: str, tensor: Any) -> _Entry:
    dtype = _TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
    if dtype is None:
        raise TypeError(
            f"{name}: a tensor of dtype {tensor.dtype} has no safetensors form (supported: "
            f"{', '.join(sorted(_TORCH_DTYPES))}); convert it first"
        )
    import torch

    if tensor.layout is not torch.strided:
        raise TypeError(f"{name}: a {tensor.layout} tensor cannot be saved; convert it with .to_dense() first")

    def buffer() -> tuple[memoryview, Any]:
        # detach: no autograd history; cpu(): a GPU tensor's bytes live on the device; contiguous(): row-major bytes.
        # For a contiguous CPU tensor all three are the tensor itself: its memory is read in place.
        plain = tensor.detach().cpu().contiguous()
        return _memory_of(plain.data_ptr(), plain.numel() * plain.element_size()), plain

    return _Entry(name, dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size(), buffer)


def _array_entry(name: str, array: Any, numpy: Any) -> _Entry:
    dtype = NUMPY_DTYPES.get(array.dtype.name)
    if dtype is None:
        raise TypeError(f"{name}: an array of dtype {array.dtype} has no safetensors form; convert it first")

    def buffer() -> tuple[memoryview, Any]:
        plain = numpy.ascontiguousarray(array)
        if plain.dtype.byteorder == ">":  # safetensors is little-endian
            plain = plain.astype(plain.dtype.newbyteorder("<"))
        return memoryview(plain.reshape(-1).view(numpy.uint8)), plain

    return _Entry(name, dtype, tuple(int(n) for n in array.shape), int(array.nbytes), buffer)


def _memory_of(address: int, nbytes: int) -> memoryview:
    """The bytes at ``address`` as a memoryview, without copying them (the caller keeps their owner alive)."""
    if nbytes == 0:
        return memoryview(b"")
    import ctypes

    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def data_bytes(tensors: Sequence[tuple[str, Any]]) -> int:
    """How many bytes of tensor data a file of ``tensors`` holds (its size, but for the header)."""
    return sum(_entry(name, value).nbytes for name, value in tensors)


def write_safetensors(
    handle: IO[bytes], tensors: Sequence[tuple[str, Any]], *, metadata: Mapping[str, str] | None = None
) -> tuple[int, str, dict[str, TensorInfo]]:
    """Write ``tensors`` (name, tensor or array) to ``handle`` in the safetensors format; returns the bytes written,
    their sha256 and each tensor's dtype and shape. Memory: one chunk of one tensor at a time, beyond the tensors."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise RuntimeError("writing safetensors needs a little-endian machine")
    entries = [_entry(name, value) for name, value in tensors]
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        if entry.name == "__metadata__" or entry.name in header:
            raise ValueError(f"tensor name {entry.name!r}: reserved or repeated in one safetensors file")
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    out = HashingWriter(handle)
    try:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for entry in entries:
            view, owner = entry.buffer()
            if len(view) != entry.nbytes:
                raise RuntimeError(f"{entry.name}: {len(view)} bytes, expected {entry.nbytes} (changed while saved?)")
            for start in range(0, len(view), CHUNK_BYTES):
                out.write(view[start : start + CHUNK_BYTES])
            del view, owner
    finally:
        out.close()
    infos = {entry.name: TensorInfo(dtype=entry.dtype, shape=entry.shape) for entry in entries}
    return out.count, out.sha256.hexdigest(), infos


def read_safetensors(source: Path | bytes, framework: str, names: Sequence[str]) -> dict[str, Any]:
    """The tensors of a safetensors file (a path, or its bytes), in ``names``' order (else the file's): with the
    ``safetensors`` package where it is installed (the Airflow side: the ``[artifacts]`` extra), else with
    :func:`read_safetensors_plain` (a runner image with torch only)."""
    try:
        import safetensors
    except ImportError:
        return read_safetensors_plain(source, framework, names)
    if isinstance(source, bytes):
        found: Mapping[str, Any]
        if framework == "np":
            from safetensors.numpy import load as load_numpy

            found = load_numpy(source)
        else:
            from safetensors.torch import load as load_torch

            found = load_torch(source)
        return {name: found[name] for name in names or list(found)}
    with safetensors.safe_open(str(source), framework=framework) as f:
        return {name: f.get_tensor(name) for name in names or list(f.keys())}


#: safetensors dtype -> (torch dtype name, numpy dtype name); None where numpy has none.
_READ_DTYPES: Final = {code: (name, name if name in NUMPY_DTYPES else None) for name, code in _TORCH_DTYPES.items()}


def read_safetensors_plain(source: Path | bytes, framework: str, names: Sequence[str] = ()) -> dict[str, Any]:
    """A safetensors file (a path, or its bytes) read with the standard library and torch (``framework="pt"``) or
    numpy (``"np"``), for workers without the ``safetensors`` package; each tensor gets memory of its own."""
    with open(source, "rb") if isinstance(source, Path) else io.BytesIO(source) as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        start = 8 + length
        found: dict[str, Any] = {}
        for name in names or list(header):
            info = header[name]
            begin, end = info["data_offsets"]
            torch_name, numpy_name = _READ_DTYPES[info["dtype"]]
            handle.seek(start + begin)
            data = bytearray(end - begin)
            handle.readinto(data)
            if framework == "np":
                import numpy

                found[name] = numpy.frombuffer(data, dtype=numpy_name).reshape(info["shape"])
                continue
            import torch

            dtype = getattr(torch, torch_name)
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            found[name] = flat.reshape(info["shape"])
    return found

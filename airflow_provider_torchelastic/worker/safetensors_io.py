"""The safetensors format, written here and streamed: an 8-byte little-endian header length, the JSON header (dtype,
shape and byte offsets per tensor, padded to 8 bytes), then each tensor's bytes.

``safetensors.torch.save_file`` would first copy every tensor into one bytes object and can only write a local path;
:func:`write_safetensors` writes to any file object (a local file, an fsspec file on an object store), reading each
tensor's bytes in place from its memory (a tensor on a GPU is copied to the CPU one at a time).
:func:`read_safetensors_from` reads a stream once, in order, straight into new tensors' memory and hashes it on the
way (:class:`HashingReader`): ``safetensors.torch.load`` needs the whole file as one bytes object first and then copies
each tensor out of it (twice the memory, and a store's stream joined into bytes before that), and ``safe_open`` needs
a local path. Standard library; torch and numpy are recognised through ``sys.modules`` and imported only to read.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final, Protocol

from airflow_provider_torchelastic.core.artifact_ref import TensorInfo
from airflow_provider_torchelastic.core.validation import short_repr

__all__ = [
    "CHUNK_BYTES",
    "NUMPY_DTYPES",
    "MAX_HEADER_BYTES",
    "HashingReader",
    "HashingWriter",
    "Readable",
    "data_bytes",
    "read_safetensors_from",
    "read_safetensors_plain",
    "write_safetensors",
]

#: Bytes written per call: a slice of a tensor's memory (no copy), so that a store's write buffer stays small (the
#: size of an object store's write block, ``artifacts.MIN_PART_BYTES``).
CHUNK_BYTES: Final = 8 << 20

#: The header's length is padded to a multiple of this, as safetensors' own writer does (aligned tensor data).
_ALIGN: Final = 8
#: The safetensors dtype codes of the numpy dtypes it can hold (numpy has no bfloat16 or float8).
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
#: The same for torch's dtypes: numpy's, and the ones numpy lacks.
_TORCH_DTYPES: Final = {
    **NUMPY_DTYPES,
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


class _Hashing:
    """The sha256 of the bytes that pass, and their count. A large chunk is hashed on the one thread of its own
    (started when first needed, so chunks are hashed in order) while the caller moves bytes: hashlib releases the
    GIL, so the sha256 costs little more than the slower of the two."""

    #: Smaller chunks are hashed inline: a thread's round trip would cost more than it saves.
    THREADED_BYTES: Final = 1 << 20

    def __init__(self) -> None:
        self.sha256, self.count = hashlib.sha256(), 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _hash_on_thread(self, data: bytes | memoryview) -> concurrent.futures.Future[None]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")
        return self._pool.submit(self.sha256.update, data)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()  # after the chunks in flight: their memory may be about to go


class HashingWriter(_Hashing):
    """Writes to ``handle`` and hashes what it writes, a large chunk while it is written."""

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__()
        self.handle = handle

    def write(self, data: bytes | memoryview) -> None:
        if len(data) < self.THREADED_BYTES:
            self.sha256.update(data)
            self.handle.write(data)
        else:
            hashed = self._hash_on_thread(data)
            try:
                self.handle.write(data)
            finally:
                hashed.result()
        self.count += len(data)

    def flush(self) -> None:
        self.handle.flush()


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor as a safetensors header names it: its name, safetensors dtype (``F32``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(dtype=self.dtype, shape=self.shape)


@dataclasses.dataclass(frozen=True)
class _Entry(_Tensor):
    """A tensor to write."""

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

    distributed = sys.modules.get("torch.distributed.tensor")
    if distributed is not None and isinstance(tensor, distributed.DTensor):
        # Its bytes here are this rank's shard; the full tensor takes a collective, which rank 0 cannot run alone.
        raise TypeError(
            f"{name}: a sharded DTensor (an FSDP2 module's state_dict() holds them) cannot be saved from rank 0 "
            "alone; return the module itself from every rank (its full state dict is then gathered), or return "
            "tensor.full_tensor(), computed on every rank"
        )
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
    infos = {entry.name: entry.info for entry in entries}
    return out.count, out.sha256.hexdigest(), infos


#: safetensors dtype -> (torch dtype name, numpy dtype name); None where numpy has none.
_READ_DTYPES: Final = {code: (name, name if name in NUMPY_DTYPES else None) for name, code in _TORCH_DTYPES.items()}
#: Bytes per element where not 1.
_ITEM_BYTES: Final = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
#: A larger header is refused before it is read, as the safetensors package does: a file of ours has a few KiB.
MAX_HEADER_BYTES: Final = 100 << 20


class Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


class HashingReader(_Hashing):
    """Reads a file's bytes, in order, into memory the caller gives, and hashes them: a large chunk while the next
    one arrives, in the memory it was read into, so the sha256 costs no copy."""

    def __init__(self, stream: Readable) -> None:
        super().__init__()
        self.stream = stream
        self._hashing: collections.deque[concurrent.futures.Future[None]] = collections.deque()

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (bytes, ``B``) from the stream; ``EOFError`` when it ends first."""
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            filled = 0
            while filled < len(chunk):
                got = self.stream.readinto(chunk[filled:])
                if not got:
                    raise EOFError(f"the file ended after {self.count + filled} bytes")
                filled += got
            self._hash(chunk)
            self.count += len(chunk)

    def read(self, size: int) -> bytes:
        data = bytearray(size)
        self.read_into(memoryview(data))
        return bytes(data)

    def _hash(self, chunk: memoryview) -> None:
        if len(chunk) < self.THREADED_BYTES and not self._hashing:
            self.sha256.update(chunk)
            return
        # One thread, so the chunks are hashed in order; two in flight at most, so a failure surfaces soon.
        while len(self._hashing) >= 2:
            self._hashing.popleft().result()
        self._hashing.append(self._hash_on_thread(chunk))

    def wait(self) -> None:
        """Wait for the chunks still being hashed: until then the memory they were read into must stay alive."""
        while self._hashing:
            self._hashing.popleft().result()

    def hexdigest(self) -> str:
        """The sha256 of what was read."""
        self.wait()
        return self.sha256.hexdigest()


@dataclasses.dataclass(frozen=True)
class _Stored(_Tensor):
    """A tensor of a file read: where its bytes are in the data section."""

    begin: int
    end: int


#: numpy's limit on dimensions (torch has none): a file with more is not one of ours.
_MAX_DIMS: Final = 64


def _header_entries(header: Any, data_size: int) -> list[_Stored]:
    """The header's tensors in the order of their bytes, checked to tile the data exactly (no gap, no overlap, each
    its shape's size): what the bytes are read into is then exactly what the file holds. ``ValueError`` for anything
    else, and nothing else: the header is the store's, whoever could write there."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise ValueError(f"tensor {name!r}: malformed header entry {short_repr(info)}")
        dtype, shape, offsets = info.get("dtype"), tuple(info["shape"]), info.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"tensor {name!r}: malformed header entry {short_repr(info)}")
        begin, end = offsets
        if (
            not isinstance(dtype, str)  # before ``in``: a list there raises TypeError
            or dtype not in _READ_DTYPES
            or len(shape) > _MAX_DIMS
            or not all(type(n) is int and n >= 0 for n in (*shape, begin, end))
            # A shape with a zero in it holds no bytes, yet torch and numpy refuse to make one whose other sizes
            # overflow an int64 (RuntimeError, TypeError): such a shape is no tensor's.
            or math.prod(max(n, 1) for n in shape) * _ITEM_BYTES.get(dtype, 1) > sys.maxsize
        ):
            raise ValueError(f"tensor {name!r}: unknown dtype or bad shape/offsets in {short_repr(info)}")
        entries.append(_Stored(name, dtype, shape, begin, end))
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    offset = 0
    for entry in entries:
        item = _ITEM_BYTES.get(entry.dtype, 1)
        if entry.begin != offset or entry.end - entry.begin != math.prod(entry.shape) * item:
            raise ValueError(f"tensor {entry.name!r}: its bytes [{entry.begin}, {entry.end}) do not follow at {offset}")
        offset = entry.end
    if offset != data_size:
        raise ValueError(f"the tensors hold {offset} bytes, the file {data_size} after its header")
    return entries


def _empty(entry: _Stored, framework: str) -> tuple[Any, memoryview]:
    """A new tensor or array for ``entry``, and its memory as bytes to read into."""
    torch_name, numpy_name = _READ_DTYPES[entry.dtype]
    nbytes = entry.end - entry.begin
    if framework == "np":
        import numpy

        if numpy_name is None:
            raise ValueError(f"tensor {entry.name!r}: numpy has no dtype {entry.dtype}")
        array = numpy.empty(entry.shape, dtype=numpy_name)
        return array, array.reshape(-1).view(numpy.uint8).data if nbytes else memoryview(bytearray())
    import torch

    tensor = torch.empty(entry.shape, dtype=getattr(torch, torch_name))
    return tensor, _memory_of(tensor.data_ptr(), nbytes) if nbytes else memoryview(bytearray())


#: What a header may hold beyond its tensors' entries: the writer's ``__metadata__`` and the alignment's padding.
_HEADER_SLACK: Final = 4096


def _header_bound(expected: Mapping[str, TensorInfo]) -> int:
    """The longest header that names ``expected``'s tensors: each entry with offsets of 20 digits, the most an
    int64 has, and :data:`_HEADER_SLACK`."""
    widest = 10**19
    entries = {
        name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [widest, widest]}
        for name, info in expected.items()
    }
    return len(json.dumps(entries, separators=(",", ":")).encode()) + _HEADER_SLACK


def _check_named(header: Any, expected: Mapping[str, TensorInfo]) -> None:
    """``ValueError`` unless ``header`` (the parsed JSON) names exactly ``expected``'s tensors, dtypes and shapes."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    named = {name: info for name, info in header.items() if name != "__metadata__"}
    if set(named) != set(expected):
        raise ValueError(f"the header names other tensors than the reference: {short_repr(sorted(named))}")
    for name, info in expected.items():
        entry = named[name]
        if not isinstance(entry, dict) or entry.get("dtype") != info.dtype or entry.get("shape") != list(info.shape):
            raise ValueError(
                f"the header names other tensors than the reference: {name!r} is {short_repr(entry)} there, "
                f"{info.dtype} {list(info.shape)} in the reference"
            )


def read_safetensors_from(
    reader: HashingReader,
    size: int,
    framework: str,
    names: Sequence[str] = (),
    expected: Mapping[str, TensorInfo] | None = None,
) -> dict[str, Any]:
    """The tensors (``framework="pt"``) or arrays (``"np"``) of the ``size``-byte safetensors file that ``reader``
    reads, in ``names``' order (else the file's). The file is read once, in order, straight into the new tensors'
    memory, and hashed as it is (``reader.hexdigest()``): the caller trusts them only once that matches. Memory: the
    tensors, and one chunk where the stream has a buffer. ``expected``: each tensor's dtype and shape, which the
    header must name exactly. ``ValueError``: not such a file; ``EOFError``: shorter than ``size``."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise RuntimeError("reading safetensors needs a little-endian machine")
    if size < 8:
        raise ValueError(f"{size} bytes: shorter than a header")
    (length,) = struct.unpack("<Q", reader.read(8))
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"a header of {length} bytes in a file of {size}")
    # Before a byte of it is parsed: a header longer than the reference's tensors can need is not this artifact's,
    # and parsing a hostile one (megabytes of entries) costs seconds of CPU before the digest could refuse it.
    needed = _header_bound(expected) if expected else None
    if needed is not None and length > needed:
        raise ValueError(f"a header of {length} bytes, more than the {needed} its reference's tensors need")
    try:
        header = json.loads(reader.read(length))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested past the parser's depth
        raise ValueError("the header is not JSON") from e
    if expected:
        # Compared as the JSON it is, before any shape arithmetic: only the reference's own tensors get that far.
        _check_named(header, expected)
    entries = _header_entries(header, size - 8 - length)
    missing = set(names) - {entry.name for entry in entries}
    if missing:
        raise ValueError(f"the file holds no tensor {', '.join(map(repr, sorted(missing)))}")
    values = {}
    try:
        for entry in entries:
            values[entry.name], memory = _empty(entry, framework)
            reader.read_into(memory)
    finally:
        reader.wait()  # the thread hashes the tensors' memory: they outlive it, even when reading fails
    return {name: values[name] for name in names or [entry.name for entry in entries]}


def read_safetensors_plain(source: Path | bytes, framework: str, names: Sequence[str] = ()) -> dict[str, Any]:
    """A safetensors file (a path, or its bytes) read with the standard library and torch (``framework="pt"``) or
    numpy (``"np"``), without the ``safetensors`` package; each tensor gets memory of its own."""
    size = source.stat().st_size if isinstance(source, Path) else len(source)
    with open(source, "rb", buffering=0) if isinstance(source, Path) else io.BytesIO(source) as handle:
        reader = HashingReader(handle)
        try:
            return read_safetensors_from(reader, size, framework, names)
        finally:
            reader.close()

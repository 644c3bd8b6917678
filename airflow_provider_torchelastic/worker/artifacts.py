"""Artifacts: tensors, state dicts, Modules and arrays that travel between tasks through object storage.

Writing (rank 0's value, and arguments too large for the payload): :func:`save_value` replaces each of them, anywhere
in a value, by a reference (:mod:`airflow_provider_torchelastic.core.artifact_ref`) to a file it writes under the
try's artifact location:

- a ``torch.Tensor`` or a numeric ``numpy.ndarray``: one safetensors file holding it;
- a state dict (a non-empty mapping whose keys are str and whose values are all tensors): one safetensors file;
- a ``torch.nn.Module``: its state dict (unwrapped from DDP/DataParallel; FSDP's full state dict, gathered on every
  rank by :func:`gather_full_state_dicts`) and its class path; ``pickled(module)`` writes the whole module with
  ``torch.save`` instead (opt-in: it loads only where pickles may).

The files are written in the safetensors format, streamed to the store (:mod:`.safetensors_io`).

Reading (:func:`load`): each reference is fetched on its own (lazily: only the references handed to ``load``), its
bytes hashed while they arrive and refused unless they match its sha256, then read with the ``safetensors`` package.

Standard library, plus torch, numpy, fsspec and safetensors imported only when a value or a URL needs them: this
runs in the workers (no Airflow) and, through :mod:`airflow_provider_torchelastic.artifacts`, on the Airflow side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from airflow_provider_torchelastic.core import artifact_ref as refs
from airflow_provider_torchelastic.core.artifact_ref import ArtifactRef
from airflow_provider_torchelastic.worker.checkpoint import open_store
from airflow_provider_torchelastic.worker.safetensors_io import (
    CHUNK_BYTES,
    NUMPY_DTYPES,
    HashingWriter,
    data_bytes,
    read_safetensors,
    write_safetensors,
)

__all__ = [
    "ArtifactIntegrityError",
    "ArtifactPickleRefusedError",
    "PickledModule",
    "fetch_arguments",
    "gather_full_state_dicts",
    "load",
    "pickled",
    "save_value",
    "spill_arguments",
]

SUFFIX: Final = ".safetensors"
_SLUG: Final = re.compile(r"[^A-Za-z0-9_.-]+")


class ArtifactIntegrityError(ValueError):
    """An artifact's bytes are not those its reference names (sha256 or size): refused, never read."""


class ArtifactPickleRefusedError(PermissionError):
    """A pickled module was to be loaded where pickles are not allowed (pass ``allow_pickle=True`` to trust it)."""


@dataclasses.dataclass(frozen=True)
class PickledModule:
    """A Module to travel whole, pickled with ``torch.save`` (see :func:`pickled`)."""

    module: Any


def pickled(module: Any) -> PickledModule:
    """Mark a Module, in rank 0's value, to travel whole (``torch.save`` of the module, its code by reference) rather
    than as its state dict. Downstream it loads only in the workers of a torch_elastic task or with
    ``load(..., allow_pickle=True)``: unpickling runs code, so only trusted artifacts may be."""
    return PickledModule(module)


# --- writing: a value's artifacts ----------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray) and value.dtype.name in NUMPY_DTYPES


def _is_module(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _is_state_dict(value: Any) -> bool:
    """A non-empty mapping of str to tensors, one of which at least is not 0-d: ``{"loss": tensor(0.3)}`` is a dict
    of metrics, which stays numbers in JSON."""
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(key, str) for key in value)
        and all(_is_tensor(item) for item in value.values())
        and any(item.ndim > 0 for item in value.values())
    )


def _unwrapped(module: Any) -> Any:
    """The module inside DistributedDataParallel or DataParallel (their state dicts prefix every key ``module.``)."""
    import torch

    while isinstance(module, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        module = module.module
    return module


def _class_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class _Writer:
    """Writes one value's artifacts under ``location``, numbering them in the order they are met."""

    def __init__(self, location: str, prefix: str = "", open_write: WriteOpener | None = None) -> None:
        self.location = location.rstrip("/")
        self.prefix = prefix
        self.count = 0
        self.open_write = open_write
        self.store: Any = None  # opened at the first artifact: a value without any needs no fsspec

    def _name(self, where: Sequence[str], suffix: str) -> str:
        slug = _SLUG.sub("_", ".".join(where))[:80].strip("._") or "value"
        name = f"{self.prefix}{self.count:04d}-{slug}{suffix}"
        self.count += 1
        return name

    @contextlib.contextmanager
    def _open(self, name: str, size: int | None = None) -> Iterator[IO[bytes]]:
        if self.open_write is not None:
            with self.open_write(f"{self.location}/{name}") as handle:
                yield handle
            return
        if self.store is None:
            self.store = open_store(self.location)
            self.store.makedirs(self.store.root)
        if self.store.fs is None or size is None:
            with self.store.open(self.store.path(name), "wb") as handle:
                yield handle
            return
        with self.store.fs.open(self.store.path(name), "wb", block_size=part_bytes(size)) as handle:
            yield handle

    def safetensors(self, where: Sequence[str], kind: str, tensors: Sequence[tuple[str, Any]], **extra: Any) -> Any:
        name = self._name(where, SUFFIX)
        framework = "np" if kind == refs.KIND_NDARRAY else "pt"
        with self._open(name, data_bytes(tensors)) as handle:
            size, digest, infos = write_safetensors(handle, tensors, metadata={"format": framework})
        ref = ArtifactRef(url=f"{self.location}/{name}", kind=kind, bytes=size, sha256=digest, tensors=infos, **extra)
        return ref.to_json()

    def pickled_module(self, where: Sequence[str], module: Any) -> Any:
        import torch

        name = self._name(where, ".pt")
        with self._open(name) as handle:
            out = HashingWriter(handle)
            try:
                torch.save(module, out)  # type: ignore[arg-type]
            finally:
                out.close()
        return ArtifactRef(
            url=f"{self.location}/{name}",
            kind=refs.KIND_PICKLED_MODULE,
            bytes=out.count,
            sha256=out.sha256.hexdigest(),
            class_path=_class_path(module),
        ).to_json()

    def blob(self, name: str, data: bytes, kind: str) -> Any:
        with self._open(name) as handle:
            handle.write(data)
        return ArtifactRef(
            url=f"{self.location}/{name}", kind=kind, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
        ).to_json()


#: The smallest part of a multipart upload (an object store's write buffer): S3 refuses parts under 5 MiB. s3fs's
#: default of 50 MiB made the writer's peak RSS grow by about 4 parts (the buffer, its copy, the request's), 0.9x
#: of a 256 MiB state dict (benchmarks/artifacts.py).
MIN_PART_BYTES: Final = 8 << 20
#: S3 allows 10,000 parts per object: larger files get larger parts, with room to spare.
MAX_PARTS: Final = 9_000


def part_bytes(size: int) -> int:
    """The write block (multipart part) size for a file of ``size`` bytes: small, so that memory stays small, but
    large enough that the file fits in the store's number of parts."""
    needed = -(-size // MAX_PARTS)
    return max(MIN_PART_BYTES, -(-needed // (1 << 20)) << 20)


#: Opens a URL for writing, with credentials the caller knows (the Airflow side: a connection).
WriteOpener = Callable[[str], IO[bytes]]
#: The pickle of a task's spilled arguments, in ``{artifact location}/arguments/``.
ARGUMENTS_FILE: Final = "arguments.pkl"


def spill_arguments(location: str, *, open_write: WriteOpener | None = None) -> Any:
    """The ``spill`` of :func:`airflow_provider_torchelastic.core.payload.dump_payload`: tensors, arrays and state
    dicts in the arguments become safetensors artifacts under ``location``, and the rest one pickle beside them."""

    def spill(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        writer = _Writer(location, open_write=open_write)
        saved_args = _save(list(args), writer, ("args",), False, set())
        saved_kwargs = _save(dict(kwargs), writer, ("kwargs",), False, set())
        return tuple(saved_args), saved_kwargs, lambda data: writer.blob(ARGUMENTS_FILE, data, refs.KIND_ARGUMENTS)

    return spill


def save_value(value: Any, location: str, *, arguments: bool = False, prefix: str = "") -> Any:
    """``value`` with every tensor, numeric array, state dict and Module in it written under ``location`` and
    replaced by its reference (a JSON object); lists, tuples, mappings and dataclass instances are walked (a
    dataclass becomes a dict of its fields, as it would in JSON), anything else is kept as it is.

    ``arguments=True`` (a task's arguments, which are pickled afterwards): Modules and dataclass instances are kept
    as they are, because the function that takes one must get one; only tensors, arrays and state dicts in lists,
    tuples and mappings become references, which the workers load back before the function is called."""
    return _save(value, _Writer(location, prefix), (), not arguments, set())


def _save(value: Any, writer: _Writer, where: tuple[str, ...], modules: bool, active: set[int]) -> Any:
    if isinstance(value, PickledModule):
        return writer.pickled_module(where, value.module)
    # A 0-d tensor or array (a loss, an accuracy) stays a number, as the JSON encoding makes it; in arguments it is
    # pickled with the rest.
    if _is_tensor(value) and value.ndim > 0:
        return writer.safetensors(where, refs.KIND_TENSOR, [(refs.SINGLE_TENSOR, value)])
    if _is_array(value) and value.ndim > 0:
        return writer.safetensors(where, refs.KIND_NDARRAY, [(refs.SINGLE_TENSOR, value)])
    if modules and _is_module(value):
        inner = _unwrapped(value)
        state = _FULL_STATE_DICTS.pop(id(value), None) or inner.state_dict()
        return writer.safetensors(where, refs.KIND_MODULE, list(state.items()), class_path=_class_path(inner))
    if _is_state_dict(value):
        return writer.safetensors(where, refs.KIND_STATE_DICT, list(value.items()))
    is_dataclass = modules and dataclasses.is_dataclass(value) and not isinstance(value, type)
    if not (isinstance(value, list | tuple | Mapping) or is_dataclass) or id(value) in active:
        return value  # a cycle is left for the JSON encoding to refuse, naming where it is
    active.add(id(value))
    try:
        if isinstance(value, Mapping):
            return {key: _save(item, writer, (*where, str(key)), modules, active) for key, item in value.items()}
        if is_dataclass:
            return {
                f.name: _save(getattr(value, f.name), writer, (*where, f.name), modules, active)
                for f in dataclasses.fields(value)
            }
        saved = [_save(item, writer, (*where, str(index)), modules, active) for index, item in enumerate(value)]
        # In JSON a tuple is a list anyway; in arguments a plain tuple stays one.
        return tuple(saved) if type(value) is tuple and not modules else saved
    finally:
        active.discard(id(value))


#: Full state dicts of FSDP modules gathered on every rank (:func:`gather_full_state_dicts`), by the module's id,
#: for rank 0's :func:`save_value` to write.
_FULL_STATE_DICTS: dict[int, Mapping[str, Any]] = {}


def gather_full_state_dicts(value: Any) -> None:
    """Every rank calls this with its own return value: the full state dict of each FSDP-sharded Module in it is
    gathered to rank 0 (a collective, so every rank must return the same structure), for :func:`save_value`."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    for module in _modules_in(value, set()):
        if not _is_sharded(module):
            continue
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        _FULL_STATE_DICTS[id(module)] = get_model_state_dict(_unwrapped(module), options=options)


def _modules_in(value: Any, seen: set[int]) -> Iterator[Any]:
    if id(value) in seen:
        return
    seen.add(id(value))
    if _is_module(value):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _modules_in(item, seen)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _modules_in(item, seen)


def _is_sharded(module: Any) -> bool:
    """FSDP (the wrapper class) or FSDP2 (``fully_shard``: parameters are DTensors)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
        return True
    tensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_module, "DTensor", None) if tensor_module is not None else None
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


# --- reading -------------------------------------------------------------------------------------------------------

#: Finds a URL's fsspec file system and path there, with credentials the caller knows (the Airflow side: a
#: connection).
Locator = Callable[[str], tuple[Any, str]]


def _local_path(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    return None if "://" in url or "::" in url else Path(url)


def _default_locator(url: str) -> tuple[Any, str]:
    """fsspec, with the environment's credentials (the workers')."""
    folder, _, name = url.rpartition("/")
    store = open_store(folder)  # says which package a URL needs, if it is missing
    return store.fs, store.path(name)


def _file_digest(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _check(ref: ArtifactRef, size: int, digest: str | None) -> None:
    if size != ref.bytes or digest is None or not hmac.compare_digest(digest, ref.sha256):
        found = f"sha256 {digest}, {size} bytes" if digest is not None else f"{size} bytes, not fetched"
        raise ArtifactIntegrityError(
            f"artifact {ref.url} is not the one its reference names ({found}; expected sha256 {ref.sha256}, "
            f"{ref.bytes} bytes): refusing to read it; was it replaced or damaged in the store?"
        )


def _verified_bytes(ref: ArtifactRef, locate: Locator | None) -> bytes:
    """A remote artifact's bytes, verified against the reference. Its size is checked first, so that an object that
    is not the reference's is refused before a byte of it is fetched; then it is read with one request (a ranged
    read or a parallel ``get_file`` costs a request per part, which some stores serve slowly), into memory that the
    tensors need anyway."""
    fs, path = (locate or _default_locator)(ref.url)
    size = int(fs.size(path))
    if size != ref.bytes:
        _check(ref, size, None)
    with fs.open(path, "rb", cache_type="none") as source:
        data = bytes(source.read(ref.bytes))
    _check(ref, len(data), hashlib.sha256(data).hexdigest())
    return data


def fetch_arguments(ref: Mapping[str, Any]) -> bytes:
    """The bytes of a payload's spilled arguments (``core.payload``'s ``fetch``), at most one more than the reference
    says (enough to fail its check): the payload checks their sha256 before it unpickles them."""
    url, expected = str(ref["url"]), int(ref["bytes"])
    local = _local_path(url)
    if local is not None:
        with open(local, "rb") as handle:
            return handle.read(expected + 1)
    fs, path = _default_locator(url)
    return bytes(fs.cat_file(path, start=0, end=min(int(fs.size(path)), expected + 1)))


def _read(ref: ArtifactRef, *, allow_pickle: bool, locate: Locator | None) -> Any:
    if ref.kind == refs.KIND_ARGUMENTS:
        raise refs.ArtifactRefError(f"{ref.url}: spilled arguments are read by the runner, not loaded")
    if ref.kind == refs.KIND_PICKLED_MODULE and not allow_pickle:
        raise ArtifactPickleRefusedError(
            f"{ref.url} is a pickled module ({ref.class_path}); unpickling runs code, so it loads only in the workers "
            "of a torch_elastic task or with load(..., allow_pickle=True) for an artifact you trust"
        )
    local = _local_path(ref.url)
    if local is None:
        return _parse(ref, _verified_bytes(ref, locate))
    _check(ref, *_file_digest(local))  # a local file is read where it is, after its sha256
    return _parse(ref, local)


def _parse(ref: ArtifactRef, source: Path | bytes) -> Any:
    """An artifact's value from its verified file or bytes."""
    if ref.kind == refs.KIND_PICKLED_MODULE:
        import io

        import torch

        where = source if isinstance(source, Path) else io.BytesIO(source)
        return torch.load(where, map_location="cpu", weights_only=False)
    framework = "np" if ref.kind == refs.KIND_NDARRAY else "pt"
    tensors = read_safetensors(source, framework, list(ref.tensors))
    if ref.kind in (refs.KIND_TENSOR, refs.KIND_NDARRAY):
        return tensors[refs.SINGLE_TENSOR]
    return tensors


def load(
    value: Any,
    *,
    into: Any = None,
    strict: bool = True,
    allow_pickle: bool = False,
    locate: Locator | None = None,
) -> Any:
    """``value`` (an XCom from a torch_elastic task) with every artifact reference in it loaded: tensors and arrays
    as themselves, a state dict as a dict of tensors, a Module as its state dict. Each reference is fetched when it
    is loaded and verified against its sha256 first (:class:`ArtifactIntegrityError`); load a part of the value
    (``load(value["model"])``) to fetch only that part.

    ``into``: a Module to load the reference ``value`` (a Module's or a state dict's) into, with
    ``load_state_dict(strict=strict)``; returns the module. ``allow_pickle``: load pickled modules too
    (``pickled()``), which runs their pickle's code. ``locate``: how to find a URL's file system (default: a local
    path, or fsspec with the environment's credentials).
    """
    if into is not None:
        ref = refs.ArtifactRef.from_json(value)
        if ref.kind not in (refs.KIND_MODULE, refs.KIND_STATE_DICT):
            raise TypeError(f"load(into=...): expected a reference to a module or a state dict, got a {ref.kind}")
        into.load_state_dict(_read(ref, allow_pickle=False, locate=locate), strict=strict)
        return into
    return refs.map_refs(value, lambda ref: _read(ref, allow_pickle=allow_pickle, locate=locate))

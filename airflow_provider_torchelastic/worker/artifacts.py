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

Reading (:func:`load`): each reference is fetched on its own (lazily: only the references handed to ``load``), with
one request where the store can (:mod:`.artifact_streams`), straight into the new tensors' memory, hashed while it
arrives; the tensors are returned only when the bytes match the reference's sha256. Peak memory: the tensors, plus
one 8 MiB chunk.

Standard library, plus torch, numpy and fsspec imported only when a value or a URL needs them: this
runs in the workers (no Airflow) and, through :mod:`airflow_provider_torchelastic.artifacts`, on the Airflow side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Final

from airflow_provider_torchelastic.core import artifact_ref as refs
from airflow_provider_torchelastic.core.artifact_ref import ArtifactRef
from airflow_provider_torchelastic.core.safe_files import read_regular
from airflow_provider_torchelastic.worker.artifact_streams import (
    ArtifactIntegrityError,
    Locator,
    check,
    default_locator,
    local_path,
    read_verified,
)
from airflow_provider_torchelastic.worker.checkpoint_store import open_store
from airflow_provider_torchelastic.worker.safetensors_io import (
    NUMPY_DTYPES,
    HashingReader,
    HashingWriter,
    data_bytes,
    read_safetensors_from,
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
    """The class a Module was written as: FSDP's wrapper (FSDP1) and the class ``fully_shard`` makes (FSDP2:
    ``FSDPNet``, a subclass of ``FSDPModule`` and ``Net``) name the user's class instead."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    if wrapper is not None and isinstance(obj, wrapper):
        obj = obj.module
    cls = type(obj)
    sharded = getattr(fsdp, "FSDPModule", None)
    if sharded is not None and issubclass(cls, sharded):
        cls = next((base for base in cls.__mro__ if not issubclass(base, sharded)), cls)
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
        # Pinned: the workers load only references the Airflow side vouched for, and these it just wrote.
        pinned_args, pinned_kwargs = refs.pin_written_refs((tuple(saved_args), saved_kwargs))
        return pinned_args, pinned_kwargs, lambda data: writer.blob(ARGUMENTS_FILE, data, refs.KIND_ARGUMENTS)

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
        state = _FULL_STATE_DICTS.pop(id(value), None)
        if state is None:
            if _is_sharded(value):
                raise TypeError(f"{'.'.join(where) or 'the value'}: {_NOT_GATHERED}")
            state = inner.state_dict()
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
_NOT_GATHERED: Final = (
    "an FSDP-sharded Module whose full state dict was not gathered: every rank must return it, with the process "
    "group still initialized, for the gathering (a collective) to run on every rank"
)


def gather_full_state_dicts(value: Any) -> None:
    """Every rank calls this with its own return value: the full state dict of each FSDP-sharded Module in it (FSDP1's
    wrapper, or a module with ``fully_shard`` applied) is gathered, for rank 0's :func:`save_value`. It is a
    collective: every rank must return the same structure, and the process group must still be initialized."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    sharded = [module for module in _modules_in(value, set()) if _is_sharded(module)]
    if len(set(_counts_of_every_rank(len(sharded)))) > 1:
        return  # a rank that would gather alone would wait forever; rank 0's save says what is wrong
    for module in sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload gathers on rank 0 only, onto its CPU, for parameters on an accelerator. On the CPU it is not
        # needed, and torch 2.13's FSDP1 fails with it there ("setStorage: ... storage of size 0"): each rank then
        # gathers a full copy, and the others drop theirs.
        offload = any(p.device.type != "cpu" for p in module.parameters())
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        state = get_model_state_dict(_unwrapped(module), options=options)
        if torch.distributed.get_rank() == 0:
            _FULL_STATE_DICTS[id(module)] = state


def _counts_of_every_rank(count: int) -> list[int]:
    """Every rank's number of sharded Modules, through the process group's store (a key per rank, not a collective
    of its backend: NCCL would need each rank's device): when rank 0 alone returns the model, as ``if rank == 0:
    return model`` does, it fails at once instead of waiting in the gathering for the group's timeout (30 min)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    # The agent's store outlives a restart of the workers: a key per restart.
    prefix = f"torchelastic_artifacts/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/sharded/"
    store.set(f"{prefix}{dist.get_rank()}", str(count))
    keys = [f"{prefix}{rank}" for rank in range(dist.get_world_size())]
    store.wait(keys)
    return [int(store.get(key)) for key in keys]


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


def fetch_arguments(ref: Mapping[str, Any]) -> bytes:
    """The bytes of a payload's spilled arguments (``core.payload``'s ``fetch``), at most one more than the reference
    says (enough to fail its check): the payload checks their sha256 before it unpickles them."""
    url, expected = str(ref["url"]), int(ref["bytes"])
    local = local_path(url)
    if local is not None:
        # A regular file, not a link: the store may be shared with other tries' pods.
        return read_regular(local, limit=expected + 1, error=ArtifactIntegrityError)
    fs, path = default_locator(url)
    return bytes(fs.cat_file(path, start=0, end=min(int(fs.size(path)), expected + 1)))


def _read(ref: ArtifactRef, *, allow_pickle: bool, locate: Locator | None) -> Any:
    if ref.kind == refs.KIND_ARGUMENTS:
        raise refs.ArtifactRefError(f"{ref.url}: spilled arguments are read by the runner, not loaded")
    if ref.kind == refs.KIND_PICKLED_MODULE:
        if not allow_pickle:
            raise ArtifactPickleRefusedError(
                f"{ref.url} is a pickled module ({ref.class_path}); unpickling runs code, so it loads only in the "
                "workers of a torch_elastic task or with load(..., allow_pickle=True) for an artifact you trust"
            )
        return _read_pickled_module(ref, locate)
    framework = "np" if ref.kind == refs.KIND_NDARRAY else "pt"

    def read(reader: HashingReader) -> dict[str, Any]:
        return read_safetensors_from(reader, ref.bytes, framework, list(ref.tensors), ref.tensors)

    tensors = read_verified(ref, locate, read)
    if ref.kind in (refs.KIND_TENSOR, refs.KIND_NDARRAY):
        return tensors[refs.SINGLE_TENSOR]
    return tensors


def _read_pickled_module(ref: ArtifactRef, locate: Locator | None) -> Any:
    """A pickled module, read once into memory and unpickled from there only after its sha256."""
    import io

    import torch

    local = local_path(ref.url)
    if local is not None:
        # Read once, into memory: hashed by path and then loaded by path again, the file could be swapped in between,
        # and the swapped pickle would run. At most one byte more than the reference says, enough to fail its check.
        held = read_regular(local, limit=ref.bytes + 1, error=ArtifactIntegrityError)
        check(ref, len(held), hashlib.sha256(held).hexdigest())
        return torch.load(io.BytesIO(held), map_location="cpu", weights_only=False)

    def read(reader: HashingReader) -> bytearray:
        data = bytearray(ref.bytes)
        reader.read_into(memoryview(data))
        return data

    data = read_verified(ref, locate, read)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


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

"""References to artifacts: the marked plain-JSON form in which a tensor, a state dict, a Module or an array travels
in XCom (and a spilled argument in the payload), and the checks made before one is accepted.

A reference is a JSON object with the key :data:`MARKER`::

    {"__torchelastic_artifact__": 1, "kind": "module", "url": "s3://.../artifacts/0000-model.safetensors",
     "format": "safetensors", "bytes": 1234, "sha256": "...", "class": "my_dag.Net",
     "tensors": {"fc.weight": {"dtype": "F32", "shape": [10, 4]}, ...}}

Nothing in it is ever unpickled: the Airflow side reads it as JSON, checks that its URL lies under the try's own
artifact location (:func:`check_refs_under`), and a loader later verifies the bytes against ``sha256``. Standard
library only: the Airflow side, the runner and the workers share it.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "KINDS",
    "MARKER",
    "ArtifactRef",
    "ArtifactRefError",
    "PinnedRef",
    "TensorInfo",
    "check_refs_under",
    "is_ref",
    "iter_refs",
    "map_refs",
    "pin_argument_refs",
    "pin_written_refs",
    "walk_refs",
]

#: The key that marks a JSON object as a reference; its value is the reference format's version.
MARKER: Final = "__torchelastic_artifact__"
VERSION: Final = 1
#: What an artifact holds, and the format of its file.
KIND_TENSOR: Final = "tensor"
KIND_NDARRAY: Final = "ndarray"
KIND_STATE_DICT: Final = "state_dict"
KIND_MODULE: Final = "module"
#: A whole module pickled with ``torch.save``: opt-in (``artifacts.pickled(module)``), loaded only where pickles are
#: allowed (the workers of a torch_elastic task, or ``load(..., allow_pickle=True)``).
KIND_PICKLED_MODULE: Final = "pickled_module"
#: A task's arguments too large for its payload: a cloudpickle, unpickled only in the workers, after its sha256.
KIND_ARGUMENTS: Final = "arguments"
FORMAT_SAFETENSORS: Final = "safetensors"
FORMAT_OF_KIND: Final[Mapping[str, str]] = {
    KIND_TENSOR: FORMAT_SAFETENSORS,
    KIND_NDARRAY: FORMAT_SAFETENSORS,
    KIND_STATE_DICT: FORMAT_SAFETENSORS,
    KIND_MODULE: FORMAT_SAFETENSORS,
    KIND_PICKLED_MODULE: "torch.save",
    KIND_ARGUMENTS: "cloudpickle",
}
KINDS: Final = tuple(FORMAT_OF_KIND)
#: The one tensor's name in the file of a ``tensor`` or ``ndarray`` artifact.
SINGLE_TENSOR: Final = "value"
#: The safetensors dtype names.
SAFETENSORS_DTYPES: Final = frozenset(
    {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "F8_E4M3", "F8_E5M2"}
)
_SHA256: Final = re.compile(r"[0-9a-f]{64}\Z")
_CLASS_PATH: Final = re.compile(r"[A-Za-z_][\w.<>]*\Z")


class ArtifactRefError(ValueError):
    """A reference that is malformed, or not where the artifacts of this try belong."""


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ArtifactRef:
    """One artifact; its fields in its JSON document's order (:meth:`to_json`), which :meth:`from_json` checks."""

    kind: str
    url: str
    bytes: int
    sha256: str
    #: ``module.qualname`` of a Module's class (``module`` and ``pickled_module`` artifacts).
    class_path: str | None = None
    #: Tensor name -> dtype and shape, in the file's order (the state dict's order), for safetensors artifacts.
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            MARKER: VERSION,
            "kind": self.kind,
            "url": self.url,
            "format": FORMAT_OF_KIND[self.kind],
            "bytes": self.bytes,
            "sha256": self.sha256,
        }
        if self.class_path is not None:
            doc["class"] = self.class_path
        if self.tensors:
            doc["tensors"] = {
                name: {"dtype": info.dtype, "shape": list(info.shape)} for name, info in self.tensors.items()
            }
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> ArtifactRef:
        """The reference in ``doc`` (a marked JSON object), checked field by field; :class:`ArtifactRefError` names
        the first field that is wrong, and is all it raises, whatever ``doc`` is (rank 0's value holds these)."""
        if not is_ref(doc):
            raise ArtifactRefError(f"not an artifact reference (a JSON object with {MARKER!r}): {_short(doc)}")
        if type(doc[MARKER]) is not int or doc[MARKER] != VERSION:
            raise ArtifactRefError(f"artifact reference {MARKER}: expected {VERSION}, got {_short(doc[MARKER])}")
        kind = doc.get("kind")
        # Type first: ``in`` a dict hashes its operand, and a list raises TypeError there.
        if not isinstance(kind, str) or kind not in FORMAT_OF_KIND:
            raise ArtifactRefError(f"artifact reference kind: expected one of {', '.join(KINDS)}, got {_short(kind)}")
        url, size, digest = doc.get("url"), doc.get("bytes"), doc.get("sha256")
        if not isinstance(url, str) or not url:
            raise ArtifactRefError(f"artifact reference url: expected a non-empty str, got {_short(url)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactRefError(f"artifact reference bytes: expected an int >= 0, got {_short(size)}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ArtifactRefError(f"artifact reference sha256: expected 64 lowercase hex digits, got {_short(digest)}")
        class_path = doc.get("class")
        if class_path is not None and (not isinstance(class_path, str) or not _CLASS_PATH.match(class_path)):
            raise ArtifactRefError(f"artifact reference class: expected a dotted class path, got {_short(class_path)}")
        return cls(
            kind=kind,
            url=url,
            bytes=size,
            sha256=digest,
            class_path=class_path,
            tensors=_tensors(doc.get("tensors", {})),
        )


def _tensors(raw: Any) -> dict[str, TensorInfo]:
    if not isinstance(raw, dict):
        raise ArtifactRefError(f"artifact reference tensors: expected an object, got {_short(raw)}")
    found: dict[str, TensorInfo] = {}
    for name, info in raw.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise ArtifactRefError(
                f"artifact reference tensors[{_short(name)}]: expected {{'dtype': a safetensors dtype, 'shape': a "
                f"list}}, got {_short(info)}"
            )
        if not isinstance(shape, list):
            raise ArtifactRefError(
                f"artifact reference tensors[{name!r}]: expected {{'dtype': a safetensors dtype, 'shape': a list}}, "
                f"got {_short(info)}"
            )
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ArtifactRefError(
                f"artifact reference tensors[{name!r}] shape: expected ints >= 0, got {_short(shape)}"
            )
        found[name] = TensorInfo(dtype=dtype, shape=tuple(shape))
    return found


_SHORT: Final = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 200


def _short(value: Any) -> str:
    """``repr(value)`` for a message, bounded; never raising (``repr`` of a list nested 2000 deep raises
    RecursionError, and of an int past Python's digit limit ValueError)."""
    try:
        return _SHORT.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a JSON object marked as a reference (well-formed or not)."""
    return isinstance(value, dict) and MARKER in value


def iter_refs(value: Any) -> Iterator[ArtifactRef]:
    """Every reference in a JSON value (lists and objects, at any depth), parsed; a malformed one raises."""
    stack = [value]
    while stack:
        item = stack.pop()
        if is_ref(item):
            yield ArtifactRef.from_json(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))


def walk_refs(value: Any, path: str = "") -> Iterator[tuple[str, ArtifactRef]]:
    """Every reference in a JSON value with where it is, in the value's order: ``model``, ``layers[2]``,
    ``stats.mean`` (``""`` for the value itself); a malformed one raises :class:`ArtifactRefError`."""
    # A stack, not recursion: rank 0's value may be nested as deep as JSON allows.
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if is_ref(item):
            yield where, ArtifactRef.from_json(item)
        elif isinstance(item, dict):
            children = [(f"{where}.{key}" if where else str(key), child) for key, child in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(f"{where}[{index}]", child) for index, child in enumerate(item)]))


def map_refs(value: Any, load: Callable[[ArtifactRef], Any]) -> Any:
    """``value`` with each reference replaced by ``load(reference)``; containers are copied, nothing else is."""
    return map_refs_raw(value, lambda raw: load(ArtifactRef.from_json(raw)))


def is_under(url: str, location: str) -> bool:
    """Whether ``url`` names a file inside the folder ``location`` (no ``..``, ``.``, empty, query or fragment part
    that could lead it out)."""
    folder = location.rstrip("/") + "/"
    if not url.startswith(folder):
        return False
    rest = url[len(folder) :]
    return bool(rest) and not any(piece in ("", ".", "..") for piece in rest.split("/")) and not set("?#\\") & set(rest)


def check_refs_under(value: Any, location: str | None) -> list[ArtifactRef]:
    """Every reference in ``value``, each checked to lie under ``location`` (the try's own artifact location,
    recomputed by the caller); :class:`ArtifactRefError` for the first that does not, or for any when there is no
    location (no artifact storage for this try)."""
    refs = list(iter_refs(value))
    for ref in refs:
        if location is None:
            raise ArtifactRefError(
                f"rank 0's value holds an artifact reference to {ref.url!r}, but this try has no artifact location "
                "([torch_elastic] artifact_storage and result_storage are unset)"
            )
        if ref.kind == KIND_ARGUMENTS:
            raise ArtifactRefError(f"rank 0's value holds a reference to spilled arguments ({ref.url!r})")
        if not is_under(ref.url, location):
            raise ArtifactRefError(
                f"rank 0's value holds an artifact reference to {ref.url!r}, which is not under this try's artifact "
                f"location {location!r}"
            )
    return refs


# --- references in a task's arguments ------------------------------------------------------------------------------

#: How deep :func:`pin_argument_refs` looks for references (the workers materialize none deeper).
MAX_ARGUMENT_DEPTH: Final = 64


@dataclass(frozen=True)
class PinnedRef:
    """A reference in a task's arguments that the Airflow side accepted when it built the payload: its URL under an
    allowed root, a pickled module only where the task allows pickles. The workers load these and nothing else, so a
    dict that merely has a reference's shape (an upstream value, ``dag_run.conf``, another DAG's XCom: JSON, which
    can hold no ``PinnedRef``) reaches the function as the dict it is. The payload's sha256 covers every pin."""

    #: Where it was in the arguments (``op_kwargs['model']``), for errors.
    where: str
    #: The reference's JSON object, as given.
    ref: Mapping[str, Any]
    allow_pickle: bool = False


def pin_argument_refs(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, roots: Sequence[str], allow_pickle: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with each artifact reference replaced by its :class:`PinnedRef`. Raises
    :class:`ArtifactRefError` naming where the first one is that is malformed, not under one of ``roots`` (the
    artifact storage, and the roots a task adds), or a pickled module while ``allow_pickle`` is off."""

    def pin(value: Any, where: str, depth: int) -> Any:
        if is_ref(value):
            return _pinned(value, where, roots, allow_pickle)
        if depth >= MAX_ARGUMENT_DEPTH:
            if next(iter_refs(value), None) is not None:
                raise ArtifactRefError(f"{where}: an artifact reference nested deeper than {MAX_ARGUMENT_DEPTH} levels")
            return value
        if isinstance(value, dict):
            return {key: pin(item, f"{where}[{key!r}]", depth + 1) for key, item in value.items()}
        if isinstance(value, list | tuple):
            items = [pin(item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    pinned_args = tuple(pin(value, f"op_args[{index}]", 1) for index, value in enumerate(args))
    return pinned_args, {key: pin(value, f"op_kwargs[{key!r}]", 1) for key, value in kwargs.items()}


def _pinned(value: Mapping[str, Any], where: str, roots: Sequence[str], allow_pickle: bool) -> PinnedRef:
    try:
        ref = ArtifactRef.from_json(value)
    except ArtifactRefError as e:
        raise ArtifactRefError(f"{where}: {e}") from None
    if ref.kind == KIND_ARGUMENTS:
        raise ArtifactRefError(f"{where}: a reference to spilled arguments ({ref.url!r}) is not an argument")
    if not any(is_under(ref.url, root) for root in roots):
        allowed = ", ".join(map(repr, roots)) or "none: [torch_elastic] artifact_storage is unset"
        raise ArtifactRefError(
            f"{where}: the artifact reference to {ref.url!r} is not under an allowed root ({allowed}); the workers "
            "would fetch and load it, so only references into your artifact storage are accepted: add its root "
            "to the task's trusted_artifact_roots if you trust it"
        )
    if ref.kind == KIND_PICKLED_MODULE and not allow_pickle:
        raise ArtifactRefError(
            f"{where}: {ref.url!r} is a pickled module ({ref.class_path}), and unpickling it runs its code in every "
            "worker: pass allow_pickled_artifacts=True to the task if you trust whoever wrote it"
        )
    return PinnedRef(where=where, ref=dict(value), allow_pickle=allow_pickle)


def pin_written_refs(value: Any) -> Any:
    """``value`` (arguments this process just spilled to the store) with each reference pinned: they are its own,
    pickled modules included."""
    return map_refs_raw(value, lambda raw: PinnedRef(where="spilled arguments", ref=dict(raw), allow_pickle=True))


def map_refs_raw(value: Any, replace: Callable[[Mapping[str, Any]], Any]) -> Any:
    """``value`` with each reference's JSON object replaced by ``replace(object)``; containers are copied."""
    if is_ref(value):
        return replace(value)
    if isinstance(value, dict):
        return {key: map_refs_raw(item, replace) for key, item in value.items()}
    if isinstance(value, list):
        return [map_refs_raw(item, replace) for item in value]
    if isinstance(value, tuple):
        return tuple(map_refs_raw(item, replace) for item in value)
    return value

"""Loading a sharded (DCP) checkpoint without running what its files say.

``torch.distributed.checkpoint`` reads a checkpoint's ``.metadata`` with ``pickle.load`` and its byte items (the
non-tensor values of a state dict) with ``torch.load(weights_only=False)``: whoever can write under the checkpoint
root (another try's pod, another tenant of a shared bucket) chooses what every rank of the next try runs. Here the
metadata goes through an unpickler that admits only the types DCP writes, and byte items load with
``weights_only=True`` unless the caller opts out. Imported by :mod:`~.checkpoint` only when a sharded checkpoint is
loaded, with torch already there.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any, Final

__all__ = ["CheckpointMetadataError", "reader_for", "restricted_planner", "safe_metadata_load"]

#: The modules whose own classes a DCP metadata pickle names (its dataclasses, enums and storage infos).
_DCP_MODULES: Final = ("torch.distributed.checkpoint.",)
#: Single names it may hold elsewhere: torch's dtypes, Size and layouts, and a local checkpoint's id (a path).
_NAMED: Final = {
    "torch": None,  # a dtype (torch.float32) or torch.Size: checked by type in _allowed_torch
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class CheckpointMetadataError(ValueError):
    """A sharded checkpoint's metadata names something DCP never writes there: it is not loaded."""


def _allowed_torch(name: str, value: Any) -> bool:
    import torch

    return name == "Size" or isinstance(value, torch.dtype | torch.layout | torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A dotted name would walk attributes (``filesystem`` + ``os.system``): only plain names of the module.
        if "." not in name:
            if module.startswith(_DCP_MODULES):
                value = super().find_class(module, name)
                if isinstance(value, type) and value.__module__ == module:
                    return value
            elif module in _NAMED:
                value = super().find_class(module, name)
                allowed = _NAMED[module]
                if (allowed is None and _allowed_torch(name, value)) or (allowed is not None and name in allowed):
                    return value
        raise CheckpointMetadataError(
            f"the checkpoint's DCP metadata names {module}.{name}, which DCP never writes there: refusing to load "
            "it (was the checkpoint written by someone else?)"
        )


def safe_metadata_load(stream: IO[bytes]) -> Any:
    """DCP's metadata from ``stream``, unpickled with only DCP's own types admitted."""
    return _MetadataUnpickler(stream).load()


def reader_for(reader_class: type) -> type:
    """``reader_class`` (DCP's ``FileSystemReader`` or ``FsspecReader``) with its metadata read by
    :func:`safe_metadata_load`; the rest of what it does (storage meta, load id) as torch 2.13 to 2.15 do."""

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_metadata_load(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    return type(f"Restricted{reader_class.__name__}", (reader_class,), {"read_metadata": read_metadata})


def restricted_planner(*, weights_only: bool) -> Any:
    """DCP's default load planner, its byte items loaded with ``torch.load(weights_only=...)``: its own
    ``load_bytes`` as torch writes it, the one argument changed."""
    import torch
    from torch.distributed.checkpoint import default_planner

    class _Planner(default_planner.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=weights_only)
            if self.flatten_state_dict:
                default_planner.set_element(  # type: ignore[attr-defined]
                    self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
                )
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return _Planner()

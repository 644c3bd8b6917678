"""What the framework integrations share: the running job's size, a stop every rank agrees on, the task's checkpoint
location, and the numbers among what a framework logs.

Standard library at import; torch only inside the functions that need a collective. Runs in the workers.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

from airflow_provider_torchelastic.core.run_context import safe_path_piece
from airflow_provider_torchelastic.errors import RecoverableError
from airflow_provider_torchelastic.worker.context import NoRunContextError, current
from airflow_provider_torchelastic.worker.liveness import stop_requested

__all__ = [
    "JobSize",
    "StopRequested",
    "barrier",
    "broadcast_from_rank_0",
    "checkpoint_location",
    "job_size",
    "node_folder",
    "numbers",
    "resume_subfolder",
    "stop_agreed",
    "watch_sigterm",
]

#: What the integrations' metrics may not send: strings, and the counters nobody charts (HF's ``total_flos``).
_NOT_METRICS: Final = frozenset({"total_flos"})


class StopRequested(RecoverableError):
    """The try was asked to stop (its pod deleted or preempted, the task killed): the integration saved a checkpoint
    and stopped training. Recoverable: the next try resumes from that checkpoint."""


@dataclass(frozen=True)
class JobSize:
    """The size of the running job, as torch elastic started it (for an elastic ``min:max`` job: the size it has
    now, which a restart may change)."""

    #: Nodes in the job: Lightning's ``num_nodes``.
    nodes: int
    #: Workers (processes) on this node: Lightning's ``devices``.
    procs_per_node: int
    world_size: int


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an int, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {raw!r}")
    return value


def job_size(env: Mapping[str, str] | None = None) -> JobSize:
    """The running job's size from torch elastic's variables (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_WORLD_SIZE``), so that a framework's ``num_nodes``/``devices`` match the world it joins whatever size an
    elastic job started with. Outside a job: one node of one process."""
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_WORLD_SIZE", world)
    nodes = _int(env, "GROUP_WORLD_SIZE", max(1, world // local))
    if nodes * local != world:
        # Nodes of different sizes (torch elastic allows it; Lightning does not): say so rather than mis-size.
        raise ValueError(
            f"the job's nodes are not all the same size: WORLD_SIZE={world} is not GROUP_WORLD_SIZE={nodes} x "
            f"LOCAL_WORLD_SIZE={local}; give every node the same nproc_per_node"
        )
    return JobSize(nodes=nodes, procs_per_node=local, world_size=world)


def checkpoint_location(subfolder: str | None = None) -> str | None:
    """The task's checkpoint location (``context.current().checkpoint_uri``), with ``/subfolder`` appended; None
    outside a task's workers or when the task has none (the integrations then keep checkpoints local, and warn)."""
    try:
        location = current().checkpoint_uri
    except NoRunContextError:
        location = None
    if location is None:
        warnings.warn(
            "this task has no checkpoint location ([torch_elastic] checkpoint_root or checkpoint_uri=): checkpoints "
            "stay in the workers' local folders and a retry starts over",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return f"{location.rstrip('/')}/{subfolder}" if subfolder else location


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among ``values`` (a tensor of one element counts), the rest left out: frameworks log
    strings and counters beside their metrics, which ``report()`` would warn about at every call."""
    found: dict[str, float] = {}
    for name, value in values.items():
        if name in _NOT_METRICS or isinstance(value, bool | str | bytes):
            continue
        detach = getattr(value, "detach", None)
        try:
            number = float(detach() if callable(detach) else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            found[name] = number
    return found


# --- stopping ------------------------------------------------------------------------------------------------------

_sigterm = threading.Event()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _sigterm.set()


def watch_sigterm() -> None:
    """Make a SIGTERM sent to this worker a stop request (as the runner's stop file is), in place of whatever handler
    a framework installed: Lightning's raises ``SIGTERMException``, a ``SystemExit`` that would fail the task for good
    instead of letting it save and be retried. Only from the main thread (signals are delivered there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _stop_here() -> bool:
    return _sigterm.is_set() or stop_requested()


def stop_agreed() -> bool:
    """Whether this try is to stop, agreed by every rank: each rank sees the stop file (or its SIGTERM) at its own
    moment, and a checkpoint is a collective, so one all-reduce makes them stop at the same step. Every rank must call
    it at the same points (each step); without a process group it is this process's answer."""
    here = _stop_here()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return here
    import torch

    flag = torch.tensor([1 if here else 0], dtype=torch.int32, device=_collective_device(dist))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _collective_device(dist: Any) -> Any:
    """Where a collective's tensor must live: the GPU for nccl, the CPU for gloo."""
    import torch

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every rank, where there is a process group of more than one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_from_rank_0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one small pickled object), where there is a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def node_folder(name: str) -> str:
    """A local folder of this node for a framework's checkpoints: ``{tmp}/torchelastic/{dag}/{run}/{task}/{map}/
    {name}/node-{GROUP_RANK}``. Per node, because the ranks of one node share a disk and nodes do not (locally, the
    nodes of one task share this machine's, and must not write into each other's folder); per task instance, because
    another task on the same machine must not resume from it."""
    try:
        ctx = current()
        pieces = [ctx.dag_id, ctx.run_id, ctx.task_id, str(ctx.map_index)]
    except NoRunContextError:
        pieces = ["outside-a-task"]
    node = os.environ.get("GROUP_RANK", "0")
    parts = [tempfile.gettempdir(), "torchelastic", *map(safe_path_piece, pieces), safe_path_piece(name)]
    return os.path.join(*parts, f"node-{safe_path_piece(node)}")


def resume_subfolder(subfolder: str, kind: str) -> str | None:
    """``{location}/{subfolder}`` of the run that ``resume_from=`` names, when this task's own location holds no
    checkpoint of ``kind`` there (:func:`~airflow_provider_torchelastic.worker.checkpoint.resume_location`)."""
    from airflow_provider_torchelastic.worker import checkpoint

    def newest(location: str) -> float | None:
        found = checkpoint.latest(f"{location}/{subfolder}", kind=kind)
        return found.committed_at if found is not None else None

    try:
        other = checkpoint.resume_location(newest)
    except NoRunContextError:
        return None
    return f"{other}/{subfolder}" if other is not None else None

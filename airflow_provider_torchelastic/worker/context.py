"""The run context of a training worker: which task instance, which try, which rank, where to checkpoint.

Call :func:`current` from the training function::

    from airflow_provider_torchelastic import context

    ctx = context.current()
    ctx.try_number, ctx.rank, ctx.checkpoint_uri, ctx.has_checkpoint()
    if ctx.stop_requested():  # the pod is being deleted or preempted: save, then return
        ...
    context.heartbeat()  # progress, in a long loop that neither steps an optimizer nor calls report()

Standard library only: it is read in the workers, where there is no Airflow. The task's side (:class:`TaskContext`,
:data:`CONTEXT_ENV`, the locations) is :mod:`airflow_provider_torchelastic.core.run_context`, re-exported here; the
worker's side comes from what torch elastic gives every worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``TORCHELASTIC_RESTART_COUNT``) and from the node's name (``HOSTNAME``, which Kubernetes sets to the pod's name, else
the host name). Outside a task's workers :func:`current` raises :class:`NoRunContextError`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from airflow_provider_torchelastic.core.run_context import (
    CONTEXT_ENV,
    NoRunContextError,
    TaskContext,
    checkpoint_location,
    result_location,
)
from airflow_provider_torchelastic.worker.checkpoint_store import latest_in, open_store
from airflow_provider_torchelastic.worker.liveness import heartbeat, stop_requested

__all__ = [
    "CONTEXT_ENV",
    "NoRunContextError",
    "RunContext",
    "TaskContext",
    "checkpoint_location",
    "current",
    "heartbeat",
    "result_location",
]


@dataclass(frozen=True, kw_only=True)
class RunContext(TaskContext):
    """What a training worker knows about its run: :class:`TaskContext` plus this worker's place in the job."""

    #: Global rank, ``0 <= rank < world_size``.
    rank: int
    #: Rank among the workers of this node.
    local_rank: int
    world_size: int
    #: This node: the pod's name on Kubernetes, the host name locally.
    node: str
    #: How often torch elastic's agent on this node restarted its workers in this try (``max_restarts``); 0 at
    #: first. A pod restarted by the training operator (``OnFailure``/``ExitCode``) starts again at 0.
    restart_count: int = 0

    @property
    def is_last_try(self) -> bool:
        """Whether Airflow gives this task instance no further try if this one fails (as Airflow decides it)."""
        return self.try_number > self.max_tries

    def has_checkpoint(self) -> bool:
        """Whether the checkpoint location holds a complete checkpoint (reads the location; False without one)."""
        if self.checkpoint_uri is None:
            return False
        return latest_in(open_store(self.checkpoint_uri)) is not None

    def stop_requested(self) -> bool:
        """Whether this try is being stopped (the pod deleted or preempted, the task killed): save and return.

        See :func:`airflow_provider_torchelastic.worker.liveness.stop_requested`.
        """
        return stop_requested()


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise NoRunContextError(
            f"{name} is not set: the run context exists only in the workers that torch elastic starts for a "
            "torch_elastic task (call context.current() from the training function, not from the DAG file)"
        )
    try:
        return int(value)
    except ValueError:
        raise NoRunContextError(f"{name}: expected an int, got {value!r}") from None


def current(env: Mapping[str, str] | None = None) -> RunContext:
    """This worker's run context; ``env`` defaults to ``os.environ``.

    Raises :class:`NoRunContextError` outside the workers of a torch_elastic task (no :data:`CONTEXT_ENV`, or no
    torch elastic rank), with a message that says which is missing.
    """
    env = os.environ if env is None else env
    text = env.get(CONTEXT_ENV)
    if not text:
        raise NoRunContextError(
            f"{CONTEXT_ENV} is not set: context.current() works only inside the training function of a "
            "torch_elastic task (TorchElasticOperator or @task.torch_elastic), where the provider sets it"
        )
    task = TaskContext.from_env_value(text)
    fields: dict[str, Any] = asdict(task)
    return RunContext(
        **fields,
        rank=_int_env(env, "RANK"),
        local_rank=_int_env(env, "LOCAL_RANK"),
        world_size=_int_env(env, "WORLD_SIZE"),
        node=env.get("HOSTNAME") or socket.gethostname(),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
    )

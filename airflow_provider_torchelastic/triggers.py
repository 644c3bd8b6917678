"""The trigger that waits for a PyTorchJob (or the single Pod) while the task is deferred.

It drives the same :func:`~airflow_provider_torchelastic.status.watch_job` state machine as the worker does with
``deferrable=False``; only the I/O is async. Its arguments are one frozen dataclass, so ``serialize()`` cannot drift
from ``__init__``, and they carry the connection as resolved on the worker (the triggerer needs no connection).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_torchelastic.status import JobRef, WaitPolicy, watch_job

__all__ = ["EVENT_DONE", "EVENT_ERROR", "TorchElasticJobTrigger", "WatchArgs"]

#: ``event["status"]``: the job ended (``event`` then holds a :class:`~status.WaitDecision`), or waiting failed.
EVENT_DONE: Final = "done"
EVENT_ERROR: Final = "error"


@dataclass(frozen=True, kw_only=True)
class WatchArgs:
    """Everything the trigger needs, JSON-serializable."""

    kind: str
    name: str
    namespace: str
    kubernetes_conn_id: str | None = None
    connection_extras: Mapping[str, Any] | None = None
    config_dict: Mapping[str, Any] | None = None
    cluster_context: str | None = None
    in_cluster: bool | None = None
    poll_interval: float = 10.0
    pending_grace_seconds: float = 120.0
    log_pods: int = 8
    #: Delete the job when a user kills the deferred task (mark failed / clear).
    delete_on_kill: bool = True
    #: Unix time by which the task must end (its ``execution_timeout``); the trigger then deletes the job and
    #: fails the task. Airflow does not enforce ``execution_timeout`` while a task is deferred.
    deadline: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> JobRef:
        return JobRef(kind=self.kind, name=self.name, namespace=self.namespace)

    @property
    def policy(self) -> WaitPolicy:
        return WaitPolicy(
            poll_interval=self.poll_interval, pending_grace_seconds=self.pending_grace_seconds, log_pods=self.log_pods
        )


class TorchElasticJobTrigger(BaseTrigger):
    """Fires once, when the job ended (or waiting for it failed)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        known = {f.name for f in fields(WatchArgs)}
        self.args = WatchArgs(**{k: v for k, v in kwargs.items() if k in known})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", asdict(self.args)

    def _hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        args = self.args
        return AsyncKubernetesHook(
            conn_id=args.kubernetes_conn_id,
            connection_extras=dict(args.connection_extras) if args.connection_extras is not None else None,
            config_dict=dict(args.config_dict) if args.config_dict else None,
            cluster_context=args.cluster_context,
            in_cluster=args.in_cluster,
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_provider_torchelastic.kube import AsyncKube, drive_async

        args = self.args
        try:
            async with self._hook().get_conn() as api:
                waiting = drive_async(watch_job(args.ref, args.policy), AsyncKube(api), self.log.info)
                remaining = None if args.deadline is None else max(0.0, args.deadline - time.time())
                decision = await asyncio.wait_for(waiting, timeout=remaining)
        except TimeoutError:
            self.log.error("execution_timeout reached: deleting %s %s/%s", args.kind, args.namespace, args.name)
            await self._delete()
            yield TriggerEvent({"status": EVENT_ERROR, "message": "execution_timeout reached; the job was deleted"})
            return
        except Exception as e:  # the event carries it to the worker, which fails the task with it
            self.log.exception("Waiting for %s %s failed", self.args.kind, self.args.name)
            yield TriggerEvent({"status": EVENT_ERROR, "message": f"{type(e).__name__}: {e}"})
            return
        yield TriggerEvent({"status": EVENT_DONE, **decision.to_event()})

    async def on_kill(self) -> None:
        """A user marked the deferred task failed or cleared it: the job must not keep the GPUs."""
        if self.args.delete_on_kill:
            await self._delete()

    async def _delete(self) -> None:
        from airflow_provider_torchelastic.kube import AsyncKube
        from airflow_provider_torchelastic.render import payload_configmap_name

        args = self.args
        async with self._hook().get_conn() as api:
            kube = AsyncKube(api)
            deleted = await kube.delete(args.kind, args.name, args.namespace)
            # Owned by the job and garbage-collected with it; explicit where no garbage collector runs.
            await kube.delete("ConfigMap", payload_configmap_name(args.name), args.namespace)
        self.log.info("Deleted %s %s/%s (existed: %s)", args.kind, args.namespace, args.name, deleted)

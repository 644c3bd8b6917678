"""The Airflow side of a cluster connection: a cncf.kubernetes connection read once into a
:class:`~.kubernetes.connection.ClusterConnection`, and the hooks and clients built from it.

The operator, the UI and the preflight call :func:`connect`; the trigger, which carries the settings resolved on the
worker, and the worker's own watch call :func:`async_hook`. So "which cluster, which namespace" is answered once, the
same way, wherever the provider talks to Kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = ["Cluster", "async_hook", "connect", "connection_of"]


def connection_of(conn_id: str, hook: Any) -> ClusterConnection:
    """The connection ``conn_id`` as ``hook`` (a ``KubernetesHook``) reads it, its extras read once."""
    try:
        extras = hook.get_connection(conn_id).extra_dejson
    except Exception:  # no such connection: the hooks' in-cluster / default kubeconfig fallback applies
        extras = None
    return ClusterConnection(conn_id=conn_id, extras=extras)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A cluster reached through an Airflow connection: its settings, its namespace and the hook that reads it."""

    connection: ClusterConnection
    #: The namespace asked for, else the connection's, else ``default``.
    namespace: str
    #: The cncf.kubernetes ``KubernetesHook`` (for the calls the provider's client does not make).
    hook: Any

    def sync_kube(self, *, request_timeout: float | None = None) -> SyncKube:
        """The provider's blocking client over the hook's API client (``request_timeout``: seconds per call)."""
        from airflow_provider_torchelastic.kubernetes.client import SyncKube

        if request_timeout is None:
            return SyncKube(self.hook.api_client)
        return SyncKube(self.hook.api_client, request_timeout=request_timeout)


def connect(conn_id: str, *, namespace: str | None = None) -> Cluster:
    """The cluster of the Airflow connection ``conn_id``, in ``namespace`` (default: the connection's, else
    ``default``). Reads the connection, opens nothing: a client connects on its first call."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    hook = KubernetesHook(conn_id=conn_id)
    connection = connection_of(conn_id, hook)
    return Cluster(connection=connection, namespace=namespace or hook.get_namespace() or "default", hook=hook)


def async_hook(connection: ClusterConnection) -> Any:
    """The cncf.kubernetes ``AsyncKubernetesHook`` for ``connection`` (its ``get_conn()`` opens an API client)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

    return AsyncKubernetesHook(**connection.hook_arguments())

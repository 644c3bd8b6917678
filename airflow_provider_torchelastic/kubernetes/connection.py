"""Where a cluster is and how to reach it: one description, built once, that every reader of the cluster shares.

The operator resolves an Airflow connection into a :class:`ClusterConnection` on the worker (its extras read once,
:mod:`airflow_provider_torchelastic.hooks`), the trigger carries it to the triggerer in its arguments, the UI and the
preflight open theirs the same way, and the sweep's command line describes a kubeconfig with it. The cncf.kubernetes
hooks take these settings as keyword arguments (:meth:`ClusterConnection.hook_arguments`); outside Airflow the
kubeconfig, or the in-cluster service account, is opened directly (:meth:`ClusterConnection.sync_kube`).

Pure apart from :meth:`ClusterConnection.sync_kube`: no Airflow (the sweep runs without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = ["CLUSTER_SOURCES", "ClusterConnection", "chosen_cluster_sources"]

#: The extras of a kubernetes connection that each name a way to reach a cluster; the hook uses one.
CLUSTER_SOURCES: Final = ("in_cluster", "kube_config_path", "kube_config")


def chosen_cluster_sources(extras: Mapping[str, Any]) -> list[str]:
    """The ways to reach a cluster a connection's extras name (either spelling of each key)."""
    return [key for key in CLUSTER_SOURCES if extras.get(key) or extras.get(f"extra__kubernetes__{key}")]


@dataclass(frozen=True, kw_only=True)
class ClusterConnection:
    """The settings that say which cluster to talk to, as the cncf.kubernetes hooks read them. JSON-serializable.

    One source of cluster settings: the Airflow connection ``conn_id`` (with its ``extras`` as read on the worker),
    or an explicit ``config_dict``, or ``in_cluster``, or (outside Airflow) a ``kubeconfig`` file; ``context`` picks
    a kubeconfig context. The hook refuses two sources only when it first connects: this refuses them when built.
    """

    #: The Airflow connection (a ``kubernetes`` connection), or None outside Airflow or with ``config_dict``.
    conn_id: str | None = None
    #: The connection's extras as read where it was resolved; None: not read (no such connection, or not yet), so
    #: that the hook reads the connection itself, or falls back to in-cluster or the default kubeconfig.
    extras: Mapping[str, Any] | None = None
    #: A kubeconfig as a dict, given instead of a connection.
    config_dict: Mapping[str, Any] | None = None
    #: A kubeconfig file, outside Airflow (the sweep's ``--kubeconfig``); None: in-cluster, else ``~/.kube/config``.
    kubeconfig: str | None = None
    #: The kubeconfig context to use (the hook's ``cluster_context``).
    context: str | None = None
    #: Use the pod's service account (the hook's ``in_cluster``); None: as the connection says.
    in_cluster: bool | None = None

    def __post_init__(self) -> None:
        # The cncf.kubernetes hook reads a connection (conn_id) *and* an explicit config_dict, then refuses the pair
        # only when it connects ("mutually exclusive"): say so when the settings are built, naming what to drop.
        if self.config_dict and self.conn_id:
            raise ValueError(
                f"kubernetes_conn_id={self.conn_id!r} and config_dict are both set; expected one source of cluster "
                "settings: pass kubernetes_conn_id=None to use config_dict, or drop config_dict to use the connection"
            )
        if self.config_dict and self.in_cluster:
            raise ValueError("in_cluster=True and config_dict are both set; expected one of them")
        kube_config = [key for key in ("kube_config", "kube_config_path") if (self.extras or {}).get(key)]
        if self.in_cluster and kube_config:
            raise ValueError(
                f"in_cluster=True, but connection {self.conn_id!r} sets {', '.join(kube_config)}; expected one "
                "source of cluster settings"
            )

    def check_one_source(self) -> None:
        """Refuse a connection whose extras name two ways to reach a cluster (``ValueError``), before anything is
        created: the hook refuses the pair itself, but only when it first connects."""
        chosen = chosen_cluster_sources(self.extras or {})
        if len(chosen) > 1:
            raise ValueError(
                f"connection {self.conn_id!r} sets {' and '.join(chosen)}; expected one of "
                f"{', '.join(CLUSTER_SOURCES)} (the Kubernetes hook cannot use more than one); fix the connection (a "
                "retry will not help)"
            )

    def hook_arguments(self) -> dict[str, Any]:
        """The keyword arguments of a cncf.kubernetes ``AsyncKubernetesHook`` for these settings."""
        return {
            "conn_id": self.conn_id,
            # Also this one: the hook falls back to ``kubernetes_default`` when it is left out, so that without it
            # settings with config_dict alone would read the default connection beside it.
            "kubernetes_conn_id": self.conn_id,
            "connection_extras": dict(self.extras) if self.extras is not None else None,
            "config_dict": dict(self.config_dict) if self.config_dict else None,
            "cluster_context": self.context,
            "in_cluster": self.in_cluster,
        }

    def sync_kube(self) -> SyncKube:
        """A blocking client outside Airflow (the sweep's command line): ``kubeconfig``, else in-cluster, else
        ``~/.kube/config``. An Airflow connection is opened through its hook instead (:mod:`..hooks`)."""
        if self.conn_id is not None or self.config_dict is not None:
            raise ValueError(
                "ClusterConnection.sync_kube: expected a kubeconfig or in-cluster settings, got "
                f"conn_id={self.conn_id!r} or a config_dict; an Airflow connection is opened with "
                "airflow_provider_torchelastic.hooks.connect"
            )
        from airflow_provider_torchelastic.kubernetes.client import sync_kube_from_config

        return sync_kube_from_config(self.kubeconfig, self.context)

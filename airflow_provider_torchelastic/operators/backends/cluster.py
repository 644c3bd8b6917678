"""A Kubernetes task's cluster and its client, from the task's Airflow connection, with what goes wrong typed: a
connection that cannot give a client is the same at every try (``ConfigurationError``), one Airflow cannot find may be
a secrets backend's outage (``InfrastructureError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_provider_torchelastic.hooks import connect
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError, InfrastructureError

if TYPE_CHECKING:
    from airflow_provider_torchelastic.hooks import Cluster
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = ["cluster_client", "task_cluster"]


def task_cluster(conn_id: str, namespace: str | None) -> Cluster:
    """The task's cluster, or an ``InfrastructureError`` when Airflow finds no such connection. Only the default
    connection may be missing (the hook then uses the worker's own cluster), so a mistyped ``kubernetes_conn_id`` never
    reaches some other cluster. Retried, as KubernetesPodOperator's is: Airflow also says "isn't defined" when every
    secrets backend failed to answer (it logs their errors at debug level and moves on), which a retry can outlast."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return connect(conn_id, namespace=namespace)
    except AirflowNotFoundException as e:
        raise InfrastructureError(
            f"kubernetes_conn_id={conn_id!r}: Airflow found no such connection ({e}). Either it is not defined (create "
            "it or fix the name; only 'kubernetes_default' may be left undefined, for the worker's in-cluster service "
            "account or default kubeconfig), or the secrets backend that holds it did not answer, which Airflow "
            "reports the same way, and a retry can help"
        ) from e


def cluster_client(cluster: Cluster) -> SyncKube:
    """The cluster's client, or a ``ConfigurationError``: building one sends nothing, so a failure is the connection's
    and the same at every try, not for Airflow's retries (as the library's ``ConfigException`` would be)."""
    try:
        cluster.connection.check_one_source()  # the hook refuses two ways to a cluster only once it connects
    except ValueError as e:
        raise ConfigurationError(str(e)) from e
    try:
        return cluster.sync_kube()
    except Exception as e:  # ConfigException, the hook's AirflowException, OSError for a kubeconfig path
        raise ConfigurationError(
            f"connection {cluster.connection.conn_id!r} gives no Kubernetes client ({type(e).__name__}: {e}): set its "
            "in_cluster, kube_config_path or kube_config extra, or run the Airflow worker in a pod with a service "
            "account (torchelastic-preflight --conn-id checks a connection)"
        ) from e

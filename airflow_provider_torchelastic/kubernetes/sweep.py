"""The backstop for jobs that outlived their task instance: delete what ran past its try's deadline.

Whoever waits for a job deletes it at the try's deadline (``execution_timeout``), and a new try deletes the job an
earlier try left (:func:`~.submit.stop_earlier_try`). What neither reaches: a deferred try marked failed before any
triggerer picked up its trigger (Airflow deletes the trigger row; ``on_kill`` never runs), a worker killed while it
waited on its last try, a deleted DAG run. So the job a try creates carries the try's deadline as the label
:data:`NOT_AFTER_LABEL` (on the job object only, not on the pods a PyTorchJob makes, so that one list call finds the
jobs and nothing else), and :func:`sweep_namespace` deletes the provider's jobs that still run
:data:`GRACE_SECONDS` past it.

Why this backstop and not another:

* A PyTorchJob's ``runPolicy.activeDeadlineSeconds`` is checked only when an event makes the training operator
  reconcile the job, so a quiet job overruns it.
* A pod's ``activeDeadlineSeconds`` kills with exit code 137, which ``OnFailure`` and ``ExitCode`` restart policies
  restart, with a new clock.
* The decision needs nothing but the object itself (no Airflow database, no trigger row, no Airflow process): the
  sweep runs wherever a task of the namespace submits (the next task of the connection), and as
  ``python -m airflow_provider_torchelastic.kubernetes.sweep`` (a CronJob in the cluster, a cron on any host), which
  imports no Airflow.

A task without ``execution_timeout`` has no deadline: its job gets a lease instead (``[torch_elastic] job_lease``,
an hour by default), the same label set to the end of the lease, which whoever waits for the job (the worker, or
the trigger) moves forward while it waits (:func:`lease_due`, on the job object itself: the provider may patch its
own jobs, and reads no other object to decide). A try that is gone renews nothing, and its job is swept once the
lease has run out.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY, MANAGED_SELECTOR
from airflow_provider_torchelastic.core.public import command_name
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection

# The label and its reading live below the waiters (the wait core renews leases): re-exported here, where they are
# used most.
from airflow_provider_torchelastic.kubernetes.deadline import (
    NOT_AFTER_LABEL,
    lease_due,
    lease_labels,
    not_after,
    with_deadline,
)
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import SyncKube

__all__ = [
    "GRACE_SECONDS",
    "NOT_AFTER_LABEL",
    "lease_due",
    "lease_labels",
    "main",
    "not_after",
    "overdue",
    "sweep_namespace",
    "with_deadline",
]

#: What the sweep lists: the provider's objects that carry a deadline.
SELECTOR: Final = f"{MANAGED_SELECTOR},{NOT_AFTER_LABEL}"
#: How long past its deadline a job may still run before the sweep deletes it: the waiter itself deletes it at the
#: deadline, so the sweep only acts once that has clearly not happened.
GRACE_SECONDS: Final = 300.0

Log = Callable[..., None]


def overdue(kind: kinds.JobKind, job: Mapping[str, Any], *, now: float, grace: float = GRACE_SECONDS) -> bool:
    """Whether the sweep deletes ``job``: the provider's, still running, and ``grace`` seconds past its deadline.

    A finished job is never swept: it holds no pods that run, and ``on_finish_action="keep"`` may have kept it.
    """
    metadata = job.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    if not isinstance(labels, Mapping) or labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return False
    deadline = not_after(job)
    return deadline is not None and now >= deadline + grace and not kind.is_finished(job)


def sweep_namespace(
    kube: SyncKube, namespace: str, *, now: float | None = None, dry_run: bool = False, info: Log, warning: Log
) -> list[JobRef]:
    """Delete the provider's jobs in ``namespace`` that still run past their deadline; the jobs it deleted (or, with
    ``dry_run``, would delete). One list call per job kind."""
    from airflow_provider_torchelastic.kubernetes.client import retry_sync

    now = time.time() if now is None else now
    swept: list[JobRef] = []
    for kind in kinds.registered():
        try:
            jobs = retry_sync(functools.partial(kube.list_kind, kind.kind, namespace, SELECTOR), warning)
        except KubeError as e:
            why = kind.unlisted_because(e)
            if why is None:
                raise
            if why == kinds.DENIED:  # the other kinds are still swept
                warning("Cannot list %s in %s (%s): jobs of that kind are not swept; see deploy/rbac.yaml", kind.kind,
                        namespace, e)  # fmt: skip
            continue
        for job in jobs:
            if not overdue(kind, job, now=now):
                continue
            ref = JobRef(kind=kind.kind, name=str(job["metadata"]["name"]), namespace=namespace)
            late = now - (not_after(job) or now)
            info(
                "%s %s/%s is still running %.0f s past its task's deadline or lease: %s it (the task instance is over)",
                ref.kind,
                ref.namespace,
                ref.name,
                late,
                "would delete" if dry_run else "deleting",
            )
            if not dry_run:
                retry_sync(functools.partial(kube.delete_job, ref), warning)
            swept.append(ref)
    return swept


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m airflow_provider_torchelastic.kubernetes.sweep --namespace NS [--kubeconfig PATH]``."""
    parser = argparse.ArgumentParser(
        prog=command_name("torchelastic-sweep", "airflow_provider_torchelastic.kubernetes.sweep"),
        description="Delete the provider's jobs that still run past their task's deadline (execution_timeout), or "
        "past their lease (a task without one: its waiter renews the lease while it waits).",
    )
    parser.add_argument("--namespace", required=True, action="append", help="a namespace to sweep (repeatable)")
    parser.add_argument("--kubeconfig", help="a kubeconfig file; default: in-cluster, else ~/.kube/config")
    parser.add_argument("--context", help="the kubeconfig context to use")
    parser.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    args = parser.parse_args(argv)

    def say(message: str, *values: object) -> None:
        print(message % values if values else message, flush=True)

    kube = ClusterConnection(kubeconfig=args.kubeconfig, context=args.context).sync_kube()
    swept = [
        ref
        for namespace in args.namespace
        for ref in sweep_namespace(kube, namespace, dry_run=args.dry_run, info=say, warning=say)
    ]
    say("%d job(s) %s", len(swept), "to delete" if args.dry_run else "deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The preflight: what a cluster can run for this provider, and what to fix, before the first task fails.

    python -m airflow_provider_torchelastic.preflight --conn-id kubernetes_default --namespace ml [--smoke] [--json]

or :func:`run_preflight` from a DAG task or a test. It asks the API, through the connection the tasks use (opened by
:func:`~airflow_provider_torchelastic.hooks.connect`, as the operator opens it), which job kinds are served, whether the
identity may do each thing the provider does (SelfSubjectAccessReviews of the rules in ``deploy/rbac.yaml``, and, as
optional rows, ``deploy/rbac-ui.yaml``), whether a Kueue LocalQueue exists (``--queue``), the server version, and with
``--smoke`` whether the image runs a one-pod job of this provider's payload format. What each answer means is decided in
:mod:`airflow_provider_torchelastic.kubernetes.preflight` (pure); this module is the Airflow side and the I/O.

Exit status: 0 when everything the provider needs is there, 1 when something it needs is missing or could not be
confirmed (optional rows never fail it), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Final

from airflow_provider_torchelastic.core.config import Elastic
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.payload import dump_payload
from airflow_provider_torchelastic.core.public import command_name
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.hooks import connect
from airflow_provider_torchelastic.kubernetes import discovery, kinds
from airflow_provider_torchelastic.kubernetes import preflight as decide
from airflow_provider_torchelastic.kubernetes.client import SyncKube
from airflow_provider_torchelastic.kubernetes.preflight import Check, Report, Rule
from airflow_provider_torchelastic.kubernetes.render import payload_secret_owner_reference, render_manifests
from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, WaitPolicy

__all__ = ["DEFAULT_CONN_ID", "PreflightError", "check_cluster", "main", "run_preflight"]

DEFAULT_CONN_ID: Final = "kubernetes_default"
#: How long the smoke job may take from creation to its end: a pulled image runs it in seconds, a cold pull of a
#: CUDA image takes minutes (raise --smoke-timeout for that).
SMOKE_TIMEOUT: Final = 180.0
_SMOKE_DAG_ID: Final = "torchelastic_preflight"

Log = Callable[[str], None]


class PreflightError(Exception):
    """The preflight could not start: the connection is unusable."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_preflight(
    *,
    conn_id: str = DEFAULT_CONN_ID,
    namespace: str | None = None,
    smoke: bool = False,
    image: str | None = None,
    queue: str | None = None,
    smoke_timeout: float = SMOKE_TIMEOUT,
    log: Log = _stderr,
) -> Report:
    """The report for the Airflow connection ``conn_id`` in ``namespace`` (default: the connection's, else
    ``default``). ``image`` (default ``[torch_elastic] image``) is what ``smoke`` runs. Raises
    :class:`PreflightError` when the connection cannot be used at all."""
    try:
        cluster = connect(conn_id, namespace=namespace)
        namespace, kube = cluster.namespace, cluster.sync_kube()
    except Exception as e:  # the hook raises AirflowException, config errors, OSError: all mean the same here
        raise PreflightError(f"connection {conn_id!r} cannot be used: {type(e).__name__}: {e}") from e
    if smoke and image is None:
        image = _configured_image()
    return check_cluster(
        kube,
        namespace,
        smoke=smoke,
        image=image,
        queue=queue,
        smoke_timeout=smoke_timeout,
        log=log,
        source=f"connection {conn_id}",
    )


def _configured_image() -> str | None:
    # Imported when used, as Airflow is above: check_cluster, given a client and an image, needs neither.
    from airflow_provider_torchelastic.settings import read_image_option

    return read_image_option()


def check_cluster(
    kube: SyncKube,
    namespace: str,
    *,
    smoke: bool = False,
    image: str | None = None,
    queue: str | None = None,
    smoke_timeout: float = SMOKE_TIMEOUT,
    log: Log = _stderr,
    source: str = "",
) -> Report:
    """Every check against ``kube`` in ``namespace``: the version, each kind's API (and CRD), the provider's RBAC
    rules for the served kinds, the UI's (optional), the LocalQueue ``queue``, and the smoke job."""
    checks: list[Check] = [_version(kube)]
    served: list[kinds.JobKind] = []
    alternatives = {kinds.PYTORCHJOB.kind, kinds.TRAINJOB.kind}
    apis = decide.with_alternatives({kind: _api(kube, kind) for kind in kinds.registered()}, alternatives)
    for kind in kinds.registered():
        api = apis[kind.kind]
        checks.append(api)
        if not kind.is_core:
            checks.append(_crd(kube, kind))
        if api.result is decide.Result.OK:
            served.append(kind)
    # The rules of the kinds the cluster serves: an unserved kind's row above says what to install first.
    checks.extend(_access(kube, rule, namespace, required=True) for rule in decide.provider_rules(served))
    checks.extend(_access(kube, rule, namespace, required=False) for rule in decide.ui_rules(served))
    if queue:
        checks.append(_queue(kube, queue, namespace))
    if smoke:
        checks.append(_smoke(kube, namespace, image, smoke_timeout, log))
    return Report(namespace=namespace, checks=tuple(checks), source=source)


def _version(kube: SyncKube) -> Check:
    try:
        return decide.version_check(kube.send(discovery.server_version()))
    except KubeError as e:
        return decide.version_check(None, str(e))


def _api(kube: SyncKube, kind: kinds.JobKind) -> Check:
    try:
        return decide.api_check(kind, kube.served_resources(kind.group, kind.version))
    except KubeError as e:
        return decide.api_check(kind, None, str(e))


def _crd(kube: SyncKube, kind: kinds.JobKind) -> Check:
    try:
        return decide.crd_check(kind, kube.send(discovery.crd(f"{kind.plural}.{kind.group}")))
    except KubeError as e:
        return decide.crd_check(kind, None, e.status, str(e))


def _access(kube: SyncKube, rule: Rule, namespace: str, *, required: bool) -> Check:
    answers: dict[str, bool | None] = {}
    errors: dict[str, str] = {}
    for verb in rule.verbs:
        try:
            review = discovery.access_review(verb, rule.plain_resource, rule.group, namespace, rule.subresource)
            answers[verb] = kube.send(review)
        except KubeError as e:
            answers[verb] = None
            errors[verb] = f"SelfSubjectAccessReview failed: {e}"
    return decide.access_check(rule, answers, namespace=namespace, required=required, errors=errors)


def _queue(kube: SyncKube, queue: str, namespace: str) -> Check:
    group, version, plural = decide.KUEUE_GROUP, decide.KUEUE_VERSION, decide.KUEUE_PLURAL
    try:
        resources = kube.served_resources(group, version)
    except KubeError as e:
        return decide.queue_check(queue, namespace, served=True, found=None, error=f"discovery failed: {e}")
    if resources is None or plural not in resources:
        return decide.queue_check(queue, namespace, served=False, found=None)
    try:
        found = kube.send(discovery.custom_object(group, version, plural, queue, namespace)) is not None
    except KubeError as e:
        return decide.queue_check(queue, namespace, served=True, found=None, error=str(e))
    return decide.queue_check(queue, namespace, served=True, found=found)


def _smoke_callable() -> Callable[[], dict[str, bool]]:
    # A nested function: cloudpickle ships it by value (its qualified name resolves in no module), so the runner
    # needs nothing of this module, only the payload format.
    def preflight_smoke() -> dict[str, bool]:
        return {"ok": True}

    return preflight_smoke


def _smoke(kube: SyncKube, namespace: str, image: str | None, timeout: float, log: Log) -> Check:
    """One Pod job through the operator's render path and wait core; whatever it created is deleted."""
    if not image:
        return decide.smoke_check(None, succeeded=False, detail="")
    identity = RunIdentity(dag_id=_SMOKE_DAG_ID, task_id="smoke", run_id=f"preflight-{uuid.uuid4().hex[:12]}")
    try:
        secret, pod = render_manifests(
            Elastic(nnodes=1, nproc_per_node=1),
            identity=identity,
            namespace=namespace,
            image=image,
            payload=dump_payload(_smoke_callable()),
            renderer=kinds.POD.render,
        )
    except (TypeError, ValueError) as e:
        return decide.smoke_check(image, succeeded=False, detail=str(e), submitted=False)
    ref = JobRef(kind=kinds.POD.kind, name=pod["metadata"]["name"], namespace=namespace)
    try:
        try:
            kube.create(secret)
            created = kube.create(pod)
            owner = payload_secret_owner_reference(
                owner_name=ref.name, owner_uid=created["metadata"]["uid"], kind=ref.kind
            )
            kube.patch_secret(secret["metadata"]["name"], namespace, owner)
        except KubeError as e:
            return decide.smoke_check(image, succeeded=False, detail=f"could not create it: {e}", submitted=False)
        log(f"[smoke] created Pod {namespace}/{ref.name} ({image})")
        policy = WaitPolicy(
            poll_interval=1.0,
            pending_grace_seconds=min(60.0, timeout),
            deadline=time.time() + timeout,
            finish_action="delete",
            progress_interval=30.0,
        )
        decision = drive_sync(wait_for_job(ref, policy), kube, lambda line: log(f"[smoke] {line}"))
        succeeded = decision.phase is Phase.SUCCEEDED
        return decide.smoke_check(image, succeeded=succeeded, detail=decision.verdict_detail)
    finally:
        # Always, whatever the wait did: a preflight leaves nothing behind.
        try:
            kube.delete_job(ref)
        except KubeError as e:
            log(f"[smoke] could not delete Pod {namespace}/{ref.name} and its payload Secret: {e}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name("torchelastic-preflight", "airflow_provider_torchelastic.preflight"),
        description="Say what a Kubernetes cluster can run for airflow-provider-torchelastic, and what to fix.",
        epilog="Exit status: 0 ready, 1 something the provider needs is missing, 2 bad usage.",
    )
    parser.add_argument("--conn-id", default=DEFAULT_CONN_ID, help="the Airflow kubernetes connection (%(default)s)")
    parser.add_argument("--namespace", default=None, help="where jobs run (default: the connection's, else default)")
    parser.add_argument("--smoke", action="store_true", help="also run a one-pod job of the image, and delete it")
    parser.add_argument("--image", default=None, help="the image --smoke runs (default: [torch_elastic] image)")
    parser.add_argument("--smoke-timeout", type=float, default=SMOKE_TIMEOUT, help="seconds (%(default)s)")
    parser.add_argument("--queue", default=None, help="a Kueue LocalQueue the jobs will name (optional)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Every option but --json is the run_preflight() parameter of its name: a new option is one add_argument().
    options = vars(_parser().parse_args(argv))
    as_json = options.pop("json")
    try:
        # stdout is the report's alone (``--json | jq``): whatever Airflow logs while it loads goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            report = run_preflight(**options)
    except PreflightError as e:
        print(f"preflight: {e}", file=sys.stderr)
        return decide.EXIT_MISSING
    sys.stdout.write(report.to_json() + "\n" if as_json else report.to_table())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())

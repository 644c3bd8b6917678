"""The objects one try of a task creates, and what the operator shows of them: the kind's job object from the
shared building blocks of :mod:`.pod_template`, with the payload Secret in front.

The operator's call::

    manifests = render_manifests(
        config,                     # Elastic(...) | PyTorch(...), the task_config
        identity=identity,          # naming.RunIdentity(dag_id, task_id, run_id, map_index, try_number);
                                    #   naming.placeholder_identity(dag_id, task_id) when there is no run
        namespace="ml",             # where everything is created
        image="repo/train:1.0",     # the operator's image; Master/Worker(image=...) override it; may be None
                                    #   when every replica (or the pod_template's pytorch container) names one
        default_image=None,         # the last resort, [torch_elastic] image: used where nothing above names one
        payload=payload_bytes,      # the serialized function and arguments, mounted at PAYLOAD_PATH
        pod_options=PodOptions(),   # operator-level pod customization, or None
        job_options=JobOptions(),   # PyTorchJob-only settings (schedulingPolicy, suspend), or None
    )
    # -> [Secret, PyTorchJob] or [Secret, Pod], in creation order (the Secret holds the payload)

After creating the second object, apply its kind's ``owner_reference(...)`` to the Secret as a merge patch, so
that Kubernetes garbage-collects the payload with the job. ``check_renderable(...)`` runs the same rendering with a
placeholder identity, for the operator's constructor: an invalid combination fails while the DAG file is parsed.
Which kind a config becomes is decided in one place, :func:`kinds.for_config`, at parse time and at run time alike.
Pure: no I/O, no Airflow, kubernetes or torch.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Final

from airflow_provider_torchelastic.core.config import TaskConfig, check_task_config
from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV as METRICS_INTERVAL_ENV
from airflow_provider_torchelastic.core.naming import (
    DNS_1123_LABEL,
    RunIdentity,
    identity_annotations,
    identity_labels,
    job_name,
    placeholder_identity,
)
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext
from airflow_provider_torchelastic.core.stall import DEFAULT_GRACE_PERIOD, DEFAULT_STALL_TIMEOUT, liveness_env
from airflow_provider_torchelastic.core.validation import check_image
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.kinds import JobKind
from airflow_provider_torchelastic.kubernetes.pod_template import (
    JsonDict,
    RenderInputs,
    invalid,
    payload_secret_name,
    render_payload_secret,
)

__all__ = [
    "UI_FOOTER",
    "UI_SUMMARY_LIMIT",
    "check_renderable",
    "elide_payload",
    "payload_secret_owner_reference",
    "render_manifests",
    "summarize_for_ui",
    "task_context_for",
    "to_yaml",
]

#: What ``summarize_for_ui`` guarantees; Airflow truncates rendered fields at 4096 characters.
UI_SUMMARY_LIMIT: Final = 4000
UI_FOOTER: Final = "# full manifest: XCom 'manifests' and the task log"


def render_manifests(
    config: TaskConfig,
    *,
    identity: RunIdentity,
    namespace: str,
    image: str | None,
    payload: bytes,
    pod_options: PodOptions | None = None,
    job_options: JobOptions | None = None,
    renderer: Callable[[RenderInputs], JsonDict] | None = None,
    default_image: str | None = None,
    require_image: bool = True,
    task_context: TaskContext | None = None,
    result_url: str | None = None,
    report_interval: float | None = None,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    grace_period: float = DEFAULT_GRACE_PERIOD,
) -> list[JsonDict]:
    """The objects one try of a task creates, in creation order: ``[Secret, PyTorchJob]`` or ``[Secret, Pod]``.

    ``renderer`` renders the job object; by default the kind that runs the config (:func:`kinds.for_config`), the
    same one the operator submits and waits for.

    Each pod's image is, most specific first: its replica's (``Master``/``Worker(image=...)``), ``image``, the pod
    template's ``pytorch`` container's, ``default_image``. A pod with none is an error unless ``require_image`` is
    False (a parse-time check, where the image may come at run time): objects rendered so are checked, not submitted.

    ``task_context`` (the try's context: retries, logical date, checkpoint location) reaches every pod's ``pytorch``
    container as one variable, ``TORCHELASTIC_CONTEXT``; by default the identity's alone. It must name the same task
    instance and try as ``identity``. ``result_url`` goes on the runner's command line: where the node holding rank 0
    writes a result too large for the termination message. ``stall_timeout`` and ``grace_period`` reach the runner
    (and the pods' ``terminationGracePeriodSeconds``): see :mod:`airflow_provider_torchelastic.core.stall`.
    """
    config = check_task_config(config)
    _check_arguments(identity, namespace, image, default_image, pod_options, job_options)
    task_context = _checked_task_context(identity, task_context)
    name = job_name(identity)
    options = pod_options or PodOptions()
    labels = identity_labels(identity)
    annotations = identity_annotations(identity)
    secret = render_payload_secret(
        name=payload_secret_name(name),
        namespace=namespace,
        payload=payload,
        labels={**options.labels, **labels},
        annotations={**options.annotations, **annotations},
    )
    inputs = RenderInputs(
        config=config,
        name=name,
        namespace=namespace,
        image=image,
        options=options,
        job_options=job_options or JobOptions(),
        labels=labels,
        annotations=annotations,
        payload_secret=secret["metadata"]["name"],
        default_image=default_image,
        image_required=require_image,
        worker_env=_worker_env(task_context, report_interval, stall_timeout, grace_period),
        result_url=result_url,
        # The pods run only the payload this try wrote, whoever wrote the Secret they mount.
        payload_sha256=hashlib.sha256(payload).hexdigest(),
    )
    workload = (renderer or kinds.for_config(config).render)(inputs)
    return [secret, workload]


def _check_arguments(
    identity: RunIdentity,
    namespace: str,
    image: str | None,
    default_image: str | None,
    pod_options: PodOptions | None,
    job_options: JobOptions | None,
) -> None:
    if not isinstance(identity, RunIdentity):
        raise TypeError(f"identity: expected a RunIdentity(...), got {identity!r}")
    if not isinstance(namespace, str) or not DNS_1123_LABEL.match(namespace):
        raise invalid("namespace", namespace, "a namespace name (a DNS-1123 label)")
    # Rendered values only: a "{{ ... }}" left in an image is refused here, never submitted.
    check_image("", "image", image)
    check_image("", "default_image", default_image)
    if pod_options is not None and not isinstance(pod_options, PodOptions):
        raise TypeError(f"pod_options: expected a PodOptions(...) or None, got {pod_options!r}")
    if job_options is not None and not isinstance(job_options, JobOptions):
        raise TypeError(f"job_options: expected a JobOptions(...) or None, got {job_options!r}")


def _checked_task_context(identity: RunIdentity, task_context: TaskContext | None) -> TaskContext:
    """``task_context``, or the identity's own when None; one that names another task instance or try is refused."""
    if task_context is None:
        return task_context_for(identity)
    if not isinstance(task_context, TaskContext):
        raise TypeError(f"task_context: expected a TaskContext(...) or None, got {task_context!r}")
    if task_context_for(identity) != replace(
        task_context,
        max_tries=max(0, identity.try_number - 1),
        logical_date=None,
        checkpoint_uri=None,
        artifact_uri=None,
    ):
        # Only the identity's fields are compared: the run adds its retries, date and storage locations.
        raise invalid("task_context", task_context, f"the task instance and try of the identity {identity!r}")
    return task_context


def _worker_env(
    task_context: TaskContext, report_interval: float | None, stall_timeout: float | None, grace_period: float
) -> list[JsonDict]:
    """The ``pytorch`` container's variables that every pod of the try gets: its context, and the runner's knobs."""
    return [
        {"name": CONTEXT_ENV, "value": task_context.to_env_value()},
        # Seconds between rank 0's metrics lines ([torch_elastic] report_interval); unset: report()'s default.
        *([{"name": METRICS_INTERVAL_ENV, "value": f"{report_interval:g}"}] if report_interval is not None else []),
        # The runner's stall detection and graceful stop.
        *({"name": name, "value": value} for name, value in liveness_env(stall_timeout, grace_period).items()),
    ]


def task_context_for(identity: RunIdentity) -> TaskContext:
    """The context of a try known only by its identity: its last try, no logical date, no checkpoint location."""
    return TaskContext(
        dag_id=identity.dag_id,
        task_id=identity.task_id,
        run_id=identity.run_id,
        map_index=identity.map_index,
        try_number=identity.try_number,
        max_tries=max(0, identity.try_number - 1),
    )


def check_renderable(
    config: TaskConfig,
    *,
    image: str | None,
    pod_options: PodOptions | None = None,
    job_options: JobOptions | None = None,
    dag_id: str = "dag",
    task_id: str = "task",
    namespace: str = "default",
    default_image: str | None = None,
    require_image: bool = True,
    renderer: Callable[[RenderInputs], JsonDict] | None = None,
) -> list[JsonDict]:
    """Render once with a placeholder identity and an empty payload, so that conflicts fail at DAG-parse time; the
    manifests (the workload last), for checks that read them.

    ``require_image=False`` where the image is only known at run time (a templated or mapped image, or an execution
    mode read from the configuration then): everything else is still checked. ``renderer``: the kind's, where it is
    known at parse time (else :func:`kinds.for_config`'s).
    """
    return render_manifests(
        config,
        identity=placeholder_identity(dag_id, task_id),
        namespace=namespace,
        image=image,
        payload=b"",
        pod_options=pod_options,
        job_options=job_options,
        default_image=default_image,
        require_image=require_image,
        renderer=renderer,
    )


def to_yaml(documents: Sequence[Any]) -> str:
    """JSON-shaped documents as block-style YAML, each opened by ``---``, keys in their given order.

    PyYAML comes with Airflow; it is imported here, not with this module, so that rendering stays cheap and
    dependency-free for the runner and for DAG parsing.
    """
    import yaml

    text: str = yaml.safe_dump_all(
        list(documents), explicit_start=True, sort_keys=False, default_flow_style=False, width=120
    )
    return text


def elide_payload(manifest: JsonDict) -> JsonDict:
    """The manifest with the payload bytes replaced by their size (for logs, XComs and the UI)."""
    # A ConfigMap's binaryData: what manifests XComs written before the payload became a Secret hold.
    field = _PAYLOAD_FIELDS.get(str(manifest.get("kind")))
    if field is None or field not in manifest:
        return manifest
    elided = copy.deepcopy(manifest)
    for key, data in elided[field].items():
        if data.startswith("<"):
            continue  # elided already (a manifest read back from the XCom); "<" is not in the base64 alphabet
        elided[field][key] = f"<{len(base64.b64decode(data))} bytes, cloudpickle payload>"
    return elided


#: Where the payload object of each form keeps its bytes.
_PAYLOAD_FIELDS: Final = {"Secret": "data", "ConfigMap": "binaryData"}


def _digest(manifest: JsonDict) -> JsonDict:
    """The parts of a big workload a reader looks for first: what runs where, with which resources."""
    digest: JsonDict = {"apiVersion": manifest.get("apiVersion"), "kind": manifest.get("kind")}
    digest["metadata"] = {
        key: manifest["metadata"][key] for key in ("name", "namespace") if key in manifest["metadata"]
    }
    kind = _kind_of(manifest)
    digest["spec"] = kind.digest_spec(manifest) if kind is not None else manifest.get("spec", {})
    return digest


def _kind_of(manifest: JsonDict) -> JobKind | None:
    """The descriptor of a rendered object, or None for a kind this process does not know (shown as it is)."""
    try:
        return kinds.get(str(manifest.get("kind")))
    except ValueError:
        return None


def _abbreviate(manifest: JsonDict) -> JsonDict:
    kind = _kind_of(manifest)
    return kind.abbreviate(manifest) if kind is not None else manifest


def summarize_for_ui(manifests: Sequence[JsonDict], *, limit: int = UI_SUMMARY_LIMIT) -> str:
    """YAML for the operator's rendered-template field: at most ``limit`` characters, ending with where the rest is.

    Tries, in order: every object (payload bytes elided); the workload alone; the workload with repetition folded
    (template metadata the job carries too, a template identical to an earlier replica's); a digest of it (images,
    resources, replicas, policies); and finally a cut digest. The last line always says where the full manifest is.
    """
    footer = UI_FOOTER + "\n"
    budget = limit - len(footer)
    workloads = [m for m in manifests if m.get("kind") not in _PAYLOAD_FIELDS]
    for candidate in (
        [elide_payload(m) for m in manifests],
        workloads,
        [_abbreviate(m) for m in workloads],
        [_digest(m) for m in workloads],
    ):
        text = to_yaml(candidate)
        if len(text) <= budget:
            return text + footer
    marker = "# ... cut to fit the rendered-template view\n"
    cut = text[: budget - len(marker)]
    return cut[: cut.rfind("\n") + 1] + marker + footer


def payload_secret_owner_reference(*, owner_name: str, owner_uid: str, kind: str) -> JsonDict:
    """The merge-patch body that makes the payload Secret a dependent of the created job of ``kind`` (any kind in
    the table: :meth:`JobKind.owner_reference`)."""
    return kinds.get(kind).owner_reference(owner_name=owner_name, owner_uid=owner_uid)

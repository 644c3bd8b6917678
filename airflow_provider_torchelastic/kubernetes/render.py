"""Render a task into the Kubernetes objects it creates: pure functions returning plain dicts.

No I/O and no airflow, kubernetes or torch imports: the same inputs always give the same objects, so what the
operator shows (``TorchElasticOperator.render_manifests()``) is exactly what it submits.

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
    # -> [ConfigMap, PyTorchJob] or [ConfigMap, Pod], in creation order

After creating the second object, apply ``payload_configmap_owner_reference(...)`` to the ConfigMap as a merge patch,
so that Kubernetes garbage-collects the payload with the job. ``check_renderable(...)`` runs the same rendering with
a placeholder identity, for the operator's constructor: an invalid combination fails while the DAG file is parsed.

Which object a config becomes is decided once, by ``workload_for``; each workload has one renderer in
``_RENDERERS``. That is the seam where a Kubeflow Trainer v2 ``TrainJob`` backend would be added.
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.core.config import Elastic, Master, TaskConfig, Worker, check_task_config
from airflow_provider_torchelastic.core.launch import config_to_launch_spec, nccl_env_defaults, runner_command
from airflow_provider_torchelastic.core.metrics_format import INTERVAL_ENV as METRICS_INTERVAL_ENV
from airflow_provider_torchelastic.core.naming import (
    TRAINING_CONTAINER,
    RunIdentity,
    identity_annotations,
    identity_labels,
    job_name,
    placeholder_identity,
)
from airflow_provider_torchelastic.core.payload import IMAGE_ENV
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions, merge_pod_options
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext
from airflow_provider_torchelastic.core.validation import check_image

__all__ = [
    "CONTAINER_NAME",
    "MAX_CONFIGMAP_BYTES",
    "PAYLOAD_PATH",
    "PORT_NAME",
    "RESULT_FILE",
    "Workload",
    "check_renderable",
    "payload_configmap_name",
    "payload_configmap_owner_reference",
    "render_manifests",
    "render_payload_configmap",
    "summarize_for_ui",
    "workload_for",
]

JsonDict: TypeAlias = dict[str, Any]

PYTORCHJOB_GROUP: Final = "kubeflow.org"
PYTORCHJOB_VERSION: Final = "v1"
PYTORCHJOB_API_VERSION: Final = f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}"
PYTORCHJOB_KIND: Final = "PyTorchJob"
PYTORCHJOB_PLURAL: Final = "pytorchjobs"

#: The training operator reads only this container's exit code and builds Services and env from its ports.
CONTAINER_NAME: Final = TRAINING_CONTAINER
#: The port the operator looks up for the rendezvous/master endpoint ("port not found" without it).
PORT_NAME: Final = "pytorchjob-port"
DEFAULT_PORT: Final = 23456

PAYLOAD_VOLUME: Final = "torchelastic-payload"
PAYLOAD_DIR: Final = "/var/run/torchelastic"
PAYLOAD_KEY: Final = "payload"
PAYLOAD_PATH: Final = f"{PAYLOAD_DIR}/{PAYLOAD_KEY}"
#: The runner writes rank 0's result here. As the termination message it can be read from the pod's status with a
#: plain GET after the pod ended, without exec'ing into a container that may already be gone.
RESULT_FILE: Final = "/dev/termination-log"
#: The kubelet keeps at most 4096 bytes of a container's termination message.
MAX_RESULT_BYTES: Final = 4096
SHM_VOLUME: Final = "dshm"
SHM_PATH: Final = "/dev/shm"

#: The API server rejects a ConfigMap whose keys and values together exceed 1 MiB (``MaxConfigMapSize``).
MAX_CONFIGMAP_BYTES: Final = 1024 * 1024
#: What ``summarize_for_ui`` guarantees; Airflow truncates rendered fields at 4096 characters.
UI_SUMMARY_LIMIT: Final = 4000
UI_FOOTER: Final = "# full manifest: XCom 'manifests' and the task log"


class Workload(str, Enum):
    """The kind of object that runs a task's nodes."""

    #: One node: a bare Pod; no training operator needed.
    POD = "Pod"
    #: Several nodes, or a Master/Worker job: a Kubeflow PyTorchJob.
    PYTORCHJOB = "PyTorchJob"


def workload_for(config: TaskConfig) -> Workload:
    """The one place that decides which object a config becomes."""
    if isinstance(config, Elastic) and config.max_nodes == 1:
        return Workload.POD
    return Workload.PYTORCHJOB


def _fail(where: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{where}: expected {expected}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------- payload


def payload_configmap_name(job: str) -> str:
    return f"{job}-payload"


def render_payload_configmap(
    *, name: str, namespace: str, payload: bytes, labels: Mapping[str, str], annotations: Mapping[str, str]
) -> JsonDict:
    """The ConfigMap that carries the payload to every pod; fails before anything exists if it cannot fit."""
    if not isinstance(payload, bytes | bytearray):
        raise TypeError(f"payload: expected bytes, got {type(payload).__name__}")
    size = len(payload) + len(PAYLOAD_KEY)
    if size > MAX_CONFIGMAP_BYTES:
        raise ValueError(
            f"payload: {len(payload)} bytes do not fit a ConfigMap (limit {MAX_CONFIGMAP_BYTES - len(PAYLOAD_KEY)} "
            f"bytes, {MAX_CONFIGMAP_BYTES} bytes per ConfigMap); pass large data by reference (object storage paths, "
            "a dataset URI) instead of as arguments or captured variables of the training function"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels), "annotations": dict(annotations)},
        # Immutable: the kubelet stops watching it, and nobody can swap the code under a running job.
        "immutable": True,
        "binaryData": {PAYLOAD_KEY: base64.b64encode(bytes(payload)).decode("ascii")},
    }


def payload_configmap_owner_reference(*, owner_name: str, owner_uid: str, kind: Workload | str) -> JsonDict:
    """The merge-patch body that makes the payload ConfigMap a dependent of the created job or pod.

    Set after the owner exists (its uid is known only then). No ``blockOwnerDeletion``: setting it needs permission on
    the owner's finalizers, and nothing is gained by blocking the owner's deletion on a ConfigMap.
    """
    workload = Workload(kind)
    api_version = PYTORCHJOB_API_VERSION if workload is Workload.PYTORCHJOB else "v1"
    if not owner_name or not owner_uid:
        raise ValueError(f"owner_name and owner_uid: expected non-empty strings, got {owner_name!r}, {owner_uid!r}")
    return {
        "metadata": {
            "ownerReferences": [
                {"apiVersion": api_version, "kind": workload.value, "name": owner_name, "uid": owner_uid}
            ]
        }
    }


# ----------------------------------------------------------------------------------------------------- quantities

_SUFFIXES: Final[Mapping[str, Decimal]] = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
}
_QUANTITY_PARTS = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([A-Za-z]*)\Z")
# Resources the scheduler may overcommit; any other (nvidia.com/gpu ...) needs limits == requests.
_OVERCOMMITTABLE = ("cpu", "memory", "ephemeral-storage")


def _quantity(value: str) -> Decimal | None:
    match = _QUANTITY_PARTS.match(value)
    if not match or match.group(2) not in _SUFFIXES:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        return None


def _check_resources(where: str, requests: Mapping[str, str], limits: Mapping[str, str]) -> None:
    """The API server's rules that a per-field check cannot see: requests <= limits; GPUs need a limit."""
    for key, request in requests.items():
        extended = key not in _OVERCOMMITTABLE and not key.startswith("hugepages-")
        if key not in limits:
            if extended:
                raise _fail(f"{where}.limits[{key!r}]", None, f"a limit for {key} (it cannot be overcommitted)")
            continue
        low, high = _quantity(request), _quantity(limits[key])
        if low is None or high is None:
            continue
        if low > high:
            raise _fail(f"{where}.requests[{key!r}]", request, f"at most the limit {limits[key]!r}")
        if extended and low != high:
            raise _fail(f"{where}.requests[{key!r}]", request, f"the limit {limits[key]!r} (no overcommit of {key})")


# --------------------------------------------------------------------------------------------------- pod template


def _set(where: str, target: JsonDict, key: str, value: Any, source: str) -> None:
    """Set ``target[key]``, refusing to silently replace a different value the user put there."""
    if key in target and target[key] != value:
        raise ValueError(
            f"{where}.{key}: the pod_template sets {target[key]!r} but {source} sets {value!r}; set it in one place"
        )
    target[key] = value


def _merge_named(where: str, items: list[Any], extra: Sequence[Any], key: str, source: str) -> list[Any]:
    """Append ``extra`` to ``items``; an item with the same ``key`` must be identical."""
    by_key = {item.get(key): item for item in items if isinstance(item, dict)}
    merged = list(items)
    for item in extra:
        existing = by_key.get(item[key])
        if existing is None:
            merged.append(copy.deepcopy(item))
            by_key[item[key]] = item
        elif existing != item:
            raise ValueError(
                f"{where}[{item[key]!r}]: the pod_template sets {existing!r} but {source} sets {item!r}; "
                "set it in one place"
            )
    return merged


def _merge_mapping(where: str, target: JsonDict, key: str, extra: Mapping[str, Any], source: str) -> None:
    if not extra:
        return
    merged = target.setdefault(key, {})
    if not isinstance(merged, dict):
        raise _fail(f"{where}.{key}", merged, "a mapping")
    for name, value in extra.items():
        _set(f"{where}.{key}", merged, name, value, source)


@dataclass(frozen=True, kw_only=True)
class _PodSettings:
    """Everything that shapes one replica's (or the single Pod's) pod, resolved."""

    where: str
    options: PodOptions
    #: The replica's image, else the operator's: it wins over the pod template's.
    image: str | None
    requests: Mapping[str, str]
    limits: Mapping[str, str]
    command: list[str]
    configmap: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    env: Sequence[JsonDict] = ()
    #: Used only when neither ``image`` nor the pod template's ``pytorch`` container names one.
    default_image: str | None = None
    #: False only for a parse-time check, when the image may still come at run time.
    image_required: bool = True


_NO_IMAGE: Final = (
    "an image: pass image= to the operator, set Master/Worker(image=...), or set the 'pytorch' container's image in "
    "PodOptions(pod_template=...); or give every task a default with the Airflow option [torch_elastic] image "
    "(env AIRFLOW__TORCH_ELASTIC__IMAGE)"
)


def _render_pod_template(settings: _PodSettings) -> JsonDict:
    """The pod template ``{metadata, spec}``: the user's ``pod_template`` with the generated fields laid over it."""
    where, options = settings.where, settings.options
    template = options.template
    metadata = template.setdefault("metadata", {})
    _merge_mapping(f"{where}.metadata", metadata, "labels", options.labels, "PodOptions.labels")
    _merge_mapping(f"{where}.metadata", metadata, "labels", settings.labels, "the provider")
    _merge_mapping(f"{where}.metadata", metadata, "annotations", options.annotations, "PodOptions.annotations")
    _merge_mapping(f"{where}.metadata", metadata, "annotations", settings.annotations, "the provider")

    spec = template.setdefault("spec", {})
    containers: list[JsonDict] = spec.setdefault("containers", [])
    container = next((c for c in containers if c.get("name") == CONTAINER_NAME), None)
    if container is None:
        container = {"name": CONTAINER_NAME}
        containers.insert(0, container)
    cwhere = f"{where}.spec.containers[{CONTAINER_NAME!r}]"

    # Most specific first: the replica's or operator's image, the template's, then the configured default. The
    # template is the lower layer, so an image given to the task replaces its image rather than conflicting with it.
    image = settings.image or container.get("image") or settings.default_image
    if image:
        container["image"] = image
    elif settings.image_required:
        raise _fail(f"{cwhere}.image", None, _NO_IMAGE)
    for index, other in enumerate(containers):
        if other is not container and not other.get("image"):
            raise _fail(f"{where}.spec.containers[{index}].image", other.get("image"), "an image on every container")
    _set(cwhere, container, "command", settings.command, "the provider (the runner's command line)")
    if options.image_pull_policy is not None:
        _set(cwhere, container, "imagePullPolicy", options.image_pull_policy, "PodOptions.image_pull_policy")

    env = _merge_named(f"{cwhere}.env", container.get("env", []), options.env_vars, "name", "PodOptions.env")
    # Defaults, not settings: where PodOptions.env or the template's container sets one of these variables (or an
    # older name of it), the user's value stays and no conflict is raised. A value from envFrom does not count: in a
    # pod an explicit env entry wins over envFrom, so such a value must be set through env to override the default.
    present = {str(item.get("name")) for item in env if isinstance(item, dict)}
    env += [{"name": name, "value": value} for name, value in nccl_env_defaults(present).items()]
    provided = list(settings.env)
    if image:
        # The runner names the image it runs in when it cannot read a payload: "rebuild <this image>".
        provided.append({"name": IMAGE_ENV, "value": image})
    env = _merge_named(f"{cwhere}.env", env, provided, "name", "the provider")
    if env:
        container["env"] = env
    env_from = list(container.get("envFrom", []))
    env_from += [item for item in options.env_from if item not in env_from]
    if env_from:
        container["envFrom"] = copy.deepcopy(env_from)

    resources = container.setdefault("resources", {})
    _merge_mapping(cwhere + ".resources", resources, "requests", settings.requests, "the replica's requests")
    _merge_mapping(cwhere + ".resources", resources, "limits", settings.limits, "the replica's limits")
    _check_resources(f"{cwhere}.resources", resources.get("requests", {}), resources.get("limits", {}))
    if not resources:
        del container["resources"]

    ports = container.setdefault("ports", [])
    if not any(port.get("name") == PORT_NAME for port in ports):
        # The training operator would add this default itself; writing it out shows the port the rendezvous uses.
        ports.append({"name": PORT_NAME, "containerPort": DEFAULT_PORT})

    shm_size = options.effective_shm_size
    own_volumes: list[JsonDict] = [
        {"name": PAYLOAD_VOLUME, "configMap": {"name": settings.configmap}},
    ]
    own_mounts: list[JsonDict] = [{"name": PAYLOAD_VOLUME, "mountPath": PAYLOAD_DIR, "readOnly": True}]
    if shm_size is not None:
        # DataLoader workers hand batches over through shared memory; the runtime's 64 MiB /dev/shm fails with
        # "bus error". A memory-backed emptyDir of the configured size replaces it.
        own_volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
        own_mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    mounts = _merge_named(
        f"{cwhere}.volumeMounts", container.get("volumeMounts", []), options.volume_mounts, "mountPath", "PodOptions"
    )
    mounts = _merge_named(f"{cwhere}.volumeMounts", mounts, own_mounts, "mountPath", "the provider")
    container["volumeMounts"] = mounts
    volumes = _merge_named(f"{where}.spec.volumes", spec.get("volumes", []), options.volumes, "name", "PodOptions")
    volumes = _merge_named(f"{where}.spec.volumes", volumes, own_volumes, "name", "the provider")
    spec["volumes"] = volumes
    volume_names = {volume.get("name") for volume in volumes}
    for mount in mounts:
        if mount.get("name") not in volume_names:
            raise _fail(f"{cwhere}.volumeMounts[{mount.get('mountPath')!r}].name", mount.get("name"), "a pod volume")

    # The runner writes the result here; on a crash the kubelet falls back to the log's tail, so a failed pod still
    # says why in its status.
    _set(cwhere, container, "terminationMessagePath", RESULT_FILE, "the provider")
    _set(cwhere, container, "terminationMessagePolicy", "FallbackToLogsOnError", "the provider")

    secrets = [ref.get("name") for ref in spec.get("imagePullSecrets", [])]
    secrets += [name for name in options.image_pull_secrets if name not in secrets]
    if secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in secrets]
    _merge_mapping(f"{where}.spec", spec, "nodeSelector", options.node_selector, "PodOptions.node_selector")
    tolerations = list(spec.get("tolerations", []))
    tolerations += [copy.deepcopy(t) for t in options.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    if options.affinity is not None:
        _set(f"{where}.spec", spec, "affinity", copy.deepcopy(dict(options.affinity)), "PodOptions.affinity")
    if options.service_account_name is not None:
        _set(f"{where}.spec", spec, "serviceAccountName", options.service_account_name, "PodOptions")
    if options.priority_class_name is not None:
        _set(f"{where}.spec", spec, "priorityClassName", options.priority_class_name, "PodOptions")
    if not metadata:
        del template["metadata"]
    return template


# -------------------------------------------------------------------------------------------------------- renderers


@dataclass(frozen=True, kw_only=True)
class RenderInputs:
    config: TaskConfig
    name: str
    namespace: str
    image: str | None
    options: PodOptions
    job_options: JobOptions
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    configmap: str
    default_image: str | None = None
    image_required: bool = True
    #: Env of every pod's ``pytorch`` container that the provider sets for the run (the run context).
    worker_env: Sequence[JsonDict] = ()
    #: Where a result too large for the termination message goes, or None.
    result_url: str | None = None


def _metadata(inputs: RenderInputs) -> JsonDict:
    return {
        "name": inputs.name,
        "namespace": inputs.namespace,
        "labels": {**inputs.options.labels, **inputs.labels},
        "annotations": {**inputs.options.annotations, **inputs.annotations},
    }


def render_pod(inputs: RenderInputs) -> JsonDict:
    config = inputs.config
    if not isinstance(config, Elastic):  # pragma: no cover - workload_for sends only single-node Elastic here
        raise TypeError(f"a single Pod renders only Elastic(nnodes=1), got {config!r}")
    job_options = inputs.job_options
    if job_options.suspend or job_options.scheduling_policy is not None:
        raise _fail(
            "JobOptions",
            job_options,
            "no job options for a single-node task (they apply to a PyTorchJob; it runs as one Pod). "
            "For Kueue, label the pod: PodOptions(labels={'kueue.x-k8s.io/queue-name': ...})",
        )
    spec = config_to_launch_spec(config)
    command = runner_command(
        spec,
        payload_path=PAYLOAD_PATH,
        result_file=RESULT_FILE,
        max_result_bytes=MAX_RESULT_BYTES,
        nnodes="1",
        result_url=inputs.result_url,
    )
    template = _render_pod_template(
        _PodSettings(
            where="Pod",
            options=inputs.options,
            image=inputs.image,
            default_image=inputs.default_image,
            image_required=inputs.image_required,
            requests=inputs.options.requests,
            limits=inputs.options.limits,
            command=command,
            configmap=inputs.configmap,
            labels=inputs.labels,
            annotations=inputs.annotations,
            # What the training operator gives every container of a PyTorchJob: logs arrive as they are written.
            env=[{"name": "PYTHONUNBUFFERED", "value": "1"}, *inputs.worker_env],
        )
    )
    metadata = {"name": inputs.name, "namespace": inputs.namespace, **template.get("metadata", {})}
    pod_spec = template["spec"]
    # Airflow decides about retries (a new try, a new pod); the kubelet restarting the runner would rerun rank 0.
    pod_spec["restartPolicy"] = "Never"
    if config.run_policy is not None and config.run_policy.active_deadline_seconds is not None:
        _set("Pod.spec", pod_spec, "activeDeadlineSeconds", config.run_policy.active_deadline_seconds, "RunPolicy")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _replica_spec(
    inputs: RenderInputs, replica_type: str, replica: Master | Worker | None, replicas: int, command: list[str]
) -> JsonDict:
    replica = replica or Worker()
    options = merge_pod_options(inputs.options, replica.pod)
    template = _render_pod_template(
        _PodSettings(
            where=f"pytorchReplicaSpecs.{replica_type}.template",
            options=options,
            image=replica.image if replica.image is not None else inputs.image,
            default_image=inputs.default_image,
            image_required=inputs.image_required,
            requests={**options.requests, **replica.requests},
            limits={**options.limits, **replica.limits},
            command=command,
            configmap=inputs.configmap,
            labels=inputs.labels,
            annotations=inputs.annotations,
            env=inputs.worker_env,
        )
    )
    # The restart policy lives on the replica: the training operator overwrites the pod's own (ExitCode -> Never).
    return {"replicas": replicas, "restartPolicy": replica.restart_policy.value, "template": template}


def _run_policy(inputs: RenderInputs) -> JsonDict:
    """Only what was given: the training operator's defaults stay its own."""
    run_policy: JsonDict = {}
    policy = inputs.config.run_policy
    if policy is not None:
        if policy.clean_pod_policy is not None:
            run_policy["cleanPodPolicy"] = policy.clean_pod_policy.value
        for key, value in (
            ("ttlSecondsAfterFinished", policy.ttl_seconds_after_finished),
            ("activeDeadlineSeconds", policy.active_deadline_seconds),
            ("backoffLimit", policy.backoff_limit),
        ):
            if value is not None:
                run_policy[key] = value
    if inputs.job_options.scheduling_policy is not None:
        run_policy["schedulingPolicy"] = copy.deepcopy(dict(inputs.job_options.scheduling_policy))
    if inputs.job_options.suspend:
        run_policy["suspend"] = True
    return run_policy


def render_pytorchjob(inputs: RenderInputs) -> JsonDict:
    config = inputs.config
    launch = config_to_launch_spec(config)
    # No --nnodes: the training operator sets PET_NNODES ("min:max" for elastic, the replica count otherwise).
    command = runner_command(
        launch,
        payload_path=PAYLOAD_PATH,
        result_file=RESULT_FILE,
        max_result_bytes=MAX_RESULT_BYTES,
        result_url=inputs.result_url,
    )
    spec: JsonDict = {}
    if isinstance(config, Elastic):
        # Rendezvous settings travel on the runner's command line (--rdzv-conf), not as rdzvConf: an empty rdzvConf
        # list breaks the operator's env builder, and one place is easier to reason about than two.
        spec["elasticPolicy"] = {
            "minReplicas": config.min_nodes,
            "maxReplicas": config.max_nodes,
            "rdzvBackend": "c10d",
            "maxRestarts": config.max_restarts,
        }
        replica_specs = {"Worker": _replica_spec(inputs, "Worker", None, config.max_nodes, command)}
    else:
        replica_specs = {"Master": _replica_spec(inputs, "Master", config.master, 1, command)}
        # The webhook rejects Worker.replicas 0; a Master-only job simply has no Worker entry.
        if config.worker_replicas > 0:
            replica_specs["Worker"] = _replica_spec(inputs, "Worker", config.worker, config.worker_replicas, command)
    # spec.nprocPerNode (a string), not the deprecated elasticPolicy.nProcPerNode (the webhook forbids both).
    spec["nprocPerNode"] = str(config.nproc_per_node)
    spec["pytorchReplicaSpecs"] = replica_specs
    run_policy = _run_policy(inputs)
    if run_policy:
        spec["runPolicy"] = run_policy
    return {"apiVersion": PYTORCHJOB_API_VERSION, "kind": PYTORCHJOB_KIND, "metadata": _metadata(inputs), "spec": spec}


_RENDERERS: Final[Mapping[Workload, Callable[[RenderInputs], JsonDict]]] = {
    Workload.POD: render_pod,
    Workload.PYTORCHJOB: render_pytorchjob,
}

_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


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
) -> list[JsonDict]:
    """The objects one try of a task creates, in creation order: ``[ConfigMap, PyTorchJob]`` or ``[ConfigMap, Pod]``.

    ``renderer`` renders the job object (``kinds.for_config(config).render`` is what the operator passes); by
    default the built-in kind for the config.

    Each pod's image is, most specific first: its replica's (``Master``/``Worker(image=...)``), ``image``, the pod
    template's ``pytorch`` container's, ``default_image``. A pod with none is an error unless ``require_image`` is
    False (a parse-time check, where the image may come at run time): objects rendered so are checked, not submitted.

    ``task_context`` (the try's context: retries, logical date, checkpoint location) reaches every pod's ``pytorch``
    container as one variable, ``TORCHELASTIC_CONTEXT``; by default the identity's alone. It must name the same task
    instance and try as ``identity``. ``result_url`` goes on the runner's command line: where the node holding rank 0
    writes a result too large for the termination message.
    """
    config = check_task_config(config)
    if not isinstance(identity, RunIdentity):
        raise TypeError(f"identity: expected a RunIdentity(...), got {identity!r}")
    if not isinstance(namespace, str) or not _DNS_1123_LABEL.match(namespace):
        raise _fail("namespace", namespace, "a namespace name (a DNS-1123 label)")
    # Rendered values only: a "{{ ... }}" left in an image is refused here, never submitted.
    check_image("", "image", image)
    check_image("", "default_image", default_image)
    if pod_options is not None and not isinstance(pod_options, PodOptions):
        raise TypeError(f"pod_options: expected a PodOptions(...) or None, got {pod_options!r}")
    if job_options is not None and not isinstance(job_options, JobOptions):
        raise TypeError(f"job_options: expected a JobOptions(...) or None, got {job_options!r}")
    if task_context is None:
        task_context = task_context_for(identity)
    elif not isinstance(task_context, TaskContext):
        raise TypeError(f"task_context: expected a TaskContext(...) or None, got {task_context!r}")
    elif task_context_for(identity) != replace(
        task_context, max_tries=max(0, identity.try_number - 1), logical_date=None, checkpoint_uri=None
    ):
        raise _fail("task_context", task_context, f"the task instance and try of the identity {identity!r}")
    name = job_name(identity)
    options = pod_options or PodOptions()
    labels = identity_labels(identity)
    annotations = identity_annotations(identity)
    configmap = render_payload_configmap(
        name=payload_configmap_name(name),
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
        configmap=configmap["metadata"]["name"],
        default_image=default_image,
        image_required=require_image,
        worker_env=[
            {"name": CONTEXT_ENV, "value": task_context.to_env_value()},
            # Seconds between rank 0's metrics lines ([torch_elastic] report_interval); unset: report()'s default.
            *([{"name": METRICS_INTERVAL_ENV, "value": f"{report_interval:g}"}] if report_interval is not None else []),
        ],
        result_url=result_url,
    )
    workload = (renderer or _RENDERERS[workload_for(config)])(inputs)
    return [configmap, workload]


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
) -> None:
    """Render once with a placeholder identity and an empty payload, so that conflicts fail at DAG-parse time.

    ``require_image=False`` where the image is only known at run time (a templated or mapped image, or an execution
    mode read from the configuration then): everything else is still checked.
    """
    render_manifests(
        config,
        identity=placeholder_identity(dag_id, task_id),
        namespace=namespace,
        image=image,
        payload=b"",
        pod_options=pod_options,
        job_options=job_options,
        default_image=default_image,
        require_image=require_image,
    )


# ---------------------------------------------------------------------------------------------------- UI summary


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
    if manifest.get("kind") != "ConfigMap" or "binaryData" not in manifest:
        return manifest
    elided = copy.deepcopy(manifest)
    for key, data in elided["binaryData"].items():
        if data.startswith("<"):
            continue  # elided already (a manifest read back from the XCom); "<" is not in the base64 alphabet
        elided["binaryData"][key] = f"<{len(base64.b64decode(data))} bytes, cloudpickle payload>"
    return elided


def _abbreviate(manifest: JsonDict) -> JsonDict:
    """The workload with its repetition folded: pod-template labels and annotations that the job carries too, and a
    replica template identical to an earlier one."""
    if manifest.get("kind") != PYTORCHJOB_KIND:
        return manifest
    short = copy.deepcopy(manifest)
    job_metadata = short.get("metadata", {})
    seen: dict[str, JsonDict] = {}
    for replica_type, replica in short["spec"].get("pytorchReplicaSpecs", {}).items():
        template = replica.get("template", {})
        metadata = template.get("metadata", {})
        for key in ("labels", "annotations"):
            inherited = job_metadata.get(key, {})
            kept = {k: v for k, v in metadata.get(key, {}).items() if inherited.get(k) != v}
            if kept:
                metadata[key] = kept
            elif key in metadata:
                metadata[key] = "<as on the job>"
        same_as = next((name for name, earlier in seen.items() if earlier == template), None)
        seen[replica_type] = copy.deepcopy(template)
        if same_as is not None:
            replica["template"] = f"<same as {same_as}>"
    return short


def _digest(manifest: JsonDict) -> JsonDict:
    """The parts of a big workload a reader looks for first: what runs where, with which resources."""
    spec = manifest.get("spec", {})
    digest: JsonDict = {"apiVersion": manifest.get("apiVersion"), "kind": manifest.get("kind")}
    digest["metadata"] = {
        key: manifest["metadata"][key] for key in ("name", "namespace") if key in manifest["metadata"]
    }

    def pod_digest(pod_spec: JsonDict) -> JsonDict:
        containers: list[JsonDict] = pod_spec.get("containers", [])
        container: JsonDict = next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
        short: JsonDict = {"image": container.get("image")}
        if container.get("resources"):
            short["resources"] = container["resources"]
        others = [c.get("name") for c in pod_spec.get("containers", []) if c.get("name") != CONTAINER_NAME]
        if others:
            short["otherContainers"] = others
        return short

    if manifest.get("kind") == "Pod":
        digest["spec"] = pod_digest(spec)
        return digest
    short_spec: JsonDict = {key: spec[key] for key in ("elasticPolicy", "nprocPerNode", "runPolicy") if key in spec}
    short_spec["pytorchReplicaSpecs"] = {
        replica_type: {
            "replicas": replica.get("replicas"),
            "restartPolicy": replica.get("restartPolicy"),
            "pytorch": pod_digest(replica.get("template", {}).get("spec", {})),
        }
        for replica_type, replica in spec.get("pytorchReplicaSpecs", {}).items()
    }
    digest["spec"] = short_spec
    return digest


def summarize_for_ui(manifests: Sequence[JsonDict], *, limit: int = UI_SUMMARY_LIMIT) -> str:
    """YAML for the operator's rendered-template field: at most ``limit`` characters, ending with where the rest is.

    Tries, in order: every object (payload bytes elided); the workload alone; the workload with repetition folded
    (template metadata the job carries too, a template identical to an earlier replica's); a digest of it (images,
    resources, replicas, policies); and finally a cut digest. The last line always says where the full manifest is.
    """
    footer = UI_FOOTER + "\n"
    budget = limit - len(footer)
    workloads = [m for m in manifests if m.get("kind") != "ConfigMap"]
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

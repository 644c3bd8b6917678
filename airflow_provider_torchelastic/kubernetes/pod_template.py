"""The building blocks every kind renders from: the payload Secret, resource checks, the pod template with the
generated fields laid over the user's, and the shared render inputs. Pure functions returning plain dicts.

No I/O and no airflow, kubernetes or torch imports: the same inputs always give the same objects, so what the
operator shows (``TorchElasticOperator.render_manifests()``) is exactly what it submits. Each kind's own object is
rendered in its module under :mod:`.kinds`; :mod:`.render` puts a try's objects together.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.core.launch import LaunchSpec, nccl_env_defaults, runner_command
from airflow_provider_torchelastic.core.naming import (
    TRAINING_CONTAINER,
)
from airflow_provider_torchelastic.core.payload import IMAGE_ENV
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.core.stall import GRACE_PERIOD_ENV, grace_period_seconds
from airflow_provider_torchelastic.core.validation import overcommit_allowed, quantity_value

__all__ = [
    "CONTAINER_NAME",
    "MAX_SECRET_BYTES",
    "PAYLOAD_PATH",
    "PORT_NAME",
    "RESULT_FILE",
    "PodSettings",
    "RenderInputs",
    "job_metadata",
    "payload_secret_name",
    "pod_spec_digest",
    "render_payload_secret",
    "render_pod_template",
]

JsonDict: TypeAlias = dict[str, Any]


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
AUTOMOUNT_TOKEN: Final = "automountServiceAccountToken"

#: The API server rejects a Secret whose data together exceeds 1 MiB (``MaxSecretSize``).
MAX_SECRET_BYTES: Final = 1024 * 1024


def invalid(where: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{where}: expected {expected}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------- payload


def payload_secret_name(job: str) -> str:
    return f"{job}-payload"


def render_payload_secret(
    *, name: str, namespace: str, payload: bytes, labels: Mapping[str, str], annotations: Mapping[str, str]
) -> JsonDict:
    """The Secret that carries the payload to every pod; fails before anything exists if it cannot fit.

    A Secret, not a ConfigMap: the payload holds the function's arguments as rendered (a ``{{ conn.x.password }}``
    among them) and the values the function uses, and Kubernetes' built-in ``view`` role reads ConfigMaps, not
    Secrets."""
    if not isinstance(payload, bytes | bytearray):
        raise TypeError(f"payload: expected bytes, got {type(payload).__name__}")
    size = len(payload) + len(PAYLOAD_KEY)
    if size > MAX_SECRET_BYTES:
        raise ValueError(
            f"payload: {len(payload)} bytes do not fit a Secret (limit {MAX_SECRET_BYTES - len(PAYLOAD_KEY)} "
            f"bytes, {MAX_SECRET_BYTES} bytes per Secret); pass large data by reference (object storage paths, "
            "a dataset URI) instead of as arguments or captured variables of the training function"
        )
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels), "annotations": dict(annotations)},
        "type": "Opaque",
        # Immutable: the kubelet stops watching it, and nobody can swap the code under a running job.
        "immutable": True,
        "data": {PAYLOAD_KEY: base64.b64encode(bytes(payload)).decode("ascii")},
    }


# ----------------------------------------------------------------------------------------------------- quantities


def _check_resources(where: str, requests: Mapping[str, str], limits: Mapping[str, str]) -> None:
    """The API server's rules that a per-field check cannot see: requests <= limits; GPUs and hugepages need a
    limit equal to the request; hugepages need cpu or memory beside them."""
    named = {*requests, *limits}
    if any(key.startswith("hugepages-") for key in named) and not named & {"cpu", "memory"}:
        raise invalid(where, {"requests": dict(requests), "limits": dict(limits)}, "cpu or memory beside hugepages")
    for key, request in requests.items():
        no_overcommit = not overcommit_allowed(key)  # extended resources and hugepages
        if key not in limits:
            if no_overcommit:
                raise invalid(f"{where}.limits[{key!r}]", None, f"a limit for {key} (it cannot be overcommitted)")
            continue
        low, high = quantity_value(request), quantity_value(limits[key])
        if low is None or high is None:
            continue
        if low > high:
            raise invalid(f"{where}.requests[{key!r}]", request, f"at most the limit {limits[key]!r}")
        if no_overcommit and low != high:
            raise invalid(f"{where}.requests[{key!r}]", request, f"the limit {limits[key]!r} (no overcommit of {key})")


# --------------------------------------------------------------------------------------------------- pod template


def set_field(where: str, target: JsonDict, key: str, value: Any, source: str) -> None:
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
        raise invalid(f"{where}.{key}", merged, "a mapping")
    for name, value in extra.items():
        set_field(f"{where}.{key}", merged, name, value, source)


@dataclass(frozen=True, kw_only=True)
class PodSettings:
    """Everything that shapes one replica's (or the single Pod's) pod, resolved."""

    where: str
    options: PodOptions
    #: The replica's image, else the operator's: it wins over the pod template's.
    image: str | None
    requests: Mapping[str, str]
    limits: Mapping[str, str]
    command: list[str]
    payload_secret: str
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


def render_pod_template(settings: PodSettings) -> JsonDict:
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
        raise invalid(f"{cwhere}.image", None, _NO_IMAGE)
    for index, other in enumerate(containers):
        if other is not container and not other.get("image"):
            raise invalid(f"{where}.spec.containers[{index}].image", other.get("image"), "an image on every container")
    set_field(cwhere, container, "command", settings.command, "the provider (the runner's command line)")
    if options.image_pull_policy is not None:
        set_field(cwhere, container, "imagePullPolicy", options.image_pull_policy, "PodOptions.image_pull_policy")

    _lay_env(settings, cwhere, container, spec, image)

    _lay_resources(settings, cwhere, container)

    ports = container.setdefault("ports", [])
    if not any(port.get("name") == PORT_NAME for port in ports):
        # The training operator would add this default itself; writing it out shows the port the rendezvous uses.
        ports.append({"name": PORT_NAME, "containerPort": DEFAULT_PORT})

    _lay_volumes(settings, where, cwhere, container, spec)

    # The runner writes the result here; on a crash the kubelet falls back to the log's tail, so a failed pod still
    # says why in its status.
    # The runner gives its workers most of the pod's grace period to stop (GRACE_PERIOD_ENV, from the operator's
    # termination_grace_period): the pod must get that much from the kubelet.
    grace = next((e.get("value") for e in settings.env if e.get("name") == GRACE_PERIOD_ENV), None)
    if isinstance(grace, str) and "terminationGracePeriodSeconds" not in spec:
        spec["terminationGracePeriodSeconds"] = grace_period_seconds(float(grace))
    set_field(cwhere, container, "terminationMessagePath", RESULT_FILE, "the provider")
    set_field(cwhere, container, "terminationMessagePolicy", "FallbackToLogsOnError", "the provider")

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
        set_field(f"{where}.spec", spec, "affinity", copy.deepcopy(dict(options.affinity)), "PodOptions.affinity")
    if options.service_account_name is not None:
        set_field(f"{where}.spec", spec, "serviceAccountName", options.service_account_name, "PodOptions")
    if options.priority_class_name is not None:
        set_field(f"{where}.spec", spec, "priorityClassName", options.priority_class_name, "PodOptions")
    _set_token_automount(where, spec, options)
    if not metadata:
        del template["metadata"]
    return template


def _lay_env(settings: PodSettings, cwhere: str, container: JsonDict, spec: JsonDict, image: str | None) -> None:
    """The ``pytorch`` container's ``env`` and ``envFrom``: the template's, PodOptions', defaults, the provider's."""
    options = settings.options
    env = _merge_named(f"{cwhere}.env", container.get("env", []), options.env_vars, "name", "PodOptions.env")
    # Defaults, not settings: where PodOptions.env or the template's container sets one of these variables (or an
    # older name of it), the user's value stays and no conflict is raised. A value from envFrom does not count: in a
    # pod an explicit env entry wins over envFrom, so such a value must be set through env to override the default.
    present = {str(item.get("name")) for item in env if isinstance(item, dict)}
    env += [{"name": name, "value": value} for name, value in nccl_env_defaults(present).items()]
    provided = list(settings.env)
    template_grace = spec.get("terminationGracePeriodSeconds")
    if isinstance(template_grace, int) and not isinstance(template_grace, bool):
        # A pod template that sets its grace period keeps it, and the runner gives its workers that grace instead.
        provided = [
            {"name": GRACE_PERIOD_ENV, "value": str(template_grace)} if item.get("name") == GRACE_PERIOD_ENV else item
            for item in provided
        ]
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


def _lay_resources(settings: PodSettings, cwhere: str, container: JsonDict) -> None:
    """The replica's requests and limits over the template's, checked together; no ``resources`` when there are none."""
    resources = container.setdefault("resources", {})
    _merge_mapping(cwhere + ".resources", resources, "requests", settings.requests, "the replica's requests")
    _merge_mapping(cwhere + ".resources", resources, "limits", settings.limits, "the replica's limits")
    _check_resources(f"{cwhere}.resources", resources.get("requests", {}), resources.get("limits", {}))
    if not resources:
        del container["resources"]


def _lay_volumes(settings: PodSettings, where: str, cwhere: str, container: JsonDict, spec: JsonDict) -> None:
    """The pod's volumes and the ``pytorch`` container's mounts: the template's, PodOptions', the provider's."""
    options = settings.options
    shm_size = options.effective_shm_size
    own_volumes: list[JsonDict] = [
        {"name": PAYLOAD_VOLUME, "secret": {"secretName": settings.payload_secret}},
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
    # Every container's mounts, sidecars' and init containers' too: the API server refuses a pod that mounts a volume
    # it does not have.
    placed = [(cwhere, mounts)] + [
        (f"{where}.spec.{key}[{other.get('name')!r}]", other.get("volumeMounts") or [])
        for key in ("containers", "initContainers")
        for other in spec.get(key) or []
        if other is not container
    ]
    for owner, owned in placed:
        for mount in owned:
            if mount.get("name") not in volume_names:
                name = f"{owner}.volumeMounts[{mount.get('mountPath')!r}].name"
                raise invalid(name, mount.get("name"), "a pod volume")


def _set_token_automount(where: str, spec: JsonDict, options: PodOptions) -> None:
    """No service account token in the pods unless the user asked for one.

    Without ``automountServiceAccountToken`` every pod gets a token of the namespace's ``default`` account, and with
    it whatever that account was granted, which training code does not need and code that reaches a pod can use.
    Where the user named a service account, that account's own ``automountServiceAccountToken`` decides; an explicit
    choice (``PodOptions.automount_service_account_token``, or the field in the pod template) is kept.
    """
    swhere = f"{where}.spec"
    if AUTOMOUNT_TOKEN in spec and not isinstance(spec[AUTOMOUNT_TOKEN], bool):
        raise invalid(f"{swhere}.{AUTOMOUNT_TOKEN}", spec[AUTOMOUNT_TOKEN], "true or false")
    chosen = options.automount_service_account_token
    if chosen is not None:
        set_field(swhere, spec, AUTOMOUNT_TOKEN, chosen, "PodOptions.automount_service_account_token")
    # serviceAccount is the deprecated spelling of serviceAccountName; the API server still honours it.
    elif AUTOMOUNT_TOKEN not in spec and not (spec.get("serviceAccountName") or spec.get("serviceAccount")):
        spec[AUTOMOUNT_TOKEN] = False


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
    payload_secret: str
    default_image: str | None = None
    image_required: bool = True
    #: Env of every pod's ``pytorch`` container that the provider sets for the run (the run context).
    worker_env: Sequence[JsonDict] = ()
    #: Where a result too large for the termination message goes, or None.
    result_url: str | None = None
    #: The sha256 (hex) of the payload this try wrote: the runner refuses any other (``--payload-sha256``).
    payload_sha256: str | None = None


def pod_runner_command(inputs: RenderInputs, launch: LaunchSpec, *, nnodes: str | None = None) -> list[str]:
    """The runner's command line in a pod of every kind: the payload at its mount, the result in the termination
    message. ``nnodes`` only where nothing in the pod supplies ``PET_NNODES``."""
    return runner_command(
        launch,
        payload_path=PAYLOAD_PATH,
        result_file=RESULT_FILE,
        max_result_bytes=MAX_RESULT_BYTES,
        nnodes=nnodes,
        result_url=inputs.result_url,
        payload_sha256=inputs.payload_sha256,
    )


def job_metadata(inputs: RenderInputs) -> JsonDict:
    return {
        "name": inputs.name,
        "namespace": inputs.namespace,
        "labels": {**inputs.options.labels, **inputs.labels},
        "annotations": {**inputs.options.annotations, **inputs.annotations},
    }


# ---------------------------------------------------------------------------------------------------- UI summary


def pod_spec_digest(pod_spec: JsonDict) -> JsonDict:
    """What a reader of a big manifest looks for first in a pod: the training container's image and resources, and
    the names of the other containers."""
    containers: list[JsonDict] = pod_spec.get("containers", [])
    container: JsonDict = next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
    short: JsonDict = {"image": container.get("image")}
    if container.get("resources"):
        short["resources"] = container["resources"]
    others = [c.get("name") for c in containers if c.get("name") != CONTAINER_NAME]
    if others:
        short["otherContainers"] = others
    return short

"""Pod customization: what a platform team adds to every pod a task creates (``PodOptions``), and the PyTorchJob's
job-level scheduling knobs (``JobOptions``).

Pure and standard library only, validated in ``__post_init__`` so that a typo fails while the DAG file is parsed.
Values are kept in Kubernetes' own (camelCase) shapes, the ones platform teams already write in YAML; kubernetes
client objects (``V1Toleration``, ``V1PodTemplateSpec`` ...) are accepted too and converted on construction, importing
the kubernetes package only when such an object is given.

Where options apply:

* ``PodOptions`` given to the operator apply to every pod of the task; ``Master(pod=...)`` / ``Worker(pod=...)``
  apply to that replica only, merged over the operator's by ``merge_pod_options``: a replica's scalar fields replace
  the operator's when set; mappings (env, labels, annotations, node selector, requests, limits) are merged key by
  key, the replica winning; lists are merged by name (volumes), mount path (volume mounts) or appended (tolerations,
  env_from, image pull secrets); a replica's ``pod_template`` replaces the operator's.
* The generated pod (the ``pytorch`` container, its command, the payload and ``/dev/shm`` volumes) is laid over
  ``pod_template``. Anything both set differently is an error rather than a silent override.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, cast

from airflow_provider_torchelastic.core.naming import is_reserved_key
from airflow_provider_torchelastic.core.validation import QUANTITY, check_image, check_resources, fail, is_int

__all__ = [
    "DEFAULT_SHM_SIZE",
    "JobOptions",
    "PodOptions",
    "UNSET",
    "config_map_key_ref",
    "merge_pod_options",
    "secret_key_ref",
]

#: ``/dev/shm`` of a container runtime is 64 MiB, which PyTorch DataLoader workers exhaust at once ("bus error");
#: 1 GiB is a safe floor. The memory-backed volume counts against the pod's memory, so raise it deliberately.
DEFAULT_SHM_SIZE: Final = "1Gi"


class _Unset(Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


#: "Not given": a replica's ``shm_size=UNSET`` inherits the operator's; the operator's falls back to the default.
UNSET: Final = _Unset.UNSET

JsonDict: TypeAlias = dict[str, Any]
EnvInput: TypeAlias = Mapping[str, "str | Mapping[str, Any]"] | Sequence[Any]

IMAGE_PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")
#: Injected by the training operator (which appends them after the template's env, so they would win anyway): a user
#: value would only look like it does something.
RESERVED_ENV: Final = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"})
RESERVED_ENV_PREFIX: Final = "PET_"

_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS_1123_SUBDOMAIN = re.compile(r"^(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?)?\Z")
# The rule of Kubernetes < 1.34 (newer versions accept any printable character but '='); we support 1.25.
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*\Z")

_VALUE_FROM_KEYS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "secretKeyRef": frozenset({"name", "key", "optional"}),
        "configMapKeyRef": frozenset({"name", "key", "optional"}),
        "fieldRef": frozenset({"fieldPath", "apiVersion"}),
        "resourceFieldRef": frozenset({"resource", "containerName", "divisor"}),
    }
)
_TOLERATION_KEYS: Final = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_TOLERATION_OPERATORS: Final = ("Exists", "Equal")
_TOLERATION_EFFECTS: Final = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_AFFINITY_KEYS: Final = frozenset({"nodeAffinity", "podAffinity", "podAntiAffinity"})
_MOUNT_KEYS: Final = frozenset(
    {"name", "mountPath", "readOnly", "subPath", "subPathExpr", "mountPropagation", "recursiveReadOnly"}
)
_SCHEDULING_POLICY_KEYS: Final = ("minAvailable", "queue", "minResources", "priorityClass", "scheduleTimeoutSeconds")
_INT32_MAX: Final = 2**31 - 1
_POSITIVE_NUMBER = re.compile(r"^\+?(\d+\.?\d*|\.\d+)")


def secret_key_ref(secret: str, key: str, *, optional: bool | None = None) -> JsonDict:
    """An env value read from a Secret: ``PodOptions(env={"TOKEN": secret_key_ref("hf", "token")})``."""
    ref: JsonDict = {"name": secret, "key": key}
    if optional is not None:
        ref["optional"] = optional
    return {"secretKeyRef": ref}


def config_map_key_ref(config_map: str, key: str, *, optional: bool | None = None) -> JsonDict:
    """An env value read from a ConfigMap: ``PodOptions(env={"MODE": config_map_key_ref("settings", "mode")})``."""
    ref: JsonDict = {"name": config_map, "key": key}
    if optional is not None:
        ref["optional"] = optional
    return {"configMapKeyRef": ref}


def _is_kubernetes_model(value: object) -> bool:
    return hasattr(value, "openapi_types") and hasattr(value, "attribute_map")


def to_plain(owner: str, name: str, value: object) -> Any:
    """A JSON-shaped deep copy of ``value``; kubernetes client models are serialized the way the client would."""
    if _is_kubernetes_model(value) or (
        isinstance(value, list | tuple) and any(_is_kubernetes_model(item) for item in value)
    ):
        # Imported here only: a DAG file that passes plain dicts must not pay for (or need) the kubernetes package.
        from kubernetes.client import ApiClient

        value = ApiClient().sanitize_for_serialization(value)
    try:
        return json.loads(json.dumps(value, default=_reject))
    except (TypeError, ValueError) as e:
        raise fail(owner, name, value, f"JSON-compatible Kubernetes fields ({e})", TypeError) from None


def _reject(value: object) -> Any:
    if isinstance(value, tuple | frozenset | MappingProxyType):
        return list(value) if not isinstance(value, MappingProxyType) else dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-compatible")


def _check_mapping(owner: str, name: str, value: object) -> JsonDict:
    plain = to_plain(owner, name, value)
    if not isinstance(plain, dict):
        raise fail(owner, name, value, "a mapping", TypeError)
    return plain


def _check_list(owner: str, name: str, value: object) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise fail(owner, name, value, "a list", TypeError)
    return cast("list[Any]", to_plain(owner, name, list(value)))


def _check_keys(owner: str, name: str, value: Mapping[str, Any], allowed: frozenset[str] | Sequence[str]) -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise fail(owner, name, value, f"only the keys {', '.join(sorted(allowed))} (unknown: {', '.join(unknown)})")


def _check_str(owner: str, name: str, value: object, pattern: re.Pattern[str], expected: str) -> str:
    if not isinstance(value, str):
        raise fail(owner, name, value, expected, TypeError)
    if not pattern.match(value):
        raise fail(owner, name, value, expected)
    return value


def check_label_key(owner: str, name: str, key: object) -> str:
    expected = "a label key: [prefix/]name, name <= 63 characters of [-_.A-Za-z0-9], prefix a DNS subdomain"
    if not isinstance(key, str):
        raise fail(owner, name, key, expected, TypeError)
    prefix, _, local = key.rpartition("/")
    if (prefix and not _DNS_1123_SUBDOMAIN.match(prefix)) or not _QUALIFIED_NAME.match(local):
        raise fail(owner, name, key, expected)
    return key


def check_labels(owner: str, name: str, value: object, *, reserved_ok: bool = False) -> Mapping[str, str]:
    labels = _check_mapping(owner, name, value)
    for key, label in labels.items():
        check_label_key(owner, name, key)
        if not reserved_ok and is_reserved_key(key):
            raise fail(owner, f"{name}[{key!r}]", key, "a key the provider and the training operator do not set")
        _check_str(owner, f"{name}[{key!r}]", label, _LABEL_VALUE, "a label value: <= 63 of [-_.A-Za-z0-9], alnum ends")
    return MappingProxyType(labels)


def check_annotations(owner: str, name: str, value: object) -> Mapping[str, str]:
    annotations = _check_mapping(owner, name, value)
    for key, text in annotations.items():
        check_label_key(owner, name, key)
        if is_reserved_key(key):
            raise fail(owner, f"{name}[{key!r}]", key, "a key the provider and the training operator do not set")
        if not isinstance(text, str):
            raise fail(owner, f"{name}[{key!r}]", text, "a str", TypeError)
    return MappingProxyType(annotations)


def _check_value_from(owner: str, name: str, value_from: object) -> JsonDict:
    expected = f"a valueFrom mapping with exactly one of {', '.join(_VALUE_FROM_KEYS)}"
    if not isinstance(value_from, dict) or len(value_from) != 1 or next(iter(value_from)) not in _VALUE_FROM_KEYS:
        raise fail(owner, name, value_from, expected)
    ((source, ref),) = value_from.items()
    if not isinstance(ref, dict):
        raise fail(owner, f"{name}.{source}", ref, "a mapping", TypeError)
    _check_keys(owner, f"{name}.{source}", ref, _VALUE_FROM_KEYS[source])
    required = {"secretKeyRef": ("name", "key"), "configMapKeyRef": ("name", "key"), "fieldRef": ("fieldPath",)}
    for key in required.get(source, ("resource",)):
        if not isinstance(ref.get(key), str) or not ref[key]:
            raise fail(owner, f"{name}.{source}.{key}", ref.get(key), "a non-empty str")
    if "optional" in ref and not isinstance(ref["optional"], bool):
        raise fail(owner, f"{name}.{source}.optional", ref["optional"], "a bool", TypeError)
    return value_from


def check_env_var(owner: str, name: str, item: object) -> JsonDict:
    """One V1EnvVar-shaped dict: ``{"name", "value"}`` or ``{"name", "valueFrom"}``."""
    var = _check_mapping(owner, name, item)
    _check_keys(owner, name, var, ("name", "value", "valueFrom"))
    var_name = _check_str(owner, f"{name}.name", var.get("name"), _ENV_NAME, "an env var name of [-._a-zA-Z0-9]")
    label = f"{name}[{var_name!r}]"
    if var_name in RESERVED_ENV or var_name.startswith(RESERVED_ENV_PREFIX):
        raise fail(owner, label, var_name, "a name the training operator does not inject (PET_*, MASTER_*, RANK...)")
    if ("value" in var) == ("valueFrom" in var):
        raise fail(owner, label, var, "exactly one of 'value' and 'valueFrom'")
    if "value" in var and not isinstance(var["value"], str):
        raise fail(owner, label, var["value"], "a str value (quote numbers: '1')", TypeError)
    if "valueFrom" in var:
        _check_value_from(owner, f"{label}.valueFrom", var["valueFrom"])
    return var


def _check_env(owner: str, value: object) -> tuple[JsonDict, ...]:
    items: list[Any]
    if isinstance(value, Mapping):
        items = []
        for key, val in value.items():
            if isinstance(val, str):
                items.append({"name": key, "value": val})
            elif isinstance(val, Mapping) or _is_kubernetes_model(val):
                items.append({"name": key, "valueFrom": to_plain(owner, f"env[{key!r}]", val)})
            else:
                raise fail(owner, f"env[{key!r}]", val, "a str, or a valueFrom such as secret_key_ref(...)", TypeError)
    else:
        items = _check_list(owner, "env", value)
    env = tuple(check_env_var(owner, "env", item) for item in items)
    _check_unique(owner, "env", [var["name"] for var in env])
    return env


def _check_unique(owner: str, name: str, keys: Sequence[str]) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise fail(owner, name, key, "unique names (this one is given twice)")
        seen.add(key)


def _check_env_from(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for index, item in enumerate(_check_list(owner, "env_from", value)):
        label = f"env_from[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, "a mapping such as {'secretRef': {'name': 'creds'}}", TypeError)
        _check_keys(owner, label, item, ("prefix", "configMapRef", "secretRef"))
        sources = [key for key in ("configMapRef", "secretRef") if key in item]
        if len(sources) != 1:
            raise fail(owner, label, item, "exactly one of 'configMapRef' and 'secretRef'")
        ref = item[sources[0]]
        if not isinstance(ref, dict):
            raise fail(owner, f"{label}.{sources[0]}", ref, "a mapping", TypeError)
        _check_keys(owner, f"{label}.{sources[0]}", ref, ("name", "optional"))
        _check_str(owner, f"{label}.{sources[0]}.name", ref.get("name"), _DNS_1123_SUBDOMAIN, "a object name")
        if "prefix" in item:
            _check_str(owner, f"{label}.prefix", item["prefix"], _ENV_NAME, "an env var name prefix")
        checked.append(item)
    return tuple(checked)


def _check_pull_secrets(owner: str, value: object) -> tuple[str, ...]:
    names: list[str] = []
    for index, item in enumerate(_check_list(owner, "image_pull_secrets", value)):
        if isinstance(item, dict) and set(item) == {"name"}:
            item = item["name"]
        names.append(_check_str(owner, f"image_pull_secrets[{index}]", item, _DNS_1123_SUBDOMAIN, "a Secret name"))
    return tuple(dict.fromkeys(names))


def _check_tolerations(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for index, item in enumerate(_check_list(owner, "tolerations", value)):
        label = f"tolerations[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, "a mapping such as {'key': 'nvidia.com/gpu', 'operator': 'Exists'}")
        # The kubernetes client serializes unset fields as absent, but a hand-written dict may carry explicit Nones.
        item = {key: val for key, val in item.items() if val is not None}
        _check_keys(owner, label, item, _TOLERATION_KEYS)
        operator = item.get("operator", "Equal")
        if operator not in _TOLERATION_OPERATORS:
            raise fail(owner, f"{label}.operator", operator, "'Exists' or 'Equal'")
        if "effect" in item and item["effect"] not in _TOLERATION_EFFECTS:
            raise fail(owner, f"{label}.effect", item["effect"], "one of " + ", ".join(_TOLERATION_EFFECTS))
        for key in ("key", "value"):
            if key in item and not isinstance(item[key], str):
                raise fail(owner, f"{label}.{key}", item[key], "a str", TypeError)
        if item.get("key"):
            check_label_key(owner, f"{label}.key", item["key"])
        if operator == "Exists" and item.get("value"):
            raise fail(owner, f"{label}.value", item["value"], "no value with operator 'Exists'")
        if not item.get("key") and operator != "Exists":
            raise fail(owner, f"{label}.operator", operator, "'Exists' when no key is given (tolerate everything)")
        if "tolerationSeconds" in item:
            seconds = item["tolerationSeconds"]
            if not is_int(seconds):
                raise fail(owner, f"{label}.tolerationSeconds", seconds, "an int", TypeError)
            if item.get("effect") != "NoExecute":
                raise fail(owner, f"{label}.effect", item.get("effect"), "'NoExecute' with tolerationSeconds")
        checked.append(item)
    return tuple(checked)


def _check_volumes(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for index, item in enumerate(_check_list(owner, "volumes", value)):
        label = f"volumes[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, "a V1Volume-shaped mapping", TypeError)
        item = {key: val for key, val in item.items() if val is not None}
        _check_str(owner, f"{label}.name", item.get("name"), _DNS_1123_LABEL, "a DNS-1123 label")
        sources = [key for key in item if key != "name"]
        if len(sources) != 1 or not isinstance(item[sources[0]], dict):
            raise fail(owner, label, item, "a name and exactly one volume source, e.g. {'name': 'data', 'pvc': ...}")
        checked.append(item)
    _check_unique(owner, "volumes", [item["name"] for item in checked])
    return tuple(checked)


def _check_volume_mounts(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for index, item in enumerate(_check_list(owner, "volume_mounts", value)):
        label = f"volume_mounts[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, "a V1VolumeMount-shaped mapping", TypeError)
        item = {key: val for key, val in item.items() if val is not None}
        _check_keys(owner, label, item, _MOUNT_KEYS)
        _check_str(owner, f"{label}.name", item.get("name"), _DNS_1123_LABEL, "the name of a volume")
        path = item.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/") or ":" in path:
            raise fail(owner, f"{label}.mountPath", path, "an absolute path without ':'")
        for key in ("subPath", "subPathExpr", "mountPropagation", "recursiveReadOnly"):
            if key in item and not isinstance(item[key], str):
                raise fail(owner, f"{label}.{key}", item[key], "a str", TypeError)
        if "readOnly" in item and not isinstance(item["readOnly"], bool):
            raise fail(owner, f"{label}.readOnly", item["readOnly"], "a bool", TypeError)
        checked.append(item)
    _check_unique(owner, "volume_mounts (mountPath)", [item["mountPath"] for item in checked])
    return tuple(checked)


def _check_pod_template(owner: str, value: object) -> JsonDict:
    template = _check_mapping(owner, "pod_template", value)
    _check_keys(owner, "pod_template", template, ("metadata", "spec"))
    metadata = template.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise fail(owner, "pod_template.metadata", metadata, "a mapping", TypeError)
    metadata = {key: val for key, val in metadata.items() if val is not None}
    _check_keys(owner, "pod_template.metadata", metadata, ("labels", "annotations", "name"))
    if "labels" in metadata:
        metadata["labels"] = dict(check_labels(owner, "pod_template.metadata.labels", metadata["labels"]))
    if "annotations" in metadata:
        metadata["annotations"] = dict(
            check_annotations(owner, "pod_template.metadata.annotations", metadata["annotations"])
        )
    # The training operator ignores a template's name; dropping it keeps the rendered job free of a misleading name.
    metadata.pop("name", None)
    spec = template.get("spec") or {}
    if not isinstance(spec, dict):
        raise fail(owner, "pod_template.spec", spec, "a mapping", TypeError)
    spec = {key: val for key, val in spec.items() if val is not None}
    if "restartPolicy" in spec:
        raise fail(
            owner,
            "pod_template.spec.restartPolicy",
            spec["restartPolicy"],
            "no restartPolicy: it is set per replica (Master/Worker(restart_policy=...)) and is Never for a single Pod",
        )
    containers = spec.get("containers") or []
    if not isinstance(containers, list) or not all(isinstance(c, dict) and c.get("name") for c in containers):
        raise fail(owner, "pod_template.spec.containers", containers, "a list of containers, each with a name")
    _check_unique(owner, "pod_template.spec.containers", [c["name"] for c in containers])
    for container in containers:
        if container["name"] == "pytorch":
            for key in ("command", "args"):
                if container.get(key):
                    raise fail(
                        owner,
                        f"pod_template.spec.containers['pytorch'].{key}",
                        container[key],
                        "no command or args on the 'pytorch' container: the provider runs the training function "
                        "there (add other containers for sidecars, or use a different image entrypoint)",
                    )
            ports = container.get("ports") or []
            for index, port in enumerate(ports if isinstance(ports, list) else []):
                if isinstance(port, dict) and not port.get("name"):
                    # The training operator makes every port of this container a port of each replica's headless
                    # Service, unnamed ones too (kubeflow/trainer v1.9 core/service.go), and beside the port it
                    # adds itself, an unnamed one makes the API server refuse the Service: the job never starts.
                    raise fail(
                        owner,
                        f"pod_template.spec.containers['pytorch'].ports[{index}]",
                        port,
                        "a named port ({'name': 'metrics', 'containerPort': 9090}): the training operator turns "
                        "every port of the 'pytorch' container into a Service port, and Kubernetes refuses a "
                        "Service with an unnamed port among several",
                    )
    for key in ("containers", "initContainers"):
        items = spec.get(key) or []
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            where = f"pod_template.spec.{key}[{item.get('name')!r}]"
            if item.get("image") is not None:
                # Pod options are not templated: an image here reaches the pod exactly as written.
                check_image(owner, f"{where}.image", item["image"])
            resources = item.get("resources")
            if isinstance(resources, dict):
                # The same rules as requests/limits given anywhere else (a 'gpu' key, a bad quantity), and the same
                # normal form: quantities as strings, so that requests and limits compare when merged.
                for part in ("requests", "limits"):
                    if resources.get(part) is not None:
                        resources[part] = dict(check_resources(owner, f"{where}.resources.{part}", resources[part]))
    return {"metadata": metadata, "spec": spec}


def _check_name(owner: str, name: str, value: object, what: str) -> str | None:
    if value is None:
        return None
    return _check_str(owner, name, value, _DNS_1123_SUBDOMAIN, f"a {what} name (a lowercase DNS subdomain) or None")


def _check_shm(owner: str, value: object) -> str | _Unset | None:
    if value is None or value is UNSET:
        return value
    if is_int(value):
        value = str(value)
    number = _POSITIVE_NUMBER.match(value) if isinstance(value, str) else None
    if not isinstance(value, str) or not QUANTITY.match(value) or not number or float(number.group(0)) <= 0:
        raise fail(owner, "shm_size", value, "a positive memory quantity such as '2Gi', or None for no /dev/shm volume")
    return value


@dataclass(frozen=True, kw_only=True)
class PodOptions:
    """What platform teams add to a task's pods: pull settings, env, resources, placement, volumes, metadata.

    Values use the Kubernetes API's field shapes (``{"key": "gpu", "operator": "Exists"}``); kubernetes client objects
    are accepted as well.
    """

    #: ``Always``, ``IfNotPresent`` or ``Never``; the cluster's default when None.
    image_pull_policy: str | None = None
    #: Names of ``kubernetes.io/dockerconfigjson`` Secrets (or ``{"name": ...}`` / ``V1LocalObjectReference``).
    image_pull_secrets: Sequence[Any] = ()
    #: ``{"NAME": "value", "TOKEN": secret_key_ref("secret", "key")}``, or a list of V1EnvVar-shaped dicts.
    env: EnvInput = ()
    #: Whole Secrets or ConfigMaps as env: ``[{"secretRef": {"name": "creds"}}, {"configMapRef": {...}}]``.
    env_from: Sequence[Any] = ()
    #: Requests of the ``pytorch`` container; a replica's own ``requests`` win key by key.
    requests: Mapping[str, Any] = field(default_factory=dict)
    #: Limits of the ``pytorch`` container, e.g. ``{"nvidia.com/gpu": 8}``; a replica's own ``limits`` win key by key.
    limits: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Any] = ()
    #: A V1Affinity-shaped mapping (``nodeAffinity``, ``podAffinity``, ``podAntiAffinity``).
    affinity: Mapping[str, Any] | None = None
    #: Pod volumes (V1Volume-shaped), mounted into the ``pytorch`` container by ``volume_mounts``.
    volumes: Sequence[Any] = ()
    volume_mounts: Sequence[Any] = ()
    service_account_name: str | None = None
    #: Labels on every object the task creates (job, pods, ConfigMap), e.g. ``{"kueue.x-k8s.io/queue-name": "q"}``.
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    priority_class_name: str | None = None
    #: Size of the memory-backed ``/dev/shm``; ``DEFAULT_SHM_SIZE`` when not given, None for the runtime's 64 MiB.
    shm_size: str | Literal[_Unset.UNSET] | None = UNSET
    #: A full pod template (dict or ``V1PodTemplateSpec``) under the generated pod: sidecars, init containers,
    #: security contexts... The generated fields are laid over it; a conflicting value is an error.
    pod_template: Mapping[str, Any] | Any | None = None

    def __post_init__(self) -> None:
        owner = "PodOptions"
        if self.image_pull_policy is not None and self.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise fail(owner, "image_pull_policy", self.image_pull_policy, "one of 'Always', 'IfNotPresent', 'Never'")
        normalized: dict[str, Any] = {
            "image_pull_secrets": _check_pull_secrets(owner, self.image_pull_secrets),
            "env": _check_env(owner, self.env),
            "env_from": _check_env_from(owner, self.env_from),
            "requests": check_resources(owner, "requests", self.requests),
            "limits": check_resources(owner, "limits", self.limits),
            "node_selector": check_labels(owner, "node_selector", self.node_selector, reserved_ok=True),
            "tolerations": _check_tolerations(owner, self.tolerations),
            "volumes": _check_volumes(owner, self.volumes),
            "volume_mounts": _check_volume_mounts(owner, self.volume_mounts),
            "labels": check_labels(owner, "labels", self.labels),
            "annotations": check_annotations(owner, "annotations", self.annotations),
            "shm_size": _check_shm(owner, self.shm_size),
            "service_account_name": _check_name(owner, "service_account_name", self.service_account_name, "account"),
            "priority_class_name": _check_name(owner, "priority_class_name", self.priority_class_name, "PriorityClass"),
        }
        if self.affinity is not None:
            affinity = _check_mapping(owner, "affinity", self.affinity)
            affinity = {key: val for key, val in affinity.items() if val is not None}
            _check_keys(owner, "affinity", affinity, _AFFINITY_KEYS)
            for key, val in affinity.items():
                if not isinstance(val, dict):
                    raise fail(owner, f"affinity.{key}", val, "a mapping", TypeError)
            normalized["affinity"] = MappingProxyType(affinity)
        if self.pod_template is not None:
            normalized["pod_template"] = MappingProxyType(_check_pod_template(owner, self.pod_template))
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @property
    def effective_shm_size(self) -> str | None:
        """The ``/dev/shm`` size this pod gets, ``None`` for no volume."""
        return DEFAULT_SHM_SIZE if self.shm_size is UNSET else self.shm_size

    @property
    def env_vars(self) -> tuple[JsonDict, ...]:
        """The env as V1EnvVar-shaped dicts, in order (copies)."""
        return tuple(copy.deepcopy(dict(var)) for var in cast("tuple[JsonDict, ...]", self.env))

    @property
    def template(self) -> JsonDict:
        """A mutable deep copy of ``pod_template`` (``{"metadata": {}, "spec": {}}`` when none)."""
        if self.pod_template is None:
            return {"metadata": {}, "spec": {}}
        return copy.deepcopy(dict(cast("Mapping[str, Any]", self.pod_template)))


def _merge_by(key: str, base: Sequence[JsonDict], override: Sequence[JsonDict]) -> tuple[JsonDict, ...]:
    merged = {item[key]: item for item in base}
    merged.update({item[key]: item for item in override})
    return tuple(merged.values())


def _append_unique(base: Sequence[Any], override: Sequence[Any]) -> tuple[Any, ...]:
    merged = list(base)
    merged += [item for item in override if item not in merged]
    return tuple(merged)


def merge_pod_options(base: PodOptions | None, override: PodOptions | None) -> PodOptions:
    """A replica's options (``override``) over the operator's (``base``); see the module docstring for the rules."""
    if base is None or override is None:
        return override or base or PodOptions()
    merged: dict[str, Any] = {}
    for spec in fields(PodOptions):
        name = spec.name
        old, new = getattr(base, name), getattr(override, name)
        if name == "shm_size":
            merged[name] = old if new is UNSET else new
        elif name in ("env", "volumes"):
            merged[name] = _merge_by("name", old, new)
        elif name == "volume_mounts":
            merged[name] = _merge_by("mountPath", old, new)
        elif name in ("image_pull_secrets", "tolerations", "env_from"):
            merged[name] = _append_unique(old, new)
        elif isinstance(old, Mapping) and name != "affinity" and name != "pod_template":
            merged[name] = {**old, **new}
        else:
            merged[name] = old if new is None else new
    return replace(PodOptions(), **merged)


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """Job-level settings of a PyTorchJob (not of a single Pod, where they would mean nothing)."""

    #: Gang scheduling (Volcano, scheduler-plugins) in the CRD's keys: ``minAvailable``, ``queue``, ``minResources``,
    #: ``priorityClass``, ``scheduleTimeoutSeconds``. The queue cannot be changed once the job exists.
    scheduling_policy: Mapping[str, Any] | None = None
    #: Create the job suspended: no pods until something (Kueue, a person) sets ``spec.runPolicy.suspend`` to false.
    suspend: bool = False

    def __post_init__(self) -> None:
        owner = "JobOptions"
        if not isinstance(self.suspend, bool):
            raise fail(owner, "suspend", self.suspend, "a bool", TypeError)
        if self.scheduling_policy is None:
            return
        policy = _check_mapping(owner, "scheduling_policy", self.scheduling_policy)
        _check_keys(owner, "scheduling_policy", policy, _SCHEDULING_POLICY_KEYS)
        for key in ("minAvailable", "scheduleTimeoutSeconds"):
            if key in policy:
                value = policy[key]
                if not is_int(value):
                    raise fail(owner, f"scheduling_policy.{key}", value, "an int", TypeError)
                if not 0 <= value <= _INT32_MAX:
                    raise fail(owner, f"scheduling_policy.{key}", value, f"an int in 0..{_INT32_MAX}")
        for key in ("queue", "priorityClass"):
            if key in policy and (not isinstance(policy[key], str) or not policy[key]):
                raise fail(owner, f"scheduling_policy.{key}", policy[key], "a non-empty str")
        if "minResources" in policy:
            policy["minResources"] = dict(
                check_resources(owner, "scheduling_policy.minResources", policy["minResources"])
            )
        object.__setattr__(self, "scheduling_policy", MappingProxyType(policy))

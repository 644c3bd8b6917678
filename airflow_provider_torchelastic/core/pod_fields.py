"""The checks of the Kubernetes fields pod options carry: names, labels and annotations, env and its sources,
tolerations, volumes and mounts, the pod template (affinity has its own module, :mod:`.affinity`); each names the
option, the field and what it expects.

Pure and standard library only (what :mod:`.pod_options` validates with while a DAG file is parsed). A kubernetes
client object given instead of a plain dict (``V1Toleration`` ...) is converted by :func:`to_plain`, importing the
kubernetes package only then.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from enum import Enum
from types import MappingProxyType
from typing import Any, Final, TypeAlias, cast

from airflow_provider_torchelastic.core.naming import (
    DNS_1123_LABEL,
    DNS_1123_SUBDOMAIN,
    LABEL_VALUE,
    QUALIFIED_NAME,
    is_reserved_key,
)
from airflow_provider_torchelastic.core.validation import QUANTITY, check_image, check_resources, fail, is_int

JsonDict: TypeAlias = dict[str, Any]


class Unset(Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


#: "Not given": a replica's ``shm_size=UNSET`` inherits the operator's; the operator's falls back to the default.
UNSET: Final = Unset.UNSET


IMAGE_PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")


_DNS_POLICIES: Final = ("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None")


#: Kubernetes' volume sources (``VolumeSource``, 1.34), and the fields the API server requires of the common ones.
_VOLUME_SOURCES: Final = (
    *("persistentVolumeClaim", "emptyDir", "configMap", "secret", "hostPath", "csi", "ephemeral", "projected"),
    *("downwardAPI", "nfs", "image", "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "fc"),
    *("flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "iscsi", "photonPersistentDisk"),
    *("portworxVolume", "quobyte", "rbd", "scaleIO", "storageos", "vsphereVolume"),
)
_VOLUME_REQUIRED: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "persistentVolumeClaim": ("claimName",),
        "configMap": ("name",),
        "secret": ("secretName",),
        "hostPath": ("path",),
        "csi": ("driver",),
        "nfs": ("server", "path"),
    }
)


_PORT_PROTOCOLS: Final = ("TCP", "UDP", "SCTP")
#: An IANA service name (the API server's IsValidPortName; no '--' and a letter are checked apart).
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?\Z")
_PORT_NAME_EXPECTED: Final = "a port name: <= 15 of [-a-z0-9], a letter among them, no '--', alnum ends"


#: Injected by the training operator (which appends them after the template's env, so they would win anyway): a user
#: value would only look like it does something.
RESERVED_ENV: Final = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"})


RESERVED_ENV_PREFIX: Final = "PET_"


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


_MOUNT_KEYS: Final = frozenset(
    {"name", "mountPath", "readOnly", "subPath", "subPathExpr", "mountPropagation", "recursiveReadOnly"}
)


SCHEDULING_POLICY_KEYS: Final = ("minAvailable", "queue", "minResources", "priorityClass", "scheduleTimeoutSeconds")


_LABEL_VALUE_EXPECTED: Final = "a label value: <= 63 of [-_.A-Za-z0-9], alnum ends"
_POSITIVE_NUMBER = re.compile(r"^\+?(\d+\.?\d*|\.\d+)")


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


def check_mapping(owner: str, name: str, value: object) -> JsonDict:
    plain = to_plain(owner, name, value)
    if not isinstance(plain, dict):
        raise fail(owner, name, value, "a mapping", TypeError)
    return plain


def _check_list(owner: str, name: str, value: object) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise fail(owner, name, value, "a list", TypeError)
    return cast("list[Any]", to_plain(owner, name, list(value)))


def _check_mappings(
    owner: str, name: str, value: object, expected: str, exc: type[Exception] = TypeError
) -> Iterator[tuple[str, JsonDict]]:
    """Each mapping of the list ``value``, with its name for messages (``name[i]``) and its None fields dropped: the
    kubernetes client serializes unset fields as absent, but a hand-written dict may carry explicit Nones."""
    for index, item in enumerate(_check_list(owner, name, value)):
        label = f"{name}[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, expected, exc)
        yield label, {key: val for key, val in item.items() if val is not None}


def check_keys(owner: str, name: str, value: Mapping[str, Any], allowed: frozenset[str] | Sequence[str]) -> None:
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
    if (prefix and not DNS_1123_SUBDOMAIN.match(prefix)) or not QUALIFIED_NAME.match(local):
        raise fail(owner, name, key, expected)
    return key


def check_labels(owner: str, name: str, value: object, *, reserved_ok: bool = False) -> Mapping[str, str]:
    labels = check_mapping(owner, name, value)
    for key, label in labels.items():
        check_label_key(owner, name, key)
        if not reserved_ok and is_reserved_key(key):
            raise fail(owner, f"{name}[{key!r}]", key, "a key the provider and the training operator do not set")
        check_label_value(owner, f"{name}[{key!r}]", label)
    return MappingProxyType(labels)


def check_label_value(owner: str, name: str, value: object) -> str:
    return _check_str(owner, name, value, LABEL_VALUE, _LABEL_VALUE_EXPECTED)


def check_annotations(owner: str, name: str, value: object) -> Mapping[str, str]:
    annotations = check_mapping(owner, name, value)
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
    check_keys(owner, f"{name}.{source}", ref, _VALUE_FROM_KEYS[source])
    required = {"secretKeyRef": ("name", "key"), "configMapKeyRef": ("name", "key"), "fieldRef": ("fieldPath",)}
    for key in required.get(source, ("resource",)):
        if not isinstance(ref.get(key), str) or not ref[key]:
            raise fail(owner, f"{name}.{source}.{key}", ref.get(key), "a non-empty str")
    if "optional" in ref and not isinstance(ref["optional"], bool):
        raise fail(owner, f"{name}.{source}.optional", ref["optional"], "a bool", TypeError)
    return value_from


def check_env_var(owner: str, name: str, item: object) -> JsonDict:
    """One V1EnvVar-shaped dict: ``{"name", "value"}`` or ``{"name", "valueFrom"}``."""
    var = check_mapping(owner, name, item)
    check_keys(owner, name, var, ("name", "value", "valueFrom"))
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


def check_env(owner: str, value: object) -> tuple[JsonDict, ...]:
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


def check_env_from(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for index, item in enumerate(_check_list(owner, "env_from", value)):
        label = f"env_from[{index}]"
        if not isinstance(item, dict):
            raise fail(owner, label, item, "a mapping such as {'secretRef': {'name': 'creds'}}", TypeError)
        check_keys(owner, label, item, ("prefix", "configMapRef", "secretRef"))
        sources = [key for key in ("configMapRef", "secretRef") if key in item]
        if len(sources) != 1:
            raise fail(owner, label, item, "exactly one of 'configMapRef' and 'secretRef'")
        ref = item[sources[0]]
        if not isinstance(ref, dict):
            raise fail(owner, f"{label}.{sources[0]}", ref, "a mapping", TypeError)
        check_keys(owner, f"{label}.{sources[0]}", ref, ("name", "optional"))
        _check_str(owner, f"{label}.{sources[0]}.name", ref.get("name"), DNS_1123_SUBDOMAIN, "a object name")
        if "prefix" in item:
            _check_str(owner, f"{label}.prefix", item["prefix"], _ENV_NAME, "an env var name prefix")
        checked.append(item)
    return tuple(checked)


def check_pull_secrets(owner: str, value: object) -> tuple[str, ...]:
    names: list[str] = []
    for index, item in enumerate(_check_list(owner, "image_pull_secrets", value)):
        if isinstance(item, dict) and set(item) == {"name"}:
            item = item["name"]
        names.append(_check_str(owner, f"image_pull_secrets[{index}]", item, DNS_1123_SUBDOMAIN, "a Secret name"))
    return tuple(dict.fromkeys(names))


def check_tolerations(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    example = "a mapping such as {'key': 'nvidia.com/gpu', 'operator': 'Exists'}"
    for label, item in _check_mappings(owner, "tolerations", value, example, ValueError):
        check_keys(owner, label, item, _TOLERATION_KEYS)
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
        if item.get("value"):  # the API server holds a toleration's value to a label value's rules
            check_label_value(owner, f"{label}.value", item["value"])
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


def check_volumes(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for label, item in _check_mappings(owner, "volumes", value, "a V1Volume-shaped mapping"):
        _check_str(owner, f"{label}.name", item.get("name"), DNS_1123_LABEL, "a DNS-1123 label")
        sources = [key for key in item if key != "name"]
        if len(sources) != 1 or not isinstance(item[sources[0]], dict):
            example = "{'name': 'data', 'persistentVolumeClaim': {'claimName': 'data'}}"
            raise fail(owner, label, item, f"a name and exactly one volume source, e.g. {example}")
        source, fields = sources[0], item[sources[0]]
        if source not in _VOLUME_SOURCES:  # the API server would drop it, and make a volume of no source an emptyDir
            raise fail(owner, f"{label}.{source}", fields, "a volume source: one of " + ", ".join(_VOLUME_SOURCES))
        for key in _VOLUME_REQUIRED.get(source, ()):
            if not isinstance(fields.get(key), str) or not fields[key]:
                raise fail(owner, f"{label}.{source}.{key}", fields.get(key), "a non-empty str")
        checked.append(item)
    _check_unique(owner, "volumes", [item["name"] for item in checked])
    return tuple(checked)


def check_volume_mounts(owner: str, value: object) -> tuple[JsonDict, ...]:
    checked = []
    for label, item in _check_mappings(owner, "volume_mounts", value, "a V1VolumeMount-shaped mapping"):
        check_keys(owner, label, item, _MOUNT_KEYS)
        _check_str(owner, f"{label}.name", item.get("name"), DNS_1123_LABEL, "the name of a volume")
        path = item.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/") or ":" in path:
            raise fail(owner, f"{label}.mountPath", path, "an absolute path without ':'")
        for key in ("subPath", "subPathExpr", "mountPropagation", "recursiveReadOnly"):
            if key in item and not isinstance(item[key], str):
                raise fail(owner, f"{label}.{key}", item[key], "a str", TypeError)
        for key in ("subPath", "subPathExpr"):
            # The API server's validateLocalDescendingPath: a path inside the volume.
            if key in item and (item[key].startswith("/") or ".." in item[key].split("/")):
                raise fail(owner, f"{label}.{key}", item[key], "a relative path inside the volume, without '..'")
        if "readOnly" in item and not isinstance(item["readOnly"], bool):
            raise fail(owner, f"{label}.readOnly", item["readOnly"], "a bool", TypeError)
        checked.append(item)
    _check_unique(owner, "volume_mounts (mountPath)", [item["mountPath"] for item in checked])
    return tuple(checked)


def check_pod_template(owner: str, value: object) -> JsonDict:
    template = check_mapping(owner, "pod_template", value)
    check_keys(owner, "pod_template", template, ("metadata", "spec"))
    metadata = template.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise fail(owner, "pod_template.metadata", metadata, "a mapping", TypeError)
    metadata = {key: val for key, val in metadata.items() if val is not None}
    check_keys(owner, "pod_template.metadata", metadata, ("labels", "annotations", "name"))
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
    _check_containers(owner, spec)
    _check_dns_policy(owner, spec)
    return {"metadata": metadata, "spec": spec}


def _check_containers(owner: str, spec: JsonDict) -> None:
    """Each container's name, image and resources (normalized in place), and the ``pytorch`` container's rules."""
    names: list[str] = []
    for key in ("containers", "initContainers"):
        items = spec.get(key) or []
        if not isinstance(items, list) or not all(isinstance(c, dict) and c.get("name") for c in items):
            raise fail(owner, f"pod_template.spec.{key}", items, "a list of containers, each with a name")
        for item in items:
            where = f"pod_template.spec.{key}[{item['name']!r}]"
            names.append(_check_str(owner, f"{where}.name", item["name"], DNS_1123_LABEL, "a DNS-1123 label"))
            if item["name"] == "pytorch" and key == "containers":
                _check_pytorch_container(owner, item)
            if "ports" in item:
                _check_ports(owner, f"{where}.ports", item["ports"])
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
    # Init containers and containers share one namespace of names (the API server refuses a name given twice).
    _check_unique(owner, "pod_template.spec containers and initContainers", names)


def _check_ports(owner: str, name: str, value: object) -> None:
    """A container's ports by the API server's rules (``validateContainerPorts``): a port name is an IANA service
    name (at most 15 characters: ``prometheus-metrics`` is one too many), unique in its container."""
    port_names: list[str] = []
    example = "a mapping such as {'name': 'metrics', 'containerPort': 9090}"
    for label, port in _check_mappings(owner, name, value, example):
        if port.get("name"):  # an empty name is no name
            port_names.append(_check_str(owner, f"{label}.name", port["name"], _PORT_NAME, _PORT_NAME_EXPECTED))
            if "--" in port["name"] or not re.search("[a-z]", port["name"]):
                raise fail(owner, f"{label}.name", port["name"], _PORT_NAME_EXPECTED)
        # A containerPort is required; a hostPort of 0 (or none) is no host port.
        for key, least in (("containerPort", 1), ("hostPort", 0)):
            number = port.get(key, None if least else 0)
            if not is_int(number) or not least <= cast("int", number) <= 65535:
                raise fail(owner, f"{label}.{key}", number, "a port number from 1 to 65535")
        if port.get("protocol") not in (None, "", *_PORT_PROTOCOLS):  # none or empty: the API server's TCP
            raise fail(owner, f"{label}.protocol", port["protocol"], "one of " + ", ".join(_PORT_PROTOCOLS))
    _check_unique(owner, f"{name} (name)", port_names)


def _check_dns_policy(owner: str, spec: JsonDict) -> None:
    policy = spec.get("dnsPolicy")
    if policy not in (None, "", *_DNS_POLICIES):  # the API server defaults an empty policy to ClusterFirst
        raise fail(owner, "pod_template.spec.dnsPolicy", policy, "one of " + ", ".join(_DNS_POLICIES))
    config = spec.get("dnsConfig")
    if policy == "None" and not (isinstance(config, dict) and config.get("nameservers")):
        raise fail(owner, "pod_template.spec.dnsConfig", config, "nameservers when dnsPolicy is 'None'")


def _check_pytorch_container(owner: str, container: JsonDict) -> None:
    """The template's ``pytorch`` container leaves the command to the provider and names every port."""
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


def check_name(owner: str, name: str, value: object, what: str) -> str | None:
    if value is None:
        return None
    return _check_str(owner, name, value, DNS_1123_SUBDOMAIN, f"a {what} name (a lowercase DNS subdomain) or None")


def check_shm(owner: str, value: object) -> str | Unset | None:
    if value is None or value is UNSET:
        return value
    if is_int(value):
        value = str(value)
    number = _POSITIVE_NUMBER.match(value) if isinstance(value, str) else None
    if not isinstance(value, str) or not QUANTITY.match(value) or not number or float(number.group(0)) <= 0:
        raise fail(owner, "shm_size", value, "a positive memory quantity such as '2Gi', or None for no /dev/shm volume")
    return value

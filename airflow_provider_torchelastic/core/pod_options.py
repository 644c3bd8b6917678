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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, cast

from airflow_provider_torchelastic.core.affinity import check_affinity, check_topology_spread
from airflow_provider_torchelastic.core.pod_fields import (
    IMAGE_PULL_POLICIES,
    SCHEDULING_POLICY_KEYS,
    UNSET,
    Unset,
    check_annotations,
    check_env,
    check_env_from,
    check_keys,
    check_labels,
    check_mapping,
    check_name,
    check_pod_template,
    check_pull_secrets,
    check_shm,
    check_tolerations,
    check_volume_mounts,
    check_volumes,
)
from airflow_provider_torchelastic.core.public import publish
from airflow_provider_torchelastic.core.validation import check_resources, fail, is_int

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


JsonDict: TypeAlias = dict[str, Any]
EnvInput: TypeAlias = Mapping[str, "str | Mapping[str, Any]"] | Sequence[Any]


_INT32_MAX: Final = 2**31 - 1


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
    #: Whether the pods mount their service account's API token. None (the default): not mounted unless a service
    #: account is named (here or as the pod template's ``serviceAccountName``; that account's own
    #: ``automountServiceAccountToken`` then decides) or the pod template sets ``automountServiceAccountToken``.
    #: Training code rarely calls the Kubernetes API, and the namespace's ``default`` account's token would only
    #: widen what code running in a pod can do. True or False: set on every pod, whatever the account.
    automount_service_account_token: bool | None = None
    #: Labels on every object the task creates (job, pods, ConfigMap), e.g. ``{"kueue.x-k8s.io/queue-name": "q"}``.
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    priority_class_name: str | None = None
    #: Size of the memory-backed ``/dev/shm``; ``DEFAULT_SHM_SIZE`` when not given, None for the runtime's 64 MiB.
    shm_size: str | Literal[Unset.UNSET] | None = UNSET
    #: A full pod template (dict or ``V1PodTemplateSpec``) under the generated pod: sidecars, init containers,
    #: security contexts... The generated fields are laid over it; a conflicting value is an error.
    pod_template: Mapping[str, Any] | Any | None = None

    def __post_init__(self) -> None:
        owner = "PodOptions"
        if self.image_pull_policy is not None and self.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise fail(owner, "image_pull_policy", self.image_pull_policy, "one of 'Always', 'IfNotPresent', 'Never'")
        automount = self.automount_service_account_token
        if automount is not None and not isinstance(automount, bool):
            raise fail(owner, "automount_service_account_token", automount, "True, False or None", TypeError)
        normalized: dict[str, Any] = {
            "image_pull_secrets": check_pull_secrets(owner, self.image_pull_secrets),
            "env": check_env(owner, self.env),
            "env_from": check_env_from(owner, self.env_from),
            "requests": check_resources(owner, "requests", self.requests),
            "limits": check_resources(owner, "limits", self.limits),
            "node_selector": check_labels(owner, "node_selector", self.node_selector, reserved_ok=True),
            "tolerations": check_tolerations(owner, self.tolerations),
            "volumes": check_volumes(owner, self.volumes),
            "volume_mounts": check_volume_mounts(owner, self.volume_mounts),
            "labels": check_labels(owner, "labels", self.labels),
            "annotations": check_annotations(owner, "annotations", self.annotations),
            "shm_size": check_shm(owner, self.shm_size),
            "service_account_name": check_name(owner, "service_account_name", self.service_account_name, "account"),
            "priority_class_name": check_name(owner, "priority_class_name", self.priority_class_name, "PriorityClass"),
        }
        if self.affinity is not None:
            normalized["affinity"] = check_affinity(owner, "affinity", self.affinity)
        if self.pod_template is not None:
            template = check_pod_template(owner, self.pod_template)
            if "affinity" in template["spec"]:
                check_affinity(owner, "pod_template.spec.affinity", template["spec"]["affinity"])
            if "topologySpreadConstraints" in template["spec"]:
                constraints = template["spec"]["topologySpreadConstraints"]
                check_topology_spread(owner, "pod_template.spec.topologySpreadConstraints", constraints)
            normalized["pod_template"] = MappingProxyType(template)
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
        policy = check_mapping(owner, "scheduling_policy", self.scheduling_policy)
        check_keys(owner, "scheduling_policy", policy, SCHEDULING_POLICY_KEYS)
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
                check_resources(owner, "scheduling_policy.minResources", policy["minResources"], container=False)
            )
        object.__setattr__(self, "scheduling_policy", MappingProxyType(policy))


# Exported at the package root, and shown (and pickled by reference) by that path.
publish(PodOptions, JobOptions)

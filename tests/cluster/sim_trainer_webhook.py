"""The TrainJob admission rules a 1.20 API server does not enforce, as pure functions for the simulated webhook.

A 1.20 API server accepts the derived Trainer v2.3.0 CRDs (``tests/crds/``) but drops their CEL rules
(``x-kubernetes-validations``) silently, and the Trainer's own validating webhook (kubeflow/trainer v2.3.0
``pkg/webhooks/trainjob_webhook.go`` ``ValidateCreate``/``ValidateUpdate`` -> ``runtime.ValidateObjects`` -> the
plugins' ``Validate``) does not run here either. :func:`validate_trainjob` gives both, one string per error:

* the CEL rules of the TrainJob CRD, listed in :data:`CEL_RULES` (the tests compare that list with the derived CRD,
  so a new upstream rule is noticed): the RFC 1035 name of at most 63 characters, ``managedBy`` one of two values,
  and the immutable fields (``trainer``, ``runtimeRef``, ``managedBy``, ``activeDeadlineSeconds``, ``initializer``,
  a runtime patch's ``manager`` and several of its PodSpecPatch fields). As with the API server, a transition rule
  (``self == oldSelf``) is checked only on UPDATE and only where the field is in the old and the new object; list
  items are paired by their list-map key (``manager`` for ``runtimePatches``, ``name`` for ``replicatedJobs``).
  Messages have the API server's form ``<path>: Invalid value: "<type>": <message>``.
* the webhook's rules: the torch plugin refuses the reserved ``PET_*`` names in ``trainer.env``
  (``torch.go`` ``Validate``, ``constants.TorchRunReservedEnvNames``); a ContainerPatch may not set ``env`` on
  containers ``node``, ``dataset-initializer`` and ``model-initializer`` (their env comes through the Trainer and
  Initializer APIs); with the runtime given, a patched replicated job and container must exist in it, and a
  ``runtimeRef`` to a runtime that does not exist is refused (upstream: ``not found ClusterTrainingRuntime specified
  in TrainJob``, a denial the client sees as 403 Forbidden, hence :data:`DENIED_STATUS`).

The messages of the webhook's rules are this module's wording of what upstream checks (the CEL ones are the CRD's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

JsonDict = dict[str, Any]

RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: Containers whose env a ContainerPatch may not set (trainjob_types.go ContainerPatch).
ENV_THROUGH_API = ("node", "dataset-initializer", "model-initializer")
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")
#: What the API server answers when a validating webhook denies a request without a code of its own.
DENIED_STATUS = 403

_POD_SPEC = ".spec.runtimePatches[].trainingRuntimeSpec.template.spec.replicatedJobs[].template.spec.template.spec"
IMMUTABLE = "field is immutable"
#: The TrainJob CRD's CEL rules (path in the schema, rule, message), as in tests/crds' derivative (status aside).
CEL_RULES: tuple[tuple[str, str, str], ...] = (
    (
        "",
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must match RFC 1035 DNS label format",
    ),
    ("", "size(self.metadata.name) <= 63", "metadata.name must be no more than 63 characters"),
    (".spec.activeDeadlineSeconds", "self == oldSelf", IMMUTABLE),
    (".spec.initializer", "self == oldSelf", IMMUTABLE),
    (
        ".spec.initializer.dataset.storageUri",
        "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')",
        "storageUri may be empty, or it must be a valid URI (scheme://...)",
    ),
    (
        ".spec.initializer.model.storageUri",
        "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')",
        "storageUri may be empty, or it must be a valid URI (scheme://...)",
    ),
    (
        ".spec.managedBy",
        "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']",
        "ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set",
    ),
    (".spec.managedBy", "self == oldSelf", IMMUTABLE),
    (".spec.runtimePatches[].manager", "self == oldSelf", IMMUTABLE),
    *(
        (f"{_POD_SPEC}.{name}", "self == oldSelf", IMMUTABLE)
        for name in (
            "containers",
            "imagePullSecrets",
            "initContainers",
            "securityContext",
            "serviceAccountName",
            "terminationGracePeriodSeconds",
            "volumes",
        )
    ),
    (".spec.runtimeRef", "self == oldSelf", IMMUTABLE),
    (".spec.trainer", "self == oldSelf", IMMUTABLE),
)
#: List-map keys the API server pairs old and new items by.
LIST_KEYS = {"runtimePatches": "manager", "replicatedJobs": "name"}
_MISSING = object()


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _invalid(path: str, value: Any, message: str) -> str:
    """The API server's CEL error: ``<path>: Invalid value: "<type>": <message>`` (``<nil>`` for the root)."""
    return f'{path.lstrip(".") or "<nil>"}: Invalid value: "{_type_name(value)}": {message}'


def _walk(path: str, new: Any, old: Any, concrete: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(concrete path, new value, old value or _MISSING) of every place ``path`` names in the new object."""
    if not path:
        yield concrete, new, old
        return
    head, _, rest = path.lstrip(".").partition(".")
    rest = "." + rest if rest else ""
    is_list = head.endswith("[]")
    name = head[:-2] if is_list else head
    if not isinstance(new, Mapping) or name not in new:
        return
    child_old = old.get(name, _MISSING) if isinstance(old, Mapping) else _MISSING
    if not is_list:
        yield from _walk(rest, new[name], child_old, f"{concrete}.{name}")
        return
    key = LIST_KEYS.get(name)
    olds = child_old if isinstance(child_old, list) else []
    for i, item in enumerate(new[name] or []):
        if key is not None and isinstance(item, Mapping):
            match = next((o for o in olds if isinstance(o, Mapping) and o.get(key) == item.get(key)), _MISSING)
        else:
            match = olds[i] if i < len(olds) else _MISSING
        yield from _walk(rest, item, match, f"{concrete}.{name}[{i}]")


def _check_rule(rule: str, message: str, value: Any, old: Any, path: str, update: bool) -> list[str]:
    if rule == "self == oldSelf":
        if update and old is not _MISSING and value != old:
            return [_invalid(path, value, message)]
        return []
    if rule.startswith("self.metadata.name.matches"):
        name = str((value.get("metadata") or {}).get("name") or "")
        return [] if RFC1035.match(name) else [_invalid(path, value, message)]
    if rule.startswith("size(self.metadata.name)"):
        name = str((value.get("metadata") or {}).get("name") or "")
        return [] if len(name) <= 63 else [_invalid(path, value, message)]
    if rule.startswith("self == '' || self.matches"):
        return [] if value == "" or URI.match(str(value)) else [_invalid(path, value, message)]
    if rule.startswith("self in ["):
        return [] if value in MANAGED_BY else [_invalid(path, value, message)]
    raise ValueError(f"no evaluation for CEL rule {rule!r}")


def cel_errors(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """The CRD's CEL rules (:data:`CEL_RULES`) on ``obj`` (and, for an UPDATE, ``old``)."""
    errors: list[str] = []
    for path, rule, message in CEL_RULES:
        for concrete, value, old_value in _walk(path, obj, old if old is not None else _MISSING):
            errors += _check_rule(rule, message, value, old_value, concrete, old is not None)
    return errors


def _runtime_pod_specs(runtime: Mapping[str, Any]) -> dict[str, JsonDict]:
    rjobs = (((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    return {
        r.get("name"): (((r.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        for r in rjobs
    }


def webhook_errors(obj: Mapping[str, Any], runtime: Mapping[str, Any] | None = None) -> list[str]:
    """The Trainer webhook's rules (module docstring); ``runtime`` is the referenced runtime object, when known."""
    spec = obj.get("spec") or {}
    errors: list[str] = []
    env = ((spec.get("trainer") or {}).get("env")) or []
    reserved = sorted({e.get("name") for e in env if e.get("name") in RESERVED_ENV})
    if reserved:
        errors.append(
            "spec.trainer.env: Invalid value: "
            f"{reserved}: must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]"
        )
    pod_specs = _runtime_pod_specs(runtime) if runtime is not None else None
    for i, patch in enumerate(spec.get("runtimePatches") or []):
        template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for j, rjob in enumerate(template.get("replicatedJobs") or []):
            base = f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            pod_patch = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
            runtime_spec = None if pod_specs is None else pod_specs.get(rjob.get("name"))
            if pod_specs is not None and runtime_spec is None:
                errors.append(f"{base}.name: Invalid value: {rjob.get('name')!r}: must exist in the runtime")
            for key in ("containers", "initContainers"):
                known = {c.get("name") for c in (runtime_spec or {}).get(key) or []}
                for k, container in enumerate(pod_patch.get(key) or []):
                    cpath = f"{base}.template.spec.template.spec.{key}[{k}]"
                    name = container.get("name")
                    if container.get("env") and name in ENV_THROUGH_API:
                        errors.append(
                            f"{cpath}.env: Invalid value: {name!r}: env can't be set for container with the name: "
                            f"{name}; use the trainer (or initializer) API"
                        )
                    if runtime_spec is not None and name not in known:
                        errors.append(f"{cpath}.name: Invalid value: {name!r}: must exist in the runtime")
    return errors


def runtime_missing_message(obj: Mapping[str, Any]) -> str:
    """The denial for a ``runtimeRef`` whose runtime does not exist (``NewObjects``/``ValidateObjects``)."""
    ref = (obj.get("spec") or {}).get("runtimeRef") or {}
    kind = ref.get("kind") or "ClusterTrainingRuntime"
    plural = "clustertrainingruntimes" if kind == "ClusterTrainingRuntime" else "trainingruntimes"
    return f'not found {kind} specified in TrainJob: {plural}.trainer.kubeflow.org "{ref.get("name", "")}" not found'


def validate_trainjob(
    obj: Mapping[str, Any],
    old: Mapping[str, Any] | None = None,
    *,
    runtime: Mapping[str, Any] | None = None,
    runtime_exists: bool | None = None,
) -> list[str]:
    """Every error of ``obj`` (an UPDATE when ``old`` is given): the CEL rules, then the webhook's. Pass the
    referenced runtime as ``runtime`` to check the patched containers against it, or ``runtime_exists=False`` when
    it is missing. An empty list admits the object."""
    errors = cel_errors(obj, old)
    if runtime_exists is False:
        errors.append(runtime_missing_message(obj))
    errors += webhook_errors(obj, runtime)
    return errors

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
* the webhook's rules (v2.3.0 ``pkg/webhooks/trainjob_webhook.go:108-119``), in upstream's order and words: a
  ``runtimeRef`` whose group/kind is no runtime kind is ``unsupported runtime: <Kind>.<group>``; the runtime is
  then looked up (``ClusterTrainingRuntime.ValidateObjects``, ``pkg/runtime/core/clustertrainingruntime.go:99-108``;
  ``TrainingRuntime.ValidateObjects``, ``trainingruntime.go:304-314``), and one that cannot be read refuses the
  TrainJob at submit with ``spec.RuntimeRef: Invalid value: {...}: <the API error>: specified
  clusterTrainingRuntime must be created before the TrainJob is created`` (``spec.runtimeRef`` and
  ``trainingRuntime`` for the namespaced kind): a denial the client sees as 403 Forbidden, hence
  :data:`DENIED_STATUS`; with the runtime, its plugins' ``Validate``: the torch plugin (only under a runtime with
  ``mlPolicy.torch``) refuses the reserved ``PET_*`` names in ``trainer.env`` (``torch.go:56-87``), the jobset
  plugin (``pkg/runtime/framework/plugins/jobset/jobset.go:172-208``) a patched replicated job, container or init
  container the runtime lacks, ``env`` patched into ``node``, ``dataset-initializer`` or ``model-initializer``, and
  a change of ``runtimePatches`` while the TrainJob stays unsuspended (``checkRuntimePatchesImmutability``; its
  look at an active JobSet is left out). Field errors print as apimachinery's (``<path>: Invalid value: <JSON>:
  <detail>``) and aggregate as ``ToAggregate`` does (duplicates dropped). The initializer checks are left out.

The API server runs the CRD's schema and CEL rules before any validating webhook, so a TrainJob with CEL errors is
refused with those alone (upstream a 422 ``Invalid``; here the simulated webhook's 403).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

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


RUNTIME_PLURALS = {"ClusterTrainingRuntime": "clustertrainingruntimes", "TrainingRuntime": "trainingruntimes"}
TRAINER_GROUP = "trainer.kubeflow.org"


def go_json(value: Any) -> str:
    """``json.Marshal``'s compact form, as apimachinery prints a field error's structured bad value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def runtime_ref(obj: Mapping[str, Any]) -> JsonDict:
    """The ``runtimeRef`` with the CRD's defaults, its members in the Go struct's order (name, apiGroup, kind)."""
    ref = (obj.get("spec") or {}).get("runtimeRef") or {}
    return {
        "name": ref.get("name", ""),
        "apiGroup": ref.get("apiGroup") or TRAINER_GROUP,
        "kind": ref.get("kind") or "ClusterTrainingRuntime",
    }


def runtime_registry_key(obj: Mapping[str, Any]) -> str:
    """``RuntimeRefToRuntimeRegistryKey``: ``<Kind>.<group>``."""
    ref = runtime_ref(obj)
    return f"{ref['kind']}.{ref['apiGroup']}"


def runtime_path(obj: Mapping[str, Any]) -> str | None:
    """The API path the webhook reads the referenced runtime from; ``None`` for a kind that is no runtime."""
    ref = runtime_ref(obj)
    plural = RUNTIME_PLURALS.get(ref["kind"])
    if plural is None or ref["apiGroup"] != TRAINER_GROUP:
        return None
    if plural == "trainingruntimes":
        namespace = (obj.get("metadata") or {}).get("namespace", "")
        return f"/apis/{TRAINER_GROUP}/v1alpha1/namespaces/{namespace}/{plural}/{ref['name']}"
    return f"/apis/{TRAINER_GROUP}/v1alpha1/{plural}/{ref['name']}"


def runtime_not_found_error(obj: Mapping[str, Any]) -> str:
    """What controller-runtime's ``client.Get`` error says for a runtime that does not exist (the API's 404)."""
    ref = runtime_ref(obj)
    return f'{RUNTIME_PLURALS.get(ref["kind"], "")}.{TRAINER_GROUP} "{ref["name"]}" not found'


def runtime_missing_message(obj: Mapping[str, Any], error: str | None = None) -> str:
    """The denial of a TrainJob whose runtime cannot be read (``ValidateObjects``); ``error`` is the lookup's
    (default: not found)."""
    ref = runtime_ref(obj)
    cluster = ref["kind"] == "ClusterTrainingRuntime"
    path = "spec.RuntimeRef" if cluster else "spec.runtimeRef"  # sic: upstream's cluster variant
    what = "clusterTrainingRuntime" if cluster else "trainingRuntime"
    detail = f"{error or runtime_not_found_error(obj)}: specified {what} must be created before the TrainJob is created"
    return f"{path}: Invalid value: {go_json(ref)}: {detail}"


def _runtime_containers(runtime: Mapping[str, Any]) -> dict[str, set[str]]:
    """Replicated job name -> the names of its containers and init containers."""
    rjobs = (((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    out: dict[str, set[str]] = {}
    for rjob in rjobs:
        pod_spec = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        names = {c.get("name") for key in ("initContainers", "containers") for c in pod_spec.get(key) or []}
        out[rjob.get("name")] = {n for n in names if isinstance(n, str)}
    return out


def webhook_errors(
    obj: Mapping[str, Any], runtime: Mapping[str, Any], old: Mapping[str, Any] | None = None
) -> list[str]:
    """The runtime's plugins' ``Validate`` (module docstring) on a TrainJob whose runtime was found."""
    spec = obj.get("spec") or {}
    errors: list[str] = []
    if "torch" in ((runtime.get("spec") or {}).get("mlPolicy") or {}):
        env = ((spec.get("trainer") or {}).get("env")) or []
        reserved = sorted({e.get("name") for e in env if e.get("name") in RESERVED_ENV})
        if reserved:
            errors.append(
                f"spec.trainer.env: Invalid value: {go_json(env)}: must not have reserved envs, invalid envs "
                f"configured: [{' '.join(reserved)}]"
            )
    patches = spec.get("runtimePatches") or []
    if old is not None:
        old_spec = old.get("spec") or {}
        if (old_spec.get("runtimePatches") or []) != patches and not (old_spec.get("suspend") or spec.get("suspend")):
            errors.append(
                "spec.runtimePatches: Forbidden: RuntimePatches can only be modified when the TrainJob is suspended "
                "before or after the update"
            )
    containers = _runtime_containers(runtime)

    def invalid(detail: str) -> None:
        errors.append(f"spec.runtimePatches: Invalid value: {go_json(patches)}: {detail}")

    for patch in patches:
        template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in template.get("replicatedJobs") or []:
            known = containers.get(rjob.get("name"))
            if known is None:
                invalid("must not have replicated job that doesn't exist in the runtime job template")
                continue
            pod_patch = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
            for container in pod_patch.get("initContainers") or []:
                if container.get("name") not in known:
                    invalid(f"must not have initContainer that doesn't exist in the runtime job {rjob.get('name')}")
            for container in pod_patch.get("containers") or []:
                if container.get("name") not in known:
                    invalid(f"must not have container that doesn't exist in the runtime job {rjob.get('name')}")
                elif container.get("env") and container.get("name") in ENV_THROUGH_API:
                    invalid(
                        f"must not have envs for the {', '.join(ENV_THROUGH_API[1:] + ENV_THROUGH_API[:1])} containers"
                    )
    return errors


#: What :func:`validate_trainjob`'s ``runtime`` says when the webhook did not look the runtime up (no API access).
NOT_LOOKED_UP: Final[Mapping[str, Any]] = {}


def validate_trainjob(
    obj: Mapping[str, Any],
    old: Mapping[str, Any] | None = None,
    *,
    runtime: Mapping[str, Any] | None = NOT_LOOKED_UP,
    runtime_error: str | None = None,
) -> list[str]:
    """Every error of ``obj`` (an UPDATE when ``old`` is given), deduplicated as ``ToAggregate`` does: the CRD's CEL
    rules and, only where they pass, the webhook's. ``runtime`` is the referenced runtime as the webhook read it,
    ``None`` where the read failed (``runtime_error``: the API's message; default not found), or
    :data:`NOT_LOOKED_UP` (the default) to check the CEL rules and the runtime kind only. An empty list admits."""
    errors = cel_errors(obj, old)
    if errors:
        return list(dict.fromkeys(errors))
    if runtime_path(obj) is None:
        return [f"unsupported runtime: {runtime_registry_key(obj)}"]
    if runtime is NOT_LOOKED_UP:
        return []
    if runtime is None:
        return [runtime_missing_message(obj, runtime_error)]
    return list(dict.fromkeys(webhook_errors(obj, runtime, old)))

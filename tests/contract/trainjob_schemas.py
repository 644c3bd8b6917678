"""The contracts a rendered TrainJob must meet, as executable checks (the TrainJob counterpart of ``schemas.py``).

* ``validate_trainjob`` / ``validate_jobset`` / ``validate_training_runtime``: the description-free derivatives of
  kubeflow/trainer v2.3.0's TrainJob and ClusterTrainingRuntime CRDs and kubernetes-sigs/jobset v0.12.0's JobSet
  CRD (``tests/crds/``, made by ``scripts/derive_crd.py``), strict as ``fieldValidation=Strict`` is, plus the API
  server's list-map rule (``x-kubernetes-list-type: map``: one item per key).
* ``check_trainjob_rules``: what the API server and the Trainer's webhook enforce beyond the schema, each rule named
  after the upstream file it mirrors (``../shared/notes/trainer-v2.md``):
  - the TrainJob CRD's CEL rules (``pkg/apis/trainer/v1alpha1/trainjob_types.go``): an RFC 1035 name of at most 63
    characters, ``managedBy`` one of two controllers, and on update the immutable fields (the whole ``trainer``
    block, ``runtimeRef``, ``activeDeadlineSeconds``, ``managedBy``, a patch's manager and its pod fields);
  - the torch plugin's ``Validate`` (``pkg/runtime/framework/plugins/torch/torch.go``): no reserved ``PET_*`` name
    in ``trainer.env`` (``constants.TorchRunReservedEnvNames``);
  - the JobSet plugin's ``Validate`` (``pkg/runtime/framework/plugins/jobset/jobset.go``): a domain-prefixed patch
    manager, patched replicated jobs and containers that exist in the runtime, no env for the ``node`` (and
    initializer) containers;
  - JobSet's webhook (jobset ``pkg/webhooks/jobset_webhook.go`` ``ValidateCreate``): the Job and pod names JobSet
    generates (``<js>-<rjob>-<job index>[-<pod index>-abcde]``) are DNS-1035 labels.
* ``jobset_for``: the JobSet the Trainer builds from a TrainJob and its runtime, reduced to what the contracts look
  at (the trainer block and the patch laid over the runtime's pod, the ``PET_*`` env the torch plugin injects), so
  that the pod the provider asks for is checked against the Pod schema and the runner's settings are read from it.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.contract.schemas import REPO_ROOT, crd_to_jsonschema

CRDS = REPO_ROOT / "tests" / "crds"
TRAINJOB_CRD = CRDS / "trainer.kubeflow.org_trainjobs.derived.yaml"
RUNTIME_CRD = CRDS / "trainer.kubeflow.org_clustertrainingruntimes.derived.yaml"
JOBSET_CRD = CRDS / "jobset.x-k8s.io_jobsets.derived.yaml"
TORCH_DISTRIBUTED = CRDS / "torch-distributed.runtime.derived.yaml"

RESERVED_ENV = frozenset({"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"})
#: kubeflow/trainer ``constants``: containers whose env comes through the Trainer and Initializer APIs only.
ENV_THROUGH_API = frozenset({"node", "dataset-initializer", "model-initializer"})
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
#: The torch plugin's master port (``constants.ContainerTrainerPort``).
MASTER_PORT = 29500

_RFC_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PATH = re.compile(r"^[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")
_PATCH_POD = ("trainingRuntimeSpec", "template", "spec", "replicatedJobs")

#: Every CEL rule of the derived TrainJob CRD outside ``status``, by the path it sits at: the rules
#: ``check_trainjob_rules`` mirrors (``test_every_cel_rule_of_the_crd_is_mirrored`` keeps this list complete).
MIRRORED_CEL_RULES = frozenset(
    {
        ("", "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"),
        ("", "size(self.metadata.name) <= 63"),
        ("spec.managedBy", "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']"),
        ("spec.initializer.dataset.storageUri", "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')"),
        ("spec.initializer.model.storageUri", "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')"),
        *(
            (path, "self == oldSelf")
            for path in (
                "spec.activeDeadlineSeconds",
                "spec.initializer",
                "spec.managedBy",
                "spec.runtimeRef",
                "spec.trainer",
                "spec.runtimePatches[].manager",
                *(
                    f"spec.runtimePatches[].trainingRuntimeSpec.template.spec.replicatedJobs[].template.spec.template"
                    f".spec.{field}"
                    for field in (
                        "containers",
                        "imagePullSecrets",
                        "initContainers",
                        "securityContext",
                        "serviceAccountName",
                        "terminationGracePeriodSeconds",
                        "volumes",
                    )
                ),
            )
        ),
    }
)
_IMMUTABLE_POD_FIELDS = tuple(path.rsplit(".", 1)[1] for path, _ in MIRRORED_CEL_RULES if ".template.spec." in path)


class TrainerRejection(ValueError):
    """What the API server or the Trainer's (or JobSet's) webhook would answer."""


@functools.cache
def load(path: Path) -> dict[str, Any]:
    # libyaml where present: the CRDs are hundreds of KB. Cached: callers copy what they change.
    loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc: dict[str, Any] = yaml.load(path.read_bytes(), Loader=loader)
    return doc


def crd_schema(crd: Mapping[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """The JSON schema of a CRD's only served version (any group), as ``schemas.crd_jsonschema`` makes it."""
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served", True)]
    schema: dict[str, Any] = crd_to_jsonschema(copy.deepcopy(version["schema"]["openAPIV3Schema"]), strict=strict)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is the API server's own
    jsonschema.Draft4Validator.check_schema(schema)
    return schema


@functools.cache
def _validator(path: Path) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(crd_schema(load(path)))


def _raw_schema(path: Path) -> dict[str, Any]:
    (version,) = load(path)["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def check_list_maps(schema: Mapping[str, Any], obj: Any, where: str = "") -> None:
    """The API server's rule for ``x-kubernetes-list-type: map`` (and ``set``): no two items with the same key."""
    if isinstance(obj, list):
        kind, keys = schema.get("x-kubernetes-list-type"), schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(key) for key in keys) if kind == "map" else item for item in obj]
        if kind in ("map", "set") and len(seen) != len({repr(key) for key in seen}):
            raise TrainerRejection(f"{where}: duplicate entries for the list-map key {keys or 'value'}: {seen}")
        for index, item in enumerate(obj):
            check_list_maps(schema.get("items", {}), item, f"{where}[{index}]")
    elif isinstance(obj, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else {})
            check_list_maps(sub, value, f"{where}.{key}")


def _validate(path: Path, obj: Mapping[str, Any]) -> None:
    _validator(path).validate(obj)
    check_list_maps(_raw_schema(path), obj)


def validate_trainjob(job: Mapping[str, Any]) -> None:
    _validate(TRAINJOB_CRD, job)


def validate_jobset(jobset: Mapping[str, Any]) -> None:
    _validate(JOBSET_CRD, jobset)


def validate_training_runtime(runtime: Mapping[str, Any]) -> None:
    _validate(RUNTIME_CRD, runtime)


def is_domain_prefixed_path(value: str) -> bool:
    """k8s.io/apimachinery ``validation.IsDomainPrefixedPath``: ``<DNS-1123 subdomain>/<path>``."""
    host, sep, path = value.partition("/")
    return bool(sep and path and _DNS_1123_SUBDOMAIN.match(host) and len(host) <= 253 and _PATH.match(path))


def _patched_jobs(job: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """(manager, replicated job, its patch's pod spec) for every patched replicated job."""
    for patch in job.get("spec", {}).get("runtimePatches") or []:
        node: Any = patch
        for key in _PATCH_POD:
            node = (node or {}).get(key)
        for rjob in node or []:
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            yield patch.get("manager"), rjob.get("name"), pod


def _runtime_containers(runtime: Mapping[str, Any]) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]["spec"]
        names[rjob["name"]] = {c["name"] for c in pod.get("initContainers", []) + pod.get("containers", [])}
    return names


def check_trainjob_rules(
    job: Mapping[str, Any], runtime: Mapping[str, Any], *, old: Mapping[str, Any] | None = None
) -> None:
    """Raise ``TrainerRejection`` where the API server or a webhook refuses ``job`` (an update of ``old``)."""
    name = job.get("metadata", {}).get("name", "")
    if not _RFC_1035.match(name) or len(name) > 63:
        raise TrainerRejection(f"metadata.name: {name!r} must be an RFC 1035 label of at most 63 characters")
    spec = job.get("spec", {})
    if "managedBy" in spec and spec["managedBy"] not in MANAGED_BY:
        raise TrainerRejection(f"spec.managedBy: must be one of {MANAGED_BY}, got {spec['managedBy']!r}")
    for part in ("dataset", "model"):
        uri = (spec.get("initializer") or {}).get(part, {}).get("storageUri", "")
        if uri and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$", uri):
            raise TrainerRejection(f"spec.initializer.{part}.storageUri: not a URI: {uri!r}")
    trainer = spec.get("trainer") or {}
    reserved = sorted({item.get("name") for item in trainer.get("env") or []} & RESERVED_ENV)
    if reserved:
        raise TrainerRejection(f"spec.trainer.env: {reserved} are reserved for the torch runtime (torch.go)")
    containers = _runtime_containers(runtime)
    for manager, rjob, pod in _patched_jobs(job):
        if not is_domain_prefixed_path(manager or ""):
            raise TrainerRejection(f"spec.runtimePatches[].manager: {manager!r} is not a domain-prefixed path")
        if rjob not in containers:
            raise TrainerRejection(f"spec.runtimePatches[{manager!r}]: replicated job {rjob!r} not in the runtime")
        for key in ("initContainers", "containers"):
            for container in pod.get(key) or []:
                if container.get("name") not in containers[rjob]:
                    raise TrainerRejection(
                        f"spec.runtimePatches[{manager!r}]: {key} {container.get('name')!r} not in runtime job {rjob!r}"
                    )
                if container.get("env") and container.get("name") in ENV_THROUGH_API:
                    raise TrainerRejection(
                        f"spec.runtimePatches[{manager!r}]: no env for the {container['name']!r} container (jobset.go)"
                    )
    _check_generated_names(job, runtime)
    if old is not None:
        _check_immutable(old, job)


def _check_generated_names(job: Mapping[str, Any], runtime: Mapping[str, Any]) -> None:
    name, nodes = job["metadata"]["name"], job.get("spec", {}).get("trainer", {}).get("numNodes")
    trainer_job = _trainer_job(runtime)
    for rjob in _runtime_containers(runtime):
        completions = nodes if rjob == trainer_job and isinstance(nodes, int) else 1
        for generated in (f"{name}-{rjob}-0", f"{name}-{rjob}-0-{completions - 1}-abcde"):
            if not _RFC_1035.match(generated) or len(generated) > 63:
                raise TrainerRejection(f"JobSet name is too long: generated name {generated!r} exceeds 63 characters")


def _check_immutable(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """``self == oldSelf``: the Kubernetes CEL transition rules, applied where the old object has the field."""
    old_spec, new_spec = old.get("spec", {}), new.get("spec", {})
    for key in ("trainer", "runtimeRef", "activeDeadlineSeconds", "managedBy", "initializer"):
        if key in old_spec and old_spec.get(key) != new_spec.get(key):
            raise TrainerRejection(f"spec.{key}: field is immutable")
    old_pods = {(manager, rjob): pod for manager, rjob, pod in _patched_jobs(old)}
    for manager, rjob, pod in _patched_jobs(new):
        before = old_pods.get((manager, rjob)) or {}
        for field in _IMMUTABLE_POD_FIELDS:
            if field in before and before.get(field) != pod.get(field):
                raise TrainerRejection(f"spec.runtimePatches[{manager!r}] {rjob} {field}: field is immutable")


def _trainer_job(runtime: Mapping[str, Any]) -> str:
    name: str
    (name,) = [
        rjob["name"]
        for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]
        if rjob["template"].get("metadata", {}).get("labels", {}).get("trainer.kubeflow.org/trainjob-ancestor-step")
        == "trainer"
    ]
    return name


def _merge_named(items: list[dict[str, Any]], extra: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    merged = {item[key]: item for item in items}
    merged.update({item[key]: copy.deepcopy(item) for item in extra})
    return list(merged.values())


def jobset_for(job: Mapping[str, Any], runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The JobSet the Trainer makes of ``job`` on ``runtime``, as far as the contracts need it: the runtime's
    replicated jobs, the trainer block on the ``node`` container of the trainer job with the ``PET_*`` env the
    torch plugin adds, and the provider's patch laid over the pods (upsert by name, as the Trainer's ``apply``)."""
    name, spec = job["metadata"]["name"], job["spec"]
    trainer, trainer_job = spec.get("trainer", {}), _trainer_job(runtime)
    jobset_spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    patches = {(m, rjob): pod for m, rjob, pod in _patched_jobs(job)}
    for rjob in jobset_spec["replicatedJobs"]:
        template = rjob["template"]
        pod_template = template["spec"]["template"]
        pod = pod_template["spec"]
        if rjob["name"] == trainer_job:
            nodes = trainer.get("numNodes", runtime["spec"].get("mlPolicy", {}).get("numNodes", 1))
            template["spec"].update(parallelism=nodes, completions=nodes)
            node = next(c for c in pod["containers"] if c["name"] == "node")
            for key, field in (("image", "image"), ("command", "command"), ("args", "args")):
                if key in trainer:
                    node[field] = trainer[key]
            if "resourcesPerNode" in trainer:
                node["resources"] = trainer["resourcesPerNode"]
            nproc = str(trainer.get("numProcPerNode", "auto"))
            injected: list[dict[str, Any]] = [
                {"name": "PET_NNODES", "value": str(nodes)},
                {"name": "PET_NPROC_PER_NODE", "value": nproc},
                {
                    "name": "PET_NODE_RANK",
                    "valueFrom": {
                        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                    },
                },
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{trainer_job}-0-0.{name}"},
                {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
            ]
            node["env"] = _merge_named(node.get("env", []), [*trainer.get("env", []), *injected], "name")
            node["ports"] = _merge_named(node.get("ports", []), [{"containerPort": MASTER_PORT}], "containerPort")
        for (_, patched_job), patch in patches.items():
            if patched_job != rjob["name"]:
                continue
            for key, value in patch.items():
                if key == "containers":
                    for container_patch in value:
                        container = next(c for c in pod["containers"] if c["name"] == container_patch["name"])
                        for field in ("env", "volumeMounts"):
                            if field in container_patch:
                                merged = _merge_named(container.get(field, []), container_patch[field], "name")
                                container[field] = merged
                        if "securityContext" in container_patch:
                            container["securityContext"] = container_patch["securityContext"]
                elif key == "volumes":
                    pod["volumes"] = _merge_named(pod.get("volumes", []), value, "name")
                else:
                    pod[key] = copy.deepcopy(value)
        for manager, patched_job in patches:
            metadata = _patch_metadata(job, manager, patched_job) if patched_job == rjob["name"] else {}
            for key in ("labels", "annotations"):
                if metadata.get(key):
                    pod_template.setdefault("metadata", {}).setdefault(key, {}).update(metadata[key])
    if spec.get("suspend"):
        jobset_spec["suspend"] = True
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name}, "spec": jobset_spec}


def _patch_metadata(job: Mapping[str, Any], manager: str, rjob_name: str) -> dict[str, Any]:
    for patch in job["spec"].get("runtimePatches") or []:
        if patch.get("manager") != manager:
            continue
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            if rjob["name"] == rjob_name:
                metadata: dict[str, Any] = rjob["template"]["spec"]["template"].get("metadata", {})
                return metadata
    return {}


def trainer_pod_template(jobset: Mapping[str, Any], trainer_job: str = "node") -> dict[str, Any]:
    rjob = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == trainer_job)
    template: dict[str, Any] = rjob["template"]["spec"]["template"]
    return template


def pod_env(template: Mapping[str, Any], *, index: int) -> dict[str, str]:
    """The ``node`` container's env as the kubelet resolves it on node ``index`` (the completion index annotation
    is the only field reference the torch plugin uses)."""
    node = next(c for c in template["spec"]["containers"] if c["name"] == "node")
    env: dict[str, str] = {}
    for item in node.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "job-completion-index" in str(item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")):
            env[item["name"]] = str(index)
    return env

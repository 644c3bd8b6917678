"""A simulated Kubeflow Trainer v2.3.0 controller, JobSet v0.12.0 controller and Indexed Job controller.

Run it as ``python -m tests.cluster.sim_trainer --kubeconfig PATH``. Like ``tests.cluster.sim_operator`` it is an
ordinary API client (list + watch, create, delete, merge-patch of ``/status``), so it runs unchanged against any API
server. Install the CRDs and the default runtime first (:func:`install`), or let the test cluster do it.

It goes TrainJob -> JobSet -> Jobs -> Pods as upstream does (facts: ``../shared/notes/trainer-v2.md``; names of the
upstream files and functions are in the comments where a behaviour is mirrored):

* **Trainer** (kubeflow/trainer v2.3.0, ``pkg/controller/trainjob_controller.go`` ``Reconcile``): skips TrainJobs
  whose ``spec.managedBy`` names another controller; a ``runtimeRef`` whose group/kind is not a runtime kind gives
  ``Failed`` reason ``TrainingRuntimeNotSupported`` (message ``unsupported runtime: <Kind>.<group>``). A runtime
  object that does not exist is **not** a condition upstream: ``NewObjects`` fails (``not found
  ClusterTrainingRuntime specified in TrainJob``), the controller records a Warning ``TrainJobResourcesCreationFailed``
  event and retries with backoff (the Trainer's validating webhook refuses such a TrainJob at create; here that is
  the simulated webhook's job). Otherwise it builds the JobSet (``pkg/runtime/core/trainingruntime.go``
  ``buildObjects``; ``pkg/runtime/framework/plugins/jobset/builder.go``): named as the TrainJob, same namespace,
  controller ownerReference to it; the runtime's JobSet template with the TrainJob's ``trainer`` block on the
  ``node`` container (image, command, args, env merged by name, ``resourcesPerNode``), ``numNodes`` as the ``node``
  Job's parallelism and completions (#3651), and the ``runtimePatches`` applied in order. The torch plugin
  (``pkg/runtime/framework/plugins/torch/torch.go`` ``EnforceMLPolicy``) adds ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (fieldRef to the completion-index annotation), ``PET_MASTER_ADDR`` (``<tj>-node-0-0.<tj>``) and
  ``PET_MASTER_PORT`` (29500) to container ``node``, and container port 29500. Status (``setSuspendedCondition``,
  ``setTrainJobStatus``, the jobset plugin's ``TrainJobStatus``): ``Suspended`` (reasons ``Suspended``/``Resumed``),
  ``Complete``/``Failed`` copied from the JobSet's ``Completed``/``Failed`` (reason and message kept), ``jobsStatus``
  from ``replicatedJobsStatus``; ``activeDeadlineSeconds`` (``reconcileDeadline``) counts from the creation, or from
  the last resume, and on expiry sets ``Failed`` reason ``DeadlineExceeded`` and deletes the JobSet. A suspended
  TrainJob suspends its JobSet; while either is suspended the JobSet is built again and applied (``Build``), so
  runtime patches changed while suspended (Kueue's) reach the JobSet's template.
* **JobSet** (kubernetes-sigs/jobset v0.12.0, ``pkg/controllers/jobset_controller.go``): the webhook's defaults
  (``pkg/webhooks/jobset_webhook.go`` ``Default``: successPolicy ``All``, completionMode ``Indexed``, pod
  restartPolicy ``OnFailure``, ``network.enableDNSHostnames``/``publishNotReadyAddresses`` true, replicas 1, group
  ``default``) are written into the JobSet when it is created, since the simulated Trainer is the only creator here.
  Jobs ``<js>-<replicatedJob>-<jobIndex>`` (``constructJob``, ``placement.GenJobName``) owned by the JobSet, with the
  JobSet labels and the same annotations (``labelAndAnnotateObject``) on the Job and its pod template, pod
  ``subdomain`` = the JobSet's (``GetSubdomain``); the headless Service named as the subdomain, selecting
  ``jobset-name``, ``publishNotReadyAddresses`` (``createHeadlessSvcIfNecessary``). Conditions ``Completed``
  (``AllJobsCompleted``, ``jobset completed successfully``), ``Failed`` (``FailedJobs``, ``jobset failed due to one
  or more job failures (first failed job: <job>)``; ``ReachedMaxRestarts`` once ``failurePolicy.maxRestarts`` is
  spent), ``Suspended`` (``SuspendedJobs``/``ResumeJobs``); ``terminalState``; ``replicatedJobsStatus``;
  ``restarts``. With ``failurePolicy.maxRestarts`` > 0 a failed Job makes it delete all its Jobs and recreate them
  with the next ``jobset.sigs.k8s.io/restart-attempt``. When finished it deletes its still-active Jobs. Resuming
  a Job (``resumeJob``) merges the JobSet's pod template labels, annotations, nodeSelector, tolerations and
  schedulingGates into the Job's (kept in ``sim.torchelastic.dev/pod-template``: 1.20 keeps a Job's template
  immutable) before its pods are made.
* **Indexed Job controller** (kubernetes ``pkg/controller/job/job_controller.go``, ``indexed_job_utils.go``): a
  1.20 API server has no Indexed Jobs (no ``completionMode``, ``suspend``, ``completedIndexes`` or ``ready``: it
  drops them silently) and the test cluster's controller-manager, where there is one, runs without its job
  controller. So the sim keeps what the server drops in annotations of its own on the Job
  (``sim.torchelastic.dev/completion-mode``, ``sim.torchelastic.dev/suspend``; ``spec.suspend`` wins where the
  server keeps it) and runs every Job a JobSet owns as Indexed: pods ``<job>-<index>-<random5>`` (generateName),
  annotation and label ``batch.kubernetes.io/job-completion-index``, env ``JOB_COMPLETION_INDEX``, hostname
  ``<job>-<index>``, labels ``job-name``/``controller-uid`` and their ``batch.kubernetes.io/`` forms, controller
  ownerReference to the Job; at most ``parallelism`` active pods; conditions ``Complete`` and ``Failed``
  (``BackoffLimitExceeded`` ``Job has reached the specified backoff limit``: failed pods > backoffLimit, or under
  OnFailure the restartCounts of active pods >= backoffLimit, ``pastBackoffLimitOnFailure``; ``DeadlineExceeded``
  ``Job was active longer than specified deadline`` for ``activeDeadlineSeconds``) written as a current (1.31+)
  controller does: ``FailureTarget``/``SuccessCriteriaMet`` first, the active pods deleted, and ``Failed``/
  ``Complete`` only once none of its pods is terminating (``enactJobFinished``), ``Suspended``
  (``JobSuspended``/``JobResumed``); suspended or finished, its active pods are deleted. A failed pod's index gets a
  new pod at once (no pod-failure backoff).

The ``torch-distributed`` runtime has no restartPolicy and no backoffLimit, so its pods run ``OnFailure`` (the JobSet
webhook's default) and its Job has the API server's default ``backoffLimit`` 6: a failing node restarts in place,
with the kubelet's crash-loop backoff, until six restarts fail the Job.

Garbage collection: the test cluster has no garbage collector. When a TrainJob, JobSet or Job is deleted, this process
deletes what its ownerReferences name (JobSets, Jobs, Services, Pods, in the same namespace; background propagation),
honours ``Foreground`` (dependents first, then the ``foregroundDeletion`` finalizer goes) and ``Orphan`` (the
ownerReferences go, then the ``orphan`` finalizer; batch/v1 Jobs deleted without a policy get that one), and every
30 s sweeps dependents whose owner no longer exists.

What it leaves out: the Trainer's initializers, MPI/other plugins, Kueue/PodGroup, ``trainerStatus``, the JobSet's
dependsOn/startupPolicy ordering, exclusive placement, coordinator, TTL and volumeClaimPolicies, Job pod-failure
policies, ``backoffLimitPerIndex`` and pod-failure backoff; Job finalizers (``batch.kubernetes.io/job-tracking``)
are not put on pods. Reconciles that fail are retried with controller-runtime's per-item exponential backoff.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.sim_operator import Informer, WorkQueue, api_error_message, from_rfc3339, to_rfc3339

log = logging.getLogger("sim-trainer")

TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINER_API_VERSION = f"{TRAINER_GROUP}/{TRAINER_VERSION}"
TRAINJOB_KIND, TRAINJOBS = "TrainJob", "trainjobs"
CLUSTER_RUNTIME_KIND, CLUSTER_RUNTIMES = "ClusterTrainingRuntime", "clustertrainingruntimes"
RUNTIME_KIND, RUNTIMES = "TrainingRuntime", "trainingruntimes"
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
JOBSET_KIND, JOBSETS = "JobSet", "jobsets"

TRAINER_CONTROLLER = "trainer.kubeflow.org/trainjob-controller"
JOBSET_CONTROLLER = "jobset.sigs.k8s.io/jobset-controller"
COMPONENT_TRAINER = "trainjob-controller"
COMPONENT_JOBSET = "jobset"
COMPONENT_JOB = "job-controller"

# The torch plugin (pkg/runtime/framework/plugins/torch/torch.go; pkg/constants/constants.go).
NODE = "node"  # the trainer replicated job and its container (constants.Node)
TORCH_PORT = 29500  # constants.ContainerTrainerPort
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")

# JobSet labels and annotations (api/jobset/v1alpha2/jobset_types.go).
L_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
L_JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
L_RJOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
L_RJOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
L_GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
L_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
L_JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
L_JOB_KEY = "jobset.sigs.k8s.io/job-key"
L_GROUP_NAME = "jobset.sigs.k8s.io/group-name"
L_GROUP_REPLICAS = "jobset.sigs.k8s.io/group-replicas"
L_JOB_GROUP_INDEX = "jobset.sigs.k8s.io/job-group-index"
L_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"

# Kubernetes Job labels and annotations.
L_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
L_JOB_NAME_LEGACY, L_CONTROLLER_UID_LEGACY = "job-name", "controller-uid"
L_JOB_NAME, L_CONTROLLER_UID = "batch.kubernetes.io/job-name", "batch.kubernetes.io/controller-uid"
# What a 1.20 API server drops from batch/v1 Jobs, kept by the sim on the Job instead.
ANN_COMPLETION_MODE = "sim.torchelastic.dev/completion-mode"
ANN_SUSPEND = "sim.torchelastic.dev/suspend"
#: The pod template fields JobSet merges into a Job when it resumes it (:func:`resume_job_template`), as JSON: a
#: 1.20 API server keeps a Job's ``spec.template`` immutable (1.23+ allow these fields of a suspended Job's).
ANN_POD_TEMPLATE = "sim.torchelastic.dev/pod-template"
DEFAULT_BACKOFF_LIMIT = 6  # the API server's default for batch/v1 Jobs

SWEEP_SECONDS = 30.0
PATCH_MERGE = "application/merge-patch+json"
CRDS_DIR = Path(__file__).resolve().parents[1] / "crds"
#: What :func:`install` creates, in order: the derived CRDs and the derived torch-distributed runtime.
CRD_FILES = (
    "trainer.kubeflow.org_trainjobs.derived.yaml",
    "trainer.kubeflow.org_clustertrainingruntimes.derived.yaml",
    "trainer.kubeflow.org_trainingruntimes.derived.yaml",  # only if present
    "jobset.x-k8s.io_jobsets.derived.yaml",
)
RUNTIME_FILE = "torch-distributed.runtime.derived.yaml"

JsonDict = dict[str, Any]

# ----------------------------------------------------------------------------------------------------------------
# Conditions (metav1.Condition; meta.SetStatusCondition)
# ----------------------------------------------------------------------------------------------------------------


def find_condition(status: JsonDict, ctype: str) -> JsonDict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == ctype), None)


def is_true(status: JsonDict, ctype: str) -> bool:
    cond = find_condition(status, ctype)
    return cond is not None and cond.get("status") == "True"


def set_condition(status: JsonDict, ctype: str, cstatus: str, reason: str, message: str, now: str) -> None:
    """``meta.SetStatusCondition``: lastTransitionTime changes only when the status does."""
    conditions = list(status.get("conditions") or [])
    for i, c in enumerate(conditions):
        if c.get("type") == ctype:
            new = {**c, "status": cstatus, "reason": reason, "message": message}
            if c.get("status") != cstatus:
                new["lastTransitionTime"] = now
            conditions[i] = new
            break
    else:
        conditions.append(
            {"type": ctype, "status": cstatus, "reason": reason, "message": message, "lastTransitionTime": now}
        )
    status["conditions"] = conditions


def set_job_condition(status: JsonDict, ctype: str, cstatus: str, reason: str, message: str, now: str) -> None:
    """Job conditions (batch/v1 JobCondition) also carry lastProbeTime."""
    set_condition(status, ctype, cstatus, reason, message, now)
    for c in status["conditions"]:
        if c["type"] == ctype:
            c["lastProbeTime"] = now


# ----------------------------------------------------------------------------------------------------------------
# Names and ownership (pure)
# ----------------------------------------------------------------------------------------------------------------


def job_name(jobset_name: str, rjob_name: str, index: int) -> str:
    """``placement.GenJobName``: ``<jobset>-<replicatedJob>-<jobIndex>``."""
    return f"{jobset_name}-{rjob_name}-{index}"


def pod_hostname(job: str, index: int) -> str:
    """The Indexed Job controller's hostname ``<job>-<index>``, cut to 63 characters without a trailing ``-``/``.``."""
    return f"{job}-{index}"[:63].rstrip("-.")


def master_addr(trainjob_name: str) -> str:
    """``PET_MASTER_ADDR``: node 0's hostname in the JobSet's subdomain (torch.go)."""
    return f"{pod_hostname(job_name(trainjob_name, NODE, 0), 0)}.{trainjob_name}"


def job_key(namespace: str, name: str) -> str:
    """``jobset.sigs.k8s.io/job-key``: the SHA-1 of ``<namespace>/<job>`` in hex (``jobHashKey``). The API's comment
    says SHA256, but 64 hex characters are no valid label value (at most 63): the API server refuses such a Job."""
    return hashlib.sha1(f"{namespace}/{name}".encode()).hexdigest()


def owner_reference(obj: JsonDict) -> JsonDict:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controller_of(obj: JsonDict) -> JsonDict | None:
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def controlled_by(obj: JsonDict, uid: str) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == uid


# ----------------------------------------------------------------------------------------------------------------
# TrainJob -> JobSet (pure)
# ----------------------------------------------------------------------------------------------------------------


def runtime_registry_key(runtime_ref: JsonDict) -> str:
    """``RuntimeRefToRuntimeRegistryKey``: ``schema.GroupKind{Group, Kind}.String()`` with the CRD's defaults."""
    group = runtime_ref.get("apiGroup") or TRAINER_GROUP
    kind = runtime_ref.get("kind") or CLUSTER_RUNTIME_KIND
    return f"{kind}.{group}"


SUPPORTED_RUNTIMES = {f"{CLUSTER_RUNTIME_KIND}.{TRAINER_GROUP}", f"{RUNTIME_KIND}.{TRAINER_GROUP}"}


def merge_by_key(base: list[JsonDict], overlay: Iterable[JsonDict], key: str) -> list[JsonDict]:
    """A list-map merge: an overlay item replaces the base item with the same key, others are appended."""
    out = [copy.deepcopy(x) for x in base]
    for item in overlay:
        for i, existing in enumerate(out):
            if existing.get(key) == item.get(key):
                out[i] = copy.deepcopy(item)
                break
        else:
            out.append(copy.deepcopy(item))
    return out


def merge_env(base: list[JsonDict], overlay: Iterable[JsonDict]) -> list[JsonDict]:
    """Env merged by name (listMap ``name``): an overlay variable replaces the one of the same name."""
    return merge_by_key(base, overlay, "name")


def _containers(pod_spec: JsonDict) -> list[JsonDict]:
    return list(pod_spec.get("containers") or [])


def gpu_count(resources: JsonDict) -> int:
    """``runtime.GetNumGPUPerNode`` (kubeflow/trainer v2.3.0 ``pkg/runtime/runtime.go:280-298``): the first resource
    whose name contains ``gpu`` in the requests, else in the limits; its whole count (rounded up)."""

    def num_gpu(resource_list: JsonDict | None) -> int:
        for name, quantity in (resource_list or {}).items():
            if "gpu" in name.lower():
                return quantity_value(quantity)
        return 0

    requested = num_gpu(resources.get("requests"))
    limited = num_gpu(resources.get("limits"))
    return limited if requested == 0 and limited > 0 else requested


def cpu_per_node(resources: JsonDict) -> int:
    """``getNumCPUPerNode`` (v2.3.0 ``pkg/runtime/framework/plugins/torch/torch.go:227-240``): the CPU request, and
    only where there is none (or it is zero) the limit; 0 with neither."""
    request = (resources.get("requests") or {}).get("cpu")
    if request is None or quantity_value(request) == 0:
        limit = (resources.get("limits") or {}).get("cpu")
        return quantity_value(limit) if limit is not None else 0
    return quantity_value(request)


def nproc_per_node(trainer: JsonDict, runtime_resources: JsonDict | None = None) -> str:
    """``PET_NPROC_PER_NODE`` as v2.3.0's torch plugin sets it (``torch.go:121-135``, ``EnforceMLPolicy``):
    ``numProcPerNode`` if the TrainJob sets it, else ``auto``; the resources are the TrainJob's
    ``resourcesPerNode``, else the runtime's ``node`` container's (``ExtractResourcePerNodeFromRuntime``), else
    none; ``auto`` with no GPU among them becomes ``max(1, CPUs per node)`` (:func:`cpu_per_node`: requests before
    limits), so no resources at all give ``"1"``. An integer is never changed; ``auto`` stays only beside a GPU.
    (v2.0.0 looked at the limits first and left ``auto`` without resources: a cluster on v2.3.0 differs.)"""
    value = str(trainer["numProcPerNode"]) if trainer.get("numProcPerNode") is not None else "auto"
    resources = trainer.get("resourcesPerNode")
    if resources is None:
        resources = runtime_resources or {}
    if value == "auto" and gpu_count(resources) == 0:
        return str(max(1, cpu_per_node(resources)))
    return value


def quantity_value(quantity: Any) -> int:
    """``resource.Quantity.Value()``: whole units, rounded up (``500m`` -> 1, ``2.5`` -> 3, ``2`` -> 2)."""
    text = str(quantity)
    if text.endswith("m"):
        return -(-int(text[:-1]) // 1000)
    return -(-int(float(text) * 1000) // 1000)


def runtime_node_resources(runtime: JsonDict) -> JsonDict | None:
    """The ``resources`` of the runtime's ``node`` container in its ``node`` replicated job, if it has any
    (``ExtractResourcePerNodeFromRuntime``, v2.3.0 ``pkg/runtime/runtime.go:254-277``)."""
    rjobs = ((((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs")) or []
    for rjob in rjobs:
        if rjob.get("name") != NODE:
            continue
        pod_spec = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
        for container in _containers(pod_spec):
            if container.get("name") == NODE and container.get("resources") is not None:
                return dict(container["resources"])
    return None


def torch_env(
    trainjob_name: str, num_nodes: int, trainer: JsonDict, runtime_resources: JsonDict | None = None
) -> list[JsonDict]:
    """The env the torch plugin adds to container ``node`` (``EnforceMLPolicy``, torch.go)."""
    return [
        {"name": "PET_NNODES", "value": str(num_nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": nproc_per_node(trainer, runtime_resources)},
        {
            "name": "PET_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{L_COMPLETION_INDEX}']"}},
        },
        {"name": "PET_MASTER_ADDR", "value": master_addr(trainjob_name)},
        {"name": "PET_MASTER_PORT", "value": str(TORCH_PORT)},
    ]


def _merge_meta(target: JsonDict, patch_meta: JsonDict | None) -> None:
    for key in ("labels", "annotations"):
        values = (patch_meta or {}).get(key)
        if values:
            target.setdefault(key, {}).update(values)


def apply_container_patch(container: JsonDict, patch: JsonDict) -> None:
    """A ContainerPatch: env merged by name, volumeMounts merged by mountPath, securityContext replaced."""
    if patch.get("env"):
        container["env"] = merge_env(container.get("env") or [], patch["env"])
    if patch.get("volumeMounts"):
        container["volumeMounts"] = merge_by_key(
            container.get("volumeMounts") or [], patch["volumeMounts"], "mountPath"
        )
    if patch.get("securityContext") is not None:
        container["securityContext"] = copy.deepcopy(patch["securityContext"])


def apply_pod_spec_patch(pod_spec: JsonDict, patch: JsonDict) -> None:
    """A PodSpecPatch (the fields it allows; lists merged by their keys, tolerations and gates appended)."""
    for key in ("serviceAccountName", "securityContext", "affinity", "terminationGracePeriodSeconds"):
        if patch.get(key) is not None:
            pod_spec[key] = copy.deepcopy(patch[key])
    if patch.get("nodeSelector"):
        pod_spec.setdefault("nodeSelector", {}).update(patch["nodeSelector"])
    for key in ("volumes", "imagePullSecrets", "schedulingGates"):
        if patch.get(key):
            pod_spec[key] = merge_by_key(pod_spec.get(key) or [], patch[key], "name")
    if patch.get("tolerations"):
        pod_spec["tolerations"] = [*(pod_spec.get("tolerations") or []), *copy.deepcopy(patch["tolerations"])]
    for key in ("containers", "initContainers"):
        for cpatch in patch.get(key) or []:
            for container in pod_spec.get(key) or []:
                if container.get("name") == cpatch.get("name"):
                    apply_container_patch(container, cpatch)


def num_nodes_of(trainjob: JsonDict, runtime: JsonDict) -> int:
    trainer = (trainjob.get("spec") or {}).get("trainer") or {}
    if trainer.get("numNodes") is not None:
        return int(trainer["numNodes"])
    return int((((runtime.get("spec") or {}).get("mlPolicy") or {}).get("numNodes")) or 1)


def build_jobset(trainjob: JsonDict, runtime: JsonDict) -> JsonDict:
    """The JobSet the Trainer builds for ``trainjob`` from ``runtime`` (a (Cluster)TrainingRuntime object), before the
    JobSet webhook's defaults (:func:`jobset_defaults`)."""
    meta, spec = trainjob["metadata"], trainjob.get("spec") or {}
    name = meta["name"]
    rspec = runtime.get("spec") or {}
    template = copy.deepcopy(rspec.get("template") or {})
    js_meta: JsonDict = {"name": name, "namespace": meta["namespace"]}
    _merge_meta(js_meta, template.get("metadata"))
    if meta.get("uid"):
        js_meta["ownerReferences"] = [
            owner_reference({"apiVersion": TRAINER_API_VERSION, "kind": TRAINJOB_KIND, "metadata": meta})
        ]
    js_spec: JsonDict = copy.deepcopy(template.get("spec") or {})
    trainer = spec.get("trainer") or {}
    nodes = num_nodes_of(trainjob, runtime)
    torch = "torch" in (rspec.get("mlPolicy") or {})
    runtime_resources = runtime_node_resources(runtime)
    for rjob in js_spec.get("replicatedJobs") or []:
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        pod_spec = job_spec.setdefault("template", {}).setdefault("spec", {})
        if rjob.get("name") != NODE:
            continue
        # numNodes -> the node Job's parallelism and completions (#3651); one Job.
        job_spec["parallelism"] = job_spec["completions"] = nodes
        for container in _containers(pod_spec):
            if container.get("name") != NODE:
                continue
            for key in ("image", "command", "args"):
                if trainer.get(key) is not None:
                    container[key] = copy.deepcopy(trainer[key])
            if trainer.get("resourcesPerNode") is not None:
                container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
            if trainer.get("env"):
                container["env"] = merge_env(container.get("env") or [], trainer["env"])
            if torch:
                container["env"] = merge_env(
                    container.get("env") or [], torch_env(name, nodes, trainer, runtime_resources)
                )
                ports = container.setdefault("ports", [])
                if not any(p.get("containerPort") == TORCH_PORT for p in ports):
                    ports.append({"containerPort": TORCH_PORT, "protocol": "TCP"})
    for patch in spec.get("runtimePatches") or []:
        tr_spec = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        _merge_meta(js_meta, tr_spec.get("metadata"))
        for rpatch in (tr_spec.get("spec") or {}).get("replicatedJobs") or []:
            for rjob in js_spec.get("replicatedJobs") or []:
                if rjob.get("name") != rpatch.get("name"):
                    continue
                jt_patch = rpatch.get("template") or {}
                _merge_meta(rjob["template"].setdefault("metadata", {}), jt_patch.get("metadata"))
                pt_patch = (jt_patch.get("spec") or {}).get("template") or {}
                pod_template = rjob["template"]["spec"]["template"]
                _merge_meta(pod_template.setdefault("metadata", {}), pt_patch.get("metadata"))
                apply_pod_spec_patch(pod_template["spec"], pt_patch.get("spec") or {})
    js_spec["suspend"] = bool(spec.get("suspend"))
    return {"apiVersion": JOBSET_API_VERSION, "kind": JOBSET_KIND, "metadata": js_meta, "spec": js_spec}


def reapplied_jobset(desired: JsonDict) -> JsonDict:
    """The merge patch that plays the Trainer's server-side apply of ``desired`` (a rebuilt JobSet) on the existing
    one: its labels and annotations, ``suspend`` and the replicated jobs (a list: replaced whole)."""
    meta = {k: desired["metadata"][k] for k in ("labels", "annotations") if desired["metadata"].get(k)}
    spec = {"suspend": bool(desired["spec"].get("suspend")), "replicatedJobs": desired["spec"]["replicatedJobs"]}
    return {"metadata": meta, "spec": spec} if meta else {"spec": spec}


def jobset_defaults(jobset: JsonDict) -> JsonDict:
    """A copy with the JobSet webhook's defaults (``jobset_webhook.go`` ``Default``) and the CRD's."""
    js = copy.deepcopy(jobset)
    spec = js.setdefault("spec", {})
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    if spec.get("failurePolicy") is not None:
        spec["failurePolicy"].setdefault("restartStrategy", "Recreate")
    spec.setdefault("managedBy", JOBSET_CONTROLLER)
    for rjob in spec.get("replicatedJobs") or []:
        rjob.setdefault("replicas", 1)
        rjob.setdefault("groupName", "default")
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        job_spec.setdefault("completionMode", "Indexed")
        pod_spec = job_spec.setdefault("template", {}).setdefault("spec", {})
        if not pod_spec.get("restartPolicy"):
            pod_spec["restartPolicy"] = "OnFailure"
    return js


# ----------------------------------------------------------------------------------------------------------------
# JobSet -> Jobs, Service (pure)
# ----------------------------------------------------------------------------------------------------------------


def subdomain(jobset: JsonDict) -> str:
    """``GetSubdomain``: ``network.subdomain`` or the JobSet's name."""
    return ((jobset.get("spec") or {}).get("network") or {}).get("subdomain") or jobset["metadata"]["name"]


def dns_hostnames(jobset: JsonDict) -> bool:
    return bool(((jobset.get("spec") or {}).get("network") or {}).get("enableDNSHostnames", True))


def job_indexes(jobset: JsonDict) -> list[tuple[JsonDict, int, int, int, int]]:
    """(replicatedJob, jobIndex, globalIndex, groupIndex, groupReplicas) of every Job, in spec order."""
    rjobs = (jobset.get("spec") or {}).get("replicatedJobs") or []
    group_total: dict[str, int] = {}
    for rjob in rjobs:
        group = rjob.get("groupName") or "default"
        group_total[group] = group_total.get(group, 0) + int(rjob.get("replicas", 1))
    out, global_index, group_seen = [], 0, dict.fromkeys(group_total, 0)
    for rjob in rjobs:
        group = rjob.get("groupName") or "default"
        for i in range(int(rjob.get("replicas", 1))):
            out.append((rjob, i, global_index, group_seen[group], group_total[group]))
            global_index += 1
            group_seen[group] += 1
    return out


def jobset_job_labels(
    jobset: JsonDict, rjob: JsonDict, index: int, global_index: int, group_index: int, group_replicas: int
) -> dict[str, str]:
    """``labelAndAnnotateObject``: the labels (and the same annotations) on a Job and its pod template."""
    meta = jobset["metadata"]
    name = job_name(meta["name"], rjob["name"], index)
    total = sum(int(r.get("replicas", 1)) for r in (jobset.get("spec") or {}).get("replicatedJobs") or [])
    restarts = int((jobset.get("status") or {}).get("restarts") or 0)
    return {
        L_JOBSET_NAME: meta["name"],
        L_JOBSET_UID: meta.get("uid", ""),
        L_RJOB_NAME: rjob["name"],
        L_RJOB_REPLICAS: str(rjob.get("replicas", 1)),
        L_GLOBAL_REPLICAS: str(total),
        L_JOB_INDEX: str(index),
        L_JOB_GLOBAL_INDEX: str(global_index),
        L_JOB_KEY: job_key(meta["namespace"], name),
        L_GROUP_NAME: rjob.get("groupName") or "default",
        L_GROUP_REPLICAS: str(group_replicas),
        L_JOB_GROUP_INDEX: str(group_index),
        L_RESTART_ATTEMPT: str(restarts),
    }


def render_job(
    jobset: JsonDict, rjob: JsonDict, index: int, global_index: int, group_index: int, group_replicas: int
) -> JsonDict:
    """``constructJob``: the Job the JobSet controller creates for ``rjob``'s replica ``index``."""
    meta = jobset["metadata"]
    template = copy.deepcopy(rjob.get("template") or {})
    tmeta = template.get("metadata") or {}
    labels = jobset_job_labels(jobset, rjob, index, global_index, group_index, group_replicas)
    job_spec = template.get("spec") or {}
    pod_template = job_spec.setdefault("template", {})
    pmeta = pod_template.setdefault("metadata", {})
    pmeta["labels"] = {**(pmeta.get("labels") or {}), **labels}
    pmeta["annotations"] = {**(pmeta.get("annotations") or {}), **labels}
    pod_spec = pod_template.setdefault("spec", {})
    if dns_hostnames(jobset):
        pod_spec["subdomain"] = subdomain(jobset)
    suspend = bool((jobset.get("spec") or {}).get("suspend"))
    job_spec["suspend"] = suspend
    annotations = {
        **(tmeta.get("annotations") or {}),
        **labels,
        ANN_COMPLETION_MODE: job_spec.get("completionMode") or "Indexed",
        ANN_SUSPEND: str(suspend).lower(),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(meta["name"], rjob["name"], index),
            "namespace": meta["namespace"],
            "labels": {**(tmeta.get("labels") or {}), **labels},
            "annotations": annotations,
            "ownerReferences": [owner_reference(jobset)],
        },
        "spec": job_spec,
    }


def render_headless_service(jobset: JsonDict) -> JsonDict:
    """``createHeadlessSvcIfNecessary``: no ports, no labels; selects every pod of the JobSet."""
    meta = jobset["metadata"]
    network = (jobset.get("spec") or {}).get("network") or {}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": subdomain(jobset),
            "namespace": meta["namespace"],
            "ownerReferences": [owner_reference(jobset)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {L_JOBSET_NAME: meta["name"]},
            "publishNotReadyAddresses": bool(network.get("publishNotReadyAddresses", True)),
        },
    }


# ----------------------------------------------------------------------------------------------------------------
# The Indexed Job controller (pure)
# ----------------------------------------------------------------------------------------------------------------


def job_suspended(job: JsonDict) -> bool:
    spec = job.get("spec") or {}
    if spec.get("suspend") is not None:
        return bool(spec["suspend"])
    return (job["metadata"].get("annotations") or {}).get(ANN_SUSPEND) == "true"


def pod_phase(pod: JsonDict) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def pod_index(pod: JsonDict) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(L_COMPLETION_INDEX)
    return int(value) if value is not None and value.isdigit() else None


def is_active(pod: JsonDict) -> bool:
    return pod_phase(pod) not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


def pod_ready(pod: JsonDict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


#: What ``resumeJob`` merges from the JobSet's pod template into a suspended Job's as it resumes it.
RESUME_MAPS = (("metadata", "labels"), ("metadata", "annotations"), ("spec", "nodeSelector"))
RESUME_LISTS = (("spec", "tolerations"), ("spec", "schedulingGates"))


def job_pod_template(job: JsonDict) -> JsonDict:
    """A copy of the Job's pod template with what its resumes merged in (:data:`ANN_POD_TEMPLATE`)."""
    template = copy.deepcopy((job.get("spec") or {}).get("template") or {})
    merged = json.loads((job["metadata"].get("annotations") or {}).get(ANN_POD_TEMPLATE) or "{}")
    for part, key in (*RESUME_MAPS, *RESUME_LISTS):
        if key in merged.get(part, {}):
            template.setdefault(part, {})[key] = merged[part][key]
    return template


def resume_job_template(job: JsonDict, rjob: JsonDict) -> JsonDict:
    """``resumeJob`` (kubernetes-sigs/jobset v0.12.0 ``pkg/controllers/jobset_controller.go:636-682``): the Job's pod
    template labels, annotations and nodeSelector merged with the replicated job's (``collections.MergeMaps``, the
    JobSet's win), its tolerations and schedulingGates with the JobSet's added (``MergeSlices``: a union), so that
    what Kueue put into a suspended TrainJob (a flavor's nodeSelector and tolerations, through the Trainer's
    re-applied JobSet) reaches the pods. Returns those five fields, for :data:`ANN_POD_TEMPLATE`."""
    current = job_pod_template(job)
    wanted = (((rjob.get("template") or {}).get("spec") or {}).get("template")) or {}
    out: JsonDict = {"metadata": {}, "spec": {}}
    for part, key in RESUME_MAPS:
        out[part][key] = {**((current.get(part) or {}).get(key) or {}), **((wanted.get(part) or {}).get(key) or {})}
    for part, key in RESUME_LISTS:
        items = list((current.get(part) or {}).get(key) or [])
        items += [item for item in (wanted.get(part) or {}).get(key) or [] if item not in items]
        out[part][key] = items
    return out


def render_indexed_pod(job: JsonDict, index: int) -> JsonDict:
    """The pod of ``index`` (``job_controller.go`` ``manageJob``/``indexed_job_utils.go``): generateName
    ``<job>-<index>-``, the completion-index annotation and label, ``JOB_COMPLETION_INDEX``, hostname
    ``<job>-<index>``, the Job's selector labels and its controller ownerReference."""
    meta = job["metadata"]
    template = job_pod_template(job)
    tmeta = template.get("metadata") or {}
    labels = {
        **(tmeta.get("labels") or {}),
        L_CONTROLLER_UID_LEGACY: meta["uid"],
        L_JOB_NAME_LEGACY: meta["name"],
        L_CONTROLLER_UID: meta["uid"],
        L_JOB_NAME: meta["name"],
        L_COMPLETION_INDEX: str(index),
    }
    annotations = {**(tmeta.get("annotations") or {}), L_COMPLETION_INDEX: str(index)}
    pod_spec = template.get("spec") or {}
    if not pod_spec.get("hostname"):
        pod_spec["hostname"] = pod_hostname(meta["name"], index)
    index_env = {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{L_COMPLETION_INDEX}']"}},
    }
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            container["env"] = merge_env(container.get("env") or [], [index_env])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{pod_hostname(meta['name'], index)}-",
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": pod_spec,
    }


def restarts_of(pod: JsonDict) -> int:
    status = pod.get("status") or {}
    return sum(
        int(cs.get("restartCount") or 0)
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    )


def compress_indexes(indexes: Iterable[int]) -> str:
    """``completedIndexes``' interval form: ``1,3-5``."""
    runs: list[list[int]] = []
    for i in sorted(set(indexes)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass
class JobPlan:
    status: JsonDict
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)


DONE_PHASES = ("Succeeded", "Failed")
FAILURE_TARGET = "FailureTarget"
#: The interim success condition, its reason and message (Kubernetes 1.33+: ``JobReasonCompletionsReached``).
SUCCESS_CRITERIA_MET = ("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods")
INTERIM = (FAILURE_TARGET, SUCCESS_CRITERIA_MET[0])


def enact_job_finished(plan: JobPlan, status: JsonDict, interim: JsonDict, terminating: int, stamp: str) -> None:
    """``enactJobFinished`` (kubernetes ``pkg/controller/job/job_controller.go``, with ``delayTerminalCondition()``:
    1.31+, where ``JobManagedBy`` or ``JobPodReplacementPolicy`` is on): ``Failed`` (for ``FailureTarget``) or
    ``Complete`` (for ``SuccessCriteriaMet``), with the interim condition's reason and message, is written only when
    no pod of the Job is terminating (deleted, not yet Succeeded or Failed); until then the Job has the interim
    condition alone, and the JobSet (``JobFinished`` looks at Complete/Failed only) and the TrainJob wait. The pod
    deletions re-queue the Job. Events as ``recordJobFinished``."""
    if terminating > 0:
        return
    failed = interim.get("type") == FAILURE_TARGET
    reason, message = interim.get("reason", ""), interim.get("message", "")
    set_job_condition(status, "Failed" if failed else "Complete", "True", reason, message, stamp)
    if failed:
        plan.events.append(("Warning", reason, message))
    else:
        status["completionTime"] = stamp
        plan.events.append(("Normal", "Completed", "Job completed"))


def decide_job(job: JsonDict, pods: list[JsonDict], now: float) -> JobPlan:
    """One pass of the Indexed Job controller over ``job`` and the pods it controls."""
    stamp = to_rfc3339(now)
    spec = job.get("spec") or {}
    status = copy.deepcopy(job.get("status") or {})
    plan = JobPlan(status=status)
    completions = int(spec.get("completions") if spec.get("completions") is not None else 1)
    parallelism = int(spec.get("parallelism") if spec.get("parallelism") is not None else 1)
    backoff_limit = int(spec["backoffLimit"] if spec.get("backoffLimit") is not None else DEFAULT_BACKOFF_LIMIT)
    policy = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy") or "OnFailure"
    active = [p for p in pods if is_active(p)]
    succeeded = {i for p in pods if pod_phase(p) == "Succeeded" and (i := pod_index(p)) is not None}
    failed = [p for p in pods if pod_phase(p) == "Failed"]
    finished = is_true(status, "Complete") or is_true(status, "Failed")
    terminating = sum(1 for p in pods if p["metadata"].get("deletionTimestamp") and pod_phase(p) not in DONE_PHASES)
    status["succeeded"] = len(succeeded)
    status["failed"] = len(failed)
    status["completedIndexes"] = compress_indexes(succeeded)
    status["ready"] = sum(1 for p in active if pod_ready(p))
    if finished:
        plan.delete = [p["metadata"]["name"] for p in active]
        status["active"] = 0
        return plan
    interim = next(
        (c for c in status.get("conditions") or [] if c.get("type") in INTERIM and c["status"] == "True"), None
    )
    if interim is not None:  # decided in an earlier pass: finish once no pod is terminating
        plan.delete = [p["metadata"]["name"] for p in active]
        status["active"] = 0
        enact_job_finished(plan, status, interim, terminating + len(plan.delete), stamp)
        return plan
    if job_suspended(job):
        plan.delete = [p["metadata"]["name"] for p in active]
        status["active"] = 0
        if not is_true(status, "Suspended"):
            set_job_condition(status, "Suspended", "True", "JobSuspended", "Job suspended", stamp)
            plan.events.append(("Normal", "Suspended", "Job suspended"))
        return plan
    if is_true(status, "Suspended"):
        set_job_condition(status, "Suspended", "False", "JobResumed", "Job resumed", stamp)
        status["startTime"] = stamp  # the deadline counts from the resume (job_controller.go)
        plan.events.append(("Normal", "Resumed", "Job resumed"))
    status.setdefault("startTime", stamp)
    failure: tuple[str, str] | None = None
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None:
        left = from_rfc3339(status["startTime"]) + int(deadline) - now
        if left <= 0:
            failure = ("DeadlineExceeded", "Job was active longer than specified deadline")
        else:
            plan.requeue_after = left
    on_failure_restarts = sum(restarts_of(p) for p in active if pod_phase(p) in ("Running", "Pending"))
    past_on_failure = policy == "OnFailure" and (
        on_failure_restarts > 0 if backoff_limit == 0 else on_failure_restarts >= backoff_limit
    )
    if failure is None and (len(failed) > backoff_limit or past_on_failure):
        failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
    if failure is not None or len(succeeded) >= completions:
        # newFailureCondition / newSuccessCondition: the interim condition now, the active pods deleted; the
        # terminal one (all JobSet looks at) only when none of them is terminating any more.
        ctype, reason, message = (FAILURE_TARGET, *failure) if failure is not None else SUCCESS_CRITERIA_MET
        set_job_condition(status, ctype, "True", reason, message, stamp)
        plan.delete = [p["metadata"]["name"] for p in active]
        status["active"] = 0
        enact_job_finished(plan, status, find_condition(status, ctype) or {}, terminating + len(plan.delete), stamp)
        return plan
    busy = {i for p in active if (i := pod_index(p)) is not None}
    room = parallelism - len(active)
    for i in range(completions):
        if room <= 0:
            break
        if i in busy or i in succeeded:
            continue
        plan.create.append(i)
        room -= 1
    status["active"] = len(active) + len(plan.create)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# The JobSet controller (pure)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class JobSetPlan:
    status: JsonDict
    create: list[JsonDict] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    suspend: dict[str, bool] = field(default_factory=dict)  # Job name -> the suspend it must get
    resume: dict[str, JsonDict] = field(default_factory=dict)  # Job name -> its merged template (resumeJob)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def job_finished(job: JsonDict) -> str | None:
    status = job.get("status") or {}
    for ctype in ("Complete", "Failed"):
        if is_true(status, ctype):
            return ctype
    return None


def decide_jobset(
    jobset: JsonDict, jobs: list[JsonDict], pods_of: Callable[[JsonDict], list[JsonDict]], now: float
) -> JobSetPlan:
    """One pass of the JobSet controller over ``jobset`` and the Jobs it controls (``Reconcile``)."""
    stamp = to_rfc3339(now)
    spec = jobset.get("spec") or {}
    status = copy.deepcopy(jobset.get("status") or {})
    status.setdefault("restarts", 0)
    plan = JobSetPlan(status=status)
    restarts = int(status["restarts"])
    current: list[JsonDict] = []
    stale: list[JsonDict] = []
    for job in jobs:
        attempt = (job["metadata"].get("labels") or {}).get(L_RESTART_ATTEMPT, "0")
        (current if attempt == str(restarts) else stale).append(job)
    plan.delete += [j["metadata"]["name"] for j in stale if not j["metadata"].get("deletionTimestamp")]
    by_rjob: dict[str, list[JsonDict]] = {}
    for job in current:
        by_rjob.setdefault((job["metadata"].get("labels") or {}).get(L_RJOB_NAME, ""), []).append(job)
    rjs_status = []
    for rjob in spec.get("replicatedJobs") or []:
        counts = {"name": rjob["name"], "ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0}
        for job in by_rjob.get(rjob["name"], []):
            done = job_finished(job)
            jspec = job.get("spec") or {}
            pods = pods_of(job)
            if done == "Complete":
                counts["succeeded"] += 1
            elif done == "Failed":
                counts["failed"] += 1
            elif job_suspended(job):
                counts["suspended"] += 1
            else:
                if any(is_active(p) for p in pods):
                    counts["active"] += 1
                want = min(int(jspec.get("parallelism") or 1), int(jspec.get("completions") or 1))
                ready = sum(1 for p in pods if is_active(p) and pod_ready(p))
                done_pods = sum(1 for p in pods if pod_phase(p) == "Succeeded")
                if ready + done_pods >= want:
                    counts["ready"] += 1
        rjs_status.append(counts)
    status["replicatedJobsStatus"] = rjs_status
    finished = is_true(status, "Completed") or is_true(status, "Failed")
    if finished:
        # jobSetFinished: delete the still-active child Jobs.
        plan.delete += [j["metadata"]["name"] for j in current if not job_finished(j)]
        return plan
    failed = sorted(
        (j for j in current if job_finished(j) == "Failed"),
        key=lambda j: (find_condition(j.get("status") or {}, "Failed") or {}).get("lastTransitionTime", ""),
    )
    if failed:
        max_restarts = int((spec.get("failurePolicy") or {}).get("maxRestarts") or 0)
        if restarts < max_restarts:
            # Recreate: every Job of this attempt goes; the next pass creates the next attempt's.
            status["restarts"] = restarts + 1
            status["restartsCountTowardsMax"] = int(status.get("restartsCountTowardsMax") or 0) + 1
            plan.delete += [j["metadata"]["name"] for j in current if not j["metadata"].get("deletionTimestamp")]
            plan.events.append(("Warning", "Restarting", f"restarting jobset, attempt {restarts + 1}"))
            return plan
        first = failed[0]["metadata"]["name"]
        if max_restarts > 0:
            reason, message = "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
        else:
            reason, message = "FailedJobs", "jobset failed due to one or more job failures"
        message = f"{message} (first failed job: {first})"
        set_condition(status, "Failed", "True", reason, message, stamp)
        status["terminalState"] = "Failed"
        plan.events.append(("Warning", reason, message))
        plan.delete += [j["metadata"]["name"] for j in current if not job_finished(j)]
        return plan
    policy = spec.get("successPolicy") or {"operator": "All"}
    targets = set(policy.get("targetReplicatedJobs") or [r["name"] for r in spec.get("replicatedJobs") or []])
    target_jobs = [j for j in current if (j["metadata"].get("labels") or {}).get(L_RJOB_NAME) in targets]
    expected = sum(int(r.get("replicas", 1)) for r in spec.get("replicatedJobs") or [] if r["name"] in targets)
    complete = [j for j in target_jobs if job_finished(j) == "Complete"]
    if (policy.get("operator") == "Any" and complete) or (
        policy.get("operator", "All") == "All" and expected and len(complete) >= expected
    ):
        set_condition(status, "Completed", "True", "AllJobsCompleted", "jobset completed successfully", stamp)
        status["terminalState"] = "Completed"
        plan.events.append(("Normal", "AllJobsCompleted", "jobset completed successfully"))
        plan.delete += [j["metadata"]["name"] for j in current if not job_finished(j)]
        return plan
    suspend = bool(spec.get("suspend"))
    existing = {j["metadata"]["name"] for j in current}
    for rjob, index, global_index, group_index, group_replicas in job_indexes(jobset):
        name = job_name(jobset["metadata"]["name"], rjob["name"], index)
        if name not in existing:
            plan.create.append(render_job(jobset, rjob, index, global_index, group_index, group_replicas))
    rjobs = {r["name"]: r for r in spec.get("replicatedJobs") or []}
    for job in current:
        if not job_finished(job) and job_suspended(job) != suspend:
            plan.suspend[job["metadata"]["name"]] = suspend
            rjob = rjobs.get((job["metadata"].get("labels") or {}).get(L_RJOB_NAME, ""))
            if not suspend and rjob is not None:
                plan.resume[job["metadata"]["name"]] = resume_job_template(job, rjob)
    if suspend and not is_true(status, "Suspended"):
        set_condition(status, "Suspended", "True", "SuspendedJobs", "jobset is suspended", stamp)
        plan.events.append(("Normal", "SuspendedJobs", "jobset is suspended"))
    elif not suspend and is_true(status, "Suspended"):
        set_condition(status, "Suspended", "False", "ResumeJobs", "jobset is resumed", stamp)
        plan.events.append(("Normal", "ResumeJobs", "jobset is resumed"))
    return plan


# ----------------------------------------------------------------------------------------------------------------
# The TrainJob controller (pure)
# ----------------------------------------------------------------------------------------------------------------

TRAINJOB_SUSPENDED_MESSAGE = "TrainJob is suspended"
TRAINJOB_RESUMED_MESSAGE = "TrainJob is resumed"
TRAINJOB_DEADLINE_MESSAGE = "TrainJob exceeded its active deadline"


def trainjob_finished(status: JsonDict) -> bool:
    return is_true(status, "Complete") or is_true(status, "Failed")


def managed_here(trainjob: JsonDict) -> bool:
    managed_by = (trainjob.get("spec") or {}).get("managedBy")
    return managed_by in (None, "", TRAINER_CONTROLLER)


def trainjob_status(trainjob: JsonDict, jobset: JsonDict | None, now: float) -> tuple[JsonDict, float | None, bool]:
    """(status, requeue after, delete the JobSet) after one pass: ``setSuspendedCondition``, ``setTrainJobStatus``
    (the jobset plugin's ``TrainJobStatus``) and ``reconcileDeadline``."""
    stamp = to_rfc3339(now)
    spec = trainjob.get("spec") or {}
    status = copy.deepcopy(trainjob.get("status") or {})
    if spec.get("suspend"):
        set_condition(status, "Suspended", "True", "Suspended", TRAINJOB_SUSPENDED_MESSAGE, stamp)
    elif is_true(status, "Suspended"):
        set_condition(status, "Suspended", "False", "Resumed", TRAINJOB_RESUMED_MESSAGE, stamp)
    if jobset is not None:
        js_status = jobset.get("status") or {}
        for js_type, tj_type in (("Completed", "Complete"), ("Failed", "Failed")):
            cond = find_condition(js_status, js_type)
            if cond is not None and cond.get("status") == "True":
                deadline_failed = tj_type == "Failed" and (find_condition(status, "Failed") or {}).get("reason") == (
                    "DeadlineExceeded"
                )
                if not deadline_failed:
                    set_condition(status, tj_type, "True", cond.get("reason", ""), cond.get("message", ""), stamp)
        jobs_status = [
            {k: r.get(k, 0) for k in ("ready", "succeeded", "failed", "active", "suspended")} | {"name": r["name"]}
            for r in js_status.get("replicatedJobsStatus") or []
        ]
        if jobs_status:
            status["jobsStatus"] = jobs_status
    ads = spec.get("activeDeadlineSeconds")
    if not ads or trainjob_finished(status) or spec.get("suspend"):
        return status, None, False
    start = from_rfc3339(trainjob["metadata"].get("creationTimestamp") or stamp)
    suspended = find_condition(status, "Suspended")
    if suspended is not None and suspended.get("status") == "False":
        start = from_rfc3339(suspended["lastTransitionTime"])
    left = start + int(ads) - now
    if left < 0:
        set_condition(status, "Failed", "True", "DeadlineExceeded", TRAINJOB_DEADLINE_MESSAGE, stamp)
        return status, None, True
    return status, max(left, 1.0), False


# ----------------------------------------------------------------------------------------------------------------
# The controllers (I/O)
# ----------------------------------------------------------------------------------------------------------------


class ReconcileError(RuntimeError):
    pass


def owner_key(obj: JsonDict, kind: str) -> tuple[str, str, str] | None:
    ref = controller_of(obj)
    if ref is None or ref.get("kind") != kind:
        return None
    return (kind, obj["metadata"].get("namespace", ""), ref["name"])


class Controllers:
    """The three simulated controllers, one worker draining one queue of (kind, namespace, name) keys."""

    def __init__(self, api: client.ApiClient, *, collect_garbage: bool = True) -> None:
        #: False beside a real kube-controller-manager (the real node), whose garbage collector does this part.
        self.collects_garbage = collect_garbage
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.stop = threading.Event()
        self.queue = WorkQueue()
        self.trainjobs = Informer("trainjobs", self._list_trainjobs, self._on_trainjob)
        self.jobsets = Informer("jobsets", self._list_jobsets, self._on_jobset)
        self.jobs = Informer("jobs", self.batch.list_job_for_all_namespaces, self._on_job, label_selector=L_JOBSET_NAME)
        self.pods = Informer("pods", self.core.list_pod_for_all_namespaces, self._on_pod, label_selector=L_JOBSET_NAME)
        self._emitted: set[tuple[str, str, str]] = set()

    def _list_trainjobs(self, **kwargs: Any) -> Any:
        return self.custom.list_cluster_custom_object(TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS, **kwargs)

    def _list_jobsets(self, **kwargs: Any) -> Any:
        return self.custom.list_cluster_custom_object(JOBSET_GROUP, JOBSET_VERSION, JOBSETS, **kwargs)

    # -- event handlers -------------------------------------------------------------------------------------------

    def _gc_later(self, obj: JsonDict) -> None:
        if not self.collects_garbage:
            return
        meta = obj["metadata"]
        threading.Thread(
            target=self.collect_garbage, args=(meta["namespace"], meta["uid"]), daemon=True, name="gc"
        ).start()

    def _on_trainjob(self, kind: str, obj: JsonDict) -> None:
        if kind == "DELETED":
            self._gc_later(obj)
            return
        self.queue.add((TRAINJOB_KIND, obj["metadata"]["namespace"], obj["metadata"]["name"]))

    def _on_jobset(self, kind: str, obj: JsonDict) -> None:
        if kind == "DELETED":
            self._gc_later(obj)
        else:
            self.queue.add((JOBSET_KIND, obj["metadata"]["namespace"], obj["metadata"]["name"]))
        key = owner_key(obj, TRAINJOB_KIND)
        if key is not None:
            self.queue.add(key)

    def _on_job(self, kind: str, obj: JsonDict) -> None:
        if kind == "DELETED":
            self._gc_later(obj)
        else:
            self.queue.add(("Job", obj["metadata"]["namespace"], obj["metadata"]["name"]))
        key = owner_key(obj, JOBSET_KIND)
        if key is not None:
            self.queue.add(key)

    def _on_pod(self, kind: str, obj: JsonDict) -> None:
        key = owner_key(obj, "Job")
        if key is not None:
            self.queue.add(key)
            # Readiness of pods feeds the JobSet's replicatedJobsStatus.
            jobset = (obj["metadata"].get("labels") or {}).get(L_JOBSET_NAME)
            if jobset:
                self.queue.add((JOBSET_KIND, obj["metadata"]["namespace"], jobset))

    # -- reconcile ------------------------------------------------------------------------------------------------

    def reconcile(self, key: tuple[str, str, str]) -> None:
        kind, namespace, name = key
        if kind == TRAINJOB_KIND:
            self.reconcile_trainjob(namespace, name)
        elif kind == JOBSET_KIND:
            self.reconcile_jobset(namespace, name)
        elif kind == "Job":
            self.reconcile_job(namespace, name)

    def _cached(self, informer: Informer, namespace: str, name: str) -> JsonDict | None:
        with informer.lock:
            return informer.cache.get((namespace, name))

    def _owned(self, informer: Informer, namespace: str, uid: str) -> list[JsonDict]:
        return [o for o in informer.items() if o["metadata"].get("namespace") == namespace and controlled_by(o, uid)]

    def get_runtime(self, trainjob: JsonDict) -> JsonDict | None:
        ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
        kind = ref.get("kind") or CLUSTER_RUNTIME_KIND
        try:
            if kind == CLUSTER_RUNTIME_KIND:
                return dict(
                    self.custom.get_cluster_custom_object(TRAINER_GROUP, TRAINER_VERSION, CLUSTER_RUNTIMES, ref["name"])
                )
            return dict(
                self.custom.get_namespaced_custom_object(
                    TRAINER_GROUP, TRAINER_VERSION, trainjob["metadata"]["namespace"], RUNTIMES, ref["name"]
                )
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def reconcile_trainjob(self, namespace: str, name: str) -> None:
        trainjob = self._cached(self.trainjobs, namespace, name)
        if trainjob is None or trainjob["metadata"].get("deletionTimestamp"):
            if trainjob is not None:
                self.finalize_deleted(trainjob, TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS)
            return
        if not managed_here(trainjob):
            return
        spec = trainjob.get("spec") or {}
        status = copy.deepcopy(trainjob.get("status") or {})
        error: str | None = None
        registry_key = runtime_registry_key(spec.get("runtimeRef") or {})
        jobset = self._cached(self.jobsets, namespace, name)
        if jobset is not None and not controlled_by(jobset, trainjob["metadata"]["uid"]):
            jobset = None
        if registry_key not in SUPPORTED_RUNTIMES:
            message = f"unsupported runtime: {registry_key}"
            set_condition(status, "Failed", "True", "TrainingRuntimeNotSupported", message, to_rfc3339(time.time()))
            self.write_status(TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS, trainjob, status, self.trainjobs)
            raise ReconcileError(message)
        if not trainjob_finished(status):
            try:
                self.reconcile_trainjob_objects(trainjob, jobset)
            except (ReconcileError, ApiException) as err:
                text = api_error_message(err) if isinstance(err, ApiException) else str(err)
                error = f"TrainJob resources reconciliation failed: {text:.950}"
                self.event(trainjob, TRAINER_API_VERSION, "Warning", "TrainJobResourcesCreationFailed", error)
        new_status, requeue, delete_jobset = trainjob_status({**trainjob, "status": status}, jobset, time.time())
        if delete_jobset:
            self.delete_object("jobset", namespace, name)
        if new_status != (trainjob.get("status") or {}):
            self.write_status(TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS, trainjob, new_status, self.trainjobs)
        if requeue is not None:
            self.queue.add((TRAINJOB_KIND, namespace, name), after=requeue + 0.05)
        if error is not None:
            raise ReconcileError(error)

    def reconcile_trainjob_objects(self, trainjob: JsonDict, jobset: JsonDict | None) -> None:
        meta = trainjob["metadata"]
        suspend = bool((trainjob.get("spec") or {}).get("suspend"))
        if jobset is not None:
            # The jobset plugin's Build (v2.3.0 pkg/runtime/framework/plugins/jobset/jobset.go:330-342): a running
            # JobSet is left alone; while the TrainJob or the JobSet is suspended the whole JobSet is built again
            # and applied, so runtime patches changed while suspended (Kueue's) reach its template before resume.
            if not suspend and not (jobset.get("spec") or {}).get("suspend"):
                return
            runtime = self.get_runtime(trainjob)
            patch: JsonDict = {"spec": {"suspend": suspend}}
            if runtime is not None:
                patch = reapplied_jobset(jobset_defaults(build_jobset(trainjob, runtime)))
            resp = self.custom.patch_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                meta["namespace"],
                JOBSETS,
                meta["name"],
                patch,
                _content_type=PATCH_MERGE,
                _preload_content=False,
            )
            self.jobsets.put(json.loads(resp.data))
            return
        runtime = self.get_runtime(trainjob)
        if runtime is None:
            ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
            kind = ref.get("kind") or CLUSTER_RUNTIME_KIND
            plural = CLUSTER_RUNTIMES if kind == CLUSTER_RUNTIME_KIND else RUNTIMES
            raise ReconcileError(
                f'not found {kind} specified in TrainJob: {plural}.{TRAINER_GROUP} "{ref.get("name")}" not found'
            )
        body = jobset_defaults(build_jobset(trainjob, runtime))
        try:
            resp = self.custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, meta["namespace"], JOBSETS, body, _preload_content=False
            )
        except ApiException as err:
            if err.status == 409:
                return  # ours arrives through the watch; someone else's is not ours (upstream: an apply conflict)
            raise
        self.jobsets.put(json.loads(resp.data))
        log.info("trainjob %s/%s: created jobset", meta["namespace"], meta["name"])

    def reconcile_jobset(self, namespace: str, name: str) -> None:
        jobset = self._cached(self.jobsets, namespace, name)
        if jobset is None:
            return
        if jobset["metadata"].get("deletionTimestamp"):
            self.finalize_deleted(jobset, JOBSET_GROUP, JOBSET_VERSION, JOBSETS)
            return
        if ((jobset.get("spec") or {}).get("managedBy") or JOBSET_CONTROLLER) != JOBSET_CONTROLLER:
            return
        uid = jobset["metadata"]["uid"]
        if dns_hostnames(jobset):
            self.ensure_service(jobset)
        jobs = self._owned(self.jobs, namespace, uid)

        def pods_of(job: JsonDict) -> list[JsonDict]:
            return self._owned(self.pods, namespace, job["metadata"]["uid"])

        plan = decide_jobset(jobset, jobs, pods_of, time.time())
        for job_to_delete in dict.fromkeys(plan.delete):
            self.delete_object("job", namespace, job_to_delete)
        for job in plan.create:
            try:
                resp = self.batch.create_namespaced_job(namespace, job, _preload_content=False)
            except ApiException as err:
                if err.status == 409:
                    continue
                self.event(jobset, JOBSET_API_VERSION, "Warning", "JobCreationFailed", api_error_message(err))
                raise
            self.jobs.put(json.loads(resp.data))
        for job_name_, suspend in plan.suspend.items():
            annotations = {ANN_SUSPEND: str(suspend).lower()}
            if job_name_ in plan.resume:
                annotations[ANN_POD_TEMPLATE] = json.dumps(plan.resume[job_name_], sort_keys=True)
            patch = {"spec": {"suspend": suspend}, "metadata": {"annotations": annotations}}
            resp = self.batch.patch_namespaced_job(
                job_name_, namespace, patch, _content_type=PATCH_MERGE, _preload_content=False
            )
            self.jobs.put(json.loads(resp.data))
        for etype, reason, message in plan.events:
            self.event(jobset, JOBSET_API_VERSION, etype, reason, message, once=True)
        if plan.status != (jobset.get("status") or {}):
            self.write_status(JOBSET_GROUP, JOBSET_VERSION, JOBSETS, jobset, plan.status, self.jobsets)
        if plan.create or plan.delete:
            self.queue.add((JOBSET_KIND, namespace, name), after=0.2)

    def ensure_service(self, jobset: JsonDict) -> None:
        body = render_headless_service(jobset)
        try:
            self.core.create_namespaced_service(jobset["metadata"]["namespace"], body, _preload_content=False)
        except ApiException as err:
            if err.status != 409:
                raise

    def reconcile_job(self, namespace: str, name: str) -> None:
        job = self._cached(self.jobs, namespace, name)
        if job is None:
            return
        if job["metadata"].get("deletionTimestamp"):
            self.finalize_deleted(job, "batch", "v1", "jobs")
            return
        if (job["metadata"].get("annotations") or {}).get(ANN_COMPLETION_MODE) != "Indexed":
            return  # not a JobSet's Job
        pods = self._owned(self.pods, namespace, job["metadata"]["uid"])
        plan = decide_job(job, pods, time.time())
        for pod_name in plan.delete:
            self.delete_object("pod", namespace, pod_name)
        for index in plan.create:
            body = render_indexed_pod(job, index)
            try:
                resp = self.core.create_namespaced_pod(namespace, body, _preload_content=False)
            except ApiException as err:
                self.event(job, "batch/v1", "Warning", "FailedCreate", f"Error creating: {api_error_message(err)}")
                raise
            created = json.loads(resp.data)
            self.pods.put(created)
            self.event(job, "batch/v1", "Normal", "SuccessfulCreate", f"Created pod: {created['metadata']['name']}")
        for etype, reason, message in plan.events:
            self.event(job, "batch/v1", etype, reason, message, once=True)
        if plan.status != (job.get("status") or {}):
            try:
                resp = self.batch.patch_namespaced_job_status(
                    name, namespace, {"status": plan.status}, _content_type=PATCH_MERGE, _preload_content=False
                )
                self.jobs.put(json.loads(resp.data))
            except ApiException as err:
                if err.status not in (404, 409, 422):
                    raise
        if plan.requeue_after is not None:
            self.queue.add(("Job", namespace, name), after=plan.requeue_after + 0.05)
        if plan.create or plan.delete:
            self.queue.add(("Job", namespace, name), after=0.2)

    # -- writes ---------------------------------------------------------------------------------------------------

    def write_status(
        self, group: str, version: str, plural: str, obj: JsonDict, status: JsonDict, informer: Informer
    ) -> None:
        meta = obj["metadata"]
        try:
            resp = self.custom.patch_namespaced_custom_object_status(
                group,
                version,
                meta["namespace"],
                plural,
                meta["name"],
                {"metadata": {"uid": meta["uid"]}, "status": status},
                _content_type=PATCH_MERGE,
                _preload_content=False,
            )
            informer.put(json.loads(resp.data))
        except ApiException as err:
            if err.status not in (404, 409, 422):
                raise

    def delete_object(self, what: str, namespace: str, name: str) -> None:
        body = {"propagationPolicy": "Background"}
        try:
            if what == "pod":
                resp = self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
                obj = json.loads(resp.data)
                if obj.get("metadata", {}).get("deletionTimestamp"):
                    self.pods.put(obj)
                else:
                    self.pods.drop(namespace, name)
            elif what == "service":
                self.core.delete_namespaced_service(name, namespace, _preload_content=False)
            elif what == "job":
                self.batch.delete_namespaced_job(name, namespace, body=body, _preload_content=False)
            elif what == "jobset":
                self.custom.delete_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name, body=body, _preload_content=False
                )
        except ApiException as err:
            if err.status != 404:
                raise

    def event(
        self, obj: JsonDict, api_version: str, etype: str, reason: str, message: str, *, once: bool = False
    ) -> None:
        meta = obj["metadata"]
        if once:
            key = (meta["uid"], reason, message)
            if key in self._emitted:
                return
            self._emitted.add(key)
        component = {TRAINER_API_VERSION: COMPONENT_TRAINER, JOBSET_API_VERSION: COMPONENT_JOBSET}.get(
            api_version, COMPONENT_JOB
        )
        now = to_rfc3339(time.time())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": api_version,
                "kind": obj.get("kind") or "",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": etype,
            "source": {"component": component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
        except Exception as err:  # best effort, as client-go's recorder
            log.debug("event %s not recorded: %s", reason, err)

    # -- garbage collection ---------------------------------------------------------------------------------------

    def dependents(self, namespace: str, uid: str) -> list[tuple[str, JsonDict]]:
        found: list[tuple[str, JsonDict]] = []
        listers: list[tuple[str, Callable[[], Any]]] = [
            (
                "jobset",
                lambda: self.custom.list_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, _preload_content=False
                ),
            ),
            ("job", lambda: self.batch.list_namespaced_job(namespace, _preload_content=False)),
            ("service", lambda: self.core.list_namespaced_service(namespace, _preload_content=False)),
            ("pod", lambda: self.core.list_namespaced_pod(namespace, _preload_content=False)),
        ]
        for what, lister in listers:
            for obj in json.loads(lister().data).get("items") or []:
                if any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or []):
                    found.append((what, obj))
        return found

    def collect_garbage(self, namespace: str, uid: str) -> int:
        """Delete what ``uid`` owned (background propagation); returns how many dependents were still there."""
        try:
            found = self.dependents(namespace, uid)
            for what, obj in found:
                if not obj["metadata"].get("deletionTimestamp"):
                    self.delete_object(what, namespace, obj["metadata"]["name"])
            return len(found)
        except Exception as err:
            log.warning("garbage collection for %s in %s failed: %s", uid, namespace, err)
            return -1

    def finalize_deleted(self, obj: JsonDict, group: str, version: str, plural: str) -> None:
        """The GC's part of a Foreground or Orphan deletion, then its finalizer goes."""
        if not self.collects_garbage:  # the real collector's finalizers
            return
        meta = obj["metadata"]
        finalizers = meta.get("finalizers") or []
        namespace, uid = meta["namespace"], meta["uid"]
        if "foregroundDeletion" in finalizers:
            remaining = self.collect_garbage(namespace, uid)
            if remaining != 0:
                self.queue.add((obj.get("kind") or "Job", namespace, meta["name"]), after=1.0)
                return
            self._remove_finalizer(obj, group, version, plural, "foregroundDeletion")
        elif "orphan" in finalizers:
            for what, dep in self.dependents(namespace, uid):
                refs = [r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
                patch = {"metadata": {"ownerReferences": refs or None}}
                name = dep["metadata"]["name"]
                if what == "pod":
                    self.core.patch_namespaced_pod(name, namespace, patch, _content_type=PATCH_MERGE)
                elif what == "service":
                    self.core.patch_namespaced_service(name, namespace, patch, _content_type=PATCH_MERGE)
                elif what == "job":
                    self.batch.patch_namespaced_job(name, namespace, patch, _content_type=PATCH_MERGE)
                else:
                    self.custom.patch_namespaced_custom_object(
                        JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name, patch, _content_type=PATCH_MERGE
                    )
            self._remove_finalizer(obj, group, version, plural, "orphan")

    def _remove_finalizer(self, obj: JsonDict, group: str, version: str, plural: str, finalizer: str) -> None:
        meta = obj["metadata"]
        patch = {"metadata": {"finalizers": [f for f in meta.get("finalizers") or [] if f != finalizer] or None}}
        patch["metadata"]["uid"] = meta["uid"]
        try:
            if group == "batch":
                self.batch.patch_namespaced_job(
                    meta["name"], meta["namespace"], patch, _content_type=PATCH_MERGE, _preload_content=False
                )
            else:
                self.custom.patch_namespaced_custom_object(
                    group,
                    version,
                    meta["namespace"],
                    plural,
                    meta["name"],
                    patch,
                    _content_type=PATCH_MERGE,
                    _preload_content=False,
                )
        except ApiException as err:
            if err.status not in (404, 409, 422):
                raise

    def sweep_orphans(self) -> None:
        """Delete dependents whose TrainJob, JobSet or Job owner no longer exists."""
        live = {o["metadata"]["uid"] for inf in (self.trainjobs, self.jobsets, self.jobs) for o in inf.items()}
        kinds = {TRAINJOB_KIND, JOBSET_KIND, "Job"}
        for informer in (self.jobsets, self.jobs, self.pods):
            for obj in informer.items():
                for ref in obj["metadata"].get("ownerReferences") or []:
                    if (
                        ref.get("kind") in kinds
                        and ref["uid"] not in live
                        and not self._owner_exists(obj["metadata"]["namespace"], ref)
                    ):
                        log.info("collecting dependents of deleted %s %s (%s)", ref["kind"], ref["name"], ref["uid"])
                        self.collect_garbage(obj["metadata"]["namespace"], ref["uid"])

    def _owner_exists(self, namespace: str, ref: JsonDict) -> bool:
        try:
            if ref["kind"] == "Job":
                current = json.loads(
                    self.batch.read_namespaced_job(ref["name"], namespace, _preload_content=False).data
                )
            else:
                group, version, plural = (
                    (TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS)
                    if ref["kind"] == TRAINJOB_KIND
                    else (JOBSET_GROUP, JOBSET_VERSION, JOBSETS)
                )
                current = self.custom.get_namespaced_custom_object(group, version, namespace, plural, ref["name"])
            return bool(current["metadata"]["uid"] == ref["uid"])
        except ApiException as err:
            return bool(err.status != 404)
        except Exception:
            return True

    # -- threads --------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self.stop.is_set():
            key = self.queue.get(self.stop)
            if key is None:
                continue
            try:
                self.reconcile(key)  # type: ignore[arg-type]
            except Exception as err:
                delay = self.queue.add_rate_limited(key)
                log.warning("reconcile %s failed: %s; retrying in %.3fs", "/".join(key), err, delay)
            else:
                self.queue.forget(key)

    def _housekeeping(self) -> None:
        while not self.stop.wait(SWEEP_SECONDS):
            if not self.collects_garbage:
                continue
            try:
                self.sweep_orphans()
            except Exception as err:
                log.warning("orphan sweep failed: %s", err)

    def run(self) -> None:
        informers = (self.pods, self.jobs, self.jobsets, self.trainjobs)
        for informer in informers:
            threading.Thread(target=informer.run, args=(self.stop,), name=f"watch-{informer.name}", daemon=True).start()
        for informer in informers:
            while not informer.synced.wait(1.0):
                if self.stop.is_set():
                    return
        log.info("caches synced; reconciling")
        threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True).start()
        self._work()


# ----------------------------------------------------------------------------------------------------------------
# Installing the CRDs and the runtime; starting the process
# ----------------------------------------------------------------------------------------------------------------


READ = ["get", "list", "watch"]
WRITE = ["create", "update", "patch", "delete"]
#: What this controller's identity needs (ClusterRole rules): the three controllers and the garbage collector.
RBAC_RULES: list[JsonDict] = [
    {
        "apiGroups": [TRAINER_GROUP],
        "resources": [TRAINJOBS, f"{TRAINJOBS}/finalizers"],
        "verbs": [*READ, "update", "patch"],
    },
    {"apiGroups": [TRAINER_GROUP], "resources": [f"{TRAINJOBS}/status"], "verbs": ["get", "update", "patch"]},
    {"apiGroups": [TRAINER_GROUP], "resources": [CLUSTER_RUNTIMES, RUNTIMES], "verbs": READ},
    {"apiGroups": [JOBSET_GROUP], "resources": [JOBSETS, f"{JOBSETS}/finalizers"], "verbs": [*READ, *WRITE]},
    {"apiGroups": [JOBSET_GROUP], "resources": [f"{JOBSETS}/status"], "verbs": ["get", "update", "patch"]},
    {"apiGroups": ["batch"], "resources": ["jobs", "jobs/finalizers"], "verbs": [*READ, *WRITE]},
    {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get", "update", "patch"]},
    {"apiGroups": [""], "resources": ["pods", "services"], "verbs": [*READ, *WRITE]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch", "update"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get"]},
]
CLUSTER_ROLE = "torchelastic:sim-trainer"


def rbac_objects(user: str) -> list[JsonDict]:
    """A ClusterRole with :data:`RBAC_RULES` and its binding to ``user`` (e.g. the cluster's ``sim-operator``)."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": CLUSTER_ROLE},
            "rules": copy.deepcopy(RBAC_RULES),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{CLUSTER_ROLE}:{user}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CLUSTER_ROLE},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        },
    ]


def install_files(crds_dir: Path = CRDS_DIR) -> list[Path]:
    """The files :func:`install` creates, in order (CRDs first, then the runtime); absent ones are left out."""
    return [p for p in (*(crds_dir / f for f in CRD_FILES), crds_dir / RUNTIME_FILE) if p.exists()]


def for_api_server_1_20(obj: JsonDict) -> JsonDict:
    """A copy of a derived CRD that a 1.20 API server accepts (``../shared/notes/real-node.md``, "Trainer v2 CRDs on
    a 1.20 API server"): without the ``default: ""`` of string fields (1.20 reads them as null and refuses them) and
    with every list-map whose key is neither required nor defaulted made atomic (the ``imagePullSecrets`` lists).
    Anything else is left as it is; other objects come back unchanged."""
    obj = copy.deepcopy(obj)
    if obj.get("kind") != "CustomResourceDefinition":
        return obj

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "string" and node.get("default") == "":
            del node["default"]
        if node.get("x-kubernetes-list-type") == "map":
            items = node.get("items") or {}
            required = set(items.get("required") or [])
            props = items.get("properties") or {}
            keys = node.get("x-kubernetes-list-map-keys") or []
            if any(k not in required and "default" not in (props.get(k) or {}) for k in keys):
                node["x-kubernetes-list-type"] = "atomic"
                node.pop("x-kubernetes-list-map-keys", None)
        for value in node.values():
            walk(value)

    for version in obj["spec"].get("versions") or []:
        walk((version.get("schema") or {}).get("openAPIV3Schema"))
    # Keys whose default was dropped above may now make a list-map invalid: one more pass settles it.
    for version in obj["spec"].get("versions") or []:
        walk((version.get("schema") or {}).get("openAPIV3Schema"))
    return obj


def install(
    kubeconfig: str | Path, *, kubectl: str = "kubectl", timeout: float = 60.0, rbac_user: str | None = None
) -> None:
    """Create the derived TrainJob/ClusterTrainingRuntime/JobSet CRDs (made 1.20-acceptable by
    :func:`for_api_server_1_20`) and the ``torch-distributed`` runtime, once the CRDs are Established. Idempotent:
    what already exists is kept. ``kubectl create``, not ``apply``: the JobSet CRD is too large for the
    last-applied annotation. ``--validate=false``: kubectl's client-side schema of a 1.20 server does not know
    ``x-kubernetes-validations`` (the server drops them). With ``rbac_user``, also :func:`rbac_objects` for it."""
    import yaml

    files = install_files()
    crds = [for_api_server_1_20(yaml.safe_load(p.read_text())) for p in files if p.name != RUNTIME_FILE]
    runtimes = [yaml.safe_load(p.read_text()) for p in files if p.name == RUNTIME_FILE]
    base = [kubectl, f"--kubeconfig={kubeconfig}"]

    def create(obj: JsonDict) -> None:
        result = subprocess.run(
            [*base, "create", "--validate=false", "-f", "-"],
            input=json.dumps(obj),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0 and "AlreadyExists" not in result.stderr:
            raise RuntimeError(f"kubectl create {obj['metadata']['name']} failed: {result.stderr.strip()[-4000:]}")

    for crd in crds:
        create(crd)
    for obj in rbac_objects(rbac_user) if rbac_user else []:
        create(obj)
    api = build_api_client(str(kubeconfig))
    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + timeout
    # Polled, not `kubectl wait` (kubectl 1.32 errors out when it looks before any condition is written).
    for crd in crds:
        name = crd["metadata"]["name"]
        while True:
            got = json.loads(ext.read_custom_resource_definition(name, _preload_content=False).data)
            if is_true(got.get("status") or {}, "Established"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {name} not Established: {got.get('status')}")
            time.sleep(0.2)
    # Discovery may lag the Established condition by a moment.
    for runtime in runtimes:
        while True:
            try:
                create(runtime)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    api.close()


def command(kubeconfig: str | Path, python: str = sys.executable, log_level: str = "INFO") -> list[str]:
    """The argv that starts this controller (run it from the repository root)."""
    return [python, "-m", "tests.cluster.sim_trainer", f"--kubeconfig={kubeconfig}", f"--log-level={log_level}"]


def build_api_client(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 16
    return client.ApiClient(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--no-garbage-collector",
        action="store_true",
        help="leave dependents to a real kube-controller-manager's garbage collector",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s sim-trainer %(levelname)s %(message)s"
    )
    controllers = Controllers(build_api_client(args.kubeconfig), collect_garbage=not args.no_garbage_collector)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        controllers.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    controllers.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

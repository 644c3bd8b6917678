"""A simulated Kubeflow training operator (v1.9) for PyTorchJobs, plus the garbage collector the cluster lacks.

Run it as ``python -m tests.cluster.sim_operator --kubeconfig PATH``. It is an ordinary API client (list + watch,
create, delete, merge-patch of ``/status``), so it runs unchanged against any API server.

It follows the real controller (kubeflow/trainer ``release-1.9``; see ``../shared/notes/pytorchjob-controller.md``):

* In-memory defaults on every reconcile (never written back): restartPolicy OnFailure, replicas 1, nprocPerNode
  ``auto``, elastic min/max, cleanPodPolicy None, the ``pytorchjob-port`` 23456 port on the ``pytorch`` container.
* Pods ``<job>-<master|worker>-<i>`` and headless Services of the same name, with the real labels, controller
  ownerReferences, restartPolicy from the replica (ExitCode -> Never), the injected env (Master, elastic and
  worker-only modes) and the ``init-pytorch`` init container on Workers when a Master exists.
* ``.status`` through the ``/status`` subresource: conditions Created, Running, Restarting, Succeeded, Failed,
  Suspended (reasons ``PyTorchJob<Type>``, the real messages), replicaStatuses recounted from the pods, startTime,
  completionTime; restarts by deleting and recreating failed pods; ExitCode (1-127 permanent, >=128 retryable);
  backoffLimit; activeDeadlineSeconds (re-checked on a resync every few seconds, unlike the real one's no-op queue);
  cleanPodPolicy; ttlSecondsAfterFinished; suspend/resume.
* Events on the job: pod/service creation and deletion, ExitedWithCode, Restarting, Succeeded/Failed, and Warnings
  named after container waiting/terminated reasons of active pods (ImagePullBackOff, CreateContainerConfigError, ...).
* Webhook rules (which the real cluster enforces at admission, before the operator sees a job) are checked too: an
  invalid job gets a Warning event and ``Failed`` with reason ``PyTorchJobFailedValidation``, so that tests notice.
  A real cluster would have rejected the create call instead.

Garbage collection: no kube-controller-manager runs in the test cluster. When a PyTorchJob is deleted, this process
deletes every Pod, Service, ConfigMap and Secret in its namespace whose ownerReferences name the job's UID; it honours
``propagationPolicy=Foreground`` (deletes dependents, then removes the ``foregroundDeletion`` finalizer) and
``Orphan`` (removes the ownerReferences, then the ``orphan`` finalizer); and every 30 s it sweeps dependents whose
owner job no longer exists.

RBAC this identity needs: pytorchjobs get/list/watch/update/patch/delete, pytorchjobs/status update/patch,
pods and services get/list/watch/create/patch/delete, configmaps and secrets get/list/watch/patch/delete,
events create.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import heapq
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.watch import ListWatch

log = logging.getLogger("sim-operator")

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
API_VERSION = f"{GROUP}/{VERSION}"
CONTROLLER_NAME = "pytorchjob-controller"

LABEL_OPERATOR = "training.kubeflow.org/operator-name"
LABEL_JOB_NAME = "training.kubeflow.org/job-name"
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"
LABEL_JOB_ROLE = "training.kubeflow.org/job-role"

MASTER, WORKER = "Master", "Worker"
REPLICA_TYPES = (MASTER, WORKER)  # Go iterates a map; a fixed order makes the simulator deterministic
DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
DEFAULT_NPROC_PER_NODE = "auto"
INIT_CONTAINER_IMAGE = "alpine:3.10"
INIT_CONTAINER_MAX_TRIES = 100
NOT_TERMINATED = 0xBEEF  # the controller's "no exit code" marker; >= 128, so it counts as retryable

RESYNC_SECONDS = 3.0
SWEEP_SECONDS = 30.0
PATCH_MERGE = "application/merge-patch+json"
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

# ----------------------------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------------------------


def to_rfc3339(epoch: float) -> str:
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(value: str) -> float:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


# ----------------------------------------------------------------------------------------------------------------
# Defaults and validation (pure)
# ----------------------------------------------------------------------------------------------------------------


def apply_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``job`` with the controller's in-memory defaults (``pytorch_defaults.go``)."""
    job = copy.deepcopy(job)
    spec = job.setdefault("spec", {})
    run_policy = spec.setdefault("runPolicy", {})
    run_policy.setdefault("cleanPodPolicy", "None")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    # Replica keys are matched case-insensitively and turned into "Master"/"Worker".
    spec["pytorchReplicaSpecs"] = {
        (k.capitalize() if k.lower() in ("master", "worker") else k): v for k, v in replicas.items()
    }
    for rspec in spec["pytorchReplicaSpecs"].values():
        if rspec is None:
            continue
        rspec.setdefault("replicas", 1)
        if not rspec.get("restartPolicy"):
            rspec["restartPolicy"] = "OnFailure"
        pod_spec = rspec.setdefault("template", {}).setdefault("spec", {})
        for container in pod_spec.get("containers") or []:
            if container.get("name") != DEFAULT_CONTAINER:
                continue
            ports = container.setdefault("ports", [])
            if not any(p.get("name") == DEFAULT_PORT_NAME for p in ports):
                ports.append({"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if lo is not None and hi is None:
            elastic["maxReplicas"] = lo
        elif hi is not None and lo is None:
            elastic["minReplicas"] = hi
        elif lo is None and hi is None:
            worker = spec["pytorchReplicaSpecs"].get(WORKER)
            if worker is not None:
                elastic["minReplicas"] = elastic["maxReplicas"] = worker["replicas"]
    if spec.get("nprocPerNode") is None and (elastic is None or elastic.get("nProcPerNode") is None):
        spec["nprocPerNode"] = DEFAULT_NPROC_PER_NODE
    return job


def validate_job(job: dict[str, Any]) -> list[str]:
    """The admission webhook's rules (``pytorchjob_webhook.go``) that the CRD schema does not check."""
    errors: list[str] = []
    name = job.get("metadata", {}).get("name", "")
    if len(name) > 63 or not DNS1035.fullmatch(name):
        errors.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1035 label")
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: Required value")
    for rtype, rspec in replicas.items():
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in REPLICA_TYPES:
            errors.append(f'{path}: Unsupported value: {rtype!r}: supported values: "Master", "Worker"')
            continue
        if rspec is None:
            errors.append(f"{path}: Required value")
            continue
        containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{path}.template.spec.containers: Required value")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{path}.template.spec.containers[{i}].image: Required value")
        if containers and not any(c.get("name") == DEFAULT_CONTAINER for c in containers):
            errors.append(f"{path}.template.spec.containers: Required value: must have a container named pytorch")
        if rtype == MASTER and rspec.get("replicas") != 1:
            errors.append(f"{path}.replicas: Forbidden: must be 1")
        if rtype == WORKER and rspec.get("replicas") is not None and rspec["replicas"] < 1:
            errors.append(f"{path}.replicas: Invalid value: must be at least 1")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if WORKER not in replicas:
            errors.append("spec.elasticPolicy: Forbidden: must be configured with the Worker replica")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by not in (None, "kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue"):
        errors.append(f"spec.runPolicy.managedBy: Unsupported value: {managed_by!r}")
    return errors


# ----------------------------------------------------------------------------------------------------------------
# Rendering pods and services (pure)
# ----------------------------------------------------------------------------------------------------------------


def job_labels(job_name: str) -> dict[str, str]:
    return {LABEL_OPERATOR: CONTROLLER_NAME, LABEL_JOB_NAME: job_name.replace("/", "-")}


def replica_labels(job_name: str, rtype: str, index: int) -> dict[str, str]:
    return {**job_labels(job_name), LABEL_REPLICA_TYPE: rtype.lower(), LABEL_REPLICA_INDEX: str(index)}


def replica_name(job_name: str, rtype: str, index: int) -> str:
    return f"{job_name}-{rtype.lower()}-{index}".replace("/", "-")


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_master_role(replicas: dict[str, Any], rtype: str, index: int) -> bool:
    if MASTER in replicas:
        return rtype == MASTER
    return rtype == WORKER and index == 0


def pytorch_port(job: dict[str, Any], rtype: str) -> int:
    """``pytorchjob-port`` of the replica's ``pytorch`` container (present after defaulting)."""
    containers = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"].get("containers") or []
    for c in containers:
        if c.get("name") == DEFAULT_CONTAINER:
            for port in c.get("ports") or []:
                if port.get("name") == DEFAULT_PORT_NAME:
                    return int(port["containerPort"])
    raise ValueError("port not found")


def injected_env(job: dict[str, Any], rtype: str, index: int) -> list[dict[str, str]]:
    """The env the controller appends to every container (``envvar.go``, ``master.go``, ``elastic.go``)."""
    spec = job["spec"]
    name = job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(int(r["replicas"]) for r in replicas.values())
    nproc = spec.get("nprocPerNode")
    nproc_int = int(nproc) if isinstance(nproc, str) and nproc.isdigit() else 1
    env: list[dict[str, str]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if MASTER in replicas:
        master_addr = replica_name(name, MASTER, 0)
        master_port = str(pytorch_port(job, MASTER))
        rank = str(index + 1 if rtype == WORKER else index)
        env += [
            {"name": "MASTER_PORT", "value": master_port},
            {"name": "PET_MASTER_PORT", "value": master_port},
            {"name": "MASTER_ADDR", "value": master_addr},
            {"name": "PET_MASTER_ADDR", "value": master_addr},
            {"name": "WORLD_SIZE", "value": str(total * nproc_int)},
            {"name": "RANK", "value": rank},
            {"name": "PET_NODE_RANK", "value": rank},
        ]
    if nproc is not None:
        env.append({"name": "PET_NPROC_PER_NODE", "value": str(nproc)})
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env.append({"name": "PET_NNODES", "value": str(total)})
        return env
    host = elastic.get("rdzvHost") or replica_name(name, WORKER, 0)
    port = elastic.get("rdzvPort") or pytorch_port(job, WORKER)
    env += [
        {"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{port}"},
        {"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend") or "c10d"},
        {"name": "PET_NNODES", "value": f"{elastic['minReplicas']}:{elastic['maxReplicas']}"},
    ]
    if elastic.get("maxRestarts") is not None:
        env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
    if elastic.get("nProcPerNode") is not None:
        env.append({"name": "PET_NPROC_PER_NODE", "value": str(elastic["nProcPerNode"])})
    if elastic.get("rdzvId") is not None:
        env.append({"name": "PET_RDZV_ID", "value": str(elastic["rdzvId"])})
    if elastic.get("rdzvConf") is not None:
        # The controller slices off the last comma; with an empty list that panics/garbles (see the note).
        env.append(
            {"name": "PET_RDZV_CONF", "value": ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])}
        )
    if elastic.get("standalone"):
        env.append({"name": "PET_STANDALONE", "value": ""})
    return env


def init_pytorch_container(job_name: str) -> dict[str, Any]:
    """``initcontainer.go``'s default template: wait for the master's DNS name."""
    master = replica_name(job_name, MASTER, 0)
    script = (
        f"err=1;for i in $(seq {INIT_CONTAINER_MAX_TRIES}); do if nslookup {master}; then err=0 && break; fi;"
        "echo waiting for master; sleep 2; done; exit $err"
    )
    return {
        "name": "init-pytorch",
        "image": INIT_CONTAINER_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"limits": {"cpu": "100m", "memory": "20Mi"}, "requests": {"cpu": "50m", "memory": "10Mi"}},
        "command": ["sh", "-c", script],
    }


def render_pod(job: dict[str, Any], rtype: str, index: int) -> dict[str, Any]:
    """The Pod the controller creates for replica ``rtype``/``index`` of a defaulted job."""
    name = job["metadata"]["name"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    rspec = replicas[rtype]
    template = copy.deepcopy(rspec.get("template") or {})
    tmeta = template.get("metadata") or {}
    labels = dict(tmeta.get("labels") or {})
    labels.update(replica_labels(name, rtype, index))
    if is_master_role(replicas, rtype, index):
        labels[LABEL_JOB_ROLE] = "master"
    pod_spec = template.get("spec") or {}
    env = injected_env(job, rtype, index)
    for container in pod_spec.get("containers") or []:
        container["env"] = list(container.get("env") or []) + copy.deepcopy(env)
    if rtype == WORKER and MASTER in replicas:
        pod_spec["initContainers"] = [*list(pod_spec.get("initContainers") or []), init_pytorch_container(name)]
    policy = rspec["restartPolicy"]
    pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
    metadata: dict[str, Any] = {
        "name": replica_name(name, rtype, index),
        "namespace": job["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(job)],
    }
    if tmeta.get("annotations"):
        metadata["annotations"] = dict(tmeta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def render_service(job: dict[str, Any], rtype: str, index: int) -> dict[str, Any]:
    """The headless Service per pod: selector = job, type and index labels; ports = the ``pytorch`` container's
    named ports."""
    name = job["metadata"]["name"]
    labels = replica_labels(name, rtype, index)
    ports: dict[str, int] = {}
    pod_spec = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]
    for c in pod_spec.get("containers") or []:
        if c.get("name") == DEFAULT_CONTAINER:
            for port in c.get("ports") or []:
                if port.get("name"):
                    ports[port["name"]] = int(port["containerPort"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": replica_name(name, rtype, index),
            "namespace": job["metadata"]["namespace"],
            "labels": dict(labels),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": dict(labels),
            "ports": [{"name": n, "port": p} for n, p in sorted(ports.items())],
        },
    }


# ----------------------------------------------------------------------------------------------------------------
# Conditions (pure; ``pkg/util/status.go``)
# ----------------------------------------------------------------------------------------------------------------


def condition_true(status: dict[str, Any], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in status.get("conditions") or [])


def is_finished(status: dict[str, Any]) -> bool:
    return condition_true(status, "Succeeded") or condition_true(status, "Failed")


def set_condition(status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str, now: str) -> None:
    """``UpdateJobConditions``: nothing changes once Failed; Running and Restarting replace each other; a finished
    job's Running condition turns False."""
    if condition_true(status, "Failed"):
        return
    conditions = status.get("conditions") or []
    current = next((c for c in conditions if c.get("type") == ctype), None)
    if current is not None and current.get("status") == cstatus and current.get("reason") == reason:
        return
    new = {
        "type": ctype,
        "status": cstatus,
        "reason": reason,
        "message": message,
        "lastUpdateTime": now,
        "lastTransitionTime": now,
    }
    if current is not None and current.get("status") == cstatus:
        new["lastTransitionTime"] = current.get("lastTransitionTime", now)
    kept = []
    for c in conditions:
        if c.get("type") == ctype:
            continue
        if {ctype, c.get("type")} == {"Running", "Restarting"}:
            continue
        if ctype in ("Failed", "Succeeded") and c.get("type") == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    status["conditions"] = [*kept, new]


def reason(ctype: str) -> str:
    return f"{KIND}{ctype}"


# ----------------------------------------------------------------------------------------------------------------
# The reconcile decision (pure)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class JobEvent:
    type: str
    reason: str
    message: str
    once_key: str | None = None  # events that would repeat on every pass are emitted once per key


@dataclass
class Plan:
    """What one reconcile pass decided: the new status and the API writes that get there."""

    status: dict[str, Any]
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    create_services: list[dict[str, Any]] = field(default_factory=list)
    delete_services: list[str] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def pytorch_exit_code(pod: dict[str, Any]) -> int | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == DEFAULT_CONTAINER and (cs.get("state") or {}).get("terminated"):
            return int(cs["state"]["terminated"]["exitCode"])
    return None


def count_replica(counts: dict[str, int], pod: dict[str, Any]) -> None:
    """``UpdateJobReplicaStatuses``: Running counts as active (or failed while being deleted)."""
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Running":
        key = "failed" if pod["metadata"].get("deletionTimestamp") else "active"
        counts[key] += 1
    elif phase == "Succeeded":
        counts["succeeded"] += 1
    elif phase == "Failed":
        counts["failed"] += 1


def label_selector(job_name: str, rtype: str) -> str:
    labels = {**job_labels(job_name), LABEL_REPLICA_TYPE: rtype.lower()}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def cleanup_targets(policy: str, pods: list[dict[str, Any]], job_finished: bool) -> list[str]:
    """``DeletePodsAndServices``: cleanPodPolicy applies to finished jobs; otherwise (suspend) everything goes."""
    names = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        phase = (pod.get("status") or {}).get("phase")
        if job_finished:
            if policy == "None":
                continue
            if policy == "Running" and phase not in ("Running", "Pending"):
                continue
        names.append(pod["metadata"]["name"])
    return names


def abnormal_pod_events(pods: list[dict[str, Any]]) -> list[JobEvent]:
    """``RecordAbnormalPods``: Warnings named after waiting/terminated reasons of active pods' containers."""
    events = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        statuses = status.get("containerStatuses") or status.get("initContainerStatuses") or []
        for cs in statuses:
            state = cs.get("state") or {}
            term, wait = state.get("terminated"), state.get("waiting")
            if term and term.get("exitCode", 0) != 0:
                msg = (
                    f"Error pod {name} container {cs['name']} exitCode: {term['exitCode']} "
                    f"terminated message: {term.get('message', '')}"
                )
                events.append(
                    JobEvent("Warning", term.get("reason") or "Error", msg, f"{pod['metadata']['uid']}/{msg}")
                )
            if wait and wait.get("message"):
                msg = f"Error pod {name} container {cs['name']} waiting message: {wait['message']}"
                events.append(
                    JobEvent("Warning", wait.get("reason") or "Waiting", msg, f"{pod['metadata']['uid']}/{msg}")
                )
        if not statuses:
            conditions = sorted(
                status.get("conditions") or [], key=lambda c: c.get("lastTransitionTime") or "", reverse=True
            )
            if conditions and conditions[0].get("status") != "True":
                cond = conditions[0]
                msg = f"Error pod {name} condition message: {cond.get('message', '')}"
                events.append(JobEvent("Warning", cond.get("reason") or "", msg, f"{pod['metadata']['uid']}/{msg}"))
    return events


def past_backoff_limit(replicas: dict[str, Any], pods: list[dict[str, Any]], limit: int) -> bool:
    """``PastBackoffLimit``: restartCounts of Running pods of OnFailure/Always/ExitCode replicas."""
    total = 0
    for rtype, rspec in replicas.items():
        if rspec["restartPolicy"] not in ("OnFailure", "Always", "ExitCode"):
            continue
        for pod in pods:
            if pod["metadata"]["labels"].get(LABEL_REPLICA_TYPE) != rtype.lower():
                continue
            status = pod.get("status") or {}
            if status.get("phase") != "Running":
                continue
            for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
                total += int(cs.get("restartCount") or 0)
    return total > 0 if limit == 0 else total >= limit


def reconcile_job(
    raw_job: dict[str, Any], pods: list[dict[str, Any]], services: list[dict[str, Any]], now: float
) -> Plan:
    """One pass of ``ReconcileJobs`` + ``UpdateJobStatus`` for a live (not deleted) job, without I/O.

    ``pods``/``services`` are those the job controls. The returned plan's ``status`` is the complete new status.
    """
    job = apply_defaults(raw_job)
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    stamp = to_rfc3339(now)
    status = copy.deepcopy(raw_job.get("status") or {})
    status.setdefault("conditions", [])
    plan = Plan(status=status)
    if not status["conditions"]:
        # onOwnerCreateFunc sets Created in memory; it is persisted with the first status write.
        set_condition(status, "Created", "True", reason("Created"), f"{KIND} {name} is created.", stamp)

    errors = validate_job(raw_job)
    if errors:
        message = f"{KIND} {name} is invalid (a real cluster's admission webhook rejects it): " + "; ".join(errors)
        plan.events.append(JobEvent("Warning", reason("FailedValidation"), message, "validation"))
        set_condition(status, "Failed", "True", reason("FailedValidation"), message, stamp)
        return plan

    spec = job["spec"]
    replicas: dict[str, Any] = spec["pytorchReplicaSpecs"]
    run_policy = spec["runPolicy"]
    clean_policy = run_policy.get("cleanPodPolicy") or "None"

    def delete_with_services(names: list[str]) -> None:
        existing = {s["metadata"]["name"] for s in services if not s["metadata"].get("deletionTimestamp")}
        plan.delete_pods.extend(names)
        plan.delete_services.extend(n for n in names if n in existing)

    if is_finished(status):
        delete_with_services(cleanup_targets(clean_policy, pods, job_finished=True))
        if condition_true(status, "Succeeded"):
            for counts in (status.get("replicaStatuses") or {}).values():
                counts["succeeded"] = counts.get("succeeded", 0) + counts.get("active", 0)
                counts["active"] = 0
        ttl = run_policy.get("ttlSecondsAfterFinished")
        if ttl is not None:
            if not status.get("completionTime"):
                # The ExitCode permanent-failure path leaves completionTime nil; the real CleanupJob errors here.
                log.warning("job %s/%s: completion time is nil, cannot clean up (TTL)", namespace, name)
            else:
                expire = from_rfc3339(status["completionTime"]) + float(ttl)
                if now >= expire:
                    plan.delete_job = True
                else:
                    plan.requeue_after = expire - now
        return plan

    if run_policy.get("suspend"):
        delete_with_services(cleanup_targets(clean_policy, pods, job_finished=False))
        for counts in (status.get("replicaStatuses") or {}).values():
            counts["active"] = 0
        message = f"{KIND} {name} is suspended."
        if condition_true(status, "Running"):
            set_condition(status, "Running", "False", reason("Suspended"), message, stamp)
        if not condition_true(status, "Suspended"):
            set_condition(status, "Suspended", "True", reason("Suspended"), message, stamp)
            plan.events.append(JobEvent("Normal", reason("Suspended"), message))
        return plan
    if condition_true(status, "Suspended"):
        message = f"{KIND} {name} is resumed."
        set_condition(status, "Suspended", "False", reason("Resumed"), message, stamp)
        status["startTime"] = stamp
        plan.events.append(JobEvent("Normal", reason("Resumed"), message))

    plan.events.extend(abnormal_pod_events(pods))

    # Backoff limit and active deadline.
    failure: str | None = None
    backoff_limit = run_policy.get("backoffLimit")
    if backoff_limit is not None:
        active = sum(
            1
            for p in pods
            if (p.get("status") or {}).get("phase") in ("Pending", "Running")
            and not p["metadata"].get("deletionTimestamp")
        )
        failed = sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Failed")
        total = sum(int(r["replicas"]) for r in replicas.values())
        previously_failed = sum(int(c.get("failed", 0)) for c in (status.get("replicaStatuses") or {}).values())
        # The real work queue never counts requeues (FakeWorkQueue), so a "new failure" exceeds only a limit of 0.
        exceeds = failed > previously_failed and active != total and int(backoff_limit) < 0 + 1
        if exceeds or past_backoff_limit(replicas, pods, int(backoff_limit)):
            failure = f"Job {name} has failed because it has reached the specified backoff limit"
    deadline = run_policy.get("activeDeadlineSeconds")
    if failure is None and deadline is not None and status.get("startTime"):
        expire = from_rfc3339(status["startTime"]) + float(deadline)
        if now >= expire:
            failure = f"Job {name} has failed because it was active longer than specified deadline"
        else:
            plan.requeue_after = expire - now
    if failure is not None:
        status.setdefault("completionTime", stamp)
        plan.events.append(JobEvent("Normal", reason("Failed"), failure))
        set_condition(status, "Failed", "True", reason("Failed"), failure, stamp)
        # Since 1.9.4 (#3419) the cleanup after a backoff/deadline failure follows cleanPodPolicy.
        delete_with_services(cleanup_targets(clean_policy, pods, job_finished=True))
        return plan

    for rtype in REPLICA_TYPES:
        if rtype in replicas:
            reconcile_replica_pods(job, rtype, pods, status, plan, stamp)
            reconcile_replica_services(job, rtype, services, plan)
    update_job_status(job, status, plan, stamp)
    return plan


def reconcile_replica_pods(
    job: dict[str, Any], rtype: str, pods: list[dict[str, Any]], status: dict[str, Any], plan: Plan, stamp: str
) -> None:
    """``ReconcilePods`` for one replica type: create missing pods, delete surplus ones, restart failed ones."""
    name = job["metadata"]["name"]
    rspec = job["spec"]["pytorchReplicaSpecs"][rtype]
    policy = rspec["restartPolicy"]
    wanted = int(rspec["replicas"])
    counts = {"active": 0, "succeeded": 0, "failed": 0}
    status.setdefault("replicaStatuses", {})[rtype] = counts
    by_index: dict[int, list[dict[str, Any]]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LABEL_REPLICA_TYPE) != rtype.lower():
            continue
        try:
            by_index.setdefault(int(labels.get(LABEL_REPLICA_INDEX, "")), []).append(pod)
        except ValueError:
            log.warning("pod %s has no valid replica index", pod["metadata"]["name"])
    for index in range(max([wanted, *(i + 1 for i in by_index)])):
        slot = by_index.get(index, [])
        if len(slot) > 1:
            log.warning("job %s: too many pods for %s %d", name, rtype, index)
            continue
        if not slot:
            if index < wanted:
                plan.create_pods.append(render_pod(job, rtype, index))
            continue
        pod = slot[0]
        pod_name = pod["metadata"]["name"]
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if index >= wanted and not deleting:
            plan.delete_pods.append(pod_name)
        code = pytorch_exit_code(pod)
        if code is not None:
            plan.events.append(
                JobEvent(
                    "Normal",
                    "ExitedWithCode",
                    f"Pod: {pod['metadata']['namespace']}.{pod_name} exited with code {code}",
                    f"exit/{pod['metadata']['uid']}/{code}",
                )
            )
        exit_code = NOT_TERMINATED if code is None else code
        failed = (pod.get("status") or {}).get("phase") == "Failed"
        retryable = exit_code >= 128
        if failed and (policy in ("OnFailure", "Always") or (policy == "ExitCode" and retryable)):
            if not deleting:
                plan.delete_pods.append(pod_name)
            message = f"job {name} is restarting because {rtype} replica(s) failed."
            plan.events.append(JobEvent("Warning", reason("Restarting"), message, f"restart/{pod['metadata']['uid']}"))
            set_condition(status, "Restarting", "True", reason("Restarting"), message, stamp)
        elif failed and policy == "ExitCode":
            message = f'job "{name}" is failing because "{rtype}" replica(s) failed.'
            plan.events.append(JobEvent("Warning", reason("Failed"), message, "failed"))
            set_condition(status, "Failed", "True", reason("Failed"), message, stamp)
        count_replica(counts, pod)


def reconcile_replica_services(job: dict[str, Any], rtype: str, services: list[dict[str, Any]], plan: Plan) -> None:
    """``ReconcileServices``: one headless Service per wanted index; surplus ones go."""
    wanted = int(job["spec"]["pytorchReplicaSpecs"][rtype]["replicas"])
    existing: dict[int, dict[str, Any]] = {}
    for svc in services:
        labels = svc["metadata"].get("labels") or {}
        if labels.get(LABEL_REPLICA_TYPE) == rtype.lower() and labels.get(LABEL_REPLICA_INDEX, "").isdigit():
            existing[int(labels[LABEL_REPLICA_INDEX])] = svc
    for index in range(wanted):
        if index not in existing:
            plan.create_services.append(render_service(job, rtype, index))
    for index, svc in existing.items():
        if index >= wanted and not svc["metadata"].get("deletionTimestamp"):
            plan.delete_services.append(svc["metadata"]["name"])


def update_job_status(job: dict[str, Any], status: dict[str, Any], plan: Plan, stamp: str) -> None:
    """``UpdateJobStatus``: the Master decides when present; otherwise all Workers, or any one if elastic."""
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    elastic = job["spec"].get("elasticPolicy") is not None
    if not status.get("startTime"):
        status["startTime"] = stamp
    for rtype in REPLICA_TYPES:
        if rtype not in replicas:
            continue
        counts = status["replicaStatuses"][rtype]
        counts["selector"] = label_selector(name, rtype)
        wanted = int(replicas[rtype]["replicas"])
        succeeded, running, failed = counts["succeeded"], counts["active"], counts["failed"]
        expected = wanted - succeeded
        if MASTER in replicas:
            if rtype == MASTER:
                if running > 0:
                    set_condition(status, "Running", "True", reason("Running"), f"{KIND} {name} is running.", stamp)
                if expected == 0:
                    finish_succeeded(status, plan, f"{KIND} {name} is successfully completed.", stamp)
                    return
        elif rtype == WORKER:
            if expected == 0 or (elastic and succeeded > 0):
                finish_succeeded(status, plan, f"{KIND} {namespace}/{name} successfully completed.", stamp)
                return
            if running > 0:
                set_condition(
                    status, "Running", "True", reason("Running"), f"{KIND} {namespace}/{name} is running.", stamp
                )
        if failed > 0 and wanted > succeeded + running:
            if replicas[rtype]["restartPolicy"] != "Never":
                message = f"{KIND} {name} is restarting because {failed} {rtype} replica(s) failed."
                plan.events.append(JobEvent("Warning", reason("Restarting"), message, f"restarting/{message}"))
                set_condition(status, "Restarting", "True", reason("Restarting"), message, stamp)
            else:
                message = f"{KIND} {name} is failed because {failed} {rtype} replica(s) failed."
                plan.events.append(JobEvent("Normal", reason("Failed"), message, "failed"))
                if not status.get("completionTime"):
                    status["completionTime"] = stamp
                set_condition(status, "Failed", "True", reason("Failed"), message, stamp)


def finish_succeeded(status: dict[str, Any], plan: Plan, message: str, stamp: str) -> None:
    plan.events.append(JobEvent("Normal", reason("Succeeded"), message, "succeeded"))
    if not status.get("completionTime"):
        status["completionTime"] = stamp
    set_condition(status, "Succeeded", "True", reason("Succeeded"), message, stamp)


# ----------------------------------------------------------------------------------------------------------------
# List + watch
# ----------------------------------------------------------------------------------------------------------------


class Informer:
    """A dict cache of one resource kind kept by list + watch; relists on 410 Gone and after errors.

    Objects are plain dicts: the client's models drop unknown fields and cannot represent custom resources.
    ``on_change(kind, obj)`` is called for every ADDED/MODIFIED/DELETED (relists report vanished objects as DELETED).
    """

    def __init__(
        self, name: str, list_fn: Callable[..., Any], on_change: Callable[[str, dict[str, Any]], None], **kwargs: Any
    ):
        self.name = name
        self.list_fn = list_fn
        self.on_change = on_change
        self.kwargs = kwargs
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str], dict[str, Any]] = {}
        # UIDs seen DELETED: a write response that arrives after the watch event must not resurrect the object.
        self.deleted: dict[str, float] = {}
        # The list + watch loop; this class adds the cache the reconciler reads (and its own writes go into).
        self._watch = ListWatch(name, list_fn, self._apply, self._relist, **kwargs)
        self.synced = self._watch.synced

    def items(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.cache.values())

    def put(self, obj: dict[str, Any]) -> None:
        """Record our own write at once, so the next reconcile does not repeat it (the controller's expectations)."""
        meta = obj["metadata"]
        with self.lock:
            if meta.get("uid") in self.deleted:
                return
            self.cache[(meta.get("namespace", ""), meta["name"])] = obj

    def drop(self, namespace: str, name: str) -> None:
        with self.lock:
            self.cache.pop((namespace, name), None)

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        with self.lock:
            if kind == "DELETED":
                now = time.monotonic()
                self.deleted[meta.get("uid", "")] = now
                if len(self.deleted) > 10_000:
                    self.deleted = {u: t for u, t in self.deleted.items() if now - t < 600}
                current = self.cache.get(key)
                if current is not None and current["metadata"].get("uid") == meta.get("uid"):
                    del self.cache[key]
            else:
                self.cache[key] = obj
        self.on_change(kind, obj)

    def _relist(self, items: list[dict[str, Any]]) -> None:
        seen = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in items}
        with self.lock:
            vanished = [o for k, o in self.cache.items() if k not in seen]
        for obj in vanished:
            self._apply("DELETED", obj)
        for obj in items:
            self._apply("MODIFIED", obj)

    def run(self, stop: threading.Event) -> None:
        self._watch.run(stop)


class WorkQueue:
    """Deduplicating queue of job keys with delayed adds; one worker drains it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: dict[tuple[str, str], None] = {}
        self._delayed: list[tuple[float, tuple[str, str]]] = []

    def add(self, key: tuple[str, str], after: float = 0.0) -> None:
        with self._cond:
            if after > 0:
                heapq.heappush(self._delayed, (time.monotonic() + after, key))
            else:
                self._ready[key] = None
            self._cond.notify()

    def get(self, stop: threading.Event) -> tuple[str, str] | None:
        with self._cond:
            while not stop.is_set():
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    self._ready[heapq.heappop(self._delayed)[1]] = None
                if self._ready:
                    key = next(iter(self._ready))
                    del self._ready[key]
                    return key
                timeout = self._delayed[0][0] - now if self._delayed else 1.0
                self._cond.wait(timeout=min(timeout, 1.0))
        return None


# ----------------------------------------------------------------------------------------------------------------
# The operator (I/O)
# ----------------------------------------------------------------------------------------------------------------


class Operator:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.stop = threading.Event()
        self.queue = WorkQueue()
        selector = f"{LABEL_OPERATOR}={CONTROLLER_NAME}"
        self.jobs = Informer("pytorchjobs", self._list_jobs, self._on_job)
        self.pods = Informer("pods", self.core.list_pod_for_all_namespaces, self._on_dependent, label_selector=selector)
        self.services = Informer(
            "services", self.core.list_service_for_all_namespaces, self._on_dependent, label_selector=selector
        )
        self._emitted: set[tuple[str, str]] = set()  # (job uid, once_key) of events that would otherwise repeat

    def _list_jobs(self, **kwargs: Any) -> Any:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)

    # -- event handlers (informer threads) ------------------------------------------------------------------------

    def _on_job(self, kind: str, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        if kind == "DELETED":
            threading.Thread(
                target=self.collect_garbage, args=(meta["namespace"], meta["uid"]), daemon=True, name="gc"
            ).start()
            return
        self.queue.add((meta["namespace"], meta["name"]))

    def _on_dependent(self, kind: str, obj: dict[str, Any]) -> None:
        job_name = (obj["metadata"].get("labels") or {}).get(LABEL_JOB_NAME)
        if job_name:
            self.queue.add((obj["metadata"]["namespace"], job_name))

    # -- reconcile (worker thread) --------------------------------------------------------------------------------

    def reconcile(self, key: tuple[str, str]) -> None:
        namespace, _name = key
        with self.jobs.lock:
            job = self.jobs.cache.get(key)
        if job is None:
            return
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            self.finalize_deleted_job(job)
            return
        uid = meta["uid"]
        pods = [p for p in self.pods.items() if p["metadata"]["namespace"] == namespace and controlled_by(p, uid)]
        services = [
            s for s in self.services.items() if s["metadata"]["namespace"] == namespace and controlled_by(s, uid)
        ]
        plan = reconcile_job(job, pods, services, time.time())
        self.execute(job, plan)

    def execute(self, job: dict[str, Any], plan: Plan) -> None:
        meta = job["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        for event in plan.events:
            self.emit_once(job, event)
        for pod_name in plan.delete_pods:
            self._delete("pod", namespace, pod_name, job)
        for svc_name in plan.delete_services:
            self._delete("service", namespace, svc_name, job)
        for pod in plan.create_pods:
            template_policy = (
                ((job["spec"]["pytorchReplicaSpecs"].get(_rtype_of(pod)) or {}).get("template") or {})
                .get("spec", {})
                .get("restartPolicy")
            )
            if template_policy:
                self.emit_once(
                    job,
                    JobEvent(
                        "Warning",
                        "SetPodTemplateRestartPolicy",
                        "Restart policy in pod template will be overwritten by restart policy in replica spec",
                        "template-restart-policy",
                    ),
                )
            self._create("pod", namespace, pod, job)
        for svc in plan.create_services:
            self._create("service", namespace, svc, job)
        if plan.status != (job.get("status") or {}) or not job.get("status"):
            try:
                resp = self.custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    {"metadata": {"uid": uid}, "status": plan.status},
                    _content_type=PATCH_MERGE,
                    _preload_content=False,
                )
                self.jobs.put(json.loads(resp.data))
            except ApiException as err:
                if err.status not in (404, 409, 422):
                    raise
        if plan.delete_job:
            log.info("job %s/%s: TTL after finished expired; deleting it", namespace, name)
            try:
                self.custom.delete_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    body={"preconditions": {"uid": uid}},
                    _preload_content=False,
                )
                self._record(job, "Normal", "SuccessfulDeletePod", f"Deleted job: {name}")
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
        if plan.requeue_after is not None:
            self.queue.add((namespace, name), after=plan.requeue_after + 0.05)
        if plan.create_pods or plan.delete_pods or plan.create_services or plan.delete_services:
            # Status follows from the pods we just changed: look again soon, without waiting for the resync.
            self.queue.add((namespace, name), after=0.2)

    def _create(self, what: str, namespace: str, obj: dict[str, Any], job: dict[str, Any]) -> None:
        create = self.core.create_namespaced_pod if what == "pod" else self.core.create_namespaced_service
        informer = self.pods if what == "pod" else self.services
        try:
            resp = create(namespace, obj, _preload_content=False)
        except ApiException as err:
            if err.status == 409:  # a predecessor of the same name is still terminating
                return
            self._record(job, "Warning", f"FailedCreate{what.capitalize()}", f"Error creating: {err.reason}")
            raise
        informer.put(json.loads(resp.data))
        self._record(
            job, "Normal", f"SuccessfulCreate{what.capitalize()}", f"Created {what}: {obj['metadata']['name']}"
        )

    def _delete(self, what: str, namespace: str, name: str, job: dict[str, Any] | None) -> None:
        informer = self.pods if what == "pod" else self.services
        delete = self.core.delete_namespaced_pod if what == "pod" else self.core.delete_namespaced_service
        try:
            resp = delete(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                informer.drop(namespace, name)
                return
            raise
        obj = json.loads(resp.data)
        if obj.get("kind") == "Pod" and obj.get("metadata", {}).get("deletionTimestamp"):
            informer.put(obj)  # graceful: the pod stays (terminating) until the kubelet removes it
        else:
            informer.drop(namespace, name)
        if job is not None:
            self._record(job, "Normal", f"SuccessfulDelete{what.capitalize()}", f"Deleted {what}: {name}")

    # -- garbage collection ---------------------------------------------------------------------------------------

    def _dependents(self, namespace: str, uid: str) -> list[tuple[str, dict[str, Any]]]:
        found: list[tuple[str, dict[str, Any]]] = []
        listers: list[tuple[str, Callable[..., Any]]] = [
            ("pod", self.core.list_namespaced_pod),
            ("service", self.core.list_namespaced_service),
            ("configmap", self.core.list_namespaced_config_map),
            ("secret", self.core.list_namespaced_secret),
        ]
        for what, lister in listers:
            items = json.loads(lister(namespace, _preload_content=False).data).get("items") or []
            for obj in items:
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                    found.append((what, obj))
        return found

    def _delete_dependent(self, what: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if what in ("pod", "service"):
            self._delete(what, meta["namespace"], meta["name"], None)
            return
        delete = self.core.delete_namespaced_config_map if what == "configmap" else self.core.delete_namespaced_secret
        try:
            delete(meta["name"], meta["namespace"], _preload_content=False)
        except ApiException as err:
            if err.status != 404:
                raise

    def collect_garbage(self, namespace: str, uid: str) -> int:
        """Delete what the job with ``uid`` owned (the GC's background propagation); returns what is still there."""
        remaining = 0
        try:
            for what, obj in self._dependents(namespace, uid):
                remaining += 1
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete_dependent(what, obj)
        except Exception as err:
            log.warning("garbage collection for %s in %s failed: %s", uid, namespace, err)
            return -1
        return remaining

    def finalize_deleted_job(self, job: dict[str, Any]) -> None:
        """Foreground/orphan deletion of a job: the GC's part, then its finalizer goes."""
        meta = job["metadata"]
        finalizers = meta.get("finalizers") or []
        namespace, uid = meta["namespace"], meta["uid"]
        if "foregroundDeletion" in finalizers:
            if self.collect_garbage(namespace, uid) != 0:
                self.queue.add((namespace, meta["name"]), after=1.0)
                return
            self._remove_finalizer(job, "foregroundDeletion")
        elif "orphan" in finalizers:
            for what, obj in self._dependents(namespace, uid):
                refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
                patch = {"metadata": {"ownerReferences": refs or None}}
                patcher = {
                    "pod": self.core.patch_namespaced_pod,
                    "service": self.core.patch_namespaced_service,
                    "configmap": self.core.patch_namespaced_config_map,
                    "secret": self.core.patch_namespaced_secret,
                }[what]
                patcher(obj["metadata"]["name"], namespace, patch, _content_type=PATCH_MERGE, _preload_content=False)
            self._remove_finalizer(job, "orphan")

    def _remove_finalizer(self, job: dict[str, Any], finalizer: str) -> None:
        meta = job["metadata"]
        rest = [f for f in meta.get("finalizers") or [] if f != finalizer]
        try:
            self.custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                meta["namespace"],
                PLURAL,
                meta["name"],
                {"metadata": {"finalizers": rest or None, "uid": meta["uid"]}},
                _content_type=PATCH_MERGE,
                _preload_content=False,
            )
        except ApiException as err:
            if err.status not in (404, 409, 422):
                raise

    def sweep_orphans(self) -> None:
        """Delete dependents of PyTorchJobs that no longer exist (deleted while this process was not watching)."""
        live = {j["metadata"]["uid"] for j in self.jobs.items()}
        candidates: dict[tuple[str, str, str], None] = {}
        for lister in (
            self.core.list_pod_for_all_namespaces,
            self.core.list_service_for_all_namespaces,
            self.core.list_config_map_for_all_namespaces,
            self.core.list_secret_for_all_namespaces,
        ):
            for obj in json.loads(lister(_preload_content=False).data).get("items") or []:
                for ref in obj["metadata"].get("ownerReferences") or []:
                    if (
                        ref.get("kind") == KIND
                        and ref.get("apiVersion", "").startswith(GROUP)
                        and ref["uid"] not in live
                    ):
                        candidates[(obj["metadata"]["namespace"], ref["name"], ref["uid"])] = None
        for namespace, job_name, uid in candidates:
            # The job may be newer than our cache: ask before deleting anything.
            try:
                current = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job_name)
                if current["metadata"]["uid"] == uid:
                    continue
            except ApiException as err:
                if err.status != 404:
                    continue
            log.info("collecting dependents of deleted job %s/%s (%s)", namespace, job_name, uid)
            self.collect_garbage(namespace, uid)

    # -- events ---------------------------------------------------------------------------------------------------

    def emit_once(self, job: dict[str, Any], event: JobEvent) -> None:
        if event.once_key is not None:
            key = (job["metadata"]["uid"], event.once_key)
            if key in self._emitted:
                return
            self._emitted.add(key)
        self._record(job, event.type, event.reason, event.message)

    def _record(self, job: dict[str, Any], event_type: str, event_reason: str, message: str) -> None:
        meta = job["metadata"]
        now = to_rfc3339(time.time())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "reason": event_reason,
            "message": message,
            "type": event_type,
            "source": {"component": CONTROLLER_NAME},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": CONTROLLER_NAME,
            "reportingInstance": "",
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
        except Exception as err:  # events are best effort, as in client-go's recorder
            log.debug("event %s not recorded: %s", event_reason, err)

    # -- threads --------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self.stop.is_set():
            key = self.queue.get(self.stop)
            if key is None:
                continue
            try:
                self.reconcile(key)
            except Exception as err:
                log.warning("reconcile %s/%s failed: %s; retrying", key[0], key[1], err)
                self.queue.add(key, after=1.0)

    def _resync(self) -> None:
        last_sweep = 0.0
        while not self.stop.wait(RESYNC_SECONDS):
            for job in self.jobs.items():
                self.queue.add((job["metadata"]["namespace"], job["metadata"]["name"]))
            if time.monotonic() - last_sweep >= SWEEP_SECONDS:
                last_sweep = time.monotonic()
                try:
                    self.sweep_orphans()
                except Exception as err:
                    log.warning("orphan sweep failed: %s", err)

    def run(self) -> None:
        for informer in (self.pods, self.services, self.jobs):
            threading.Thread(target=informer.run, args=(self.stop,), name=f"watch-{informer.name}", daemon=True).start()
        for informer in (self.pods, self.services, self.jobs):
            while not informer.synced.wait(1.0):
                if self.stop.is_set():
                    return
        log.info("caches synced; reconciling")
        threading.Thread(target=self._resync, name="resync", daemon=True).start()
        self._work()


def _rtype_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][LABEL_REPLICA_TYPE]).capitalize()


def build_api_client(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 16  # three watches, the worker and the sweeper share the pool
    return client.ApiClient(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s sim-operator %(levelname)s %(message)s"
    )
    operator = Operator(build_api_client(args.kubeconfig))

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        operator.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    operator.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

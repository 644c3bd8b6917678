"""A simulated Kubeflow training operator (v1.9) for PyTorchJobs, plus the garbage collector the cluster lacks.

Run it as ``python -m tests.cluster.sim_operator --kubeconfig PATH``. It is an ordinary API client (list + watch,
create, delete, merge-patch of ``/status``), so it runs unchanged against any API server. The admission webhook that
rejects invalid jobs is a separate process, ``tests.cluster.sim_webhook``.

It follows the real controller (kubeflow/trainer v1.9.4, branch ``release-1.9``; see
``../shared/notes/pytorchjob-controller.md``); ``file:line`` references below are in that tree:

* In-memory defaults on every reconcile (never written back): restartPolicy OnFailure, replicas 1, nprocPerNode
  ``auto``, elastic min/max, cleanPodPolicy None, the ``pytorchjob-port`` 23456 port on the ``pytorch`` container.
* Pods ``<job>-<master|worker>-<i>`` and headless Services of the same name, with the real labels, controller
  ownerReferences, restartPolicy from the replica (ExitCode -> Never), the injected env (Master, elastic and
  worker-only modes) and the ``init-pytorch`` init container on Workers when a Master exists.
* Every port of the ``pytorch`` container becomes a Service port, unnamed ones too (``pkg/core/service.go:83-99``,
  a name -> port map, so two unnamed ports collapse into one). With the default port added that is always two or
  more ports, and the API server rejects a Service with an unnamed one among several (422): the create fails with
  a ``FailedCreateService`` Warning, the pass ends there without a status write, and the job never progresses.
* Which pods and Services a job has (``pytorchjob_controller.go:281-314``): the pods with the job-name and
  operator-name labels **and** a controller ownerReference to the job (``JobControlledPodList``,
  ``pkg/common/util/util.go:43-55``); the Services with those labels, whoever owns them. The PyTorch reconciler
  overrides ``JobController.GetPodsForJob``/``GetServicesForJob`` (``common/pod.go:219-254``, which adopt orphans
  through ClaimPods), so **nothing is ever adopted**: an orphan pod is ignored (and blocks the create of a pod of
  the same name: 409, a ``FailedCreatePod`` Warning, retried with backoff), a labelled orphan Service counts as the
  job's. Dependents' events wake only the job named by their controller ownerReference
  (``EnqueueRequestForOwner(OnlyControllerOwner)``, ``pytorchjob_controller.go:198-207``).
* Replica types are visited in random order, as Go iterates a map: once for pods/Services (``common/job.go:338``)
  and once more for the status decision (``pytorchjob_controller.go:369``). So with a Master, the Master's success
  and a Worker's failure (restartPolicy Never) in the same pass give Succeeded or Failed depending on the order.
  The running operator draws the order from ``random.Random(seed)``; the seed is ``TORCHELASTIC_SIM_SEED`` if set,
  else random, and is logged at start (``replica order seed: N``).
* ``.status`` through the ``/status`` subresource: conditions Created, Running, Restarting, Succeeded, Failed,
  Suspended (reasons ``PyTorchJob<Type>``, the real messages), replicaStatuses recounted from the pods, startTime,
  completionTime; restarts by deleting and recreating failed pods; ExitCode (1-127 permanent, >=128 retryable);
  backoffLimit; cleanPodPolicy; ttlSecondsAfterFinished; suspend/resume.
* Worker-only elastic success does not end the pass: the failure check still runs for the Worker
  (``pytorchjob_controller.go:409-443``), so under restartPolicy Never one Worker succeeded and another failed in
  the same pass leaves both Succeeded and Failed True. With a Master, the Master's success returns at once
  (``:400``), so only replica types visited before it can add Failed.
* activeDeadlineSeconds is checked only when something else causes a reconcile (``common/job.go:211``); the
  re-check the real one queues at the deadline goes to a no-op ``FakeWorkQueue`` (``pytorchjob_controller.go:82,
  365``), so a quiet Running job overruns its deadline until a pod or job event arrives. There is no periodic
  recheck: the only resync is the informers' (controller-runtime's default ``SyncPeriod``, 10 h).
* A backoffLimit/activeDeadlineSeconds failure with ``ttlSecondsAfterFinished: 0`` deletes the job before its
  Failed condition is written (``CleanupJob`` at ``common/job.go:233`` runs before the status update at ``:247``),
  so watchers see the job vanish without ever seeing Failed. The TTL of a job that finished otherwise is applied
  on the next pass, after the Succeeded/Failed status was written.
* Events on the job: pod/service creation and deletion (and their failures), ExitedWithCode, Restarting,
  Succeeded/Failed, and Warnings named after container waiting/terminated reasons of active pods
  (ImagePullBackOff, CreateContainerConfigError, ...).
* Failed reconciles are retried with controller-runtime's per-item exponential backoff (5 ms doubling, at most
  1000 s), reset by a successful pass.

It differs from the real one in what it leaves out or simplifies: no validation (the webhook does that at
admission; a job that got past it is reconciled as it is), no HPA, gang scheduling, PodGroups, metrics or
``managedBy`` handling; no expectations (its own writes go into its caches at once instead); events are recorded
once per distinct occurrence rather than aggregated with counts by client-go's correlator; Service ports are sorted
by name (Go's map order is random); its caches are plain list + watch loops.

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
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
REPLICA_TYPES = (MASTER, WORKER)  # the pure functions' default order; the running operator shuffles (Go map order)
DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
DEFAULT_NPROC_PER_NODE = "auto"
INIT_CONTAINER_IMAGE = "alpine:3.10"
INIT_CONTAINER_MAX_TRIES = 100
NOT_TERMINATED = 0xBEEF  # the controller's "no exit code" marker; >= 128, so it counts as retryable

# controller-runtime's default cache SyncPeriod (the manager sets none, cmd/training-operator.v1/main.go:141): the
# only periodic reconcile of a quiet job, hence the only time its activeDeadlineSeconds is checked without an event.
RESYNC_SECONDS = 10 * 3600.0
SWEEP_SECONDS = 30.0
SEED_ENV = "TORCHELASTIC_SIM_SEED"
# workqueue.DefaultTypedControllerRateLimiter's per-item exponential backoff after a failed reconcile.
BACKOFF_BASE_SECONDS = 0.005
BACKOFF_MAX_SECONDS = 1000.0
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


def go_quote(value: str) -> str:
    """Go's ``%q`` for the strings these messages quote (ASCII; JSON's escaping agrees with Go's there)."""
    return json.dumps(value, ensure_ascii=False)


MANAGED_BY_VALUES = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


def validate_job(job: dict[str, Any], old_job: dict[str, Any] | None = None) -> list[str]:
    """The admission webhook's rules that the CRD schema does not check, with its messages.

    ``validatePyTorchJob`` (``pkg/webhooks/pytorch/pytorchjob_webhook.go:75-160``): each string is one
    ``field.Error`` as Go prints it. Replica types are visited in sorted order (Go: random map order).
    ``old_job`` is accepted for UPDATE but, as upstream (``:63``, which validates the new object against itself),
    changes nothing: ``managedBy`` immutability is never enforced.
    """
    errors: list[str] = []
    name = (job.get("metadata") or {}).get("name", "")
    name_errors = []
    if len(name) > 63:
        name_errors.append("must be no more than 63 characters")
    if not DNS1035.fullmatch(name):
        name_errors.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
            "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
            "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    if name_errors:
        errors.append(f"metadata.name: Invalid value: {go_quote(name)}: should match: {','.join(name_errors)}")
    spec = job.get("spec") or {}
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in MANAGED_BY_VALUES:
        supported = ", ".join(go_quote(v) for v in sorted(MANAGED_BY_VALUES))
        errors.append(
            f"spec.runPolicy.managedBy: Unsupported value: {go_quote(str(managed_by))}: supported values: {supported}"
        )
    replicas: dict[str, Any] | None = spec.get("pytorchReplicaSpecs")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if WORKER not in (replicas or {}):
            errors.append(
                "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used"
            )
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if replicas is None:
        errors.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for rtype, rspec in sorted((replicas or {}).items()):
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        containers_path = f"{path}.template.spec.containers"
        if rtype not in REPLICA_TYPES:
            errors.append(f'{path}: Unsupported value: {go_quote(rtype)}: supported values: "Master", "Worker"')
        if rspec is None:
            # Upstream dereferences the nil spec right after (a panic the webhook server recovers into a 500).
            raise WebhookPanic("runtime error: invalid memory address or nil pointer dereference")
        containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{containers_path}: Required value: must be specified")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{containers_path}[{i}].image: Required value: must be required")
        if not any(c.get("name") == DEFAULT_CONTAINER for c in containers):
            errors.append(
                f"{containers_path}: Required value: must have at least one container with name {DEFAULT_CONTAINER}"
            )
        count = rspec.get("replicas")
        if rtype == MASTER:
            if count != 1:
                errors.append(f"{path}.replicas: Forbidden: must be 1")
        elif count is not None and count < 1:
            errors.append(f"{path}.replicas: Forbidden: must be at least 1")
    return list(dict.fromkeys(errors))  # ErrorList.ToAggregate drops duplicate messages


def validation_warnings(job: dict[str, Any]) -> list[str]:
    """The webhook's admission warnings (``pytorchjob_webhook.go:101-104``)."""
    elastic = (job.get("spec") or {}).get("elasticPolicy") or {}
    if elastic.get("nProcPerNode") is not None:
        return ["spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead"]
    return []


def aggregate_message(errors: list[str]) -> str:
    """``utilerrors.Aggregate.Error()``: one message as is, several as ``[a, b]``."""
    return errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"


class WebhookPanic(Exception):
    """What would panic in the Go webhook; controller-runtime recovers it into an errored (500) response."""


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
    """The headless Service per pod (``CreateNewService``, ``common/service.go:211-252``): selector = job, type and
    index labels; ports = every port of the ``pytorch`` container, named or not (``GetPortsFromJob``,
    ``pkg/core/service.go:83-99``: a name -> port map, so an unnamed port keeps its empty name and two unnamed ports
    collapse into the last one). Sorted by name here; Go's map order is random."""
    name = job["metadata"]["name"]
    labels = replica_labels(name, rtype, index)
    ports: dict[str, int] = {}
    pod_spec = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]
    for c in pod_spec.get("containers") or []:
        if c.get("name") == DEFAULT_CONTAINER:
            for port in c.get("ports") or []:
                ports[port.get("name") or ""] = int(port["containerPort"])
            break
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
            # ServicePort.Name is omitempty: an unnamed port has no name key at all.
            "ports": [{"name": n, "port": p} if n else {"port": p} for n, p in sorted(ports.items())],
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
    """What one reconcile pass decided: the new status and, in the order the real controller makes them, the events
    and API writes that get there.

    The I/O side performs ``steps`` in order and stops at the first write that fails; then, as upstream (an error
    returned before ``UpdateJobStatusInApiServer``), the status is not written and the job is retried with backoff.
    Step kinds: ``event`` (a :class:`JobEvent`), ``create_pod``/``create_service`` (the object),
    ``delete_pod``/``delete_service`` (the name), ``delete_job`` and ``error`` (a message: the pass fails there).
    """

    status: dict[str, Any]
    steps: list[tuple[str, Any]] = field(default_factory=list)
    requeue_after: float | None = None
    order: tuple[str, ...] = ()
    """The replica order of the pods/Services loop (``common/job.go:338``)."""
    status_order: tuple[str, ...] = ()
    """The replica order of the status decision (``pytorchjob_controller.go:369``)."""

    def add(self, kind: str, item: Any = None) -> None:
        self.steps.append((kind, item))

    def event(self, event: JobEvent) -> None:
        self.add("event", event)

    def _items(self, kind: str) -> list[Any]:
        return [item for k, item in self.steps if k == kind]

    @property
    def events(self) -> list[JobEvent]:
        return self._items("event")

    @property
    def create_pods(self) -> list[dict[str, Any]]:
        return self._items("create_pod")

    @property
    def delete_pods(self) -> list[str]:
        return self._items("delete_pod")

    @property
    def create_services(self) -> list[dict[str, Any]]:
        return self._items("create_service")

    @property
    def delete_services(self) -> list[str]:
        return self._items("delete_service")

    @property
    def delete_job(self) -> bool:
        return bool(self._items("delete_job"))

    @property
    def errors(self) -> list[str]:
        return self._items("error")


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """``metav1.IsControlledBy``: the controller ownerReference names ``uid``."""
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def has_job_labels(obj: dict[str, Any], job_name: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in job_labels(job_name).items())


def job_pods(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``GetPodsForJob`` of the PyTorch reconciler (``pytorchjob_controller.go:281-296``): the pods in the job's
    namespace with its job-name and operator-name labels that it controls (``JobControlledPodList``,
    ``pkg/common/util/util.go:43-55``). No adoption: orphans and other owners' pods are left out."""
    meta = job["metadata"]
    return [
        p
        for p in pods
        if p["metadata"].get("namespace") == meta["namespace"]
        and has_job_labels(p, meta["name"])
        and controlled_by(p, meta["uid"])
    ]


def job_services(job: dict[str, Any], services: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``GetServicesForJob`` of the PyTorch reconciler (``pytorchjob_controller.go:298-314``): every Service in the
    job's namespace with its job-name and operator-name labels, whoever owns it (no ownership check, no adoption)."""
    meta = job["metadata"]
    return [
        s for s in services if s["metadata"].get("namespace") == meta["namespace"] and has_job_labels(s, meta["name"])
    ]


def replica_order(
    replicas: dict[str, Any], order: Sequence[str] | None = None, rng: random.Random | None = None
) -> tuple[str, ...]:
    """The replica types of a job in the order one Go map iteration visits them: ``order`` if given, else shuffled
    by ``rng`` if given, else Master before Worker."""
    present = [t for t in REPLICA_TYPES if t in replicas]
    if order is not None:
        ranked = {t: i for i, t in enumerate(order)}
        return tuple(sorted(present, key=lambda t: ranked.get(t, len(ranked))))
    if rng is not None:
        rng.shuffle(present)
    return tuple(present)


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
    raw_job: dict[str, Any],
    pods: list[dict[str, Any]],
    services: list[dict[str, Any]],
    now: float,
    *,
    order: Sequence[str] | None = None,
    rng: random.Random | None = None,
) -> Plan:
    """One pass of ``ReconcileJobs`` + ``UpdateJobStatus`` for a live (not deleted) job, without I/O.

    ``pods``/``services`` are the job's as :func:`job_pods`/:func:`job_services` select them. ``order`` fixes the
    replica order of both Go map iterations; ``rng`` shuffles each independently; with neither, Master comes first.
    The returned plan's ``status`` is the complete new status.
    """
    job = apply_defaults(raw_job)
    meta = job["metadata"]
    name = meta["name"]
    stamp = to_rfc3339(now)
    status = copy.deepcopy(raw_job.get("status") or {})
    status.setdefault("conditions", [])
    plan = Plan(status=status)
    if not status["conditions"]:
        # onOwnerCreateFunc sets Created in memory; it is persisted with the first status write.
        set_condition(status, "Created", "True", reason("Created"), f"{KIND} {name} is created.", stamp)

    spec = job["spec"]
    replicas: dict[str, Any] = spec["pytorchReplicaSpecs"]
    run_policy = spec["runPolicy"]
    clean_policy = run_policy.get("cleanPodPolicy") or "None"

    def delete_with_services(names: list[str]) -> None:
        # DeletePodsAndServices (common/job.go:43-69): each pod, then the Service of the same name.
        for pod_name in names:
            plan.add("delete_pod", pod_name)
            plan.add("delete_service", pod_name)

    if is_finished(status):
        delete_with_services(cleanup_targets(clean_policy, pods, job_finished=True))
        cleanup_job(plan, run_policy, status, now, just_completed=False)
        if condition_true(status, "Succeeded"):
            for counts in (status.get("replicaStatuses") or {}).values():
                counts["succeeded"] = counts.get("succeeded", 0) + counts.get("active", 0)
                counts["active"] = 0
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
            plan.event(JobEvent("Normal", reason("Suspended"), message))
        return plan
    if condition_true(status, "Suspended"):
        message = f"{KIND} {name} is resumed."
        set_condition(status, "Suspended", "False", reason("Resumed"), message, stamp)
        status["startTime"] = stamp
        plan.event(JobEvent("Normal", reason("Resumed"), message))

    for event in abnormal_pod_events(pods):
        plan.event(event)

    # Backoff limit and active deadline (common/job.go:192-214). The deadline is checked here, on whatever pass an
    # event causes, and nowhere else: its requeue (pytorchjob_controller.go:365) goes to a no-op FakeWorkQueue.
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
    if (
        failure is None
        and deadline is not None
        and status.get("startTime")
        and now - from_rfc3339(status["startTime"]) >= float(deadline)
    ):
        failure = f"Job {name} has failed because it was active longer than specified deadline"
    if failure is not None:
        just_completed = not status.get("completionTime")
        status.setdefault("completionTime", stamp)
        plan.event(JobEvent("Normal", reason("Failed"), failure))
        set_condition(status, "Failed", "True", reason("Failed"), failure, stamp)
        # Since 1.9.4 (#3419) the cleanup after a backoff/deadline failure follows cleanPodPolicy.
        delete_with_services(cleanup_targets(clean_policy, pods, job_finished=True))
        # CleanupJob (job.go:233) before the status write (job.go:247): with a TTL of 0 the job is deleted before
        # its Failed condition is ever written.
        cleanup_job(plan, run_policy, status, now, just_completed=just_completed)
        return plan

    plan.order = replica_order(replicas, order, rng)
    for rtype in plan.order:
        reconcile_replica_pods(job, rtype, pods, status, plan, stamp)
        reconcile_replica_services(job, rtype, services, plan)
    plan.status_order = replica_order(replicas, order, rng)
    update_job_status(job, status, plan, stamp, plan.status_order)
    return plan


def cleanup_job(
    plan: Plan, run_policy: dict[str, Any], status: dict[str, Any], now: float, *, just_completed: bool
) -> None:
    """``CleanupJob`` (``common/job.go:420-453``) and the TTL requeue of ``Reconcile`` (``pytorchjob_controller.go:
    169-176``).

    ``just_completed``: completionTime was set in this very pass, so it is ``now`` to the nanosecond and the
    controller's ``time.Now()`` a moment later is after it: a TTL of 0 has expired. Otherwise completionTime comes
    from the API in whole seconds.
    """
    ttl = run_policy.get("ttlSecondsAfterFinished")
    if ttl is None or run_policy.get("suspend"):
        return
    if not status.get("completionTime"):
        # The ExitCode permanent-failure path leaves completionTime nil: CleanupJob errors, the pass fails (no status
        # write) and is retried with backoff, forever.
        plan.add("error", "job completion time is nil, cannot cleanup")
        return
    if just_completed:
        if int(ttl) <= 0:
            plan.add("delete_job")
        # Otherwise CleanupJob's AddAfter goes to the FakeWorkQueue, and Reconcile's requeue looks at the status the
        # pass started with (not finished): nothing is queued; the status write's event brings the next pass.
        return
    expire = from_rfc3339(status["completionTime"]) + float(ttl)
    if now > expire:
        plan.add("delete_job")
    else:
        plan.requeue_after = expire - now


def reconcile_replica_pods(
    job: dict[str, Any], rtype: str, pods: list[dict[str, Any]], status: dict[str, Any], plan: Plan, stamp: str
) -> None:
    """``ReconcilePods`` for one replica type (``common/pod.go:269-380``): create missing pods, delete surplus ones,
    restart failed ones."""
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
                if ((rspec.get("template") or {}).get("spec") or {}).get("restartPolicy"):
                    plan.event(
                        JobEvent(
                            "Warning",
                            "SetPodTemplateRestartPolicy",
                            "Restart policy in pod template will be overwritten by restart policy in replica spec",
                            "template-restart-policy",
                        )
                    )
                plan.add("create_pod", render_pod(job, rtype, index))
            continue
        pod = slot[0]
        pod_name = pod["metadata"]["name"]
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if index >= wanted and not deleting:
            plan.add("delete_pod", pod_name)
        code = pytorch_exit_code(pod)
        if code is not None:
            plan.event(
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
                plan.add("delete_pod", pod_name)
            message = f"job {name} is restarting because {rtype} replica(s) failed."
            plan.event(JobEvent("Warning", reason("Restarting"), message, f"restart/{pod['metadata']['uid']}"))
            set_condition(status, "Restarting", "True", reason("Restarting"), message, stamp)
        elif failed and policy == "ExitCode":
            message = f'job "{name}" is failing because "{rtype}" replica(s) failed.'
            plan.event(JobEvent("Warning", reason("Failed"), message, "failed"))
            set_condition(status, "Failed", "True", reason("Failed"), message, stamp)
        count_replica(counts, pod)


def reconcile_replica_services(job: dict[str, Any], rtype: str, services: list[dict[str, Any]], plan: Plan) -> None:
    """``ReconcileServices`` (``common/service.go:157-203``): one headless Service per wanted index; surplus ones
    go."""
    wanted = int(job["spec"]["pytorchReplicaSpecs"][rtype]["replicas"])
    existing: dict[int, dict[str, Any]] = {}
    for svc in services:
        labels = svc["metadata"].get("labels") or {}
        if labels.get(LABEL_REPLICA_TYPE) == rtype.lower() and labels.get(LABEL_REPLICA_INDEX, "").isdigit():
            existing[int(labels[LABEL_REPLICA_INDEX])] = svc
    for index in range(max([wanted, *(i + 1 for i in existing)])):
        current = existing.get(index)
        if current is None:
            if index < wanted:
                plan.add("create_service", render_service(job, rtype, index))
        elif index >= wanted and not current["metadata"].get("deletionTimestamp"):
            plan.add("delete_service", current["metadata"]["name"])


def update_job_status(
    job: dict[str, Any], status: dict[str, Any], plan: Plan, stamp: str, order: Sequence[str] = REPLICA_TYPES
) -> None:
    """``UpdateJobStatus`` (``pytorchjob_controller.go:343-447``), visiting replica types in ``order``.

    With a Master, only the Master decides success, and its success returns at once (``:400``): replica types not
    visited yet are not checked for failure. Without one, all Workers succeeded or (elastic) any one did, and the
    pass goes on to the failure check (``:409-443``), so a job can end with both Succeeded and Failed True.
    """
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    elastic = job["spec"].get("elasticPolicy") is not None
    if not status.get("startTime"):
        status["startTime"] = stamp
    for rtype in order:
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
            elif running > 0:
                set_condition(
                    status, "Running", "True", reason("Running"), f"{KIND} {namespace}/{name} is running.", stamp
                )
        if failed > 0 and wanted > succeeded + running:
            if replicas[rtype]["restartPolicy"] != "Never":
                message = f"{KIND} {name} is restarting because {failed} {rtype} replica(s) failed."
                plan.event(JobEvent("Warning", reason("Restarting"), message, f"restarting/{message}"))
                set_condition(status, "Restarting", "True", reason("Restarting"), message, stamp)
            else:
                message = f"{KIND} {name} is failed because {failed} {rtype} replica(s) failed."
                plan.event(JobEvent("Normal", reason("Failed"), message, "failed"))
                if not status.get("completionTime"):
                    status["completionTime"] = stamp
                set_condition(status, "Failed", "True", reason("Failed"), message, stamp)


def finish_succeeded(status: dict[str, Any], plan: Plan, message: str, stamp: str) -> None:
    plan.event(JobEvent("Normal", reason("Succeeded"), message, "succeeded"))
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
    """Deduplicating queue of job keys with delayed adds and per-key failure backoff; one worker drains it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: dict[tuple[str, str], None] = {}
        self._delayed: list[tuple[float, tuple[str, str]]] = []
        self._failures: dict[tuple[str, str], int] = {}

    def add(self, key: tuple[str, str], after: float = 0.0) -> None:
        with self._cond:
            if after > 0:
                heapq.heappush(self._delayed, (time.monotonic() + after, key))
            else:
                self._ready[key] = None
            self._cond.notify()

    def add_rate_limited(self, key: tuple[str, str]) -> float:
        """``AddRateLimited`` with ``ItemExponentialFailureRateLimiter(5ms, 1000s)``; returns the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(BACKOFF_BASE_SECONDS * 2.0 ** min(failures, 40), BACKOFF_MAX_SECONDS)
        self.add(key, after=delay)
        return delay

    def forget(self, key: tuple[str, str]) -> None:
        with self._cond:
            self._failures.pop(key, None)

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


class ReconcileError(RuntimeError):
    """A pass that failed the way the real one returns an error: logged, retried with backoff."""


def replica_seed() -> int:
    """``TORCHELASTIC_SIM_SEED`` if set, else a fresh random seed."""
    configured = os.environ.get(SEED_ENV, "").strip()
    return int(configured) if configured else random.SystemRandom().randrange(2**32)


def api_error_message(err: ApiException) -> str:
    """What Go's ``%v`` of a client-go StatusError prints: the Status message (else the HTTP reason)."""
    try:
        body = json.loads(err.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return str(err.reason)


def controller_job_key(obj: dict[str, Any]) -> tuple[str, str] | None:
    """The job an event on a dependent wakes: the PyTorchJob its controller ownerReference names
    (``EnqueueRequestForOwner(..., OnlyControllerOwner())``, ``pytorchjob_controller.go:198-207``); none for orphans."""
    meta = obj["metadata"]
    if not (meta.get("labels") or {}).get(LABEL_REPLICA_TYPE):
        return None  # OnDependent*Func: no replica-type label, no event (reconciler.go:78-81, 141-144)
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(GROUP + "/"):
            return (meta.get("namespace", ""), ref["name"])
    return None


class Operator:
    def __init__(self, api: client.ApiClient, *, seed: int | None = None, collect_garbage: bool = True) -> None:
        #: False beside a real kube-controller-manager (the real node), whose garbage collector does this part.
        self.collects_garbage = collect_garbage
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.stop = threading.Event()
        self.queue = WorkQueue()
        self.seed = replica_seed() if seed is None else seed
        self.rng = random.Random(self.seed)
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
            if self.collects_garbage:
                threading.Thread(
                    target=self.collect_garbage, args=(meta["namespace"], meta["uid"]), daemon=True, name="gc"
                ).start()
            return
        self.queue.add((meta["namespace"], meta["name"]))

    def _on_dependent(self, kind: str, obj: dict[str, Any]) -> None:
        key = controller_job_key(obj)
        if key is not None:
            self.queue.add(key)

    # -- reconcile (worker thread) --------------------------------------------------------------------------------

    def reconcile(self, key: tuple[str, str]) -> None:
        with self.jobs.lock:
            job = self.jobs.cache.get(key)
        if job is None:
            return
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            if self.collects_garbage:  # else the real collector's foreground/orphan finalizers
                self.finalize_deleted_job(job)
            return
        pods = job_pods(job, self.pods.items())
        services = job_services(job, self.services.items())
        plan = reconcile_job(job, pods, services, time.time(), rng=self.rng)  # one worker thread uses the rng
        log.debug("job %s/%s: replica order %s, status order %s", key[0], key[1], plan.order, plan.status_order)
        self.execute(job, plan)

    def execute(self, job: dict[str, Any], plan: Plan) -> None:
        """Perform the plan's steps in order; a failed write raises (after its Warning event), so the status is not
        written and the job is retried with backoff, as when the real reconcile returns an error."""
        meta = job["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        wrote = False
        for kind, item in plan.steps:
            if kind == "event":
                self.emit_once(job, item)
            elif kind == "create_pod":
                self._create("pod", namespace, item, job)
                wrote = True
            elif kind == "create_service":
                self._create("service", namespace, item, job)
                wrote = True
            elif kind == "delete_pod":
                self._delete("pod", namespace, item, job)
                wrote = True
            elif kind == "delete_service":
                self._delete("service", namespace, item, job)
                wrote = True
            elif kind == "delete_job":
                self._delete_job(job)
            elif kind == "error":
                raise ReconcileError(f"job {namespace}/{name}: {item}")
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
                if err.status not in (404, 409, 422):  # 404: deleted meanwhile (or just now, by a TTL of 0)
                    raise
        if plan.requeue_after is not None:
            self.queue.add((namespace, name), after=plan.requeue_after + 0.05)
        if wrote:
            # The watch events of what we just wrote would wake the job anyway; do not wait for them.
            self.queue.add((namespace, name), after=0.2)

    def _delete_job(self, job: dict[str, Any]) -> None:
        """``DeleteJob`` (``pytorchjob_controller.go:316-330``) when the TTL after finished has expired."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        log.info("job %s/%s: TTL after finished expired; deleting it", namespace, name)
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                body={"preconditions": {"uid": meta["uid"]}},
                _preload_content=False,
            )
        except ApiException as err:
            if err.status in (404, 409):
                return
            self._record(job, "Warning", "FailedDeletePod", f"Error deleting: {api_error_message(err)}")
            raise
        self._record(job, "Normal", "SuccessfulDeletePod", f"Deleted job: {name}")

    def _create(self, what: str, namespace: str, obj: dict[str, Any], job: dict[str, Any]) -> None:
        """``createPods``/``createServices`` (``control/pod_control.go:140-165``, ``service_control.go:84-109``):
        any error, a 409 AlreadyExists or a 422 Invalid included, is a Warning event and fails the pass."""
        create = self.core.create_namespaced_pod if what == "pod" else self.core.create_namespaced_service
        informer = self.pods if what == "pod" else self.services
        try:
            resp = create(namespace, obj, _preload_content=False)
        except ApiException as err:
            message = api_error_message(err)
            self._record(job, "Warning", f"FailedCreate{what.capitalize()}", f"Error creating: {message}")
            raise ReconcileError(f"creating {what} {obj['metadata']['name']}: {message}") from err
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
                delay = self.queue.add_rate_limited(key)
                log.warning("reconcile %s/%s failed: %s; retrying in %.3fs", key[0], key[1], err, delay)
            else:
                self.queue.forget(key)

    def _housekeeping(self) -> None:
        """The orphan sweep every SWEEP_SECONDS (the GC's part), and the informers' resync every RESYNC_SECONDS
        (10 h, as controller-runtime's default): a quiet job is not reconciled in between, so nothing enforces its
        activeDeadlineSeconds until an event comes."""
        last_resync = time.monotonic()
        while not self.stop.wait(SWEEP_SECONDS):
            if time.monotonic() - last_resync >= RESYNC_SECONDS:
                last_resync = time.monotonic()
                for job in self.jobs.items():
                    self.queue.add((job["metadata"]["namespace"], job["metadata"]["name"]))
            if not self.collects_garbage:
                continue
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
        threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True).start()
        self._work()


def build_api_client(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 16  # three watches, the worker and the sweeper share the pool
    return client.ApiClient(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--no-garbage-collector",
        action="store_true",
        help="leave PyTorchJobs' dependents to a real kube-controller-manager's garbage collector",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s sim-operator %(levelname)s %(message)s"
    )
    operator = Operator(build_api_client(args.kubeconfig), collect_garbage=not args.no_garbage_collector)
    # Replica types are visited in random (Go map) order; this seed reproduces a run's orders.
    log.info("replica order seed: %d (set %s to reproduce)", operator.seed, SEED_ENV)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        operator.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    operator.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The TrainJob kind (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``): a fixed number of nodes on a
training runtime (``torch-distributed`` by default), each node a pod of one indexed Job of the TrainJob's JobSet.

Last in the table of kinds (``kinds.BUILT_IN``), so only ``kinds.choose`` picks it: ``job_kind='trainjob'``, or
``auto`` on a cluster that serves it. :func:`check_trainjob_config` is the parse-time check for when the kind is
known. Its pods are its own through the JobSet and the Jobs between them (:data:`OWNERS`, read beside the pods); the
triggerer's shared watch does not cover them, so its triggers poll.

Read against kubeflow/trainer v2.3.0 and kubernetes-sigs/jobset v0.12.0 (``../shared/notes/trainer-v2.md``):

* the Trainer's torch plugin gives the runtime's ``node`` container ``PET_NNODES`` (``trainer.numNodes``),
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the pod's completion index), ``PET_MASTER_ADDR``
  (``<tj>-node-0-0.<tj>``) and ``PET_MASTER_PORT`` (29500), and refuses a TrainJob whose ``trainer.env`` sets any of
  them. The runner reads them: with a master address and a node rank it takes torch's static rendezvous, node 0
  hosting the store, so global rank 0 is on the pod of completion index 0;
* pod customisation goes through one ``runtimePatches`` entry of the provider's manager. A container patch carries
  only env, volumeMounts and securityContext, may name only containers the runtime has, and may not give the
  ``node`` container env (that is ``trainer.env``). Everything else a task asks of its pods either has a place in
  the ``trainer`` block or the patch, or is refused with the field named (:func:`check_trainjob_options`);
* there is no elastic training (KEP-2903, kubeflow/trainer#2903, is open) and no field for a restart policy, a
  backoff limit, a TTL or a pod clean-up policy (:func:`check_trainjob_config`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.config import Master, PyTorch, TaskConfig, Worker
from airflow_provider_torchelastic.core.launch import config_to_launch_spec
from airflow_provider_torchelastic.core.naming import LABEL_PREFIX, RunIdentity, fit_job_name, job_name
from airflow_provider_torchelastic.core.outcome import NodeReport, Verdict, decide_run
from airflow_provider_torchelastic.core.pod_options import merge_pod_options
from airflow_provider_torchelastic.kubernetes import status
from airflow_provider_torchelastic.kubernetes.kinds.descriptor import JobKind, OwnerQuery
from airflow_provider_torchelastic.kubernetes.kinds.held import suspended_decision
from airflow_provider_torchelastic.kubernetes.kinds.trainjob_limits import (
    MAX_NODE_DIGITS,
    PATCH_ONLY,
    POD_PATCH_FIELDS,
    RESERVED_ENV,
    accepts,
    cannot,
    check_trainjob_config,
    check_trainjob_options,
)
from airflow_provider_torchelastic.kubernetes.pod_template import (
    JsonDict,
    PodSettings,
    RenderInputs,
    job_metadata,
    pod_runner_command,
    render_pod_template,
)
from airflow_provider_torchelastic.kubernetes.status import Observed
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

__all__ = [
    "API_VERSION",
    "CONTROLLERS",
    "GROUP",
    "KIND",
    "OWNERS",
    "PATCH_MANAGER",
    "PLURAL",
    "RESERVED_ENV",
    "TORCH_DISTRIBUTED",
    "Runtime",
    "check_trainjob_config",
    "check_trainjob_options",
    "decide_trainjob",
    "is_rank0_pod",
    "render_trainjob",
    "runtime_from_manifest",
    "trainjob_finished",
    "trainjob_name",
]

GROUP: Final = "trainer.kubeflow.org"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
PLURAL: Final = "trainjobs"
#: Where the API server mounts a service account's token, and what the provider's patch mounts there instead when the
#: pods must have none (:func:`_split_template`): an empty, read-only, memory-backed folder.
TOKEN_MOUNT_PATH: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_MASK_VOLUME: Final = {"name": "torchelastic-no-token", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
TOKEN_MASK_MOUNT: Final = {"name": "torchelastic-no-token", "mountPath": TOKEN_MOUNT_PATH, "readOnly": True}
#: Whose entry of ``spec.runtimePatches`` is the provider's (a list keyed by manager; Kueue uses its own).
PATCH_MANAGER: Final = f"{LABEL_PREFIX}/provider"
#: The container of the runtime's trainer job that the ``trainer`` block sets (kubeflow/trainer ``constants.Node``).
NODE_CONTAINER: Final = "node"
#: A pod's controllers up to the TrainJob, nearest first: the indexed Job, its JobSet, the TrainJob.
CONTROLLERS: Final = ("Job", "JobSet", "TrainJob")
#: JobSet's pod labels: the JobSet (named as its TrainJob), the replicated job, the Job's index in it.
JOBSET_NAME_LABEL: Final = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL: Final = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL: Final = "jobset.sigs.k8s.io/job-index"
#: Kubernetes' indexed Job label: the node's index, which the torch plugin makes ``PET_NODE_RANK``.
COMPLETION_INDEX_LABEL: Final = "batch.kubernetes.io/job-completion-index"
_ANCESTOR_LABEL: Final = "trainer.kubeflow.org/trainjob-ancestor-step"
_RUNTIME_KINDS: Final = ("ClusterTrainingRuntime", "TrainingRuntime")
_POD_SUFFIX: Final = len("-abcde")
#: Seconds after a node's failure during which its peers' reports are awaited (the root cause may be theirs).
_FAILED_SETTLE_SECONDS: Final = 5.0


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """What the provider must know of the training runtime a TrainJob names: its replicated jobs and their
    containers (a patch may name only those) and which of them runs the trainer. Rendering never reads the cluster,
    so a runtime other than the default is described here (:func:`runtime_from_manifest` reads one)."""

    name: str = "torch-distributed"
    #: ``ClusterTrainingRuntime`` (cluster-wide) or ``TrainingRuntime`` (in the TrainJob's namespace).
    kind: str = "ClusterTrainingRuntime"
    #: Replicated job -> the names of its containers and init containers.
    containers: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {"node": (NODE_CONTAINER,)})
    #: The replicated job labelled as the trainer step, which the ``trainer`` block and the patch apply to.
    trainer_job: str = "node"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Runtime.name: expected a runtime's name, got {self.name!r}")
        if self.kind not in _RUNTIME_KINDS:
            raise ValueError(f"Runtime.kind: expected one of {', '.join(_RUNTIME_KINDS)}, got {self.kind!r}")
        containers = MappingProxyType({job: tuple(names) for job, names in dict(self.containers).items()})
        if NODE_CONTAINER not in containers.get(self.trainer_job, ()):
            raise ValueError(
                f"Runtime.trainer_job: expected a replicated job with a {NODE_CONTAINER!r} container (the one the "
                f"trainer block sets), got {self.trainer_job!r} of {dict(containers)!r}"
            )
        object.__setattr__(self, "containers", containers)

    @property
    def max_job_name_length(self) -> int:
        """The longest TrainJob name whose JobSet's pod names JobSet accepts (44 for ``torch-distributed``)."""
        longest = max(len(f"-{job}-0-") for job in self.containers)
        return 63 - longest - MAX_NODE_DIGITS - _POD_SUFFIX


#: Kubeflow Trainer v2.3.0's default runtime (``manifests/base/runtimes/torch_distributed.yaml``).
TORCH_DISTRIBUTED: Final = Runtime()


def runtime_from_manifest(runtime: Mapping[str, Any]) -> Runtime:
    """The :class:`Runtime` a (Cluster)TrainingRuntime object describes."""
    kind, name = runtime.get("kind"), (runtime.get("metadata") or {}).get("name")
    jobs = ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get("replicatedJobs") or []
    containers: dict[str, tuple[str, ...]] = {}
    trainer_job = None
    for job in jobs:
        template = job.get("template") or {}
        pod = (template.get("spec") or {}).get("template", {}).get("spec") or {}
        names = [c.get("name") for c in (pod.get("initContainers") or []) + (pod.get("containers") or [])]
        containers[job.get("name")] = tuple(names)
        # The Trainer finds the job its trainer block applies to by this label, not by name.
        if ((template.get("metadata") or {}).get("labels") or {}).get(_ANCESTOR_LABEL) == "trainer":
            trainer_job = job.get("name")
    return Runtime(name=name, kind=kind, containers=containers, trainer_job=trainer_job)  # type: ignore[arg-type]


# --- names --------------------------------------------------------------------------------------------------------


def trainjob_name(identity: RunIdentity, runtime: Runtime = TORCH_DISTRIBUTED) -> str:
    """The TrainJob's name: :func:`job_name` cut so that JobSet's pod names fit (RFC 1035, at most 63)."""
    return fit_job_name(job_name(identity), runtime.max_job_name_length)


def node_hostname(name: str, index: int, runtime: Runtime = TORCH_DISTRIBUTED) -> str:
    """The hostname of node ``index`` (``<tj>-node-0-<index>``; ``PET_MASTER_ADDR`` names node 0's, with the
    TrainJob's name as subdomain). The pod's *name* has the indexed Job's random suffix after it."""
    return f"{name}-{runtime.trainer_job}-0-{index}"


# --- render -------------------------------------------------------------------------------------------------------


def _node_replica(config: TaskConfig) -> Master | Worker | None:
    # The Master and the Worker are the same pod here (_limitation refuses them different).
    return config.worker if isinstance(config, PyTorch) else None


def render_trainjob(inputs: RenderInputs, runtime: Runtime = TORCH_DISTRIBUTED) -> JsonDict:
    """The TrainJob of a task: the runner as ``trainer.command`` on every node, the pods' customisation, the payload
    Secret's volume and the provider's labels in the provider's runtime patch."""
    config = inputs.config
    check_trainjob_config(config)
    replica = _node_replica(config)
    options = merge_pod_options(inputs.options, replica.pod) if replica is not None else inputs.options
    check_trainjob_options(options, inputs.job_options)
    launch = config_to_launch_spec(config)
    # No --nnodes: the torch plugin sets PET_NNODES to trainer.numNodes (and the rest the runner reads).
    command = pod_runner_command(inputs, launch)
    template = render_pod_template(
        PodSettings(
            where="TrainJob pod",
            options=options,
            image=replica.image if replica is not None and replica.image is not None else inputs.image,
            default_image=inputs.default_image,
            image_required=inputs.image_required,
            requests={**options.requests, **(replica.requests if replica is not None else {})},
            limits={**options.limits, **(replica.limits if replica is not None else {})},
            command=command,
            payload_secret=inputs.payload_secret,
            labels=inputs.labels,
            annotations=inputs.annotations,
            # The Trainer sets no PYTHONUNBUFFERED (the training operator does): logs arrive as they are written.
            env=[{"name": "PYTHONUNBUFFERED", "value": "1"}, *inputs.worker_env],
        )
    )
    node, patch = _split_template(template, runtime)
    trainer: JsonDict = {"numNodes": launch.max_nodes}
    if isinstance(launch.nproc_per_node, int):
        # An int only (the CRD's type); "auto", "cpu", "gpu" travel on the runner's --nproc-per-node alone.
        trainer["numProcPerNode"] = launch.nproc_per_node
    trainer.update(node)
    metadata = job_metadata(inputs)
    metadata["name"] = fit_job_name(inputs.name, runtime.max_job_name_length)
    spec: JsonDict = {
        "runtimeRef": {"apiGroup": GROUP, "kind": runtime.kind, "name": runtime.name},
        "trainer": trainer,
        "runtimePatches": [patch],
    }
    if inputs.job_options.suspend:
        spec["suspend"] = True
    if config.run_policy is not None and config.run_policy.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = config.run_policy.active_deadline_seconds
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata, "spec": spec}


def _split_template(template: JsonDict, runtime: Runtime) -> tuple[JsonDict, JsonDict]:
    """The rendered pod template as the ``trainer`` block and the provider's runtime patch."""
    spec = dict(template["spec"])
    (container,) = spec.pop("containers")  # check_trainjob_options refused any other
    container = dict(container)
    container.pop("name")
    # Left out on purpose: the training operator's port (the torch plugin adds its own, 29500) and the termination
    # message settings (the runner writes to the default path; without FallbackToLogsOnError a node killed before it
    # reported shows no log tail in its status).
    for key in ("ports", "terminationMessagePath", "terminationMessagePolicy"):
        container.pop(key, None)  # check_trainjob_options refused the user's own
    # A patch has no automountServiceAccountToken. Where the pod would say false (no service account named), the
    # token is masked instead: the API server's ServiceAccount admission mounts no token into a container that
    # already mounts something at the token's path, and adds no token volume when no container needs it.
    no_token = spec.pop("automountServiceAccountToken", None) is False
    trainer: JsonDict = {"image": container.pop("image", None), "command": container.pop("command")}
    if trainer["image"] is None:
        del trainer["image"]  # a parse-time check without an image: nothing is submitted
    trainer["env"] = container.pop("env", [])
    if "resources" in container:
        trainer["resourcesPerNode"] = container.pop("resources")
    patched: JsonDict = {"name": NODE_CONTAINER}  # env only through trainer.env: the webhook refuses it here
    mounts = container.pop("volumeMounts", [])
    names = [mount["name"] for mount in mounts]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        # The patch keys a container's mounts by volume name (a list map): one mount per volume.
        raise cannot(f"volumeMounts[{twice[0]!r}]", mounts, "a runtime patch mounts each volume once")
    if no_token and not any(mount.get("mountPath") == TOKEN_MOUNT_PATH for mount in mounts):  # else: the user's own
        spec["volumes"] = [*spec.get("volumes", []), copy.deepcopy(TOKEN_MASK_VOLUME)]
        mounts = [*mounts, dict(TOKEN_MASK_MOUNT)]
    patched["volumeMounts"] = mounts
    if "securityContext" in container:
        patched["securityContext"] = container.pop("securityContext")
    if container:  # pragma: no cover - a field render_pod_template started to set: place it or refuse it above
        raise cannot("the rendered container", sorted(container), PATCH_ONLY)
    pod_spec = {key: spec.pop(key) for key in sorted(POD_PATCH_FIELDS & set(spec))}
    if spec:  # pragma: no cover - the same, for the pod
        raise cannot("the rendered pod", sorted(spec), PATCH_ONLY)
    pod_spec["containers"] = [patched]
    pod: JsonDict = {"spec": pod_spec}
    metadata = copy.deepcopy(template.get("metadata", {}))
    # The queue label names the workload Kueue admits, the TrainJob (job_metadata puts it there); on its pods it
    # would only ask Kueue's pod integration, where enabled, to gate pods of an admitted job.
    metadata.get("labels", {}).pop(status.KUEUE_QUEUE_LABEL, None)
    if metadata:
        pod = {"metadata": metadata, **pod}
    job = {"name": runtime.trainer_job, "template": {"spec": {"template": pod}}}
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}
    return trainer, patch


# --- the pods of a job --------------------------------------------------------------------------------------------


def pod_selector(name: str, runtime: Runtime = TORCH_DISTRIBUTED) -> str:
    """The trainer's pods of TrainJob ``name`` (its JobSet has its name), not those of other replicated jobs."""
    return f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={runtime.trainer_job}"


def is_rank0_pod(pod: Mapping[str, Any], runtime: Runtime = TORCH_DISTRIBUTED) -> bool:
    """Whether ``pod`` is node 0 of the trainer: it hosts the static rendezvous, and global rank 0 with it."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return (
        labels.get(REPLICATED_JOB_LABEL) == runtime.trainer_job
        and labels.get(JOB_INDEX_LABEL) == "0"
        and labels.get(COMPLETION_INDEX_LABEL) == "0"
    )


# --- decide -------------------------------------------------------------------------------------------------------


def trainjob_finished(job: Mapping[str, Any]) -> bool:
    return status.true_condition(job, "Complete") is not None or status.true_condition(job, "Failed") is not None


def _suspended(job: Mapping[str, Any]) -> bool:
    return bool((job.get("spec") or {}).get("suspend")) or status.true_condition(job, "Suspended") is not None


def _num_nodes(job: Mapping[str, Any]) -> int | None:
    nodes = ((job.get("spec") or {}).get("trainer") or {}).get("numNodes")
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else None


def decide_trainjob(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """A TrainJob: its Complete, Failed and Suspended conditions, and the reports of its pods."""
    return status.with_pods(_decide(ref, snapshot, policy), snapshot, snapshot.pods)


def _decide(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """The job's state, most final first: stuck pods, Failed, Complete, a failed node, suspended, then waiting for
    capacity, running or pending."""
    job = snapshot.job
    if job is None:
        return status.job_gone(ref)
    seen = Observed(
        ref=ref,
        job=job,
        pods=list(snapshot.pods),
        total=_num_nodes(job) or 1,
        now=snapshot.now,
        pull_errors=snapshot.pull_errors,
    )
    stuck = status.stuck_decision(seen, policy)
    if stuck is not None:
        return stuck
    reports = seen.reports()
    failed = status.true_condition(job, "Failed")
    if failed is not None:
        # The pods name the root cause (pod, rank, exception; OOM and eviction recoverable) where one reported it;
        # otherwise the condition, copied from the JobSet's, says why (a deadline, a backoff limit, the runtime).
        verdict = decide_run(reports)
        if verdict.failure is None and (verdict.succeeded or not verdict.node):
            verdict = _failed_condition_verdict(job, failed)
        return seen.decision(Phase.FAILED, "Failed", verdict=verdict)
    if status.true_condition(job, "Complete") is not None:
        # Complete is the JobSet's: every node's pod succeeded. Rank 0's report is on node 0's pod.
        if any(r.outcome is not None and r.outcome.holds_rank0 for r in reports) or len(reports) >= len(seen.pods):
            verdict = decide_run(reports)
            return seen.decision(status.phase_of(verdict), "Complete", verdict=verdict)
        return seen.decision(Phase.RUNNING, "Complete, waiting for rank 0's pod")
    verdict = decide_run(reports)
    if not verdict.succeeded and verdict.node is not None:
        return _node_failed(seen, reports, verdict)
    if _suspended(job):
        # Created suspended (Kueue's webhook does that to a labelled TrainJob) or preempted: waiting for capacity.
        return suspended_decision(seen, policy)
    return _decide_unfinished(seen, policy)


def _node_failed(seen: Observed, reports: Sequence[NodeReport], verdict: Verdict) -> WaitDecision:
    """A node failed (its container ended with a failure, maybe restarted since: lastState) before the job did.

    torch-distributed restarts it in place (OnFailure, the Job's backoffLimit 6), for minutes before the TrainJob
    fails, but a restarted node cannot rejoin: its peers' workers already failed on the broken collectives, and the
    static rendezvous starts no new round. So the task fails now and stops the job; a recoverable cause (OOM,
    eviction, RecoverableError) is retried by Airflow, with a fresh TrainJob, from its checkpoints.
    """
    failed_at = min((r.finished_at for r in reports if r.finished_at is not None), default=seen.now)
    if seen.now - failed_at < _FAILED_SETTLE_SECONDS and len(reports) < len(seen.pods):
        # Its peers fail a moment later, and the root cause may be theirs: give them a moment to report.
        return seen.decision(Phase.RUNNING, "a node failed, waiting for its peers to report")
    return seen.decision(Phase.FAILED, "a node failed", verdict=verdict, stop=True)


def _decide_unfinished(seen: Observed, policy: WaitPolicy) -> WaitDecision:
    """Neither ended nor suspended: waiting for its nodes' capacity, running, or pending (failed when it never gets
    a pod)."""
    waits = seen.waiting_for_capacity
    if waits and seen.running < seen.total:
        # A fixed number of nodes: the job cannot start without every one of them.
        first = min(waits, key=lambda wait: wait.since)
        pod = next((p for p in seen.pods if p.get("metadata", {}).get("name") == first.pod), {})
        host = " (it hosts the rendezvous: every node's PET_MASTER_ADDR names it)" if is_rank0_pod(pod) else ""
        return status.out_of_patience(seen, policy, first.since, status.describe_wait(first) + host, first.pod)
    if seen.running:
        return seen.decision(Phase.RUNNING, "Running")
    if not seen.pods and seen.now - seen.created >= policy.pending_grace_seconds:
        return _no_pods(seen, policy)
    queue = status.queue_name(seen.job)
    return seen.decision(Phase.PENDING, "Created" + (f" (Kueue LocalQueue {queue})" if queue else ""))


def _no_pods(seen: Observed, policy: WaitPolicy) -> WaitDecision:
    """Not suspended, yet no pod: the JobSet (or its Jobs) was not made. A JobSet the JobSet webhook refuses shows
    only as an event on the TrainJob, and the TrainJob stays as it is: without this it would wait forever."""
    ref = seen.ref
    detail = (
        f"{ref.kind} {ref.namespace}/{ref.name} has no pods {policy.pending_grace_seconds:.0f} s after its creation "
        "and is not suspended: its JobSet was not created or was refused (see `kubectl describe trainjob -n "
        f"{ref.namespace} {ref.name}` for the Trainer's events), or Kubeflow Trainer's controller is not running; a "
        "retry would meet the same refusal"
    )
    return seen.stopped("failed (no pods)", causes.CONFIGURATION, detail)


def _failed_condition_verdict(job: Mapping[str, Any], condition: Mapping[str, Any]) -> Verdict:
    reason, message = condition.get("reason", ""), condition.get("message", "")
    deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
    if reason == "DeadlineExceeded":
        return Verdict(
            succeeded=False,
            cause=causes.DEADLINE,
            detail=f"the TrainJob ran longer than run_policy.active_deadline_seconds={deadline} and the Trainer "
            f"stopped it ({message}); a retry would run into the same limit",
        )
    return Verdict(succeeded=False, recoverable=False, detail=f"the TrainJob failed: {reason}: {message}".rstrip(": "))


# --- the rendered-template view -----------------------------------------------------------------------------------


def _digest_spec(manifest: JsonDict) -> JsonDict:
    """What runs where: the runtime, the node count, the image and the resources of every node."""
    spec = manifest.get("spec", {})
    trainer = spec.get("trainer", {})
    short: JsonDict = {key: spec[key] for key in ("runtimeRef", "suspend", "activeDeadlineSeconds") if key in spec}
    keys = ("numNodes", "numProcPerNode", "image", "resourcesPerNode")
    short["trainer"] = {key: trainer[key] for key in keys if key in trainer}
    return short


def _training_containers(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer block (its ``resourcesPerNode`` are every node's): a TrainJob's one replica."""
    trainer = (workload.get("spec") or {}).get("trainer")
    return {"trainer": trainer} if isinstance(trainer, dict) else {}


def _jobset_of(name: str) -> str:
    return f"metadata.name={name}"  # the JobSet has its TrainJob's name (kubeflow/trainer jobset.go)


def _jobs_of(name: str) -> str:
    return f"{JOBSET_NAME_LABEL}={name}"


#: The JobSet and its Jobs, between a TrainJob and its pods (read to follow each pod's controllers by uid).
OWNERS: Final = (
    OwnerQuery(group="jobset.x-k8s.io", version="v1alpha2", plural="jobsets", field_selector=_jobset_of),
    OwnerQuery(group="batch", version="v1", plural="jobs", label_selector=_jobs_of),
)

KIND: Final = JobKind(
    kind="TrainJob",
    group=GROUP,
    version=VERSION,
    plural=PLURAL,
    accepts=accepts,
    render=render_trainjob,
    pod_selector=pod_selector,
    decide=decide_trainjob,
    is_finished=trainjob_finished,
    pod_owner_label=JOBSET_NAME_LABEL,
    pod_controllers=CONTROLLERS,
    log_container=NODE_CONTAINER,
    intermediates=OWNERS,
    replica_count=_num_nodes,
    training_containers=_training_containers,
    resources_key="resourcesPerNode",
    digest_spec=_digest_spec,
    controller="Kubeflow Trainer v2",
    install_hint="install Kubeflow Trainer v2.3 (its CRDs, JobSet v0.12 and the torch-distributed runtime)",
    # The Trainer's webhook refuses a TrainJob whose runtime does not exist with a 403, as it refuses bad fields.
    refusal_hint="a runtimeRef naming a runtime the cluster lacks is refused so: `kubectl get "
    "clustertrainingruntimes` lists those installed (torch-distributed is the default)",
)

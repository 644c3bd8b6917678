"""The PyTorchJob kind (Kubeflow training operator v1): several nodes, or a Master/Worker job.

Read against kubeflow/trainer v1.9.4, where it is least kind: the deadline is checked only on an event, Succeeded and
Failed can be written in one pass, and a TTL of 0 deletes a failed job before its Failed condition is written.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.config import Elastic, Master, TaskConfig, Worker
from airflow_provider_torchelastic.core.launch import config_to_launch_spec
from airflow_provider_torchelastic.core.naming import (
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    TRAINING_CONTAINER,
    replica_order,
)
from airflow_provider_torchelastic.core.outcome import Verdict, decide_run
from airflow_provider_torchelastic.core.pod_options import merge_pod_options
from airflow_provider_torchelastic.kubernetes.kinds.descriptor import JobKind
from airflow_provider_torchelastic.kubernetes.kinds.held import suspended_decision
from airflow_provider_torchelastic.kubernetes.pod_template import (
    JsonDict,
    PodSettings,
    RenderInputs,
    job_metadata,
    pod_runner_command,
    pod_spec_digest,
    render_pod_template,
)
from airflow_provider_torchelastic.kubernetes.status import (
    Observed,
    describe_wait,
    is_suspended,
    job_gone,
    out_of_patience,
    parse_time,
    phase_of,
    pods_not_created,
    queue_name,
    stuck_decision,
    true_condition,
    with_pods,
)
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "POD_LABEL",
    "VERSION",
    "active_deadline",
    "decide_pytorchjob",
    "pytorchjob_finished",
    "render_pytorchjob",
    "rendezvous_host_pod",
]

GROUP: Final = "kubeflow.org"
VERSION: Final = "v1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
PLURAL: Final = "pytorchjobs"
#: The training operator labels every pod of a job with the job's name.
POD_LABEL: Final = "training.kubeflow.org/job-name"


def accepts(config: TaskConfig) -> bool:
    """Everything the Pod kind does not take: several nodes (elastic or not), or a Master/Worker job."""
    return not (isinstance(config, Elastic) and config.max_nodes == 1)


# --- render ------------------------------------------------------------------------------------------------------


def _replica_spec(
    inputs: RenderInputs, replica_type: str, replica: Master | Worker | None, replicas: int, command: list[str]
) -> JsonDict:
    replica = replica or Worker()
    options = merge_pod_options(inputs.options, replica.pod)
    template = render_pod_template(
        PodSettings(
            where=f"pytorchReplicaSpecs.{replica_type}.template",
            options=options,
            image=replica.image if replica.image is not None else inputs.image,
            default_image=inputs.default_image,
            image_required=inputs.image_required,
            requests={**options.requests, **replica.requests},
            limits={**options.limits, **replica.limits},
            command=command,
            payload_secret=inputs.payload_secret,
            labels=inputs.labels,
            annotations=inputs.annotations,
            env=inputs.worker_env,
        )
    )
    # The restart policy lives on the replica: the training operator overwrites the pod's own (ExitCode -> Never).
    return {"replicas": replicas, "restartPolicy": replica.restart_policy.value, "template": template}


def _run_policy(inputs: RenderInputs) -> JsonDict:
    """Only what was given: the training operator's defaults stay its own."""
    run_policy: JsonDict = {}
    policy = inputs.config.run_policy
    if policy is not None:
        if policy.clean_pod_policy is not None:
            run_policy["cleanPodPolicy"] = policy.clean_pod_policy.value
        for key, value in (
            ("ttlSecondsAfterFinished", policy.ttl_seconds_after_finished),
            ("activeDeadlineSeconds", policy.active_deadline_seconds),
            ("backoffLimit", policy.backoff_limit),
        ):
            if value is not None:
                run_policy[key] = value
    if inputs.job_options.scheduling_policy is not None:
        run_policy["schedulingPolicy"] = copy.deepcopy(dict(inputs.job_options.scheduling_policy))
    if inputs.job_options.suspend:
        run_policy["suspend"] = True
    return run_policy


def render_pytorchjob(inputs: RenderInputs) -> JsonDict:
    config = inputs.config
    launch = config_to_launch_spec(config)
    # No --nnodes: the training operator sets PET_NNODES ("min:max" for elastic, the replica count otherwise).
    command = pod_runner_command(inputs, launch)
    spec: JsonDict = {}
    if isinstance(config, Elastic):
        # Rendezvous settings travel on the runner's command line (--rdzv-conf), not as rdzvConf: an empty rdzvConf
        # list breaks the operator's env builder, and one place is easier to reason about than two.
        spec["elasticPolicy"] = {
            "minReplicas": config.min_nodes,
            "maxReplicas": config.max_nodes,
            "rdzvBackend": "c10d",
            "maxRestarts": config.max_restarts,
        }
        replica_specs = {"Worker": _replica_spec(inputs, "Worker", None, config.max_nodes, command)}
    else:
        replica_specs = {"Master": _replica_spec(inputs, "Master", config.master, 1, command)}
        # The webhook rejects Worker.replicas 0; a Master-only job simply has no Worker entry.
        if config.worker_replicas > 0:
            replica_specs["Worker"] = _replica_spec(inputs, "Worker", config.worker, config.worker_replicas, command)
    # spec.nprocPerNode (a string), not the deprecated elasticPolicy.nProcPerNode (the webhook forbids both).
    spec["nprocPerNode"] = str(config.nproc_per_node)
    spec["pytorchReplicaSpecs"] = replica_specs
    run_policy = _run_policy(inputs)
    if run_policy:
        spec["runPolicy"] = run_policy
    return {"apiVersion": API_VERSION, "kind": "PyTorchJob", "metadata": job_metadata(inputs), "spec": spec}


# --- decide ------------------------------------------------------------------------------------------------------


def _total_replicas(job: Mapping[str, Any]) -> int:
    specs = job.get("spec", {}).get("pytorchReplicaSpecs", {})
    return sum(int(spec.get("replicas", 1)) for spec in specs.values()) or 1


def pytorchjob_finished(job: Mapping[str, Any]) -> bool:
    return true_condition(job, "Succeeded") is not None or true_condition(job, "Failed") is not None


def _min_nodes(job: Mapping[str, Any], total: int) -> int:
    """How many pods the job needs running to make progress: elastic ``minReplicas``, else all of them."""
    elastic = job.get("spec", {}).get("elasticPolicy") or {}
    minimum = elastic.get("minReplicas")
    return int(minimum) if isinstance(minimum, int) and 0 < minimum <= total else total


def decide_pytorchjob(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """A Kubeflow PyTorchJob: its conditions, and the reports of its pods."""
    return with_pods(_decide_pytorchjob(ref, snapshot, policy), snapshot, snapshot.pods)


def _decide_pytorchjob(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """The job's state, most final first: stuck pods, past its deadline, Failed, Succeeded, suspended, then waiting
    for capacity or running."""
    job = snapshot.job
    if job is None:
        return _vanished(ref, snapshot)
    seen = Observed(
        ref=ref,
        job=job,
        pods=list(snapshot.pods),
        total=_total_replicas(job),
        now=snapshot.now,
        pull_errors=snapshot.pull_errors,
    )
    stuck = stuck_decision(seen, policy)
    if stuck is not None:
        return stuck
    failed = true_condition(job, "Failed")
    succeeded = true_condition(job, "Succeeded") is not None
    deadline = active_deadline(job)
    if failed is None and not succeeded and deadline is not None and seen.now >= deadline[1]:
        # The training operator checks activeDeadlineSeconds only when an event makes it reconcile the job
        # (kubeflow/trainer v1.9 common/job.go: its timed re-check goes to a no-op queue), so a quiet job runs past
        # it. The wait enforces it itself, from the same start time, and stops the job.
        return _past_deadline(seen, deadline[0])
    if failed is not None:
        return _decide_failed(seen, failed, succeeded=succeeded)
    if succeeded:
        return _decide_succeeded(seen)
    if is_suspended(job):
        return suspended_decision(seen, policy)
    if snapshot.create_error and not seen.pods and not _ever_ran(job):
        # Never ran, so the operator's FailedCreatePod Warning is about this job's first pods, not a stale one.
        return pods_not_created(seen, policy, snapshot.create_error, KIND.controller or "its controller")
    return _decide_unfinished(seen, policy, deadline)


def _ever_ran(job: Mapping[str, Any]) -> bool:
    """Whether the job had a Running condition, true or not since (the operator keeps a condition it set)."""
    return any(condition.get("type") == "Running" for condition in job.get("status", {}).get("conditions") or [])


def _past_deadline(seen: Observed, seconds: int) -> WaitDecision:
    ref = seen.ref
    detail = (
        f"{ref.kind} {ref.namespace}/{ref.name}: {_DEADLINE_PREFIX}={seconds} (counted from its start time) and was "
        "stopped by the provider; a retry would run into the same limit"
    )
    return seen.stopped("failed (past run_policy.active_deadline_seconds)", causes.DEADLINE, detail)


def _decide_failed(seen: Observed, failed: Mapping[str, Any], *, succeeded: bool) -> WaitDecision:
    """A Failed job: the root cause its pods reported, else what its condition says."""
    # The job fails as soon as one replica does; its peers end a moment later, and the earliest failure (the
    # root cause) may be on a pod that has not ended yet. Give the pods that still run a moment to report.
    failed_at = parse_time(failed.get("lastTransitionTime")) or seen.now
    if seen.running and seen.now - failed_at < _FAILED_SETTLE_SECONDS:
        return seen.decision(Phase.RUNNING, "Failed, waiting for its pods to report")
    verdict = decide_run(seen.reports())
    by_condition = _failed_condition_verdict(seen.job, failed)
    if verdict.failure is None:
        # No worker reported an exception: the job's own condition says why (deadline, backoff limit), and
        # pods stopped because of it (exit 143) are consequences, not causes.
        if verdict.succeeded or not verdict.node or by_condition.detail.startswith(_DEADLINE_PREFIX):
            verdict = by_condition
    elif _says_more(failed):
        # The root cause, and what the training operator did about it (restarts up to the backoff limit).
        verdict = replace(verdict, detail=f"{verdict.detail}; {by_condition.detail}")
    if succeeded:
        # Both at once: the operator checks success and failure in one pass (elastic success does not return
        # before the failure check, and replica types come in random order). The verdict is the pods', never
        # the order the operator happened to write: any rank that failed fails the task.
        verdict = replace(verdict, detail=f"{verdict.detail}; {_BOTH_CONDITIONS}")
    return seen.decision(Phase.FAILED, "Failed", verdict=verdict)


def _decide_succeeded(seen: Observed) -> WaitDecision:
    # An elastic PyTorchJob is Succeeded as soon as *one* worker succeeds; rank 0 may be on another pod that
    # is still at its exit barrier. Wait for the pod that reports rank 0's result. Pods that never got
    # capacity (an elastic job that ran on fewer nodes) will not end: they are not waited for.
    reports = seen.reports()
    holders = [r for r in reports if r.outcome is not None and r.outcome.holds_rank0]
    started = len(seen.pods) - len(seen.waiting_for_capacity)
    if holders or len(reports) >= started:
        verdict = decide_run(reports)
        return seen.decision(phase_of(verdict), "Succeeded", verdict=verdict)
    return seen.decision(Phase.RUNNING, "Succeeded, waiting for rank 0's pod")


def _decide_unfinished(seen: Observed, policy: WaitPolicy, deadline: tuple[int, float] | None) -> WaitDecision:
    """Neither ended nor suspended: waiting for the pods it cannot start without, else running or pending (woken
    at its deadline, which the wait enforces)."""
    job = seen.job
    waits = seen.waiting_for_capacity
    wake_at = deadline[1] if deadline is not None else None
    host = rendezvous_host_pod(job)
    host_wait = next((wait for wait in waits if wait.pod == host), None)
    if host_wait is not None:
        # Elastic rendezvous: the c10d store lives on the pod PET_RDZV_ENDPOINT names (worker-0), and only that pod
        # can host it; without it no other worker can join, however many run.
        what = f"{describe_wait(host_wait)} (it hosts the rendezvous; no worker can start without it)"
        return replace(out_of_patience(seen, policy, host_wait.since, what, host_wait.pod), wake_at=wake_at)
    if waits and seen.placed < _min_nodes(job, seen.total):
        # The job cannot start (or go on) without these pods: waiting for capacity, bounded by scheduling_timeout.
        first = min(waits, key=lambda wait: wait.since)
        return replace(out_of_patience(seen, policy, first.since, describe_wait(first), first.pod), wake_at=wake_at)
    # Enough pods run (elastic partial capacity: the rest may join later, or never): the job makes progress.
    for state in ("Restarting", "Running"):
        if true_condition(job, state) is not None:
            phase = Phase.RUNNING if seen.running else Phase.PENDING
            return seen.decision(phase, state, wake_at=wake_at)
    created = "Created" if true_condition(job, "Created") else "Pending"
    queue = queue_name(job)
    if queue:
        created += f" (Kueue LocalQueue {queue})"
    return seen.decision(Phase.PENDING, created, wake_at=wake_at)


def active_deadline(job: Mapping[str, Any]) -> tuple[int, float] | None:
    """``(activeDeadlineSeconds, the Unix time it expires)`` of a started PyTorchJob, or None.

    Counted from ``status.startTime``, as the training operator counts it (a resumed job's start time is reset).
    A job that has not started, or is suspended, has no deadline running.
    """
    seconds = (job.get("spec", {}).get("runPolicy") or {}).get("activeDeadlineSeconds")
    started = parse_time(job.get("status", {}).get("startTime"))
    if not isinstance(seconds, int) or isinstance(seconds, bool) or started is None or is_suspended(job):
        return None
    return seconds, started + seconds


def rendezvous_host_pod(job: Mapping[str, Any]) -> str | None:
    """The pod that hosts an elastic PyTorchJob's c10d store: ``<job>-worker-0``, unless ``rdzvHost`` moves it.

    The training operator points every worker's ``PET_RDZV_ENDPOINT`` at ``<job>-worker-0`` (kubeflow/trainer v1.9
    ``pytorch/elastic.go``), and torch elastic hosts the store only on the machine that address resolves to.
    """
    spec = job.get("spec", {})
    elastic = spec.get("elasticPolicy")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if elastic is None or "Master" in replicas or "Worker" not in replicas or elastic.get("rdzvHost"):
        return None
    return f"{job.get('metadata', {}).get('name', '')}-worker-0"


def _vanished(ref: JobRef, snapshot: Snapshot) -> WaitDecision:
    """The job is gone. With ``ttlSecondsAfterFinished`` set, the training operator itself may have deleted it, and
    with a TTL of 0 a job failed by its backoff limit or deadline is deleted *before* its Failed condition is written
    (kubeflow/trainer v1.9 common/job.go: CleanupJob before UpdateJobConditions). What the wait saw last then says
    why it failed; without that evidence (or without a TTL: someone deleted it) a retry may help."""
    last = snapshot.last_seen
    job = last.job if last is not None else None
    if (
        last is None
        or job is None
        or (job.get("spec", {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished") is None
    ):
        return job_gone(ref)
    seen = Observed(ref=ref, job=job, pods=list(last.pods), total=_total_replicas(job), now=snapshot.now)
    gone = (
        f"then {ref.kind} {ref.namespace}/{ref.name} vanished: its ttlSecondsAfterFinished deleted it as it failed, "
        "before its Failed condition was written"
    )
    state = "Failed (deleted by its TTL)"
    verdict = decide_run(seen.reports())
    if not verdict.succeeded and verdict.node:
        return seen.decision(Phase.FAILED, state, verdict=replace(verdict, detail=f"{verdict.detail}; {gone}"))
    deadline = active_deadline(job)
    if deadline is not None and snapshot.now >= deadline[1]:
        detail = f"{_DEADLINE_PREFIX}={deadline[0]} and was stopped; {gone}"
        return seen.decision(
            Phase.FAILED, state, verdict=Verdict(succeeded=False, detail=detail, cause=causes.DEADLINE)
        )
    limit = (job.get("spec", {}).get("runPolicy") or {}).get("backoffLimit")
    restarts = sum(_restarts(pod) for pod in last.pods)
    if isinstance(limit, int) and restarts and restarts >= limit:
        detail = f"its pods restarted {restarts} times, reaching backoffLimit={limit}; {gone}"
        return seen.decision(Phase.FAILED, state, verdict=Verdict(succeeded=False, detail=detail))
    return job_gone(ref)


def _restarts(pod: Mapping[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return sum(int(status.get("restartCount") or 0) for status in statuses)


_DEADLINE_PREFIX: Final = "the job ran longer than run_policy.active_deadline_seconds"


_BOTH_CONDITIONS: Final = (
    "the PyTorchJob is both Succeeded and Failed (the training operator wrote both in one pass); the pods decide: "
    "a rank that failed fails the task"
)


#: How long a failed job's still-running pods may take to report before the verdict is taken without them.
_FAILED_SETTLE_SECONDS: Final = 10.0


def _says_more(condition: Mapping[str, Any]) -> bool:
    """Whether a Failed condition tells more than "a replica failed": a backoff limit or a deadline was reached."""
    message = str(condition.get("message", "")).lower()
    return "backoff" in message or "deadline" in message


def _failed_condition_verdict(job: Mapping[str, Any], condition: Mapping[str, Any]) -> Verdict:
    message = condition.get("message", "") or condition.get("reason", "")
    deadline = job.get("spec", {}).get("runPolicy", {}).get("activeDeadlineSeconds")
    if deadline is not None and "deadline" in message.lower():
        return Verdict(
            succeeded=False,
            cause=causes.DEADLINE,
            detail=f"{_DEADLINE_PREFIX}={deadline} and was stopped ({message})",
        )
    return Verdict(succeeded=False, recoverable=False, detail=f"the PyTorchJob failed: {message}")


# --- the rendered-template view ----------------------------------------------------------------------------------


def _abbreviate(manifest: JsonDict) -> JsonDict:
    """The workload with its repetition folded: pod-template labels and annotations that the job carries too, and a
    replica template identical to an earlier one."""
    short = copy.deepcopy(manifest)
    job_metadata = short.get("metadata", {})
    seen: dict[str, JsonDict] = {}
    for replica_type, replica in short["spec"].get("pytorchReplicaSpecs", {}).items():
        template = replica.get("template", {})
        metadata = template.get("metadata", {})
        for key in ("labels", "annotations"):
            inherited = job_metadata.get(key, {})
            kept = {k: v for k, v in metadata.get(key, {}).items() if inherited.get(k) != v}
            if kept:
                metadata[key] = kept
            elif key in metadata:
                metadata[key] = "<as on the job>"
        same_as = next((name for name, earlier in seen.items() if earlier == template), None)
        seen[replica_type] = copy.deepcopy(template)
        if same_as is not None:
            replica["template"] = f"<same as {same_as}>"
    return short


def _digest_spec(manifest: JsonDict) -> JsonDict:
    spec = manifest.get("spec", {})
    short_spec: JsonDict = {key: spec[key] for key in ("elasticPolicy", "nprocPerNode", "runPolicy") if key in spec}
    short_spec["pytorchReplicaSpecs"] = {
        replica_type: {
            "replicas": replica.get("replicas"),
            "restartPolicy": replica.get("restartPolicy"),
            "pytorch": pod_spec_digest(replica.get("template", {}).get("spec", {})),
        }
        for replica_type, replica in spec.get("pytorchReplicaSpecs", {}).items()
    }
    return short_spec


def _replica_count(job: Mapping[str, Any]) -> int | None:
    specs = job.get("spec", {}).get("pytorchReplicaSpecs")
    if not isinstance(specs, Mapping):
        return None
    return sum(_int(spec.get("replicas", 1), 1) for spec in specs.values()) or 1


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _pods(name: str) -> str:
    return f"{POD_LABEL}={name}"


def _training_containers(workload: Mapping[str, Any]) -> dict[str, Any]:
    """Each replica type's training container."""
    return {
        replica: container
        for replica, template in _pod_templates(workload).items()
        for container in (template.get("spec") or {}).get("containers") or []
        if container.get("name") == TRAINING_CONTAINER
    }


def _pod_templates(workload: Mapping[str, Any]) -> dict[str, Any]:
    """Each replica type's pod template, which the training operator makes that replica's pods from."""
    specs = (workload.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return {replica: spec["template"] for replica, spec in specs.items() if isinstance(spec.get("template"), dict)}


def _pod_order(pod: Mapping[str, Any]) -> tuple[int, int, str]:
    """Master first (it holds rank 0 when there is one), then workers by index (the training operator's labels)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    order = replica_order(str(labels.get(REPLICA_TYPE_LABEL, "")), _int(labels.get(REPLICA_INDEX_LABEL), 0))
    return (*order, str(metadata.get("name", "")))


#: The Kubeflow training operator v1.9, standalone install (what the preflight tells a cluster without it).
_TRAINING_OPERATOR_KUSTOMIZATION: Final = "github.com/kubeflow/training-operator.git/manifests/overlays/standalone"
TRAINING_OPERATOR_INSTALL: Final = f'kubectl apply --server-side -k "{_TRAINING_OPERATOR_KUSTOMIZATION}?ref=v1.9.0"'


KIND: Final = JobKind(
    kind="PyTorchJob",
    group=GROUP,
    version=VERSION,
    plural=PLURAL,
    accepts=accepts,
    render=render_pytorchjob,
    pod_selector=_pods,
    decide=decide_pytorchjob,
    is_finished=pytorchjob_finished,
    pod_owner_label=POD_LABEL,
    pod_order=_pod_order,
    training_containers=_training_containers,
    pod_templates=_pod_templates,
    replica_count=_replica_count,
    abbreviate=_abbreviate,
    digest_spec=_digest_spec,
    controller="the Kubeflow training operator",
    install_hint=f"install the Kubeflow training operator v1.9: {TRAINING_OPERATOR_INSTALL}",
)

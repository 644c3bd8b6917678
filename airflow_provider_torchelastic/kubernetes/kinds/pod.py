"""The Pod kind: a task of one node runs as a bare Pod, with no training operator.

It is its own only pod: the pod's phase and the runner's report in its termination message are the job's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.config import Elastic, TaskConfig
from airflow_provider_torchelastic.core.launch import config_to_launch_spec
from airflow_provider_torchelastic.core.naming import TRAINING_CONTAINER
from airflow_provider_torchelastic.core.outcome import Verdict, decide_run
from airflow_provider_torchelastic.kubernetes import status
from airflow_provider_torchelastic.kubernetes.kinds.descriptor import JobKind
from airflow_provider_torchelastic.kubernetes.pod_template import (
    JsonDict,
    PodSettings,
    RenderInputs,
    invalid,
    pod_runner_command,
    pod_spec_digest,
    render_pod_template,
    set_field,
)
from airflow_provider_torchelastic.kubernetes.status import Observed
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

__all__ = ["KIND", "decide_pod", "pod_finished", "render_pod"]


def accepts(config: TaskConfig) -> bool:
    """One node, and not a Master/Worker job: nothing needs a training operator."""
    return isinstance(config, Elastic) and config.max_nodes == 1


# --- render ------------------------------------------------------------------------------------------------------


def render_pod(inputs: RenderInputs) -> JsonDict:
    config = inputs.config
    if not isinstance(config, Elastic):  # pragma: no cover - the Pod kind accepts only single-node Elastic here
        raise TypeError(f"a single Pod renders only Elastic(nnodes=1), got {config!r}")
    job_options = inputs.job_options
    if job_options.suspend or job_options.scheduling_policy is not None:
        raise invalid(
            "JobOptions",
            job_options,
            "no job options for a single-node task (they apply to a PyTorchJob; it runs as one Pod). "
            "For Kueue, label the pod: PodOptions(labels={'kueue.x-k8s.io/queue-name': ...})",
        )
    spec = config_to_launch_spec(config)
    command = pod_runner_command(inputs, spec, nnodes="1")
    template = render_pod_template(
        PodSettings(
            where="Pod",
            options=inputs.options,
            image=inputs.image,
            default_image=inputs.default_image,
            image_required=inputs.image_required,
            requests=inputs.options.requests,
            limits=inputs.options.limits,
            command=command,
            payload_secret=inputs.payload_secret,
            labels=inputs.labels,
            annotations=inputs.annotations,
            # What the training operator gives every container of a PyTorchJob: logs arrive as they are written.
            env=[{"name": "PYTHONUNBUFFERED", "value": "1"}, *inputs.worker_env],
        )
    )
    metadata = {"name": inputs.name, "namespace": inputs.namespace, **template.get("metadata", {})}
    pod_spec = template["spec"]
    # Airflow decides about retries (a new try, a new pod); the kubelet restarting the runner would rerun rank 0.
    pod_spec["restartPolicy"] = "Never"
    if config.run_policy is not None and config.run_policy.active_deadline_seconds is not None:
        set_field("Pod.spec", pod_spec, "activeDeadlineSeconds", config.run_policy.active_deadline_seconds, "RunPolicy")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# --- decide ------------------------------------------------------------------------------------------------------


def pod_finished(pod: Mapping[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def decide_pod(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """A single Pod (one node): it is its own only pod."""
    decision = _decide_pod(ref, snapshot, policy)
    return status.with_pods(decision, snapshot, [snapshot.job] if snapshot.job is not None else [])


def _decide_pod(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    job = snapshot.job
    if job is None:
        return status.job_gone(ref)
    seen = Observed(ref=ref, job=job, pods=[job], total=1, now=snapshot.now, pull_errors=snapshot.pull_errors)
    stuck = status.stuck_decision(seen, policy)
    if stuck is not None:
        return stuck
    phase = job.get("status", {}).get("phase", "Pending")
    if pod_finished(job):
        reports = seen.reports()
        verdict = decide_run(reports) if reports else Verdict(succeeded=False, detail=f"pod ended {phase}")
        return seen.decision(status.phase_of(verdict), phase, verdict=verdict)
    waits = seen.waiting_for_capacity
    if waits:
        return status.out_of_patience(seen, policy, waits[0].since, status.describe_wait(waits[0]), waits[0].pod)
    return seen.decision(Phase.RUNNING if phase == "Running" else Phase.PENDING, phase)


def _training_containers(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The Pod's own training container, as its one replica."""
    containers = (workload.get("spec") or {}).get("containers") or []
    found = [container for container in containers if container.get("name") == TRAINING_CONTAINER]
    return {"pod": found[0]} if found else {}


def _digest_spec(manifest: JsonDict) -> JsonDict:
    return pod_spec_digest(manifest.get("spec", {}))


KIND: Final = JobKind(
    kind="Pod",
    group="",
    version="v1",
    plural="pods",
    accepts=accepts,
    render=render_pod,
    pod_selector=lambda name: None,
    pod_controllers=(),
    decide=decide_pod,
    is_finished=pod_finished,
    replica_count=lambda job: 1,
    training_containers=_training_containers,
    digest_spec=_digest_spec,
)

"""What a TrainJob cannot run, said with the field, the value and why: the parse-time checks of the TrainJob kind
(:mod:`.trainjob`), read against kubeflow/trainer v2.3.0 (``../shared/notes/trainer-v2.md``).

A TrainJob runs a fixed number of nodes on a runtime: no elastic range (KEP-2903 is open), no restart policy, backoff
limit, TTL or clean-up policy of its own, one pod for every node, and pod customisation only where a runtime patch
has a place for it. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from airflow_provider_torchelastic.core.config import Elastic, RestartPolicy, TaskConfig
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.kubernetes.pod_template import CONTAINER_NAME

__all__ = [
    "MAX_NODE_DIGITS",
    "PATCH_ONLY",
    "POD_PATCH_FIELDS",
    "RESERVED_ENV",
    "accepts",
    "cannot",
    "check_trainjob_config",
    "check_trainjob_options",
]

#: What the torch plugin injects into the ``node`` container and refuses in ``trainer.env``
#: (``constants.TorchRunReservedEnvNames``).
RESERVED_ENV: Final = frozenset(
    {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
#: JobSet's webhook refuses a JobSet whose longest pod name, ``<js>-<rjob>-<job index>-<pod index>`` plus the
#: indexed Job's 5-character random suffix, is not a DNS-1035 label (jobset ``pkg/webhooks/jobset_webhook.go``); it
#: would show only as an event on the TrainJob. Up to 99999 nodes: the pod index has at most 5 digits.
MAX_NODE_DIGITS: Final = 5


def cannot(where: str, value: object, why: str) -> ValueError:
    return ValueError(f"{where}: a TrainJob cannot take {value!r}: {why}")


def _limitation(config: TaskConfig) -> ValueError | None:
    """Why ``config`` cannot run as a TrainJob, or None."""
    nodes = config.max_nodes if isinstance(config, Elastic) else config.nnodes
    if nodes >= 10**MAX_NODE_DIGITS:
        return cannot("the node count", nodes, f"JobSet's pod names leave room for {MAX_NODE_DIGITS} digits")
    if isinstance(config, Elastic):
        if config.min_nodes != config.max_nodes:
            return cannot(
                "Elastic.nnodes",
                config.nnodes,
                "it runs a fixed number of nodes (Kubeflow Trainer v2.3 has no elastic training; KEP-2903, "
                f"kubeflow/trainer#2903, is open); use nnodes={config.max_nodes} or a PyTorchJob for a range",
            )
        if config.max_nodes == 1:
            return cannot("Elastic.nnodes", config.nnodes, "one node runs as a Pod, not a TrainJob")
        if config.max_restarts:
            return cannot(
                "Elastic.max_restarts",
                config.max_restarts,
                "the Trainer gives the nodes a static rendezvous (PET_MASTER_ADDR, PET_NODE_RANK), which cannot "
                "restart the workers of all nodes together; use 0, and Airflow's retries with checkpoints",
            )
    else:
        if config.nnodes == 1:
            return cannot("PyTorch.worker.replicas", 0, "a Master-only job is one node: use Elastic(nnodes=1)")
        for replica_type, replica in (("master", config.master), ("worker", config.worker)):
            if replica.restart_policy is not RestartPolicy.NEVER:
                return cannot(
                    f"PyTorch.{replica_type}.restart_policy",
                    replica.restart_policy.value,
                    "it has no restart policy field (the runtime's Job decides: torch-distributed restarts failed "
                    "pods in place, up to the Job's backoffLimit); leave the default, Never",
                )
        for name in ("image", "requests", "limits", "pod"):
            master, worker = getattr(config.master, name), getattr(config.worker, name)
            if master != worker:
                return cannot(
                    f"PyTorch.master.{name}",
                    master,
                    f"every node gets the same pod (one image, trainer.resourcesPerNode); the worker's is "
                    f"{worker!r}: set the same on Master and Worker",
                )
    policy = config.run_policy
    for name in ("clean_pod_policy", "ttl_seconds_after_finished", "backoff_limit"):
        value = getattr(policy, name) if policy is not None else None
        if value is not None:
            why = "it has no such field (of RunPolicy it takes active_deadline_seconds only)"
            return cannot(f"RunPolicy.{name}", getattr(value, "value", value), why)
    return None


def check_trainjob_config(config: TaskConfig) -> None:
    """Raise a ValueError naming the field, the value and why, if ``config`` cannot run as a TrainJob."""
    problem = _limitation(config)
    if problem is not None:
        raise problem


def accepts(config: TaskConfig) -> bool:
    """Several nodes, a fixed number of them, and nothing a TrainJob has no field for."""
    return _limitation(config) is None


#: The pod-spec fields a runtime patch carries (``PodSpecPatch`` of kubeflow/trainer v2.3.0).
POD_PATCH_FIELDS: Final = frozenset(
    {"serviceAccountName", "volumes", "imagePullSecrets", "securityContext", "nodeSelector", "affinity"}
    | {"tolerations", "schedulingGates", "terminationGracePeriodSeconds"}
)
#: The training container's fields with a place: the trainer block's image, env and resourcesPerNode, the patch's
#: volumeMounts and securityContext.
_CONTAINER_FIELDS: Final = frozenset({"name", "image", "env", "resources", "volumeMounts", "securityContext"})
PATCH_ONLY: Final = (
    f"a runtime patch sets only {', '.join(sorted(POD_PATCH_FIELDS))} of a pod, and env, volumeMounts and "
    "securityContext of a runtime's container"
)
_OPTIONS_WITHOUT_PLACE: Final = {
    "image_pull_policy": "the runtime's container decides it",
    "env_from": "trainer.env takes single variables only; use env= with secret_key_ref()/config_map_key_ref()",
    "priority_class_name": "set it in the runtime (or use a Kueue WorkloadPriorityClass label on the job)",
    "automount_service_account_token": "name a service account whose automountServiceAccountToken is false "
    "(PodOptions(service_account_name=...)), or set it in the runtime",
}


def check_trainjob_options(options: PodOptions, job_options: JobOptions) -> None:
    """Raise a ValueError naming what the pod and job options ask that a TrainJob has no place for."""
    if job_options.scheduling_policy is not None:
        raise cannot(
            "JobOptions.scheduling_policy",
            dict(job_options.scheduling_policy),
            "it has no schedulingPolicy (gang scheduling is the runtime's podGroupPolicy; Kueue queues by label)",
        )
    for name, why in _OPTIONS_WITHOUT_PLACE.items():
        value = getattr(options, name)
        if value not in (None, ()):
            raise cannot(f"PodOptions.{name}", value, f"{PATCH_ONLY}; {why}")
    spec = options.template.get("spec", {})
    extra = sorted(set(spec) - POD_PATCH_FIELDS - {"containers"})
    if extra:
        raise cannot(f"PodOptions.pod_template.spec.{extra[0]}", spec[extra[0]], PATCH_ONLY)
    for container in spec.get("containers", []):
        where = f"PodOptions.pod_template.spec.containers[{container['name']!r}]"
        if container["name"] != CONTAINER_NAME:
            raise cannot(where, container["name"], "it cannot add containers: the runtime's are the pods' containers")
        extra = sorted(set(container) - _CONTAINER_FIELDS)
        if extra:
            raise cannot(f"{where}.{extra[0]}", container[extra[0]], PATCH_ONLY)
        for item in container.get("env", []):
            if item.get("name") in RESERVED_ENV:
                raise cannot(f"{where}.env[{item['name']!r}]", item, "the Trainer sets it for torchrun and refuses it")

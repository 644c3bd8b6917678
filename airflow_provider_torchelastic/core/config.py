"""Typed task configuration: what a DAG author writes in ``task_config=``.

Everything here is pure (standard library only) and validated in ``__post_init__``, so a bad value fails
while the DAG file is parsed, with a message that names the field, the value given and what is expected (the shared
checks live in ``validation``, below this module and ``pod``).
The string enums carry the PyTorchJob API spellings, so rendering never has to translate them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Final, TypeAlias, cast

from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.core.public import publish
from airflow_provider_torchelastic.core.validation import (
    check_image,
    check_int,
    check_resources,
    check_seconds,
    fail,
    is_int,
    is_number,
)

__all__ = [
    "DEFAULT_MONITOR_INTERVAL",
    "CleanPodPolicy",
    "Elastic",
    "Master",
    "PyTorch",
    "RestartPolicy",
    "RunPolicy",
    "TaskConfig",
    "Worker",
]

#: torchrun's symbolic ``--nproc-per-node`` values, resolved on the node that runs the workers.
NPROC_SYMBOLS: Final = ("auto", "cpu", "gpu")
START_METHODS: Final = ("spawn", "fork")
DEFAULT_RDZV_CONFIGS: Final[Mapping[str, Any]] = MappingProxyType({"timeout": 900, "join_timeout": 900})
#: ``rdzv_configs`` keys that torch elastic reads with ``int()`` (``RendezvousParameters.get_as_int``), all of them
#: positive: the launcher's ``timeout``; the c10d store's ``read_timeout``; the dynamic handler's ``join``,
#: ``last_call``, ``close`` and ``heartbeat`` timeouts and its keep-alive settings. A float such as 1.5 fails in the
#: pod, as "1.5" does not parse as an int.
RDZV_INT_KEYS: Final = frozenset(
    {
        "timeout",
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "read_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
    }
)
#: ``rdzv_configs`` keys that torch elastic reads as bools (``get_as_bool``): whether this node hosts the c10d store.
RDZV_BOOL_KEYS: Final = frozenset({"is_host"})


class RestartPolicy(str, Enum):
    """Replica restart policy, as the PyTorchJob API spells it."""

    ALWAYS = "Always"
    ON_FAILURE = "OnFailure"
    NEVER = "Never"
    #: Exit codes 1-127 are permanent, 128-255 are restarted (the runner exits >= 128 on a recoverable error).
    EXIT_CODE = "ExitCode"


class CleanPodPolicy(str, Enum):
    """Which pods the training operator deletes once the job finished."""

    NONE = "None"
    RUNNING = "Running"
    ALL = "All"


def _coerce_enum(owner: str, name: str, value: object, enum: type[Enum], *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum)
        raise fail(owner, name, value, f"one of {allowed}") from None


@dataclass(frozen=True, kw_only=True)
class RunPolicy:
    """Job-wide policies of a PyTorchJob; unset fields keep the training operator's defaults."""

    #: Pods to delete when the job finishes (operator default: ``None``, keep all).
    clean_pod_policy: CleanPodPolicy | None = None
    #: Seconds after which a finished job is deleted by the training operator.
    ttl_seconds_after_finished: int | None = None
    #: Seconds after start at which the training operator fails the job.
    active_deadline_seconds: int | None = None
    #: Restarts the training operator allows before it fails the job.
    backoff_limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "clean_pod_policy",
            _coerce_enum("RunPolicy", "clean_pod_policy", self.clean_pod_policy, CleanPodPolicy, optional=True),
        )
        for name in ("ttl_seconds_after_finished", "active_deadline_seconds", "backoff_limit"):
            check_int("RunPolicy", name, getattr(self, name), minimum=0, optional=True)
        if self.active_deadline_seconds == 0:
            raise fail("RunPolicy", "active_deadline_seconds", 0, "an int >= 1 (0 would fail the job at once)")


def _check_run_policy(owner: str, value: object) -> None:
    if value is not None and not isinstance(value, RunPolicy):
        raise fail(owner, "run_policy", value, "a RunPolicy(...) or None", TypeError)


def _check_nproc(owner: str, value: object) -> int | str:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, str):
        if value not in NPROC_SYMBOLS:
            raise fail(owner, "nproc_per_node", value, "an int >= 1 or one of 'auto', 'cpu', 'gpu'")
        return value
    check_int(owner, "nproc_per_node", value, minimum=1)
    return value  # type: ignore[return-value]


def _check_rdzv_configs(value: object) -> Mapping[str, Any]:
    """The user's rendezvous settings merged over the defaults, checked the way torch elastic will read them.

    They travel as ``--rdzv-conf k=v,k=v`` (``launch.format_rdzv_conf``) and come back as strings, so a ``,`` or ``=``
    in a key or value would split differently, and a value torch reads with ``int()`` must be an int here.
    """
    owner, name = "Elastic", "rdzv_configs"
    if not isinstance(value, Mapping):
        raise fail(owner, name, value, "a mapping with string keys, e.g. {'join_timeout': 600}", TypeError)
    # Merged over the defaults so that setting one key does not silently drop the 900 s timeouts.
    merged = {**DEFAULT_RDZV_CONFIGS, **value}
    for key, item in merged.items():
        expected_key = "non-empty string keys without ',' or '=' (they are passed as k=v,k=v)"
        if not isinstance(key, str):
            raise fail(owner, name, key, expected_key, TypeError)
        if not key.strip() or "," in key or "=" in key:
            raise fail(owner, name, key, expected_key)
        where = f"{name}[{key!r}]"
        if key in RDZV_INT_KEYS:
            expected = "an int >= 1 (torch elastic reads it with int())"
            if not is_int(item):
                raise fail(owner, where, item, expected, TypeError)
            if item < 1:
                raise fail(owner, where, item, expected)
        elif key in RDZV_BOOL_KEYS:
            if not (isinstance(item, bool) or item in (0, 1)) or isinstance(item, float):
                raise fail(owner, where, item, "a bool (or 0/1)", TypeError)
        elif not (isinstance(item, str | bool) or is_number(item)):
            raise fail(owner, where, item, "a str, int, float or bool", TypeError)
        elif isinstance(item, str) and (not item.strip() or "," in item or "=" in item):
            raise fail(owner, where, item, "a non-empty value without ',' or '=' (it is passed as k=v,k=v)")
    return MappingProxyType(merged)


@dataclass(frozen=True, kw_only=True)
class _Replica:
    #: Container image; ``None`` uses the operator's ``image``.
    image: str | None = None
    #: Resource requests, e.g. ``{"cpu": "4", "memory": "16Gi"}``.
    requests: Mapping[str, str] = field(default_factory=dict)
    #: Resource limits; GPUs go here, e.g. ``{"nvidia.com/gpu": 8}``.
    limits: Mapping[str, str] = field(default_factory=dict)
    #: ``Never`` by default, so that Airflow, not the cluster, decides about retries.
    restart_policy: RestartPolicy = RestartPolicy.NEVER
    #: Pod customization for this replica only, merged over the operator's ``pod_options``
    #: (see ``airflow_provider_torchelastic.core.pod_options.merge_pod_options``).
    pod: PodOptions | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.pod is not None and not isinstance(self.pod, PodOptions):
            raise fail(owner, "pod", self.pod, "a PodOptions(...) or None", TypeError)
        # Not a templated field (task_config is not rendered): a "{{ ... }}" here would reach the pod as written.
        check_image(owner, "image", self.image)
        object.__setattr__(self, "requests", check_resources(owner, "requests", self.requests))
        object.__setattr__(self, "limits", check_resources(owner, "limits", self.limits))
        policy = _coerce_enum(owner, "restart_policy", self.restart_policy, RestartPolicy)
        object.__setattr__(self, "restart_policy", policy)


@dataclass(frozen=True, kw_only=True)
class Master(_Replica):
    """The PyTorchJob Master replica: always exactly one pod, which holds rank 0 and decides the job's outcome."""


@dataclass(frozen=True, kw_only=True)
class Worker(_Replica):
    """The PyTorchJob Worker replicas."""

    #: Number of worker pods besides the master (``PyTorch.num_workers`` is the deprecated spelling).
    replicas: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("Worker", "replicas", self.replicas, minimum=0, optional=True)


#: torchrun's own default (``--monitor-interval``, torch's ``LaunchConfig``). The agent's check is cheap; a longer one
#: (5 s, Flyte's and torch's old default) held every task for half of it on average after its workers ended
#: (benchmarks/bench_real_node.py).
DEFAULT_MONITOR_INTERVAL: Final = 0.1


@dataclass(frozen=True, kw_only=True)
class Elastic:
    """Torch elastic (torchrun) training on ``nnodes`` nodes with ``nproc_per_node`` workers each.

    One node runs as a single Pod; more nodes run as an elastic PyTorchJob with a c10d rendezvous.
    """

    #: Number of nodes: an int, or ``"min:max"`` for an elastic range.
    nnodes: int | str = 1
    #: Worker processes per node: an int, or torchrun's ``"auto"``, ``"cpu"`` or ``"gpu"``.
    nproc_per_node: int | str = 1
    #: How workers are started: ``"spawn"`` (safe default) or ``"fork"`` (faster; no CUDA before the fork).
    start_method: str = "spawn"
    #: Seconds between the agent's health checks of its workers: how soon a node notices that its workers ended.
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    #: In-place restarts of the whole worker group before the node gives up.
    max_restarts: int = 0
    #: Rendezvous settings passed to torch elastic.
    rdzv_configs: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_RDZV_CONFIGS))
    #: Job-wide policies on Kubernetes.
    run_policy: RunPolicy | None = None

    def __post_init__(self) -> None:
        self._parse_nnodes()
        object.__setattr__(self, "nproc_per_node", _check_nproc("Elastic", self.nproc_per_node))
        if self.start_method not in START_METHODS:
            raise fail("Elastic", "start_method", self.start_method, "'spawn' or 'fork'")
        check_seconds("Elastic", "monitor_interval", self.monitor_interval)
        check_int("Elastic", "max_restarts", self.max_restarts, minimum=0)
        object.__setattr__(self, "rdzv_configs", _check_rdzv_configs(self.rdzv_configs))
        _check_run_policy("Elastic", self.run_policy)
        if self.max_nodes == 1 and self.run_policy is not None:
            job_only = [
                name
                for name in ("clean_pod_policy", "ttl_seconds_after_finished", "backoff_limit")
                if getattr(self.run_policy, name) is not None
            ]
            if job_only:
                # One node renders a plain Pod: the training operator, which would apply these, is not involved.
                raise fail(
                    "Elastic",
                    "run_policy",
                    self.run_policy,
                    f"only active_deadline_seconds for one node (nnodes={self.nnodes!r} runs as a single Pod, which "
                    f"cannot honour {', '.join(job_only)}: they apply to multi-node jobs, nnodes > 1 or a range "
                    "such as '1:2')",
                )

    def _parse_nnodes(self) -> tuple[int, int]:
        expected = "an int >= 1 or a 'min:max' string with 1 <= min <= max"
        value = self.nnodes
        if is_int(value):
            if value < 1:  # type: ignore[operator]
                raise fail("Elastic", "nnodes", value, expected)
            return value, value  # type: ignore[return-value]
        if not isinstance(value, str):
            raise fail("Elastic", "nnodes", value, expected, TypeError)
        parts = value.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise fail("Elastic", "nnodes", value, expected)
        low, high = int(parts[0]), int(parts[-1])
        if not 1 <= low <= high:
            raise fail("Elastic", "nnodes", value, expected)
        return low, high

    @property
    def min_nodes(self) -> int:
        return self._parse_nnodes()[0]

    @property
    def max_nodes(self) -> int:
        return self._parse_nnodes()[1]


@dataclass(frozen=True, kw_only=True)
class PyTorch:
    """A PyTorchJob with one Master and ``worker.replicas`` Workers, ranked statically (Master is node 0)."""

    master: Master = field(default_factory=Master)
    worker: Worker = field(default_factory=Worker)
    run_policy: RunPolicy | None = None
    #: Deprecated spelling of ``worker.replicas``.
    num_workers: int | None = None
    #: Worker processes per pod.
    nproc_per_node: int | str = 1
    #: How workers are started inside each pod.
    start_method: str = "spawn"

    def __post_init__(self) -> None:
        if not isinstance(self.master, Master):
            raise fail("PyTorch", "master", self.master, "a Master(...)", TypeError)
        if not isinstance(self.worker, Worker):
            raise fail("PyTorch", "worker", self.worker, "a Worker(...)", TypeError)
        _check_run_policy("PyTorch", self.run_policy)
        check_int("PyTorch", "num_workers", self.num_workers, minimum=0, optional=True)
        if self.num_workers is not None and self.worker.replicas is not None:
            raise ValueError(
                f"PyTorch.num_workers: expected either num_workers or worker.replicas, got both "
                f"(num_workers={self.num_workers!r}, worker.replicas={self.worker.replicas!r}); "
                "keep worker=Worker(replicas=...)"
            )
        if self.num_workers is None and self.worker.replicas is None:
            raise ValueError(
                "PyTorch.worker.replicas: expected the number of worker pods, got None; set worker=Worker(replicas=N)"
            )
        if self.num_workers is not None:
            warnings.warn(
                "PyTorch(num_workers=...) is deprecated; use PyTorch(worker=Worker(replicas=...))",
                DeprecationWarning,
                stacklevel=3,
            )
            # Normalise once here, so that everything downstream reads worker.replicas only.
            object.__setattr__(self, "worker", replace(self.worker, replicas=self.num_workers))
        object.__setattr__(self, "nproc_per_node", _check_nproc("PyTorch", self.nproc_per_node))
        if self.start_method not in START_METHODS:
            raise fail("PyTorch", "start_method", self.start_method, "'spawn' or 'fork'")

    @property
    def worker_replicas(self) -> int:
        # Never None: __post_init__ refuses neither and folds num_workers into worker.replicas.
        return cast(int, self.worker.replicas)

    @property
    def nnodes(self) -> int:
        return 1 + self.worker_replicas


TaskConfig: TypeAlias = Elastic | PyTorch


def check_task_config(value: object) -> TaskConfig:
    """Return ``value`` if it is a task config, else raise a TypeError that says what is accepted."""
    if isinstance(value, Elastic | PyTorch):
        return value
    raise TypeError(f"task_config: expected Elastic(...) or PyTorch(...), got {value!r}")


# Exported at the package root, and shown (and pickled by reference) by that path.
publish(RestartPolicy, CleanPodPolicy, RunPolicy, Master, Worker, Elastic, PyTorch)

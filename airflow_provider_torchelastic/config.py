"""Typed task configuration: what a DAG author writes in ``task_config=``.

Everything here is pure (standard library only) and validated in ``__post_init__``, so a bad value fails
while the DAG file is parsed, with a message that names the field, the value given and what is expected.
The string enums carry the PyTorchJob API spellings, so rendering never has to translate them.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

if TYPE_CHECKING:
    from airflow_provider_torchelastic.pod import PodOptions

__all__ = [
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

# A Kubernetes resource quantity (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/).
_QUANTITY = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
# A qualified resource name such as ``cpu`` or ``nvidia.com/gpu``.
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


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


def _fail(owner: str, name: str, value: object, expected: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"{owner}.{name}: expected {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass; ``nnodes=True`` is a bug, not one node.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(owner: str, name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        raise _fail(owner, name, value, f"an int >= {minimum}", TypeError)
    if value < minimum:  # type: ignore[operator]
        raise _fail(owner, name, value, f"an int >= {minimum}")


def _coerce_enum(owner: str, name: str, value: object, enum: type[Enum], *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum)
        raise _fail(owner, name, value, f"one of {allowed}") from None


def _check_resources(owner: str, name: str, value: object) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise _fail(owner, name, value, "a mapping of resource name to quantity, e.g. {'cpu': '4'}", TypeError)
    checked: dict[str, str] = {}
    for key, quantity in value.items():
        if not isinstance(key, str) or not _RESOURCE_NAME.match(key):
            raise _fail(owner, name, key, "resource names such as 'cpu', 'memory' or 'nvidia.com/gpu'")
        if _is_int(quantity) or isinstance(quantity, float):
            quantity = str(quantity)
        if not isinstance(quantity, str) or not _QUANTITY.match(quantity):
            raise _fail(owner, f"{name}[{key!r}]", quantity, "a Kubernetes quantity such as 2, '500m' or '16Gi'")
        checked[key] = quantity
    return MappingProxyType(checked)


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
            _check_int("RunPolicy", name, getattr(self, name), minimum=0, optional=True)
        if self.active_deadline_seconds == 0:
            raise _fail("RunPolicy", "active_deadline_seconds", 0, "an int >= 1 (0 would fail the job at once)")


def _check_run_policy(owner: str, value: object) -> None:
    if value is not None and not isinstance(value, RunPolicy):
        raise _fail(owner, "run_policy", value, "a RunPolicy(...) or None", TypeError)


def _check_nproc(owner: str, value: object) -> int | str:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, str):
        if value not in NPROC_SYMBOLS:
            raise _fail(owner, "nproc_per_node", value, "an int >= 1 or one of 'auto', 'cpu', 'gpu'")
        return value
    _check_int(owner, "nproc_per_node", value, minimum=1)
    return value  # type: ignore[return-value]


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
    #: (see ``airflow_provider_torchelastic.pod.merge_pod_options``).
    pod: PodOptions | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        # Imported here: pod.py builds on this module's validators, so a top-level import would be circular.
        from airflow_provider_torchelastic.pod import PodOptions

        if self.pod is not None and not isinstance(self.pod, PodOptions):
            raise _fail(owner, "pod", self.pod, "a PodOptions(...) or None", TypeError)
        if self.image is not None and (not isinstance(self.image, str) or not self.image.strip()):
            raise _fail(owner, "image", self.image, "a non-empty image reference or None")
        object.__setattr__(self, "requests", _check_resources(owner, "requests", self.requests))
        object.__setattr__(self, "limits", _check_resources(owner, "limits", self.limits))
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
        _check_int("Worker", "replicas", self.replicas, minimum=0, optional=True)


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
    #: Seconds between the agent's health checks of its workers.
    monitor_interval: float = 5
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
            raise _fail("Elastic", "start_method", self.start_method, "'spawn' or 'fork'")
        if (
            not (_is_int(self.monitor_interval) or isinstance(self.monitor_interval, float))
            or self.monitor_interval <= 0
        ):
            raise _fail("Elastic", "monitor_interval", self.monitor_interval, "a number of seconds > 0")
        _check_int("Elastic", "max_restarts", self.max_restarts, minimum=0)
        if not isinstance(self.rdzv_configs, Mapping) or not all(isinstance(k, str) for k in self.rdzv_configs):
            raise _fail("Elastic", "rdzv_configs", self.rdzv_configs, "a mapping with string keys", TypeError)
        # Merge over the defaults so that setting one key does not silently drop the 900 s timeouts.
        object.__setattr__(self, "rdzv_configs", MappingProxyType({**DEFAULT_RDZV_CONFIGS, **self.rdzv_configs}))
        _check_run_policy("Elastic", self.run_policy)

    def _parse_nnodes(self) -> tuple[int, int]:
        expected = "an int >= 1 or a 'min:max' string with 1 <= min <= max"
        value = self.nnodes
        if _is_int(value):
            if value < 1:  # type: ignore[operator]
                raise _fail("Elastic", "nnodes", value, expected)
            return value, value  # type: ignore[return-value]
        if not isinstance(value, str):
            raise _fail("Elastic", "nnodes", value, expected, TypeError)
        parts = value.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise _fail("Elastic", "nnodes", value, expected)
        low, high = int(parts[0]), int(parts[-1])
        if not 1 <= low <= high:
            raise _fail("Elastic", "nnodes", value, expected)
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
            raise _fail("PyTorch", "master", self.master, "a Master(...)", TypeError)
        if not isinstance(self.worker, Worker):
            raise _fail("PyTorch", "worker", self.worker, "a Worker(...)", TypeError)
        _check_run_policy("PyTorch", self.run_policy)
        _check_int("PyTorch", "num_workers", self.num_workers, minimum=0, optional=True)
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
            raise _fail("PyTorch", "start_method", self.start_method, "'spawn' or 'fork'")

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

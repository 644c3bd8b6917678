"""How the runner is invoked: the one command line shared by local execution and every pod.

Pure: turns a task config into the runner's arguments. What differs per node (the rendezvous: ``PET_NNODES``,
``PET_RDZV_ENDPOINT``, ``MASTER_ADDR`` ...) is not here; the Kubeflow training operator injects it into each pod,
and local execution passes it per node process.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from airflow_provider_torchelastic.core.config import DEFAULT_MONITOR_INTERVAL, Elastic, PyTorch, TaskConfig
from airflow_provider_torchelastic.core.outcome import TERMINATION_MESSAGE_LIMIT

RUNNER_MODULE: Final = "airflow_provider_torchelastic.runner"

#: Env defaults for the training processes, in every pod and in local execution, where torch's effective default
#: lets a job on GPUs hang longer than it must when a peer is lost. Defaults only: a variable the user sets wins.
#: Only NCCL variables, which the NCCL backend alone reads: gloo (CPU) jobs are unaffected.
NCCL_ENV_DEFAULTS: Final[Mapping[str, str]] = MappingProxyType(
    {
        # What a collective timeout or NCCL error does. torch's own default is 3 (SkipCleanUp: end the process at
        # once), but torchelastic's agent, which the runner is, gives its workers 1 (TearDown) when the variable is
        # unset. 1 first calls ncclCommAbort, which can itself block on a lost peer; the worker then lingers until the
        # heartbeat monitor kills it (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 8 minutes) or, with monitoring turned off,
        # forever. 3 restores torch's default, so the agent sees the failure as soon as the collective times out.
        # The rest already prevents silent hangs with torch 2.13's defaults: the watchdog's heartbeat monitor is on
        # (TORCH_NCCL_ENABLE_MONITORING=1, 480 s), wait() is non-blocking and left to the watchdog
        # (TORCH_NCCL_BLOCKING_WAIT=0), and the flight recorder dumps on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT=1).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }
)
#: The older names torch still reads for a variable (it prefers the first name when both are set): a user who set an
#: older one has made the choice, and the default under the new name must not silently override it.
_NCCL_ENV_ALIASES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",)}
)


def nccl_env_defaults(present: Collection[str]) -> dict[str, str]:
    """The :data:`NCCL_ENV_DEFAULTS` that no variable in ``present`` sets already, under its name or an older one."""
    return {
        name: value
        for name, value in NCCL_ENV_DEFAULTS.items()
        if name not in present and not any(alias in present for alias in _NCCL_ENV_ALIASES.get(name, ()))
    }


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """The per-node launch settings that every node of one task shares."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int | str
    start_method: str
    #: The defaults below are a static job's (:class:`~.config.PyTorch`): it has no knobs for them.
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    max_restarts: int = 0
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    #: True for a PyTorch Master/Worker job: static ranks, Master is node 0.
    static_ranks: bool = False

    @property
    def nnodes(self) -> str:
        """torchrun's spelling of the node count: ``"N"`` or ``"min:max"``."""
        if self.min_nodes == self.max_nodes:
            return str(self.max_nodes)
        return f"{self.min_nodes}:{self.max_nodes}"


def config_to_launch_spec(config: TaskConfig) -> LaunchSpec:
    if isinstance(config, Elastic):
        return LaunchSpec(
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            nproc_per_node=config.nproc_per_node,
            start_method=config.start_method,
            monitor_interval=config.monitor_interval,
            max_restarts=config.max_restarts,
            rdzv_configs=config.rdzv_configs,
        )
    if isinstance(config, PyTorch):
        # A fixed node count, never restarted in place, with no rendezvous to tune: the defaults.
        return LaunchSpec(
            static_ranks=True,
            min_nodes=config.nnodes,
            max_nodes=config.nnodes,
            nproc_per_node=config.nproc_per_node,
            start_method=config.start_method,
        )
    raise TypeError(f"task_config: expected Elastic(...) or PyTorch(...), got {config!r}")


def format_rdzv_conf(configs: Mapping[str, Any]) -> str:
    """``{"timeout": 900}`` -> ``"timeout=900"``, torchrun's ``--rdzv-conf`` syntax."""
    return ",".join(f"{key}={value}" for key, value in configs.items())


def runner_command(
    spec: LaunchSpec,
    *,
    payload_path: str,
    result_file: str,
    max_result_bytes: int = TERMINATION_MESSAGE_LIMIT,
    nnodes: str | None = None,
    python: str = "python",
    result_url: str | None = None,
    payload_sha256: str | None = None,
) -> list[str]:
    """The runner's command line. ``nnodes`` is omitted where ``PET_NNODES`` supplies it (a PyTorchJob).

    ``payload_sha256``: the digest of the payload this try wrote; the runner refuses any other payload before
    unpickling it (a Secret of the payload's name may have been written by someone else).

    ``result_url``: where the node holding rank 0 writes a value too large for its result file
    (``[torch_elastic] result_storage``); a URL only, never credentials (those come from the workers' environment).
    """
    args: list[str] = [python, "-m", RUNNER_MODULE, "--payload", payload_path, "--result-file", result_file]
    # Always explicit, locally too: one limit for rank 0's result wherever the task runs.
    args += ["--max-result-bytes", str(max_result_bytes)]
    if result_url is not None:
        args += ["--result-url", result_url]
    if payload_sha256 is not None:
        args += ["--payload-sha256", payload_sha256]
    if nnodes is not None:
        args += ["--nnodes", nnodes]
    args += [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--start-method",
        spec.start_method,
        "--monitor-interval",
        str(spec.monitor_interval),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    if spec.rdzv_configs:
        args += ["--rdzv-conf", format_rdzv_conf(spec.rdzv_configs)]
    return args

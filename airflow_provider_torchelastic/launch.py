"""How the runner is invoked: the one command line shared by local execution and every pod.

Pure: turns a task config into the runner's arguments. What differs per node (the rendezvous: ``PET_NNODES``,
``PET_RDZV_ENDPOINT``, ``MASTER_ADDR`` ...) is not here; the Kubeflow training operator injects it into each pod,
and local execution passes it per node process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from airflow_provider_torchelastic.config import Elastic, PyTorch, TaskConfig
from airflow_provider_torchelastic.outcome import TERMINATION_MESSAGE_LIMIT

RUNNER_MODULE: Final = "airflow_provider_torchelastic.runner"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """The per-node launch settings that every node of one task shares."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int | str
    start_method: str
    monitor_interval: float
    max_restarts: int
    rdzv_configs: Mapping[str, Any]
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
        return LaunchSpec(
            min_nodes=config.nnodes,
            max_nodes=config.nnodes,
            nproc_per_node=config.nproc_per_node,
            start_method=config.start_method,
            monitor_interval=5,
            max_restarts=0,
            rdzv_configs={},
            static_ranks=True,
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
) -> list[str]:
    """The runner's command line. ``nnodes`` is omitted where ``PET_NNODES`` supplies it (a PyTorchJob)."""
    args: list[str] = [python, "-m", RUNNER_MODULE, "--payload", payload_path, "--result-file", result_file]
    # Always explicit, locally too: one limit for rank 0's result wherever the task runs.
    args += ["--max-result-bytes", str(max_result_bytes)]
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

"""Every piece of torch elastic the runner uses, in one place, checked before the first job runs on it.

The runner launches workers with torch's ``elastic_launch`` and reads torch's own failure records, which are not all
public API: ``DefaultLogsSpecs`` and ``Std`` (where workers' output and error files go), ``SignalException`` (the
agent stopped by a signal), ``ChildFailedError`` and its ``ProcessFailure`` records, and ``LaunchConfig``'s fields.
A torch in the user's image that moved one of them would otherwise fail a job with an ``AttributeError`` or
``ImportError`` from deep inside the launch; here it fails before any worker starts, naming what is missing, the
torch version found and the versions the runner is tested with (``make test-torch``, README "torch versions").
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from airflow_provider_torchelastic.runner import RunnerUsageError

__all__ = ["TESTED_TORCH", "ElasticApi", "TorchIncompatibleError", "elastic_api", "flight_recorder_trace"]

#: The torch versions whose elastic internals the runner's tests (tests/runner) pass on.
TESTED_TORCH: Final = ("2.13.0", "2.14.1", "2.15.0")

#: (module, name) of every torch object the runner uses.
_NAMES: Final = (
    ("torch.distributed.elastic.multiprocessing", "DefaultLogsSpecs"),
    ("torch.distributed.elastic.multiprocessing", "Std"),
    ("torch.distributed.elastic.multiprocessing.api", "SignalException"),
    ("torch.distributed.elastic.multiprocessing.errors", "ChildFailedError"),
    ("torch.distributed.launcher.api", "LaunchConfig"),
    ("torch.distributed.launcher.api", "elastic_launch"),
)
#: Where the runner runs, and so where torch must be installed.
_WHERE: Final = (
    "in the image (Kubernetes), or in the Airflow worker's environment (local execution: "
    "pip install 'airflow-provider-torchelastic[torch]')"
)
#: The ``LaunchConfig`` fields the runner sets.
LAUNCH_FIELDS: Final = (
    "min_nodes",
    "max_nodes",
    "nproc_per_node",
    "run_id",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_configs",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "logs_specs",
    "log_line_prefix_template",
    "signals_to_handle",
)


class TorchIncompatibleError(RunnerUsageError):
    """The torch in this image lacks a piece of torch elastic the runner uses: a configuration error (the image),
    never worth a retry."""


@dataclass(frozen=True)
class ElasticApi:
    """What the runner uses of torch elastic, found in the torch that is installed."""

    DefaultLogsSpecs: Any
    Std: Any
    SignalException: Any
    ChildFailedError: Any
    LaunchConfig: Any
    elastic_launch: Callable[..., Any]


def elastic_api(import_module: Callable[[str], Any] = importlib.import_module) -> ElasticApi:
    """The torch elastic objects the runner uses; :class:`TorchIncompatibleError` naming every one that is missing,
    or saying that torch itself is not installed."""
    try:
        import_module("torch")
    except ImportError as e:  # not a torch that moved something: none at all, where a user most often meets it
        raise TorchIncompatibleError(
            f"torch is not installed for the runner's Python ({sys.executable}: {e}); install one of the versions the "
            f"runner is tested with ({', '.join(TESTED_TORCH)}) {_WHERE}"
        ) from None
    found: dict[str, Any] = {}
    missing: list[str] = []
    for module_name, name in _NAMES:
        try:
            found[name] = getattr(import_module(module_name), name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{name}")
    config = found.get("LaunchConfig")
    if config is not None:
        fields = {field.name for field in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
        missing += [f"LaunchConfig.{name}" for name in LAUNCH_FIELDS if name not in fields]
    if missing:
        raise TorchIncompatibleError(
            f"torch {_torch_version(import_module)} lacks what the runner uses of torch elastic: "
            f"{', '.join(missing)}; the runner is tested with torch {', '.join(TESTED_TORCH)}: install one of them "
            f"{_WHERE}"
        )
    return ElasticApi(**found)


def _torch_version(import_module: Callable[[str], Any]) -> str:
    try:
        return str(import_module("torch").__version__)
    except (ImportError, AttributeError):
        return "(version unknown)"


def flight_recorder_trace() -> str | None:
    """This process's Flight Recorder trace as JSON (its collectives, the pending one included), or None where torch
    has no such call or records nothing. Private API (``torch._C._distributed_c10d._dump_fr_trace_json``, in 2.13 for
    gloo too): only the stall forensics call it, and only an absent trace follows from a torch that moved it."""
    try:
        dump = importlib.import_module("torch._C._distributed_c10d")._dump_fr_trace_json
        trace = dump(True, True)
        return trace.decode("utf-8", "replace") if isinstance(trace, bytes) else str(trace)
    except Exception:  # any torch: the trace is a bonus, the stacks are the evidence
        return None

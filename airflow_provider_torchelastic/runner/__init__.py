"""The runner: ``python -m airflow_provider_torchelastic.runner``, one torch elastic agent per node.

The same runner runs in every pod and in local execution. It needs only the standard library, torch and
cloudpickle (no Airflow, no kubernetes client), so the training image can be built without Airflow.

Settings come from the command line; where an option is not given, from the ``PET_*`` variables that the Kubeflow
training operator injects (the same defaults torchrun takes); failing both, a standalone rendezvous on
``localhost:0`` for one node.

Exit codes (see :mod:`airflow_provider_torchelastic.errors`): 0 success; 1 a worker (or the agent itself) failed
permanently; 2 the runner could not start (arguments, payload, Python version); 200 a worker raised
``RecoverableError``, or a stall or a stop stopped the workers (>= 128, so the PyTorchJob ``ExitCode`` policy
restarts it); 128 + N when the runner itself got signal N other than SIGTERM (SIGINT: a sibling node failed), in
which case it writes no failure report, because it is not the root cause.

SIGTERM (a deleted, preempted or drained pod, a killed task) is a stop request, not an end: the workers see
``stop_requested()`` and get the grace period (``--grace-period``) less the runner's margin to save and return; the
runner then reports a recoverable preemption. ``--stall-timeout``: see :mod:`airflow_provider_torchelastic.core.stall`.

When several workers fail together (one raises, its peers then lose their connections to it), the failure reported
is the cause, not a victim: see :func:`failure_from_child_failed` and
:func:`airflow_provider_torchelastic.core.outcome.consequence_sign`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from airflow_provider_torchelastic.runner.agent import *  # noqa: F403
    from airflow_provider_torchelastic.runner.worker import *  # noqa: F403

# The runner is two modules, imported on first use of one of their names: the worker side (``worker``), which every
# spawned worker imports to find its entrypoint, and the agent side (``agent``), which the workers must not pay for.
_AGENT: Final = f"{__name__}.agent"
_WORKER: Final = f"{__name__}.worker"


# Defined here, not in the agent: the package's exceptions keep their modules (errors.py draws them with it), and a
# class costs a worker nothing.
class RunnerUsageError(ValueError):
    """The runner was started with settings it cannot use."""


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("agent", "worker"):
        # Module dunders (``__path__``, ...) and the submodules themselves are the import system's business.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    worker = importlib.import_module(_WORKER)
    module = worker if name in vars(worker) else importlib.import_module(_AGENT)
    try:
        value = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    agent, worker = importlib.import_module(_AGENT), importlib.import_module(_WORKER)
    return sorted(set(globals()) | set(dir(agent)) | set(dir(worker)))

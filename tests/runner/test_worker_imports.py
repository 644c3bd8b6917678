"""A spawned worker imports only what it needs of the provider: its entrypoint's module and the payload loader.

Each spawned worker is a fresh interpreter that imports its entrypoint's module (and the packages above it) before
the training function runs, on every node and every restart; the agent's modules (settings, launch, root cause,
outcome) and the package's configuration types stay out of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_torchelastic.errors import EXIT_OK
from tests.runner.support import run_runner

OWN = "airflow_provider_torchelastic"
#: The package imports its version (core/version.py) on the way: core's __init__ is a docstring.
ENTRYPOINT_MODULES = [OWN, f"{OWN}.core", f"{OWN}.core.version", f"{OWN}.runner", f"{OWN}.runner.worker"]
#: Never in a spawned worker: the agent side, and what the package's names are defined in.
AGENT_SIDE = [
    f"{OWN}.runner.agent",
    f"{OWN}.core.outcome",
    f"{OWN}.core.config",
    f"{OWN}.core.pod_options",
    f"{OWN}.worker.metrics",
]


def provider_modules_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == {OWN!r})))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_entrypoint_module_imports_nothing_else_of_the_provider() -> None:
    assert provider_modules_after(f"import {OWN}.runner.worker") == ENTRYPOINT_MODULES


def test_the_runner_package_and_its_names_still_resolve() -> None:
    from airflow_provider_torchelastic import runner
    from airflow_provider_torchelastic.runner import agent, worker

    assert runner.main is agent.main and runner.parse_settings is agent.parse_settings
    assert runner.RECOVERABLE_MARKER == worker.RECOVERABLE_MARKER == "recoverable_error"
    assert runner.call_training_function is worker.call_training_function
    assert runner._spawn_entrypoint is worker._spawn_entrypoint
    assert runner.ResultNotSerializableError.__module__ == f"{OWN}.core.encoding"
    assert {"main", "failure_from_child_failed", "EXCEPTION_MARKER"} <= set(dir(runner))
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        runner.Missing  # noqa: B018


def loaded_provider_modules() -> list[str]:
    import sys

    return sorted(m for m in sys.modules if m.split(".")[0] == "airflow_provider_torchelastic")


@pytest.mark.slow
def test_a_spawned_worker_imports_the_entrypoint_and_the_payload_loader_only(tmp_path: Path) -> None:
    # What the payload loader needs of the provider is the loader's business; nothing beyond it and the entrypoint.
    # And the rank's heartbeat (worker.liveness, standard library only): every worker of a runner beats.
    liveness = [f"{OWN}.worker", f"{OWN}.worker.liveness"]
    expected = sorted({*ENTRYPOINT_MODULES, *liveness, *provider_modules_after(f"import {OWN}.core.payload")})
    run = run_runner(tmp_path, loaded_provider_modules, start_method="spawn")
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome is not None
    assert run.outcome.result == expected
    assert not set(AGENT_SIDE) & set(run.outcome.result)

"""Builders for runner tests: write a payload, run ``python -m airflow_provider_torchelastic.runner`` for real, read
back what it reported."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from airflow_provider_torchelastic.core.outcome import NodeOutcome, decode_outcome
from airflow_provider_torchelastic.core.payload import dump_payload

RUNNER = "airflow_provider_torchelastic.runner"
# Variables of the machine running the tests that would change what the runner does.
_SCRUBBED = ("OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has: only its parent's reaping is left)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@functools.cache
def _runners_tmpdir() -> str:
    """Where the runners started by this test process make their temporary folders, removed when it exits: a test
    that kills an agent outright leaves its log folder, which a local run would remove (``local.run``)."""
    folder = tempfile.mkdtemp(prefix="runner-tests-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def runner_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in _SCRUBBED}
    env["PYTHONUNBUFFERED"] = "1"
    env["TMPDIR"] = _runners_tmpdir()
    env.update(overrides)
    return env


def runner_command(
    payload: Path,
    result_file: Path,
    *,
    nproc: int | None = 2,
    start_method: str = "spawn",
    extra: Sequence[str] = (),
) -> list[str]:
    # A short monitor interval makes the agent notice failures fast on a small machine.
    command = [sys.executable, "-m", RUNNER, "--payload", str(payload), "--result-file", str(result_file)]
    command += ["--start-method", start_method, "--monitor-interval", "0.3"]
    if nproc is not None:
        command += ["--nproc-per-node", str(nproc)]
    return [*command, *extra]


@dataclass(frozen=True)
class RunnerRun:
    returncode: int
    output: str
    #: The result file's text; None when the runner did not create it.
    result_text: str | None

    @property
    def outcome(self) -> NodeOutcome | None:
        return decode_outcome(self.result_text)

    def describe(self) -> str:
        return f"exit {self.returncode}\nresult file: {self.result_text!r}\noutput:\n{self.output}"


def write_payload(
    tmp_path: Path,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    data: bytes | None = None,
) -> Path:
    path = tmp_path / "payload.bin"
    path.write_bytes(data if data is not None else dump_payload(fn, args, kwargs))
    return path


def run_runner(
    tmp_path: Path,
    fn: Callable[..., Any] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    payload: bytes | None = None,
    nproc: int | None = 2,
    start_method: str = "spawn",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
) -> RunnerRun:
    """Run the runner to the end, from a directory where the test modules are not importable."""
    payload_path = write_payload(tmp_path, fn, args, kwargs, data=payload)  # type: ignore[arg-type]
    result_file = tmp_path / "result.json"
    proc = subprocess.Popen(
        runner_command(payload_path, result_file, nproc=nproc, start_method=start_method, extra=extra),
        cwd=tmp_path,
        env=dict(env) if env is not None else runner_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the runner did not finish within {timeout} s; output:\n{output}") from None
    finally:
        # Nothing the runner started may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = result_file.read_text() if result_file.exists() else None
    return RunnerRun(returncode=proc.returncode, output=output, result_text=text)

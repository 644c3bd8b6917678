"""Local execution: the runner as subprocesses on this machine, one per node.

``nnodes=N`` starts N runner processes (node agents) joined by a real c10d rendezvous on 127.0.0.1, each with
``nproc_per_node`` workers, so multi-node logic can be rehearsed without a cluster. No Airflow here: the operator
passes a line logger and maps the :class:`~airflow_provider_torchelastic.core.outcome.Verdict` to Airflow exceptions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

from airflow_provider_torchelastic.core.launch import LaunchSpec, nccl_env_defaults, runner_command
from airflow_provider_torchelastic.core.outcome import NodeOutcome, NodeReport, Verdict, decide_run, decode_outcome
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext
from airflow_provider_torchelastic.core.stall import GRACE_PERIOD_ENV

if TYPE_CHECKING:
    import psutil

__all__ = ["LocalRun", "run_locally"]

#: How long the other nodes may keep running after one node failed before they are stopped. They cannot finish
#: without it (their collectives would block until the gloo/nccl timeout), but a moment lets them report.
PEER_GRACE_SECONDS: Final = 2.0
#: SIGTERM first (the agent stops its workers cleanly), SIGKILL after this.
TERMINATE_TIMEOUT_SECONDS: Final = 30.0
#: How long a SIGKILLed process may take to die.
KILL_WAIT_SECONDS: Final = 5.0
_POLL_SECONDS: Final = 0.2

# Variables that would make a local runner join a rendezvous of the pod or job Airflow itself runs in.
_INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: What the Airflow worker's environment keeps from the training workers. Airflow's AIRFLOW_CTX_* of the worker's
#: own task: the run context reaches the workers in one variable, as in pods, where there is no Airflow; code that
#: read AIRFLOW_CTX_* would work here and break on Kubernetes. Airflow's settings, connections and variables
#: (AIRFLOW__*, AIRFLOW_CONN_*, AIRFLOW_VAR_*): they carry the metadata database's and other systems' credentials,
#: which training code has no business reading (and pods never get). torchrun's PET_* and rendezvous variables of a
#: surrounding job: the runner would join it.
_WITHHELD_PREFIXES: Final = ("PET_", "AIRFLOW_CTX_", "AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")


def _clean_env(task_context: TaskContext | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_WITHHELD_PREFIXES) and k not in _INHERITED_RENDEZVOUS and k != CONTEXT_ENV
    }
    if task_context is not None:
        env[CONTEXT_ENV] = task_context.to_env_value()
    env["PYTHONUNBUFFERED"] = "1"
    # The same NCCL defaults as every pod, whether or not this machine has a GPU (finding out would import torch in
    # the Airflow worker; gloo ignores them); a value in the worker's own environment wins.
    env.update(nccl_env_defaults(env))
    return env


def run_env(
    task_context: TaskContext | None,
    grace_period: float,
    extra_env: Mapping[str, str] | None = None,
    *,
    workdir: Path,
) -> dict[str, str]:
    """Every node's environment: the Airflow worker's, less what it withholds (:data:`_WITHHELD_PREFIXES`), with
    the run context, what the runners give their workers after SIGTERM (``grace_period``, less their margin),
    ``extra_env``, and the run's own temporary folder in ``workdir`` (:func:`temporary_folder`)."""
    return {
        **_clean_env(task_context),
        GRACE_PERIOD_ENV: f"{grace_period:g}",
        **(extra_env or {}),
        "TMPDIR": str(temporary_folder(workdir)),
    }


def temporary_folder(workdir: Path) -> Path:
    """Where the nodes make what they make with tempfile (each agent's log folder, a copy of its workers' output; the
    training code's own temporary files): in the run's folder, which the run removes however the nodes ended. A node
    killed outright (the OOM killer) cannot remove its own."""
    return workdir / "tmp"


def added_env(env: Mapping[str, str]) -> dict[str, str]:
    """What :func:`run_env` adds to, or changes in, the Airflow worker's own environment: what a plan shows."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def node_commands(
    spec: LaunchSpec,
    *,
    workdir: Path,
    python: str = sys.executable,
    result_url: str | None = None,
    payload_sha256: str | None = None,
) -> list[list[str]]:
    """One runner command line per node. Node 0 hosts the rendezvous store, so none of them races for it.
    ``payload_sha256``: the digest of the payload written to ``workdir``, checked by each runner, as in pods."""
    payload = str(workdir / "payload.bin")
    nodes = spec.max_nodes
    if nodes == 1:
        return [
            runner_command(
                spec,
                payload_path=payload,
                result_file=str(workdir / "node-0.json"),
                nnodes="1",
                python=python,
                result_url=result_url,
                payload_sha256=payload_sha256,
            )
        ]
    endpoint = f"127.0.0.1:{_free_port()}"
    run_id = uuid.uuid4().hex
    commands = []
    for index in range(nodes):
        node_spec = replace(spec, rdzv_configs={**spec.rdzv_configs, "is_host": int(index == 0)})
        command = runner_command(
            node_spec,
            payload_path=payload,
            result_file=str(workdir / f"node-{index}.json"),
            nnodes=spec.nnodes,
            python=python,
            result_url=result_url,
            payload_sha256=payload_sha256,
        )
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
        commands.append(command)
    return commands


@dataclass
class LocalRun:
    """Running node processes; :meth:`stop` is safe to call from another thread (``on_kill``)."""

    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    #: What each node reported, once the run ended (for the job summary).
    reports: list[NodeReport] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)
    #: Unix time at which each node (by index) was seen ended before the run stopped any node itself.
    _ended_at: dict[int, float] = field(default_factory=dict)
    #: Set once the run signals its nodes itself: a node that a signal ended before that was killed from outside.
    _terminating: threading.Event = field(default_factory=threading.Event)
    #: One termination at a time: ``stop`` (another thread) and the run's own end may both terminate, and the run
    #: must not return while the other is still killing what it found.
    _terminate_lock: threading.Lock = field(default_factory=threading.Lock)

    #: Seconds a killed task's nodes get between SIGTERM and SIGKILL (``termination_grace_period``, as in a pod):
    #: their workers see ``stop_requested()`` and may save a checkpoint.
    grace_period: float = TERMINATE_TIMEOUT_SECONDS

    def stop(self) -> None:
        """The task is killed: ask every node to stop (SIGTERM: its workers may save), kill it after the grace."""
        self._stopped.set()
        self._terminating.set()
        with self._terminate_lock:
            _terminate(self.processes, signal.SIGTERM, self.grace_period)

    def terminate(self) -> None:
        """End the nodes now (one failed, or the run is over): SIGINT, which the runner, like torchrun, passes to
        its workers as an immediate stop; SIGTERM would ask them to save first."""
        self._terminating.set()
        with self._terminate_lock:
            _terminate(self.processes, signal.SIGINT, TERMINATE_TIMEOUT_SECONDS)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()


def _terminate(processes: list[subprocess.Popen[str]], signum: int, timeout: float) -> None:
    alive = [p for p in processes if p.poll() is None]
    # Each worker runs in a session of its own (runner.worker.leave_agent_session), out of reach of its node's group
    # signal: its agent stops it, or the kernel kills it when the agent dies. Whatever they started is found now,
    # while the process tree still links it to its node, and killed last.
    descendants = _descendants(alive)
    for proc in alive:
        # Each node runs in its own session: signal the group, so its workers go too.
        _signal_group(proc, signum)
    deadline = time.monotonic() + timeout
    for proc in alive:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    for proc in processes:
        # Workers that outlived their agent (a SIGKILLed agent cannot stop them) must not linger either.
        _signal_group(proc, signal.SIGKILL)
    _kill_all(descendants)


def _descendants(processes: list[subprocess.Popen[str]]) -> list[psutil.Process]:
    import psutil

    found: list[psutil.Process] = []
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            found.extend(psutil.Process(proc.pid).children(recursive=True))
    return found


def _kill_all(processes: list[psutil.Process]) -> None:
    """SIGKILL each that is still running (psutil refuses a pid reused since), and wait until each is gone or a
    zombie: they are not this process's children, so whoever adopted them reaps them (or, as a container's PID 1
    that reaps nothing, never does; hence the bound)."""
    import psutil

    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                time.sleep(0.05)


def _signal_group(proc: subprocess.Popen[str], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


#: Longer output without a newline is cut into lines of this many characters: a worker printing a huge blob must not
#: make the Airflow worker hold it whole.
MAX_LOG_LINE: Final = 64 * 1024


def _pump(proc: subprocess.Popen[str], prefix: str, log_line: Callable[[str], None]) -> None:
    """Copy a node's output to the task log until it closes, whatever the workers print.

    If this thread died, the pipe would fill and the runner (and its workers) block on their next print until the
    task is killed: so undecodable bytes are replaced, over-long lines are cut, and a line the log cannot take is
    skipped, never fatal.
    """
    assert proc.stdout is not None  # started with stdout=PIPE
    while line := proc.stdout.readline(MAX_LOG_LINE):
        try:
            log_line(prefix + line.rstrip("\n"))
        except Exception:  # see the docstring: losing one line beats losing the run
            with contextlib.suppress(Exception):
                log_line(f"{prefix}(a line of {len(line)} characters could not be logged)")


def run_locally(
    payload: bytes,
    spec: LaunchSpec,
    *,
    log_line: Callable[[str], None],
    run: LocalRun | None = None,
    python: str = sys.executable,
    task_context: TaskContext | None = None,
    result_url: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Verdict:
    """Run the payload on this machine and decide the outcome. Every process is gone when this returns.

    ``task_context`` reaches every worker as :data:`~airflow_provider_torchelastic.context.CONTEXT_ENV`, as it does
    in pods; ``result_url`` is where a result too large for the result file goes (``[torch_elastic]
    result_storage``). ``extra_env`` is added to every node's environment (the metrics interval).
    """
    run = run or LocalRun()
    with tempfile.TemporaryDirectory(prefix="torchelastic-local-") as tmp:
        workdir = Path(tmp)
        (workdir / "payload.bin").write_bytes(payload)
        digest = hashlib.sha256(payload).hexdigest()
        commands = node_commands(spec, workdir=workdir, python=python, result_url=result_url, payload_sha256=digest)
        env = run_env(task_context, run.grace_period, extra_env, workdir=workdir)
        temporary_folder(workdir).mkdir()
        pumps: list[threading.Thread] = []
        try:
            for index, command in enumerate(commands):
                if run.stopped:
                    break
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    env=env,
                    start_new_session=True,
                )
                run.processes.append(proc)
                prefix = f"[node{index}] " if len(commands) > 1 else ""
                pump = threading.Thread(target=_pump, args=(proc, prefix, log_line), daemon=True)
                pump.start()
                pumps.append(pump)
            _wait(run, log_line)
        finally:
            run.terminate()
            for pump in pumps:
                pump.join(timeout=5)
        reports = [
            _node_report(run, index, proc, workdir, name=f"node {index}" if len(commands) > 1 else "runner")
            for index, proc in enumerate(run.processes)
        ]
    run.reports = reports
    if run.stopped:
        return Verdict(succeeded=False, detail="the run was stopped before it finished")
    return decide_run(reports)


def _wait(run: LocalRun, log_line: Callable[[str], None]) -> None:
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in run.processes]
        now = time.time()
        for index, code in enumerate(codes):
            if code is not None and not run._terminating.is_set():
                run._ended_at.setdefault(index, now)
        if all(code is not None for code in codes) or run.stopped:
            return
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_SECONDS:
            log_line("a node failed; stopping the other nodes, which cannot finish without it")
            run.terminate()
            return
        time.sleep(_POLL_SECONDS)


def _node_report(run: LocalRun, index: int, proc: subprocess.Popen[str], workdir: Path, *, name: str) -> NodeReport:
    """A node's report, its exit code as a container's would be (128 + N for signal N).

    A node that a signal ended before this run stopped any (the OOM killer's SIGKILL, someone's kill) was killed from
    outside: the signal is its reason, as ``OOMKilled`` is a pod's, so that it is not taken for a peer that failed
    because of it.
    """
    code, reason = proc.returncode, ""
    if code is not None and code < 0:
        signum = -code
        if index in run._ended_at:
            reason = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
        code = 128 + signum
    return NodeReport(
        name=name,
        exit_code=code,
        outcome=_read_outcome(workdir / f"node-{index}.json"),
        reason=reason,
        finished_at=run._ended_at.get(index),
    )


def _read_outcome(path: Path) -> NodeOutcome | None:
    try:
        return decode_outcome(path.read_text())
    except OSError:
        return None

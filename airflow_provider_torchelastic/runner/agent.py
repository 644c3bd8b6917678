"""The agent side of the runner: settings, the launch of this node's workers, and the outcome it reports.

``python -m airflow_provider_torchelastic.runner`` runs :func:`main`; the package docstring
(:mod:`airflow_provider_torchelastic.runner`) describes its options and exit codes. What runs in each training
process is :mod:`airflow_provider_torchelastic.runner.worker`, which spawned workers import instead of this module.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback as tb
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from airflow_provider_torchelastic.core.config import DEFAULT_MONITOR_INTERVAL

# Re-exported: the error a worker raises for rank 0's value is the runner's.
from airflow_provider_torchelastic.core.encoding import ResultNotSerializableError as ResultNotSerializableError
from airflow_provider_torchelastic.core.outcome import (
    TERMINATION_MESSAGE_LIMIT,
    ResultTooLargeError,
    WorkerFailure,
    encode_failure,
    encode_success,
    encode_success_ref,
)
from airflow_provider_torchelastic.core.payload import PayloadError, check_compatible, load_payload, read_header
from airflow_provider_torchelastic.core.stall import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_STALL_TIMEOUT,
    GRACE_PERIOD_ENV,
    STALL_TIMEOUT_ENV,
    shutdown_timeout,
)
from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK, EXIT_RECOVERABLE, EXIT_USAGE
from airflow_provider_torchelastic.runner import RunnerUsageError

# Re-exported: the runner package's public name for it.
from airflow_provider_torchelastic.runner.failures import failure_from_child_failed as failure_from_child_failed
from airflow_provider_torchelastic.runner.stops import (
    name_the_rank_that_left,
    stall_of_timeout,
    stop_failure,
    watched_failure,
)
from airflow_provider_torchelastic.runner.torch_compat import ElasticApi, TorchIncompatibleError, elastic_api
from airflow_provider_torchelastic.runner.watchdog import Watchdog
from airflow_provider_torchelastic.runner.worker import (
    _fetch_arguments,
    _spawn_entrypoint,
    forked_entrypoint,
)
from airflow_provider_torchelastic.worker.liveness import HEARTBEAT_DIR_ENV, STOP_FILE_ENV

log = logging.getLogger("airflow_provider_torchelastic.runner")

#: torch's ``ProcessFailure.error_file`` of a worker that wrote no error file.
_NO_ERROR_FILE: Final = "<N/A>"
#: Prefix of every worker output line; ``${rank}`` is the global rank (local ranks repeat across nodes).
LOG_LINE_PREFIX: Final = "[rank${rank}]:"
STANDALONE_ENDPOINT: Final = "localhost:0"
#: Seconds between two refreshes of a tqdm progress bar (Hugging Face's Trainer, accelerate and Lightning draw one)
#: where the user has not chosen: the workers' output is a log, not a terminal, and tqdm's own 0.1 s would add ten
#: lines a second to it. tqdm (>= 4.66) reads ``TQDM_<parameter>`` as that parameter's default.
TQDM_MININTERVAL: Final = "10"
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class RunnerSettings:
    payload: str
    result_file: str | None
    max_result_bytes: int | None
    #: Where a result too large for ``result_file`` goes (``[torch_elastic] result_storage``), or None.
    result_url: str | None = None
    #: The sha256 (hex) of the payload the try wrote, from the manifest; a payload with another digest is refused.
    payload_sha256: str | None = None
    min_nodes: int
    max_nodes: int
    nproc_per_node: str
    start_method: str
    monitor_interval: float
    max_restarts: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    #: Seconds a rank may go without progress before the runner stops the workers as stalled; None: never.
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT
    #: The pod's (or local run's) grace period between SIGTERM and SIGKILL; the workers get most of it to stop.
    grace_period: float = DEFAULT_GRACE_PERIOD


# --- settings (pure) --------------------------------------------------------------------------------------------


def _parse_nnodes(value: str) -> tuple[int, int]:
    low, _, high = value.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise RunnerUsageError(f"--nnodes: expected N or MIN:MAX, got {value!r}") from None
    if not 1 <= lo <= hi:
        raise RunnerUsageError(f"--nnodes: expected 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def _parse_rdzv_conf(value: str) -> dict[str, Any]:
    """``"timeout=900,is_host=1"`` -> ``{"timeout": 900, "is_host": 1}`` (torchrun's ``--rdzv-conf`` syntax)."""
    configs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RunnerUsageError(f"--rdzv-conf: expected key=value pairs separated by commas, got {value!r}")
        configs[key] = int(raw) if raw.lstrip("-").isdigit() else raw
    return configs


def _usage() -> str | None:
    """The runner package's docstring: its options and exit codes."""
    return sys.modules[__package__].__doc__ if __package__ else None


def _build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_torchelastic.runner", description=_usage())

    def env_default(name: str, default: str | None) -> str | None:
        return env.get(f"PET_{name}", default)

    parser.add_argument("--payload", default=env.get("TORCHELASTIC_PAYLOAD"), help="path of the payload file")
    parser.add_argument(
        "--result-file",
        default=env.get("TORCHELASTIC_RESULT_FILE"),
        help="where this node writes its outcome (rank 0's result, or the failure); a pod's terminationMessagePath",
    )
    # The same limit everywhere (local execution and pods): a result that works locally must work on Kubernetes,
    # where the termination message keeps at most this much.
    parser.add_argument(
        "--max-result-bytes",
        type=int,
        default=TERMINATION_MESSAGE_LIMIT,
        help="refuse a larger outcome document (default: a Kubernetes termination message's limit)",
    )
    parser.add_argument(
        "--result-url",
        default=None,
        help="where the node holding rank 0 writes a result larger than --max-result-bytes (a path or fsspec URL; "
        "credentials come from the environment); the outcome document then carries this reference",
    )
    parser.add_argument(
        "--payload-sha256",
        default=None,
        help="the sha256 (hex) of the payload this try wrote; any other payload is refused before it is unpickled",
    )
    parser.add_argument("--nnodes", default=env_default("NNODES", "1"), help="N or MIN:MAX (env PET_NNODES)")
    parser.add_argument("--nproc-per-node", default=env_default("NPROC_PER_NODE", "1"), help="N, auto, cpu or gpu")
    parser.add_argument("--start-method", default=env.get("PET_START_METHOD", "spawn"), choices=["spawn", "fork"])
    monitor = env_default("MONITOR_INTERVAL", "") or DEFAULT_MONITOR_INTERVAL
    parser.add_argument("--monitor-interval", type=float, default=float(monitor))
    parser.add_argument("--max-restarts", type=int, default=int(env_default("MAX_RESTARTS", "0") or 0))
    parser.add_argument("--rdzv-backend", default=env_default("RDZV_BACKEND", None))
    parser.add_argument("--rdzv-endpoint", default=env_default("RDZV_ENDPOINT", None))
    parser.add_argument("--rdzv-id", default=env_default("RDZV_ID", None))
    parser.add_argument("--rdzv-conf", default=env_default("RDZV_CONF", ""))
    parser.add_argument(
        "--stall-timeout",
        default=env.get(STALL_TIMEOUT_ENV, f"{DEFAULT_STALL_TIMEOUT:g}"),
        help="seconds a rank may go without progress before its workers are stopped as stalled; 0 or none: never "
        f"(env {STALL_TIMEOUT_ENV})",
    )
    parser.add_argument(
        "--grace-period",
        default=env.get(GRACE_PERIOD_ENV, f"{DEFAULT_GRACE_PERIOD:g}"),
        help="seconds between SIGTERM and SIGKILL (the pod's terminationGracePeriodSeconds): after SIGTERM the "
        f"workers see stop_requested() and get this less a few seconds to return (env {GRACE_PERIOD_ENV})",
    )
    return parser


def _parse_seconds(option: str, value: str, *, allow_off: bool) -> float | None:
    if allow_off and value.strip().lower() in ("0", "none", "off", ""):
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        off = "; 0 or none turns it off" if allow_off else ""
        raise RunnerUsageError(f"{option}: expected seconds > 0{off}, got {value!r}")
    return seconds


def parse_settings(argv: Sequence[str] | None, env: Mapping[str, str]) -> RunnerSettings:
    """Command line first, then ``PET_*``, then a standalone single-node rendezvous."""
    parser = _build_parser(env)
    args = parser.parse_args(argv)
    if not args.payload:
        raise RunnerUsageError("--payload: expected the path of the payload file (or env TORCHELASTIC_PAYLOAD)")
    min_nodes, max_nodes = _parse_nnodes(str(args.nnodes))
    configs = _parse_rdzv_conf(args.rdzv_conf or "")
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id

    master_addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    if master_addr and not endpoint and "PET_NODE_RANK" in env:
        # PyTorchJob with a Master: the operator gives every pod a static node rank and the Master's address.
        port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or "23456"
        backend, endpoint = "static", f"{master_addr}:{port}"
        configs["rank"] = int(env["PET_NODE_RANK"])
    elif endpoint:
        backend = backend or "c10d"
    elif max_nodes > 1:
        raise RunnerUsageError(
            f"--nnodes {args.nnodes}: a multi-node run needs a rendezvous endpoint; pass --rdzv-endpoint "
            "HOST:PORT or set PET_RDZV_ENDPOINT (the Kubeflow training operator sets it for elastic PyTorchJobs)"
        )
    else:
        # One node: torchrun's --standalone. Port 0 lets the OS pick, so parallel runs never collide.
        backend, endpoint, run_id = "c10d", STANDALONE_ENDPOINT, run_id or str(uuid.uuid4())

    digest = args.payload_sha256
    if digest is not None and not _SHA256_HEX.fullmatch(digest):
        raise RunnerUsageError(f"--payload-sha256: expected 64 lowercase hex digits, got {digest!r}")
    if args.max_result_bytes is not None and args.max_result_bytes < 1:
        raise RunnerUsageError(f"--max-result-bytes: expected a positive int, got {args.max_result_bytes}")
    if args.monitor_interval <= 0:
        raise RunnerUsageError(f"--monitor-interval: expected seconds > 0, got {args.monitor_interval}")
    if args.max_restarts < 0:
        raise RunnerUsageError(f"--max-restarts: expected an int >= 0, got {args.max_restarts}")
    stall_timeout = _parse_seconds("--stall-timeout", str(args.stall_timeout), allow_off=True)
    grace_period = _parse_seconds("--grace-period", str(args.grace_period), allow_off=False)
    return RunnerSettings(
        payload=args.payload,
        result_file=args.result_file,
        max_result_bytes=args.max_result_bytes,
        result_url=args.result_url or None,
        payload_sha256=digest,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=str(args.nproc_per_node),
        start_method=args.start_method,
        monitor_interval=args.monitor_interval,
        max_restarts=args.max_restarts,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        # Every node of a job must use the same id; "none" is torchrun's default too.
        rdzv_id=run_id or "none",
        rdzv_configs=configs,
        stall_timeout=stall_timeout,
        grace_period=grace_period if grace_period is not None else DEFAULT_GRACE_PERIOD,
    )


def resolve_nproc_per_node(value: str) -> int:
    """torchrun's rules: ``gpu`` = visible GPUs, ``cpu`` = CPU count, ``auto`` = GPUs if any, else CPUs."""
    if value.isdigit() and int(value) >= 1:
        return int(value)
    if value not in ("auto", "cpu", "gpu"):
        raise RunnerUsageError(f"--nproc-per-node: expected an int >= 1, 'auto', 'cpu' or 'gpu', got {value!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "gpu" and gpus == 0:
        raise RunnerUsageError("--nproc-per-node gpu: no CUDA device is visible on this node")
    if value == "gpu" or (value == "auto" and gpus > 0):
        return gpus
    return os.cpu_count() or 1


# --- the agent side -----------------------------------------------------------------------------------------------


def _write_outcome(settings: RunnerSettings, text: str) -> None:
    if settings.result_file:
        Path(settings.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.result_file).write_text(text)


def _report_failure(settings: RunnerSettings, failure: WorkerFailure) -> int:
    kind = "recoverable" if failure.recoverable else "non-recoverable"
    print(f"torchelastic runner: {kind} failure: {failure.summary()}", file=sys.stderr)
    if failure.traceback:
        print(failure.traceback, file=sys.stderr)
    _write_outcome(settings, encode_failure(failure, max_bytes=settings.max_result_bytes))
    return EXIT_RECOVERABLE if failure.recoverable else EXIT_FAILED


def _runner_failure(exc: BaseException, *, rank: int) -> WorkerFailure:
    return WorkerFailure(
        rank=rank,
        exception=type(exc).__name__,
        message=str(exc),
        timestamp=time.time(),
        hostname=socket.gethostname(),
    )


def check_digest(data: bytes, expected: str | None, where: str) -> None:
    """Refuse a payload whose sha256 is not the manifest's (None: no flag, an older Airflow side): whoever could
    write the payload's Secret must not choose what this pod unpickles."""
    actual = hashlib.sha256(data).hexdigest()
    if expected is not None and not hmac.compare_digest(actual, expected):
        raise RunnerUsageError(
            f"the payload at {where} is not the one this try wrote (sha256 {actual}, expected {expected} from "
            "--payload-sha256): refusing to load it; was the payload Secret replaced by someone else?"
        )


def _launch_config(torch_elastic: ElasticApi, settings: RunnerSettings, nproc: int, log_dir: str) -> Any:
    """torch elastic's ``LaunchConfig`` for this node: the rendezvous, restarts and logs the settings give."""
    return torch_elastic.LaunchConfig(
        min_nodes=settings.min_nodes,
        max_nodes=settings.max_nodes,
        nproc_per_node=nproc,
        run_id=settings.rdzv_id,
        rdzv_backend=settings.rdzv_backend,
        rdzv_endpoint=settings.rdzv_endpoint,
        rdzv_configs=dict(settings.rdzv_configs),
        max_restarts=settings.max_restarts,
        monitor_interval=settings.monitor_interval,
        start_method=settings.start_method,
        logs_specs=torch_elastic.DefaultLogsSpecs(log_dir=log_dir, tee=torch_elastic.Std.ALL),
        log_line_prefix_template=LOG_LINE_PREFIX,
        # SIGTERM is the runner's own (_STOP): it asks the workers to stop instead of killing them (torch would).
        signals_to_handle=_TORCH_SIGNALS,
    )


def run(settings: RunnerSettings) -> int:
    """Launch this node's workers and report the outcome; returns the process exit code."""
    try:
        data = Path(settings.payload).read_bytes()
        check_digest(data, settings.payload_sha256, settings.payload)
        header, _ = read_header(data)
        check_compatible(header)
        nproc = resolve_nproc_per_node(settings.nproc_per_node)
    except (OSError, PayloadError, RunnerUsageError) as e:
        _report_failure(settings, _runner_failure(e, rank=-1))
        return EXIT_USAGE

    # Import torch only now: argument errors above are reported without paying for it. A torch that moved a piece
    # of torch elastic the runner uses is the image's configuration, said before any worker starts.
    try:
        torch_elastic = elastic_api()
    except TorchIncompatibleError as e:
        _report_failure(settings, _runner_failure(e, rank=-1))
        return EXIT_USAGE

    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N workers each spawning a thread per core would oversubscribe the node.
        os.environ["OMP_NUM_THREADS"] = "1"

    entrypoint: Callable[..., str | None]
    entry_args: tuple[Any, ...] = ()
    agent_pid = os.getpid()  # each worker leaves this session but dies with this process (leave_agent_session)
    if settings.start_method == "spawn":
        entrypoint, entry_args = _spawn_entrypoint, (settings.payload, agent_pid)
    else:
        payload = load_payload(data, fetch=_fetch_arguments)
        entrypoint = forked_entrypoint(payload.fn, payload.args, payload.kwargs, agent_pid)

    if _STOP.requested_at is not None:
        return _report_failure(settings, stop_failure(None, None))
    # A real log dir, not os.devnull: torch only gives workers a TORCHELASTIC_ERROR_FILE (where exceptions and the
    # recoverable marker land) when it has somewhere to put it.
    log_dir = tempfile.mkdtemp(prefix="torchelastic-")
    watchdog = _start_watchdog(settings, Path(log_dir))
    config = _launch_config(torch_elastic, settings, nproc, log_dir)
    try:
        returns = torch_elastic.elastic_launch(config, entrypoint)(*entry_args)
    except torch_elastic.ChildFailedError as e:
        failure = name_the_rank_that_left(failure_from_child_failed(e, log_dir), watchdog, e)
        return _report_failure(settings, watched_failure(watchdog, failure) or stall_of_timeout(failure))
    except torch_elastic.SignalException as e:
        # Someone stopped this node (pod deleted, preempted, a sibling failed): say so, but publish no failure, so
        # that the node whose worker really failed stays the root cause.
        print(f"torchelastic runner: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except Exception as e:
        # The agent itself failed: most often it lost the rendezvous store that a failed node hosted (a broken pipe,
        # DistNetworkError), which outcome.py reads as a consequence of that node's failure. Report it rather than
        # die with a bare exit 1, so that the verdict can tell it from a cause.
        failure = replace(_runner_failure(e, rank=-1), traceback=tb.format_exc())
        return _report_failure(settings, watched_failure(watchdog, failure) or failure)
    finally:
        watchdog.close()
        _STOP.watchdog = None
        shutil.rmtree(log_dir, ignore_errors=True)

    stopped = watched_failure(watchdog, None)
    if stopped is not None:
        # Asked to stop, the function returned early (as it should): the training did not finish.
        return _report_failure(settings, stopped)
    rank0_json = next((value for value in returns.values() if value is not None), None)
    try:
        _write_outcome(settings, encode_success(rank0_json, max_bytes=settings.max_result_bytes))
    except ResultTooLargeError as e:
        # Only the node holding rank 0 carries a value, so the failure is rank 0's.
        if rank0_json is None or settings.result_url is None:
            return _report_failure(settings, _runner_failure(e, rank=0))
        return _store_result(settings, rank0_json, settings.result_url)
    return EXIT_OK


# --- stalls and stops --------------------------------------------------------------------------------------------

#: The signals torch's agent turns into its ``SignalException`` (and forwards to the workers as SIGTERM): all it
#: handles by default but SIGTERM.
_TORCH_SIGNALS: Final = "SIGINT,SIGHUP,SIGQUIT"


class _StopSignal:
    """SIGTERM, from the runner's start: before the workers run it only notes the time (the runner then reports the
    stop instead of launching); while they run, the watchdog tells them (their stop file) and keeps the deadline.
    PID 1 in a container ignores a signal it has no handler for, so without one a pod waits out its grace period."""

    def __init__(self) -> None:
        self.requested_at: float | None = None
        self.watchdog: Watchdog | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()
            print("torchelastic runner: SIGTERM: asking the workers to stop", file=sys.stderr, flush=True)
        if self.watchdog is not None:
            self.watchdog.request_stop()


_STOP = _StopSignal()


def _start_watchdog(settings: RunnerSettings, log_dir: Path) -> Watchdog:
    folder = log_dir / "liveness"
    folder.mkdir()
    stop_file = folder / "stop"
    # The workers inherit these: where their heartbeat goes, and the file whose existence means "stop".
    os.environ[HEARTBEAT_DIR_ENV] = str(folder)
    os.environ[STOP_FILE_ENV] = str(stop_file)
    watchdog = Watchdog(
        folder,
        stop_file,
        stall_timeout=settings.stall_timeout,
        shutdown_timeout=shutdown_timeout(settings.grace_period),
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    # Still no workers a while after the deadline (the rendezvous waits for nodes that are gone): report and leave.
    watchdog.on_expired = lambda: os._exit(_report_failure(settings, stop_failure(watchdog, None)))
    _STOP.watchdog = watchdog
    if _STOP.requested_at is not None:
        watchdog.request_stop()
    watchdog.start()
    return watchdog


def _store_result(settings: RunnerSettings, rank0_json: str, url: str) -> int:
    """Write a result too large for the result file to result storage, and report where it is."""
    from airflow_provider_torchelastic.worker.checkpoint_store import write_bytes

    try:
        write_bytes(url, rank0_json.encode())
    except Exception as e:  # any store error (credentials, network, a missing library): rank 0's value is lost
        failure = _runner_failure(e, rank=0)
        message = f"could not write rank 0's result ({len(rank0_json)} bytes) to {url}: {failure.message}"
        # A store that was unreachable may be reachable on the next try.
        return _report_failure(settings, replace(failure, message=message, recoverable=not isinstance(e, ImportError)))
    log.info("rank 0's result (%d bytes) written to %s", len(rank0_json), url)
    _write_outcome(settings, encode_success_ref(url))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[torchelastic runner] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _STOP)
    # Until torch's agent handles SIGINT (an immediate stop: local execution ends the other nodes with it when one
    # failed), it ends the runner at once, as a signal, not as a KeyboardInterrupt's traceback and exit 1.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # Before torch is imported: it imports tqdm (torch.hub), which reads its defaults once, and forked workers inherit
    # that import.
    os.environ.setdefault("TQDM_MININTERVAL", TQDM_MININTERVAL)
    try:
        settings = parse_settings(argv, os.environ)
    except RunnerUsageError as e:
        print(f"torchelastic runner: {e}", file=sys.stderr)
        _report_usage_error(argv, e)
        return EXIT_USAGE
    return run(settings)


def _report_usage_error(argv: Sequence[str] | None, error: RunnerUsageError) -> None:
    """Publish a settings error where the outcome would have gone, so a pod says why it did not start."""
    hint = argparse.ArgumentParser(add_help=False)
    hint.add_argument("--result-file", default=os.environ.get("TORCHELASTIC_RESULT_FILE"))
    hint.add_argument("--max-result-bytes", type=int, default=TERMINATION_MESSAGE_LIMIT)
    try:
        known, _ = hint.parse_known_args(argv)
    except SystemExit:  # even these two are unreadable: stderr is all we have
        return
    if known.result_file:
        failure = _runner_failure(error, rank=-1)
        Path(known.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(known.result_file).write_text(encode_failure(failure, max_bytes=known.max_result_bytes))

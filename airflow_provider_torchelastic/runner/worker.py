"""The worker side of the runner: what runs in each training process.

A spawned worker is a fresh interpreter that imports this module to find its entrypoint, so the module stays as
light as the package: the standard library only, and what the worker needs is imported when it needs it (the
payload loader and cloudpickle to unpickle the function, the result encoding on rank 0).
The agent side (:mod:`airflow_provider_torchelastic.runner.agent`: settings, launch, root cause, outcome) is never
imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

#: The package this module belongs to: the worker finds its other modules in ``sys.modules`` (never importing them) by
#: names made from it, so that a copy of the package under another name finds its own.
_PACKAGE: Final = __name__.split(".")[0]
#: Beside a worker's ``TORCHELASTIC_ERROR_FILE``: the worker's exception was a ``RecoverableError``. A file, not the
#: exception's class name, because the agent only sees the exception as text, and a name would miss subclasses.
RECOVERABLE_MARKER: Final = "recoverable_error"
#: Beside the error file: the precise time of the failure.
FAILED_AT_MARKER: Final = "failed_at"
#: Beside the error file: the exception's type name and message, as JSON.
EXCEPTION_MARKER: Final = "exception"
_MARKER_MESSAGE_CHARS: Final = 4096
#: :data:`airflow_provider_torchelastic.core.outcome.MAX_BASES`: the classes of an exception its report names.
_MAX_BASES: Final = 8
_METRICS_MODULE: Final = f"{_PACKAGE}.worker.metrics"
_ERRORS_MODULE: Final = f"{_PACKAGE}.errors"
#: The run context's variable (:data:`airflow_provider_torchelastic.core.run_context.CONTEXT_ENV`), named here so that
#: a worker that needs no context imports nothing to find out.
_CONTEXT_ENV: Final = "TORCHELASTIC_CONTEXT"
#: Where the pinned references' class lives (:func:`_pinned_class`).
_PINNED_MODULE: Final = f"{_PACKAGE}.core.artifact_ref"
_MAX_DEPTH: Final = 64


def _is_recoverable(exc: BaseException) -> bool:
    """A ``RecoverableError`` (or a subclass). Such an exception exists only where its class's module was imported,
    so a worker whose errors module is not imported has none, and is spared importing it while it fails."""
    errors = sys.modules.get(_ERRORS_MODULE)
    return errors is not None and isinstance(exc, errors.RecoverableError)


def _leave_failure_markers(exc: BaseException, message: str | None = None) -> None:
    """Leave, beside the worker's error file, when it failed, what it raised (``message``: its text, when not
    ``str(exc)``) and whether that is recoverable."""
    failed_at = time.time()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        # Without the error file's directory the agent cannot see the marker; the failure then counts as permanent.
        print("warning: TORCHELASTIC_ERROR_FILE is not set; cannot mark the failure recoverable", file=sys.stderr)
        return
    folder = Path(error_file).parent
    folder.mkdir(parents=True, exist_ok=True)
    # torch records whole seconds; sibling workers that fail a moment later (a peer closed the connection) must
    # not tie with the root cause, across nodes too.
    folder.joinpath(FAILED_AT_MARKER).write_text(repr(failed_at))
    if _is_recoverable(exc):
        folder.joinpath(RECOVERABLE_MARKER).touch()
    # What torch's error file will say, for the agent to read if this worker is stopped before torch writes it.
    raised = {
        "exception": type(exc).__name__,
        "message": (str(exc) if message is None else message)[:_MARKER_MESSAGE_CHARS],
        # Where its class lives and what it derives from: Airflow's retry rules name the user's exception by these,
        # and the class itself exists only here.
        "module": type(exc).__module__,
        "bases": [
            f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__ if cls not in (BaseException, object)
        ][:_MAX_BASES],
    }
    folder.joinpath(EXCEPTION_MARKER).write_text(json.dumps(raised))


def encode_result(value: Any) -> str:
    """Rank 0's value as strict JSON: scalars, small tensors and arrays, dataclasses, enums, dates, paths and sets
    converted, NaN and infinities spelled as strings (:mod:`airflow_provider_torchelastic.core.encoding`); anything
    else raises :class:`~airflow_provider_torchelastic.core.encoding.ResultNotSerializableError`, naming its type and
    where it sits in the value."""
    from airflow_provider_torchelastic.core.encoding import value_to_json

    return value_to_json(value)


def _flush_metrics() -> None:
    """Rank 0's last reported metrics. Only a function that called ``report()`` has any, and it imported the
    metrics module to do so: where the module is not imported there is nothing to flush, and nothing to import."""
    metrics = sys.modules.get(_METRICS_MODULE)
    if metrics is not None:
        metrics.flush()


def _fetch_arguments(ref: Mapping[str, Any]) -> bytes:
    """Spilled arguments (a payload over its limit), read from the store with this worker's credentials."""
    from airflow_provider_torchelastic.worker.artifacts import fetch_arguments

    return fetch_arguments(ref)


def _artifact_location() -> str | None:
    """This try's artifact location, from the run context (None: no artifact storage, or no context)."""
    try:
        location = json.loads(os.environ.get(_CONTEXT_ENV) or "{}").get("artifact_uri")
    except (ValueError, AttributeError):  # not our context: context.current() says what is wrong with it
        return None
    return location if isinstance(location, str) and location else None


def _pinned_class() -> type | None:
    """The class of the references the Airflow side accepted in the arguments (core.artifact_ref.PinnedRef): only
    ever imported by unpickling a payload that holds some, so a worker given none imports nothing more."""
    module = sys.modules.get(_PINNED_MODULE)
    pinned = getattr(module, "PinnedRef", None)
    return pinned if isinstance(pinned, type) else None


def _holds_pinned(value: Any, pinned: type, depth: int = 0) -> bool:
    if isinstance(value, pinned):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return any(_holds_pinned(item, pinned, depth + 1) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_pinned(item, pinned, depth + 1) for item in value)
    return False


def _materialized(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """The arguments with every reference the Airflow side pinned loaded (an upstream task's model, a spilled
    tensor): the function gets tensors, arrays and state dicts, never references. Each rank loads them itself. A dict
    that only looks like a reference (anything from JSON: an upstream value, dag_run.conf) is left as it is: loading
    it would fetch from wherever it points, and unpickle what is there."""
    pinned = _pinned_class()
    if pinned is None or not _holds_pinned([args, kwargs], pinned):
        return args, kwargs
    from airflow_provider_torchelastic.worker.artifacts import load

    def materialized(value: Any, depth: int) -> Any:
        if isinstance(value, pinned):
            ref: Any = value  # a PinnedRef, whose module this worker need not import to know it
            return load(dict(ref.ref), allow_pickle=ref.allow_pickle)
        if depth >= _MAX_DEPTH:
            return value
        if isinstance(value, dict):
            return {key: materialized(item, depth + 1) for key, item in value.items()}
        if isinstance(value, list | tuple):
            items = [materialized(item, depth + 1) for item in value]
            return items if isinstance(value, list) else tuple(items)
        return value

    return tuple(materialized(value, 1) for value in args), {k: materialized(v, 1) for k, v in kwargs.items()}


def _saved_artifacts(value: Any, location: str | None) -> Any:
    """Rank 0's value with its tensors, arrays, state dicts and Modules written as artifacts (when this try has an
    artifact location); a store that fails is worth a retry, a value that cannot be saved is not."""
    if location is None:
        return value
    from airflow_provider_torchelastic.worker.artifacts import save_value

    try:
        return save_value(value, location)
    except (TypeError, ValueError):
        raise
    except Exception as e:
        from airflow_provider_torchelastic.errors import RecoverableError

        raise RecoverableError(f"could not write rank 0's artifacts to {location}: {type(e).__name__}: {e}") from e


class WorkerExit(Exception):
    """A worker's ``SystemExit`` with a failing code (``sys.exit(2)``, ``sys.exit("bad config")``), raised as an
    ``Exception`` in its place: torch's error file then records it with its traceback, where a ``SystemExit`` would
    end the worker with a bare exit code. Named ``SystemExit`` in the error file and in reports."""

    def __init__(self, exit: SystemExit) -> None:
        code = exit.code
        # Python prints a code that is not an int, and exits 1.
        super().__init__(f"exit code {code}" if isinstance(code, int) else f"{code} (exit code 1)")
        self.code = code


WorkerExit.__name__ = WorkerExit.__qualname__ = "SystemExit"


def _call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``fn(*args, **kwargs)``, where ``exit()`` is a return and an ``async def`` function is run to its end.

    ``exit()``, ``sys.exit()`` and ``sys.exit(0)`` (argparse's ``--help``, "not enough GPUs" guards, ported
    ``__main__`` code) return None: left to torch, code 0 becomes a None that hides rank 0's place and code None a
    worker that never returns, which hangs the job. Any other code fails the worker as :class:`WorkerExit`.

    An ``async def`` function (Airflow's ``@task`` awaits those too) returns a coroutine that nothing would run: each
    worker runs it in an event loop of its own, as a ``main()`` would with ``asyncio.run``.
    """
    try:
        value = fn(*args, **kwargs)
        if isinstance(value, Coroutine):
            import asyncio

            value = asyncio.run(value)
        return value
    except SystemExit as e:
        if e.code is None or e.code == 0:
            rank = os.environ.get("RANK", "?")
            print(f"rank {rank}: the training function called exit({e.code!r}): it returned None", flush=True)
            return None
        raise WorkerExit(e) from e


#: Where the heartbeat files are (:mod:`airflow_provider_torchelastic.worker.liveness`); named here so that a worker
#: without stall detection imports nothing to find out.
_HEARTBEAT_DIR_ENV: Final = "TORCHELASTIC_HEARTBEAT_DIR"
#: :data:`airflow_provider_torchelastic.runner.watchdog.DUMP_REQUEST` and the suffixes of what a rank leaves.
_DUMP_REQUEST: Final = "dump-request"
_STACKS_SUFFIX: Final = ".stacks"
_TRACE_SUFFIX: Final = ".trace.json"


def _start_liveness() -> None:
    """Start this rank's heartbeat (the watchdog's clock for it starts now), and leave the runner a way to see where
    it is stuck: all its threads' stacks on SIGUSR2 (faulthandler writes them from the signal handler, so a rank
    blocked in C or holding the GIL in a loop answers too), and torch's Flight Recorder trace on request (a thread:
    the trace is in this process's memory, and the call works while the main thread is blocked in a collective)."""
    folder = os.environ.get(_HEARTBEAT_DIR_ENV)
    rank = os.environ.get("RANK")
    if not folder or rank is None:
        return
    import faulthandler
    import threading

    from airflow_provider_torchelastic.worker.liveness import heartbeat_path

    path = heartbeat_path(folder, rank)
    with contextlib.suppress(OSError):
        Path(path).write_text(str(os.getpid()))  # anew: a restarted attempt's rank has a new pid and a new clock
        stacks = open(path + _STACKS_SUFFIX, "w")  # noqa: SIM115 (kept open for faulthandler, for the process's life)
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True, chain=False)
    _beat_on_optimizer_steps()
    threading.Thread(target=_answer_trace_requests, args=(folder, path), name="torchelastic-trace", daemon=True).start()


def _beat_on_optimizer_steps() -> None:
    """Every optimizer step is progress, whatever the loop (plain torch, Lightning, transformers, accelerate)."""
    if "torch" not in sys.modules:  # a worker always has torch (torch elastic started it); only a test may not
        return
    import importlib

    from airflow_provider_torchelastic.worker.liveness import heartbeat

    def beat(*_: Any) -> None:
        heartbeat()

    with contextlib.suppress(ImportError, AttributeError):  # public API since torch 2.0; a torch without it: no beat
        importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(beat)


def _answer_trace_requests(folder: str, path: str) -> None:
    request = Path(folder, _DUMP_REQUEST)
    answered = False
    while True:
        time.sleep(0.5)
        if not request.exists():
            answered = False
            continue
        if answered:
            continue
        answered = True
        from airflow_provider_torchelastic.runner.torch_compat import flight_recorder_trace

        trace = flight_recorder_trace()
        with contextlib.suppress(OSError):
            Path(path + _TRACE_SUFFIX).write_text(trace if trace is not None else "")


#: What a spawn or forkserver child runs to import a module the payload shipped by value: the module's members,
#: pickled by value beside this file by the worker that started the child.
_SHIPPED_STUB: Final = """import pathlib as _pathlib, cloudpickle as _cloudpickle
_members = _cloudpickle.loads(_pathlib.Path(__file__).with_suffix(".pkl").read_bytes())
globals().update({_name: _cloudpickle.loads(_value) for _name, _value in _members.items()})
"""


def _write_shipped_modules(folder: Path) -> None:
    """Each module the payload shipped by value (the DAG file's and its siblings', registered by the loader) as an
    importable stub in ``folder``: its members by value, one by one, so one that cannot travel is only left out."""
    import cloudpickle

    from airflow_provider_torchelastic.core.unpickle import ShippedModule

    for name, module in list(sys.modules.items()):
        if not isinstance(module, ShippedModule):
            continue
        # A package beside the DAG file (``team.data``): the loader ships its parents too, as packages.
        stub = folder.joinpath(*name.split("."))
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            stub = stub / "__init__"
        stub.parent.mkdir(parents=True, exist_ok=True)
        members: dict[str, bytes] = {}
        cloudpickle.register_pickle_by_value(module)
        try:
            for key, value in list(vars(module).items()):
                if not key.startswith("__"):
                    with contextlib.suppress(Exception):  # a lock, a connection: the child cannot have it anyway
                        members[key] = cloudpickle.dumps(value)
        finally:
            cloudpickle.unregister_pickle_by_value(module)
        stub.with_suffix(".pkl").write_bytes(cloudpickle.dumps(members))
        stub.with_suffix(".py").write_text(_SHIPPED_STUB)


def _ship_modules_to_child_processes() -> None:
    """The training code's own spawn and forkserver children (a DataLoader's workers, a process pool; forkserver is
    Python 3.14's default) are fresh interpreters that receive classes and functions by reference, by module name:
    a class of the DAG file (``unusual_prefix_<sha1>_<file>``, shipped by value) would fail there with "No module
    named ...". The first such child started makes those modules importable from a folder put on its ``sys.path``
    (a fork child inherits them and needs nothing). The folder lies in the agent's, which the agent removes."""
    import multiprocessing.spawn as spawn
    import threading

    prepare = spawn.get_preparation_data
    folders: list[str] = []
    written = threading.Lock()  # children started from two threads at once: the second must not read a half-written one

    def preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = prepare(name)
        with written:
            if not folders:
                beside = os.environ.get(_HEARTBEAT_DIR_ENV)
                agents = Path(beside).parent if beside else Path(tempfile.mkdtemp(prefix="torchelastic-"))
                folder = agents / f"shipped-modules-{os.getpid()}"
                _write_shipped_modules(folder)
                folders.append(str(folder))
        data["sys_path"] = [*data.get("sys_path", sys.path), folders[0]]
        return data

    spawn.get_preparation_data = preparation_data


def call_training_function(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Run the user's function in a worker; rank 0 returns its value as JSON, the others None."""
    _ship_modules_to_child_processes()
    _start_liveness()
    if os.environ.get("RANK", "0") == "0":  # with the "[rank0]:" prefix, it tells the trigger whose log to stream
        print("this node holds rank 0", flush=True)
    try:
        args, kwargs = _materialized(args, kwargs)
        value = _call(fn, args, kwargs)
        if os.environ.get(_HEARTBEAT_DIR_ENV):
            from airflow_provider_torchelastic.worker.liveness import mark_done

            mark_done()
        location = _artifact_location()
        if location is not None:
            from airflow_provider_torchelastic.worker.artifacts import gather_full_state_dicts

            gather_full_state_dicts(value)  # a collective: FSDP modules' full state dicts, on every rank
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        value = _saved_artifacts(value, location)
    except Exception as e:
        # A failing exit is recorded as the SystemExit it was (its class is builtins', its bases SystemExit's).
        _leave_failure_markers(e.__cause__ if isinstance(e, WorkerExit) and e.__cause__ is not None else e, str(e))
        raise
    finally:
        # A forked worker ends with os._exit, which skips atexit.
        _flush_metrics()
    # Encode in the worker, so that a bad value fails with rank 0's traceback instead of a pickling error later.
    return encode_result(value)


#: prctl(2) option: the signal this process gets when the thread that started it exits.
_PR_SET_PDEATHSIG: Final = 1


def leave_agent_session(agent_pid: int) -> None:
    """Give this worker a session of its own, as torchrun gives its workers, and tie its life to the agent's.

    Why a session: with autogroup scheduling (Linux's default outside a cpu cgroup, so an Airflow worker's local
    runs, not pods) the CPU is shared out per session. Workers left in the agent's session split one share between
    them next to every other session on the machine, and a 2-worker job then ran 1.1-1.3x as long as under torchrun
    on a busy host (benchmarks/results.md). Why the death signal: a worker outside the agent's process group no
    longer gets a signal sent to that group (local execution stops a node that way), and an agent killed with
    SIGKILL cannot stop its workers itself; the kernel does it for it instead. An agent that is stopped gently stops
    its workers itself (torch's PContext signals each one).
    """
    with contextlib.suppress(PermissionError):  # already a session (and group) leader: nothing to leave
        os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != agent_pid:
        # The agent died before the death signal was armed: nothing would ever stop this worker.
        os._exit(128 + int(signal.SIGKILL))


def forked_entrypoint(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], agent_pid: int
) -> Callable[[], str | None]:
    """fork: the children inherit the unpickled function, so a closure is enough and nothing is pickled again."""

    def entrypoint() -> str | None:
        # The agent's SIGTERM handler asks for a stop; a forked worker inherits it, and must instead die at once when
        # torch stops it (a sibling failed).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        leave_agent_session(agent_pid)
        return call_training_function(fn, args, kwargs)

    return entrypoint


def _spawn_entrypoint(payload_path: str, agent_pid: int | None = None) -> str | None:
    """Module-level, so that spawned workers can import it; each child unpickles the function itself."""
    if agent_pid is not None:
        leave_agent_session(agent_pid)
    from airflow_provider_torchelastic.core.payload import load_payload

    payload = load_payload(Path(payload_path).read_bytes(), fetch=_fetch_arguments)
    return call_training_function(payload.fn, payload.args, payload.kwargs)

"""The runner for real: ``python -m airflow_provider_torchelastic.runner`` with real torch workers (gloo, CPU).

Each test starts a runner process that starts 2 workers, so they are slow on a small machine; failures are made to
surface fast with a short monitor interval.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic import RecoverableError
from airflow_provider_torchelastic.core.outcome import decode_outcome, encode_success
from airflow_provider_torchelastic.core.payload import MAGIC, dump_payload
from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK, EXIT_RECOVERABLE, EXIT_USAGE
from tests.runner.support import gone, run_runner, runner_command, runner_env, write_payload

pytestmark = pytest.mark.slow

HERE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(params=["spawn", "fork"])
def start_method(request: pytest.FixtureRequest) -> str:
    return request.param


# --- training functions (shipped by value: the workers run in tmp_path, where this module is not importable) ------


def all_reduce_ranks(offset: float) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    print(f"hello from rank {rank}", flush=True)
    result = {"rank": rank, "world_size": dist.get_world_size(), "sum": value.item(), "env_rank": os.environ["RANK"]}
    dist.destroy_process_group()
    return result


class FlakyStorageError(RecoverableError):
    """A user's own recoverable error: a subclass, defined where the training function is."""


def fail_on_rank_1(kind: str) -> str:
    if int(os.environ["RANK"]) == 1:
        if kind == "recoverable":
            raise FlakyStorageError("bucket timed out on rank 1")
        raise ValueError("label 7 is out of range")  # the raising line
    return "rank 0 finished"


RAISING_LINE = next(
    number
    for number, line in enumerate(Path(__file__).read_text().splitlines(), start=1)
    if line.strip().startswith('raise ValueError("label 7 is out of range")')
)


def return_unserializable(kind: str) -> object:
    # A set travels as a sorted list; one whose items cannot be compared has no JSON form.
    return {"set": {1, "two"}, "object": object()}[kind]


def return_text(size: int) -> str:
    return "x" * size


def env_of_rank_0(name: str) -> str | None:
    return os.environ.get(name)


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


async def train_async(fail: bool) -> dict:
    import asyncio

    await asyncio.sleep(0.01)  # what a data client's await would be
    if fail and int(os.environ["RANK"]) == 1:
        raise FlakyStorageError("shard 3 timed out on rank 1")
    return {"rank": int(os.environ["RANK"]), "loop": type(asyncio.get_running_loop()).__name__}


def sleep_long() -> None:
    # Who this worker is, for the test to find it after its agent is gone.
    print(f"training started: pid={os.getpid()} sid={os.getsid(0)}", flush=True)
    time.sleep(300)


# --- outcomes ------------------------------------------------------------------------------------------------------


def test_all_reduce_result_of_rank_0(tmp_path: Path, start_method: str) -> None:
    run = run_runner(tmp_path, all_reduce_ranks, (1.0,), start_method=start_method)
    assert run.returncode == EXIT_OK, run.describe()
    outcome = run.outcome
    assert outcome is not None and outcome.succeeded and outcome.holds_rank0, run.describe()
    # ranks 0 and 1 contribute 1 + 2
    assert outcome.result == {"rank": 0, "world_size": 2, "sum": 3.0, "env_rank": "0"}
    # Worker output is prefixed by the global rank.
    for rank in (0, 1):
        assert f"[rank{rank}]:hello from rank {rank}" in run.output.splitlines(), run.describe()


@pytest.mark.parametrize("kind", ["recoverable", "permanent"])
def test_failure_on_rank_1(tmp_path: Path, start_method: str, kind: str) -> None:
    run = run_runner(tmp_path, fail_on_rank_1, (kind,), start_method=start_method)
    outcome = run.outcome
    assert outcome is not None and not outcome.succeeded and outcome.failure is not None, run.describe()
    failure = outcome.failure
    assert failure.rank == 1
    if kind == "recoverable":
        assert run.returncode == EXIT_RECOVERABLE == 200, run.describe()
        assert (failure.exception, failure.message) == ("FlakyStorageError", "bucket timed out on rank 1")
        assert failure.recoverable is True
    else:
        assert run.returncode == EXIT_FAILED == 1, run.describe()
        assert (failure.exception, failure.message) == ("ValueError", "label 7 is out of range")
        assert failure.recoverable is False
        # cloudpickle names by-value code "<dynamic-code>", so the traceback has the line number, not the text.
        assert f"line {RAISING_LINE}, in fail_on_rank_1" in failure.traceback, failure.traceback
        assert failure.traceback.rstrip().endswith("ValueError: label 7 is out of range")
    assert failure.exitcode == 1 and failure.timestamp > 0 and failure.hostname
    # The runner says it on its own output too, for the task log.
    assert f"{'recoverable' if kind == 'recoverable' else 'non-recoverable'} failure: rank 1" in run.output


@pytest.mark.parametrize(
    ("start_method", "kind", "type_name"),
    [("spawn", "set", "builtins.set"), ("fork", "object", "builtins.object")],
)
def test_result_that_is_not_json(tmp_path: Path, start_method: str, kind: str, type_name: str) -> None:
    run = run_runner(tmp_path, return_unserializable, (kind,), start_method=start_method)
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and not failure.recoverable
    assert failure.exception == "ResultNotSerializableError"
    assert f"result has type {type_name}" in failure.message, failure.message


@pytest.mark.parametrize(("start_method", "fail"), [("spawn", False), ("fork", True)])
def test_an_async_function_runs_to_its_end_on_every_rank(tmp_path: Path, start_method: str, fail: bool) -> None:
    # Without the runner's event loop rank 0's value would be a coroutine that never ran, and no rank could fail.
    run = run_runner(tmp_path, train_async, (fail,), start_method=start_method)
    outcome = run.outcome
    assert outcome is not None, run.describe()
    if fail:
        assert run.returncode == EXIT_RECOVERABLE and outcome.failure is not None, run.describe()
        assert (outcome.failure.rank, outcome.failure.exception) == (1, "FlakyStorageError"), run.describe()
    else:
        assert run.returncode == EXIT_OK, run.describe()
        assert outcome.result == {"rank": 0, "loop": "_UnixSelectorEventLoop"}, run.describe()
    assert "never awaited" not in run.output, run.describe()


def test_result_larger_than_max_result_bytes(tmp_path: Path) -> None:
    size = len(encode_success(json.dumps("x" * 3000)).encode())
    run = run_runner(tmp_path, return_text, (3000,), start_method="fork", extra=["--max-result-bytes", "1000"])
    assert run.returncode == EXIT_FAILED, run.describe()
    assert run.result_text is not None and len(run.result_text.encode()) <= 1000
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and failure.exception == "ResultTooLargeError"
    assert f"{size} bytes" in failure.message and "limit of 1000 bytes" in failure.message


# --- environment ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nproc", "user_value", "expected"),
    [(2, None, "1"), (2, "3", "3"), (1, None, None)],
    ids=["set-for-2", "user-value-kept", "untouched-for-1"],
)
def test_omp_num_threads(tmp_path: Path, nproc: int, user_value: str | None, expected: str | None) -> None:
    env = runner_env() if user_value is None else runner_env(OMP_NUM_THREADS=user_value)
    run = run_runner(tmp_path, env_of_rank_0, ("OMP_NUM_THREADS",), nproc=nproc, start_method="fork", env=env)
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome.result == expected  # type: ignore[union-attr]


def tqdm_refreshes(steps: int) -> int:
    """How often a real tqdm bar over ``steps`` steps of 50 ms draws itself (its first and last draw included)."""
    import io

    from tqdm import tqdm

    out = io.StringIO()
    for _ in tqdm(range(steps), file=out):
        time.sleep(0.05)
    return out.getvalue().count("\r")


@pytest.mark.parametrize(
    ("start_method", "user_value", "most"),
    [("fork", None, 3), ("spawn", None, 3), ("fork", "0.1", None)],
    ids=["fork", "spawn", "user-value-kept"],
)
def test_a_tqdm_bar_draws_itself_seldom_unless_the_user_chose(
    tmp_path: Path, start_method: str, user_value: str | None, most: int | None
) -> None:
    env = runner_env() if user_value is None else runner_env(TQDM_MININTERVAL=user_value)
    run = run_runner(tmp_path, tqdm_refreshes, (40,), start_method=start_method, env=env)
    assert run.returncode == EXIT_OK, run.describe()
    refreshes = run.outcome.result  # type: ignore[union-attr]
    if most is not None:
        assert refreshes <= most  # the first and the last draw: 2 s is well under the 10 s default
    else:
        assert refreshes >= 10  # tqdm's own pace, 10 a second, as the user asked


def test_pet_variables_are_honoured(tmp_path: Path) -> None:
    env = runner_env(PET_NNODES="1", PET_NPROC_PER_NODE="2")
    run = run_runner(tmp_path, world_size, nproc=None, start_method="fork", env=env)
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome.result == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "env"), [(["--nnodes", "2"], {}), ([], {"PET_NNODES": "1:3"})], ids=["flag", "pet-env"]
)
def test_multi_node_without_endpoint_is_a_usage_error(tmp_path: Path, extra: list[str], env: dict[str, str]) -> None:
    run = run_runner(tmp_path, world_size, extra=extra, env=runner_env(**env))
    assert run.returncode == EXIT_USAGE, run.describe()
    assert "a multi-node run needs a rendezvous endpoint" in run.output
    assert "--rdzv-endpoint" in run.output and "PET_RDZV_ENDPOINT" in run.output
    # A pod that cannot start says why in its termination message too, not only in its log.
    assert run.outcome is not None and run.outcome.failure is not None
    assert run.outcome.failure.rank == -1 and "rendezvous endpoint" in run.outcome.failure.message


def test_payload_from_another_python_is_refused(tmp_path: Path) -> None:
    data = dump_payload(world_size)
    header_line, _, body = data[len(MAGIC) :].partition(b"\n")
    header = {**json.loads(header_line), "python": "3.99"}
    run = run_runner(tmp_path, payload=MAGIC + json.dumps(header).encode() + b"\n" + body)
    assert run.returncode == EXIT_USAGE, run.describe()
    assert "Python 3.99" in run.output and f"Python {HERE_PYTHON}" in run.output
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == -1 and failure.exception == "PayloadError"
    assert "Python 3.99" in failure.message and f"Python {HERE_PYTHON}" in failure.message


def test_payload_of_a_newer_format_names_both_versions_and_the_image(tmp_path: Path) -> None:
    from airflow_provider_torchelastic import __version__
    from airflow_provider_torchelastic.core.payload import FORMAT_VERSION

    data = dump_payload(world_size)
    header_line, _, body = data[len(MAGIC) :].partition(b"\n")
    header = {**json.loads(header_line), "format": FORMAT_VERSION + 1, "provider": "9.9.0"}
    image = "registry.example.com/ml/runner:0.1.0"
    run = run_runner(
        tmp_path, payload=MAGIC + json.dumps(header).encode() + b"\n" + body, env=runner_env(TORCHELASTIC_IMAGE=image)
    )
    assert run.returncode == EXIT_USAGE, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.exception == "PayloadError", run.describe()
    for words in (
        f"airflow-provider-torchelastic 9.9.0 (payload format {FORMAT_VERSION + 1})",
        f"the image {image} has airflow-provider-torchelastic {__version__} (payload format {FORMAT_VERSION})",
        f"rebuild the image {image} with airflow-provider-torchelastic 9.9.0",
    ):
        assert words in failure.message, failure.message


def test_missing_payload_file_is_a_usage_error(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    command = runner_command(tmp_path / "absent.bin", result_file, nproc=2)
    proc = subprocess.run(command, env=runner_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert "absent.bin" in proc.stderr


# Runs the runner's ``__main__`` as ``python -m`` would, with an atexit handler that prints without flushing (stdout
# is a pipe: block-buffered), and a module global whose ``__del__`` runs only if the interpreter tears its modules down.
_EXIT_PROBE = """
import atexit, runpy, sys, threading, time

class Teardown:
    def __del__(self):
        print("modules torn down", flush=True)

keep = Teardown()
atexit.register(lambda: print("atexit ran"))
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
sys.argv = ["runner", *sys.argv[2:]]
runpy.run_module("airflow_provider_torchelastic.runner", run_name="__main__")
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_the_runner_exits_without_tearing_down_torch_unless_a_thread_must_end(tmp_path: Path, thread: str) -> None:
    # The modules' teardown (torch's: about 0.5 s) comes after the outcome is written, and delays the container's end.
    args = runner_command(tmp_path / "absent.bin", tmp_path / "result.json", nproc=2)[3:]
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_PROBE, thread, *args],
        env=runner_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert "absent.bin" in proc.stderr and "atexit ran" in proc.stdout, proc.stdout + proc.stderr
    if thread == "thread":  # a non-daemon thread still running: the interpreter's own exit, which joins it
        assert "thread done" in proc.stdout and "modules torn down" in proc.stdout, proc.stdout
    else:
        assert "modules torn down" not in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "result.json").read_text())["succeeded"] is False


# --- being stopped -------------------------------------------------------------------------------------------------


def _read_lines(stream, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))


def _kill(proc: subprocess.Popen[str], workers: dict[int, int]) -> None:
    """Whatever a test left of the runner and its workers (their own sessions: the group kill misses them)."""
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _start_sleeping_workers(
    tmp_path: Path, start_method: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], dict[int, int], list[str], queue.Queue[str]]:
    """A runner whose 2 workers sleep; returns it, each worker's pid -> session id, and the output so far."""
    payload = write_payload(tmp_path, sleep_long)
    proc = subprocess.Popen(
        runner_command(payload, tmp_path / "result.json", nproc=2, start_method=start_method, extra=extra),
        cwd=tmp_path,
        env=runner_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    workers: dict[int, int] = {}
    deadline = time.monotonic() + 120
    while len(workers) < 2:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError("workers did not start:\n" + "\n".join(seen)) from None
        seen.append(line)
        if match := re.search(r"^\[rank\d\]:training started: pid=(\d+) sid=(\d+)$", line):
            workers[int(match[1])] = int(match[2])
    return proc, workers, seen, lines


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_each_worker_has_its_own_session_and_dies_with_a_killed_agent(tmp_path: Path, start_method: str) -> None:
    proc, workers, seen, _ = _start_sleeping_workers(tmp_path, start_method)
    try:
        # As torchrun's workers: a session each (autogroup shares CPU out per session), not the agent's.
        assert all(sid == pid for pid, sid in workers.items()), (workers, seen)
        assert os.getsid(proc.pid) not in workers.values()
        # SIGKILL to the agent alone: it cannot stop its workers, and no group signal reaches them; the kernel must.
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in workers if not gone(pid)] == [], "workers outlived their SIGKILLed agent"
    finally:
        _kill(proc, workers)


def test_sigterm_while_training_asks_the_workers_to_stop_then_stops_them_and_reports_a_preemption(
    tmp_path: Path,
) -> None:
    # Workers that never look at stop_requested(): after the grace period less the runner's margin (4 - 1 s) the
    # runner stops them itself, and reports the stop (recoverable) rather than dying of the signal.
    proc, workers, seen, lines = _start_sleeping_workers(tmp_path, "fork", ("--grace-period", "4"))
    result_file = tmp_path / "result.json"
    try:
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=120)
        time.sleep(0.5)  # the reader thread's last lines
        while not lines.empty():
            seen.append(lines.get())
        output = "\n".join(seen)
        assert returncode == EXIT_RECOVERABLE, output
        outcome = decode_outcome(result_file.read_text())
        assert outcome is not None and outcome.failure is not None, output
        assert outcome.failure.exception == "StopRequested" and outcome.failure.recoverable, outcome
        assert "did not finish within 3 s" in outcome.failure.message, outcome
        assert "SIGTERM: asking the workers to stop" in output
        # The workers went with the runner: it stopped them itself (they are not in its process group).
        assert [pid for pid in workers if not gone(pid)] == [], output
    finally:
        _kill(proc, workers)


def _never_unpickled() -> None:  # pragma: no cover - the point is that it never runs
    raise AssertionError("unpickled")


class _Tripwire:
    """Unpickling it writes a file: proof that a payload was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "unpickled"))


def test_a_payload_with_another_digest_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    import hashlib

    tripwire = tmp_path / "unpickled"
    written = dump_payload(world_size)
    other = dump_payload(_never_unpickled, (_Tripwire(str(tripwire)),))
    digest = hashlib.sha256(written).hexdigest()
    run = run_runner(tmp_path, payload=other, nproc=1, extra=["--payload-sha256", digest])
    assert run.returncode == EXIT_USAGE, run.describe()
    assert not tripwire.exists()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == -1 and failure.exception == "RunnerUsageError", run.describe()
    assert "is not the one this try wrote" in failure.message and digest in failure.message
    assert hashlib.sha256(other).hexdigest() in failure.message


def test_the_payload_with_the_right_digest_runs(tmp_path: Path) -> None:
    import hashlib

    data = dump_payload(world_size)
    run = run_runner(tmp_path, payload=data, nproc=1, extra=["--payload-sha256", hashlib.sha256(data).hexdigest()])
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome is not None and run.outcome.result == 1


def test_a_malformed_digest_is_a_usage_error(tmp_path: Path) -> None:
    run = run_runner(tmp_path, world_size, nproc=1, extra=["--payload-sha256", "not-hex"])
    assert run.returncode == EXIT_USAGE, run.describe()
    assert "--payload-sha256: expected 64 lowercase hex digits" in run.output


# --- the training code's own processes ------------------------------------------------------------------------------

#: A DAG file's code as the workers get it: by value, under the module name Airflow imports a DAG file as, which no
#: process can import.
DAG_FILE_CODE = """
class Squares:
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index * index


def load_in_child_processes(context):
    import torch.utils.data as tud

    loader = tud.DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context=context)
    return [batch.tolist() for batch in loader]
"""


DAG_FILE_MODULE = "unusual_prefix_" + "cd" * 20 + "_train_dag"


@pytest.mark.parametrize(
    ("module", "context"),
    [(DAG_FILE_MODULE, "spawn"), (DAG_FILE_MODULE, "forkserver"), (DAG_FILE_MODULE, "fork"), ("team.data", "spawn")],
    ids=["spawn", "forkserver", "fork", "package-beside-the-dag-file"],
)
def test_a_dag_files_class_reaches_the_training_codes_own_child_processes(
    tmp_path: Path, module: str, context: str
) -> None:
    namespace: dict[str, Any] = {"__name__": module}
    exec(compile(DAG_FILE_CODE, "train_dag.py", "exec"), namespace)
    run = run_runner(tmp_path, namespace["load_in_child_processes"], (context,), nproc=1, start_method="spawn")
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome.result == [[0, 1], [4, 9]]  # type: ignore[union-attr]

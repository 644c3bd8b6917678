"""Outcome documents (what a node reports) and ``decide_run`` (the verdict of a run from all its nodes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.outcome import (
    CONSEQUENCE_SIGNS,
    SCHEMA,
    NodeOutcome,
    NodeReport,
    ResultTooLargeError,
    WorkerFailure,
    consequence_sign,
    decide_run,
    decode_outcome,
    encode_failure,
    encode_success,
    is_consequence,
    root_cause,
)


def failure(**overrides: Any) -> WorkerFailure:
    values: dict[str, Any] = {
        "rank": 1,
        "exception": "ValueError",
        "message": "bad batch 17",
        "traceback": 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: bad batch 17\n',
        "recoverable": False,
        "exitcode": 1,
        "timestamp": 1000.0,
        "hostname": "node-a",
    }
    values.update(overrides)
    return WorkerFailure(**values)


def report(
    name: str,
    exit_code: int | None,
    outcome: NodeOutcome | None = None,
    reason: str = "",
    *,
    finished_at: float | None = None,
) -> NodeReport:
    return NodeReport(name=name, exit_code=exit_code, outcome=outcome, reason=reason, finished_at=finished_at)


def failed(**overrides: Any) -> NodeOutcome:
    return NodeOutcome(succeeded=False, failure=failure(**overrides))


def succeeded(result: Any = None, *, holds_rank0: bool) -> NodeOutcome:
    return NodeOutcome(succeeded=True, holds_rank0=holds_rank0, result=result)


# --- documents ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [{"loss": 0.25, "acc": [1, 2]}, [1, "two", None], "text", 3.5, 0, None, True])
def test_success_round_trip(value: Any) -> None:
    outcome = decode_outcome(encode_success(json.dumps(value)))
    assert outcome == NodeOutcome(succeeded=True, holds_rank0=True, result=value)


def test_success_without_rank0_round_trip() -> None:
    assert decode_outcome(encode_success(None)) == NodeOutcome(succeeded=True, holds_rank0=False, result=None)


def test_failure_round_trip() -> None:
    original = failure(recoverable=True, exitcode=200, message='quotes " and unicode é')
    assert decode_outcome(encode_failure(original)) == NodeOutcome(succeeded=False, failure=original)
    assert decode_outcome(encode_failure(original).encode()) == NodeOutcome(succeeded=False, failure=original)


def test_failure_with_missing_fields_decodes_with_defaults() -> None:
    outcome = decode_outcome(json.dumps({"schema": SCHEMA, "succeeded": False, "failure": {"extra": 1}}))
    assert outcome is not None and outcome.failure is not None
    assert (outcome.failure.rank, outcome.failure.exception, outcome.failure.recoverable) == (-1, "UnknownError", False)


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        b"",
        "Traceback (most recent call last):\n  File ...\nRuntimeError: CUDA out of memory",
        '{"succeeded": true, "holds_rank0": true, "result": 1}',
        '{"schema": "someone.else/v1", "succeeded": true}',
        "[1, 2, 3]",
        "42",
    ],
    ids=["none", "empty", "empty-bytes", "log-tail", "no-schema", "other-schema", "list", "number"],
)
def test_anything_else_decodes_to_none(text: str | bytes | None) -> None:
    assert decode_outcome(text) is None


def test_result_too_large_names_size_and_limit() -> None:
    value = json.dumps({"weights": list(range(2000))})
    size = len(encode_success(value).encode())
    with pytest.raises(ResultTooLargeError) as info:
        encode_success(value, max_bytes=4096)
    assert f"{size} bytes" in str(info.value) and "limit of 4096 bytes" in str(info.value)
    assert isinstance(info.value, ValueError)
    # Exactly at the limit is fine.
    assert len(encode_success(value, max_bytes=size).encode()) == size


def long_traceback(frames: int) -> str:
    lines = ["Traceback (most recent call last):"]
    for i in range(frames):
        lines.append(f'  File "/opt/train/model_{i}.py", line {i}, in forward')
        lines.append(f'    out = self.layers["block_{i}"](x)  # \t tab and ünïcödé')
    lines.append("ZeroDivisionError: the very end of the traceback")
    return "\n".join(lines)


@pytest.mark.parametrize("limit", [4096, 1500, 700])
def test_failure_trimmed_to_limit_keeps_json_and_traceback_end(limit: int) -> None:
    original = failure(traceback=long_traceback(400), message="division by zero in block 7")
    text = encode_failure(original, max_bytes=limit)
    assert len(text.encode()) <= limit
    outcome = decode_outcome(text)
    assert outcome is not None and outcome.failure is not None
    kept = outcome.failure
    assert kept.traceback.startswith("...")
    assert kept.traceback.endswith("ZeroDivisionError: the very end of the traceback")
    assert kept.message == "division by zero in block 7", "the message is cut only after the traceback is gone"
    assert (kept.rank, kept.exception, kept.timestamp) == (original.rank, original.exception, original.timestamp)


def test_long_message_trimmed_after_traceback_keeps_its_start() -> None:
    message = "rank 0 returned 123456 bytes; the limit is 900 " + "x" * 5000
    text = encode_failure(failure(traceback="short\n" * 100, message=message), max_bytes=900)
    assert len(text.encode()) <= 900
    outcome = decode_outcome(text)
    assert outcome is not None and outcome.failure is not None
    assert outcome.failure.message.startswith("rank 0 returned 123456 bytes; the limit is 900")
    assert outcome.failure.message.endswith("...")


@settings(max_examples=60, deadline=None)
@given(traceback=st.text(max_size=3000), message=st.text(max_size=1500), limit=st.integers(600, 5000))
def test_trimmed_failure_always_fits_and_decodes(traceback: str, message: str, limit: int) -> None:
    text = encode_failure(failure(traceback=traceback, message=message, hostname="h"), max_bytes=limit)
    assert len(text.encode()) <= limit
    outcome = decode_outcome(text)
    assert outcome is not None and outcome.failure is not None and outcome.failure.rank == 1


def test_failure_summary() -> None:
    assert failure().summary() == "rank 1 on node-a failed with ValueError: bad batch 17"
    assert failure(rank=-1, hostname="").summary() == "the runner failed with ValueError: bad batch 17"


# --- decide_run --------------------------------------------------------------------------------------------------


def test_root_cause_is_the_earliest_failure_across_nodes() -> None:
    verdict = decide_run(
        [
            # Reported first, but it failed later: a consequence (its peer went away), and recoverable.
            report("node 0", 200, failed(rank=0, exception="DistBackendError", recoverable=True, timestamp=2000.5)),
            report("node 1", 1, failed(rank=3, exception="KeyError", message="'label'", timestamp=2000.1)),
            report("node 2", 143),  # stopped from outside after the failure: no report
        ]
    )
    assert not verdict.succeeded
    assert verdict.node == "node 1"
    assert verdict.failure is not None and verdict.failure.exception == "KeyError" and verdict.failure.rank == 3
    assert verdict.recoverable is False
    assert "node 1" in verdict.detail and "rank 3" in verdict.detail and "KeyError" in verdict.detail
    assert "non-recoverable" in verdict.detail


def test_earliest_recoverable_root_cause_is_recoverable() -> None:
    verdict = decide_run(
        [
            report("node 0", 1, failed(rank=0, recoverable=False, timestamp=50.0)),
            report("node 1", 200, failed(rank=2, exception="Preempted", recoverable=True, timestamp=49.0)),
        ]
    )
    assert (verdict.node, verdict.recoverable) == ("node 1", True)


@pytest.mark.parametrize(("code", "reason"), [(137, ""), (143, ""), (255, ""), (1, "OOMKilled"), (2, "Evicted")])
def test_node_killed_from_outside_without_report_is_recoverable(code: int, reason: str) -> None:
    verdict = decide_run(
        [report("node 0", 0, succeeded({"x": 1}, holds_rank0=True)), report("node 1", code, None, reason)]
    )
    assert not verdict.succeeded
    assert verdict.recoverable is True
    assert verdict.node == "node 1"
    assert f"exited with code {code}" in verdict.detail and "without a failure report" in verdict.detail
    assert (reason in verdict.detail) if reason else True


@pytest.mark.parametrize("reason", ["StartError", "ContainerCannotRun"])
def test_a_command_the_runtime_could_not_start_is_the_images_fault_not_a_kill(reason: str) -> None:
    """Exit code 128 with containerd's StartError (Docker's ContainerCannotRun): the image has no such executable
    (seen on the real node with an image without Python, issue 33 item 3), which no retry mends."""
    verdict = decide_run([report("smoke", 128, None, reason)])
    assert not verdict.succeeded and verdict.recoverable is False
    assert (verdict.cause, verdict.reason, verdict.exit_code) == (causes.CONFIGURATION, reason, 128)
    assert f"smoke exited with code 128 ({reason}) without a failure report" in verdict.detail, verdict.detail
    assert "could not start its command" in verdict.detail and "killed from outside" not in verdict.detail


def test_exit_1_without_report_is_not_recoverable() -> None:
    verdict = decide_run([report("runner", 1, None)])
    assert not verdict.succeeded and verdict.recoverable is False
    assert "runner exited with code 1" in verdict.detail and "see its log" in verdict.detail


def test_success_takes_the_rank0_holder_even_when_it_is_not_node_0() -> None:
    verdict = decide_run(
        [
            report("node 0", 0, succeeded(None, holds_rank0=False)),
            report("node 1", 0, succeeded({"world_size": 4}, holds_rank0=True)),
            report("node 2", 0, succeeded(None, holds_rank0=False)),
        ]
    )
    assert verdict.succeeded and verdict.result == {"world_size": 4} and verdict.node == "node 1"


def test_success_with_a_null_result() -> None:
    verdict = decide_run([report("runner", 0, succeeded(None, holds_rank0=True))])
    assert verdict.succeeded and verdict.result is None


def test_all_exited_zero_but_nobody_held_rank0_is_a_failure() -> None:
    verdict = decide_run([report("node 0", 0, None), report("node 1", 0, succeeded(None, holds_rank0=False))])
    assert not verdict.succeeded and "no node reported rank 0's result" in verdict.detail


# --- causes and consequences: who is a victim of whom -----------------------------------------------------------

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:2486. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("exception", "message"),
    [
        ("RuntimeError", GLOO_CLOSED),
        ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network"),
        ("DistBackendError", "NCCL WARN Net : Connection closed by remote peer 10.0.0.7<45012>"),
        ("DistNetworkError", "failed to connect to worker-0:29400"),
        ("torch.distributed.DistNetworkError", "anything"),
        ("DistStoreError", "wait timeout after 30000ms, keys: /default_pg/0//cpu//0"),
        ("DistNetworkError", "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server crash?"),
        ("RuntimeError", "[Errno 104] Connection reset by peer"),
        ("BrokenPipeError", "[Errno 32] Broken pipe"),
        ("RendezvousConnectionError", "The connection to the C10d store has failed. See inner exception for details."),
        ("RendezvousClosedError", ""),
        ("SignalSIGTERM", "Signal 15 (SIGTERM) received by PID 4711"),
        ("SignalSIGABRT", "Signal 6 (SIGABRT) received by PID 4711"),
    ],
)
def test_lost_connections_and_stores_are_consequences(exception: str, message: str) -> None:
    assert is_consequence(exception, message)
    sign = consequence_sign(exception, message)
    assert sign and sign == failure(exception=exception, message=message).consequence_sign


@pytest.mark.parametrize(
    ("exception", "message", "recoverable"),
    [
        ("ValueError", "bad batch 17", False),
        ("FlakyStorageError", "bucket timed out", True),
        # The code said it is recoverable: its own cause, whatever the text.
        ("TransientStorageError", "download failed: Connection reset by peer", True),
        ("SignalSIGKILL", "Signal 9 (SIGKILL) received by PID 4711", True),  # the OOM killer: a cause
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("ResultTooLargeError", "rank 0's return value is 9000 bytes", False),
        ("PayloadError", "the payload was written by Python 3.99", False),
        ("RuntimeError", "Expected all tensors to be on the same device", False),
        ("WorkerError", "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html", False),
    ],
)
def test_the_codes_own_failures_are_causes(exception: str, message: str, recoverable: bool) -> None:
    assert not is_consequence(exception, message, recoverable=recoverable)
    assert not failure(exception=exception, message=message, recoverable=recoverable).is_consequence


def test_a_worker_stopped_by_its_agent_is_a_consequence_though_the_runner_marks_sigterm_recoverable() -> None:
    assert is_consequence("SignalSIGTERM", "Signal 15 (SIGTERM) received by PID 4711", recoverable=True)
    assert (
        root_cause(
            [
                failure(rank=0, exception="SignalSIGTERM", recoverable=True, timestamp=1.0),
                failure(rank=1, timestamp=2.0),
            ]
        ).rank
        == 1
    )


def test_every_sign_says_why() -> None:
    for kind, pattern, why in CONSEQUENCE_SIGNS:
        assert kind in ("type", "message") and pattern and why
        if kind == "message":
            assert pattern == pattern.lower(), "messages are matched in lower case"


def test_root_cause_of_one_nodes_ranks() -> None:
    victim = failure(rank=0, exception="RuntimeError", message=GLOO_CLOSED, timestamp=100.01)
    cause = failure(rank=1, exception="FlakyStorageError", recoverable=True, timestamp=100.02)
    assert root_cause([victim, cause]) is cause, "a known cause wins over an earlier victim"
    assert root_cause([cause, victim]) is cause
    later = failure(rank=2, timestamp=100.5)
    assert root_cause([later, cause]) is cause, "then the earliest"
    twin = failure(rank=3, exception="FlakyStorageError", recoverable=True, timestamp=100.02)
    assert root_cause([twin, cause]) is twin, "an exact tie goes to the first given"
    other_victim = failure(rank=4, exception="SignalSIGTERM", message="Signal 15", timestamp=99.0)
    assert root_cause([victim, other_victim]) is other_victim, "victims only: the earliest"
    with pytest.raises(ValueError, match="no failures"):
        root_cause([])


# --- decide_run: failures close together ------------------------------------------------------------------------


def both_orders(first: NodeReport, second: NodeReport) -> list[list[NodeReport]]:
    return [[first, second], [second, first]]


@pytest.mark.parametrize("order", [0, 1], ids=["cause-first", "victim-first"])
@pytest.mark.parametrize("victim_time", [5000.2, 5000.9], ids=["victim-earlier", "victim-later"])
def test_a_cause_beats_a_victim_in_the_same_second(order: int, victim_time: float) -> None:
    victim = report("node 0", 1, failed(rank=0, exception="RuntimeError", message=GLOO_CLOSED, timestamp=victim_time))
    cause = report("node 1", 200, failed(rank=1, exception="FlakyStorageError", recoverable=True, timestamp=5000.5))
    verdict = decide_run(both_orders(cause, victim)[order])
    assert verdict.node == "node 1" and verdict.failure is not None and verdict.failure.rank == 1
    assert verdict.recoverable is True, "the cause's recoverability, not the victim's"
    assert "consequence" not in verdict.detail and "node 0" not in verdict.detail


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize(
    "peer",
    [
        # What the issue saw: the peer's runner died of a broken pipe to the store before it could write.
        report("worker-0", 1, None, finished_at=7000.0),
        report("worker-0", 1, failed(rank=0, exception="RuntimeError", message=GLOO_CLOSED, timestamp=6999.1)),
        report("worker-0", 1, failed(rank=-1, exception="DistNetworkError", message="Broken pipe", timestamp=6999.0)),
        report("worker-0", 143, None, finished_at=6999.0),
        report("worker-0", 137, None, finished_at=6999.0),  # no reason: the kubelet's SIGKILL after the grace
    ],
    ids=["exit-1-no-report", "gloo-victim", "agent-lost-store", "exit-143", "exit-137-no-reason"],
)
def test_an_oom_killed_pod_beats_its_peers_that_failed_because_of_it(order: int, peer: NodeReport) -> None:
    oom = report("worker-1", 137, None, reason="OOMKilled", finished_at=7000.0)
    verdict = decide_run(both_orders(oom, peer)[order])
    assert verdict.node == "worker-1" and verdict.failure is None
    assert verdict.recoverable is True
    assert "worker-1 exited with code 137 (OOMKilled)" in verdict.detail and "worker-0" not in verdict.detail


@pytest.mark.parametrize("order", [0, 1])
def test_an_evicted_pod_beats_a_victim(order: int) -> None:
    evicted = report("worker-0", None, None, reason="Evicted")
    victim = report("worker-1", 1, failed(rank=1, exception="RuntimeError", message="Connection reset by peer"))
    verdict = decide_run(both_orders(evicted, victim)[order])
    assert (verdict.node, verdict.recoverable) == ("worker-0", True)
    assert "Evicted" in verdict.detail


@pytest.mark.parametrize("order", [0, 1])
def test_a_reported_cause_beats_a_pod_killed_from_outside(order: int) -> None:
    cause = report("worker-0", 1, failed(rank=0, exception="ValueError", message="bad shard", timestamp=10.0))
    oom = report("worker-1", 137, None, reason="OOMKilled", finished_at=9.0)
    verdict = decide_run(both_orders(cause, oom)[order])
    assert verdict.node == "worker-0" and verdict.failure is not None and verdict.failure.exception == "ValueError"
    assert verdict.recoverable is False


def test_killed_pods_are_ordered_by_when_they_ended() -> None:
    verdict = decide_run(
        [
            report("worker-0", 137, None, reason="OOMKilled", finished_at=31.0),
            report("worker-1", None, None, reason="Evicted", finished_at=30.0),
            report("worker-2", 137, None, reason="OOMKilled"),  # unknown: after those that say
        ]
    )
    assert verdict.node == "worker-1"


def test_only_victims_keeps_the_earliest_and_says_it_looks_like_a_consequence() -> None:
    verdict = decide_run(
        [
            report("node 0", 1, failed(rank=0, exception="RuntimeError", message=GLOO_CLOSED, timestamp=40.7)),
            report("node 1", 1, failed(rank=2, exception="DistNetworkError", message="Broken pipe", timestamp=40.3)),
            report("node 2", 1, None),  # maybe the cause; it did not say
            report("node 3", 0, succeeded(None, holds_rank0=False)),
        ]
    )
    assert verdict.node == "node 1" and verdict.failure is not None and verdict.failure.rank == 2
    assert verdict.recoverable is False
    assert "looks like a consequence of a peer's failure" in verdict.detail, verdict.detail
    assert "a socket to torch's c10d store broke" in verdict.detail, "says why"
    assert "node 2 exited with code 1 without a failure report" in verdict.detail, "points at the silent node"
    assert "node 0" not in verdict.detail and "node 3" not in verdict.detail


def test_same_second_causes_are_ordered_by_sub_second_time_then_by_order() -> None:
    early = report("node 0", 1, failed(rank=0, exception="KeyError", timestamp=80.25))
    late = report("node 1", 1, failed(rank=1, exception="IndexError", timestamp=80.75))
    for reports in both_orders(early, late):
        assert decide_run(reports).node == "node 0"
    tie = report("node 2", 1, failed(rank=2, exception="IndexError", timestamp=80.25))
    assert decide_run([tie, early]).node == "node 2"
    assert decide_run([early, tie]).node == "node 0"


def test_a_local_node_killed_by_a_signal_beats_a_victim() -> None:
    verdict = decide_run(
        [
            report("node 0", 137, None, reason="SIGKILL"),  # local execution: killed by a signal from outside
            report("node 1", 1, failed(rank=1, exception="RuntimeError", message=GLOO_CLOSED)),
        ]
    )
    assert (verdict.node, verdict.recoverable) == ("node 0", True)
    assert "exited with code 137 (SIGKILL)" in verdict.detail


def test_a_worker_the_oom_killer_picked_is_said_to_be_out_of_memory() -> None:
    # On a real node the kernel kills a worker, not the runner: the runner reports the signal, the container OOMKilled.
    sigkill = failed(exception="SignalSIGKILL", message="Signal 9 (SIGKILL) received by PID 4711", recoverable=True)
    verdict = decide_run([report("job-worker-0", 1, sigkill, reason="OOMKilled")])
    assert verdict.recoverable and "SignalSIGKILL" in verdict.detail
    assert "its container ended OOMKilled (out of memory" in verdict.detail, verdict.detail
    # A worker's own exception in a container that ended normally says nothing of memory.
    plain = decide_run([report("job-worker-0", 1, failed(exception="ValueError", recoverable=False))])
    assert "container ended" not in plain.detail

"""Outcome documents (what a node reports) and ``decide_run`` (the verdict of a run from all its nodes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.outcome import (
    SCHEMA,
    NodeOutcome,
    NodeReport,
    ResultTooLargeError,
    WorkerFailure,
    decide_run,
    decode_outcome,
    encode_failure,
    encode_success,
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


def report(name: str, exit_code: int | None, outcome: NodeOutcome | None = None, reason: str = "") -> NodeReport:
    return NodeReport(name=name, exit_code=exit_code, outcome=outcome, reason=reason)


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

"""Text that pods and workers control is parsed by total functions: any input gives a value or None, never an
exception (termination messages can be any log tail; rank 0's code prints the metrics lines)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.metrics_format import parse_metrics_line
from airflow_provider_torchelastic.core.outcome import SCHEMA, decode_outcome
from airflow_provider_torchelastic.core.tap import MetricsTap

DEEP = "[" * 5000 + "]" * 5000

HOSTILE_DOCUMENTS = [
    "[" * 999,
    DEEP,
    json.dumps({"schema": SCHEMA, "succeeded": False, "failure": []}),
    json.dumps({"schema": SCHEMA, "succeeded": False, "failure": {"rank": "zero", "timestamp": "now", "message": 3}}),
    json.dumps({"schema": SCHEMA, "succeeded": False, "failure": {"timestamp": 1e999}}).replace("Infinity", "1e999"),
    '{"schema": "' + SCHEMA + '", "succeeded": false, "failure": {"timestamp": NaN}}',
    json.dumps({"schema": SCHEMA, "succeeded": "yes", "holds_rank0": "no"}),
    '{"schema": "' + SCHEMA + '", "succeeded": true, "result": Bogus}',
    json.dumps({"schema": SCHEMA, "succeeded": True, "result": "x" * 100_000}),
    b"\xff\xfe\x00",
]


@pytest.mark.parametrize("text", HOSTILE_DOCUMENTS)
def test_a_hostile_termination_message_decodes_to_a_value_or_none(text: str | bytes) -> None:
    outcome = decode_outcome(text)
    if outcome is not None and outcome.failure is not None:
        failure = outcome.failure
        assert isinstance(failure.rank, int) and isinstance(failure.message, str)
        assert isinstance(failure.timestamp, float) and failure.timestamp == failure.timestamp  # not NaN
        failure.summary()


def test_a_failure_with_wrong_types_keeps_what_is_right() -> None:
    doc = {"schema": SCHEMA, "succeeded": False, "failure": {"rank": "zero", "exception": "KeyError", "message": 3}}
    outcome = decode_outcome(json.dumps(doc))
    assert outcome is not None and outcome.failure is not None
    assert (outcome.failure.rank, outcome.failure.exception, outcome.failure.message) == (-1, "KeyError", "")


HOSTILE_LINES = [
    'TORCHELASTIC_METRICS {"last": [1]}',
    'TORCHELASTIC_METRICS {"last": "loss"}',
    'TORCHELASTIC_METRICS {"step": "z", "last": {"loss": "NaN", "x": {}}, "points": {"loss": [[1, "a"], 2]}}',
    'TORCHELASTIC_METRICS {"points": [1, 2], "last": null}',
    "TORCHELASTIC_METRICS {" + '"a": ' + DEEP + "}",
    "TORCHELASTIC_METRICS {" + "x" * (2 * 1024 * 1024) + "}",
    '[rank0]:TORCHELASTIC_METRICS {"last": {"loss": 1e999}}',
]


@pytest.mark.parametrize("line", HOSTILE_LINES)
def test_a_hostile_metrics_line_is_a_value_or_none_and_the_tap_survives_it(line: str) -> None:
    parse_metrics_line(line)
    logged: list[str] = []
    tap = MetricsTap(logged.append)
    tap(line)
    tap('[rank0]:TORCHELASTIC_METRICS {"step": 3, "last": {"loss": 0.5}}')
    assert tap.last == {"loss": 0.5}
    json.dumps(tap.to_json())


@given(st.text(max_size=300))
def test_any_text_after_the_marker_parses_to_a_value_or_none(tail: str) -> None:
    parse_metrics_line("TORCHELASTIC_METRICS {" + tail)
    decode_outcome('{"schema": "' + SCHEMA + '", ' + tail)


@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.text(max_size=5),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=5), c),
        max_leaves=20,
    )
)
def test_any_json_in_a_metrics_line_or_a_failure_parses_to_a_value_or_none(value: object) -> None:
    parse_metrics_line("TORCHELASTIC_METRICS " + json.dumps({"step": value, "last": value, "points": value}))
    decode_outcome(json.dumps({"schema": SCHEMA, "succeeded": False, "failure": value}))
    decode_outcome(json.dumps({"schema": SCHEMA, "succeeded": False, "failure": {"rank": value, "timestamp": value}}))

"""Job names and labels: deterministic, DNS-1035, short enough for the pods and Services the operator derives."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.naming import (
    LABEL_IDENTITY,
    LABEL_MANAGED_BY,
    LABEL_MAP_INDEX,
    LABEL_RUN_ID,
    MANAGED_BY,
    MAX_JOB_NAME_LENGTH,
    RunIdentity,
    identity_annotations,
    identity_labels,
    is_reserved_key,
    job_name,
    label_selector,
    placeholder_identity,
    safe_label_value,
)

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?)?$")


def ident(**overrides: object) -> RunIdentity:
    values: dict[str, object] = {"dag_id": "etl", "task_id": "train", "run_id": "manual__2026-01-01T00:00:00+00:00"}
    values.update(overrides)
    return RunIdentity(**values)  # type: ignore[arg-type]


def test_name_is_readable_and_deterministic() -> None:
    name = job_name(ident())
    assert name.startswith("etl-train-")
    assert name == job_name(ident())
    assert DNS_1035.match(name)


@pytest.mark.parametrize(
    "change", [{"dag_id": "etl2"}, {"task_id": "x"}, {"run_id": "r2"}, {"map_index": 0}, {"try_number": 2}]
)
def test_every_part_of_the_identity_changes_the_name(change: dict[str, object]) -> None:
    assert job_name(ident(**change)) != job_name(ident())


def test_ambiguous_concatenations_differ() -> None:
    assert job_name(ident(dag_id="a-b", task_id="c")) != job_name(ident(dag_id="a", task_id="b-c"))


@settings(max_examples=300, deadline=None)
@given(
    dag_id=st.text(min_size=1, max_size=300),
    task_id=st.text(min_size=1, max_size=300),
    run_id=st.text(min_size=1, max_size=300),
    map_index=st.integers(-1, 10**6),
    try_number=st.integers(0, 10**4),
)
def test_any_identity_gives_a_valid_short_name_and_labels(
    dag_id: str, task_id: str, run_id: str, map_index: int, try_number: int
) -> None:
    identity = RunIdentity(dag_id=dag_id, task_id=task_id, run_id=run_id, map_index=map_index, try_number=try_number)
    name = job_name(identity)
    assert DNS_1035.match(name) and len(name) <= MAX_JOB_NAME_LENGTH
    for pod in (f"{name}-worker-99999", f"{name}-master-0"):
        assert len(pod) <= 63 and DNS_1035.match(pod)
    for value in identity_labels(identity).values():
        assert len(value) <= 63 and LABEL_VALUE.match(value)
    assert identity_annotations(identity)[LABEL_RUN_ID] == run_id


def test_names_that_start_with_a_digit_or_have_no_letters() -> None:
    assert job_name(ident(dag_id="2024_etl", task_id="1")).startswith("te-2024-etl-1-")
    assert job_name(ident(dag_id="___", task_id="ü")).startswith("te-")


def test_long_dag_ids_keep_the_task_readable() -> None:
    name = job_name(ident(dag_id="a_very_long_dag_id_" * 10, task_id="fine_tune_llm"))
    assert "fine-tune-llm" in name


@pytest.mark.parametrize(
    ("value", "expected"),
    [("etl", "etl"), ("a.b_c-d", "a.b_c-d"), ("", ""), ("x" * 63, "x" * 63)],
)
def test_valid_label_values_are_kept(value: str, expected: str) -> None:
    assert safe_label_value(value) == expected


@pytest.mark.parametrize("value", ["manual__2026-01-01T00:00:00+00:00", "x" * 64, "-lead", "trail.", "ü", "a b"])
def test_invalid_label_values_are_made_safe_and_stay_distinct(value: str) -> None:
    safe = safe_label_value(value)
    assert LABEL_VALUE.match(safe) and len(safe) <= 63
    assert safe == safe_label_value(value)
    assert safe != safe_label_value(value + "x")


def test_labels_carry_the_identity_and_the_provider() -> None:
    labels = identity_labels(ident(map_index=3, try_number=2))
    assert labels[LABEL_MANAGED_BY] == MANAGED_BY
    assert labels[LABEL_MAP_INDEX] == "3"
    assert LABEL_MAP_INDEX not in identity_labels(ident())


def test_label_selectors() -> None:
    identity = ident(try_number=3)
    assert label_selector(identity) == f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_IDENTITY}={identity.digest}"
    every_try = label_selector(identity, all_tries=True)
    assert "try-number" not in every_try and every_try.endswith(f",!{LABEL_MAP_INDEX}")
    assert f"{LABEL_MAP_INDEX}=4" in label_selector(ident(map_index=4), all_tries=True)
    assert label_selector(ident(try_number=1), all_tries=True) == every_try


def test_placeholder_identity() -> None:
    identity = placeholder_identity("dag", "task")
    assert (identity.dag_id, identity.task_id, identity.map_index, identity.try_number) == ("dag", "task", -1, 1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"dag_id": ""}, TypeError, "dag_id"),
        ({"run_id": None}, TypeError, "run_id"),
        ({"map_index": -2}, ValueError, "map_index"),
        ({"try_number": True}, TypeError, "try_number"),
        ({"try_number": -1}, ValueError, "try_number"),
    ],
)
def test_invalid_identity(kwargs: dict[str, object], exc: type[Exception], field: str) -> None:
    with pytest.raises(exc, match=field):
        ident(**kwargs)


@pytest.mark.parametrize(
    ("key", "reserved"),
    [
        ("torchelastic.airflow.apache.org/dag-id", True),
        ("app.kubernetes.io/managed-by", True),
        ("training.kubeflow.org/job-name", True),
        ("app.kubernetes.io/name", False),
        ("kueue.x-k8s.io/queue-name", False),
        ("team", False),
    ],
)
def test_reserved_keys(key: str, reserved: bool) -> None:
    assert is_reserved_key(key) is reserved


def test_a_trailing_newline_is_not_a_valid_label_value() -> None:
    # "$" matches before a final newline; a label value with one would be refused by the API server.
    assert safe_label_value("manual__2026\n") != "manual__2026\n"
    assert "\n" not in safe_label_value("manual__2026\n")

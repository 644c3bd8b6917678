"""Every parser of text or objects that a pod, an XCom or a store controls is total: whatever it is given, it returns
a value (or its "nothing") or raises its one declared error, never another exception.

Who controls what: a pod writes its termination message (with ``FallbackToLogsOnError``, any log tail) and the
user's pod template its env; rank 0's code prints the metrics lines; any DAG can push the ``torch_elastic_job``
XCom the UI lists; whoever can write under a checkpoint root or the artifact storage writes the ``COMMITTED``
markers and the safetensors headers; a trigger event is read back from Airflow's database. One bad input must cost
its own row, pod or folder, never the task, the page or every resume.

The strategies are adversarial on purpose: integers of 400 digits (past float's range, within int's digit limit),
digits ``str.isdigit()`` accepts and ``int()`` does not (``"²"``) or reads otherwise (``"٣"``), ``1e999``/``NaN``
/``Infinity`` as JSON literals, values nested 2000 deep (past the JSON parser's and ``repr``'s recursion limit),
lists where objects belong and numbers where text does. Each property test runs 200 examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.artifact_ref import KINDS, MARKER, ArtifactRef, ArtifactRefError, walk_refs
from airflow_provider_torchelastic.core.metrics_format import MARKER as METRICS_MARKER
from airflow_provider_torchelastic.core.metrics_format import MetricSeries, parse_metrics_line
from airflow_provider_torchelastic.core.naming import REPLICA_INDEX_LABEL, REPLICA_TYPE_LABEL, RunIdentity, job_name
from airflow_provider_torchelastic.core.outcome import SCHEMA, NodeOutcome, decode_outcome
from airflow_provider_torchelastic.core.summary import JobSummary, PodSummary, pod_summaries, pod_summary
from airflow_provider_torchelastic.core.tap import MetricsTap
from airflow_provider_torchelastic.kubernetes.wait_types import Phase
from airflow_provider_torchelastic.plugin import views
from airflow_provider_torchelastic.plugin.service import JobsService
from airflow_provider_torchelastic.plugin.views import Identity
from airflow_provider_torchelastic.worker import checkpoint
from airflow_provider_torchelastic.worker.safetensors_io import HashingReader, read_safetensors_from

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- the adversarial values ---------------------------------------------------------------------------------------

HUGE = 10**400
DEPTH = 2000


def _nested(depth: int, inner: Any = None) -> Any:
    value = [] if inner is None else inner
    for _ in range(depth):
        value = [value]
    return value


#: A list nested 2000 deep (``repr``, ``str`` and ``json.dumps`` of it raise RecursionError) and its JSON text
#: (``json.loads`` of it raises RecursionError, which is no ValueError).
DEEP_VALUE = _nested(DEPTH)
DEEP_JSON = "[" * DEPTH + "]" * DEPTH
#: Digits ``str.isdigit()`` says yes to: ``int()`` refuses the first two (superscript two, circled one), and reads
#: the others (double-struck 01, Arabic-Indic three, N'Ko five, Bengali zero) as 1, 3, 5 and 0.
ODD_DIGITS = ["²", "①", "\U0001d7d8\U0001d7d9", "٣", "߅", "\u09e6"]

#: Python values no well-behaved writer makes; each can stand where any value goes (no DEEP_VALUE: it has no JSON).
SCALAR_ATOMS = st.sampled_from(
    [
        *(HUGE, -HUGE, 2**63, -(2**63) - 1, math.inf, -math.inf, math.nan, 1e308, -1e-320, True, False, None, 0, -1),
        *(*ODD_DIGITS, "9" * 400, "1e999", "inf", "nan", "NaN", "Infinity", "-Infinity", "", "x" * 100_000),
    ]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | SCALAR_ATOMS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
#: Any value at all, for a place where a dict, list, str or number belongs.
ANY_VALUE = st.one_of(SCALAR_ATOMS, st.just(DEEP_VALUE), JSON_VALUES)
#: JSON literals, for text documents: the values above as JSON, and what json.dumps never writes (1e999, numbers of
#: 400 digits written out, nesting past the parser's depth).
LITERALS = st.one_of(
    st.sampled_from(["9" * 400, "-" + "9" * 400, "1e999", "-1e999", "NaN", "-Infinity", DEEP_JSON, "[]", "{}"]),
    st.sampled_from(ODD_DIGITS).map(json.dumps),
    JSON_VALUES.map(json.dumps),
)


def _object_text(
    required: dict[str, st.SearchStrategy[str]] | None = None, optional: dict[str, st.SearchStrategy[str]] | None = None
) -> st.SearchStrategy[str]:
    """A JSON object's text whose members' texts come from the strategies (so they can be any literal above)."""
    members = st.fixed_dictionaries(required or {}, optional=optional or {})
    return members.map(lambda found: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in found.items()) + "}")


def _shaped(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A dict with some of ``fields``, or any value at all in its place."""
    return st.one_of(st.fixed_dictionaries({}, optional=fields), ANY_VALUE)


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except RecursionError:  # DEEP_VALUE inside: its text is just as deep
        return DEEP_JSON


def _any(*names: str) -> dict[str, st.SearchStrategy[Any]]:
    return dict.fromkeys(names, ANY_VALUE)


# --- 1. a node's outcome document (a termination message, a local result file) -----------------------------------

FAILURE_FIELDS = ("rank", "exception", "message", "traceback", "recoverable", "exitcode", "timestamp", "hostname")
FAILURE_TEXT = _object_text(optional=dict.fromkeys((*FAILURE_FIELDS, "module", "bases"), LITERALS))
OUTCOME_TEXT = st.one_of(
    st.text(),
    _object_text(
        required={
            "schema": st.just(json.dumps(SCHEMA)) | LITERALS,
            "succeeded": st.sampled_from(["true", "false"]) | LITERALS,
        },
        optional={"holds_rank0": LITERALS, "result": LITERALS, "result_ref": LITERALS, "failure": FAILURE_TEXT},
    ),
)


def _check_outcome(outcome: NodeOutcome | None) -> None:
    assert outcome is None or isinstance(outcome, NodeOutcome)
    if outcome is not None and outcome.failure is not None:
        failure = outcome.failure
        assert type(failure.rank) is int and -(2**63) <= failure.rank < 2**63
        assert type(failure.exitcode) is int and -(2**63) <= failure.exitcode < 2**63
        assert isinstance(failure.timestamp, float) and math.isfinite(failure.timestamp)
        assert all(isinstance(text, str) for text in (failure.exception, failure.message, failure.hostname))
        failure.summary()


@PROPERTY
@given(st.one_of(OUTCOME_TEXT, OUTCOME_TEXT.map(str.encode), ANY_VALUE))
def test_an_outcome_document_decodes_to_an_outcome_or_none(text: Any) -> None:
    _check_outcome(decode_outcome(text))


def test_a_400_digit_integer_in_an_outcome_is_read_as_absent() -> None:
    huge = "9" * 400
    text = (
        f'{{"schema": "{SCHEMA}", "succeeded": false, "failure": {{"rank": {huge}, "exception": "OSError", '
        f'"exitcode": {huge}, "timestamp": {huge}}}}}'
    )
    outcome = decode_outcome(text)  # raised OverflowError: float() of the timestamp
    assert outcome is not None and outcome.failure is not None
    failure = outcome.failure
    assert (failure.rank, failure.exception, failure.exitcode, failure.timestamp) == (-1, "OSError", 1, 0.0)


# --- 2. a metrics line (rank 0's code prints it; the wait and the UI parse it) -------------------------------------

POINTS_TEXT = st.lists(st.tuples(LITERALS, LITERALS).map(lambda p: f"[{p[0]}, {p[1]}]"), max_size=3).map(
    lambda points: "[" + ", ".join(points) + "]"
)
METRICS_DOC = _object_text(
    optional={
        "step": LITERALS,
        "last": _object_text(optional={"loss": LITERALS, "acc": LITERALS}) | LITERALS,
        "points": _object_text(optional={"loss": POINTS_TEXT | LITERALS}) | LITERALS,
    }
)
LINE_PREFIX = st.sampled_from(["", "[rank0]:", "[pod-0] [rank0]:", "2026-01-01T00:00:00.000000000Z [pod-0] "])
METRICS_LINE = st.one_of(
    st.text(),
    st.tuples(LINE_PREFIX, METRICS_DOC).map(lambda parts: f"{parts[0]}{METRICS_MARKER} {parts[1]}"),
    st.text().map(lambda tail: f"{METRICS_MARKER} {{{tail}"),
)


@PROPERTY
@given(st.one_of(METRICS_LINE, ANY_VALUE))
def test_a_metrics_line_parses_to_a_line_or_none_and_the_tap_goes_on(line: Any) -> None:
    parsed = parse_metrics_line(line)
    if parsed is not None:
        assert parsed.step is None or math.isfinite(parsed.step)
        assert all(isinstance(value, float) for value in parsed.last.values())
        assert all(math.isfinite(step) for points in parsed.points.values() for step, _ in points)
        MetricSeries().extend(parsed)
    if isinstance(line, str):
        tap = MetricsTap(lambda text: None)
        tap(line)
        json.dumps(tap.to_json(), allow_nan=False)


def test_a_400_digit_integer_in_a_metrics_line_is_no_number_and_the_wait_goes_on() -> None:
    line = f'[rank0]:{METRICS_MARKER} {{"step": 3, "last": {{"loss": {"9" * 400}, "acc": 0.5}}}}'
    parsed = parse_metrics_line(line)  # raised OverflowError, and a non-deferrable wait with it
    assert parsed is not None and (parsed.step, dict(parsed.last)) == (3.0, {"acc": 0.5})
    logged: list[str] = []
    tap = MetricsTap(logged.append)
    tap(line)
    assert logged == ["metrics: step 3 acc=0.5"] and tap.last == {"acc": 0.5}


# --- 3. a job summary from XCom (any DAG can push one; the UI lists them all) ---------------------------------------

POD_DICT = _shaped(
    _any("name", "replica_type", "replica_index", "ranks", "phase", "node", "restarts", "reason", "message")
    | _any("exit_code", "log_tail")
)
SUMMARY_DICT = st.fixed_dictionaries(
    {"version": st.just(1) | ANY_VALUE},
    optional={
        "kind": st.just("PyTorchJob") | ANY_VALUE,
        "name": st.just("train-abc") | ANY_VALUE,
        "phase": st.sampled_from(["succeeded", "failed"]) | ANY_VALUE,
        "created": st.floats(0, 2e9) | ANY_VALUE,
        "finished": st.floats(0, 2e9) | ANY_VALUE,
        "pods": st.lists(POD_DICT, max_size=2) | ANY_VALUE,
        "metrics": st.dictionaries(st.text(max_size=4), st.lists(st.lists(ANY_VALUE, max_size=3), max_size=3))
        | ANY_VALUE,
        "last_metrics": st.dictionaries(st.text(max_size=4), ANY_VALUE, max_size=2) | ANY_VALUE,
        "artifacts": st.lists(_shaped(_any("path", "kind", "url", "bytes")), max_size=2) | ANY_VALUE,
    }
    | _any("namespace", "root_cause", "artifacts_omitted"),
)
ROW = Identity(dag_id="d", task_id="t", run_id="r", try_number=1)


@PROPERTY
@given(st.one_of(SUMMARY_DICT, SUMMARY_DICT.map(_json_text), ANY_VALUE, st.text()))
def test_a_summary_xcom_reads_as_a_strict_json_summary_or_nothing(value: Any) -> None:
    with contextlib.suppress(ValueError):
        JobSummary.from_json(value)
    summary = views.summary_from_xcom(value)
    if summary is not None:
        # What the UI's API answers must be strict JSON: json.dumps(allow_nan=False) is what it runs.
        json.dumps(summary, allow_nan=False)
        json.dumps(views.job_row_from_summary(summary, ROW), allow_nan=False)
        json.dumps(views.job_detail_from_summary(summary, ROW), allow_nan=False)


# --- 4. pods as the API server lists them (the user writes their template) -----------------------------------------

DIGITS = st.one_of(
    st.sampled_from([*ODD_DIGITS, "4", "0", "9" * 400, "1" * 19, " 4", "4\n", "-1", "+2"]),
    st.text("0123456789²٣", max_size=25),
)
ENV = st.lists(
    _shaped({"name": st.sampled_from(["PET_NPROC_PER_NODE", "PET_NODE_RANK"]), "value": DIGITS | ANY_VALUE}),
    max_size=3,
)
CONTAINER = _shaped(
    {
        "name": st.just("pytorch") | ANY_VALUE,
        "env": ENV | ANY_VALUE,
        "command": st.lists(st.just("--nproc-per-node") | DIGITS | ANY_VALUE, max_size=3) | ANY_VALUE,
        "args": st.lists(DIGITS, max_size=2) | ANY_VALUE,
    }
)
ENDED = _shaped({"reason": ANY_VALUE, "message": OUTCOME_TEXT | ANY_VALUE, "exitCode": ANY_VALUE})
CONTAINER_STATUS = _shaped(
    {
        "name": st.just("pytorch") | ANY_VALUE,
        "state": _shaped({"terminated": ENDED, "waiting": _shaped(_any("reason", "message"))}),
        "lastState": _shaped({"terminated": ENDED}),
        "restartCount": ANY_VALUE,
    }
)
POD = _shaped(
    {
        "metadata": _shaped(
            {
                "name": ANY_VALUE,
                "labels": _shaped(
                    {REPLICA_TYPE_LABEL: st.sampled_from(["master", "worker"]) | ANY_VALUE, REPLICA_INDEX_LABEL: DIGITS}
                ),
            }
        ),
        "spec": _shaped({"containers": st.lists(CONTAINER, max_size=2) | ANY_VALUE, "nodeName": ANY_VALUE}),
        "status": _shaped(
            {"containerStatuses": st.lists(CONTAINER_STATUS, max_size=2) | ANY_VALUE} | _any("phase", "reason")
        ),
    }
)


@PROPERTY
@given(st.lists(POD, max_size=3) | ANY_VALUE)
def test_any_pod_gives_a_summary(pods: Any) -> None:
    for summary in pod_summaries(pods):
        assert isinstance(summary, PodSummary) and len(summary.ranks) <= 4096
        assert summary.replica_index is None or summary.replica_index >= 0
        json.dumps(summary.to_dict(), allow_nan=False)
    if isinstance(pods, list):
        for pod in pods:
            assert pod_summary(pod) == PodSummary.from_dict(pod_summary(pod).to_dict())


def _pod(env: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    container = {"name": "pytorch", "env": [{"name": name, "value": value} for name, value in env.items()]}
    return {"metadata": {"name": "p", "labels": labels or {}}, "spec": {"containers": [container]}}


@pytest.mark.parametrize("digit", ["²", "٣"])
def test_a_digit_python_calls_one_in_a_pods_env_is_no_worker_count(digit: str) -> None:
    # "²".isdigit() is True, int("²") raises ValueError; int("٣") is 3: neither is what a pod's settings say.
    summary = pod_summary(_pod({"PET_NPROC_PER_NODE": digit}))
    assert summary.ranks == ()
    labels = {REPLICA_TYPE_LABEL: "worker", REPLICA_INDEX_LABEL: digit}
    worker = pod_summary(_pod({"PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": digit}, labels))
    assert (worker.replica_index, worker.ranks) == (None, ())
    assert pod_summary(_pod({"PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"}, labels)).ranks == (2, 3)


# --- 5. an artifact reference (in rank 0's value) -------------------------------------------------------------------

TENSOR_INFO = _shaped(
    {
        "dtype": st.sampled_from(["F32", "I64"]) | ANY_VALUE,
        "shape": st.lists(st.integers(-1, 4) | ANY_VALUE, max_size=3) | ANY_VALUE,
    }
)
REFERENCE = st.fixed_dictionaries(
    {MARKER: st.just(1) | ANY_VALUE},
    optional={
        "kind": st.sampled_from(KINDS) | ANY_VALUE,
        "url": st.just("s3://bucket/artifacts/0000-model.safetensors") | ANY_VALUE,
        "bytes": st.integers(0, 10) | ANY_VALUE,
        "sha256": st.just("0" * 64) | ANY_VALUE,
        "class": st.just("dags.train.Net") | ANY_VALUE,
        "tensors": st.dictionaries(st.text(max_size=4), TENSOR_INFO, max_size=2) | ANY_VALUE,
    },
)


@PROPERTY
@given(REFERENCE | ANY_VALUE)
def test_an_artifact_reference_parses_or_raises_artifact_ref_error(doc: Any) -> None:
    with contextlib.suppress(ArtifactRefError):
        assert isinstance(ArtifactRef.from_json(doc), ArtifactRef)
    try:
        # Deep values around it too: the walk is no recursion.
        found = list(walk_refs({"a": [DEEP_VALUE, _nested(DEPTH, [doc])]}))
    except ArtifactRefError:
        return
    assert all(isinstance(ref, ArtifactRef) for _, ref in found)


def test_a_reference_whose_kind_is_a_list_is_a_malformed_reference() -> None:
    with pytest.raises(ArtifactRefError, match="kind"):
        ArtifactRef.from_json({MARKER: 1, "kind": ["module"]})  # raised TypeError: unhashable type: 'list'


# --- 6. a safetensors header (the artifact storage's bytes) ---------------------------------------------------------

SHAPE_TEXT = st.lists(st.sampled_from(["0", "1", "2", "4", "9" * 400, str(2**62), "-1", "1.5", "true"]), max_size=4)
OFFSETS_TEXT = st.lists(st.sampled_from(["0", "4", "8", "16", "9" * 400, "-1", '"0"']), max_size=3)
ENTRY_TEXT = _object_text(
    optional={
        "dtype": st.sampled_from(['"F32"', '"BF16"', '"U8"', '"XX"']) | LITERALS,
        "shape": SHAPE_TEXT.map(lambda items: "[" + ", ".join(items) + "]") | LITERALS,
        "data_offsets": OFFSETS_TEXT.map(lambda items: "[" + ", ".join(items) + "]") | LITERALS,
    }
)
HEADER_TEXT = st.one_of(
    st.text(max_size=40), LITERALS, _object_text(optional={"x": ENTRY_TEXT | LITERALS, "__metadata__": LITERALS})
)
#: Shapes with a zero (no bytes, so they pass the tiling check) whose other sizes overflow torch's and numpy's int64.
OVERFLOWING_SHAPE = f'{{"x": {{"dtype": "F32", "shape": [0, {2**62}, {2**62}], "data_offsets": [0, 0]}}}}'
TOO_LARGE_A_DIMENSION = f'{{"x": {{"dtype": "F32", "shape": [0, {2**64}], "data_offsets": [0, 0]}}}}'


@PROPERTY
@given(HEADER_TEXT, st.integers(0, 16), st.sampled_from(["np", "pt"]))
@example(OVERFLOWING_SHAPE, 0, "pt")  # torch.empty: RuntimeError, "Stride calculation overflowed"
@example(TOO_LARGE_A_DIMENSION, 0, "pt")  # torch.empty: TypeError, "Overflow when unpacking long"
@example(TOO_LARGE_A_DIMENSION, 0, "np")
@example(DEEP_JSON, 0, "np")
def test_a_safetensors_header_reads_or_raises_value_error(header: str, data_size: int, framework: str) -> None:
    encoded = header.encode()
    blob = struct.pack("<Q", len(encoded)) + encoded + bytes(data_size)
    reader = HashingReader(io.BytesIO(blob))
    try:
        read_safetensors_from(reader, len(blob), framework)
    except (ValueError, EOFError):  # its declared errors, which the loader reports as ArtifactIntegrityError
        pass
    finally:
        reader.close()


def test_a_header_whose_shape_overflows_is_not_a_file_of_ours() -> None:
    encoded = OVERFLOWING_SHAPE.encode()
    reader = HashingReader(io.BytesIO(struct.pack("<Q", len(encoded)) + encoded))
    with pytest.raises(ValueError, match="bad shape"):
        read_safetensors_from(reader, 8 + len(encoded), "pt")  # raised RuntimeError from torch.empty


# --- 7. a checkpoint's COMMITTED marker (whoever can write under the root) ------------------------------------------

GOOD_MARKER = {"step": 1, "kind": "torch.save", "committed_at": 1_700_000_000.5, "rank": 0}
MARKER_BYTES = st.one_of(
    st.binary(max_size=40),
    LITERALS.map(str.encode),
    _object_text(
        optional={
            "step": LITERALS,
            "kind": st.sampled_from(['"torch.save"', '"torch.distributed.checkpoint"']) | LITERALS,
            "committed_at": st.just("1700000000.5") | LITERALS,
            "rank": LITERALS,
        }
    ).map(str.encode),
)


def _checkpoints(root: Path, odd_marker: bytes | None) -> None:
    """Step 1 committed as this package commits; step 2 committed with ``odd_marker`` (None: only step 2)."""
    good = root / "step-000000000001-good"
    good.mkdir()
    (good / checkpoint.COMMIT_MARKER).write_text(json.dumps(GOOD_MARKER))
    odd = root / "step-000000000002-odd"
    odd.mkdir()
    (odd / checkpoint.COMMIT_MARKER).write_bytes(odd_marker if odd_marker is not None else b"")


@PROPERTY
@given(MARKER_BYTES)
def test_any_marker_leaves_latest_a_checkpoint_to_find(marker: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        _checkpoints(Path(folder), marker)
        found = checkpoint.latest(folder)
    assert found is not None and found.step in (1, 2)
    assert isinstance(found.kind, str) and math.isfinite(found.committed_at)


@pytest.mark.parametrize(
    "marker",
    [
        {"step": 2, "kind": "torch.save", "committed_at": "soon"},  # float("soon"): ValueError
        {"step": 2, "kind": "torch.save", "committed_at": HUGE},  # float(10**400): OverflowError
        {"step": 2, "kind": ["torch.save"], "committed_at": 1.0},
        ["torch.save", 1.0],  # list.get: AttributeError
    ],
    ids=["committed_at-text", "committed_at-huge", "kind-list", "a-list"],
)
def test_a_malformed_marker_is_no_checkpoint_and_is_logged(
    marker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _checkpoints(tmp_path, json.dumps(marker).encode())
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        found = checkpoint.latest(str(tmp_path))
    assert found is not None and (found.step, found.committed_at) == (1, GOOD_MARKER["committed_at"])
    assert "step-000000000002-odd" in caplog.text and "COMMITTED" in caplog.text


def test_a_malformed_marker_alone_leaves_no_checkpoint(tmp_path: Path) -> None:
    odd = tmp_path / "step-000000000002-odd"
    odd.mkdir()
    (odd / checkpoint.COMMIT_MARKER).write_text('{"committed_at": "soon"}')
    assert checkpoint.latest(str(tmp_path)) is None


# --- 8. a trigger event (read back from Airflow's database by execute_complete) -----------------------------------

VERDICT = _shaped(
    {"succeeded": st.booleans() | ANY_VALUE, "failure": _shaped(_any(*FAILURE_FIELDS, "bases"))}
    | _any("result", "result_ref", "recoverable", "node", "detail", "cause", "exit_code", "reason", "unknown")
)
SERIES = _shaped(
    {
        "metrics": st.dictionaries(
            st.text(max_size=4),
            _shaped({"kept": st.lists(st.lists(ANY_VALUE, max_size=3), max_size=3)} | _any("stride", "offered")),
            max_size=2,
        )
        | ANY_VALUE
    }
    | _any("max_points", "last_step")
)
EVENT = st.fixed_dictionaries(
    {},
    optional={
        "status": st.sampled_from(["done", "error"]) | ANY_VALUE,
        "phase": st.sampled_from([phase.value for phase in Phase]) | ANY_VALUE,
        "verdict": st.none() | VERDICT,
        "pods": st.lists(POD_DICT, max_size=2) | ANY_VALUE,
        "metrics": _shaped({"series": SERIES, "tails": st.dictionaries(st.text(max_size=4), ANY_VALUE, max_size=2)}),
    }
    | _any("progress", "state", "created", "message"),
)


@PROPERTY
@given(EVENT | ANY_VALUE)
def test_a_trigger_event_decodes_or_raises_value_error(payload: Any) -> None:
    from airflow_provider_torchelastic.triggers import JobEnded, WaitFailed, event_from_payload

    try:
        outcome = event_from_payload(payload)
    except ValueError:
        return
    if isinstance(outcome, WaitFailed):
        assert isinstance(outcome.message, str)
        return
    assert isinstance(outcome, JobEnded)
    decision = outcome.decision
    assert decision.created is None or math.isfinite(decision.created)
    # What execute_complete does next with the event's metrics: the summary's charts come from them.
    tap = MetricsTap.from_json(decision.metrics, lambda text: None)
    json.dumps(tap.to_json(), allow_nan=False)


def test_an_event_whose_verdict_has_a_field_this_version_does_not_know_still_decodes() -> None:
    from airflow_provider_torchelastic.triggers import JobEnded, event_from_payload

    payload = {"status": "done", "phase": "failed", "progress": "", "verdict": {"succeeded": False, "later": 1}}
    outcome = event_from_payload(payload)  # raised TypeError: Verdict() got an unexpected keyword argument
    assert isinstance(outcome, JobEnded) and outcome.decision.verdict is not None
    assert outcome.decision.verdict.succeeded is False


# --- the UI's listing: a bad row hides itself, not the page ---------------------------------------------------------


class _NoKube:
    conn_id = "kubernetes_default"
    default_namespace = "ml"

    def jobs(self, namespace: str) -> tuple[Any, ...]:
        return ()

    def find(self, namespace: str, name: str) -> None:
        return None


class _Rows:
    """The summaries' surface over XCom rows as stored, whatever their values are."""

    def __init__(self, rows: list[tuple[Identity, Any]]) -> None:
        self.rows = rows

    def dag_ids(self) -> set[str]:
        return {identity.dag_id for identity, _ in self.rows}

    def job_namespaces(self) -> dict[str, set[str]]:
        return {}

    def latest(self, query: Any) -> list[tuple[Identity, Any]]:
        # A detail view reads one task instance's row by its keys; the list, every row.
        keys = ("dag_id", "run_id", "task_id", "map_index")
        return [row for row in self.rows if all(getattr(query, k) in (None, getattr(row[0], k)) for k in keys)]

    def ended(self, jobs: Any) -> set[Any]:
        return set()

    def naming(self, namespace: str | None, name: str, dag_ids: Any) -> list[Identity]:
        # What the database's JSON filter does: the rows whose value names the job.
        return [row for row, value in self.rows if isinstance(value, dict) and value.get("name") == name]


class _Everyone:
    def readable(self, dag_ids: set[str]) -> set[str]:
        return set(dag_ids)

    def can_read(self, dag_id: str) -> bool:
        return True

    def can_read_logs(self, dag_id: str) -> bool:
        return True

    def sees_kubernetes_errors(self) -> bool:
        return True


def _row_of(dag_id: str) -> tuple[Identity, str]:
    """A task instance try's XCom row, and the name of the job that try ran."""
    run = RunIdentity(dag_id=dag_id, task_id="train", run_id="manual__1", try_number=1)
    row = Identity(dag_id=dag_id, task_id="train", run_id="manual__1", try_number=1)
    return row, job_name(run)


def _summary_of(name: str, **fields: Any) -> dict[str, Any]:
    summary = {"version": 1, "kind": "Pod", "namespace": "ml", "name": name, "phase": "failed"}
    return {**summary, "created": 1_800_000_000.0, "finished": 1_800_000_090.0, **fields}


def test_a_summary_xcom_of_a_wrong_shape_hides_itself_not_the_listing(caplog: pytest.LogCaptureFixture) -> None:
    good_row, good_name = _row_of("good")
    rows = [(good_row, _summary_of(good_name))]
    for index, fields in enumerate(
        [
            {"created": HUGE},  # float(): OverflowError
            {"metrics": {"loss": [[1, 2, 3]]}, "finished": "later"},  # unpacking, then float(): ValueError
            {"last_metrics": ["loss"]},  # list.items: AttributeError
            {"pods": "p"},
        ]
    ):
        row, name = _row_of(f"odd{index}")
        rows.append((row, _summary_of(name, **fields)))
    service = JobsService(_NoKube(), _Rows(rows))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        listed = service.list_jobs(_Everyone())["jobs"]  # type: ignore[arg-type]
    assert [row["dag_id"] for row in listed] == ["good"]
    assert all(f"odd{index}/manual__1/train" in caplog.text for index in range(4))
    # The detail of a job whose only summary is a bad one is no job, not an error.
    assert service.job("ml", _row_of("odd0")[1], _Everyone()) is None  # type: ignore[arg-type]


def test_an_xcom_row_airflows_decoder_refuses_is_skipped() -> None:
    from airflow_provider_torchelastic.plugin import sources

    # A class name off the deserialization allow list: XComModel.deserialize_value raises ImportError.
    stored = json.dumps({"__classname__": "no_such_module.Thing", "__version__": 1, "__data__": 1})
    assert sources._xcom_value(stored, "a row") is sources._UNREADABLE
    assert sources._xcom_value(DEEP_JSON, "a row") is sources._UNREADABLE  # RecursionError
    assert sources._xcom_value(json.dumps({"version": 1}), "a row") == {"version": 1}

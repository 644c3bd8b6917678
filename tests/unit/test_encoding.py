"""Rank 0's value as strict JSON (``encoding``): the natural conversions, with real torch and numpy objects, and the
refusals that name the type and where it sits."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import math
import pathlib
import subprocess
import sys
import uuid
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from airflow_provider_torchelastic.core.encoding import (
    MAX_ARRAY_ELEMENTS,
    NAN,
    NEGATIVE_INFINITY,
    POSITIVE_INFINITY,
    ResultNotSerializableError,
    value_to_json,
    value_to_jsonable,
)
from airflow_provider_torchelastic.core.outcome import decode_outcome, encode_success
from tests.conftest import REPO_ROOT


def strict_loads(text: str) -> Any:
    """What any strict JSON reader accepts: no bare NaN or Infinity."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"not strict JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)


def encoded(value: Any) -> Any:
    return strict_loads(value_to_json(value))


class Split(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Stage(enum.IntEnum):
    WARMUP = 1


class Color(enum.Enum):
    RED = (255, 0, 0)


class Point(NamedTuple):
    x: int
    y: int


@dataclasses.dataclass
class Metrics:
    loss: Any
    accuracy: float
    per_class: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    metrics: Metrics
    split: Split = Split.EVAL


# --- what plain JSON already was stays as it was ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -3, 2**70, 1.5, -0.0, 1e300, "", "text é ✓", [], {}, [1, "two", None], {"a": {"b": [1.0]}}],
)
def test_plain_json_encodes_as_json_dumps_does(value: Any) -> None:
    assert value_to_json(value) == json.dumps(value)


# --- conversions -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.tensor(1.5), 1.5),
        (torch.tensor(7), 7),
        (torch.tensor(True), True),
        (torch.tensor(0.25, dtype=torch.bfloat16), 0.25),
        (torch.tensor(0.5, dtype=torch.float16), 0.5),
        (np.float32(0.5), 0.5),
        (np.float64(0.1), 0.1),
        (np.float16(2.0), 2.0),
        (np.longdouble(3.0), 3.0),
        (np.int8(-3), -3),
        (np.uint64(2**63), 2**63),
        (np.bool_(False), False),
        (np.array(4.0), 4.0),
        (np.array(9), 9),
        (np.str_("label"), "label"),
    ],
    ids=repr,
)
def test_torch_and_numpy_scalars_become_numbers(value: Any, expected: Any) -> None:
    result = encoded(value)
    assert result == expected and type(result) is type(expected)


def test_torch_size_and_tuples_become_lists() -> None:
    assert encoded(torch.zeros(2, 3).shape) == [2, 3]
    assert encoded(torch.Size([])) == []
    assert encoded((1, (2, 3))) == [1, [2, 3]]
    assert encoded(Point(1, 2)) == [1, 2]  # a named tuple is a tuple, as json has it


def test_small_tensors_become_nested_lists() -> None:
    assert encoded(torch.arange(6).reshape(2, 3)) == [[0, 1, 2], [3, 4, 5]]
    assert encoded(torch.tensor([[True, False]])) == [[True, False]]
    assert encoded(torch.empty(0, 4)) == []
    assert encoded(torch.tensor([0.5, -1.0], dtype=torch.float16)) == [0.5, -1.0]


def test_a_tensor_that_requires_grad_is_detached() -> None:
    weights = torch.ones(3, requires_grad=True)
    assert encoded(weights * 2) == [2.0, 2.0, 2.0]
    assert encoded(torch.nn.Parameter(torch.tensor([1.0]))) == [1.0]
    assert encoded((weights * weights).sum()) == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_is_copied_to_the_cpu() -> None:
    assert encoded({"loss": torch.tensor(0.5, device="cuda"), "v": torch.arange(3, device="cuda")}) == {
        "loss": 0.5,
        "v": [0, 1, 2],
    }


def test_a_non_contiguous_view_encodes_its_values() -> None:
    assert encoded(torch.arange(6).reshape(2, 3).t()) == [[0, 3], [1, 4], [2, 5]]


def test_small_arrays_become_nested_lists() -> None:
    assert encoded(np.arange(4, dtype=np.uint16).reshape(2, 2)) == [[0, 1], [2, 3]]
    assert encoded(np.array([True, False])) == [True, False]
    assert encoded(np.array(["a", "b"])) == ["a", "b"]
    assert encoded(np.array([{"k": np.int64(1)}, None], dtype=object)) == [{"k": 1}, None]


def test_a_tensor_or_array_at_the_limit_is_accepted() -> None:
    assert len(encoded(torch.zeros(MAX_ARRAY_ELEMENTS, dtype=torch.int8))) == MAX_ARRAY_ELEMENTS
    assert len(encoded(np.zeros((100, MAX_ARRAY_ELEMENTS // 100)))) == 100


def test_non_finite_floats_become_strings_everywhere() -> None:
    value = {
        "float": [math.nan, math.inf, -math.inf],
        "numpy": [np.float32("nan"), np.float64("inf"), np.array(-np.inf)],
        "tensor": torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0]),
        "scalar": torch.tensor(float("nan")),
    }
    assert encoded(value) == {
        "float": [NAN, POSITIVE_INFINITY, NEGATIVE_INFINITY],
        "numpy": [NAN, POSITIVE_INFINITY, NEGATIVE_INFINITY],
        "tensor": [NAN, POSITIVE_INFINITY, NEGATIVE_INFINITY, 1.0],
        "scalar": NAN,
    }
    assert (NAN, POSITIVE_INFINITY, NEGATIVE_INFINITY) == ("NaN", "Infinity", "-Infinity")
    # float() reads the spellings back.
    assert math.isnan(float(NAN)) and float(POSITIVE_INFINITY) == math.inf and float(NEGATIVE_INFINITY) == -math.inf


def test_dataclasses_become_objects_of_their_fields_recursively() -> None:
    run = Run(name="r1", metrics=Metrics(loss=torch.tensor(0.25), accuracy=np.float32(0.5), per_class=[np.int64(3)]))
    assert encoded(run) == {
        "name": "r1",
        "metrics": {"loss": 0.25, "accuracy": 0.5, "per_class": [3]},
        "split": "eval",
    }


def test_dataclasses_are_read_field_by_field_not_deep_copied() -> None:
    class NoCopy:
        def __deepcopy__(self, memo: Any) -> Any:
            raise AssertionError("deep-copied")

    @dataclasses.dataclass
    class Holder:
        value: Any

    # asdict would deep-copy NoCopy before anything could refuse it.
    with pytest.raises(ResultNotSerializableError, match=r"result\.value has type .*NoCopy"):
        value_to_json(Holder(NoCopy()))


def test_a_dataclass_class_is_not_an_instance() -> None:
    with pytest.raises(ResultNotSerializableError, match=r"result has type builtins\.type"):
        value_to_json(Metrics)


def test_enums_become_their_value() -> None:
    assert encoded([Split.TRAIN, Stage.WARMUP, Color.RED]) == ["train", 1, [255, 0, 0]]


def test_dates_and_paths_become_strings() -> None:
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert encoded(
        [moment, datetime.date(2026, 1, 2), datetime.time(3, 4), pathlib.Path("/ckpt/e3"), pathlib.PurePosixPath("a")]
    ) == ["2026-01-02T03:04:05+00:00", "2026-01-02", "03:04:00", "/ckpt/e3", "a"]


def test_durations_decimals_and_uuids_become_numbers_and_strings() -> None:
    run = uuid.UUID("12345678-1234-5678-1234-567812345678")
    value = [
        datetime.timedelta(minutes=2, milliseconds=500),
        decimal.Decimal("12"),
        decimal.Decimal("1E+3"),
        decimal.Decimal("0.25"),
        decimal.Decimal("2.0"),
        decimal.Decimal("NaN"),
        decimal.Decimal("sNaN"),
        decimal.Decimal("-Infinity"),
        decimal.Decimal("1E+70"),
        run,
    ]
    assert encoded(value) == [120.5, 12, 1000, 0.25, 2.0, "NaN", "NaN", "-Infinity", 1e70, str(run)]
    kinds = [type(item) for item in value_to_jsonable(value)]
    assert kinds == [float, int, int, float, float, str, str, str, float, str]


def test_sets_become_sorted_lists() -> None:
    assert encoded({3, 1, 2}) == [1, 2, 3]
    assert encoded(frozenset({"b", "a"})) == ["a", "b"]
    assert encoded({(2, "b"), (1, "a")}) == [[1, "a"], [2, "b"]]


def test_mapping_keys_are_converted_as_json_does() -> None:
    # (1 and True are one key in a Python dict, hence 2)
    value = {2: "int", 2.5: "float", True: "bool", "s": "str", math.nan: "nan", np.int64(7): "numpy", Split.TRAIN: "e"}
    assert encoded(value) == {
        "2": "int",
        "2.5": "float",
        "true": "bool",
        "s": "str",
        "NaN": "nan",
        "7": "numpy",
        "train": "e",
    }
    plain = {1: "int", 2.5: "float", False: "bool", "s": "str"}
    assert value_to_json(plain) == json.dumps(plain)
    assert encoded(OrderedDict([("b", 1), ("a", 2)])) == {"b": 1, "a": 2}


def test_the_jsonable_form_holds_only_plain_python_types() -> None:
    value = value_to_jsonable({"t": torch.arange(2), "n": np.float32(1), "m": Metrics(1, np.nan), "s": {2, 1}})
    assert value == {"t": [0, 1], "n": 1.0, "m": {"loss": 1, "accuracy": "NaN", "per_class": []}, "s": [1, 2]}
    assert type(value["n"]) is float and all(type(item) is int for item in value["t"])


# --- what reaches XCom ----------------------------------------------------------------------------------------------


def test_the_xcom_value_keeps_the_strings_and_is_strict_json() -> None:
    outcome = decode_outcome(encode_success(value_to_json({"loss": torch.tensor(float("nan")), "ppl": math.inf})))
    assert outcome is not None and outcome.result == {"loss": "NaN", "ppl": "Infinity"}
    json.dumps(outcome.result, allow_nan=False)  # Airflow's XCom serialization gets strict JSON values


def test_bare_nan_from_an_older_runner_is_read_as_the_strings() -> None:
    document = encode_success('{"loss": NaN, "hi": Infinity, "lo": -Infinity, "ok": 1.5}')
    outcome = decode_outcome(document)
    assert outcome is not None and outcome.result == {"loss": "NaN", "hi": "Infinity", "lo": "-Infinity", "ok": 1.5}


# --- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"metrics": [1, 2, object()]}, r"result\['metrics'\]\[2\] has type builtins\.object"),
        ([b"raw"], r"result\[0\] has type builtins\.bytes"),
        ({"c": 1 + 2j}, r"result\['c'\] has type builtins\.complex"),
        (Run("r", Metrics(loss=[object()], accuracy=1.0)), r"result\.metrics\.loss\[0\] has type builtins\.object"),
        ({"t": torch.tensor([1j])}, r"result\['t'\] has type torch\.Tensor .*dtype torch\.complex64"),
        ({"a": np.array([1j])}, r"result\['a'\] has type numpy\.ndarray .*dtype complex128"),
        (np.array(["2026-01-01"], dtype="datetime64[D]"), r"result has type numpy\.ndarray .*datetime64"),
        (np.complex64(1j), r"result has type numpy\.complex64"),
        (torch.tensor([[0, 1]]).to_sparse(), r"sparse_coo tensor.*\.to_dense\(\)"),
        (torch.float32, r"result has type torch\.dtype"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_a_value_without_a_json_form_names_its_type_and_place(value: Any, message: str) -> None:
    with pytest.raises(ResultNotSerializableError, match=message) as raised:
        value_to_json(value)
    assert str(raised.value).startswith("rank 0's return value cannot be encoded as JSON: ")
    assert isinstance(raised.value, TypeError)


def test_a_class_of_a_dag_file_is_named_by_the_file_not_by_airflows_module_name() -> None:
    thing = type("Thing", (), {"__module__": "unusual_prefix_" + "e5" * 20 + "_train_dag"})
    with pytest.raises(ResultNotSerializableError, match=r"result has type train_dag\.Thing \(") as raised:
        value_to_json(thing())
    assert "unusual_prefix" not in str(raised.value)


@pytest.mark.parametrize(
    ("value", "shape"),
    [
        (torch.zeros(MAX_ARRAY_ELEMENTS + 1), (MAX_ARRAY_ELEMENTS + 1,)),
        (np.zeros((101, 100)), (101, 100)),
        ({"w": torch.zeros(200, 60, requires_grad=True)}, (200, 60)),
    ],
    ids=["tensor", "array", "nested-parameter"],
)
def test_a_large_tensor_or_array_is_refused_naming_shape_and_limit(value: Any, shape: tuple[int, ...]) -> None:
    with pytest.raises(ResultNotSerializableError) as raised:
        value_to_json(value)
    message = str(raised.value)
    assert f"of shape {shape}" in message and f"more than the {MAX_ARRAY_ELEMENTS} elements" in message
    assert ".tolist()" in message and "storage" in message
    assert ("torch.Tensor" if not isinstance(value, np.ndarray) else "numpy.ndarray") in message


def test_a_set_that_cannot_be_sorted_is_refused() -> None:
    with pytest.raises(ResultNotSerializableError, match=r"result\['tags'\].*builtins\.int, builtins\.str.*sorted"):
        value_to_json({"tags": {1, "a"}})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({(1, 2): "x"}, r"result has a key of type builtins\.tuple"),
        ({"outer": {None: 1}}, r"result\['outer'\] has a key of type builtins\.NoneType"),
        ({Color.RED: 1}, r"result has a key of type builtins\.tuple"),
        ({1: "a", "1": "b"}, r"keys 1 and '1' both become the JSON key '1'"),
    ],
)
def test_mapping_keys_that_json_cannot_hold_are_refused(value: Any, message: str) -> None:
    with pytest.raises(ResultNotSerializableError, match=message):
        value_to_json(value)


def test_a_cycle_is_refused() -> None:
    loop: list[Any] = [1]
    loop.append({"back": loop})
    with pytest.raises(ResultNotSerializableError, match=r"result\[1\]\['back'\] .*contains itself"):
        value_to_json(loop)


def test_the_same_object_twice_is_not_a_cycle() -> None:
    shared = [1, 2]
    assert encoded({"a": shared, "b": shared}) == {"a": [1, 2], "b": [1, 2]}


def test_too_deep_a_value_is_refused() -> None:
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]
    with pytest.raises(ResultNotSerializableError, match="nested too deeply"):
        value_to_json(deep)


def test_a_huge_repr_is_cut_in_the_message() -> None:
    with pytest.raises(ResultNotSerializableError) as raised:
        value_to_json([object()] * 1 + [b"x" * 10_000])
    assert len(str(raised.value)) < 600


def test_the_encoder_imports_neither_torch_nor_numpy() -> None:
    code = (
        "import sys\n"
        "from airflow_provider_torchelastic.core.encoding import value_to_json\n"
        "print(value_to_json({'a': float('nan')}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'airflow')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ['{"a": "NaN"}', "[]"]

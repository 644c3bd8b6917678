"""Rank 0's return value as strict JSON, with the conversions a training function's result naturally needs.

The worker holding rank 0 encodes its value here, so a value that cannot travel fails in that worker, with its
traceback, before anything leaves the node. What comes out is strict JSON (RFC 8259): readable by any JSON parser
and by Airflow's XCom, never a pickle.

Conversions (the README's "Result encoding" says the same for users):

- ``None``, ``bool``, ``str``, ``int`` as they are; ``float`` as a number, except NaN and ±infinity, which strict JSON
  has no spelling for: they become the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (Python's ``json``
  would write bare ``NaN``, which other parsers reject). They stay strings on the Airflow side.
- torch and numpy scalars (a 0-d tensor or array, ``numpy.float32``, ``numpy.int64``, ``numpy.bool_`` ...) as
  numbers or booleans; ``torch.Size`` and other tuples as lists.
- tensors and arrays of booleans, integers or floats (numpy string and object arrays too) with at most
  ``MAX_ARRAY_ELEMENTS`` elements as nested lists; a tensor is detached and copied to the CPU first. Larger ones are
  refused, naming the shape: return a summary, ``.tolist()`` a slice, or save the array to storage and return its
  path. Complex, sparse and datetime ones are refused.
- dataclass instances as objects of their fields (``dataclasses.fields``, read one level at a time: no deep copy);
  enums as their value; ``datetime``/``date``/``time`` as ISO 8601 strings; ``timedelta`` as its seconds (the unit
  the provider's own durations take); ``Decimal`` as an int when written without a fraction, else a float (as
  FastAPI does); ``UUID`` and ``pathlib`` paths as strings.
- sets and frozensets as sorted lists (a set has no order of its own); a set whose items cannot be compared is
  refused.
- mappings as objects. Keys are converted as ``json`` does: ``str`` as is, ``int`` and ``float`` as their decimal
  text, ``True``/``False`` as ``"true"``/``"false"`` (numpy scalars and enums first become their value). Any other
  key is refused, and so are two keys that become the same text (``1`` and ``"1"``).

Anything else is refused with a :class:`ResultNotSerializableError` that names the type and where it sits
(``result['metrics'][2]``). Standard library only: torch and numpy are recognised through ``sys.modules`` (a value
can only be a tensor where torch is already imported), never imported here.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import PurePath
from typing import Any, Final

__all__ = [
    "MAX_ARRAY_ELEMENTS",
    "NAN",
    "NEGATIVE_INFINITY",
    "POSITIVE_INFINITY",
    "ResultNotSerializableError",
    "as_authored",
    "value_to_json",
    "value_to_jsonable",
]

#: The most elements a tensor or array may have to travel as nested lists. A guard against converting model weights
#: element by element: the result's real bound is the 4096-byte termination message, which holds a few hundred
#: numbers at most, so a larger tensor could never arrive anyway.
MAX_ARRAY_ELEMENTS: Final = 10_000
#: How NaN and the infinities travel: strict JSON has no spelling for them. These are the names JavaScript,
#: Python's ``float()`` and ``json`` (non-strict) use, so ``float(value)`` reads them back.
NAN: Final = "NaN"
POSITIVE_INFINITY: Final = "Infinity"
NEGATIVE_INFINITY: Final = "-Infinity"
#: The name of the value itself in error messages: ``result['metrics'][2]``.
ROOT: Final = "result"

_HINT: Final = (
    "return dicts, lists, strings, numbers, booleans or None (tensors, arrays, numpy and torch scalars, dataclasses, "
    "enums, dates, durations, decimals, UUIDs and paths are converted; see 'Result encoding' in the README)"
)
_SAVE_HINT: Final = (
    "set the Airflow option [torch_elastic] artifact_storage (or result_storage) to pass tensors, arrays, state dicts "
    "and Modules of any size as artifacts (see 'Results: models and tensors' in the README), or return a summary "
    "(a mean, a norm, .tolist() of a slice)"
)
#: numpy dtype kinds that become JSON: bool, signed and unsigned int, float, str, and object (each item converted).
_NUMPY_KINDS: Final = frozenset("biufUO")


class ResultNotSerializableError(TypeError):
    """Rank 0 returned a value that cannot travel as JSON."""


def value_to_json(value: Any) -> str:
    """``value`` as strict JSON text (``json.dumps``'s default spacing), or :class:`ResultNotSerializableError`."""
    # allow_nan=False: a non-finite float that escaped the conversion must fail here, not reach a strict reader.
    return json.dumps(value_to_jsonable(value), allow_nan=False)


def value_to_jsonable(value: Any) -> Any:
    """``value`` made of dicts, lists, str, int, finite float, bool and None only (pure; see the module doc)."""
    try:
        return _convert(value, ROOT, set())
    except RecursionError:
        raise ResultNotSerializableError(
            f"rank 0's return value is nested too deeply to encode as JSON; {_HINT}"
        ) from None


#: How Airflow names the module of a DAG file it loads (``unusual_prefix_<sha1 of the path>_<file name>``): a class
#: defined in a DAG file is named by its file, as its author knows it, in types and default reprs alike.
_DAG_FILE_MODULE: Final = re.compile(r"\bunusual_prefix_[0-9a-f]{40}_")


def as_authored(text: str) -> str:
    """``text`` (a type name, a repr, a worker's traceback) with each DAG file's module named by its file."""
    return _DAG_FILE_MODULE.sub("", text)


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{as_authored(kind.__module__)}.{kind.__qualname__}"


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = as_authored(repr(value))
    except Exception:  # a broken __repr__ must not hide the real problem
        return "<unprintable>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse(where: str, value: Any, why: str = "which has no JSON form", hint: str = _HINT) -> Exception:
    return ResultNotSerializableError(
        f"rank 0's return value cannot be encoded as JSON: {where} has type {_type_name(value)} "
        f"({_short_repr(value)}), {why}; {hint}"
    )


def _float(value: Any) -> float | str:
    number = float(value)
    if math.isnan(number):
        return NAN
    if math.isinf(number):
        return POSITIVE_INFINITY if number > 0 else NEGATIVE_INFINITY
    return number


def _decimal(value: Any) -> int | float | str:
    """FastAPI's rule: a Decimal written without a fraction (``Decimal("12")``, ``Decimal("1E+3")``) as an int, which
    keeps every digit, any other as a float. A signalling NaN cannot become a float, and a whole one of more than 64
    digits becomes one too (json refuses ints of thousands of digits)."""
    if value.is_nan():
        return NAN
    if value.is_finite() and value.as_tuple().exponent >= 0 and value.adjusted() < 64:
        return int(value)
    return _float(value)


def _convert(value: Any, where: str, active: set[int]) -> Any:
    """One value, recursively; ``active`` holds the containers being converted, to refuse a cycle."""
    # Enums first: a str or int enum is also a str or int, but travels as its value.
    if isinstance(value, Enum):
        return _convert(value.value, where, active)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)  # numpy.str_ and other subclasses as plain str
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):  # numpy.float64 is a float too
        return _float(value)
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, PurePath):
        return str(value)
    # Through sys.modules, as numpy and torch: a value can only be a Decimal or a UUID where its module is imported.
    decimal = sys.modules.get("decimal")
    if decimal is not None and isinstance(value, decimal.Decimal):
        return _decimal(value)
    uuid = sys.modules.get("uuid")
    if uuid is not None and isinstance(value, uuid.UUID):
        return str(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic | numpy.ndarray):
        return _numpy(numpy, value, where, active)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor(torch, value, where, active)
    if isinstance(value, list | tuple | set | frozenset | Mapping) or _is_dataclass_instance(value):
        if id(value) in active:
            raise _refuse(where, value, "which contains itself (a reference cycle)")
        active.add(id(value))
        try:
            return _container(value, where, active)
        finally:
            active.discard(id(value))
    raise _refuse(where, value)


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _container(value: Any, where: str, active: set[int]) -> Any:
    if isinstance(value, list | tuple):  # torch.Size and named tuples too
        return [_convert(item, f"{where}[{index}]", active) for index, item in enumerate(value)]
    if isinstance(value, set | frozenset):
        try:
            items = sorted(value)
        except TypeError:
            kinds = ", ".join(sorted({_type_name(item) for item in value}))
            raise _refuse(
                where,
                value,
                f"whose items ({kinds}) cannot be sorted (a set travels as a sorted list, having no order of its own)",
                "return a list instead",
            ) from None
        return [_convert(item, f"{where}[{index}]", active) for index, item in enumerate(items)]
    if isinstance(value, Mapping):
        converted: dict[str, Any] = {}
        original: dict[str, Any] = {}
        for key, item in value.items():
            name = _key_to_str(key, where)
            if name in converted:
                raise _refuse(
                    where,
                    value,
                    f"whose keys {original[name]!r} and {key!r} both become the JSON key {name!r}",
                    "use distinct keys",
                )
            original[name] = key
            converted[name] = _convert(item, f"{where}[{key!r}]", active)
        return converted
    # A dataclass instance: its fields one level at a time (dataclasses.asdict would deep-copy every value, tensors
    # included, before we could convert them).
    return {
        field.name: _convert(getattr(value, field.name), f"{where}.{field.name}", active)
        for field in dataclasses.fields(value)
    }


def _key_to_str(key: Any, where: str) -> str:
    """A mapping key as ``json`` writes it; enums and numpy scalars first become their value."""
    if isinstance(key, Enum):
        key = key.value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(key, numpy.bool_ | numpy.integer | numpy.floating):
        key = key.item() if not isinstance(key, numpy.floating) else float(key)
    if isinstance(key, str):
        return str(key)
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        number = _float(key)
        return number if isinstance(number, str) else float.__repr__(number)
    raise ResultNotSerializableError(
        f"rank 0's return value cannot be encoded as JSON: {where} has a key of type {_type_name(key)} "
        f"({_short_repr(key)}); JSON object keys are strings, and only str, int, float and bool keys are converted "
        "(as json does); use str keys"
    )


def _numpy(numpy: Any, value: Any, where: str, active: set[int]) -> Any:
    if isinstance(value, numpy.bool_):
        return bool(value)
    if isinstance(value, numpy.integer):
        return int(value)
    if isinstance(value, numpy.floating):
        return _float(value)  # float(), not .item(): a longdouble's item() is a longdouble again
    if isinstance(value, numpy.generic):  # complex, datetime64, bytes_, void
        raise _refuse(where, value)
    shape = tuple(value.shape)
    if value.dtype.kind not in _NUMPY_KINDS:
        raise _refuse(where, value, f"an array of dtype {value.dtype}, which has no JSON form")
    if value.size > MAX_ARRAY_ELEMENTS:
        raise _too_many_elements(where, value, shape, int(value.size))
    if value.ndim == 0:
        return _convert(value[()], where, active)
    return _convert(value.tolist(), where, active)


def _tensor(torch: Any, value: Any, where: str, active: set[int]) -> Any:
    shape = tuple(value.shape)
    if value.is_complex():
        raise _refuse(where, value, f"a tensor of dtype {value.dtype}, which has no JSON form")
    if value.layout is not torch.strided:
        raise _refuse(where, value, f"a {value.layout} tensor", "convert it with .to_dense() first")
    numel = int(value.numel())
    if numel > MAX_ARRAY_ELEMENTS:
        raise _too_many_elements(where, value, shape, numel)
    try:
        # detach: a tensor that requires grad cannot become a list; cpu: a CUDA tensor's items live on the device.
        items = value.detach().cpu().tolist()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        raise _refuse(where, value, f"a tensor of dtype {value.dtype} that torch cannot turn into a list ({e})") from e
    return _convert(items, where, active)


def _too_many_elements(where: str, value: Any, shape: tuple[int, ...], count: int) -> Exception:
    return ResultNotSerializableError(
        f"rank 0's return value cannot be encoded as JSON: {where} is a {_type_name(value)} of shape {shape} "
        f"({count} elements), more than the {MAX_ARRAY_ELEMENTS} elements a result may carry as a list; {_SAVE_HINT}"
    )


def loads_untrusted(
    text: str | bytes, *, max_bytes: int, parse_constant: Callable[[str], Any] | None = None
) -> Any | None:
    """JSON from text a pod or a worker controls (a termination message, a log line): the value, or None.

    Never raises. Text over ``max_bytes`` is refused before parsing; so is anything ``json`` refuses, nesting deeper
    than the parser's recursion limit included (``"[" * 999`` raises RecursionError, not ValueError).
    """
    if len(text) > max_bytes:
        return None
    try:
        return json.loads(text, parse_constant=parse_constant)
    except (ValueError, RecursionError, TypeError, KeyError):  # KeyError: a parse_constant that knows no such name
        return None

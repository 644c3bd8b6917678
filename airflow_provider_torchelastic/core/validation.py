"""Value checks shared by the typed configuration (``config``), the pod options (``pod``), the renderer and the
operator's parse-time checks.

The bottom of the pure core: standard library only, and nothing of this package, so that every module above can
import it without a cycle. Every check fails the same way: ``<Owner>.<field>: expected <what>, got <value>``, a
``TypeError`` for a value of the wrong type and a ``ValueError`` for a wrong value of the right type.

Below the checks, the readers of values that someone else controls (a pod's status, a line rank 0 prints, an XCom
any DAG can push): each gives a value of its type or a default, and never raises, whatever it is given.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Mapping
from decimal import Decimal, DecimalException
from types import MappingProxyType
from typing import Any, Final, TypeVar

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "QUANTITY",
    "as_list",
    "as_mapping",
    "ascii_decimal",
    "check_image",
    "check_int",
    "check_resources",
    "check_seconds",
    "fail",
    "finite_float",
    "int_or",
    "is_int",
    "is_number",
    "is_templated",
    "overcommit_allowed",
    "quantity_value",
    "short_repr",
    "text_or",
]

#: A Kubernetes resource quantity (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/):
#: a number, then an exponent or a suffix.
QUANTITY: Final = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?\Z")
_SCALE: Final[Mapping[str, Decimal]] = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
}
#: The resources a container may name without a domain (the API server's "standard resource for containers").
_CONTAINER_RESOURCES: Final = ("cpu", "memory", "ephemeral-storage")
_RESOURCE_EXPECTED: Final = (
    "a container resource ('cpu', 'memory', 'ephemeral-storage', 'hugepages-<size>') or a device plugin's "
    "'domain/name' such as 'nvidia.com/gpu'"
)
# A qualified resource name such as ``cpu`` or ``nvidia.com/gpu``.
_RESOURCE_NAME: Final = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")

# An image reference, in the grammar of the container runtimes (github.com/distribution/reference):
# [domain[:port]/]path[:tag][@digest], with lowercase path components.
_DOMAIN_COMPONENT: Final = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_PATH_COMPONENT: Final = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REFERENCE: Final = re.compile(
    rf"^(?P<name>(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,})?\Z",
    re.ASCII,
)
_MAX_IMAGE_NAME: Final = 255
_IMAGE_EXPECTED: Final = "an image reference such as 'registry.example.com/ml/train:1.0' (lowercase repository path)"


def fail(owner: str, name: str, value: object, expected: str, exc: type[Exception] = ValueError) -> Exception:
    """The exception to raise for a bad value: ``<owner>.<name>: expected <expected>, got <value!r>``.

    An empty ``owner`` names a bare argument, as the operator's own are named (``poll_interval: expected ...``).
    """
    where = f"{owner}.{name}" if owner else name
    return exc(f"{where}: expected {expected}, got {value!r}")


def is_int(value: object) -> bool:
    # bool is an int subclass; ``nnodes=True`` is a bug, not one node.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return is_int(value) or isinstance(value, float)


def is_templated(value: object) -> bool:
    """Whether ``value`` is a Jinja template, which only the task's run can render."""
    return isinstance(value, str) and "{{" in value


def check_int(owner: str, name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value):
        raise fail(owner, name, value, f"an int >= {minimum}", TypeError)
    if value < minimum:  # type: ignore[operator]
        raise fail(owner, name, value, f"an int >= {minimum}")


def check_seconds(owner: str, name: str, value: object, *, allow_zero: bool = False) -> float:
    """A finite duration in seconds, > 0 (or >= 0 with ``allow_zero``); never a bool (``True`` is not one second)."""
    expected = f"a number of seconds {'>=' if allow_zero else '>'} 0"
    if not is_number(value):
        raise fail(owner, name, value, expected, TypeError)
    seconds = float(value)  # type: ignore[arg-type]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise fail(owner, name, value, expected)
    return seconds


def check_image(owner: str, name: str, value: object, *, optional: bool = True, templated_ok: bool = False) -> None:
    """An image reference the container runtime can pull; a Jinja template only where the field is templated."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise fail(owner, name, value, _IMAGE_EXPECTED, TypeError)
    if templated_ok and is_templated(value):
        return  # rendered at run time, and checked again then
    match = _IMAGE_REFERENCE.match(value)
    if match is None or len(match.group("name")) > _MAX_IMAGE_NAME:
        raise fail(owner, name, value, _IMAGE_EXPECTED)


def _gpu_typo(key: str) -> bool:
    """``gpu``, ``GPU``, ``gpus``, ``nvidia-gpu``, ``nvidia.com/gpus``...: Flyte's and other tools' spellings of a
    resource that Kubernetes only knows by its device plugin's name."""
    prefix, _, local = key.rpartition("/")
    if not prefix:
        # Names without a domain are Kubernetes' own (cpu, memory, hugepages-*...); none of them is a GPU.
        return "gpu" in key.lower()
    return local.lower() in ("gpu", "gpus") and local != "gpu"


def quantity_value(text: object) -> Decimal | None:
    """A Kubernetes quantity (``"500m"``, ``"16Gi"``, ``"1e3"``, ``2``) as a number; None when it is none."""
    if is_number(text):
        text = str(text)
    match = QUANTITY.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    try:
        return Decimal(number + (exponent or "")) * _SCALE.get(suffix or "", Decimal(1))
    except DecimalException:  # an exponent past what Decimal holds: no quantity either
        return None


def _native(name: str) -> bool:
    # Kubernetes' IsNativeResource: a name without a domain, or in kubernetes.io's.
    return "/" not in name or "kubernetes.io/" in name


def overcommit_allowed(name: str) -> bool:
    """Whether a request may stay below its limit, or go without one (Kubernetes' ``IsOvercommitAllowed``): native
    resources but hugepages; never a device plugin's (``nvidia.com/gpu``)."""
    return _native(name) and not name.startswith("hugepages-")


def _quantity_problem(key: str, quantity: str) -> str | None:
    """What the API server says of ``quantity`` for ``key`` that the pattern cannot: ValidateResourceQuantityValue."""
    amount = quantity_value(quantity)
    if amount is None:
        return None
    if amount < 0:
        return "a quantity >= 0"
    if not _native(key) and amount != amount.to_integral_value():
        return f"a whole number of {key} (a device plugin's resource has no fractions)"
    return None


def check_resources(owner: str, name: str, value: object, *, container: bool = True) -> Mapping[str, str]:
    """Requests or limits as ``{resource name: quantity string}`` (ints and floats become strings), read-only;
    ``container``: a container's, whose names without a domain are the API server's few."""
    if not isinstance(value, Mapping):
        raise fail(owner, name, value, "a mapping of resource name to quantity, e.g. {'cpu': '4'}", TypeError)
    checked: dict[str, str] = {}
    for key, quantity in value.items():
        if isinstance(key, str) and _gpu_typo(key):
            raise fail(
                owner,
                name,
                key,
                "a GPU resource by its device plugin's name: 'nvidia.com/gpu' (NVIDIA) or 'amd.com/gpu' (AMD); "
                "the API server rejects any other spelling",
            )
        if not isinstance(key, str) or not _RESOURCE_NAME.match(key):
            raise fail(owner, name, key, "resource names such as 'cpu', 'memory' or 'nvidia.com/gpu'")
        if container and "/" not in key and key not in _CONTAINER_RESOURCES and not key.startswith("hugepages-"):
            raise fail(owner, name, key, _RESOURCE_EXPECTED)
        if is_number(quantity):
            quantity = str(quantity)
        if not isinstance(quantity, str) or not QUANTITY.match(quantity):
            raise fail(owner, f"{name}[{key!r}]", quantity, "a Kubernetes quantity such as 2, '500m' or '16Gi'")
        if (problem := _quantity_problem(key, quantity)) is not None:
            raise fail(owner, f"{name}[{key!r}]", quantity, problem)
        checked[key] = quantity
    return MappingProxyType(checked)


# --- readers of untrusted values ---------------------------------------------------------------------------------

#: The range of the integers a reader accepts: what Kubernetes, torch and a database column hold (an int64). A
#: 400-digit integer is a valid JSON number, yet no rank, exit code or count; past this it is read as absent.
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

T = TypeVar("T")


def finite_float(value: object) -> float | None:
    """A JSON number (never a bool) as a finite float; None for anything else.

    ``float()`` of an int past about 10**308 raises ``OverflowError``, and ``1e999`` parses to infinity: neither is a
    number a metric, a time or a step can be.
    """
    if not is_number(value):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def int_or(value: object, default: T, *, low: int = INT64_MIN, high: int = INT64_MAX) -> int | T:
    """``value`` if it is an int (never a bool) in ``[low, high]``, else ``default``."""
    return value if is_int(value) and low <= value <= high else default  # type: ignore[operator,return-value]


#: ``str.isdigit()`` is true of ``"²"`` and ``"٣"``, which ``int()`` refuses or reads as another number: ASCII only.
_ASCII_DECIMAL: Final = re.compile(r"[0-9]{1,18}\Z")


def ascii_decimal(text: object, *, high: int = INT64_MAX) -> int | None:
    """The integer written in ASCII digits (at most 18 of them, so an int64) in ``text``, if it is at most
    ``high``; None for anything else."""
    if not isinstance(text, str) or not _ASCII_DECIMAL.match(text):
        return None
    number = int(text)
    return number if number <= high else None


def text_or(value: object, default: T) -> str | T:
    """``value`` if it is a str, else ``default``: never ``str()`` of a value someone else made (a structure nested
    2000 deep makes ``str()`` raise ``RecursionError``)."""
    return value if isinstance(value, str) else default


def as_mapping(value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one: a part of an object read from elsewhere can be anything."""
    return value if isinstance(value, Mapping) else {}


def as_list(value: object) -> list[Any]:
    """``value`` if it is a list, else an empty one."""
    return value if isinstance(value, list) else []


_SHORT_REPR: Final = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 200


def short_repr(value: object) -> str:
    """``repr(value)`` for an error message: bounded in depth and length, and never raising."""
    try:
        return _SHORT_REPR.repr(value)
    except Exception:  # an int past Python's digit limit, a broken __repr__: its type still says what it was
        return f"<{type(value).__name__}>"

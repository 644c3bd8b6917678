"""More memory after an out-of-memory kill: ``retry_resources=``, as pure functions over resources.

A try whose training container was OOM-killed is retried by Airflow with the same pod, so it fails the same way.
With ``retry_resources`` the next try's training container gets more memory: a factor (``2.0`` doubles the memory
requests and limits after each OOM) or a callable ``(try_number, cause, resources) -> resources`` that decides
itself. ``resources`` is the training container's ``{"requests": {...}, "limits": {...}}`` as the previous try ran
it. Whatever either gives is capped (:func:`cap_memory`): the namespace's LimitRange where there is one, else
``[torch_elastic] retry_memory_max``. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.core.validation import check_resources, fail, is_number, quantity_value

__all__ = [
    "MEMORY",
    "Resources",
    "RetryResources",
    "cap_memory",
    "check_retry_resources",
    "escalate",
    "format_memory",
    "limit_range_max_memory",
    "memory_bytes",
]

#: The training container's ``{"requests": {name: quantity}, "limits": {name: quantity}}``.
Resources: TypeAlias = Mapping[str, Mapping[str, str]]
#: What ``retry_resources=`` takes: a factor > 1, or ``(try_number, cause, resources) -> resources``.
RetryResources: TypeAlias = float | Callable[[int, str, Resources], Resources]

MEMORY: Final = "memory"
_EXPECTED: Final = (
    "a factor > 1 (2.0 doubles the training container's memory requests and limits after each OOM), a callable "
    "(try_number, cause, resources) -> resources, or None"
)


def check_retry_resources(value: object) -> object:
    """``retry_resources``: None, a finite factor > 1 (not a bool), or a callable. Whether memory is set at all is
    checked where the pods are known (:func:`~airflow_provider_torchelastic.kubernetes.training_resources`)."""
    if value is None or (callable(value) and not isinstance(value, type)):
        return value
    if not is_number(value):
        raise fail("", "retry_resources", value, _EXPECTED, TypeError)
    factor = float(value)  # type: ignore[arg-type]
    if not math.isfinite(factor) or factor <= 1:
        raise fail("", "retry_resources", value, _EXPECTED)
    return factor


def memory_bytes(quantity: object) -> int | None:
    """A memory quantity (``"256Mi"``, ``"1G"``, ``268435456``) in bytes, rounded up; None when it is none."""
    value = quantity_value(quantity.strip() if isinstance(quantity, str) else quantity)
    if value is None or not value.is_finite() or value < 0:
        return None
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def format_memory(size: int) -> str:
    """Bytes as the shortest binary quantity that holds them: ``"512Mi"``, ``"3Gi"``; rounded up to a whole Mi."""
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return f"{-(-size // 2**20)}Mi"


def limit_range_max_memory(limit_ranges: Sequence[Mapping[str, Any]]) -> int | None:
    """The most memory a container may have under a namespace's LimitRanges (``type: Container``, ``max.memory``;
    the smallest when several say it); None when none does."""
    found = [
        size
        for limit_range in limit_ranges
        for item in (limit_range.get("spec") or {}).get("limits") or []
        if isinstance(item, Mapping) and item.get("type") == "Container"
        if (size := memory_bytes((item.get("max") or {}).get(MEMORY))) is not None
    ]
    return min(found) if found else None


def _scaled(resources: Resources, factor: float) -> dict[str, dict[str, str]]:
    scaled: dict[str, dict[str, str]] = {}
    for part in ("requests", "limits"):
        values = dict(resources.get(part) or {})
        size = memory_bytes(values.get(MEMORY))
        if size is not None:
            values[MEMORY] = format_memory(math.ceil(size * factor))
        if values:
            scaled[part] = values
    return scaled


def _checked(returned: object) -> dict[str, dict[str, str]]:
    expected = "a mapping {'requests': {...}, 'limits': {...}} of Kubernetes quantities"
    if not isinstance(returned, Mapping) or set(returned) - {"requests", "limits"}:
        raise fail("", "retry_resources() returned", returned, expected, TypeError)
    return {
        part: dict(check_resources("", f"retry_resources()[{part!r}]", values)) for part, values in returned.items()
    }


def cap_memory(resources: Resources, cap: int) -> tuple[dict[str, dict[str, str]], bool]:
    """``resources`` with no memory request or limit above ``cap`` bytes, and whether anything was cut."""
    capped, cut = {part: dict(values) for part, values in resources.items()}, False
    for values in capped.values():
        size = memory_bytes(values.get(MEMORY))
        if size is not None and size > cap:
            values[MEMORY], cut = format_memory(cap), True
    return capped, cut


def escalate(
    retry: Any, resources: Resources, *, try_number: int, cause: str, cap: int
) -> tuple[dict[str, dict[str, str]], bool]:
    """The training container's resources for try ``try_number`` after a try that ended with ``cause``, from
    ``resources`` (what that try ran with), capped at ``cap`` bytes of memory; and whether the cap cut them.

    A callable's answer is checked (a ``TypeError``/``ValueError`` naming ``retry_resources()``), never trusted.
    """
    if callable(retry):
        current = {part: dict(values) for part, values in resources.items()}
        new = _checked(retry(try_number, cause, current))
    else:
        new = _scaled(resources, float(retry))
    return cap_memory(new, cap)

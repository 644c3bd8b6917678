"""What one try leaves for the next in the task state store: its cause, the preemptions, the memory it ran with.

Airflow clears a task's XComs at every try; the task state store survives retries of the same task instance, so the
next try reads here how the previous one ended (``retry_resources`` raises the memory after an OOM) and how often
the task instance was preempted (``max_preemptions`` counts over all tries). Two keys:

* :data:`LAST_TRY_KEY`: ``{"try_number", "cause", "preemptions"}``, written when a Kubernetes try's verdict is known
  (``preemptions``: the task instance's total so far);
* :data:`RESOURCES_KEY`: ``{"try_number", "resources"}``, the training containers' resources (by replica) a try
  ran with once ``retry_resources`` changed them; a later try starts from there, and never goes back down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.retry_resources import escalate, format_memory, limit_range_max_memory
from airflow_provider_torchelastic.core.validation import as_mapping, int_or, text_or

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = [
    "LAST_TRY_KEY",
    "RESOURCES_KEY",
    "Escalation",
    "LastTry",
    "last_try",
    "preemptions_before",
    "record_try",
    "resources_for_try",
    "summary_of",
]

LAST_TRY_KEY: Final = "torchelastic_last_try"
RESOURCES_KEY: Final = "torchelastic_retry_resources"


@dataclass(frozen=True, kw_only=True)
class LastTry:
    try_number: int
    cause: str
    #: The task instance's preemptions up to and including that try.
    preemptions: int


def _store(context: Context) -> Any:
    return context.get("task_state_store")


def _try_number(context: Context) -> int:
    return int(getattr(context.get("ti"), "try_number", 1) or 1)


def last_try(context: Context) -> LastTry | None:
    """The record of the last try that reached a verdict, from an earlier try (None for none, or an unreadable one)."""
    store = _store(context)
    saved = as_mapping(store.get(LAST_TRY_KEY) if store is not None else None)
    number = int_or(saved.get("try_number"), None, low=1)
    if number is None or number >= _try_number(context):
        return None
    return LastTry(
        try_number=number,
        cause=text_or(saved.get("cause"), causes.UNKNOWN),
        preemptions=int_or(saved.get("preemptions"), 0, low=0),
    )


def preemptions_before(context: Context) -> int:
    """The task instance's preemptions in its earlier tries."""
    last = last_try(context)
    return last.preemptions if last is not None else 0


def record_try(context: Context, *, cause: str, preemptions: int, log: Callable[..., None]) -> None:
    """Record how this try ended for the next one: its cause ("" when it succeeded) and its preemptions."""
    store = _store(context)
    if store is None:
        return
    record = {
        "try_number": _try_number(context),
        "cause": cause,
        "preemptions": preemptions_before(context) + preemptions,
    }
    try:
        store.set(LAST_TRY_KEY, record)
    except Exception as e:  # the try's outcome stands; only the next try's memory of it is missing
        log("Could not record this try's outcome in the task state store: %s", e)


@dataclass(frozen=True, kw_only=True)
class Escalation:
    """What ``retry_resources`` did for this try: the resources by replica, and a line for the log and summary."""

    resources: Mapping[str, Any]
    line: str


def _memory_line(replica: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    parts = []
    for part in ("requests", "limits"):
        old, new = (before.get(part) or {}).get("memory"), (after.get(part) or {}).get("memory")
        if old != new:
            parts.append(f"{part} {old} -> {new}")
    return f"{replica} memory " + (", ".join(parts) if parts else "unchanged")


def resources_for_try(
    retry: Any,
    rendered: Mapping[str, Mapping[str, Mapping[str, str]]],
    context: Context,
    *,
    read_limit_ranges: Callable[[], list[dict[str, Any]] | None],
    default_cap: Callable[[], int],
) -> Escalation | None:
    """The training containers' resources for this try under ``retry_resources=retry``, or None to keep
    ``rendered`` (the DAG's own).

    The same try run again (a worker that crashed) gets what it had. After an OOM not yet answered, ``retry`` turns
    the last resources a try ran with (else ``rendered``) into new ones, capped by the namespace's LimitRange
    (``read_limit_ranges``; None when it cannot be read) or ``default_cap``. Otherwise what an earlier try raised
    stays.
    """
    store = _store(context)
    if store is None:
        return None
    number = _try_number(context)
    applied = as_mapping(store.get(RESOURCES_KEY))
    applied_try = int_or(applied.get("try_number"), 0, low=0)
    current = {replica: as_mapping(parts) for replica, parts in as_mapping(applied.get("resources")).items()}
    if applied_try == number and current:
        return Escalation(resources=current, line=f"retry_resources: try {number} runs again with what it had")
    last = last_try(context)
    if last is None or last.cause != causes.OUT_OF_MEMORY or applied_try > last.try_number:
        if not current:
            return None
        return _applied(store, number, current, f"retry_resources: try {number} keeps what try {applied_try} got")
    base = {replica: current.get(replica) or parts for replica, parts in rendered.items()}
    limit_ranges = read_limit_ranges()
    range_cap = limit_range_max_memory(limit_ranges) if limit_ranges else None
    cap = range_cap if range_cap is not None else default_cap()
    where = "the namespace's LimitRange" if range_cap is not None else "[torch_elastic] retry_memory_max"
    new, lines = {}, []
    for replica, resources in base.items():
        new[replica], cut = escalate(retry, resources, try_number=number, cause=last.cause, cap=cap)
        lines.append(
            _memory_line(replica, resources, new[replica])
            + (f" (capped at {format_memory(cap)} by {where})" if cut else "")
        )
    line = f"retry_resources: try {last.try_number} ran out of memory; try {number}: " + "; ".join(lines)
    return _applied(store, number, new, line)


def _applied(store: Any, number: int, resources: Mapping[str, Any], line: str) -> Escalation:
    """Remember what try ``number`` runs with (the next try starts from it; the job summary shows it)."""
    store.set(RESOURCES_KEY, {"try_number": number, "resources": resources, "note": line})
    return Escalation(resources=resources, line=line)


def summary_of(context: Context) -> dict[str, Any] | None:
    """What ``retry_resources`` gave this try, for the job summary (``{"retry_resources": ...}``); None: nothing."""
    store = _store(context)
    applied = as_mapping(store.get(RESOURCES_KEY) if store is not None else None)
    if int_or(applied.get("try_number"), 0) != _try_number(context):
        return None
    note = text_or(applied.get("note"), "")
    return {"retry_resources": {"resources": as_mapping(applied.get("resources")), "note": note}}

"""Known secret values out of text: the wait's log lines, a trigger's event, a job summary. Pure (stdlib).

The values are the try's own (its sensitive env entries, :mod:`..operators.masking`); Airflow's masker covers what
it knows in the processes it runs in, but a pod's log line printed by the triggerer, or a termination message in a
trigger's event, never passes through the worker's masker. So the lines and events are redacted where they are
made, with the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

__all__ = ["MASK", "env_entries", "redact_text", "redact_value", "redacting", "sensitive_env_values"]

MASK: Final = "***"


def redact_text(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ``***`` (longest first, so that a secret that
    contains another is masked whole)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    return text


def redact_value(value: Any, secrets: Sequence[str]) -> Any:
    """``value`` (JSON-like: dicts, lists, strings) with :func:`redact_text` applied to every string in it."""
    if not secrets:
        return value
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, dict):
        return {redact_value(k, secrets): redact_value(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(v, secrets) for v in value)
    return value


def redacting(log: Callable[[str], None], secrets: Sequence[str]) -> Callable[[str], None]:
    """``log`` behind :func:`redact_text` (``log`` itself when there is nothing to redact)."""
    if not secrets:
        return log
    values = tuple(secrets)

    def redacted(line: str) -> None:
        log(redact_text(line, values))

    return redacted


def env_entries(node: Any) -> Iterator[dict[str, Any]]:
    """Every ``{"name": ..., "value": ...}`` of an ``env`` list anywhere in ``node`` (pod specs of any kind, their
    containers and init containers, a pod template's)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                yield from (e for e in value if isinstance(e, dict) and isinstance(e.get("name"), str))
            else:
                yield from env_entries(value)
    elif isinstance(node, list):
        for item in node:
            yield from env_entries(item)


def sensitive_env_values(objects: Iterable[Any], is_sensitive: Callable[[str], bool]) -> tuple[str, ...]:
    """The values of the env entries in ``objects`` (manifests, a job and its pods) whose names are sensitive."""
    found: list[str] = []
    for obj in objects:
        for entry in env_entries(obj):
            value = entry.get("value")
            if isinstance(value, str) and value and value not in found and is_sensitive(entry["name"]):
                found.append(value)
    return tuple(found)

"""What a try shows of its manifests and its job, masked by Airflow's secrets-masker rules.

The manifests reach the task log, the ``manifests`` XCom and the rendered-template view (``rendered_job``); the job
summary (log tails, messages, the root cause) reaches an XCom and the UI. None of them is a place for a secret: an
env entry with a sensitive name (``API_TOKEN``, ``DB_PASSWORD``: Airflow's ``[core] sensitive_var_conn_names`` and
built-in names) has its value replaced by ``***`` and registered with the task's masker, so that the value is also
masked wherever else it shows up (the pods' log lines in the task log, a log tail in the summary). Everything else
goes through Airflow's ``redact``, which masks what the masker already knows (the connections and variables the try
read).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from airflow_provider_torchelastic.compat import is_sensitive_name, redact
from airflow_provider_torchelastic.core.redaction import MASK, env_entries, redact_value, sensitive_env_values

__all__ = ["mask_manifests", "mask_summary", "sensitive_values"]


def sensitive_values(manifests: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The values of env entries with sensitive names in ``manifests``, registered with the task's masker (so that
    Airflow masks them too, in this process and its supervisor)."""
    from airflow.sdk.log import mask_secret

    found = sensitive_env_values(manifests, is_sensitive_name)
    for value in found:
        mask_secret(value)
    return found


def mask_manifests(manifests: Sequence[dict[str, Any]], secrets: Sequence[str]) -> list[dict[str, Any]]:
    """Copies of ``manifests`` fit to show: sensitive env values replaced, ``secrets`` and everything the masker
    knows redacted. The manifests themselves are not changed."""
    masked = copy.deepcopy(list(manifests))
    for manifest in masked:
        for entry in env_entries(manifest):
            if isinstance(entry.get("value"), str) and is_sensitive_name(entry["name"]):
                entry["value"] = MASK
    return [redact(redact_value(manifest, secrets)) for manifest in masked]


def mask_summary(summary: dict[str, Any], secrets: Sequence[str] = ()) -> dict[str, Any]:
    """The job summary's plain form with ``secrets`` and everything the masker knows redacted (log tails, messages,
    the root cause)."""
    redacted: dict[str, Any] = redact(redact_value(summary, secrets))
    return redacted

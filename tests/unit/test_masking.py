"""Secrets out of what others can see (issue 20, item 2): sensitive env values in the shown manifests, the try's
secret values in log lines, trigger events and job summaries."""

from __future__ import annotations

import json

from airflow_provider_torchelastic.core.redaction import redact_text, redact_value, redacting
from airflow_provider_torchelastic.operators.masking import mask_manifests, mask_summary, sensitive_values
from airflow_provider_torchelastic.triggers import _redacted_event

TOKEN = "tok-0123456789abcdef"


def pod(env: list[dict]) -> dict:
    containers = [{"name": "pytorch", "env": env}]
    return {
        "kind": "PyTorchJob",
        "spec": {
            "pytorchReplicaSpecs": {
                "Worker": {
                    "template": {"spec": {"containers": containers, "initContainers": [{"name": "init", "env": env}]}}
                }
            }
        },
    }


def test_sensitive_env_values_are_masked_in_the_shown_manifests_and_kept_in_the_real_ones() -> None:
    env = [{"name": "API_TOKEN", "value": TOKEN}, {"name": "EPOCHS", "value": "30"}, {"name": "DB_PASSWORD"}]
    manifests = [pod(env)]
    secrets = sensitive_values(manifests)
    assert secrets == (TOKEN,)
    shown = json.dumps(mask_manifests(manifests, secrets))
    assert TOKEN not in shown and shown.count('"value": "***"') == 2 and '"value": "30"' in shown
    assert json.dumps(manifests).count(TOKEN) == 2, "the manifests that are submitted keep the value"


def test_a_secret_in_a_non_sensitive_place_is_redacted_too() -> None:
    manifests = [pod([{"name": "API_TOKEN", "value": TOKEN}, {"name": "ARGS", "value": f"--key={TOKEN}"}])]
    assert TOKEN not in json.dumps(mask_manifests(manifests, sensitive_values(manifests)))


def test_redaction_masks_the_longest_secret_whole_and_walks_json() -> None:
    assert redact_text("a=secret-long b=secret", ["secret", "secret-long"]) == "a=*** b=***"
    assert redact_value({"k": [TOKEN, 1, {"x": f"x{TOKEN}"}]}, [TOKEN]) == {"k": ["***", 1, {"x": "x***"}]}
    lines: list[str] = []
    redacting(lines.append, [TOKEN])(f"[pod] the token is {TOKEN}")
    assert lines == ["[pod] the token is ***"]
    assert redacting(lines.append, []) == lines.append


def test_a_trigger_event_loses_the_secrets_in_its_texts_not_rank_0s_result() -> None:
    payload = {
        "status": "done",
        "progress": f"failed: {TOKEN}",
        "verdict": {"succeeded": True, "result": {"echo": TOKEN}, "detail": f"rank 0 said {TOKEN}"},
        "pods": [{"message": TOKEN}],
    }
    redacted = _redacted_event(payload, (TOKEN,))
    assert redacted["verdict"]["result"] == {"echo": TOKEN}, "the training code's own value is its business"
    assert TOKEN not in json.dumps({k: v for k, v in redacted.items() if k != "verdict"})
    assert TOKEN not in redacted["verdict"]["detail"]
    assert _redacted_event(payload, ()) is payload


def test_a_summary_loses_the_secrets_in_its_log_tails() -> None:
    summary = {"pods": [{"name": "p", "log_tail": [f"the token is {TOKEN}"]}], "root_cause": TOKEN}
    assert TOKEN not in json.dumps(mask_summary(summary, (TOKEN,)))

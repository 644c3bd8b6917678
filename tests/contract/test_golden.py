"""Golden files: canonical renders, checked field by field against reviewed YAML in ``tests/contract/golden/``.

A change to what we submit shows up here as a diff a reviewer can read. After an intended change, refresh the files
and review the diff before committing:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/contract/test_golden.py -p no:cacheprovider

Every golden render also meets every contract (``validate_rendered``), so a refreshed file cannot bless an object the
cluster would reject.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, RestartPolicy, RunPolicy, Worker
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions, secret_key_ref
from airflow_provider_torchelastic.kubernetes.render import summarize_for_ui
from tests.contract.builders import render
from tests.contract.schemas import validate_rendered

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

PLATFORM = PodOptions(
    limits={"nvidia.com/gpu": 8, "memory": "200Gi"},
    requests={"cpu": "32", "memory": "200Gi"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    labels={"kueue.x-k8s.io/queue-name": "gpu"},
    image_pull_secrets=["regcred"],
    env={"HF_TOKEN": secret_key_ref("hf", "token")},
    shm_size="32Gi",
)


def _cases() -> dict[str, list[dict[str, Any]]]:
    return {
        "single_pod": render(Elastic(nproc_per_node=2)),
        "elastic_gpu": render(Elastic(nnodes="2:4", nproc_per_node="gpu", max_restarts=3), pod_options=PLATFORM),
        "master_worker": render(
            PyTorch(
                master=Master(restart_policy=RestartPolicy.EXIT_CODE),
                worker=Worker(replicas=2, restart_policy=RestartPolicy.EXIT_CODE),
                run_policy=RunPolicy(backoff_limit=3),
                nproc_per_node=8,
            ),
            pod_options=PLATFORM,
            job_options=JobOptions(scheduling_policy={"queue": "team-a", "minAvailable": 3}),
        ),
    }


def _check(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with UPDATE_GOLDEN=1 (see this module's docstring)")
    assert text == path.read_text(), f"{path.name} differs; if intended, refresh with UPDATE_GOLDEN=1 and review"


@pytest.mark.parametrize("case", sorted(_cases()))
def test_render_matches_golden(case: str) -> None:
    manifests = _cases()[case]
    validate_rendered(manifests)
    text = yaml.safe_dump_all(manifests, sort_keys=False, width=120)
    path = GOLDEN / f"{case}.yaml"
    _check(path, text)
    assert list(yaml.safe_load_all(path.read_text())) == manifests


@pytest.mark.parametrize("case", sorted(_cases()))
def test_ui_summary_matches_golden(case: str) -> None:
    _check(GOLDEN / f"{case}.summary.yaml", summarize_for_ui(_cases()[case]))

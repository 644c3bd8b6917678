"""NCCL env defaults in every rendered training container: present by default, the user's value wins without a
conflict (PodOptions env, a replica's PodOptions, the pod template, an older spelling), still valid renders."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, Worker
from airflow_provider_torchelastic.core.launch import NCCL_ENV_DEFAULTS, nccl_env_defaults
from airflow_provider_torchelastic.core.pod_options import PodOptions, secret_key_ref
from tests.contract.builders import pod_specs, pytorch_container, render, workload
from tests.contract.schemas import validate_rendered

NAME = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

CONFIGS = {
    "pod": Elastic(),
    "elastic": Elastic(nnodes="2:4", nproc_per_node="gpu"),
    "master-worker": PyTorch(worker=Worker(replicas=2), nproc_per_node=8),
}


def env_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or valueFrom) of the pytorch container; a name given twice fails the test."""
    env = pytorch_container(pod_spec).get("env", [])
    names = [item["name"] for item in env]
    assert len(names) == len(set(names)), names
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in env}


def rendered_envs(config: Any, options: PodOptions | None = None) -> dict[str, dict[str, Any]]:
    manifests = render(config, pod_options=options)
    validate_rendered(manifests)
    return {replica: env_of(spec) for replica, spec in pod_specs(workload(manifests)).items()}


def test_the_defaults_are_only_the_one_torch_elastic_changes() -> None:
    # torch's own default is 3; torchelastic's agent gives its workers 1 unless the variable is set.
    assert dict(NCCL_ENV_DEFAULTS) == {NAME: "3"}
    assert all(name.startswith(("TORCH_NCCL_", "NCCL_")) for name in NCCL_ENV_DEFAULTS), "NCCL backend only"


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_pod_gets_the_defaults(case: str) -> None:
    envs = rendered_envs(CONFIGS[case])
    assert envs, case
    for replica, env in envs.items():
        for name, value in NCCL_ENV_DEFAULTS.items():
            assert env.get(name) == value, (replica, env)


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize(
    "user_env",
    [
        {NAME: "1"},
        {NAME: secret_key_ref("nccl", "mode")},
    ],
    ids=["value", "valueFrom"],
)
def test_pod_options_env_wins_without_a_conflict(case: str, user_env: dict[str, Any]) -> None:
    for replica, env in rendered_envs(CONFIGS[case], PodOptions(env=user_env)).items():
        expected = user_env[NAME] if isinstance(user_env[NAME], str) else dict(user_env[NAME])
        assert env[NAME] == expected, replica


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_pod_template_env_wins_without_a_conflict(case: str) -> None:
    template = {"spec": {"containers": [{"name": "pytorch", "env": [{"name": NAME, "value": "0"}]}]}}
    for replica, env in rendered_envs(CONFIGS[case], PodOptions(pod_template=template)).items():
        assert env[NAME] == "0", replica


def test_a_replicas_own_env_wins_for_that_replica_only() -> None:
    config = PyTorch(master=Master(pod=PodOptions(env={NAME: "2"})), worker=Worker(replicas=2))
    envs = rendered_envs(config)
    assert envs["Master"][NAME] == "2"
    assert envs["Worker"][NAME] == NCCL_ENV_DEFAULTS[NAME]


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_an_older_spelling_the_user_sets_is_not_overridden(case: str) -> None:
    # torch prefers TORCH_NCCL_ASYNC_ERROR_HANDLING over NCCL_ASYNC_ERROR_HANDLING: a default under the new name
    # would silently replace the user's choice.
    for replica, env in rendered_envs(CONFIGS[case], PodOptions(env={"NCCL_ASYNC_ERROR_HANDLING": "1"})).items():
        assert NAME not in env and env["NCCL_ASYNC_ERROR_HANDLING"] == "1", replica


def test_env_from_does_not_suppress_the_default() -> None:
    # Values behind envFrom are unknown at render time, and an explicit env entry wins over them in the pod: the
    # README says to override through env.
    env = rendered_envs(Elastic(), PodOptions(env_from=[{"configMapRef": {"name": "nccl"}}]))["Pod"]
    assert env[NAME] == NCCL_ENV_DEFAULTS[NAME]


def test_the_defaults_come_after_the_users_env_and_before_the_providers() -> None:
    env = list(rendered_envs(Elastic(), PodOptions(env={"WANDB_PROJECT": "x"}))["Pod"])
    assert env.index("WANDB_PROJECT") < env.index(NAME) < env.index("PYTHONUNBUFFERED")


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ((), {NAME: "3"}),
        ((NAME,), {}),
        (("NCCL_ASYNC_ERROR_HANDLING",), {}),
        (("NCCL_DEBUG", "PATH"), {NAME: "3"}),
    ],
)
def test_nccl_env_defaults_skips_what_is_set(present: tuple[str, ...], expected: dict[str, str]) -> None:
    assert nccl_env_defaults(present) == expected


def test_local_execution_gets_the_defaults_and_keeps_the_workers_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.local import run as local

    monkeypatch.delenv(NAME, raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert local._clean_env()[NAME] == NCCL_ENV_DEFAULTS[NAME]
    monkeypatch.setenv(NAME, "1")
    assert local._clean_env()[NAME] == "1"
    monkeypatch.delenv(NAME)
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")
    assert NAME not in local._clean_env()

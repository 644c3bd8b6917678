"""The runner's view of torch elastic (runner/torch_compat.py): every internal it uses is found in the installed
torch, and a torch that moved one fails with a configuration error naming it, not an AttributeError mid-launch."""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any

import pytest

from airflow_provider_torchelastic.runner import RunnerUsageError
from airflow_provider_torchelastic.runner.torch_compat import (
    LAUNCH_FIELDS,
    TESTED_TORCH,
    TorchIncompatibleError,
    elastic_api,
)


def test_the_installed_torch_has_everything_the_runner_uses() -> None:
    import torch

    api = elastic_api()
    assert api.elastic_launch.__name__ == "elastic_launch"
    assert issubclass(api.ChildFailedError, Exception)
    assert torch.__version__.split("+")[0] in TESTED_TORCH


def _without(module: str, name: str) -> Any:
    """An import function whose ``module`` lacks ``name`` (as a torch that moved it would)."""

    def import_module(wanted: str) -> Any:
        found = importlib.import_module(wanted)
        if wanted != module:
            return found
        copy = types.ModuleType(wanted)
        copy.__dict__.update({k: v for k, v in vars(found).items() if k != name})
        return copy

    return import_module


def test_a_missing_internal_is_named_with_the_torch_version_and_the_tested_ones() -> None:
    import torch

    with pytest.raises(TorchIncompatibleError) as caught:
        elastic_api(_without("torch.distributed.elastic.multiprocessing.api", "SignalException"))
    message = str(caught.value)
    assert "torch.distributed.elastic.multiprocessing.api.SignalException" in message, message
    assert f"torch {torch.__version__} lacks" in message and "2.13.0, 2.14.1, 2.15.0" in message, message
    # A configuration error of the image: the runner reports it as its own usage error (exit 2, never retried).
    assert isinstance(caught.value, RunnerUsageError)


def test_a_launch_config_without_a_field_the_runner_sets_is_named() -> None:
    import torch.distributed.launcher.api as launcher

    fields = [(f.name, f.type, f) for f in dataclasses.fields(launcher.LaunchConfig) if f.name != "logs_specs"]
    older = dataclasses.make_dataclass("LaunchConfig", fields)

    def import_module(wanted: str) -> Any:
        found = importlib.import_module(wanted)
        if wanted != "torch.distributed.launcher.api":
            return found
        copy = types.ModuleType(wanted)
        copy.__dict__.update({**vars(found), "LaunchConfig": older})
        return copy

    assert "logs_specs" in LAUNCH_FIELDS
    with pytest.raises(TorchIncompatibleError, match=r"LaunchConfig\.logs_specs"):
        elastic_api(import_module)


def test_no_torch_at_all_says_so_and_where_to_install_it() -> None:
    def import_module(wanted: str) -> Any:
        if wanted == "torch" or wanted.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return importlib.import_module(wanted)

    with pytest.raises(TorchIncompatibleError) as caught:
        elastic_api(import_module)
    message = str(caught.value)
    # Not "torch (version unknown) lacks ...": the six internals are not the news, the missing torch is.
    assert message.startswith("torch is not installed for the runner's Python (") and "lacks" not in message, message
    assert "No module named 'torch'" in message and "2.13.0, 2.14.1, 2.15.0" in message, message
    assert "in the image (Kubernetes)" in message and "airflow-provider-torchelastic[torch]" in message, message
    assert isinstance(caught.value, RunnerUsageError)

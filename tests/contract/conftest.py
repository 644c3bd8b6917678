"""Contract tests need the real PyTorchJob CRD; without it every test here errors with where to put it."""

from __future__ import annotations

import pytest

from tests.contract.schemas import load_crd


@pytest.fixture(scope="session", autouse=True)
def _require_crd() -> None:
    load_crd()

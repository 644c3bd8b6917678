"""Contract tests need the PyTorchJob CRD (the committed derivative unless TORCHELASTIC_CRD_PATH says otherwise)."""

from __future__ import annotations

import pytest

from tests.contract.schemas import load_crd


@pytest.fixture(scope="session", autouse=True)
def _require_crd() -> None:
    load_crd()

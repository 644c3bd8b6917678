"""Test session setup: a throwaway AIRFLOW_HOME with a sqlite database, set before anything imports Airflow."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_DAGS = REPO_ROOT / "tests" / "dags"

_home = tempfile.mkdtemp(prefix="torchelastic-airflow-home-")
os.environ.update(
    AIRFLOW_HOME=_home,
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__UNIT_TEST_MODE="True",
    AIRFLOW__CORE__DAGS_FOLDER=str(TEST_DAGS),
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{_home}/airflow.db",
)

if (REPO_ROOT / "tests" / "cluster" / "pytest_plugin.py").exists():
    pytest_plugins = ["tests.cluster.pytest_plugin"]


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[None]:
    """A fresh Airflow metadata database for tests that run DAGs."""
    from airflow.utils import db

    db.resetdb()
    yield

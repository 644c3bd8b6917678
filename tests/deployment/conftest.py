"""Loads the cluster and Airflow-deployment plugins for these tests (see tests/cluster_tests/conftest.py for why
not ``pytest_plugins``)."""

from __future__ import annotations

import pytest

PLUGINS = ("tests.cluster.pytest_plugin", "tests.airflow_services.pytest_plugin")


def pytest_configure(config: pytest.Config) -> None:
    for plugin in PLUGINS:
        if not config.pluginmanager.has_plugin(plugin):
            config.pluginmanager.import_plugin(plugin)

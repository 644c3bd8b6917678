"""Loads the cluster plugin for these tests when the top-level tests/conftest.py does not already do so.

Not ``pytest_plugins = [...]``: pytest rejects that in a non-top-level conftest once the lead's tests/conftest.py
exists, and registering the plugin twice would start two clusters.
"""

from __future__ import annotations

import pytest

PLUGIN = "tests.cluster.pytest_plugin"


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN):
        config.pluginmanager.import_plugin(PLUGIN)

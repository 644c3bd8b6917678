"""The runner needs neither Airflow nor the kubernetes client: run it where importing them fails.

A ``sitecustomize`` on ``PYTHONPATH`` installs an import blocker in the runner *and* in every spawned worker (each is
a fresh interpreter that inherits the environment), so the training image can be built without Airflow.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from airflow_provider_torchelastic.errors import EXIT_OK
from tests.runner.support import run_runner, runner_env

pytestmark = pytest.mark.slow

BLOCKER = """
import sys


class BlockAirflowAndKubernetes:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top == "airflow" or top.startswith("kubernetes"):
            raise ImportError(f"{name} is not installed in this image (blocked by the test)")
        return None


sys.meta_path.insert(0, BlockAirflowAndKubernetes())
"""


def probe_imports() -> dict:
    import os
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    blocked = {}
    for name in ("airflow", "airflow.sdk", "kubernetes", "kubernetes_asyncio"):
        try:
            __import__(name)
        except ImportError:
            blocked[name] = True
        else:
            blocked[name] = False
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] == "airflow" or m.startswith("kubernetes"))
    result = {
        "world_size": dist.get_world_size(),
        "rank": int(os.environ["RANK"]),
        "blocked": blocked,
        "loaded": loaded,
    }
    dist.destroy_process_group()
    return result


def test_runner_runs_where_airflow_cannot_be_imported(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = runner_env()
    env["PYTHONPATH"] = str(site) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    run = run_runner(tmp_path, probe_imports, start_method="spawn", env=env)
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome is not None and run.outcome.result == {
        "world_size": 2,
        "rank": 0,
        "blocked": {"airflow": True, "airflow.sdk": True, "kubernetes": True, "kubernetes_asyncio": True},
        "loaded": [],
    }

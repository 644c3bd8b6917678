"""Benchmark: what importing the operator costs a DAG file's parse beyond Airflow's own SDK (issue 39, item 5).

Run: ``make bench`` (or ``.venv/bin/python benchmarks/import_cost.py [--repeat 9] [--label TEXT] [--no-record]``).
Results are appended to ``benchmarks/results.md``. Goal: the operator's import at most 50 ms over ``import
airflow.sdk``.

Three kinds of fresh interpreter take turns, round after round, so that the machine's load drifting during the run
moves them alike: one runs ``import airflow.sdk``; one runs ``import airflow.sdk`` and then ``import
airflow_provider_torchelastic.operators``; one imports both and builds the operator as a DAG file does, with
``execution="local"`` and then with ``execution="kubernetes"`` (whose parse-time check renders the job once with a
placeholder run). Each times its steps inside the process with ``time.perf_counter``, which leaves out the
interpreter's start and exit (tens of ms of noise on a shared machine, and Airflow's own at-exit work): the goal is
checked on the median of the operator's import so timed. The whole processes of the first two kinds are timed too,
and this package's modules counted after each step.

Both with and without bytecode for this package: a checkout run with ``PYTHONDONTWRITEBYTECODE`` set (as in this
project's development shells, where the checkout has no ``.pyc`` files) compiles every module of ours it imports,
each time; an installed wheel has its ``.pyc`` files. The latter is measured with ``PYTHONPYCACHEPREFIX`` pointing
at a fresh folder that one untimed round fills first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "airflow_provider_torchelastic"
GOAL_MS = 50.0

_COUNT = """
import json, sys, time

def ours():
    return sum(1 for name in sys.modules if name.split(".")[0] == "PACKAGE")
"""

SDK_ONLY = """
import json, time
start = time.perf_counter()
import airflow.sdk
print(json.dumps({"sdk": time.perf_counter() - start}))
"""

WITH_OPERATOR = (
    _COUNT
    + """
start = time.perf_counter()
import airflow.sdk
sdk = time.perf_counter()
import PACKAGE.operators
imported = time.perf_counter()
print(json.dumps({"sdk": sdk - start, "operator": imported - sdk, "modules": ours()}))
"""
).replace("PACKAGE", PACKAGE)

# In processes of their own, so that the whole-process times above are the imports' alone.
CONSTRUCTIONS = (
    _COUNT
    + """
import airflow.sdk
from PACKAGE.operators import TorchElasticOperator

def train():
    return 1

start = time.perf_counter()
TorchElasticOperator(task_id="local", python_callable=train, execution="local")
local = time.perf_counter()
modules_local = ours()
TorchElasticOperator(
    task_id="kubernetes", python_callable=train, execution="kubernetes", image="registry.example.com/train:1"
)
kubernetes = time.perf_counter()
print(json.dumps({"local": local - start, "kubernetes": kubernetes - local, "modules": [modules_local, ours()]}))
"""
).replace("PACKAGE", PACKAGE)

Run = tuple[float, dict[str, Any]]


@dataclass(frozen=True)
class Cost:
    """Medians over the rounds, in ms (modules: a count, the same in every round)."""

    #: ``import airflow.sdk`` alone, in its own processes.
    sdk: float
    #: ``import airflow.sdk`` in the processes that import the operator next.
    sdk_then_operator: float
    #: ``import airflow_provider_torchelastic.operators`` after ``import airflow.sdk``: what the goal is about.
    operator: float
    #: Whole processes: ``python -c "import airflow.sdk"`` and the same plus the operator's import.
    process_sdk: float
    process_operator: float
    #: The first ``TorchElasticOperator(..., execution="local")`` after the import, then a Kubernetes one.
    construct_local: float
    construct_kubernetes: float
    #: This package's modules in ``sys.modules`` after the import, the local construction and the Kubernetes one.
    modules: tuple[int, int, int]


def _run(code: str, env: dict[str, str]) -> Run:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{code!r} failed ({proc.returncode}):\n{proc.stderr}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def measure(repeat: int, env: dict[str, str]) -> Cost:
    sdk_runs: list[Run] = []
    operator_runs: list[Run] = []
    construction_runs: list[Run] = []
    for _ in range(repeat):
        sdk_runs.append(_run(SDK_ONLY, env))
        operator_runs.append(_run(WITH_OPERATOR, env))
        construction_runs.append(_run(CONSTRUCTIONS, env))

    def median_ms(runs: list[Run], key: str) -> float:
        return statistics.median(float(data[key]) for _, data in runs) * 1e3

    local, kubernetes = construction_runs[-1][1]["modules"]
    return Cost(
        sdk=median_ms(sdk_runs, "sdk"),
        sdk_then_operator=median_ms(operator_runs, "sdk"),
        operator=median_ms(operator_runs, "operator"),
        process_sdk=statistics.median(wall for wall, _ in sdk_runs) * 1e3,
        process_operator=statistics.median(wall for wall, _ in operator_runs) * 1e3,
        construct_local=median_ms(construction_runs, "local"),
        construct_kubernetes=median_ms(construction_runs, "kubernetes"),
        modules=(int(operator_runs[-1][1]["modules"]), int(local), int(kubernetes)),
    )


def conditions(home: Path) -> dict[str, dict[str, str]]:
    """The environments measured, by name: this checkout's (no bytecode for our modules) and an installed one's."""
    # A throwaway Airflow home, so that reading [torch_elastic] options finds the defaults and writes nothing else.
    base = {**os.environ, "AIRFLOW_HOME": str(home / "airflow")}
    base.pop("AIRFLOW__TORCH_ELASTIC__EXECUTION", None)
    source = {**base, "PYTHONDONTWRITEBYTECODE": "1"}
    source.pop("PYTHONPYCACHEPREFIX", None)
    installed = {**base, "PYTHONPYCACHEPREFIX": str(home / "pycache")}
    installed.pop("PYTHONDONTWRITEBYTECODE", None)
    return {"no .pyc (a checkout)": source, ".pyc (an installed wheel)": installed}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=9, help="rounds (odd: the median is one of them)")
    parser.add_argument("--label", default="", help="what this run measures (before/after a change), in the title")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to results.md")
    args = parser.parse_args()

    costs: dict[str, Cost] = {}
    with tempfile.TemporaryDirectory(prefix="torchelastic-import-cost-") as tmp:
        for name, env in conditions(Path(tmp)).items():
            # Untimed: fills the bytecode cache where there is one, and the page cache.
            _run(CONSTRUCTIONS, env)
            costs[name] = measure(args.repeat, env)

    title = f"{args.label}, " if args.label else ""
    lines = [
        f"## {title}import cost (benchmarks/import_cost.py), {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
        f"UTC, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, median of "
        f"{args.repeat} alternating rounds",
        "",
        "| our modules | `import airflow.sdk` ms (in the other processes) | + `import ...operators` ms (goal <= 50) "
        "| processes: sdk / sdk + operator ms (difference) | construct local ms | then kubernetes ms "
        "| our modules after import / local / kubernetes |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {c.sdk:.0f} ({c.sdk_then_operator:.0f}) | {c.operator:.1f} | {c.process_sdk:.0f} / "
            f"{c.process_operator:.0f} ({c.process_operator - c.process_sdk:+.0f}) | {c.construct_local:.1f} | "
            f"{c.construct_kubernetes:.1f} | {' / '.join(map(str, c.modules))} |"
            for name, c in costs.items()
        ),
        "",
    ]
    report = "\n".join(lines)
    print(report)
    for name, c in costs.items():
        verdict = "met" if c.operator <= GOAL_MS else "NOT met"
        print(
            f"{name}: importing the operator after airflow.sdk takes {c.operator:.1f} ms: goal <= {GOAL_MS:g} {verdict}"
        )
    if not args.no_record:
        with (REPO / "benchmarks" / "results.md").open("a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

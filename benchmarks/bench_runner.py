"""Benchmarks: what the provider costs on top of plain torchrun, and what the DAG parse path costs.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_runner.py [--repeat N]``). Everything is measured in
one run on the same machine and reported as ratios to a baseline measured in that run, so the numbers compare
across machines better than absolute seconds. Results are appended to ``benchmarks/results.md``.

Measured:
- parse path: ``import airflow_provider_torchelastic`` + the operator, vs ``import torch`` (fresh interpreters);
- payload: size and dump/load time of the quickstart training function (pickled by value);
- launch: a trivial 2-worker job (gloo all_reduce) through our runner with spawn and with fork, vs the same
  function as a script under ``torchrun --standalone`` (the baseline); wall time and peak RSS of the process tree.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRAIN_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    def main():
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()
    if __name__ == "__main__":
        main()
    """
)


def _time_command(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of the largest process in the tree (children's max RSS)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(after, before) / 1024


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def bench_imports(repeat: int) -> dict[str, float]:
    def timed(code: str) -> float:
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            samples.append(time.perf_counter() - start)
        return _median(samples)

    baseline = timed("pass")
    sdk = timed("from airflow.sdk import BaseOperator")
    provider = timed(
        "import airflow_provider_torchelastic; from airflow_provider_torchelastic import TorchElasticOperator"
    )
    torch = timed("import torch")
    return {
        "python -c pass": baseline,
        "from airflow.sdk import BaseOperator": sdk,
        "import provider + operator": provider,
        "import torch": torch,
    }


def bench_payload(repeat: int) -> dict[str, float]:
    os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp())
    # The quickstart names no image: parsed for Kubernetes it needs [torch_elastic] image; locally it needs none.
    os.environ.setdefault("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    sys.path.insert(0, str(REPO / "example_dags"))
    import torch_elastic_quickstart as quickstart  # type: ignore[import-not-found]

    from airflow_provider_torchelastic.core.payload import dump_payload, load_payload

    fn = quickstart.train.function
    dumps, loads = [], []
    data = b""
    for _ in range(repeat):
        start = time.perf_counter()
        data = dump_payload(fn, (), {"epochs": 30})
        dumps.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_payload(data)
        loads.append(time.perf_counter() - start)
    return {"payload bytes": float(len(data)), "dump ms": _median(dumps) * 1e3, "load ms": _median(loads) * 1e3}


def bench_launch(repeat: int) -> dict[str, tuple[float, float]]:
    from airflow_provider_torchelastic.core.payload import dump_payload

    work = Path(tempfile.mkdtemp(prefix="torchelastic-bench-"))
    script = work / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # A module name that is not importable: the function travels by value, as a DAG file's would.
    namespace: dict[str, object] = {"__name__": "bench_train"}
    exec(compile(TRAIN_SCRIPT.replace('if __name__ == "__main__":\n    main()', ""), "train_bench", "exec"), namespace)
    payload = work / "payload.bin"
    payload.write_bytes(dump_payload(namespace["main"]))  # type: ignore[arg-type]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def runner(start_method: str) -> list[str]:
        return [
            sys.executable, "-m", "airflow_provider_torchelastic.runner", "--payload", str(payload),
            "--nproc-per-node", "2", "--monitor-interval", "0.5", "--start-method", start_method,
        ]  # fmt: skip

    commands = {
        "torchrun --standalone (baseline)": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.5",
            str(script),
        ],
        **{f"runner, {method}": runner(method) for method in ("spawn", "fork")},
    }
    results: dict[str, tuple[float, float]] = {}
    for name, command in commands.items():
        walls, rss = [], 0.0
        for _ in range(repeat):
            wall, peak = _time_command(command, env)
            walls.append(wall)
            rss = max(rss, peak)
        results[name] = (_median(walls), rss)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to results.md")
    args = parser.parse_args()

    imports = bench_imports(args.repeat)
    payload = bench_payload(args.repeat)
    launch = bench_launch(args.repeat)

    base_import = imports["python -c pass"]
    base_launch = launch["torchrun --standalone (baseline)"][0]
    lines = [
        f"## {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, median of {args.repeat}",
        "",
        "| parse path | seconds | x `python -c pass` |",
        "|---|---|---|",
        *(f"| {k} | {v:.3f} | {v / base_import:.1f} |" for k, v in imports.items()),
        "",
        f"Payload of the quickstart `train`: {payload['payload bytes']:.0f} bytes, "
        f"dump {payload['dump ms']:.1f} ms, load {payload['load ms']:.1f} ms.",
        "",
        "| 2-worker gloo job | wall seconds | x torchrun | peak RSS of one process (MiB) |",
        "|---|---|---|---|",
        *(f"| {k} | {wall:.2f} | {wall / base_launch:.2f} | {rss:.0f} |" for k, (wall, rss) in launch.items()),
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_record:
        with (REPO / "benchmarks" / "results.md").open("a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

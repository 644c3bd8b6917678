"""Benchmarks: what the provider costs on top of plain torchrun, and what the DAG parse path costs.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_runner.py [--repeat N]``). Everything is measured in
one run on the same machine and reported as ratios to a baseline measured in that run, so the numbers compare
across machines better than absolute seconds. Results are appended to ``benchmarks/results.md``.

Measured:
- parse path: ``import airflow_provider_torchelastic`` + the operator, vs ``import torch`` (fresh interpreters;
  the operator's import over ``import airflow.sdk``, timed inside the process, is ``benchmarks/import_cost.py``'s,
  which ``make bench`` runs next);
- payload: size and dump/load time of the quickstart training function (pickled by value);
- launch: a trivial 2-worker job (gloo all_reduce) through our runner with spawn and with fork, vs the same
  function as a script under ``torchrun --standalone`` (the baseline); wall time, CPU time (user + system of the
  process tree) and peak RSS of its largest process. The three commands run in turn, round after round, and each
  ratio is the median of the rounds' own ratios, so that the machine's load drifting during the run moves the
  three alike;
- worker imports: what a spawned worker imports of this provider before the training function runs (its
  entrypoint's module and the payload loader, after torch), from ``python -X importtime``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
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


def _time_command(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system of the process and of the descendants it waited for) and peak RSS
    (MiB) of the largest of those processes."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, command)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


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


BASELINE = "torchrun --standalone (baseline)"


@dataclass(frozen=True)
class Launch:
    wall: float
    #: Median over the rounds of this command's wall time / the baseline's in the same round.
    wall_ratio: float
    cpu: float
    cpu_ratio: float
    rss: float


def bench_launch(repeat: int) -> dict[str, Launch]:
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
        BASELINE: [
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
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            samples[name].append(_time_command(command, env))
    baseline = samples[BASELINE]
    return {
        name: Launch(
            wall=_median([wall for wall, _, _ in runs]),
            wall_ratio=_median([run[0] / base[0] for run, base in zip(runs, baseline, strict=True)]),
            cpu=_median([cpu for _, cpu, _ in runs]),
            cpu_ratio=_median([run[1] / base[1] for run, base in zip(runs, baseline, strict=True)]),
            rss=max(rss for _, _, rss in runs),
        )
        for name, runs in samples.items()
    }


WORKER_IMPORTS = (
    # What a spawned worker has imported before it unpickles its entrypoint: torch, and torch elastic's _wrap ...
    "import torch.multiprocessing.spawn, torch.distributed.elastic.multiprocessing.api; "
    # ... then what it imports of ours: the entrypoint's module (runner._spawn_entrypoint) and the payload loader.
    "import airflow_provider_torchelastic.runner.worker; "
    "from airflow_provider_torchelastic.core.payload import load_payload"
)


def bench_worker_imports(repeat: int) -> tuple[int, float]:
    """How many modules of this provider and cloudpickle a spawned worker imports, and their ``-X importtime`` self
    times in ms (median of ``repeat`` fresh interpreters)."""
    totals, count = [], 0
    for _ in range(repeat):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", WORKER_IMPORTS], capture_output=True, text=True, check=True
        )
        # "import time: <self us> | <cumulative us> | <indent><module>"
        rows = [line.removeprefix("import time:").split("|") for line in proc.stderr.splitlines()]
        ours = [
            int(row[0])
            for row in rows
            if len(row) == 3
            and row[0].strip().isdigit()
            and row[2].strip().split(".")[0] in ("airflow_provider_torchelastic", "cloudpickle")
        ]
        totals.append(sum(ours) / 1e3)
        count = len(ours)
    return count, _median(totals)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to results.md")
    args = parser.parse_args()

    imports = bench_imports(args.repeat)
    payload = bench_payload(args.repeat)
    worker_modules, worker_ms = bench_worker_imports(args.repeat)
    launch = bench_launch(args.repeat)

    base_import = imports["python -c pass"]
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
        f"A spawned worker imports {worker_modules} modules of the provider and cloudpickle before the training "
        f"function runs: {worker_ms:.1f} ms (`-X importtime` self times, after torch).",
        "",
        "| 2-worker gloo job | wall seconds | x torchrun | CPU seconds | x torchrun | peak RSS of one process (MiB) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {k} | {r.wall:.2f} | {r.wall_ratio:.2f} | {r.cpu:.2f} | {r.cpu_ratio:.2f} | {r.rss:.0f} |"
            for k, r in launch.items()
        ),
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

"""Benchmark: a large state dict saved as an artifact from rank 0 and loaded downstream, against a raw fsspec copy of
the same bytes to the same store, measured in the same run (issue 23, item 6).

Run: ``make bench-artifacts`` (or ``.venv/bin/python benchmarks/artifacts.py [--gib 1] [--repeat 3]``). Stores:
``file://`` (a temporary folder) and an S3-compatible server (moto in server mode, in a process of its own). Each
measurement runs in a fresh interpreter, so that its peak RSS is its own:

- ``save``: ``save_value(state_dict, location)``, what rank 0 runs (the safetensors writer, streamed to fsspec);
- ``copy``: the baseline, the same tensors' bytes written with ``fs.open(url, "wb").write(memory)`` to one object;
- ``load``: ``artifacts.load(ref)`` (one streamed request, read straight into the tensors, sha256-checked on the way);
- ``read``: the baseline, ``fs.open(url, "rb").read()`` of the same object.

Reported: seconds, throughput ratio to the baseline (>= 0.8 is the goal), and how much the writer's peak RSS grew
while it saved, as a fraction of the tensors' size (<= 0.2 is the goal); likewise the loader's and the raw read's
(the loaded tensors themselves are 1.0). Each ratio is the median of the rounds'.
Results are appended to ``benchmarks/results.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results.md"
TENSOR_MIB = 64

CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch

    mode, url, gib, ref_path = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    count = max(1, int(gib * 1024 / {tensor_mib}))
    elements = {tensor_mib} * (1 << 20) // 4

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if mode in ("save", "copy"):
        state = {{f"layer{{i}}.weight": torch.full((elements,), float(i)) for i in range(count)}}
    # The store's file system imported before the baseline: its libraries' memory is not the writer's.
    import fsspec

    fsspec.core.url_to_fs(url)
    if mode in ("load", "read"):
        import safetensors.torch
    before = peak_mib()
    started = time.perf_counter()
    if mode == "save":
        from airflow_provider_torchelastic.worker.artifacts import save_value

        ref = save_value(state, url)
        with open(ref_path, "w") as f:
            json.dump(ref, f)
    elif mode == "copy":
        import fsspec

        with fsspec.open(url + "/raw.bin", "wb") as f:
            for tensor in state.values():
                f.write(memoryview(tensor.numpy()).cast("B"))
    elif mode == "load":
        from airflow_provider_torchelastic.worker.artifacts import load

        with open(ref_path) as f:
            loaded = load(json.load(f))
        assert len(loaded) == count
    elif mode == "read":
        import fsspec

        with fsspec.open(url + "/raw.bin", "rb") as f:
            data = f.read()
        assert len(data) == count * elements * 4
    seconds = time.perf_counter() - started
    print(json.dumps({{"seconds": seconds, "before_mib": before, "peak_mib": peak_mib(), "mib": count * {tensor_mib}}}))
    """
).format(tensor_mib=TENSOR_MIB)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_s3() -> tuple[subprocess.Popen[bytes], dict[str, str], str]:
    port = free_port()
    code = (
        "import time\nfrom moto.server import ThreadedMotoServer\n"
        f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
        "while True: time.sleep(3600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + 60
    while True:
        try:
            import boto3

            boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **_credentials(env)).create_bucket(Bucket=bucket)
            break
        except Exception:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.5)
    return server, env, f"s3://{bucket}"


def _credentials(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def measure(mode: str, url: str, gib: float, ref_path: str, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, url, str(gib), ref_path],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {url}: {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def bench_store(name: str, url: str, gib: float, repeat: int, env: dict[str, str]) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(repeat):
        location = f"{url}/round{index}"
        with tempfile.TemporaryDirectory() as tmp:
            ref_path = str(Path(tmp) / "ref.json")
            found = {mode: measure(mode, location, gib, ref_path, env) for mode in ("copy", "save", "read", "load")}
        rounds.append(found)
        print(name, index, {mode: round(m["seconds"], 2) for mode, m in found.items()}, flush=True)
    mib = rounds[0]["save"]["mib"]

    def median(mode: str) -> float:
        return statistics.median(r[mode]["seconds"] for r in rounds)

    return {
        "store": name,
        "mib": mib,
        "copy": median("copy"),
        "save": median("save"),
        "read": median("read"),
        "load": median("load"),
        "save_ratio": statistics.median(r["copy"]["seconds"] / r["save"]["seconds"] for r in rounds),
        "load_ratio": statistics.median(r["read"]["seconds"] / r["load"]["seconds"] for r in rounds),
        "save_rss": statistics.median((r["save"]["peak_mib"] - r["save"]["before_mib"]) / mib for r in rounds),
        "copy_rss": statistics.median((r["copy"]["peak_mib"] - r["copy"]["before_mib"]) / mib for r in rounds),
        "load_rss": statistics.median((r["load"]["peak_mib"] - r["load"]["before_mib"]) / mib for r in rounds),
        "read_rss": statistics.median((r["read"]["peak_mib"] - r["read"]["before_mib"]) / mib for r in rounds),
    }


def record(rows: list[dict[str, Any]], gib: float, repeat: int) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {now}, artifacts (benchmarks/artifacts.py), {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, a {gib:g} GiB state dict of {TENSOR_MIB} MiB tensors, median of {repeat}",
        "",
        "| store | raw copy s | save s | save / copy throughput | raw read s | load s | load / read throughput "
        "| writer's peak RSS growth (x tensors) | raw copy's | loader's peak RSS growth (x tensors) | raw read's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['store']} | {row['copy']:.2f} | {row['save']:.2f} | {row['save_ratio']:.2f} | {row['read']:.2f} "
            f"| {row['load']:.2f} | {row['load_ratio']:.2f} | {row['save_rss']:.3f} | {row['copy_rss']:.3f} "
            f"| {row['load_rss']:.3f} | {row['read_rss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the state dict (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per store (default 3)")
    parser.add_argument("--stores", default="file,s3", help="comma-separated: file, s3")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to results.md")
    args = parser.parse_args()
    rows = []
    stores = args.stores.split(",")
    if "file" in stores:
        folder = tempfile.mkdtemp(prefix="bench-artifacts-")
        try:
            rows.append(bench_store("file://", f"file://{folder}", args.gib, args.repeat, {}))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if "s3" in stores:
        server, env, url = start_s3()
        try:
            rows.append(bench_store("S3 (moto server)", url, args.gib, args.repeat, env))
        finally:
            server.kill()
            server.wait()
    text = record(rows, args.gib, args.repeat)
    print(text)
    if not args.no_record:
        with RESULTS.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()

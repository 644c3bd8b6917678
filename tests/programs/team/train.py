"""A torchrun-style training program: argv picks what it does, rank 0 hands back its value with set_result().

python -m team.train ok --steps 3        (torchrun -m team.train ok --steps 3)
python tests/programs/team/train.py fail
"""

from __future__ import annotations

import argparse
import os
import sys

from airflow_provider_torchelastic import RecoverableError, set_result


class ShardServerDown(RecoverableError):
    """Worth a retry: the retry finds the server up."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="team.train")
    parser.add_argument("mode", choices=["ok", "recoverable-on-try-1", "fail", "exit"])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--try-number", type=int, default=1)
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    if options.mode == "recoverable-on-try-1" and options.try_number == 1:
        raise ShardServerDown(f"rank {rank}: the shard server is down on try {options.try_number}")
    if options.mode == "fail" and rank == 1:
        raise ValueError("label 7 is out of range in shard 3")
    if options.mode == "exit":
        set_result({"stopped": "early", "rank": rank})
        sys.exit(0)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.zeros(1)
    for step in range(options.steps):
        value = torch.tensor([float(rank + step)])
        dist.all_reduce(value)
        total += value
    dist.destroy_process_group()
    set_result(
        {
            "argv": sys.argv[1:],
            "total": total.item(),
            "main": __name__,
            "main_file": os.path.basename(getattr(sys.modules["__main__"], "__file__", "") or ""),
            "try_number": options.try_number,
        }
    )


if __name__ == "__main__":
    main()

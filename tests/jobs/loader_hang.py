"""A hang behind a data loader, for the stack dump tests (run under torchrun, gloo on CPU): every
rank reads a DataLoader whose workers stay alive (num_workers=2, persistent_workers; forked or
spawned by the rank, so they inherit its RANK), then the rank given sleeps instead of entering
the all-reduce the others wait in. Each rank writes OUT/rank<R>.json (its pid) once its loader's
workers are up, just before it sleeps or waits.

    loader_hang.py OUT --sleep-rank R [--context fork|spawn] [--seconds S]

Every rank ends by itself after S seconds (120 by default), should nobody stop it.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


def sleep_instead_of_all_reduce(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sleep-rank", type=int, required=True)
    parser.add_argument("--context", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context=args.context)
    total = sum(int(batch.sum()) for batch in loader)  # the workers started, and stay
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
    if rank == args.sleep_rank:
        sleep_instead_of_all_reduce(args.seconds)
    else:
        dist.all_reduce(torch.tensor([float(total)]))  # waits for the sleeper
    sys.stdout.flush()
    os._exit(0)  # see ddp_loop.py: no interpreter finalization under gloo's threads


if __name__ == "__main__":  # a spawned worker imports this file again
    main()

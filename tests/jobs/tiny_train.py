"""A real, small training job across the cluster's nodes: what the end-to-end tests kill pods
under, so that "the run went on" is shown by the training itself.

Run as the head's job (a Ray driver): one rank per node (rank 0 on the head), a tiny model
trained with DistributedDataParallel over gloo. Each step's batch depends only on the step and
the rank, so a resumed run computes exactly the losses the first run would have. Rank 0 writes
a checkpoint every `--every` steps (atomically: a temporary file, then a rename) into
$PODAGENT_CHECKPOINT_DIR and appends every step to `.steps.jsonl` there (hidden, so podagent's
checkpoint detection ignores it); with podagent's resume flag (`--load_checkpoint`) it starts
from the newest checkpoint and the ranks get its weights from rank 0 (no shared disk needed).

    python tests/jobs/tiny_train.py --steps 200 --every 20 --step-time 0.05 [--load_checkpoint]
        [--hang-rank R --hang-at S] [--collective-timeout SECONDS]

With --hang-rank, on the first attempt (PODAGENT_ATTEMPT=1) that rank stops entering the
collectives at step S and sleeps for ever (a stalled data loader), after writing `.hung.json`
(its node's address, when) into the checkpoint directory; the other ranks wait in DDP.

Ends with `TRAINED steps=N attempt=A loss=L` and exit 0; a rank that fails (a peer gone)
fails the job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

STEPS_FILE = ".steps.jsonl"
FEATURES, HIDDEN, BATCH = 8, 16, 32


def checkpoints(directory: Path) -> list[Path]:
    return sorted(directory.glob("step-*.pt"))


class Trainer:
    """One rank, in a Ray worker process on its node."""

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def train(self, rank: int, world: int, master: str, port: int, options: dict[str, Any]
              ) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=options["collective_timeout"]))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                    torch.nn.Linear(HIDDEN, 1))
        directory = Path(options["checkpoint_dir"])
        start = torch.zeros(1, dtype=torch.int64)
        if rank == 0 and options["resume"]:
            found = checkpoints(directory)
            if found:
                state = torch.load(found[-1])
                model.load_state_dict(state["model"])
                start[0] = state["step"]
                print(f"resumed from {found[-1].name} (step {state['step']})", flush=True)
        dist.broadcast(start, src=0)
        ddp = DistributedDataParallel(model)  # starts every rank from rank 0's weights
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)  # no state to carry over
        loss_value = float("nan")
        for step in range(int(start[0]) + 1, options["steps"] + 1):
            if rank == options["hang_rank"] and step == options["hang_at"] \
                    and options["attempt"] == 1:
                self._hang(directory)
            generator = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(BATCH, FEATURES, generator=generator)
            y = torch.sin(x.sum(dim=1, keepdim=True))
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            loss_value = float(mean) / world
            if rank == 0:
                self._record(directory, step, loss_value, options)
                if step % options["every"] == 0:
                    self._save(directory, step, model)
            time.sleep(options["step_time"])
        dist.destroy_process_group()
        return {"rank": rank, "loss": loss_value}

    @staticmethod
    def _record(directory: Path, step: int, loss: float, options: dict[str, Any]) -> None:
        line = {"step": step, "loss": loss, "attempt": options["attempt"], "t": time.time()}
        with open(directory / STEPS_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"step {step} loss {loss:.6f} attempt {options['attempt']}", flush=True)

    @staticmethod
    def _hang(directory: Path) -> None:
        import ray

        marker = {"ip": ray.util.get_node_ip_address(), "at": time.time()}
        (directory / ".hung.json").write_text(json.dumps(marker))
        while True:
            time.sleep(3600)

    @staticmethod
    def _save(directory: Path, step: int, model: Any) -> None:
        import torch

        path = directory / f"step-{step:06d}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"step": step, "model": model.state_dict()}, tmp)
        os.replace(tmp, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds slept per step")
    parser.add_argument("--load_checkpoint", action="store_true", help="podagent's resume flag")
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=0)
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="gloo's timeout: how long the others wait for a hung rank")
    args = parser.parse_args(argv)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from podagent.checks.clustercheck import own_node_address, plan_ranks

    directory = Path(os.environ["PODAGENT_CHECKPOINT_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    # As the cluster check connects (Ray 2.48 may take a worker's address for the driver's).
    ray.init(address="auto", logging_level="ERROR", _node_ip_address=own_node_address())
    _, ranks = plan_ranks(ray.nodes(), "gloo")
    attempt = int(os.environ.get("PODAGENT_ATTEMPT", "1"))
    print(f"training on {len(ranks)} node(s): {', '.join(r.node_ip for r in ranks)}; "
          f"attempt {attempt}", flush=True)
    remote = ray.remote(Trainer)
    actors = [remote.options(num_cpus=0, max_restarts=0, scheduling_strategy=(
        NodeAffinitySchedulingStrategy(r.node_id, soft=False))).remote() for r in ranks]
    port = ray.get(actors[0].free_port.remote(), timeout=120)
    options = {"steps": args.steps, "every": args.every, "step_time": args.step_time,
               "resume": args.load_checkpoint, "checkpoint_dir": str(directory),
               "attempt": attempt, "hang_rank": args.hang_rank, "hang_at": args.hang_at,
               "collective_timeout": args.collective_timeout}
    results = ray.get([a.train.remote(r.rank, len(ranks), ranks[0].node_ip, port, options)
                       for a, r in zip(actors, ranks, strict=True)])
    print(f"TRAINED steps={args.steps} attempt={attempt} loss={results[0]['loss']:.6f}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

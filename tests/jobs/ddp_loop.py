"""A gloo DDP loop for the runs without Ray: torch.distributed under torchrun, or the same loop
under accelerate (--accelerate). Each rank writes what it is to OUT/rank<R>.json after its first
step (the run is then under way: the fault tests wait for it) and again after its last.
"""

import argparse
import json
import os
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--accelerate", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
if args.accelerate:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, world = accelerator.process_index, accelerator.num_processes
    backward = accelerator.backward
    mode = str(accelerator.distributed_type)
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(model)
    backward = torch.Tensor.backward
    mode = "torchrun"


def report(step: int) -> None:
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "world": world, "node": int(os.environ["GROUP_RANK"]),
                   "local_rank": int(os.environ["LOCAL_RANK"]), "mode": mode, "step": step,
                   "node_rank_set": "NODE_RANK" in os.environ,
                   "token_seen": "PODAGENT_TOKEN" in os.environ}, f)
    os.replace(path + ".tmp", path)


x = torch.full((8, 4), float(rank + 1))
for step in range(1, args.steps + 1):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1))
    backward(loss)  # DDP all-reduces the gradient over every rank here
    optimizer.step()
    if step in (1, args.steps):
        report(step)
    if step % 10 == 1:
        print(f"rank {rank} step {step}", flush=True)
    time.sleep(args.step_seconds)
# Leave without finalizing the interpreter. The allreduce that backward() started holds a Python
# object (autograd's context); when gloo's worker thread drops the last reference to it only
# after this interpreter began to finalize, that thread takes the GIL, is ended by Python, and
# the process aborts ("terminate called without an active exception", SIGABRT; torch's bug,
# pytorch/pytorch#190489): under CPU load one run in five.
sys.stdout.flush()
os._exit(0)

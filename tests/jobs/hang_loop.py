"""A DDP loop (gloo; NCCL on a GPU with --backend nccl) that checkpoints every step and
resumes from its newest checkpoint, for the hang tests and bench/gpu_hang.py (runs without Ray
under torchrun): on its first attempt one rank stops entering the
collectives at one step and sleeps for ever, as a rank behind a stalled data loader does; the
others wait inside DDP's gradient all-reduce. Only rank 0 prints (as trainers do), so the
other pods' output is silent on a healthy run too.

    hang_loop.py OUT CKPT --steps N --hang-rank R --hang-at S [--step-seconds T]
                 [--backend nccl]

OUT/hung (once written by the rank that hangs: when it began) makes every later attempt run
through; each rank writes OUT/rank<R>.json when it finishes: its first step (1 + the
checkpoint it resumed from) and the last.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import podagent.job

podagent.job.enable_stack_dumps()  # where py-spy may not read this process (no ptrace)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("ckpt")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--hang-rank", type=int, default=-1)
parser.add_argument("--hang-at", type=int, default=5)
parser.add_argument("--step-seconds", type=float, default=0.2)
parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
args = parser.parse_args()

gpu = args.backend == "nccl"
if gpu:
    torch.cuda.set_device(0)  # each pod sees its one GPU
device = torch.device("cuda", 0) if gpu else torch.device("cpu")
dist.init_process_group(args.backend)
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

os.makedirs(args.ckpt, exist_ok=True)
saved = sorted(int(name[5:-3]) for name in os.listdir(args.ckpt)
               if name.startswith("step-") and name.endswith(".pt"))
start = 1
if saved:
    state = torch.load(os.path.join(args.ckpt, f"step-{saved[-1]}.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    start = saved[-1] + 1
if rank == 0:
    print(f"starting at step {start} (checkpoint: {saved[-1] if saved else 'none'})",
          flush=True)

hung = os.path.join(args.out, "hung")
x = torch.full((8, 4), float(rank + 1), device=device)
for step in range(start, args.steps + 1):
    if rank == args.hang_rank and step == args.hang_at and not os.path.exists(hung):
        with open(hung, "w") as f:
            json.dump({"rank": rank, "step": step, "at": time.time()}, f)
        while True:  # never enters this step's all-reduce
            time.sleep(3600)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1, device=device)).backward()
    optimizer.step()
    if gpu:  # a step ends when its kernels did (as a trainer's loss.item() waits for them)
        torch.cuda.synchronize()
    if rank == 0:
        path = os.path.join(args.ckpt, f"step-{step}.pt")
        torch.save({"model": model.module.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"step {step}", flush=True)
    time.sleep(args.step_seconds)

with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "first": start, "last": args.steps}, f)
sys.stdout.flush()
os._exit(0)  # see ddp_loop.py: no interpreter finalization under gloo's threads

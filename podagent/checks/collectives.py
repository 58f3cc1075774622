"""The collective checks themselves: plain torch.distributed, no Ray.

The cluster check runs them in Ray actors; `bench/gpu_pods.py` runs the same bandwidth
measurement in plain processes as the reference, so the two figures differ only in how the
processes were started.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MB = 1 << 20


@dataclass(frozen=True)
class Bandwidth:
    size_bytes: int
    seconds: float  # per all_reduce, averaged over the timed iterations
    algbw: float  # GB/s: bytes / time
    # GB/s: algbw * 2(n-1)/n, the ring all_reduce's per-link traffic (nccl-tests); None for
    # one rank, where nothing crosses a link and no bus bandwidth exists.
    busbw: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bus_factor(world: int) -> float | None:
    return 2 * (world - 1) / world if world > 1 else None


def device_for(backend: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"


def _sync(backend: str) -> None:
    if backend == "nccl":
        import torch

        torch.cuda.synchronize()


def check_all_reduce(rank: int, world: int, backend: str) -> str | None:
    """Each rank gives rank+1 in every element; every rank must see n(n+1)/2 everywhere."""
    import torch
    import torch.distributed as dist

    x = torch.full((1024,), float(rank + 1), device=device_for(backend))
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    got = x.cpu()
    if not torch.all(got == expected):
        return f"all_reduce gave {float(got[0])} (and others), expected {expected}"
    return None


def check_gather(rank: int, world: int, backend: str) -> str | None:
    """gather to rank 0: rank 0 must receive every rank's own value, in rank order."""
    import torch
    import torch.distributed as dist

    device = device_for(backend)
    mine = torch.tensor([float(rank)], device=device)
    if backend == "nccl":
        # NCCL has no gather; all_gather then keep it on rank 0 is what trainers do.
        parts = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(parts, mine)
        bucket = parts if rank == 0 else None
    else:
        bucket = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, bucket, dst=0)
    if rank == 0:
        assert bucket is not None
        got = [float(t.item()) for t in bucket]
        if got != [float(r) for r in range(world)]:
            return f"rank 0 gathered {got}, expected {list(range(world))}"
    return None


def check_all_gather(rank: int, world: int, backend: str) -> str | None:
    import torch
    import torch.distributed as dist

    device = device_for(backend)
    parts = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank), float(rank) * 10], device=device))
    got = [t.cpu().tolist() for t in parts]
    expected = [[float(r), float(r) * 10] for r in range(world)]
    if got != expected:
        return f"all_gather gave {got}, expected {expected}"
    return None


def check_sequential_gathers(rank: int, world: int, backend: str,
                             count: int = 200) -> tuple[str | None, float]:
    """Many small all_gathers in a row, as batch processing does; returns (error, ms per op)."""
    import torch
    import torch.distributed as dist

    device = device_for(backend)
    parts = [torch.zeros(4, device=device) for _ in range(world)]
    started = time.perf_counter()
    for step in range(count):
        dist.all_gather(parts, torch.full((4,), float(step * world + rank), device=device))
        # Checked on the CPU every 50th step only: a copy each step would time the copy.
        if step % 50 == 49 or step == count - 1:
            got = [float(t[0].item()) for t in parts]
            if got != [float(step * world + r) for r in range(world)]:
                return f"gather {step + 1} of {count} gave {got}", 0.0
    _sync(backend)
    return None, (time.perf_counter() - started) / count * 1000


def measure_all_reduce(size_bytes: int, world: int, backend: str, warmup: int = 3,
                       iterations: int = 20) -> Bandwidth:
    """algbw and busbw of a float32 all_reduce of size_bytes, as nccl-tests define them.

    20 timed iterations: with 5, socket transports varied by 25% from run to run.
    """
    import torch
    import torch.distributed as dist

    tensor = torch.ones(max(1, size_bytes // 4), dtype=torch.float32,
                        device=device_for(backend))
    for _ in range(warmup):
        dist.all_reduce(tensor)
    _sync(backend)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    _sync(backend)
    seconds = (time.perf_counter() - started) / iterations
    algbw = size_bytes / seconds / 1e9
    factor = bus_factor(world)
    return Bandwidth(size_bytes, seconds, algbw, algbw * factor if factor else None)


def payload_sizes(max_bytes: int) -> list[int]:
    """1 MiB, then x16 steps, always ending at max_bytes."""
    sizes, size = [], MB
    while size < max_bytes:
        sizes.append(size)
        size *= 16
    return [*sizes, max_bytes]


def sampler_shard(dataset_size: int, world: int, rank: int, batch: int,
                  seed: int = 0) -> dict[str, Any]:
    """What this rank's DistributedSampler gives: its indices and its steps per epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = range(dataset_size)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)  # type: ignore[arg-type]
    return {"indices": list(sampler), "steps": len(loader)}


def expected_steps(dataset_size: int, world: int, batch: int) -> int:
    """Steps per epoch per rank: ceil(M / world) samples each (the sampler pads), in batches."""
    return math.ceil(math.ceil(dataset_size / world) / batch)


# The DDP step's model: small enough to take milliseconds, two layers so that the gradients of
# one depend on the other's weights (a wrong reduction of either shows).
DDP_SHAPE = (32, 64, 1)
DDP_BATCH = 16


def ddp_step(rank: int, world: int, backend: str, seed: int = 0) -> tuple[str | None, dict]:
    """One DistributedDataParallel training step of a small model, each rank on its own data.

    Every rank's averaged gradients must equal every other rank's exactly (one all_reduce
    result, copied to all) and the mean of the ranks' own gradients, computed here without DDP,
    within float rounding; the weights after the optimizer's step must be equal everywhere.
    Returns (error or None, figures).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # DDP's constructor imports torch._dynamo, once per process: seconds on a small CPU that
    # every trainer pays too. Timed apart from the step.
    started = time.perf_counter()
    import torch._dynamo

    imported = time.perf_counter() - started
    started = time.perf_counter()
    device = device_for(backend)
    torch.manual_seed(seed)  # the same initial weights on every rank
    inputs, hidden, outputs = DDP_SHAPE
    model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, outputs)).to(device)
    data = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own batch
    x = torch.randn(DDP_BATCH, inputs, generator=data).to(device)
    y = torch.randn(DDP_BATCH, outputs, generator=data).to(device)

    def flat(values: Any) -> Any:
        return torch.cat([v.detach().reshape(-1) for v in values])

    torch.nn.functional.mse_loss(model(x), y).backward()
    own = flat(p.grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if backend == "nccl"
                                  else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    averaged = flat(p.grad for p in model.parameters())
    optimizer.step()
    weights = flat(model.parameters())

    def everyone(tensor: Any) -> list[Any]:
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor)
        return [part.cpu() for part in parts]

    error, off_mean = ddp_verdict(rank, everyone(own), everyone(averaged), everyone(weights))
    return error, {"params": own.numel(), "max_diff": off_mean,
                   "seconds": round(time.perf_counter() - started, 3),
                   "import_s": round(imported, 3)}


def ddp_verdict(rank: int, own: Sequence[Any], averaged: Sequence[Any],
                weights: Sequence[Any]) -> tuple[str | None, float]:
    """Rank `rank`'s verdict on a DDP step from every rank's flattened own gradients, averaged
    gradients and weights after the step: (error or None, largest |averaged - mean of own|)."""
    import torch

    mine = averaged[rank]
    off_mean = float((mine - torch.stack(list(own)).mean(0)).abs().max())
    unequal = [r for r, other in enumerate(averaged) if not torch.equal(other, mine)]
    if unequal:
        worst = max(float((averaged[r] - mine).abs().max()) for r in unequal)
        return (f"averaged gradients differ from those of rank(s) {unequal} "
                f"(by up to {worst:.3g})", off_mean)
    # Summed in another order than DDP's buckets, so equal only up to rounding.
    scale = max(float(torch.stack(list(own)).abs().max()), 1e-12)
    if off_mean > 1e-5 * scale:
        return (f"averaged gradients are not the mean of the ranks' own: off by up to "
                f"{off_mean:.3g} (largest gradient {scale:.3g})", off_mean)
    unequal = [r for r, other in enumerate(weights) if not torch.equal(other, weights[rank])]
    if unequal:
        return f"weights after the step differ from those of rank(s) {unequal}", off_mean
    return None, off_mean

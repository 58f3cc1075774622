"""The GPU check's measurements, in a process of their own (`python -m
podagent.run.gpu_probe`): each GPU's BF16 matmul throughput, one process per GPU at once,
and with two GPUs or more an all-reduce across all of them whose sum is checked. One JSON
object on stdout; podagent's GPU check (run/gpu_check.py) judges it.

A child process because CUDA, once started in a process, stays there: podagent itself never
holds a GPU that Ray or the job will need, and a GPU that hangs is ended with its process
group by the check's deadline, not waited for. `--device cpu` runs the same flow on the CPU
with gloo (what podagent's own tests exercise on machines without GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

# Square BF16 matmuls of this size keep a data-center GPU's tensor cores busy (smaller ones
# measure launch overhead); a few warm-up rounds bring the clocks up first.
MATMUL_N = {"cuda": 8192, "cpu": 256}
WARMUP, ROUNDS = 10, 50
# The all-reduce: large enough for its bandwidth to mean something, small enough for seconds.
REDUCE_ELEMENTS = {"cuda": 64 * 1024 * 1024, "cpu": 256 * 1024}  # float32: 256 MiB on GPUs
REDUCE_ROUNDS = 5
GROUP_TIMEOUT = timedelta(seconds=60)  # a peer that never comes ends the rank, not the pod


def _matmul_tflops(torch: Any, device: Any, kind: str) -> float:
    n = MATMUL_N[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(WARMUP):
        torch.mm(a, b, out=out)
    _sync(torch, kind)
    began = time.perf_counter()
    for _ in range(ROUNDS):
        torch.mm(a, b, out=out)
    _sync(torch, kind)
    seconds = time.perf_counter() - began
    if not bool(torch.isfinite(out).all()):
        raise ArithmeticError("the matmul's result holds NaN or Inf")
    return 2 * n**3 * ROUNDS / seconds / 1e12


def _sync(torch: Any, kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def _all_reduce(torch: Any, device: Any, kind: str, rank: int, world: int) -> dict[str, Any]:
    """Every rank's GPU reduced with every other's: the sums checked element by element
    (a first reduce of rank+1, then timed rounds of ones), and the bus bandwidth."""
    dist = torch.distributed
    tensor = torch.full((REDUCE_ELEMENTS[kind],), float(rank + 1), device=device,
                        dtype=torch.float32)
    dist.all_reduce(tensor)  # also sets the rings up: not timed
    _sync(torch, kind)
    wrong = int((tensor != float(world * (world + 1) // 2)).sum())
    tensor.fill_(1.0)
    began = time.perf_counter()
    for _ in range(REDUCE_ROUNDS):
        dist.all_reduce(tensor)
    _sync(torch, kind)
    seconds = (time.perf_counter() - began) / REDUCE_ROUNDS
    wrong += int((tensor != float(world**REDUCE_ROUNDS)).sum())  # exact in float32
    size = tensor.numel() * tensor.element_size()
    return {"ok": wrong == 0, "wrong": wrong, "bytes": size,
            # NCCL's bus bandwidth convention: what each link carried, per second
            "busbw_gbs": 2 * (world - 1) / world * size / seconds / 1e9}


def rank_main(rank: int, world: int, kind: str, store: str, out_dir: str) -> None:
    """One GPU's measurements, into out_dir/rank<r>.json whatever happens."""
    result: dict[str, Any] = {"rank": rank}
    try:
        import torch

        if kind == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            result["name"] = torch.cuda.get_device_name(rank)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        result["tflops"] = _matmul_tflops(torch, device, kind)
        if world > 1:
            torch.distributed.init_process_group(
                "nccl" if kind == "cuda" else "gloo", init_method=f"file://{store}",
                rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
            try:
                result["reduce"] = _all_reduce(torch, device, kind, rank, world)
            finally:
                torch.distributed.destroy_process_group()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}".strip()
        result["trace"] = traceback.format_exc(limit=3)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def probe(kind: str, count: int | None, work: str) -> dict[str, Any]:
    """The measurements, using `work` (an empty directory) for the ranks' results."""
    began = time.monotonic()
    try:
        import torch
    except Exception as exc:  # the image's torch, not the GPU: nothing measured, said so
        return {"error": f"torch could not be imported ({type(exc).__name__}: {exc})".strip(),
                "kind": "no-torch"}
    if kind == "cuda":
        if not torch.cuda.is_available():
            return {"error": f"torch {torch.__version__} sees no CUDA device "
                             f"(CUDA runtime {torch.version.cuda})", "kind": "no-cuda"}
        world = torch.cuda.device_count()
    else:
        world = count or 1
    store = os.path.join(work, "store")
    if world == 1:
        rank_main(0, 1, kind, store, work)
    else:
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(world, kind, store, work), nprocs=world, join=True)
    ranks = []
    for rank in range(world):
        file = Path(work, f"rank{rank}.json")
        ranks.append(json.loads(file.read_text()) if file.exists() else
                     {"rank": rank, "error": "the rank's process left no result"})
    return {"torch": torch.__version__, "device": kind, "world": world, "ranks": ranks,
            "seconds": time.monotonic() - began}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podagent.run.gpu_probe")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--count", type=int, default=None,
                        help="--device cpu: how many ranks stand for GPUs")
    parser.add_argument("--work", default=None,
                        help="an empty directory for the ranks' results (its caller removes "
                             "it; default: one of its own, removed at the end)")
    args = parser.parse_args(argv)
    try:
        if args.work:
            result = probe(args.device, args.count, args.work)
        else:
            with tempfile.TemporaryDirectory(prefix="podagent-gpu-probe-") as work:
                result = probe(args.device, args.count, work)
    except Exception as exc:  # a rank's process lost, say: one answer the check can read
        result = {"error": f"{type(exc).__name__}: {exc}".strip()}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

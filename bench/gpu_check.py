"""The GPU check before the job (podagent/run/gpu_check.py), on this host's GPUs: its
seconds per pod, and whether what it measures is what the GPU does.

    python bench/gpu_check.py --runs 3            # a host with NVIDIA GPUs, torch with CUDA

For a pod of one GPU (CUDA_VISIBLE_DEVICES=0) and one of every GPU of the host, `--runs` times
each: the whole check as a pod runs it (PODAGENT_GPU_CHECK=full: nvidia-smi, then the probe's
child process: torch's import, CUDA's start, each GPU's BF16 matmul, the all-reduce) and
PODAGENT_GPU_CHECK=smi alone; the matmul figures it reports; and, as the baseline in the same
run, the same BF16 matmul timed in this process with the same size and rounds, after its own
warm-up (probe / baseline: 1.0 means the check measures what the GPU does). Prints a table and
the rated fraction each GPU reached (PODAGENT_GPU_MIN_SPEED is 0.5). Exit 0 when every check
passed.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from podagent import config  # noqa: E402
from podagent.report import Reporter  # noqa: E402
from podagent.run import gpu_check, gpu_probe  # noqa: E402
from podagent.waiting import Signals  # noqa: E402
from tests.harness.benchkit import fmt, median, table  # noqa: E402


def baseline_tflops(index: int) -> float:
    """The probe's matmul, in this process (the GPU warm already from the check)."""
    import torch

    device = torch.device("cuda", index)
    torch.cuda.set_device(index)
    return gpu_probe._matmul_tflops(torch, device, "cuda")


def one_check(mode: str, visible: str | None, count: int, log_dir: Path) -> tuple[float, dict]:
    env = {**os.environ, "PODAGENT_GPU_CHECK": mode, "RUNPOD_GPU_COUNT": str(count),
           "PODAGENT_LOG_DIR": str(log_dir)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    settings = config.build({}, env)
    probe_env = {k: v for k, v in env.items()}
    reporter = Reporter("worker", "bench", None, stream=io.StringIO())
    began = time.monotonic()
    verdict = gpu_check.check(settings, reporter, Signals(), probe_env)
    seconds = time.monotonic() - began
    assert verdict is not None
    return seconds, verdict.figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/podagent-gpu-check"))
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device: this bench needs NVIDIA GPUs")
        return 2
    name = torch.cuda.get_device_name(0)
    peak = gpu_check.peak_of(name)
    rows = []
    failed = 0
    for label, visible, count in (("1 GPU", "0", 1), (f"{gpus} GPUs", None, gpus)):
        full, smi, tflops, busbw = [], [], [], []
        for _ in range(args.runs):
            try:
                seconds, figures = one_check("full", visible, count, args.out)
                full.append(seconds)
                tflops += figures.get("tflops", [])
                busbw += figures.get("allreduce_busbw_gbs", [])
                seconds, _ = one_check("smi", visible, count, args.out)
                smi.append(seconds)
            except Exception as exc:  # a failed check is a result: said, counted
                failed += 1
                print(f"{label}: the check failed: {exc}")
        base = baseline_tflops(0)
        rows.append([label, fmt(median(full)) if full else "—",
                     f"{min(full):.1f}–{max(full):.1f}" if full else "—",
                     fmt(median(smi)) if smi else "—",
                     f"{statistics.median(tflops):.0f}" if tflops else "—",
                     f"{base:.0f}",
                     f"{statistics.median(tflops) / base:.2f}" if tflops else "—",
                     f"{statistics.median(tflops) / peak:.2f}" if tflops and peak else "—",
                     f"{statistics.median(busbw):.0f}" if busbw else "—"])
    print(f"\nThe GPU check on {gpus} × {name} (rated {peak or '?'} TFLOPS dense BF16), "
          f"{args.runs} run(s) each, torch {torch.__version__}\n")
    print(table(["pod", "check s (full)", "range s", "check s (smi)", "probe TFLOPS",
                 "in-process TFLOPS", "probe / in-process", "of rated", "all-reduce busbw GB/s"],
                rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

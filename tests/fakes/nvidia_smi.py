"""A stand-in for `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` on machines
without NVIDIA GPUs: it answers for the GPUs a spec file describes, so that podagent's GPU check
meets a GPU with errors, a missing one, another type, an old driver or a stuck one.

    install(bin_dir, spec)   writes bin_dir/nvidia-smi, which runs this file with `spec`

The spec (JSON): {"gpus": [{"name", "uuid", "memory_used", "ecc", "retire_pending",
"remap_pending", "remap_failed"}, ...], "mode": "ok" | "nvml-error" | "old-driver" | "hang" |
"raw" (prints the bytes of "raw_hex" whatever was asked),
"bad_once": {GPU fields}, "bad_role": "worker" | "head"}: with bad_once, the first pod of that
role (a worker: RAY_WORKER=1, the default) that runs it claims it, and every later call on that
pod (by RUNPOD_POD_ID) sees its first GPU so; every other pod sees the GPUs as they are.
Answers as nvidia-smi words its own: unknown fields exit 2 with "is not a valid field to
query"; an error field a GPU does not report is [N/A].
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ERROR_FIELDS = {"ecc.errors.uncorrected.volatile.total": "ecc",
                "retired_pages.pending": "retire_pending",
                "remapped_rows.pending": "remap_pending",
                "remapped_rows.failure": "remap_failed"}
BASIC = {"index", "name", "uuid", "memory.used"}


def install(bin_dir: Path, spec: dict) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    spec_file = bin_dir / "nvidia-smi.json"
    spec_file.write_text(json.dumps(spec))
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "
                      f"--spec {spec_file} \"$@\"\n")
    script.chmod(0o755)
    return script


def _cell(gpu: dict, field: str, index: int) -> str:
    if field == "index":
        return str(index)
    if field == "name":
        return gpu.get("name", "NVIDIA H100 80GB HBM3")
    if field == "uuid":
        return gpu.get("uuid", f"GPU-0000000{index}-standin")
    if field == "memory.used":
        return str(gpu.get("memory_used", 0))
    value = gpu.get(ERROR_FIELDS[field])
    if value is None:
        return "[N/A]"
    if isinstance(value, bool):
        return "Yes" if value else "No"
    return str(value)


def _bad_here(spec_file: Path, spec: dict) -> dict | None:
    """This pod's first GPU's faults, when it claimed bad_once (or did before)."""
    if not spec.get("bad_once"):
        return None
    pod = os.environ.get("RUNPOD_POD_ID", "")
    claimed = spec_file.with_name("claimed")
    try:
        if claimed.read_text() == pod:
            return spec["bad_once"]
        return None
    except FileNotFoundError:
        pass
    worker = os.environ.get("RAY_WORKER") == "1"
    if worker != (spec.get("bad_role", "worker") == "worker") or not pod:
        return None
    try:  # the first worker to get here has it: creating the file claims it, once
        with open(claimed, "x") as f:
            f.write(pod)
    except FileExistsError:
        return None
    return spec["bad_once"]


def main(argv: list[str]) -> int:
    spec_file = Path(argv[argv.index("--spec") + 1])
    spec = json.loads(spec_file.read_text())
    mode = spec.get("mode", "ok")
    if mode == "hang":
        time.sleep(3600)
    if mode == "nvml-error":
        print("Failed to initialize NVML: Driver/library version mismatch")
        return 18
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), "")
    fields = query.split(",")
    known = BASIC | (set() if mode == "old-driver" else set(ERROR_FIELDS))
    for field in fields:
        if field not in known:
            print(f'Field "{field}" is not a valid field to query.')
            return 2
    if mode == "raw":  # a stranger's bytes, as they are
        sys.stdout.buffer.write(bytes.fromhex(spec["raw_hex"]))
        return 0
    gpus = [dict(g) for g in spec.get("gpus", [{}])]
    bad = _bad_here(spec_file, spec)
    if bad and gpus:
        gpus[0].update(bad)
    for index, gpu in enumerate(gpus):
        print(", ".join(_cell(gpu, field, index) for field in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The GPU check every pod runs before its run's job (PODAGENT_GPU_CHECK): a GPU with errors,
a slow one, a missing one or the wrong type is found in seconds at the start, not by NCCL or
the trainer hours in.

    smi:  nvidia-smi's facts of every GPU: as many as the pod was given (RUNPOD_GPU_COUNT), of
          the type asked for (PODAGENT_GPU_TYPE, which `podagent up` sets), no uncorrected ECC
          error since the driver loaded, no page waiting to be retired, no row remapping
          pending or failed.
    full: those, then a child process (run/gpu_probe.py) measures each GPU's BF16 matmul
          against its type's rated dense BF16 throughput (PEAK_TFLOPS) and its siblings, and
          reduces across the pod's GPUs with the sums checked.

A GPU that fails raises GpuCheckFailed (exit 28): the pod stops itself rather than being
started again on the same GPUs, and `podagent up` replaces it (--replacements). The policy
(`judge_smi`, `judge_probe`) is pure functions of what nvidia-smi and the probe said; the
mechanism (running them, within deadlines: `look`, `run_probe`) is apart.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podagent.config import Settings
from podagent.errors import GpuCheckFailed
from podagent.platform.pod import detect_gpus
from podagent.process import ManagedProcess
from podagent.report import Reporter
from podagent.waiting import Signals
from podagent.wire import Event

SMI_TIMEOUT = 30.0  # nvidia-smi can take seconds per GPU when persistence mode is off
PROBE_TIMEOUT = 240.0  # torch's import, CUDA's start and NCCL's rings on 8 GPUs, with room
WAIT_TICK = 0.5  # how often the wait for the probe looks for a signal
STOP_GRACE = 5.0  # a probe stopped gets this long after SIGTERM
PROBE_LOG = "gpu_probe.log"  # in the run's directory on this pod
# Fields of `nvidia-smi --query-gpu` (`nvidia-smi --help-query-gpu`). An older driver that
# lacks the error fields is asked for the first four alone.
BASIC_FIELDS = ("index", "name", "uuid", "memory.used")
ERROR_FIELDS = ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                "remapped_rows.pending", "remapped_rows.failure")
# A GPU using this much memory already runs something (a job re-attached to): measuring its
# speed would measure the job, and an all-reduce beside it could run it out of memory.
BUSY_MIB = 2048
MAX_ROWS = 64  # more GPUs than any machine has: nvidia-smi's answer is nonsense
# Among a pod's GPUs, one this far below their median is slow whatever its type.
SIBLING_FRACTION = 0.75

# The vendors' rated dense BF16 tensor throughput (TFLOPS, no sparsity) by nvidia-smi's name
# of the GPU. A GPU of a type not listed is measured and compared with its siblings only.
PEAK_TFLOPS: Mapping[str, float] = {
    "NVIDIA B200": 2250.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L4": 121.0,
    "NVIDIA RTX 6000 Ada Generation": 364.0,
    "NVIDIA RTX A6000": 155.0,
    "NVIDIA A40": 150.0,
    "NVIDIA GeForce RTX 4090": 165.0,
}


_MIG = re.compile(r"\s+MIG\s+\S+\s*$", re.IGNORECASE)  # "... MIG 1g.24gb": a slice of the GPU


def is_mig(name: str) -> bool:
    return bool(_MIG.search(name))


def same_gpu(a: str, b: str) -> bool:
    """Whether two names are one GPU type: RunPod's catalog ids are nvidia-smi's names, but
    spacing, case and the vendor's name are not worth failing a pod over; a MIG slice's type
    (RunPod's "<GPU> MIG 1g.24gb") is its GPU's, which is what nvidia-smi names."""
    def norm(name: str) -> str:
        return re.sub(r"[^a-z0-9]", "", _MIG.sub("", name).lower()).removeprefix("nvidia")
    return norm(a) == norm(b)


def peak_of(name: str) -> float | None:
    return next((peak for model, peak in PEAK_TFLOPS.items() if same_gpu(model, name)), None)


# --- what was seen ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as nvidia-smi lists it; None: the driver does not tell (N/A, not supported)."""
    index: int
    name: str
    uuid: str
    memory_used_mib: int | None = None
    ecc_uncorrected: int | None = None
    retire_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _yes(text: str) -> bool | None:
    return {"yes": True, "no": False}.get(text.lower())


def parse_smi(text: str, with_errors: bool) -> tuple[SmiGpu, ...]:
    """`--query-gpu=BASIC_FIELDS[,ERROR_FIELDS] --format=csv,noheader,nounits` lines."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        want = len(BASIC_FIELDS) + (len(ERROR_FIELDS) if with_errors else 0)
        if len(cells) != want:
            raise ValueError(f"nvidia-smi gave {len(cells)} field(s) where {want} were asked "
                             f"for: {line.strip()[:200]!r}")
        if len(gpus) == MAX_ROWS:
            raise ValueError(f"nvidia-smi listed more than {MAX_ROWS} GPUs")
        index, name, uuid, used = cells[:4]
        errors = cells[4:] if with_errors else ["", "", "", ""]
        gpus.append(SmiGpu(_number(index) if _number(index) is not None else len(gpus), name,
                           uuid, _number(used), _number(errors[0]), _yes(errors[1]),
                           _yes(errors[2]), _yes(errors[3])))
    return tuple(gpus)


@dataclass(frozen=True)
class Sighting:
    """What nvidia-smi said: the GPUs, or why it could not say."""
    gpus: tuple[SmiGpu, ...] = ()
    errors_known: bool = False  # the driver answered the error fields
    failure: str = ""  # nvidia-smi absent, failing or not answering


def look(timeout: float = SMI_TIMEOUT) -> Sighting:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Sighting(failure="nvidia-smi is not on PATH (the NVIDIA driver's tools are "
                                "missing from the container)")
    last = ""
    for fields in (BASIC_FIELDS + ERROR_FIELDS, BASIC_FIELDS):
        argv = [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        try:
            # A stranger's bytes may not be UTF-8: a name replaced, never a crash.
            done = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                                  timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            return Sighting(failure=f"nvidia-smi did not answer within {timeout:g} s (a GPU "
                                    f"or its driver is stuck)")
        except OSError as exc:
            return Sighting(failure=f"nvidia-smi could not run: {exc}")
        if done.returncode == 0:
            try:
                return Sighting(parse_smi(done.stdout, fields != BASIC_FIELDS),
                                errors_known=fields != BASIC_FIELDS)
            except ValueError as exc:
                return Sighting(failure=str(exc))
        said = (done.stdout + done.stderr).strip().splitlines()
        last = f"nvidia-smi exited {done.returncode}: {said[-1] if said else 'no output'}"
        if "not a valid field" not in last.lower():
            break  # e.g. "Failed to initialize NVML": the basic query would fail too
    return Sighting(failure=last)


@dataclass(frozen=True)
class Probe:
    """What run/gpu_probe.py measured: per rank (GPU) its TFLOPS and the all-reduce."""
    ranks: tuple[Mapping[str, Any], ...] = ()
    seconds: float = 0.0
    failure: str = ""  # the probe could not run or answer, or the GPUs could not be used
    skipped: str = ""  # nothing measured for a cause that is not the GPUs' (no torch)


def run_probe(env: Mapping[str, str], log: Path, signals: Signals,
              timeout: float = PROBE_TIMEOUT, argv_tail: Sequence[str] = ()) -> Probe:
    """The probe in a session of its own, its output in `log`; stopped (TERM, then KILL)
    at the deadline or on a signal (which then ends the check)."""
    began = time.monotonic()
    work = tempfile.mkdtemp(prefix="podagent-gpu-probe-")  # removed however the probe ends
    probe = ManagedProcess("gpu-probe", [sys.executable, "-m", "podagent.run.gpu_probe",
                                         "--work", work, *argv_tail], env, log)
    offset = log.stat().st_size if log.exists() else 0  # an earlier start's lines stay
    try:
        try:
            probe.start()
        except OSError as exc:  # its log cannot be opened (a full or read-only volume)
            return Probe(skipped=f"the GPU probe could not start ({exc})")
        while (code := probe.wait(WAIT_TICK)) is None:
            signals.check()
            if time.monotonic() - began > timeout:
                probe.stop(STOP_GRACE)
                return Probe(failure=f"the GPU probe did not finish within {timeout:g} s (a "
                                     f"GPU or the all-reduce hung); it was stopped")
    finally:
        probe.stop(STOP_GRACE)
        shutil.rmtree(work, ignore_errors=True)
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    said: Any = None
    with contextlib.suppress(ValueError):
        said = json.loads(next((x for x in reversed(lines) if x.startswith("{")), ""))
    if not isinstance(said, dict):
        tail = lines[-1].strip() if lines else "no output"
        return Probe(failure=f"the GPU probe exited {code} without its result: {tail} "
                             f"(its log: {log})")
    if said.get("error") and said.get("kind") == "no-torch":
        return Probe(skipped=str(said["error"]))
    if said.get("error"):
        return Probe(failure=f"the GPU probe failed: {said['error']}")
    ranks = said.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        return Probe(failure="the GPU probe's result has no ranks")
    return Probe(tuple(ranks), time.monotonic() - began)


# --- the policy ---------------------------------------------------------------------------------


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


def judge_smi(seen: Sighting, expected: int, expected_how: str, gpu_type: str,
              verdict: Verdict) -> None:
    if seen.failure:
        verdict.failures.append(f"{expected} GPU(s) expected ({expected_how}) but "
                                f"{seen.failure}")
        return
    gpus = seen.gpus
    verdict.figures["gpus"] = [g.name for g in gpus]
    distinct = len({g.uuid or f"#{g.index}" for g in gpus})  # a GPU listed twice is one
    if distinct < expected:
        verdict.failures.append(f"{distinct} GPU(s) visible to nvidia-smi, {expected} "
                                f"expected ({expected_how})")
    if gpu_type:
        wrong = sorted({g.name for g in gpus if not same_gpu(g.name, gpu_type)})
        if wrong:
            verdict.failures.append(f"GPU type {', '.join(wrong)} where {gpu_type} was asked "
                                    f"for (PODAGENT_GPU_TYPE)")
    if not seen.errors_known:
        verdict.notes.append("this driver's nvidia-smi does not report ECC errors or "
                             "retired/remapped memory: not checked")
    for g in gpus:
        label = f"GPU {g.index} ({g.uuid or g.name})"
        if g.ecc_uncorrected:
            verdict.failures.append(f"{label}: {g.ecc_uncorrected} uncorrected ECC error(s) "
                                    f"since the driver loaded")
        if g.retire_pending:
            verdict.failures.append(f"{label}: a memory page is waiting to be retired (it "
                                    f"needs a GPU reset)")
        if g.remap_failed:
            verdict.failures.append(f"{label}: a row remapping failed (the GPU needs "
                                    f"servicing)")
        elif g.remap_pending:
            verdict.failures.append(f"{label}: a row remapping is pending (it needs a GPU "
                                    f"reset)")


def busy(seen: Sighting) -> list[int]:
    return [g.index for g in seen.gpus
            if g.memory_used_mib is not None and g.memory_used_mib >= BUSY_MIB]


def judge_probe(probe: Probe, names: Sequence[str], min_fraction: float,
                verdict: Verdict, rated: bool = True) -> None:
    """`rated`: each GPU is held to its type's rating too (not a MIG slice: a share of it)."""
    if probe.failure:
        verdict.failures.append(probe.failure)
        return
    if probe.skipped:
        verdict.notes.append(f"{probe.skipped}: speed and all-reduce not measured (the "
                             f"image's torch, not the GPUs; the job will meet it too)")
        return
    verdict.figures["probe_s"] = round(probe.seconds, 1)
    speeds: dict[int, float] = {}
    for rank in probe.ranks:
        index = rank.get("rank", "?")
        if rank.get("error"):
            verdict.failures.append(f"GPU {index}: {rank['error']}")
            continue
        tflops = rank.get("tflops")
        if isinstance(tflops, (int, float)) and isinstance(index, int):
            speeds[index] = float(tflops)
        reduce = rank.get("reduce")
        if isinstance(reduce, dict) and not reduce.get("ok"):
            verdict.failures.append(f"GPU {index}: the all-reduce across the pod's GPUs gave "
                                    f"{reduce.get('wrong')} wrong element(s)")
        if isinstance(reduce, dict) and isinstance(reduce.get("busbw_gbs"), (int, float)):
            verdict.figures.setdefault("allreduce_busbw_gbs", []).append(
                round(float(reduce["busbw_gbs"]), 1))
    verdict.figures["tflops"] = [round(speeds[i], 1) for i in sorted(speeds)]
    if not speeds:
        return
    middle = statistics.median(speeds.values())
    for index, tflops in sorted(speeds.items()):
        name = names[index] if index < len(names) else (
            str(probe.ranks[index].get("name", "")) if index < len(probe.ranks) else "")
        peak = peak_of(name) if name and rated else None
        if peak is not None and tflops < min_fraction * peak:
            verdict.failures.append(
                f"GPU {index} ({name}): {tflops:.0f} TFLOPS in a BF16 matmul, below "
                f"{min_fraction:g} of its type's rated {peak:.0f} (PODAGENT_GPU_MIN_SPEED)")
        elif len(speeds) > 1 and tflops < SIBLING_FRACTION * middle:
            verdict.failures.append(
                f"GPU {index}: {tflops:.0f} TFLOPS in a BF16 matmul, below {SIBLING_FRACTION:g}"
                f" of its siblings' median {middle:.0f}")
        elif peak is None and name and rated:
            verdict.notes.append(f"no rated throughput known for {name}: its speed is "
                                 f"compared with its siblings only")
        elif not rated:
            verdict.notes.append("a MIG slice: its speed is compared with its siblings only")
    verdict.notes[:] = list(dict.fromkeys(verdict.notes))


# --- the mechanism ------------------------------------------------------------------------------


def expected_gpus(settings: Settings, offered: int, offered_how: str) -> tuple[int, str]:
    """How many GPUs the pod should have: what RunPod was asked for, else what Ray is
    offered."""
    count = settings.environ.get("RUNPOD_GPU_COUNT", "")
    return (int(count), "RUNPOD_GPU_COUNT") if count.isdigit() else (offered, offered_how)


def check(settings: Settings, reporter: Reporter, signals: Signals,
          env: Mapping[str, str]) -> Verdict | None:
    """This pod's GPUs checked as PODAGENT_GPU_CHECK says; raises GpuCheckFailed. None: no
    check (it is off, or the pod has no GPUs). `env`: the probe's environment (the pod's
    NCCL preset in it)."""
    mode = settings.gpu_check
    offered, how = detect_gpus(settings)
    if mode == "off" or offered == 0:
        return None
    began = time.monotonic()
    expected, expected_how = expected_gpus(settings, offered, how)
    verdict = Verdict()
    seen = look()
    judge_smi(seen, expected, expected_how, settings.gpu_type, verdict)
    if mode == "full" and verdict.ok:
        taken = busy(seen)
        if taken:
            verdict.notes.append(f"GPU(s) {', '.join(map(str, taken))} already hold "
                                 f"{BUSY_MIB} MiB or more (a job runs): speed and all-reduce "
                                 f"not measured")
        else:
            probe = run_probe(env, settings.run_dir / PROBE_LOG, signals)
            judge_probe(probe, [g.name for g in seen.gpus], settings.gpu_min_speed, verdict,
                        rated=not is_mig(settings.gpu_type))
    seconds = time.monotonic() - began
    reporter.event(Event.GPU_CHECK, ok=verdict.ok, mode=mode, seconds=round(seconds, 1),
                   failures=verdict.failures, notes=verdict.notes, **verdict.figures)
    for note in verdict.notes:
        reporter.say(f"GPU check: {note}")
    if not verdict.ok:
        raise GpuCheckFailed("; ".join(verdict.failures))
    speeds = verdict.figures.get("tflops")
    measured = f", BF16 matmul {'/'.join(f'{t:.0f}' for t in speeds)} TFLOPS" if speeds else ""
    reduced = verdict.figures.get("allreduce_busbw_gbs")
    if reduced:
        measured += f", all-reduce {min(reduced):.0f} GB/s bus bandwidth"
    reporter.say(f"GPU check ({mode}) passed in {seconds:.1f} s: {len(seen.gpus)} × "
                 f"{', '.join(sorted(set(verdict.figures.get('gpus', []))))}{measured}")
    return verdict

"""K pods on one host, one GPU each: the real podagent head and K-1 workers, the cluster check
across K ranks over NCCL sockets, and a raw torch.distributed all_reduce across the same K GPUs
as the reference, run before and after the cluster.

Each pod is a network namespace holding one GPU, attached to one Linux bridge by a veth whose
pod end is named podnet1 (the RunPod Global Networking interface), so the runpod-global preset
applies as on RunPod. NCCL_P2P_DISABLE/NCCL_SHM_DISABLE make NCCL treat the GPUs as separate
machines (on one host it would otherwise use NVLink across the namespaces); they are the pods'
own variables, so podagent keeps them. NVLink multicast is off in every process.

    python bench/gpu_pods.py --pods 2,4,8        # root, K GPUs, torch, Ray, pyroute2
    python bench/gpu_pods.py --cpu --pods 3      # the same flow with gloo, without GPUs

With GPUs, K is at most the host's GPU count; with --cpu (gloo), any K. Every run gets a fresh
network: the raw all_reduce, the cluster (bring-up, the check with its DDP step, the end), the
raw all_reduce again. Prints each run's check and a line, then medians per K: busbw of the check
and of the raw all_reduce, check / best raw, bring-up time, the check's wall time. Exit 0 when
every run passed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import benchkit  # noqa: E402
from tests.harness.benchkit import RunFailed, fmt, last_lines, median, reason_line  # noqa: E402

PREFIX = "gp"  # namespaces gp0, gp1, ...: the tests' pods are "pa...", other benches' "pb"/"sc"
BRIDGE = f"{PREFIX}br"
SUBNET = "10.79.0"  # a /24 of its own
IFNAME = "podnet1"
RUN_NAME = "gpu-pods"
RAW_PORT = 29577
# Never let NCCL use NVLink multicast on a shared host (it can take the GPUs down).
SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}
AS_SEPARATE_MACHINES = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
GPU_SIZE, CPU_SIZE = 256 << 20, 16 << 20  # the check's largest payload on each
TARGET_RATIO = 0.90

ENTER = """
import ctypes, os, sys
fd = os.open(f"/var/run/netns/{sys.argv[1]}", os.O_RDONLY)
if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
    raise OSError(ctypes.get_errno(), "setns")
os.execvp(sys.argv[2], sys.argv[2:])
"""

RAW = """
import datetime, json, sys
import torch, torch.distributed as dist
from podagent.checks import collectives
rank, world, backend, master, size = sys.argv[1:6]
rank, world = int(rank), int(world)
if backend == "nccl":
    torch.cuda.set_device(0)
dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
bw = collectives.measure_all_reduce(int(size), world, backend)
dist.destroy_process_group()
if rank == 0:
    print("RAW " + json.dumps(bw.as_dict()), flush=True)
"""


def pod_name(i: int) -> str:
    return f"{PREFIX}{i}"


def pod_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


# --- the pods ------------------------------------------------------------------------------------


def make_network(k: int) -> None:
    """K namespaces on one bridge, each with its veth end named podnet1 and its own address.
    pyroute2, not `ip`: GPU hosts may lack iproute2."""
    from pyroute2 import IPRoute

    remove_network()  # what an interrupted run left
    with IPRoute() as ipr:
        # Bridged frames skip iptables: a host whose FORWARD policy drops would cut the pods off.
        ipr.link("add", ifname=BRIDGE, kind="bridge", br_nf_call_iptables=0)
        bridge = ipr.link_lookup(ifname=BRIDGE)[0]
        ipr.link("set", index=bridge, state="up")
    for i in range(k):
        add_pod(i)


def add_pod(i: int) -> None:
    """Pod i on the existing bridge: its namespace, its veth end named podnet1, its address
    (bench/gpu_replace.py adds a new host this way in place of a lost one)."""
    from pyroute2 import IPRoute, NetNS, netns

    name = pod_name(i)
    with IPRoute() as ipr:
        bridge = ipr.link_lookup(ifname=BRIDGE)[0]
        netns.create(name)
        ipr.link("add", ifname=f"{name}h", kind="veth", peer=f"{name}p")
        ipr.link("set", index=ipr.link_lookup(ifname=f"{name}p")[0], net_ns_fd=name)
        ipr.link("set", index=ipr.link_lookup(ifname=f"{name}h")[0], master=bridge,
                 state="up")
    with NetNS(name) as ns:
        index = ns.link_lookup(ifname=f"{name}p")[0]
        ns.link("set", index=index, ifname=IFNAME)
        ns.addr("add", index=index, address=pod_ip(i), prefixlen=24)
        ns.link("set", index=index, state="up")
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")


def pod_pids(name: str) -> list[int]:
    """Every process whose network namespace is the pod's (what `ip netns pids` reads)."""
    try:
        target = os.stat(f"/var/run/netns/{name}")
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue  # gone meanwhile
            if (ns.st_dev, ns.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry))
    return pids


def kill_pod(name: str, timeout: float = 10.0) -> None:
    """SIGKILL every process of the pod, and only those: never `ray stop`, which would stop
    every Ray on the machine."""
    deadline = time.monotonic() + timeout
    while pids := pod_pids(name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of pod {name} outlived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def remove_network() -> None:
    from pyroute2 import IPRoute, netns

    pods = [n for n in netns.listnetns() if re.fullmatch(rf"{PREFIX}\d+", n)]
    for name in pods:
        kill_pod(name)
    with IPRoute() as ipr:
        # The host ends first: a namespace's removal frees its veths only later, asynchronously.
        for ifname in [f"{name}h" for name in pods] + [BRIDGE]:
            for index in ipr.link_lookup(ifname=ifname):
                ipr.link("del", index=index)
    for name in pods:
        netns.remove(name)
        shutil.rmtree(ray_temp(name), ignore_errors=True)


def ray_temp(name: str) -> str:
    return f"/tmp/ray-{name}"  # short: Ray's socket paths must fit 107 bytes


def in_pod(name: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ENTER, name, *argv], env=env,
                            start_new_session=True, **kwargs)


def pod_env(i: int, cpu: bool, logs: Path, extra: dict[str, str] | None = None
            ) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PODAGENT_", "RAY_ADDRESS", "NCCL_", "GLOO_"))}
    env.update(SAFE)
    env.update(AS_SEPARATE_MACHINES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = "" if cpu else str(i)
    env["PODAGENT_NUM_GPUS"] = "0" if cpu else "1"
    env.update(PODAGENT_NCCL_PRESET="runpod-global", PODAGENT_REWARD="none",
               PODAGENT_RUN_NAME=RUN_NAME, PODAGENT_LOG_DIR=str(logs / pod_name(i)),
               PODAGENT_RAY_TEMP_DIR=ray_temp(pod_name(i)), PODAGENT_AFTER_RUN="exit",
               **(extra or {}))
    return env


# --- one run ------------------------------------------------------------------------------------


@dataclass
class Run(benchkit.RunRecord):
    # seconds: the check's busbw here (benchkit's figure field)
    pods: int
    index: int
    raw_before: float | None = None  # busbw, GB/s
    raw_after: float | None = None
    transport: list[str] = field(default_factory=list)
    bringup_s: float | None = None  # all pods started → the head has every worker
    check_wall_s: float | None = None  # the check job submitted → finished
    check_s: float | None = None  # the check's own time, as it prints it
    ddp: dict[str, Any] | None = None
    check_lines: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        raws = [b for b in (self.raw_before, self.raw_after) if b]
        return self.seconds / max(raws) if self.seconds and raws else None


def raw_all_reduce(k: int, cpu: bool, envs: list[dict[str, str]], size: int) -> float:
    """The check's all_reduce in plain processes, one per pod, under each pod's environment
    as podagent gives it; the busbw, GB/s."""
    backend = "gloo" if cpu else "nccl"
    procs = [in_pod(pod_name(i), [sys.executable, "-c", RAW, str(i), str(k), backend,
                                  f"{pod_ip(0)}:{RAW_PORT}", str(size)], envs[i],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(k)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        if p.returncode:
            raise RunFailed(f"raw all_reduce failed ({p.returncode}): {reason_line(out)}",
                            last_lines(out))
    (line,) = [x for x in outputs[0].splitlines() if x.startswith("RAW ")]
    return json.loads(line[4:])["busbw"]


def exported_env(env: dict[str, str]) -> dict[str, str]:
    """env plus what podagent would apply (`podagent env --export`), env winning."""
    exported = subprocess.run([sys.executable, "-m", "podagent", "env", "--export"], env=env,
                              capture_output=True, text=True, check=True).stdout
    full = dict(env)
    for key, value in re.findall(r"^export (\w+)=(.*)$", exported, re.M):
        full.setdefault(key, value.strip("'"))
    return full


def run_cluster(run: Run, cpu: bool, logs: Path, timeout: float) -> None:
    k = run.pods
    head_env = pod_env(0, cpu, logs, {"EXPECTED_WORKERS": str(k - 1)})
    if cpu:
        head_env["PODAGENT_CHECK_BACKEND"] = "gloo"
    outs = [open(logs / f"{pod_name(i)}.out", "w") for i in range(k)]
    t0 = time.time()
    procs = [in_pod(pod_name(0), [sys.executable, "-m", "podagent", "head"], head_env,
                    stdout=outs[0], stderr=subprocess.STDOUT)]
    procs += [in_pod(pod_name(i), [sys.executable, "-m", "podagent", "worker"],
                     pod_env(i, cpu, logs, {"PODAGENT_HEAD_ADDR": pod_ip(0)}),
                     stdout=outs[i], stderr=subprocess.STDOUT) for i in range(1, k)]
    try:
        procs[0].wait(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass  # said below, by the exit codes
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for out in outs:
            out.close()
    run.exit_codes = {pod_name(i): p.returncode for i, p in enumerate(procs)}
    text = (logs / f"{pod_name(0)}.out").read_text()
    run.check_lines = [x for x in text.splitlines() if x.startswith("check:")]
    events = benchkit.pod_events(logs / pod_name(0) / RUN_NAME)
    records = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    ts = {r["event"]: r["ts"] for r in records if r.get("result", "ok") == "ok"}
    summary = next((r for r in reversed(records) if r["event"] == "check"), {})
    if "workers_joined" in ts:
        run.bringup_s = round(ts["workers_joined"] - t0, 2)
    if "job_submitted" in ts and "job_finished" in ts:
        run.check_wall_s = round(ts["job_finished"] - ts["job_submitted"], 2)
    run.seconds, run.check_s = summary.get("busbw"), summary.get("seconds")
    run.transport, run.ddp = summary.get("transport", []), summary.get("ddp_step")
    if any(code != 0 for code in run.exit_codes.values()):
        raise RunFailed(f"exit codes {run.exit_codes}: {reason_line(text)}", last_lines(text))
    if not summary.get("passed") or not (run.ddp or {}).get("ok"):
        raise RunFailed(f"the check did not pass: {summary.get('failures')}", last_lines(text))


def one_run(run: Run, logs: Path, cpu: bool, timeout: float) -> None:
    k = run.pods
    size = CPU_SIZE if cpu else GPU_SIZE
    make_network(k)
    try:
        envs = [exported_env(pod_env(i, cpu, logs)) for i in range(k)]
        run.raw_before = raw_all_reduce(k, cpu, envs, size)
        run_cluster(run, cpu, logs, timeout)
        run.raw_after = raw_all_reduce(k, cpu, envs, size)
        run.ok = True
    finally:
        remove_network()
        for line in run.check_lines:
            print(f"    {line}", flush=True)


# --- driver and tables ---------------------------------------------------------------------------


def line(run: Run, total: int) -> str:
    figure = (f"check {fmt(run.seconds, 3)} / raw {fmt(run.raw_before, 3)}, "
              f"{fmt(run.raw_after, 3)} GB/s = {fmt(run.ratio)}; up {fmt(run.bringup_s, 1)} s, "
              f"check {fmt(run.check_wall_s, 1)} s")
    return benchkit.status_line(run, f"K={run.pods} run {run.index}/{total}", figure)


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    backend = "gloo on CPUs" if args.cpu else "NCCL, one GPU per pod"
    out = [f"### {args.host or meta['machine']}: K pods on one host ({meta['started']})", "",
           f"{backend}; {meta['machine']}; Ray {meta['ray']}, torch {meta['torch']}, podagent "
           f"{meta['podagent']} (commit {meta['commit']}); {args.runs} run(s) per K, medians; "
           f"all_reduce of {(CPU_SIZE if args.cpu else GPU_SIZE) >> 20} MiB.", ""]
    rows = []
    for k in args.pods:
        mine = [r for r in runs if r.pods == k and r.ok]
        if not mine:
            rows.append([str(k)] + ["-"] * 10 + [f"0/{args.runs}"])
            continue

        def mid(name: str, digits: int, runs: list[Run] = mine) -> str:
            return fmt(median([getattr(r, name) for r in runs if getattr(r, name) is not None]),
                       digits)

        ratio = median([r.ratio for r in mine if r.ratio is not None])
        transport = ", ".join(sorted({t for r in mine for t in r.transport})) or "?"
        step = max((r.ddp or {}).get("seconds") or 0.0 for r in mine)
        imported = max((r.ddp or {}).get("import_s") or 0.0 for r in mine)
        rows.append([str(k), transport, mid("seconds", 3), mid("raw_before", 3),
                     mid("raw_after", 3), fmt(ratio),
                     # The target is for NCCL on GPUs: gloo on a few CPUs measures the CPUs.
                     benchkit.verdict(None if ratio is None or args.cpu
                                      else ratio >= TARGET_RATIO),
                     mid("bringup_s", 1), mid("check_wall_s", 1), mid("check_s", 1),
                     f"✓ {step:.2f} s (+{imported:.2f} s import)", f"{len(mine)}/{args.runs}"])
    out += [benchkit.table(["K", "transport", "check busbw GB/s", "raw before",
                            "raw after", "check / best raw", f"≥ {TARGET_RATIO:.2f}",
                            "bring-up s", "check wall s", "check itself s", "ddp step",
                            "runs passed"], rows), "",
            "bring-up: every pod started → the head has all K-1 workers (its `workers_joined` "
            "event); check wall: the check job submitted → finished; check itself: the time "
            "the check prints (from its ray.init on); ddp step: the slowest rank's, worst run, "
            "and DDP's one-time import of torch._dynamo before it.",
            ""]
    return benchkit.join_report(out, runs, label=lambda r: str(r.pods), what="K")


def gpu_count() -> int:
    devices = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    if devices:
        return len(devices)
    import torch  # a host whose device nodes are not named as usual

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=benchkit.parse_ints, default=[2],
                        help="pod counts K, e.g. 2,4,8 (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs per K (default 3)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPUs instead of GPUs")
    parser.add_argument("--host", default="", help="the host's name for the table's title")
    parser.add_argument("--run-timeout", type=float, default=300.0,
                        help="bound on each cluster's run in seconds (default 300)")
    parser.add_argument("--out", type=Path, default=benchkit.RESULTS,
                        help="results directory (default bench/results/, git-ignored)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (pods are network namespaces)")
    if min(args.pods) < 2:
        parser.error("K must be at least 2 (one head, one worker)")
    if not args.cpu and max(args.pods) > gpu_count():
        parser.error(f"one GPU per pod: K={max(args.pods)} needs {max(args.pods)} GPUs, this "
                     f"host has {gpu_count()}; --cpu runs any K")

    # Its pods are its own (pyroute2, no DNS), not the harness's: nothing of theirs to clean.
    outdir, meta = benchkit.begin(args.out, "gpu-pods-", clean=False)
    meta["torch"] = importlib.metadata.version("torch")

    def plan() -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
        for k in args.pods:
            for i in range(1, args.runs + 1):
                yield (Run(k, i), f"k{k}-r{i}",
                       lambda r, d: one_run(r, d, args.cpu, args.run_timeout))

    runs = benchkit.execute_all(plan(), outdir, lambda r: line(r, args.runs))
    benchkit.write_results(outdir, render(runs, args, meta), meta, args, runs)
    return 0 if runs and all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

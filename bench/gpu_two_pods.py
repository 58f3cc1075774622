"""Two pods on one 2-GPU host: the real podagent head and worker, the cluster check over NCCL
sockets, and a raw torch.distributed all_reduce between the same two GPUs as the reference.

Each "pod" is a network namespace holding one GPU, linked by a veth pair whose ends are both
named podnet1 (the RunPod Global Networking interface), so the runpod-global preset applies as
on RunPod. NCCL_P2P_DISABLE/NCCL_SHM_DISABLE make NCCL treat the two GPUs as two machines (on
one host it would otherwise use NVLink across the namespaces); they are the pods' own variables,
so podagent keeps them.

    python bench/gpu_two_pods.py            # needs root, 2 GPUs, torch, Ray 2.60, pyroute2
    python bench/gpu_two_pods.py --cpu      # the same flow with gloo, to try it without GPUs

Prints the check's output, then a table: transport, busbw of the check and of the raw
all_reduce (run before and after the check), and the ratio. Exit 0 when the check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACES = (("pa", "10.77.0.1"), ("pb", "10.77.0.2"))
IFNAME = "podnet1"
# Never let NCCL use NVLink multicast on a shared host (it can take the GPUs down).
SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}
AS_TWO_MACHINES = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
SIZE = 256 << 20

ENTER = """
import ctypes, os, sys
fd = os.open(f"/var/run/netns/{sys.argv[1]}", os.O_RDONLY)
if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
    raise OSError(ctypes.get_errno(), "setns")
os.execvp(sys.argv[2], sys.argv[2:])
"""

RAW = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from podagent.checks import collectives
rank, backend, master = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if backend == "nccl":
    torch.cuda.set_device(0)
dist.init_process_group(backend, init_method=f"tcp://{master}:29577", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
bw = collectives.measure_all_reduce(int(sys.argv[4]), 2, backend)
dist.destroy_process_group()
if rank == 0:
    print("RAW " + json.dumps(bw.as_dict()), flush=True)
"""


def make_namespaces() -> None:
    from pyroute2 import IPRoute, NetNS, netns

    for name, _ in NAMESPACES:
        if name in netns.listnetns():
            netns.remove(name)
        netns.create(name)
    with IPRoute() as ipr:
        ipr.link("add", ifname="vpa", kind="veth", peer="vpb")
        for dev, (name, _) in zip(("vpa", "vpb"), NAMESPACES, strict=True):
            ipr.link("set", index=ipr.link_lookup(ifname=dev)[0], net_ns_fd=name)
    for dev, (name, address) in zip(("vpa", "vpb"), NAMESPACES, strict=True):
        with NetNS(name) as ns:
            index = ns.link_lookup(ifname=dev)[0]
            ns.link("set", index=index, ifname=IFNAME)
            ns.addr("add", index=index, address=address, prefixlen=24)
            ns.link("set", index=index, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")


def remove_namespaces() -> None:
    from pyroute2 import netns

    for name, _ in NAMESPACES:
        if name in netns.listnetns():
            netns.remove(name)


def in_pod(name: str, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ENTER, name, *argv], env=env,
                            start_new_session=True, **kwargs)


def pod_env(gpu: int | None, tmp: Path, name: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PODAGENT_", "RAY_ADDRESS", "NCCL_", "GLOO_"))}
    env.update(SAFE)
    env.update(AS_TWO_MACHINES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)
    env["PODAGENT_NUM_GPUS"] = "0" if gpu is None else "1"
    env.update(PODAGENT_NCCL_PRESET="runpod-global", PODAGENT_REWARD="none",
               PODAGENT_RUN_NAME="gpu-two-pods", PODAGENT_LOG_DIR=str(tmp / "logs" / name),
               PODAGENT_RAY_TEMP_DIR=f"/tmp/ray-{name}", **extra)
    return env


def raw_reference(cpu: bool, tmp: Path, size: int) -> dict:
    """The same all_reduce between the same two devices, in plain processes, under the
    environment podagent gives each pod (`podagent env --export`)."""
    backend = "gloo" if cpu else "nccl"
    procs = []
    for rank, (name, _) in enumerate(NAMESPACES):
        env = pod_env(None if cpu else rank, tmp, name, {})
        exported = subprocess.run([sys.executable, "-m", "podagent", "env", "--export"],
                                  env=env, capture_output=True, text=True, check=True).stdout
        for key, value in re.findall(r"^export (\w+)=(.*)$", exported, re.M):
            env.setdefault(key, value.strip("'"))
        procs.append(in_pod(name, [sys.executable, "-c", RAW, str(rank), backend,
                                   NAMESPACES[0][1], str(size)], env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        if p.returncode:
            raise SystemExit(f"raw all_reduce failed ({p.returncode}):\n{out[-3000:]}")
    (line,) = [x for x in outputs[0].splitlines() if x.startswith("RAW ")]
    return json.loads(line[4:])


def run_cluster(cpu: bool, tmp: Path) -> tuple[int, str, dict]:
    head_env = pod_env(None if cpu else 0, tmp, "pa", {"EXPECTED_WORKERS": "1"})
    worker_env = pod_env(None if cpu else 1, tmp, "pb",
                         {"PODAGENT_HEAD_ADDR": NAMESPACES[0][1]})
    if cpu:
        head_env["PODAGENT_CHECK_BACKEND"] = "gloo"
    started = time.monotonic()
    out_head = open(tmp / "head.out", "w")
    out_worker = open(tmp / "worker.out", "w")
    head = in_pod("pa", [sys.executable, "-m", "podagent", "head"], head_env,
                  stdout=out_head, stderr=subprocess.STDOUT)
    worker = in_pod("pb", [sys.executable, "-m", "podagent", "worker"], worker_env,
                    stdout=out_worker, stderr=subprocess.STDOUT)
    try:
        code = head.wait(timeout=540)
        worker.wait(timeout=60)
    finally:
        for p in (head, worker):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
    print(f"cluster up, checked and down in {time.monotonic() - started:.1f} s "
          f"(head exit {code}, worker exit {worker.returncode})", flush=True)
    text = (tmp / "head.out").read_text()
    events = tmp / "logs" / "pa" / "gpu-two-pods" / "events.jsonl"
    summary = {}
    for line in events.read_text().splitlines() if events.exists() else []:
        record = json.loads(line)
        if record.get("event") == "check":
            summary = record
    return code, text, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPUs instead of GPUs")
    parser.add_argument("--out", default="gpu-two-pods", help="directory for logs")
    args = parser.parse_args()
    tmp = Path(args.out).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    size = (16 << 20) if args.cpu else SIZE
    make_namespaces()
    try:
        before = raw_reference(args.cpu, tmp, size)
        code, text, summary = run_cluster(args.cpu, tmp)
        after = raw_reference(args.cpu, tmp, size)
    finally:
        remove_namespaces()
    print("\n".join(line for line in text.splitlines()
                    if line.startswith(("check:", "[head]"))), flush=True)
    check_bw = summary.get("busbw")
    raw = max(before["busbw"], after["busbw"])
    rows = [
        ("transport (NCCL's report)", ", ".join(summary.get("transport", [])) or "?"),
        (f"check busbw, {size >> 20} MiB all_reduce", f"{check_bw:.3f} GB/s" if check_bw
         else "?"),
        ("raw busbw before the check", f"{before['busbw']:.3f} GB/s"),
        ("raw busbw after the check", f"{after['busbw']:.3f} GB/s"),
        ("check / best raw", f"{check_bw / raw:.2f}" if check_bw else "?"),
        ("check passed", str(summary.get("passed"))),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""What hostile input costs the parts a run without Ray and a reward function rely on.

1. The supervisor port (a run without Ray's head, `podagent torchrun/accelerate`): 1,000
   stranger connections attempted at once, each sending a first line it never finishes (up to
   --partial KiB), from --addresses loopback addresses; this podagent's hub against the one of
   --baseline (a git worktree), each in a child process of its own, in turn. Printed: the
   hub's memory growth (RSS, MiB), the connections it still holds 1 s and 8 s later, and
   whether a real worker still joins and a status question is answered while they are there.
2. The reward server (`--func`, a light rule, one sample per request as upstream OpenRLHF
   sends, --in-flight at once): samples/s with one hostile item in every 100 (in turn: raises,
   calls sys.exit(), returns NaN, returns 10**400, kills its worker) against none, same server
   settings, in turn; the ratio; whether every good item kept its reward.

    python bench/hostile.py [--baseline REF] [--samples 3000] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import reward_func as rf  # noqa: E402 (bench/reward_func.py: the workload, the client, the server)

from tests.harness.benchkit import table  # noqa: E402

BASELINE = "44b31a2"  # before the supervisor port bounded strangers
STRANGERS = 1000

# The hub in a child: it serves a rendezvous for one worker until told to stop (stdin closes).
HUB_CHILD = """
import io, queue, sys, threading, time
from podagent.gang import mesh
from podagent.report import Reporter
port = int(sys.argv[1])
rv = mesh.Rendezvous("bench", "127.0.0.1", port, workers=1)
hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), 30.0, "tok", Reporter("head", "b", None,
               stream=io.StringIO()), queue.Queue())
hub.status = lambda: {"run": "bench"}
print("listening", flush=True)
hub.gather(3600, lambda: None)
hub.start(lambda m: {"rank": m.rank})
print("formed", flush=True)
sys.stdin.read()
"""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _held(pid: int, port: int) -> int:
    """Established connections the hub process holds on its port."""
    import psutil

    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == "ESTABLISHED")


def supervisor(pythonpath: str, partial_kib: int, addresses: int) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    hub = subprocess.Popen([sys.executable, "-c", HUB_CHILD, str(port)], env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
    assert hub.stdout is not None and hub.stdout.readline().strip() == "listening"
    before = _rss_mib(hub.pid)
    held: list[socket.socket] = []
    chunk = b'{"ask": "status", "pad": "' + b"x" * (partial_kib * 1024)
    started = time.monotonic()
    for i in range(STRANGERS):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5,
                                         source_address=(f"127.0.1.{i % addresses + 1}", 0))
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.send(chunk)
            held.append(s)
        except OSError:
            pass
    took = time.monotonic() - started
    time.sleep(1.0)  # measuring, not readiness: what the hub holds a second later
    grown, one_s = _rss_mib(hub.pid) - before, _held(hub.pid, port)
    # A real worker joins and a question is answered with the strangers still there.
    joined = _worker_joins(port, pythonpath)
    time.sleep(max(0.0, 8.0 - (time.monotonic() - started)))
    eight_s = _held(hub.pid, port)
    peak = _rss_mib(hub.pid) - before
    for s in held:
        s.close()
    hub.stdin.close()  # type: ignore[union-attr]
    hub.wait(timeout=30)
    return {"grown_mib": round(max(grown, peak), 1), "held_1s": one_s, "held_8s": eight_s,
            "worker_joined": joined, "connect_s": round(took, 2)}


def _worker_joins(port: int, pythonpath: str) -> bool:
    code = textwrap.dedent(f"""
        import io, queue, time
        from podagent.gang import mesh
        from podagent.report import Reporter
        rv = mesh.Rendezvous("bench", "127.0.0.1", {port}, workers=1)
        link = mesh.Link(rv, mesh.Peer("10.9.9.9", "w"), 30.0, "tok",
                         Reporter("worker", "b", None, stream=io.StringIO()), queue.Queue())
        go = link.join(time.monotonic() + 20, 20, None, time.sleep)
        print("go" if go.get("rank") == 1 else "no")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "PYTHONPATH": pythonpath},
                             cwd="/")
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip().endswith("go")


def worktree(ref: str, root: Path) -> Path:
    path = root / f"podagent-{ref}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)
    return path


# --- the reward server ----------------------------------------------------------------------

HOSTILE_RULE = '''
import os, re, sys

def reward_func(queries, prompts, labels, **kwargs):
    q = queries[0]
    if q.startswith("HOSTILE-"):
        kind = q.split(":")[0][len("HOSTILE-"):]
        if kind == "raise":
            raise RuntimeError("hostile")
        if kind == "exit":
            sys.exit(1)
        if kind == "die":
            os._exit(1)
        return {"rewards": [{"nan": float("nan"), "huge": 10**400}[kind]]}
    found = re.findall(r"\\\\boxed\\{([^{}]*)\\}", q)
    right = bool(found) and found[-1].strip() == str(labels[0]).strip()
    return {"rewards": [1.0 if right else 0.0]}
'''
KINDS = ("raise", "exit", "nan", "huge", "die")


def reward_rate(rule: Path, samples: int, in_flight: int, hostile: bool,
                log: Path) -> dict[str, float]:
    items = rf.workload(samples, 1)
    if hostile:
        for n, i in enumerate(range(50, samples, 100)):
            query, prompt, label = items[i]
            items[i] = (f"HOSTILE-{KINDS[n % len(KINDS)]}:{query}", prompt, label)
    data = Path(tempfile.mkdtemp()) / "items.json"
    data.write_text(json.dumps(items))
    proc, url = rf.start_server(str(rule), 0, log)
    try:
        warm = Path(tempfile.mkdtemp()) / "warm.json"  # the workers' first items, untimed
        warm.write_text(json.dumps(rf.workload(200, 2)))
        subprocess.run([sys.executable, __file__, "--child", url, str(warm), str(in_flight)],
                       check=True, capture_output=True, cwd=REPO)
        out = subprocess.run([sys.executable, __file__, "--child", url, str(data),
                              str(in_flight)], check=True, capture_output=True, text=True,
                             cwd=REPO)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    expected = [1.0 if q.split("\\boxed{")[-1].rstrip("}").strip() == lab else 0.0
                for q, _, lab in items]
    good = [i for i, (q, _, _) in enumerate(items) if not q.startswith("HOSTILE-")]
    result["good_right"] = all(result["rewards"][i] == expected[i] for i in good)
    result["alive"] = alive
    return result


def _serve_items(url: str, path: str, in_flight: int) -> dict[str, object]:
    import asyncio

    import aiohttp

    items = json.loads(Path(path).read_text())
    rewards = [0.0] * len(items)

    async def one(semaphore: asyncio.Semaphore, index: int) -> None:
        query, prompt, label = items[index]
        async with semaphore, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=180)) as s, s.post(
                url, json={"query": [query], "prompts": [prompt], "labels": [label]}) as r:
            r.raise_for_status()
            rewards[index] = (await r.json())["rewards"][0]

    async def main() -> float:
        semaphore = asyncio.Semaphore(in_flight)
        started = time.perf_counter()
        await asyncio.gather(*(one(semaphore, i) for i in range(len(items))))
        return time.perf_counter() - started

    wall = asyncio.run(main())
    return {"samples_s": len(items) / wall, "rewards": rewards}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--partial", type=int, default=8,
                        help="KiB each stranger sends (past 16, this podagent drops it at once)")
    parser.add_argument("--only", choices=("supervisor", "reward"), default=None)
    parser.add_argument("--addresses", type=int, default=125)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/hostile")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_serve_items(*args.child[:2], int(args.child[2]))))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hostile-"))
    report: dict[str, object] = {}
    try:
        if args.only in (None, "supervisor"):
            base = worktree(args.baseline, root)
            rows = []
            for name, path in (("this podagent", str(REPO)), (f"baseline {args.baseline}",
                                                               str(base))):
                got = supervisor(path, args.partial, args.addresses)
                report[f"supervisor {name}"] = got
                rows.append([name, f"{got['grown_mib']}", str(got["held_1s"]),
                             str(got["held_8s"]), "yes" if got["worker_joined"] else "no"])
            print(f"\n1,000 stranger connections attempted at once, each sending "
                  f"{args.partial} KiB of a first line it never finishes, from "
                  f"{args.addresses} addresses:")
            print(table(["hub", "memory growth (MiB)", "held after 1 s", "held after 8 s",
                         "a real worker joined"], rows))
        if args.only == "supervisor":
            return 0

        rule = root / "rule.py"
        rule.write_text(HOSTILE_RULE)
        rates: dict[bool, list[float]] = {False: [], True: []}
        checks = []
        for run in range(args.runs):
            # In turn, the order alternating: the machine's noise falls on both.
            for hostile in ((False, True) if run % 2 == 0 else (True, False)):
                got = reward_rate(rule, args.samples, args.in_flight, hostile,
                                  root / f"server-{run}-{hostile}.log")
                rates[hostile].append(got["samples_s"])
                checks.append(bool(got["good_right"]) and bool(got["alive"]))
        none, some = statistics.median(rates[False]), statistics.median(rates[True])
        report["reward"] = {"none": rates[False], "hostile": rates[True],
                            "ratio": some / none, "all_good_right": all(checks)}
        print(f"\nReward server, --func light rule, {args.samples} samples one per request, "
              f"{args.in_flight} in flight (median of {args.runs}):")
        print(table(["items", "samples/s", "ratio"], [
            ["none hostile", f"{none:.0f}", "1.00"],
            ["1 hostile in 100", f"{some:.0f}", f"{some / none:.2f}"]]))
        print(f"every good item kept its reward and the server stayed up: {all(checks)}")
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                        str(root / f"podagent-{args.baseline}")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        (args.out / "hostile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""verl's reward function against the head's reward server: the sync client and the async one
with verl's 8 reward workers, against one batched request, on the same server.

One reward server (`podagent reward-server --scoring boxed`, real process on loopback,
--workers verifier processes) serves every run. Each run is a fresh child process that scores
--samples new samples (bench/reward_func.py's workload: boxed answers, right and wrong, with
their golds) one way:

* sync: verl's reward loop with a thread pool of --reward-workers calling `compute_score` once
  per sample (one request each, --reward-workers in flight);
* async: --reward-workers workers, each a thread with its own event loop awaiting
  `compute_score_async` for its share of the samples at once (one aiohttp session per loop);
* batched: one `compute_score(solution_strs=...)` for them all (verl's batch manager), the
  baseline: requests of up to 1,024 items.

samples/s is samples over the run's wall time. Runs go in rounds, the order turned every other
round; the table gives each way's median (min-max) and its ratio to the batched run's median.
Every run's rewards are compared with the batched run's of the same round (same samples).

    python bench/verl_client.py [--samples 2000] [--runs 3] [--reward-workers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import reward_func as rf  # noqa: E402 (bench/reward_func.py: the workload)

from tests.harness.benchkit import git_commit, median, table, write_results  # noqa: E402

WAYS = ("batched", "sync", "async")


def child(way: str, url: str, items_path: str, reward_workers: int) -> dict[str, object]:
    """One run in this (fresh) process: the samples scored `way`, timed."""
    import asyncio
    import concurrent.futures
    import threading

    os.environ["REMOTE_RM_URL"] = url
    from podagent.rewards import client

    items = json.loads(Path(items_path).read_text())
    queries = [q for q, _, _ in items]
    golds = [g for _, _, g in items]
    infos = [{"question": p} for _, p, _ in items]
    started = time.monotonic()
    if way == "batched":
        rewards = client.compute_score(solution_strs=queries, ground_truths=golds,
                                       extra_infos=infos)
    elif way == "sync":
        with concurrent.futures.ThreadPoolExecutor(reward_workers) as pool:
            rewards = list(pool.map(lambda i: client.compute_score(
                "math", queries[i], golds[i], infos[i]), range(len(items))))
    else:
        shares = [range(w, len(items), reward_workers) for w in range(reward_workers)]
        rewards = [0.0] * len(items)

        async def worker(share: range) -> None:
            got = await asyncio.gather(*(client.compute_score_async(
                "math", queries[i], golds[i], infos[i]) for i in share))
            for i, reward in zip(share, got, strict=True):
                rewards[i] = reward
            await client.async_client().close()

        threads = [threading.Thread(target=lambda s=s: asyncio.run(worker(s)))
                   for s in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    took = time.monotonic() - started
    return {"way": way, "seconds": took, "rate": len(items) / took, "rewards": rewards}


def run_child(way: str, url: str, items: Path, reward_workers: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, __file__, "--child", way, url, str(items),
                          str(reward_workers)], capture_output=True, text=True, cwd=REPO,
                         timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{way} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reward-workers", type=int, default=8,
                        help="verl's reward.num_workers")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                        help="the server's verifier processes")
    parser.add_argument("--seed", type=int, default=59)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "verl_client")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="verl-client-"))
    proc, url = rf.start_server(["--scoring", "boxed", "--workers", str(args.workers)],
                                args.out / "server.log")
    runs: list[dict[str, object]] = []
    try:
        warm = work / "warm.json"  # the verifiers' first items, untimed
        warm.write_text(json.dumps(rf.workload(200, args.seed + 1000)))
        run_child("batched", url, warm, args.reward_workers)
        for n in range(args.runs):
            items = work / f"round{n}.json"
            items.write_text(json.dumps(rf.workload(args.samples, args.seed + n)))
            order = WAYS if n % 2 == 0 else tuple(reversed(WAYS))
            got = {way: run_child(way, url, items, args.reward_workers) for way in order}
            for way in WAYS:
                same = got[way]["rewards"] == got["batched"]["rewards"]
                runs.append({"round": n, "way": way, "rate": got[way]["rate"],
                             "seconds": got[way]["seconds"], "same_rewards": same})
                print(f"round {n}: {way:8} {got[way]['rate']:8.1f} samples/s"
                      f"{'' if same else '  REWARDS DIFFER'}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    base = median([r["rate"] for r in runs if r["way"] == "batched"])
    rows = []
    for way in WAYS:
        rates = [r["rate"] for r in runs if r["way"] == way]
        mid = median(rates)
        rows.append([way, f"{mid:.0f} ({min(rates):.0f}-{max(rates):.0f})",
                     f"{mid / base:.2f}" if base else "-",
                     "yes" if all(r["same_rewards"] for r in runs if r["way"] == way)
                     else "NO"])
    report = (f"verl client, {args.samples} samples per run, {args.runs} rounds, "
              f"{args.reward_workers} reward workers, server --workers {args.workers} "
              f"(podagent {git_commit()})\n\n"
              + table(["way", "samples/s median (min-max)", "vs batched", "same rewards"],
                      rows))
    meta = {"samples": args.samples, "runs": args.runs, "commit": git_commit()}
    write_results(args.out, report, meta, args, [])
    (args.out / "runs.json").write_text(json.dumps(runs, indent=2) + "\n")
    return 0 if all(r["same_rewards"] for r in runs) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
    else:
        sys.exit(main())

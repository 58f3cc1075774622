"""`podagent up` benchmark: from the command on "the laptop" to the job's first line, against
the fake RunPod cloud (tests/fakes/runpod_cloud.py: RunPod's v2 API over HTTP, each pod a
network-namespace pod running the real podagent), beside the same pods started directly (no
API at all: podagent on each pod, as a template would run it). Both in the same run, in turn.

    python bench/up.py [--pods 3,8] [--runs 2] [--out DIR]

Per pod count it prints: up's time to the job's first line and to its exit (pods terminated
and gone), the direct start's time to the first line, their ratio, the API calls up made, and
the manual steps the README's RunPod quickstart has a user do for the same run today.
Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.agents import clean_environ
from tests.harness.benchkit import fmt, median, table
from tests.harness.pods import DnsServer, PodNetwork, wait_for

KEY = "rpa_" + "BenchKey" * 4
IMAGE = "ghcr.io/podagent/podagent:bench"
GPU = "NVIDIA H100 80GB HBM3"
MARKER = "FIRST-JOB-LINE"
JOB = (sys.executable, "-c", f"print({MARKER!r}, flush=True)")
POD_ENV = {"PODAGENT_REWARD": "none"}  # the same on both sides: no reward server
RUN_TIMEOUT = 600.0


def manual_steps(pods: int) -> int:
    """The README's RunPod quickstart for one run, secrets set up once either way: create the
    template (1); deploy the head with EXPECTED_WORKERS and PODAGENT_JOB (1); copy its pod id
    (1); deploy each worker with HEAD_POD_ID (pods-1); open the head's logs (1); stop every
    pod afterwards (pods)."""
    return 1 + 1 + 1 + (pods - 1) + 1 + pods


def run_up(pods: int, root: Path) -> dict[str, Any]:
    with PodNetwork(prefix="pb") as net, DnsServer(address=net.host_ip, port=0) as dns, \
            FakeRunPodCloud(net, dns, root / "cloud", api_key=KEY,
                            images={IMAGE: [sys.executable, "-m", "podagent"]}) as cloud:
        env = {**clean_environ(), "RUNPOD_API_KEY": KEY, "RUNPOD_API_URL": cloud.url,
               "XDG_STATE_HOME": str(root / "state"), "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
        argv = [sys.executable, "-m", "podagent", "up", "--name", f"bench{pods}", "--image",
                IMAGE, "--gpu", GPU, "--gpus", "1", "--pods", str(pods)]
        for k, v in POD_ENV.items():
            argv += ["-e", f"{k}={v}"]
        argv += ["--", *JOB]
        first: list[float] = []
        out: list[str] = []
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=root)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if MARKER in line and not line.startswith("[") and not first:
                    first.append(time.monotonic() - t0)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code = proc.wait(timeout=RUN_TIMEOUT)
        took = time.monotonic() - t0
        reader.join(timeout=10)
        if code != 0 or not first:
            raise RuntimeError(f"podagent up exited {code}:\n{''.join(out)[-3000:]}")
        calls = cloud.requests
        return {"first": first[0], "whole": took, "calls": len(calls),
                "creates": sum(r.method == "POST" for r in calls),
                "billing_after": len(cloud.billing()),
                "invalid": len(cloud.invalid_requests())}


def run_direct(pods: int, root: Path) -> dict[str, Any]:
    env = {**POD_ENV, "EXPECTED_WORKERS": str(pods - 1), "PODAGENT_AFTER_RUN": "exit",
           "PODAGENT_JOB": shlex.join(JOB)}
    with harness.cluster(pods - 1) as c:
        agents, _ = harness.start_agents(c, root, env, {"PODAGENT_AFTER_RUN": "exit"})
        t0 = time.monotonic()
        try:
            def seen() -> bool:
                if any(MARKER in line and not line.startswith("[")
                       for line in agents[0].output.splitlines()):
                    return True
                if agents[0].proc and agents[0].proc.poll() is not None:
                    raise RuntimeError(f"the head exited {agents[0].proc.returncode} before "
                                       f"the job's first line:\n{agents[0].output[-3000:]}")
                return False

            wait_for(seen, timeout=RUN_TIMEOUT, interval=0.05, what="the job's first line")
            first = time.monotonic() - t0
            harness.wait_agents_exit(agents, RUN_TIMEOUT)
            codes = harness.exit_codes(agents)
            if any(codes.values()):
                raise RuntimeError(f"direct pods exited {codes}")
            return {"first": first, "whole": time.monotonic() - t0}
        finally:
            harness.close_agents(agents)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=benchkit.parse_ints, default=[3, 8])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/up"))
    args = parser.parse_args()
    benchkit.require_root(parser)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for pods in args.pods:
        results[pods] = {"up": [], "direct": []}
        for run in range(args.runs):
            for method, body in (("up", run_up), ("direct", run_direct)):
                root = args.out / f"{method}-{pods}-{run}"
                shutil.rmtree(root, ignore_errors=True)  # a run dir of its own, every time
                root.mkdir(parents=True)
                figures = body(pods, root)
                results[pods][method].append(figures)
                print(f"{pods} pods, run {run + 1}, {method}: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in figures.items()), flush=True)
    rows = []
    for pods, by in results.items():
        up_first = median([r["first"] for r in by["up"]])
        direct_first = median([r["first"] for r in by["direct"]])
        ratio = up_first / direct_first if up_first and direct_first else None
        rows.append([str(pods), fmt(up_first, 1), fmt(direct_first, 1), fmt(ratio, 2),
                     fmt(median([r["whole"] for r in by["up"]]), 1),
                     str(int(median([r["calls"] for r in by["up"]]) or 0)),
                     str(int(median([r["creates"] for r in by["up"]]) or 0)),
                     str(max(r["billing_after"] for r in by["up"])),
                     str(max(r["invalid"] for r in by["up"])),
                     f"1 vs {manual_steps(pods)}"])
    report = table(["pods", "up → first job line (s)", "direct → first line (s)",
                    "ratio up/direct", "up → exit, pods gone (s)", "API calls", "creates",
                    "billing after", "off-schema requests", "steps: up vs by hand"], rows)
    print(report)
    (args.out / "up.json").write_text(json.dumps({str(k): v for k, v in results.items()},
                                                 indent=1))
    (args.out / "up.md").write_text(report + "\n")


if __name__ == "__main__":
    main()

"""A pod lost mid-training under `podagent up`, against the fake RunPod cloud (its pods are
network-namespace pods running the real podagent and a real Ray training, tests/jobs/
tiny_train.py, its checkpoints on one network volume): seconds from the loss to training
again, two ways, in the same run, in turn.

- replace: podagent's way. `up` replaces the lost worker (a new pod of the same spec under its
  name); the head takes it in and resubmits the job, resuming from the newest checkpoint.
- recreate-all: the peers' way (dstack resubmits the whole run, SkyPilot's managed jobs
  restart every node). `up --replacements 0` ends the run at the loss and terminates every
  pod; the same `up` command is run again at once, creating every pod, and its job resumes
  from the same checkpoints.

    python bench/up_replace.py [--pods 3] [--runs 2] [--out DIR]

Per run: the seconds from the loss (the worker terminated at RunPod) to the training's first
step after it, the step it resumed from, and the pods created for the run in all; then the
medians and the ratio recreate-all / replace. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness import benchkit
from tests.harness.agents import clean_environ
from tests.harness.benchkit import fmt, median, table
from tests.harness.pods import DnsServer, PodNetwork, wait_for

KEY = "rpa_" + "BenchKey" * 4
IMAGE = "ghcr.io/podagent/podagent:bench"
GPU = "NVIDIA H100 80GB HBM3"
TRAIN = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "tiny_train.py"
STEPS, EVERY, STEP_TIME = 400, 5, 0.2  # long enough that neither way ends before it resumes
LOSE_AT = 12  # the step after which the worker is lost
STEP = re.compile(r"\bstep (\d+) loss \S+ attempt (\d+)")
RESUMED = re.compile(r"resumed from step-(\d+)\.pt")
TIMEOUT = 600.0


class Up:
    """One `podagent up` process and its output, as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: re.Pattern[str], after: float = 0.0,
              accept: Any = lambda m: True) -> tuple[float, re.Match[str]] | None:
        for at, line in list(self.lines):
            m = pattern.search(line)
            if at >= after and m and accept(m):
                return at, m
        return None

    def await_first(self, pattern: re.Pattern[str], what: str, after: float = 0.0,
                    accept: Any = lambda m: True) -> tuple[float, re.Match[str]]:
        def seen() -> tuple[float, re.Match[str]] | None:
            if self.proc.poll() is not None and not self.first(pattern, after, accept):
                raise RuntimeError(f"up exited {self.proc.returncode} before {what}:\n"
                                   + "\n".join(line for _, line in self.lines[-40:]))
            return self.first(pattern, after, accept)

        return wait_for(seen, timeout=TIMEOUT, interval=0.05, what=what)

    def stop(self) -> int:
        """Ctrl-C: `up` terminates the pods and ends."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=TIMEOUT)
        self._reader.join(timeout=10)
        return code


def _lose(cloud: FakeRunPodCloud, name: str) -> float:
    pod = next(p for p in cloud.pods.values() if p.name == name and p.status != "TERMINATED")
    lost = time.monotonic()
    answer = requests.delete(f"{cloud.url}/v2/pods/{pod.id}", timeout=30,
                             headers={"Authorization": f"Bearer {KEY}"})
    answer.raise_for_status()
    return lost


def one_run(way: str, pods: int, root: Path) -> dict[str, Any]:
    with PodNetwork(prefix="pr") as net, DnsServer(address=net.host_ip, port=0) as dns, \
            FakeRunPodCloud(net, dns, root / "cloud", api_key=KEY, pod_key="own",
                            network_volumes={"vol": "US-KS-2"},
                            images={IMAGE: [sys.executable, "-m", "podagent"]}) as cloud:
        env = {**clean_environ(), "RUNPOD_API_KEY": KEY, "RUNPOD_API_URL": cloud.url,
               "XDG_STATE_HOME": str(root / "state"), "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
        run = f"rep{pods}"
        argv = [sys.executable, "-m", "podagent", "up", "--name", run, "--image", IMAGE,
                "--gpu", GPU, "--gpus", "1", "--pods", str(pods), "--network-volume", "vol",
                "-e", "PODAGENT_REWARD=none", "-e", "PODAGENT_STOP_TIMEOUT=5",
                "--replacements", "1" if way == "replace" else "0", "--",
                sys.executable, str(TRAIN), "--steps", str(STEPS), "--every", str(EVERY),
                "--step-time", str(STEP_TIME)]
        up = later = Up(argv, env, root)
        try:
            up.await_first(STEP, f"step {LOSE_AT}", accept=lambda m: int(m[1]) >= LOSE_AT)
            lost = _lose(cloud, f"podagent-{run}-w1")
            if way == "replace":
                again, _ = up.await_first(STEP, "the first step after the loss", after=lost,
                                          accept=lambda m: m[2] == "2")
                resumed = up.await_first(RESUMED, "the resumed checkpoint", after=lost)[1]
            else:
                code = up.proc.wait(timeout=TIMEOUT)
                if code != 24:
                    raise RuntimeError(f"up --replacements 0 exited {code}, not 24")
                later = Up(argv, env, root)  # the whole run, created again
                again, _ = later.await_first(STEP, "the first step of the new run")
                resumed = later.await_first(RESUMED, "the resumed checkpoint")[1]
        finally:
            for each in {up, later}:
                each.stop()
        creates = [r for r in cloud.requests if r.method == "POST" and r.path == "/v2/pods"
                   and 200 <= r.status < 300]
        return {"seconds": again - lost, "resumed": int(resumed[1]), "creates": len(creates),
                "billing_after": len(cloud.billing()),
                "invalid": len(cloud.invalid_requests())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/up_replace"))
    args = parser.parse_args()
    benchkit.require_root(parser)
    args.out.mkdir(parents=True, exist_ok=True)
    ways = ("replace", "recreate-all")
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for n in range(args.runs):
        for way in ways:
            root = args.out / f"{way}-{n}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            figures = one_run(way, args.pods, root)
            results[way].append(figures)
            print(f"run {n + 1}, {way}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in figures.items()), flush=True)
    rows = []
    for way in ways:
        got = results[way]
        rows.append([way, fmt(median([r["seconds"] for r in got]), 1),
                     ", ".join(str(r["resumed"]) for r in got),
                     ", ".join(str(r["creates"]) for r in got),
                     str(sum(r["billing_after"] for r in got)),
                     str(sum(r["invalid"] for r in got))])
    print(table(["way", "loss -> training again (s, median)", "resumed at step",
                 "pods created", "billing after", "invalid requests"], rows))
    replace = median([r["seconds"] for r in results["replace"]])
    whole = median([r["seconds"] for r in results["recreate-all"]])
    if replace and whole:
        print(f"recreate-all / replace: {whole / replace:.2f}x ({args.pods} pods, "
              f"{args.runs} run(s) each, in turn)")


if __name__ == "__main__":
    main()

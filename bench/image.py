"""The image benchmark: what building podagent's image costs on each base, and how long a
cluster of containers of it takes to come up beside the same cluster as namespaced pods.

    python bench/image.py [--runs 3] [--build-runs 1] [--rebuild-bases] [--out DIR]

1. Build: podagent's image from the repository's Dockerfile on each base of docker/images.py,
   every layer rebuilt (`--no-cache`: apt's tini and the pip install from PyPI), timed; the size
   podagent adds is the image's size minus the base's. `--rebuild-bases` also removes the
   cached root filesystem and bases first and times making them.
2. Bring-up: 1 head + 2 workers, configured by the RunPod template's environment (token set,
   built-in reward server, W&B off), EXPECTED_WORKERS=2, job `python -c pass`. t0 is just
   before the first pod starts (`docker run` for containers, the podagent process for
   namespaces); ready is the `ts` of the head's `workers_joined` event (the "cluster ready"
   line). Containers run the Ray 2.60 image; namespaces run this environment's podagent (Ray
   2.60 too). Runs alternate between the two so machine noise spreads over both.

Needs root. Starts the Docker engine when it is not running (tests/container/engine.py) and
stops it afterwards if it started it.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podagent import __version__ as PODAGENT_VERSION
from tests.container import engine as engine_module
from tests.container.engine import images
from tests.container.pods import PodContainer, Session, pod_net, template_env
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.benchkit import median, reason_line, table
from tests.harness.pods import cleanup_stale

WORKERS = 2
RUN_NAME = "bench"
JOB = "python -c pass"
NET_PREFIX = "pi"  # namespaced pods of this bench; distinct from the tests' and bringup's
IMAGE_BASE = "ray2.60"  # the same Ray as this environment's, for the namespaces


@dataclass
class BuildRun:
    base: str
    index: int
    seconds: float
    base_bytes: int
    image_bytes: int
    added_bytes: int


@dataclass
class UpRun:
    method: str  # containers | namespaces
    index: int
    ok: bool = False
    ready_s: float | None = None  # t0 -> the head's workers_joined event
    exit_s: float | None = None  # t0 -> every pod exited
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def bench_env() -> dict[str, str]:
    """The template's env with its secrets filled in, W&B off (the bench has no account); every
    pod exits when the run is over (the measure), where on RunPod it would stay up."""
    env = template_env(secrets.token_urlsafe(32), "")
    del env["WANDB_API_KEY"]  # the user deleted the line
    env.update(EXPECTED_WORKERS="", PODAGENT_JOB=JOB, PODAGENT_RUN_NAME=RUN_NAME,
               PODAGENT_AFTER_RUN="exit")
    return env


def ready_ts(events: list[dict[str, Any]]) -> float | None:
    return next((e["ts"] for e in events
                 if e.get("event") == "workers_joined" and e.get("result") == "ok"), None)


def settle(run: UpRun, t0: float, codes: list[int], events: list[dict[str, Any]],
           head_output: str) -> None:
    """A bring-up that ended: ok when every pod exited 0 and the head saw the workers join."""
    ready = ready_ts(events)
    if codes != [0] * len(codes) or ready is None:
        raise RuntimeError(f"exit codes {codes}: {reason_line(head_output)}")
    run.ready_s = round(ready - t0, 3)
    run.ok = True


# --- bring-up in containers -----------------------------------------------------------------------


def up_containers(run: UpRun, session: Session, image: str, timeout: float) -> None:
    env = bench_env()
    with pod_net(session) as net:
        head = PodContainer(net, image, "head", {**env, "EXPECTED_WORKERS": str(WORKERS)})
        head.env["HEAD_POD_ID"] = head.pod_id
        pods = [head, *(PodContainer(net, image, f"w{i}", {**env, "HEAD_POD_ID": head.pod_id})
                        for i in range(1, WORKERS + 1))]
        try:
            t0 = time.time()
            for pod in pods:
                pod.start()
            run.extra["docker_run_s"] = round(time.time() - t0, 3)
            codes = [pod.wait_exit(timeout) for pod in pods]
            run.exit_s = round(time.time() - t0, 3)
            mount = net.docker("volume", "inspect", "--format", "{{.Mountpoint}}",
                               head.volume).stdout.strip()
            events = benchkit.pod_events(Path(mount) / "podagent" / "logs" / RUN_NAME)
            settle(run, t0, codes, harness.read_events(events), head.logs)
        finally:
            for pod in pods:
                pod.remove()
                net.docker("volume", "rm", "--force", pod.volume, check=False)


# --- bring-up in namespaces -----------------------------------------------------------------------


def up_namespaces(run: UpRun, timeout: float) -> None:
    env = bench_env()
    for key in ("PODAGENT_LOG_DIR", "PODAGENT_CHECKPOINT_DIR"):
        del env[key]  # the Agent puts the logs in its own folder; no volume here
    agents = []
    with tempfile.TemporaryDirectory(prefix="podagent-bench-") as folder, \
            harness.cluster(WORKERS, prefix=NET_PREFIX) as c:
        root = Path(folder)
        try:
            agents, t0 = harness.start_agents(c, root, {**env, "EXPECTED_WORKERS": str(WORKERS)},
                                              env)
            harness.wait_agents_exit(agents, timeout)
            run.exit_s = round(time.time() - t0, 3)
            settle(run, t0, [a.proc.returncode for a in agents],
                   harness.read_events(benchkit.pod_events(root / "head" / RUN_NAME)),
                   agents[0].output)
        finally:
            harness.close_agents(agents)


# --- report ---------------------------------------------------------------------------------------


def report(builds: list[BuildRun], bases: dict[str, float], ups: list[UpRun]) -> str:
    rows = []
    for name in dict.fromkeys(b.base for b in builds):
        runs = [b for b in builds if b.base == name]
        rows.append([name, f"{bases[name]:.0f} s" if name in bases else "cached",
                     f"{median([r.seconds for r in runs], 1)} ({len(runs)} run(s))",
                     images.mib(runs[-1].base_bytes), images.mib(runs[-1].added_bytes)])
    lines = ["## Image build (podagent's layers, --no-cache)", "",
             table(["base", "base made in", "build s (median)", "base size", "podagent adds"],
                   rows)]
    if "rootfs" in bases:
        lines.append(f"\nDebian root filesystem (debootstrap + import): {bases['rootfs']:.0f} s")
    rows, medians = [], {}
    for method in ("containers", "namespaces"):
        runs = [u for u in ups if u.method == method]
        ok = [u for u in runs if u.ok]
        medians[method] = median([u.ready_s for u in ok if u.ready_s is not None], 1)
        each = ", ".join(f"{u.ready_s:.1f}" if u.ok and u.ready_s else "fail" for u in runs)
        rows.append([method, f"{len(ok)}/{len(runs)}", str(medians[method]),
                     str(median([u.exit_s for u in ok if u.exit_s is not None], 1)), each])
    lines += ["", f"## Start -> cluster ready, 1 head + {WORKERS} workers", "",
              table(["pods as", "runs ok", "ready s (median)", "all exited s (median)",
                     "each run"], rows)]
    if medians["containers"] and medians["namespaces"]:
        lines.append(f"\nratio containers / namespaces (ready, medians): "
                     f"{medians['containers'] / medians['namespaces']:.2f}")
    for u in ups:
        if not u.ok:
            lines.append(f"- {u.method} run {u.index} failed: {u.reason}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="bring-ups of each kind")
    parser.add_argument("--build-runs", type=int, default=1, help="--no-cache builds per base")
    parser.add_argument("--rebuild-bases", action="store_true",
                        help="remove the cached root filesystem and bases, and time making them")
    parser.add_argument("--run-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=benchkit.RESULTS)
    args = parser.parse_args()
    outdir = args.out / time.strftime("image-%Y%m%d-%H%M%S")
    outdir.mkdir(parents=True)
    cleanup_stale(NET_PREFIX)

    builds: list[BuildRun] = []
    made: dict[str, float] = {}
    ups: list[UpRun] = []
    with engine_module.engine() as engine:
        docker = engine.docker
        if args.rebuild_bases:
            stale = [line for line in docker("images", "--format", "{{.Repository}}:{{.Tag}}")
                     .stdout.split() if line.startswith((images.ROOTFS_REPO, images.BASE_REPO))]
            if stale:
                docker("rmi", *stale, timeout=600)
        rootfs = images.ensure_rootfs(docker)
        if not rootfs.cached:
            made["rootfs"] = rootfs.seconds
        for name, base in images.BASES.items():
            base_image = images.ensure_base(docker, base, rootfs)
            if not base_image.cached:
                made[name] = base_image.seconds
            for i in range(1, args.build_runs + 1):
                b = images.build_image(docker, base, base_image, no_cache=True)
                builds.append(BuildRun(name, i, round(b.image.seconds, 1), b.base_size, b.size,
                                       b.added))
                print(f"build {name} #{i}: {b.image.seconds:.1f} s, adds "
                      f"{images.mib(b.added)}", flush=True)
        image = f"{images.IMAGE_REPO}:test-{IMAGE_BASE}"
        session = Session(docker)
        session.cleanup_stale()
        try:
            for i in range(1, args.runs + 1):
                for method in ("containers", "namespaces"):
                    run = UpRun(method, i)
                    try:
                        if method == "containers":
                            up_containers(run, session, image, args.run_timeout)
                        else:
                            up_namespaces(run, args.run_timeout)
                    except (RuntimeError, TimeoutError, AssertionError) as exc:
                        run.reason = str(exc).splitlines()[0][:300]
                    ups.append(run)
                    print(f"{method} #{i}: ready {run.ready_s} s, exited {run.exit_s} s"
                          f"{'' if run.ok else ' FAILED: ' + run.reason}", flush=True)
        finally:
            session.close()
        meta = {"podagent": PODAGENT_VERSION, "engine": engine.version,
                "storage": docker("info", "--format", "{{.Driver}}").stdout.strip(),
                "cpus": len(os.sched_getaffinity(0)),
                "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    text = report(builds, made, ups)
    benchkit.write_results(outdir, text, meta, args, [*builds, *ups])
    return 0 if all(u.ok for u in ups) else 1


if __name__ == "__main__":
    sys.exit(main())

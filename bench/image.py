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
import contextlib
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bringup import read_events, reason_line, write_results  # noqa: E402

from podagent import __version__ as PODAGENT_VERSION  # noqa: E402
from tests.container import engine as engine_module  # noqa: E402
from tests.container.engine import images  # noqa: E402
from tests.container.pods import PodContainer, Session, pod_net, template_env  # noqa: E402
from tests.harness.agents import Agent  # noqa: E402
from tests.harness.pods import DnsServer, PodNetwork, cleanup_stale, wait_for  # noqa: E402

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


def pod_env() -> dict[str, str]:
    """The template's env with its secrets filled in, W&B off (the bench has no account)."""
    env = template_env(secrets.token_urlsafe(32), "")
    del env["WANDB_API_KEY"]  # the user deleted the line
    env.update(EXPECTED_WORKERS="", PODAGENT_JOB=JOB, PODAGENT_RUN_NAME=RUN_NAME)
    return env


def ready_ts(events: list[dict[str, Any]]) -> float | None:
    return next((e["ts"] for e in events
                 if e.get("event") == "workers_joined" and e.get("result") == "ok"), None)


# --- bring-up in containers -----------------------------------------------------------------------


def up_containers(run: UpRun, session: Session, image: str, timeout: float) -> None:
    env = pod_env()
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
            events = read_events(Path(mount) / "podagent" / "logs" / RUN_NAME / "events.jsonl")
            ready = ready_ts(events)
            if codes != [0] * len(pods) or ready is None:
                raise RuntimeError(f"exit codes {codes}: {reason_line(head.logs)}")
            run.ready_s = round(ready - t0, 3)
            run.ok = True
        finally:
            for pod in pods:
                pod.remove()
                net.docker("volume", "rm", "--force", pod.volume, check=False)


# --- bring-up in namespaces -----------------------------------------------------------------------


def up_namespaces(run: UpRun, timeout: float) -> None:
    env = pod_env()
    for key in ("PODAGENT_LOG_DIR", "PODAGENT_CHECKPOINT_DIR"):
        del env[key]  # the Agent puts the logs in its own folder; no volume here
    agents: list[Agent] = []
    with tempfile.TemporaryDirectory(prefix="podagent-bench-") as folder, \
            PodNetwork(prefix=NET_PREFIX) as net, \
            DnsServer(address=net.host_ip, port=0) as dns:
        root = Path(folder)
        pods = [net.add_pod("head"), *(net.add_pod(f"w{i}") for i in range(1, WORKERS + 1))]
        for pod in pods:
            dns.set_record(pod.dns_name, pod.ip)
        head_id = pods[0].pod_id
        agents = [Agent(pods[0], dns, root, {**env, "HEAD_POD_ID": head_id,
                                             "EXPECTED_WORKERS": str(WORKERS),
                                             "PODAGENT_RUN_NAME": RUN_NAME})]
        agents += [Agent(p, dns, root, {**env, "HEAD_POD_ID": head_id,
                                        "PODAGENT_RUN_NAME": RUN_NAME}) for p in pods[1:]]
        try:
            t0 = time.time()
            for a in agents:
                a.start()
            wait_for(lambda: all(a.proc.poll() is not None for a in agents), timeout=timeout,
                     interval=0.1, what=f"all {len(agents)} podagents to exit")
            run.exit_s = round(time.time() - t0, 3)
            codes = [a.proc.returncode for a in agents]
            ready = ready_ts(read_events(root / "head" / RUN_NAME / "events.jsonl"))
            if codes != [0] * len(agents) or ready is None:
                raise RuntimeError(f"exit codes {codes}: {reason_line(agents[0].output)}")
            run.ready_s = round(ready - t0, 3)
            run.ok = True
        finally:
            for a in agents:
                with contextlib.suppress(Exception):
                    a.close()


# --- report ---------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def report(builds: list[BuildRun], bases: dict[str, float], ups: list[UpRun]) -> str:
    lines = ["## Image build (podagent's layers, --no-cache)", "",
             "| base | base made in | build s (median) | base size | podagent adds |",
             "|---|---|---|---|---|"]
    for name in dict.fromkeys(b.base for b in builds):
        runs = [b for b in builds if b.base == name]
        made = f"{bases[name]:.0f} s" if name in bases else "cached"
        lines.append(f"| {name} | {made} | {median([r.seconds for r in runs])} "
                     f"({len(runs)} run(s)) | {images.mib(runs[-1].base_bytes)} | "
                     f"{images.mib(runs[-1].added_bytes)} |")
    if "rootfs" in bases:
        lines.append(f"\nDebian root filesystem (debootstrap + import): {bases['rootfs']:.0f} s")
    lines += ["", f"## Start -> cluster ready, 1 head + {WORKERS} workers", "",
              "| pods as | runs ok | ready s (median) | all exited s (median) | each run |",
              "|---|---|---|---|---|"]
    medians = {}
    for method in ("containers", "namespaces"):
        runs = [u for u in ups if u.method == method]
        ok = [u for u in runs if u.ok]
        medians[method] = median([u.ready_s for u in ok if u.ready_s is not None])
        each = ", ".join(f"{u.ready_s:.1f}" if u.ok and u.ready_s else "fail" for u in runs)
        lines.append(f"| {method} | {len(ok)}/{len(runs)} | {medians[method]} | "
                     f"{median([u.exit_s for u in ok if u.exit_s is not None])} | {each} |")
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
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
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
    write_results(outdir, text, meta, args, [*builds, *ups])
    return 0 if all(u.ok for u in ups) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Recovery benchmark: the time a lost worker pod costs a training run, podagent beside plain Ray.

A head and N workers (network namespaces with a real DNS server, as in the end-to-end tests:
tests/harness/) run a real, tiny DDP training job over gloo (tests/jobs/tiny_train.py: rank 0
appends every step to $PODAGENT_CHECKPOINT_DIR/.steps.jsonl and saves a checkpoint every
--every steps). Once the training is a few steps past a checkpoint, one worker pod is SIGKILLed
and a replacement pod (a new pod id and address, the same HEAD_POD_ID) is started at once.

* podagent: the real podagent in every pod (PODAGENT_ON_NODE_LOSS=restart, the default;
  PODAGENT_RESTART_BACKOFF=0: no backoff is measured). Measured from the
  kill (wall time): the head's `worker_lost` event (detection), its `job_finished` event (the
  job stopped), its `worker_joined` event for the replacement (and the replacement's own Ray
  registration), the resubmitted job's `job_submitted` event (<run>-2) and the training's
  first step of attempt 2.
* ray (the baseline): `ray start --head` / `ray start --address` in the same kind of pods,
  `ray job submit` of the same job, Ray's defaults throughout; the replacement pod runs
  `ray start --address` at once. Measured: the kill -> the job's terminal status in the Jobs API
  (capped at --baseline-cap), and the kill -> the lost node dead in Ray's node table. Nothing
  submits the job again: the training's next step never comes without a person.

Needs root and iproute2. Run from the repository root with the project's virtual environment:

    python bench/recovery.py [--runs 3] [--workers 2] [--methods podagent,ray] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import tenacity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.agents import Agent
from tests.harness.benchkit import RunFailed, fmt, last_lines, median, reason_line, table, verdict
from tests.harness.pods import Pod, wait_for

METHODS = ("podagent", "ray")
BASELINE = "ray"
TRAIN = benchkit.REPO / "tests" / "jobs" / "tiny_train.py"
STEPS, EVERY, STEP_TIME = 100_000, 10, 0.1  # never finishes: the bench ends the run
KILL_AT = 2 * EVERY + 3  # the kill comes a few steps past the checkpoint of step 20
RUN_NAME = "bench"  # tests/harness/cluster.py's PODAGENT_RUN_NAME
RESUBMITTED = f"{RUN_NAME}-2"
RAY_JOB = "ray-1"
STEPS_FILE = ".steps.jsonl"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
BACKOFF = "0"  # no backoff before the resubmission: what is measured is podagent's own path
NODE_WATCH_S = 30.0  # plain Ray: the node table watched this long after the job ended
TARGET_STOP_S = 10.0  # kill -> the job stopped (detection + stop)
TARGET_ADDED_S = 15.0  # kill -> next new step, less the replacement's own start -> Ray registered


@dataclass
class Run(benchkit.RunRecord):
    # seconds: podagent: kill -> first new step; ray: kill -> job terminal
    method: str
    index: int
    workers: int
    capped: bool = False  # plain Ray's job not over within --baseline-cap
    # All from the kill, in seconds (podagent unless noted):
    detect_s: float | None = None  # -> the head's worker_lost (its `at`); ray: node dead
    ended_s: float | None = None  # -> job_finished (the head is done with the job); ray: FAILED
    stopped_s: float | None = None  # -> job_stopped (Ray confirmed the stop)
    joined_s: float | None = None  # -> worker_joined for the replacement (ray: node alive)
    submitted_s: float | None = None  # -> job_submitted (<run>-2)
    first_step_s: float | None = None  # -> the first step of attempt 2
    own_s: float | None = None  # replacement started -> its Ray node registered
    added_s: float | None = None  # first_step_s - own_s
    job_status: str | None = None  # ray: the terminal status
    step_at_kill: int | None = None
    resumed_at: int | None = None  # attempt 2's first step
    redone: int | None = None  # steps of attempt 1 done again by attempt 2

    def split(self) -> dict[str, float | None]:
        """podagent's kill -> first new step in consecutive parts (they add up to the total)."""
        def gap(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 3)

        return {"detection": self.detect_s, "stop": gap(self.detect_s, self.ended_s),
                "detection_stop": self.ended_s, "wait": gap(self.ended_s, self.joined_s),
                "job_start": gap(self.joined_s, self.first_step_s),
                "resubmit": gap(self.joined_s, self.submitted_s),
                "job_own": gap(self.submitted_s, self.first_step_s)}


def train_argv() -> list[str]:
    return [sys.executable, str(TRAIN), "--steps", str(STEPS), "--every", str(EVERY),
            "--step-time", f"{STEP_TIME:g}"]


def steps(checkpoints: Path) -> list[dict[str, Any]]:
    """The training's step lines so far (a line being written is skipped)."""
    found = []
    for line in harness.read_text(checkpoints / STEPS_FILE).splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def wait_step(checkpoints: Path, attempt: int, step: int, timeout: float,
              alive: Callable[[], None]) -> dict:
    """Until attempt `attempt` of the training reached `step`; returns that step's line.
    `alive()` raises RunFailed when what runs the job is gone."""
    def reached() -> dict | None:
        alive()
        return next((s for s in steps(checkpoints)
                     if s["attempt"] == attempt and s["step"] >= step), None)

    try:
        return wait_for(reached, timeout=timeout, interval=0.05,
                        what=f"attempt {attempt} of the training to reach step {step}")
    except TimeoutError as exc:
        raise RunFailed(str(exc)) from None


def new_pod(c: harness.Cluster, name: str) -> Pod:
    """A replacement pod on the same network: a new pod id and address, in DNS, with a short
    Ray temp dir of its own (removed with the cluster's)."""
    pod = c.net.add_pod(name)
    c.dns.set_record(pod.dns_name, pod.ip)
    c.tmp[name] = c.tmp[c.head.name].removesuffix(c.head.name) + name
    return pod


# --- podagent ------------------------------------------------------------------------------------


def run_podagent(run: Run, logdir: Path, timeout: float) -> None:
    checkpoints = logdir / "checkpoints"
    worker_env = {"PODAGENT_HEAD_TIMEOUT": str(int(timeout))}
    with harness.cluster(run.workers) as c:
        agents: list[Agent] = []
        try:
            agents, t0 = harness.start_agents(
                c, logdir,
                head_env={"EXPECTED_WORKERS": str(run.workers), "PODAGENT_REWARD": "none",
                          "PODAGENT_JOB": shlex.join(train_argv()),
                          "PODAGENT_CHECKPOINT_DIR": str(checkpoints),
                          "PODAGENT_RESTART_BACKOFF": BACKOFF,
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout))},
                worker_env=worker_env)
            head, victim = agents[0], agents[1]

            def head_alive() -> None:
                if head.proc.poll() is not None:
                    raise RunFailed(f"the head exited {head.proc.returncode}: "
                                    f"{reason_line(head.output)}", last_lines(head.output))

            first = wait_step(checkpoints, 1, 1, max(1.0, t0 + timeout - time.time()),
                              head_alive)
            run.extra["cold_first_step_s"] = round(first["t"] - t0, 3)
            try:
                for worker in agents[1:]:
                    worker.wait_output("watching the head", timeout=60)
            except (TimeoutError, AssertionError) as exc:
                raise RunFailed(str(exc).splitlines()[0], last_lines(head.output)) from None
            wait_step(checkpoints, 1, KILL_AT, timeout, head_alive)

            pod = new_pod(c, "r1")
            replacement = Agent(pod, c.dns, logdir, {
                "PATH": harness.pod_env()["PATH"], "PODAGENT_RUN_NAME": RUN_NAME,
                "HEAD_POD_ID": c.head.pod_id, "PODAGENT_RAY_TEMP_DIR": c.tmp[pod.name],
                **worker_env})
            replacement.ray_tmp = c.tmp[pod.name]
            run.step_at_kill = max(s["step"] for s in steps(checkpoints))
            killed = time.time()
            victim.kill_pod()
            started = time.time()
            agents.append(replacement.start())
            harness.kill_pod(victim.pod)  # whatever was forked meanwhile
            run.extra["replacement_started_s"] = round(started - killed, 3)

            resumed = wait_step(checkpoints, 2, 1, timeout, head_alive)
            measure_podagent(run, logdir, killed, started, victim.pod.ip, pod.ip,
                             resumed, checkpoints)
            dashboard = f"http://{c.head.ip}:{harness.DASHBOARD_PORT}"
            run.extra["job_ended_s"] = job_end(dashboard, f"{RUN_NAME}-1", killed)
            run.extra["cold_job_own_s"] = round(first["t"] - float(next(
                e["ts"] for e in harness.read_events(benchkit.pod_events(
                    logdir / "head" / RUN_NAME))
                if e.get("event") == "job_submitted" and e.get("result") == "ok")), 3)
            run.exit_codes = harness.exit_codes(agents)
            said = head.output.partition(f"job {RESUBMITTED} submitted")[2].split("\n", 1)[0]
            if "--load_checkpoint" not in said:
                raise RunFailed(f"{RESUBMITTED} was not submitted with the resume flag",
                                last_lines(head.output))
            run.ok = True
        finally:
            harness.close_agents(agents)


def measure_podagent(run: Run, logdir: Path, killed: float, started: float, lost_ip: str,
                     new_ip: str, resumed: dict, checkpoints: Path) -> None:
    """The head's events after the kill, and the training's steps, into the run."""
    events = [e for e in harness.read_events(benchkit.pod_events(logdir / "head" / RUN_NAME))
              if float(e.get("ts", 0)) >= killed]

    def first(name: str, **match: Any) -> dict | None:
        return next((e for e in events if e.get("event") == name
                     and all(e.get(k) == v for k, v in match.items())), None)

    lost = next((e for e in events if e.get("event") == "worker_lost" and "at" in e
                 and e.get("ip") == lost_ip), None)
    finished = first("job_finished")
    stopped = first("job_stopped")
    joined = next((e for e in events if e.get("event") == "worker_joined"
                   and e.get("replaces") == lost_ip and e.get("ip") == new_ip), None)
    submitted = first("job_submitted", submission_id=RESUBMITTED, result="ok")
    missing = [name for name, e in (("worker_lost", lost), ("job_finished", finished),
                                    ("worker_joined (replaces)", joined),
                                    (f"job_submitted {RESUBMITTED}", submitted)) if e is None]
    if missing:
        raise RunFailed(f"the head's events lack {', '.join(missing)} after the kill")
    assert lost and finished and joined and submitted

    def since(t: float) -> float:
        return round(t - killed, 3)

    run.detect_s = since(float(lost["at"]))
    run.ended_s = since(float(finished["ts"]))
    run.stopped_s = since(float(stopped["ts"])) if stopped else None
    run.joined_s = since(float(joined["ts"]))
    run.submitted_s = since(float(submitted["ts"]))
    run.first_step_s = run.seconds = since(float(resumed["t"]))
    run.own_s = round(joined["registered_ms"] / 1000 - started, 3)
    run.added_s = round(run.first_step_s - run.own_s, 3)
    run.extra.update(lost_how=lost.get("how"), job_status=finished.get("status"),
                     stop_status=stopped.get("status") if stopped else None,
                     registered_s=since(joined["registered_ms"] / 1000))
    restarted = first("restarted")
    if restarted:
        run.extra["ledger_time_lost_s"] = restarted.get("time_lost_s")
    # The replacement's own steps: podagent's start -> head found -> `ray start` done.
    for e in harness.read_events(benchkit.pod_events(logdir / "r1" / RUN_NAME)):
        if e.get("event") in ("head_found", "joined") and e.get("result") == "ok":
            run.extra[f"replacement_{e['event']}_s"] = round(float(e["ts"]) - started, 3)
            run.extra[f"replacement_{e['event']}_duration_s"] = e.get("duration_s")
    first_of_2 = min(s["step"] for s in steps(checkpoints) if s["attempt"] == 2)
    last_of_1 = max(s["step"] for s in steps(checkpoints) if s["attempt"] == 1)
    run.resumed_at, run.redone = first_of_2, max(0, last_of_1 - first_of_2 + 1)


# --- plain Ray -----------------------------------------------------------------------------------


def ray_start(c: harness.Cluster, pod: Pod, logdir: Path, timeout: float) -> None:
    """`ray start` in the pod; a worker's is repeated (0.5 s apart) until it exits 0, as
    bench/bringup.py's floor does: on a loaded machine one attempt can time out."""
    extra = ("--dashboard-host", pod.ip) if pod is c.head else ()
    log = logdir / f"{pod.name}.out"
    deadline = time.time() + timeout

    def attempt() -> int:
        return harness.run_in_pod(pod, c.ray_start(pod, *extra), harness.pod_env(), log,
                                  deadline - time.time())

    rc = attempt() if pod is c.head else tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout), wait=tenacity.wait_fixed(0.5),
        retry=tenacity.retry_if_result(lambda rc: rc != 0),
        retry_error_callback=lambda s: s.outcome.result())(attempt)
    if rc != 0:
        text = harness.read_text(log)
        raise RunFailed(f"{pod.name}: `ray start` exit {rc}: {reason_line(text)}",
                        last_lines(text))


def job_info(dashboard: str, job: str) -> dict[str, Any]:
    """The Jobs API's record of a job ({} when it cannot be read): status, end_time (ms)..."""
    try:
        reply = requests.get(f"{dashboard}/api/jobs/{job}", timeout=2.0)
        found = reply.json() if reply.ok else {}
        return found if isinstance(found, dict) else {}
    except (requests.RequestException, ValueError):
        return {}


def job_status(dashboard: str) -> str | None:
    return job_info(dashboard, RAY_JOB).get("status")


def job_end(dashboard: str, job: str, killed: float) -> float | None:
    """Seconds from the kill to the job's end as Ray recorded it (its `end_time`)."""
    end = job_info(dashboard, job).get("end_time")
    return round(end / 1000 - killed, 3) if end else None


def save_job_log(dashboard: str, path: Path) -> str:
    """The job's output as Ray keeps it (in the head's temp dir, gone with the pod)."""
    try:
        reply = requests.get(f"{dashboard}/api/jobs/{RAY_JOB}/logs", timeout=5.0)
        text = str(reply.json().get("logs", "")) if reply.ok else ""
    except (requests.RequestException, ValueError, AttributeError):
        text = ""
    path.write_text(text)
    return text


def run_ray(run: Run, logdir: Path, timeout: float, cap: float) -> None:
    checkpoints = logdir / "checkpoints"
    checkpoints.mkdir()
    with harness.cluster(run.workers) as c:
        gcs: GcsClient | None = None
        joiner: threading.Thread | None = None
        try:
            t0 = time.time()
            for pod in c.pods:
                ray_start(c, pod, logdir, timeout)
            gcs = GcsClient(f"{c.head.ip}:{harness.RAY_PORT}")
            nodes = await_alive(gcs, run.workers + 1, timeout)
            victim = c.workers[0]
            victim_id = next(n.node_id for n in nodes if n.ip == victim.ip)
            dashboard = f"http://{c.head.ip}:{harness.DASHBOARD_PORT}"
            # gloo would pick the address the host name resolves to (loopback here); podagent
            # sets this from the pod's interface, a plain Ray user sets it by hand.
            runtime_env = {"env_vars": {"PODAGENT_CHECKPOINT_DIR": str(checkpoints),
                                        "GLOO_SOCKET_IFNAME": c.head.ifname}}
            submit = [harness.RAY, "job", "submit", "--address", dashboard, "--no-wait",
                      "--submission-id", RAY_JOB, "--runtime-env-json", json.dumps(runtime_env),
                      "--", *train_argv()]
            rc = tenacity.Retrying(  # the dashboard may not answer yet
                stop=tenacity.stop_after_delay(timeout), wait=tenacity.wait_fixed(0.5),
                retry=tenacity.retry_if_result(lambda rc: rc != 0 and job_status(dashboard)
                                               is None),
                retry_error_callback=lambda s: s.outcome.result())(
                    lambda: harness.run_in_pod(c.head, submit, harness.pod_env(),
                                               logdir / "submit.out", timeout))
            submitted = time.time()
            if rc != 0 and job_status(dashboard) is None:
                text = harness.read_text(logdir / "submit.out")
                raise RunFailed(f"`ray job submit` exit {rc}: {reason_line(text)}",
                                last_lines(text))

            def job_alive() -> None:
                status = job_status(dashboard)
                if status in TERMINAL:
                    text = save_job_log(dashboard, logdir / "job.log")
                    raise RunFailed(f"the job ended {status} before the kill: "
                                    f"{reason_line(text)}", last_lines(text))

            first = wait_step(checkpoints, 1, 1, timeout, job_alive)
            run.extra["cold_first_step_s"] = round(first["t"] - t0, 3)
            run.extra["cold_job_own_s"] = round(first["t"] - submitted, 3)
            wait_step(checkpoints, 1, KILL_AT, timeout, job_alive)

            pod = new_pod(c, "r1")
            run.step_at_kill = max(s["step"] for s in steps(checkpoints))
            killed = time.time()
            harness.kill_pod(victim)
            started = time.time()
            joiner = threading.Thread(target=lambda: ray_start(c, pod, logdir, timeout),
                                      daemon=True)
            joiner.start()
            measure_ray(run, gcs, dashboard, victim_id, pod.ip, killed, started, cap)
            run.extra["job_ended_s"] = job_end(dashboard, RAY_JOB, killed)
            last = max(s["t"] for s in steps(checkpoints))
            run.extra["last_step_after_kill_s"] = round(last - killed, 3)
            run.extra["resubmitted"] = any(s["attempt"] != 1 for s in steps(checkpoints))
            save_job_log(dashboard, logdir / "job.log")
            run.ok = True
        finally:
            if gcs is not None:
                gcs.close()
            for pod in c.net.pods:  # the replacement too; never `ray stop`
                with contextlib.suppress(Exception):
                    harness.kill_pod(pod)
            if joiner is not None:
                joiner.join(timeout=15)


def await_alive(gcs: GcsClient, count: int, timeout: float) -> list:
    def alive() -> list:
        nodes = [n for n in gcs.nodes(timeout=2.0) if n.alive]
        return nodes if len(nodes) >= count else []

    try:
        return wait_for(alive, timeout=timeout, interval=0.1, ignore=(GcsUnavailable,),
                        what=f"{count} alive nodes in the head's node table")
    except TimeoutError as exc:
        raise RunFailed(str(exc)) from None


def measure_ray(run: Run, gcs: GcsClient, dashboard: str, victim_id: str, new_ip: str,
                killed: float, started: float, cap: float) -> None:
    """Polls the Jobs API and the node table every 0.1 s until the job is over (or the cap);
    the node table a while longer (NODE_WATCH_S) if the lost node is not dead in it yet or the
    replacement not in."""
    while time.time() - killed < cap:
        now = time.time()
        if run.detect_s is None or run.joined_s is None:
            try:
                nodes = gcs.nodes(timeout=2.0)
            except GcsUnavailable:
                nodes = []
            if run.detect_s is None and any(n.node_id == victim_id and not n.alive
                                            for n in nodes):
                run.detect_s = round(now - killed, 3)
            new = next((n for n in nodes if n.ip == new_ip and n.alive), None)
            if run.joined_s is None and new is not None:
                run.joined_s = round(now - killed, 3)
                run.own_s = round(new.start_time_ms / 1000 - started, 3)
        if run.ended_s is None:
            status = job_status(dashboard)
            if status in TERMINAL:
                run.ended_s = run.seconds = round(now - killed, 3)
                run.job_status = status
        watched = run.ended_s is not None and now - killed > run.ended_s + NODE_WATCH_S
        if run.ended_s is not None and (watched or None not in (run.detect_s, run.joined_s)):
            return
        time.sleep(0.1)
    if run.ended_s is None:
        run.ended_s = run.seconds = cap
        run.capped = True


# --- driver and tables ---------------------------------------------------------------------------


def cell(found: list[float], capped: bool = False) -> str:
    # The run counts are in the line above the table.
    return benchkit.spread(found, capped, count=False)


def line(run: Run, total: int) -> str:
    if run.method == "podagent":
        parts = run.split()
        note = ("" if run.first_step_s is None else
                f", detect {fmt(parts['detection'], 1)} stop {fmt(parts['stop'], 1)} "
                f"wait {fmt(parts['wait'], 1)} job {fmt(parts['job_start'], 1)} "
                f"own {fmt(run.own_s, 1)} added {fmt(run.added_s, 1)}")
        figure = None
    else:
        note = (f", job {run.job_status}, node dead {fmt(run.detect_s, 1)} s"
                if run.ended_s is not None else "")
        figure = f"≥{run.seconds:.0f} s" if run.capped and run.seconds is not None else None
    return benchkit.status_line(run, f"{run.method:<8} run {run.index}/{total}", figure,
                                note=note)


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    ours = [r for r in runs if r.method == "podagent" and r.ok]
    base = [r for r in runs if r.method == BASELINE and r.ok]
    capped = any(r.capped for r in base)
    out = [f"### Recovery benchmark ({meta['started']})", "",
           f"{meta['machine']}; Ray {meta['ray']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); head + {args.workers} worker(s); {len(ours)} podagent "
           f"and {len(base)} plain Ray run(s); load average {meta['load_min']:.1f}-"
           f"{meta['load_max']:.1f} at run starts. The job: tests/jobs/tiny_train.py "
           f"--every {EVERY} --step-time {STEP_TIME:g}, a worker pod SIGKILLed a few steps "
           f"past step {KILL_AT - 3}'s checkpoint, a replacement pod started at once. "
           f"podagent: PODAGENT_RESTART_BACKOFF={BACKOFF} (no backoff).", ""]

    def part(name: str):
        return lambda r: r.split()[name]

    def both(what: str, ours_get, base_get=None, base_text: str | None = None,
             compare: bool = False) -> list[str]:
        o = benchkit.figures(runs, "podagent", ours_get)
        b = benchkit.figures(runs, BASELINE, base_get) if base_get else []
        return [what, cell(o), base_text if base_text is not None else cell(b),
                fmt(benchkit.median_ratio(b, o), 1) if compare else ""]

    def own(r: Run) -> float | None:  # podagent's addition less the job's own start
        job_own = r.split()["job_own"]
        return None if r.added_s is None or job_own is None else round(r.added_s - job_own, 3)

    rows = [
        both("kill → the job over in Ray's records (the job's `end_time`: the training "
             "broke or was stopped)", lambda r: r.extra.get("job_ended_s"),
             lambda r: r.extra.get("job_ended_s")),
        both("kill → the loss is noticed (podagent: `worker_lost`; plain Ray: node dead in "
             "its node table)", part("detection"), lambda r: r.detect_s, compare=True),
        both("noticed → the job stopped (`job_finished`)", part("stop")),
        both("**kill → job stopped** (plain Ray: the job's terminal status, "
             f"{'/'.join(sorted({r.job_status or '?' for r in base})) or '-'})",
             part("detection_stop"), lambda r: r.ended_s,
             base_text=cell(benchkit.figures(runs, BASELINE, lambda r: r.ended_s), capped),
             compare=True),
        both("job stopped → the replacement joined (`worker_joined`, replaces the lost)",
             part("wait")),
        both("the replacement's own start → its Ray registered (podagent started / "
             "`ray start` run → `start_time_ms`)", lambda r: r.own_s, lambda r: r.own_s),
        both("kill → the replacement is in the node table (`registered_ms`; plain Ray: "
             "seen alive)", lambda r: r.extra.get("registered_s"), lambda r: r.joined_s),
        both("replacement joined → the training's next new step (job start)",
             part("job_start")),
        both("… of which: joined → job submitted again (`job_submitted` "
             f"{RESUBMITTED})", part("resubmit")),
        both("… of which: submitted → its first step (the job's own start)", part("job_own")),
        both("**kill → the training's next new step**", lambda r: r.first_step_s,
             base_text="never, without a person"),
        both("**podagent's addition: total − the replacement's own start**",
             lambda r: r.added_s, base_text="-"),
        both("… less the resubmitted job's own start (what remains: detection, stop, waiting "
             "beyond the replacement's start, resubmission)", own),
        both("for comparison, the first attempt's own start: submitted → its first step",
             lambda r: r.extra.get("cold_job_own_s"), lambda r: r.extra.get("cold_job_own_s")),
        both("steps done twice (from the checkpoint to the kill)", lambda r: r.redone),
        both("first bring-up: every pod started → first training step",
             lambda r: r.extra.get("cold_first_step_s"),
             lambda r: r.extra.get("cold_first_step_s")),
    ]
    out += ["Seconds from the SIGKILL, median (min-max); plain Ray's wait is capped at "
            f"{args.baseline_cap:g} s (≥ marks a capped median).", "",
            table(["measure", "podagent", "plain Ray", "plain Ray / podagent"], rows), ""]
    stop = median(benchkit.figures(runs, "podagent", part("detection_stop")))
    added = median(benchkit.figures(runs, "podagent", own))
    worst_stop = max(benchkit.figures(runs, "podagent", part("detection_stop")), default=None)
    worst_added = max(benchkit.figures(runs, "podagent", own), default=None)
    out += [table(["target", "median", "worst run", "result"], [
        [f"detection + stop ≤ {TARGET_STOP_S:g} s", fmt(stop, 1), fmt(worst_stop, 1),
         verdict(None if stop is None else stop <= TARGET_STOP_S)],
        [f"podagent's addition beyond the replacement's own Ray start and the job's own start "
         f"≤ {TARGET_ADDED_S:g} s",
         fmt(added, 1), fmt(worst_added, 1),
         verdict(None if added is None else added <= TARGET_ADDED_S)]]), "",
            "The parts (detection, stop, wait, job start) add up to kill → next new step. "
            "podagent's addition = kill → next new step − (the replacement's podagent started → "
            "its Ray node's `start_time_ms`); the target leaves out the resubmitted job's own "
            "start as well (its driver and ranks importing torch: the same as the first "
            "attempt's start, paid by any restart). plain Ray: nothing submits the job again; the "
            "replacement joins the cluster and sits idle.", ""]
    return benchkit.join_report(out, runs)


def plan(args: argparse.Namespace) -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
    bodies: dict[str, benchkit.Body[Run]] = {
        "podagent": lambda r, d: run_podagent(r, d, args.run_timeout),
        "ray": lambda r, d: run_ray(r, d, args.run_timeout, args.baseline_cap),
    }
    for i, method in benchkit.rounds(args.runs, args.methods):
        yield Run(method, i, args.workers), f"{method}-r{i}", bodies[method]


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, methods=METHODS)
    parser.add_argument("--workers", type=int, choices=(1, 2, 3, 4), default=2,
                        help="workers besides the head (default 2); one of them is killed")
    benchkit.add_baseline_cap(parser, 600.0, "plain Ray's job to end")
    return benchkit.run_all(parser, argv, "recovery-", plan, line, render)


if __name__ == "__main__":
    sys.exit(main())

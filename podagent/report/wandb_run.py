"""The bring-up as a W&B run: stage durations, nodes and GPUs as they join, the cluster check's
results and the job's outcome, in the user's project, grouped with the job's own runs by the
run name.

Only the head logs (one run per cluster). wandb takes ~2 s of CPU to import and start, so that
happens on a thread of its own while the bring-up goes on; events seen meanwhile wait in a queue.
The key is never passed, printed or logged: wandb reads WANDB_API_KEY from the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import shlex
import string
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from podagent import __version__
from podagent.config import Settings
from podagent.report import Reporter
from podagent.wire import Event

DEFAULT_PROJECT = "podagent"
NO_KEY = "W&B: WANDB_API_KEY not set; bring-up is not logged to W&B"
OFFLINE_MODES = frozenset({"offline", "dryrun"})
INIT_TIMEOUT = 60.0  # wandb.init's own limit: online, it logs in and creates the run
UPLOAD_TIMEOUT = 20.0  # wandb's limit on the last upload; then the files stay for `wandb sync`
FINISH_WAIT = 30.0  # the most finish() holds podagent's exit, whatever W&B does
SERVICE_NAME = "wandb-core"  # the service process wandb starts
SERVICE_TOKEN = "WANDB_SERVICE"  # where wandb puts the way to reach that service
STEP_METRIC = "elapsed_s"
NODE_COLUMNS = ("role", "ip", "gpus", "joined_s", "state")


@dataclass(frozen=True)
class Decision:
    mode: str | None  # "online", "offline", or None: not logged
    project: str
    line: str


def decide(environ: Mapping[str, str], run_dir: Path | None = None) -> Decision:
    """Whether and how the bring-up is logged, and the one line that says so."""
    project = environ.get("WANDB_PROJECT", "").strip() or DEFAULT_PROJECT
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode == "disabled":
        return Decision(None, project, "W&B: WANDB_MODE=disabled; bring-up is not logged to W&B")
    if mode in OFFLINE_MODES:
        where = f"; files in {run_dir}/wandb" if run_dir is not None else ""
        return Decision("offline", project,
                        f"W&B: logging bring-up to project {project} (offline{where})")
    if not environ.get("WANDB_API_KEY", "").strip():
        return Decision(None, project, NO_KEY)
    return Decision("online", project, f"W&B: logging bring-up to project {project}")


def attach(reporter: Reporter, settings: Settings, role: Any) -> BringupRun | None:
    """Start logging this pod's bring-up to W&B when it is the head and W&B is configured.

    Returns the run to finish at the end (`finish(exit_code)`), or None."""
    if getattr(role, "value", role) != "head":
        return None  # one run per cluster: the head sees every node join
    decision = decide(settings.environ, settings.run_dir)
    reporter.say(decision.line)
    if decision.mode is None:
        return None
    run = BringupRun(reporter, settings, decision.mode, decision.project)
    run.start()
    return run


# --- events to metrics (no wandb here) -----------------------------------------------------------


@dataclass
class Update:
    metrics: dict[str, Any]
    summary: dict[str, Any]


class BringupTally:
    """What the bring-up run records, read from podagent's events (metrics, the node and
    check tables; not to be confused with the run's ledger on the volume)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = t0  # times are seconds since podagent began logging the bring-up
        self.nodes: dict[str, dict[str, Any]] = {}
        self.check_nodes: list[dict[str, Any]] = []
        self.job_status: str | None = None
        self.exit_code: int | None = None

    def _cluster(self) -> dict[str, Any]:
        alive = [n for n in self.nodes.values() if n["state"] == "alive"]
        return {"cluster/nodes": len(alive), "cluster/gpus": sum(n["gpus"] for n in alive)}

    def _node(self, key: str, role: str, ip: Any, gpus: Any, elapsed: float) -> None:
        self.nodes[key] = {"role": role, "ip": str(ip), "gpus": _number(gpus) or 0,
                           "joined_s": elapsed, "state": "alive"}

    def apply(self, record: Mapping[str, Any]) -> Update:
        name = str(record.get("event", ""))
        ts = _number(record.get("ts"))
        if self.t0 is None and ts is not None:
            self.t0 = ts
        elapsed = round(ts - self.t0, 3) if ts is not None and self.t0 is not None else 0.0
        up = Update({}, {})
        if "duration_s" in record and "result" in record:  # a timed step
            up.metrics[f"stage/{name}_s"] = _number(record["duration_s"])
            if record["result"] != "ok":
                up.summary["failed_stage"] = name
        if name == Event.PREPARED:
            self._node("head", "head", record.get("node_ip"), record.get("gpus"), elapsed)
            up.metrics.update(self._cluster())
            up.summary["nccl_preset"] = record.get("preset")
        elif name == Event.WORKER_JOINED:
            key = str(record.get("node_id") or record.get("ip"))
            self._node(key, "worker", record.get("ip"), record.get("gpus"), elapsed)
            up.metrics.update(self._cluster())
        elif name == Event.WORKER_LOST:
            key = str(record.get("node_id") or record.get("ip"))
            if key in self.nodes:
                self.nodes[key]["state"] = "lost"
            up.metrics.update(self._cluster())
            up.metrics["cluster/workers_lost"] = sum(
                n["state"] == "lost" for n in self.nodes.values())
        elif name == Event.WORKERS_JOINED and record.get("result") == "ok":
            census = {"cluster/nodes": _number(record.get("nodes")),
                      "cluster/gpus": _number(record.get("gpus"))}
            up.metrics.update({k: v for k, v in census.items() if v is not None})
        elif name == Event.JOB_SUBMITTED and record.get("result") == "ok":
            up.summary["time_to_job_s"] = elapsed
        elif name == Event.JOB_FINISHED and record.get("status"):
            self.job_status = str(record["status"])
        elif name == Event.JOB_STOPPED and self.job_status is None:
            self.job_status = str(record.get("status") or "STOP_UNCONFIRMED")
        elif name.startswith("check") and "passed" in record:
            self._check(name, record, up)
        elif name == Event.STATE:
            up.summary["last_state"] = record.get("state")
        elif name == Event.TEARDOWN:
            up.summary["outcome"] = record.get("outcome")
        elif name == Event.EXIT:
            self.exit_code = _int(record.get("code"))
            if record.get("error"):
                # A one-line error, or a traceback: its last line names the exception.
                up.summary["error"] = str(record["error"]).strip().splitlines()[-1][:500]
        elif name == Event.REWARD_RESTART:
            up.metrics["reward/restarts"] = record.get("restart")
        elif name == Event.REWARD_FAILED:
            up.summary["reward_failed"] = record.get("why")
        elif name == Event.AUTH_OFF:
            up.summary["cluster_token"] = "off"
        elif name == Event.RESUME:
            up.summary["resumed_from"] = record.get("checkpoint_dir")
        elif name == Event.RESTART:  # a lost node (or a failed job): the job is run again
            up.metrics["cluster/restarts"] = _number(record.get("n"))
            up.summary["last_restart_reason"] = record.get("reason")
        elif name == Event.HANG:  # no progress: the stacks dumped, the culprit named
            up.metrics["cluster/hangs"] = _number(record.get("n"))
            up.summary["last_hang_culprits"] = ", ".join(
                f"{c.get('name')} on {c.get('pod')}" for c in record.get("culprits") or []
                if isinstance(c, dict)) or "none stood out"
            up.summary["last_hang_folder"] = record.get("folder")
        elif name == Event.RESTARTED:
            up.metrics["cluster/restart_time_lost_s"] = _number(record.get("time_lost_s"))
        if up.metrics:
            up.metrics[STEP_METRIC] = elapsed
        return up

    def _check(self, name: str, record: Mapping[str, Any], up: Update) -> None:
        # "check" -> check/passed; "check_nccl" -> check/nccl (and its figures under it).
        sub = name[len("check"):].strip("_-/.")
        prefix = f"check/{sub}/" if sub else "check/"
        up.metrics[f"check/{sub}" if sub else "check/passed"] = int(bool(record["passed"]))
        for key, value in record.items():
            if key in ("ts", "pod", "role", "event", "passed"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                up.metrics[prefix + key] = value
            elif key == "failures" and isinstance(value, list):
                up.summary[prefix + "failures"] = "; ".join(map(str, value))
            elif key == "nodes" and isinstance(value, list):
                self.check_nodes = [v for v in value if isinstance(v, dict)]
            elif isinstance(value, (str, bool)) or (
                    isinstance(value, list) and all(isinstance(v, str) for v in value)):
                up.summary[prefix + key] = value if not isinstance(value, list) else ", ".join(
                    value)

    def node_table(self) -> tuple[list[str], list[list[Any]]]:
        return list(NODE_COLUMNS), [[n[c] for c in NODE_COLUMNS] for n in self.nodes.values()]

    def check_table(self) -> tuple[list[str], list[list[Any]]]:
        columns: list[str] = []
        for row in self.check_nodes:
            columns += [k for k in row if k not in columns]
        return columns, [[_cell(row.get(c)) for c in columns] for row in self.check_nodes]


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Finish:
    exit_code: int


class BringupRun:
    """Owns the W&B run. Every wandb call happens on its one thread: the event listener only
    queues, so a slow or broken W&B never holds the bring-up up."""

    def __init__(self, reporter: Reporter, settings: Settings, mode: str, project: str):
        self.reporter, self.settings, self.mode, self.project = reporter, settings, mode, project
        self.tally = BringupTally(time.time())
        self.service: psutil.Process | None = None
        self.failure: str | None = None
        self.run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                              for _ in range(8))
        self._queue: queue.SimpleQueue[dict[str, Any] | _Finish] = queue.SimpleQueue()
        self._finishing = False
        self._thread = threading.Thread(target=self._work, name="wandb-bringup", daemon=True)

    @property
    def name(self) -> str:
        return f"{self.settings.run_name}-bringup"

    def start(self) -> None:
        self.reporter.add_listener(self._on_event)
        self._thread.start()

    def _on_event(self, record: dict[str, Any]) -> None:
        if not self._finishing and self.failure is None:
            self._queue.put(record)

    def finish(self, exit_code: int) -> None:
        """Record the outcome and close the run; holds the exit at most FINISH_WAIT seconds."""
        if self._finishing:
            return
        self._finishing = True
        self._queue.put(_Finish(exit_code))
        self._thread.join(FINISH_WAIT)
        if self._thread.is_alive():
            self.reporter.warn(f"W&B: the bring-up run did not finish within {FINISH_WAIT:g} s; "
                               f"its files stay in {self.settings.run_dir}/wandb (`wandb sync` "
                               f"uploads them)")
            self._abandon()

    # --- on the run's thread -----------------------------------------------------------------

    def _work(self) -> None:
        try:
            run = self._init()
        except Exception as exc:  # wandb raises many kinds (usage, auth, network, timeout)
            self._fail("could not start the bring-up run", exc)
            _teardown_wandb()
            return
        while True:
            item = self._queue.get()
            if isinstance(item, _Finish):
                break
            if self.failure is None:
                try:
                    self._record(run, item)
                except Exception as exc:
                    self._fail(f"could not log the event {item.get('event')!r}", exc)
        self._close(run, item.exit_code)

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.failure is None:  # one warning: what follows a failure fails the same way
            self.failure = f"{type(exc).__name__}: {exc}"
            self.reporter.warn(f"W&B: {what} ({self.failure}); the bring-up is not logged "
                               f"further")

    def _init(self) -> Any:
        import wandb

        options = wandb.Settings(
            mode=self.mode,
            # podagent's own output stays podagent's: no wandb lines, no captured console.
            silent=True, console="off",
            # Nothing about the machine or the code: the bring-up's events are the content.
            x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
            x_save_requirements=False, save_code=False, disable_git=True,
            init_timeout=INIT_TIMEOUT, finish_timeout=UPLOAD_TIMEOUT,
            # "Stop run" in the W&B UI would otherwise SIGINT podagent: the cluster is not
            # W&B's to stop.
            stop_fn=lambda: None,
        )
        # wandb also logs through Python's logging: its records go to its own files in the run
        # dir, not to whatever handlers podagent or Ray set up.
        logging.getLogger("wandb").propagate = False
        wandb.setup(settings=options)
        # wandb told its service's address to os.environ for child processes to share: none of
        # podagent's children (Ray, the reward server, the job) should attach to this service.
        os.environ.pop(SERVICE_TOKEN, None)
        self.service = next((p for p in psutil.Process().children()
                             if _name(p) == SERVICE_NAME), None)
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        # Explicit values win over the user's WANDB_NAME/WANDB_RUN_ID/WANDB_RESUME, which are
        # meant for the job's runs.
        run = wandb.init(
            project=self.project, group=self.settings.run_name, name=self.name, job_type="bringup",
            id=self.run_id, resume="never", dir=str(self.settings.run_dir), config=self._config(),
            settings=options,
        )
        run.define_metric(STEP_METRIC)
        for prefix in ("stage", "cluster", "check", "reward"):
            run.define_metric(f"{prefix}/*", step_metric=STEP_METRIC)
        return run

    def _config(self) -> dict[str, Any]:
        settings = self.settings
        job = (self.reporter.redact(shlex.join(settings.job)) if settings.job
               else "cluster check")
        return {"podagent_version": __version__, "run_name": settings.run_name,
                "pod": self.reporter.pod, "expected_workers": settings.expected_workers,
                "min_workers": settings.min_workers, "reward": settings.reward,
                "nccl_preset": settings.nccl_preset, "job": job}

    def _record(self, run: Any, record: dict[str, Any]) -> None:
        up = self.tally.apply(record)
        if up.metrics:
            run.log(up.metrics)
        if up.summary:
            run.summary.update(up.summary)

    def _close(self, run: Any, exit_code: int) -> None:
        import wandb

        try:
            if self.failure is None:
                tables = {}
                for key, (columns, rows) in (("cluster/node_table", self.tally.node_table()),
                                             ("check/node_table", self.tally.check_table())):
                    if rows:
                        tables[key] = wandb.Table(columns=columns, data=rows)
                if tables:
                    run.log(tables)
                run.summary.update({"job_status": self.tally.job_status or "not run",
                                    "exit_code": exit_code})
            run.finish(exit_code=exit_code)
        except Exception as exc:
            self._fail("could not finish the bring-up run", exc)
        finally:
            _teardown_wandb()

    def _abandon(self) -> None:
        """W&B hangs (network): stop its service so that podagent can exit."""
        services = [p for p in psutil.Process().children() if _name(p) == SERVICE_NAME]
        for proc in services:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(services, timeout=5)
        # Also drops wandb's exit hook, which would wait for the service again.
        stopper = threading.Thread(target=_teardown_wandb, daemon=True)
        stopper.start()
        stopper.join(2.0)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _teardown_wandb() -> None:
    """Stop wandb's service process (if wandb got as far as starting it): nothing of W&B
    outlives podagent's own teardown."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        with contextlib.suppress(Exception):
            wandb.teardown()

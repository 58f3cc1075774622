"""A hang on the Ray path: the head's progress watch ran out (run/progress.py) while the job
ran. Every pod dumps the job's processes' stacks (the head its own at once, each worker when
it reads the request in Ray's key-value store, within a second), the head says one line per
pod and names the likely culprit; the head then stops the job and the kernel's policy decides
whether it is submitted again (cluster/head.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from podagent import process
from podagent.cluster import ray_node, runstate
from podagent.config import Settings
from podagent.platform.roles import Role
from podagent.ray_access.gcs import GcsClient, GcsUnavailable, NodeInfo
from podagent.report import Reporter
from podagent.run import hangs, stacks
from podagent.run.hangs import DUMP_WAIT, Verdict
from podagent.run.progress import HEARTBEAT_FILE, ProgressWatch
from podagent.waiting import Backoff, Deadline, Expired, retry


class Hung(Exception):
    """While the job runs: no progress for PODAGENT_HANG_TIMEOUT (the quiet seconds)."""

    def __init__(self, quiet: float):
        super().__init__(f"no progress for {quiet:.0f} s")
        self.quiet = quiet


def watch_for(settings: Settings) -> ProgressWatch:
    """The head's watch over one job: the job's output comes streamed (saw_output)."""
    checkpoints = settings.checkpoint_dir
    return ProgressWatch(settings.hang_timeout,
                         checkpoints=Path(checkpoints) if checkpoints else None,
                         heartbeat=settings.run_dir / HEARTBEAT_FILE)


def dump_this_pod(settings: Settings, pod: str, n: int) -> stacks.PodDump:
    """This pod's part of the job (its Ray workers and actors, and on the head the driver)."""
    targets = stacks.ray_job_targets(process.pod_ray_processes(settings.ray_temp_dir))
    return stacks.dump_pod(pod, targets, hangs.folder(settings.run_dir, n),
                           hangs.stacks_dir(settings.run_dir))


def dump_everywhere(settings: Settings, gcs: GcsClient, me: str, workers: list[NodeInfo],
                    n: int, quiet: float, last_seen: str, reporter: Reporter,
                    sleep: Callable[[float], None]) -> Verdict:
    """Hang `n`: every pod's stacks, one line per pod, the culprit named, the event said."""
    started = hangs.announce(settings, reporter, n, quiet, last_seen)
    try:
        gcs.kv_put(runstate.KV_NAMESPACE, runstate.KV_DUMP, runstate.dump_request(n))
    except GcsUnavailable as exc:
        reporter.warn(f"could not ask the workers for their stacks: {exc}")
    dumps = {me: dump_this_pod(settings, me, n)}
    names = {w.ip: named(w.ip, w.label(runstate.LABEL_POD)) for w in workers}

    def answers() -> dict[str, stacks.PodDump]:
        for ip, name in names.items():
            if name in dumps:
                continue
            try:
                raw = gcs.kv_get(runstate.KV_NAMESPACE, runstate.dumped_key(n, ip))
            except GcsUnavailable:
                continue
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {}
                dumps[name] = stacks.PodDump.from_wire(body if isinstance(body, dict) else {},
                                                       name)
        return dumps

    with contextlib.suppress(Expired):  # a pod that did not answer is said so below
        retry(answers, awaited="every worker's stacks", backoff=Backoff.every(0.5),
              deadline=Deadline.after(DUMP_WAIT), sleep=sleep,
              until=lambda got: all(name in got for name in names.values()))
    for name in names.values():
        dumps.setdefault(name, hangs.missing(name))
    verdict = hangs.conclude(settings, reporter, n, quiet, last_seen, dumps, started)
    with contextlib.suppress(GcsUnavailable):  # for `podagent status`
        gcs.kv_put(runstate.KV_NAMESPACE, runstate.KV_DUMP,
                   runstate.dump_request(n, verdict.line))
    return verdict


def named(ip: str, pod: str | None) -> str:
    """A pod as the lines name it, as a run without Ray names its peers: its address (unique
    in the cluster) and its pod."""
    return f"{ip} ({pod})" if pod else ip


def pod_name(settings: Settings, role: Role, node_ip: str) -> str:
    """This pod, named so."""
    return named(node_ip, ray_node.node_labels(settings, role).get(runstate.LABEL_POD))


def answer(settings: Settings, gcs: GcsClient, node_ip: str, n: int,
           reporter: Reporter) -> None:
    """A worker's part: its stacks, put where the head reads them."""
    dumped = dump_this_pod(settings, pod_name(settings, Role.WORKER, node_ip), n)
    reporter.say(f"hang {n}: the head asked for this pod's stacks: {len(dumped.stacks)} "
                 f"process(es) dumped in {dumped.seconds:.1f} s to {dumped.folder}")
    try:
        gcs.kv_put(runstate.KV_NAMESPACE, runstate.dumped_key(n, node_ip),
                   json.dumps(dumped.to_wire()).encode())
    except GcsUnavailable as exc:
        reporter.warn(f"could not give the head this pod's stacks: {exc}")

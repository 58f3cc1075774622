"""A hang, as both engines report it: the warning when the watch runs out, then one line per
pod from every pod's stacks (run/stacks.py), the likely culprit, and the `hang` event (for
events.jsonl, W&B and `podagent status`). Who asks the pods for their stacks is the engine's
business: the supervisor port without Ray (gang/supervisor.py), Ray's key-value store with it
(cluster/hang.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from podagent.config import Settings
from podagent.report import Reporter
from podagent.run import stacks
from podagent.wire import Event

DUMP_WAIT = 30.0  # seconds the head waits for every pod's stacks
HANGS = "hangs"  # the run directory's folder of dumps, one folder per hang
STACKS = "stacks"  # where a job's faulthandler writes (podagent.job.enable_stack_dumps)


def folder(run_dir: Path, n: int) -> Path:
    return run_dir / HANGS / str(n)


def next_number(run_dir: Path) -> int:
    """The next hang's number: one more than the folders there (container restarts included)."""
    try:
        taken = [int(p.name) for p in (run_dir / HANGS).iterdir() if p.name.isdigit()]
    except OSError:
        taken = []
    return max(taken, default=0) + 1


def stacks_dir(run_dir: Path) -> Path:
    return run_dir / STACKS


@dataclass(frozen=True)
class Verdict:
    n: int
    line: str  # the likely culprit, and where the stacks are
    pods: tuple[str, ...]  # the culprits' pods


def announce(settings: Settings, reporter: Reporter, n: int, quiet: float,
             last_seen: str) -> float:
    """The warning that starts hang `n`; when it started (for the dump's time)."""
    reporter.warn(f"HANG {n}: no progress for {quiet:.0f} s (PODAGENT_HANG_TIMEOUT="
                  f"{settings.hang_timeout:g}; last progress: {last_seen or 'none'}): "
                  f"dumping the stacks of the run's processes on every pod")
    return time.monotonic()


def missing(pod: str) -> stacks.PodDump:
    return stacks.PodDump(pod, error=f"no answer to the dump request within {DUMP_WAIT:g} s")


def conclude(settings: Settings, reporter: Reporter, n: int, quiet: float, last_seen: str,
             dumps: Mapping[str, stacks.PodDump], started: float) -> Verdict:
    """Every pod's stacks said, the culprit named, the event recorded."""
    every = [s for d in dumps.values() for s in d.stacks]
    for dumped in dumps.values():
        reporter.say(f"hang {n}, {stacks.pod_line(dumped)}")
    found = stacks.culprits(every)
    where = folder(settings.run_dir, n)
    # Each pod writes in its own directory of the run: <run>/<pod>/hangs/<n>.
    each = folder(settings.run_dir.parent / "<pod>", n)
    line = f"{stacks.verdict(every)}; stacks in {each} on each pod"
    reporter.warn(f"hang {n}: {line}")
    reporter.event(Event.HANG, n=n, quiet_s=round(quiet, 1), timeout_s=settings.hang_timeout,
                   last_progress=last_seen, dump_s=round(time.monotonic() - started, 3),
                   folder=str(where),
                   culprits=[{"pod": s.pod, "name": s.name, "where": s.where} for s in found],
                   pods={pod: d.to_wire() for pod, d in dumps.items()})
    return Verdict(n, line, tuple(sorted({s.pod for s in found})))

"""Is the run making progress? A hung collective is not an idle GPU: every rank but one spins
inside NCCL at full utilization, billing, until NCCL's own timeout (two hours in the seeds).
So podagent watches what a healthy trainer always does sooner or later, on one clock:

* a new line of the job's output (any rank, any pod: a run is as alive as its busiest pod);
* a new or updated file in its checkpoint directory;
* an explicit heartbeat: the job touches the file named in PODAGENT_HEARTBEAT, or prints a line
  holding HEARTBEAT_MARKER (`podagent.job.heartbeat()` does the first).

Once the job has sent one explicit heartbeat, only heartbeats and checkpoints count: its other
output may come from threads that go on printing while its ranks hang.

The files are looked at every LOOK_EVERY seconds, but what a look finds counts from the file's
own modification time, not from the look: a hang is not called up to LOOK_EVERY late. That
time is bounded to what can be true: not after now (a network volume's clock ahead of ours),
not before the look that did not see it yet (a file copied in with an old time, a clock behind),
and never before the progress already known.

`ProgressWatch` only keeps the clock; the engines decide what a hang means (run/policy.py) and
which pods it reaches (gang/supervisor.py without Ray, cluster/head.py with it).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

HEARTBEAT_MARKER = "[podagent heartbeat]"
HEARTBEAT_VARIABLE = "PODAGENT_HEARTBEAT"  # the file the job may touch, set for it
HEARTBEAT_FILE = "heartbeat"  # its name in the run's directory
LOOK_EVERY = 2.0  # seconds between looks at the files: a hang is minutes, a stat is cheap
SCAN_LIMIT = 2000  # directory entries one look at the checkpoint directory reads at most
SCAN_DEPTH = 3  # run/global_step_10/model/...: deeper files are written with their parents


def newest_change(root: Path, limit: int = SCAN_LIMIT, depth: int = SCAN_DEPTH) -> float:
    """The newest modification time under `root` (0.0: nothing there), reading at most `limit`
    entries: a checkpoint directory holds a few steps of a few files each, and a new step
    changes the directory that holds it, so a bounded look never misses one."""
    newest, seen = 0.0, 0
    level = [root]
    for _ in range(depth + 1):
        below: list[Path] = []
        for folder in level:
            with contextlib.suppress(OSError):
                newest = max(newest, folder.stat().st_mtime)
                with os.scandir(folder) as entries:
                    for entry in entries:
                        seen += 1
                        if seen > limit:
                            return newest
                        with contextlib.suppress(OSError):
                            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                            if entry.is_dir(follow_symlinks=False):
                                below.append(Path(entry.path))
        level = below
        if not level:
            break
    return newest


def _mtime(path: Path | None) -> float:
    if path is None:
        return 0.0
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class ProgressWatch:
    """The seconds since the run last made progress, from the sources above. The job's output
    comes as it is printed, through `saw_output` (the Ray head's stream of the job's log; a
    run without Ray's teed training), never read back from a file: a volume that refuses the
    log must not make a run that prints look hung."""

    def __init__(self, timeout: float, *,
                 checkpoints: Path | None = None, heartbeat: Path | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout, self.checkpoints, self.heartbeat = timeout, checkpoints, heartbeat
        self.clock = clock
        self.explicit = False  # the job sent a heartbeat: plain output no longer counts
        self.last_seen = ""  # what the last progress was, for the hang's line
        self._last = self._looked = clock()  # the last progress; the last look at the files
        self._next_look = 0.0
        self._checkpoint_mark = newest_change(checkpoints) if checkpoints else 0.0
        self._beat_mark = _mtime(heartbeat)

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def reset(self, why: str) -> None:
        """A step or a restart begins: the clock starts again (its start-up is no hang)."""
        self._last, self.last_seen = self.clock(), why

    def saw_output(self, text: str) -> None:
        self._saw(text, self.clock())

    def _saw(self, text: str, at: float) -> None:
        if HEARTBEAT_MARKER in text:
            self.explicit = True
            self._progress("a heartbeat line", at)
        elif not self.explicit and text.strip():
            self._progress("output", at)

    def quiet(self) -> float:
        """Seconds since the last progress (the files are looked at every LOOK_EVERY, and
        once more before the quiet seconds reach the timeout: a hang is never called on
        progress written since the last look)."""
        now = self.clock()
        due = now >= self._next_look
        if not due and self.enabled and now - self._last >= self.timeout:
            # Once per crossing: not looked at since the quiet reached the timeout. (A head
            # whose own quiet stays past it while a worker's output keeps the run alive would
            # otherwise scan the checkpoints at every poll.)
            due = self._looked < self._last + self.timeout
        if due:
            self._next_look = now + LOOK_EVERY
            self._look()
        return self.clock() - self._last

    def hung(self) -> float | None:
        """The quiet seconds once they reach the timeout (never with the watch off)."""
        if not self.enabled:
            return None
        quiet = self.quiet()
        return quiet if quiet >= self.timeout else None

    def _progress(self, what: str, at: float) -> None:
        """Progress at `at` (on the watch's clock); one older than what is known is no news."""
        if at >= self._last:
            self._last, self.last_seen = at, what

    def _look(self) -> None:
        now, wall = self.clock(), time.time()
        since, self._looked = self._looked, now

        def when(mtime: float) -> float:
            """A file's modification time on the watch's clock, within what can be true: after
            the last look (which did not see it), not after now."""
            return min(now, max(since, now - (wall - mtime)))

        beat = _mtime(self.heartbeat)
        if beat > self._beat_mark:
            self._beat_mark, self.explicit = beat, True
            self._progress(f"a touch of {self.heartbeat}", when(beat))
        if self.checkpoints is not None:
            mark = newest_change(self.checkpoints)
            if mark > self._checkpoint_mark:
                self._checkpoint_mark = mark
                self._progress(f"a checkpoint in {self.checkpoints}", when(mark))

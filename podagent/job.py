"""What a job may call to help podagent watch it (podagent is in the job's image; this module
imports nothing else of it, so it costs the job nothing):

    import podagent.job
    podagent.job.enable_stack_dumps()   # once, early: stacks on SIGUSR1 where py-spy cannot
    podagent.job.heartbeat()            # at each step: progress, whatever the job prints

Both do nothing outside a podagent run.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

# The names podagent sets for the job (run/progress.py and run/stacks.py define them too; a
# test holds them equal, so that this module stays free of podagent's imports).
HEARTBEAT_VARIABLE = "PODAGENT_HEARTBEAT"
STACKS_VARIABLE = "PODAGENT_STACKS"
HEARTBEAT_MARKER = "[podagent heartbeat]"

_dump_file = None  # kept open for faulthandler, for the life of the process


def heartbeat() -> None:
    """Tell podagent the run makes progress: touches PODAGENT_HEARTBEAT's file (on a pod
    where it cannot be written, prints the heartbeat line instead). Once a job sends
    heartbeats, podagent counts only them and checkpoints as progress."""
    path = os.environ.get(HEARTBEAT_VARIABLE)
    if not path:
        return
    try:
        Path(path).touch()
    except OSError:
        print(HEARTBEAT_MARKER, flush=True)


def enable_stack_dumps() -> bool:
    """Let podagent read this process's stacks on a hang where py-spy is not allowed: on
    SIGUSR1, faulthandler writes every thread's stack to PODAGENT_STACKS/<pid>.txt. Whether
    it was enabled."""
    global _dump_file
    folder = os.environ.get(STACKS_VARIABLE)
    if not folder or _dump_file is not None:
        return _dump_file is not None
    try:
        os.makedirs(folder, exist_ok=True)
        _dump_file = open(os.path.join(folder, f"{os.getpid()}.txt"), "a")
    except OSError as exc:
        print(f"podagent.job: no stack dumps ({exc})", file=sys.stderr)
        return False
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True, chain=False)
    return True

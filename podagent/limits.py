"""This pod's process limits, raised before Ray starts.

Ray's GCS keeps about 6 open files per node (measured: 163 at 16 pods), its daemons and the
job's workers many more, and every thread counts against the process limit: a container whose
soft limits are the runtime's defaults (1,024 open files) runs out near 150 nodes, and users
see "No available agent to submit job" on a fresh head (fixed by raising `ulimit -u`). A soft
limit may be raised up to the hard one without privileges, so podagent does that for itself
and everything it starts, says so in one line, and warns when even the hard limit is short.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

# What one pod needs: a base for Ray's daemons, its workers and the job on the pod, and on the
# head a share per node of the cluster (the GCS's ~6 open files a node, with room).
OPEN_FILES_BASE = 4096
OPEN_FILES_PER_NODE = 8
PROCESSES_BASE = 8192  # threads count: Ray's daemons and core workers run dozens each


@dataclass(frozen=True)
class Limit:
    resource: int
    name: str  # as ulimit names it, for the user
    option: str  # ulimit's option

    def needed(self, nodes: int) -> int:
        if self.resource == resource.RLIMIT_NOFILE:
            return OPEN_FILES_BASE + OPEN_FILES_PER_NODE * nodes
        return PROCESSES_BASE


LIMITS = (Limit(resource.RLIMIT_NOFILE, "open files", "-n"),
          Limit(resource.RLIMIT_NPROC, "processes", "-u"))


def _shown(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value:,}"


def _short(value: int, needed: int) -> bool:
    return value != resource.RLIM_INFINITY and value < needed


def raise_to_hard(nodes: int) -> tuple[list[str], list[str]]:
    """Raise each soft limit to its hard limit. Returns (what was raised, warnings): one line
    each. `nodes`: the nodes this pod serves (the whole cluster on the head, 1 on a worker)."""
    raised, warnings = [], []
    for limit in LIMITS:
        try:
            soft, hard = resource.getrlimit(limit.resource)
            if soft != hard:
                resource.setrlimit(limit.resource, (hard, hard))
                raised.append(f"{limit.name} {_shown(soft)} -> {_shown(hard)}")
        except (ValueError, OSError) as exc:  # a platform that refuses: say so, go on
            warnings.append(f"could not raise the {limit.name} limit: {exc}")
            continue
        needed = limit.needed(nodes)
        if _short(hard, needed):
            warnings.append(
                f"the {limit.name} limit of this pod is {_shown(hard)} (hard), and a cluster of "
                f"{nodes} node(s) needs about {needed:,} here: raise it where the container is "
                f"started (`ulimit {limit.option} {needed}`, or the runtime's --ulimit), or "
                f"Ray may fail with 'Too many open files' / 'No available agent'")
    return raised, warnings

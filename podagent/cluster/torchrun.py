"""`podagent torchrun`: torchrun with the ranks worked out, for trainers that do not use Ray.

Every pod runs the same command. The head's address comes from the same discovery as the Ray
path, the node count from the expected workers, processes per node from the GPUs; torch's c10d
rendezvous at the head hands out the node ranks, so nobody types a NODE_RANK. Then podagent
execs torchrun: signals and the exit code are torchrun's own.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from podagent.config import Settings
from podagent.roles import Role


@dataclass(frozen=True)
class TorchrunPlan:
    argv: tuple[str, ...]
    env_overrides: Mapping[str, str]
    rdzv_id: str


def rendezvous_id(settings: Settings, head_ip: str) -> str:
    """The same on every pod of the cluster and different between clusters.

    The run name only when every pod has the same one (explicit, or derived from HEAD_POD_ID or
    PRIMARY_ADDR): a name from each pod's own RUNPOD_POD_ID or start time differs per pod.
    """
    if settings.run_name_shared:
        raw = settings.run_name
    else:
        raw = f"podagent-{settings.head_pod_id or settings.primary_addr or head_ip}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)


def plan(settings: Settings, role: Role, node_ip: str, head_ip: str, gpus: int,
         nccl_vars: Mapping[str, str], user_args: Sequence[str]) -> TorchrunPlan:
    """torchrun's argv: podagent's options first, the user's after them (torchrun's parser
    keeps the last value of an option, so a user's own --nnodes wins)."""
    rdzv_id = rendezvous_id(settings, head_ip)
    argv = (
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(settings.expected_workers + 1),
        "--nproc-per-node", str(gpus or 1),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{head_ip}:{settings.rendezvous_port}",
        "--rdzv-id", rdzv_id,
        # Said, not guessed: torch compares host names to decide who hosts the store, and
        # pods (or containers) can share one.
        "--rdzv-conf", f"is_host={1 if role is Role.HEAD else 0}",
        # The address other nodes reach this one at; the host name may resolve elsewhere.
        "--local-addr", node_ip,
        *user_args,
    )
    return TorchrunPlan(argv, dict(nccl_vars), rdzv_id)


def execute(torchrun_plan: TorchrunPlan) -> None:
    """Become torchrun (never returns)."""
    env = {**os.environ, **torchrun_plan.env_overrides}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(torchrun_plan.argv[0], list(torchrun_plan.argv), env)

"""What runs on each pod of a run without Ray: torchrun, or accelerate launch, with every
per-machine value worked out (node count, this pod's machine rank, the head's address and port,
processes per node), and the user's own options and script after them.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from podagent.config import Settings
from podagent.gang import parse
from podagent.platform.roles import Role


@dataclass(frozen=True)
class Layout:
    """The run's shape as this pod's podagent knows it once the rendezvous is over."""
    role: Role
    nodes: int
    machine_rank: int
    node_ip: str
    head_ip: str
    port: int  # torch's rendezvous (accelerate's main process port) on the head
    gpus: int
    procs_per_node: int  # one per GPU (one without GPUs), or the user's own --nproc-per-node
    rdzv_id: str
    wait: float  # how long this pod waits for the others (the role's timeout)


@dataclass(frozen=True)
class Step:
    name: str  # "data check" or "training"
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    lines: tuple[str, ...] = ()  # what podagent set or overrode, said before it starts


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


def wait_limit(settings: Settings, role: Role) -> float:
    """How long this pod waits for the others: the head for its workers, a worker for its
    head (the same settings as the Ray path)."""
    return settings.worker_timeout if role is Role.HEAD else settings.head_timeout


class Torchrun:
    """torchrun, its node ranks from torch's own c10d rendezvous at the head."""

    name = "torchrun"

    def __init__(self, user_args: Sequence[str]):
        parsed = parse.split(self.name, user_args)
        self.options = tuple(parsed["options"])
        self.script = tuple(parsed["script"])
        # The user's own count wins over podagent's (torchrun keeps the last one given).
        self.nproc: int | None = parsed["nproc"]

    def procs_per_node(self, gpus: int) -> int:
        return self.nproc or gpus or 1

    def requested_rank(self, settings: Settings, role: Role) -> int | None:
        # torch's rendezvous gives the node ranks; an Instant Cluster's NODE_RANK is kept
        # for podagent's own order only.
        return settings.node_rank if role is Role.WORKER and settings.node_rank else None

    def step(self, name: str, layout: Layout, script: Sequence[str],
             nccl: Mapping[str, str]) -> Step:
        """torchrun's argv: podagent's options first, the user's after them (torchrun's
        parser keeps the last value of an option, so a user's own --nnodes wins)."""
        conf = {
            # Said, not guessed: torch compares host names to decide who hosts the store,
            # and pods (or containers) can share one.
            "is_host": 1 if layout.role is Role.HEAD else 0,
            # torch's own wait (600 s by default) gets podagent's limit too: everyone was
            # there a moment ago, but a pod that dies before its torchrun starts must not
            # stall the rest.
            "join_timeout": math.ceil(layout.wait),
        }
        argv = (
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(layout.nodes),
            "--nproc-per-node", str(layout.procs_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{layout.head_ip}:{layout.port}",
            "--rdzv-id", layout.rdzv_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
            # The address other nodes reach this one at; the host name may resolve elsewhere.
            "--local-addr", layout.node_ip,
            *self.options,
            *script,
        )
        return Step(name, argv, dict(nccl))


class Accelerate:
    """accelerate launch, this pod's machine rank from podagent's rendezvous (static: a rank
    a worker asked for is kept, the head is 0)."""

    name = "accelerate"

    def __init__(self, user_args: Sequence[str]):
        from podagent.gang import accelerate

        self._mod = accelerate
        parsed = parse.split(self.name, user_args)
        typed = tuple(accelerate.Option(dest, tuple(tokens), value)
                      for dest, tokens, value in parsed["typed"])
        self.args = accelerate.LaunchArgs(tuple(parsed["options"]), tuple(parsed["script"]),
                                          parsed["config_file"], dict(parsed["given"]), typed,
                                          frozenset(parsed["flags"]))
        self.script = tuple(self.args.script)
        if self.args.config_file:
            accelerate.read_config(self.args.config_file)  # one that does not parse: exit 2

    def procs_per_node(self, gpus: int) -> int:
        return gpus or 1  # podagent sets accelerate's --num_processes (over all machines)

    def requested_rank(self, settings: Settings, role: Role) -> int | None:
        given = self._mod.check_given(self.args, head=role is Role.HEAD,
                                      workers=settings.expected_workers,
                                      node_rank=settings.node_rank)
        if given is not None:
            return given
        return settings.node_rank if role is Role.WORKER and settings.node_rank else None

    def step(self, name: str, layout: Layout, script: Sequence[str],
             nccl: Mapping[str, str]) -> Step:
        planned = self._mod.plan(self.args, nodes=layout.nodes,
                                 machine_rank=layout.machine_rank, main_ip=layout.head_ip,
                                 main_port=layout.port, procs_per_node=layout.procs_per_node,
                                 gpus=layout.gpus, script=script)
        return Step(name, tuple(planned.argv), {**nccl, **planned.env}, tuple(planned.lines))


Launcher = Torchrun | Accelerate


def data_check_step(launcher: Launcher, layout: Layout, out_dir: Path, loader: str | None,
                    nccl: Mapping[str, str]) -> Step:
    from podagent.gang import datacheck

    script = datacheck.script_args(out_dir, launcher.name, loader)
    return launcher.step("data check", layout, script, nccl)

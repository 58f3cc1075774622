"""Which role this pod plays, and the rule that decided it. Pure: table-tested.

Rules, first match wins:
  1. an explicit subcommand (`podagent head` / `podagent worker`);
  2. RAY_WORKER: 1 worker, 0 head;
  3. HEAD_POD_ID compared with RUNPOD_POD_ID: equal head, different worker;
  4. RunPod Instant Cluster: NODE_RANK 0 head, otherwise worker (PRIMARY_ADDR is the head);
  5. nothing: a standalone head.
Facts that a lower rule would read are still checked against the deciding one: a pod that two
facts put in different roles is refused (two heads are worse than none).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from podagent.config import Settings
from podagent.errors import RoleConflict
from podagent.platform.head_location import require_head_location


class Role(str, enum.Enum):
    HEAD = "head"
    WORKER = "worker"


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    reason: str


def _facts(settings: Settings) -> list[tuple[Role, str]]:
    """Every independent fact about the role, strongest first."""
    facts: list[tuple[Role, str]] = []
    if settings.ray_worker is not None:
        facts.append((Role.WORKER if settings.ray_worker else Role.HEAD,
                      f"RAY_WORKER={int(settings.ray_worker)}"))
    if settings.head_pod_id and settings.pod_id:
        if settings.head_pod_id == settings.pod_id:
            facts.append((Role.HEAD, f"RUNPOD_POD_ID={settings.pod_id} equals HEAD_POD_ID"))
        else:
            facts.append((Role.WORKER, f"RUNPOD_POD_ID={settings.pod_id} differs from "
                                       f"HEAD_POD_ID={settings.head_pod_id}"))
    if settings.node_rank is not None:
        facts.append((Role.HEAD if settings.node_rank == 0 else Role.WORKER,
                      f"NODE_RANK={settings.node_rank} (Instant Cluster)"))
    return facts


def detect_role(settings: Settings, explicit: Role | None = None) -> RoleDecision:
    facts = _facts(settings)
    if explicit is not None:
        decision = RoleDecision(explicit, f"the subcommand `podagent {explicit.value}`")
    elif facts:
        role, reason = facts[0]
        decision = RoleDecision(role, reason)
    elif settings.primary_addr is not None:
        decision = RoleDecision(Role.WORKER,
                                f"PRIMARY_ADDR={settings.primary_addr} names the head")
    elif settings.head_pod_id:
        decision = RoleDecision(Role.HEAD, "HEAD_POD_ID is set but RUNPOD_POD_ID is not, and "
                                           "RAY_WORKER is unset: the head")
    else:
        alone = "a standalone head" if settings.expected_workers == 0 else (
            f"the head of {settings.expected_workers} expected worker(s)")
        decision = RoleDecision(Role.HEAD, f"no role variable is set: {alone}")
    for role, reason in facts:
        if role is not decision.role:
            raise RoleConflict(
                f"role conflict: {decision.reason} makes this pod the {decision.role.value}, "
                f"but {reason} makes it a {role.value}; fix one of them"
            )
    if decision.role is Role.WORKER:
        require_head_location(settings)  # a worker that could not find its head: bad input
    return decision

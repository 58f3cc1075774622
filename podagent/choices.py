"""The closed sets of names podagent's settings and messages use, each defined here once.

A leaf: it imports nothing of podagent, so that settings, the reward server and the lifecycles
can all name these without importing each other.
"""

from __future__ import annotations

import enum


class Named(str, enum.Enum):
    """An enum whose members are their names wherever they are printed or compared."""

    def __str__(self) -> str:
        return self.value


class AfterRun(Named):
    """What a pod does once its run is over for good (PODAGENT_AFTER_RUN); what each does is in
    `meaning` (the setting's help) and in run/after_run.py."""

    STAY = "stay"
    EXIT = "exit"
    STOP_POD = "stop-pod"

    @classmethod
    def default(cls, on_runpod: bool, can_stop: bool = True) -> AfterRun:
        """On RunPod a pod stops itself (with the key RunPod injects), or stays without one:
        an idle pod bills as much as a busy one, so staying is only the fallback."""
        if not on_runpod:
            return cls.EXIT
        return cls.STOP_POD if can_stop else cls.STAY

    @property
    def meaning(self) -> str:
        return _AFTER_RUN_MEANING[self]


_AFTER_RUN_MEANING = {
    AfterRun.STAY: "stay up idle until the pod is stopped (RunPod would otherwise start the "
                   "container again and run again; an idle pod bills as a busy one)",
    AfterRun.EXIT: "exit with the run's outcome (on RunPod the container is started again)",
    AfterRun.STOP_POD: "ask RunPod's API (v2) to stop this pod, which ends its GPU billing, with "
                       "the RUNPOD_API_KEY RunPod injects; refused, stay",
}


class OnNodeLoss(Named):
    """What the head does when a node of the running job is lost (PODAGENT_ON_NODE_LOSS)."""

    RESTART = "restart"  # stop the job at once; once the cluster is whole, submit it again
    WAIT = "wait"  # leave the job to decide; restart it if it fails
    FAIL = "fail"  # leave the job to decide, never restart

    @classmethod
    def default(cls, restarts: int) -> OnNodeLoss:
        return cls.RESTART if restarts else cls.FAIL


def one_of(described: list[str]) -> str:
    """'a, b or c'."""
    return " or ".join([", ".join(described[:-1]), described[-1]] if len(described) > 1
                       else described)


# A job in Ray's Jobs API is over once its status is one of these.
JOB_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


# The built-in reward server's scoring profiles (its --scoring, PODAGENT_REWARD_SCORING).
SCORING = ("openrlhf-m", "boxed", "openrlhf-boxed")

# What runs the job on every pod (PODAGENT_LAUNCHER): a Ray cluster the job is submitted to, or
# a launcher on every pod without Ray (`podagent torchrun` / `podagent accelerate`).
RAY_LAUNCHER = "ray"
LAUNCHERS = (RAY_LAUNCHER, "torchrun", "accelerate")

# What the head runs as its reward server (PODAGENT_REWARD): podagent's own server scoring by a
# profile, podagent's server serving the user's reward_func file, the user's own command, none.
REWARD_KINDS = ("builtin", "func", "cmd", "none")

# OpenRLHF-M's --prompt-template values (the reward server's --prompt-template,
# PODAGENT_REWARD_TEMPLATE); rewards.openrlhf_m gives each its assistant prefix.
PROMPT_TEMPLATES = ("chatml", "qwen1", "base")

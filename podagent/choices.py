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
    """What a pod does once its run is over for good (PODAGENT_AFTER_RUN)."""

    STAY = "stay"  # idle and healthy until the pod is stopped (RunPod restarts what exits)
    EXIT = "exit"  # exit with the run's code
    STOP_POD = "stop-pod"  # ask RunPod's API to stop this pod, then stay until it does

    @classmethod
    def default(cls, on_runpod: bool) -> AfterRun:
        return cls.STAY if on_runpod else cls.EXIT


# A job in Ray's Jobs API is over once its status is one of these.
JOB_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


# The built-in reward server's scoring profiles (its --scoring, PODAGENT_REWARD_SCORING).
SCORING = ("openrlhf-m", "boxed")

# OpenRLHF-M's --prompt-template values (the reward server's --prompt-template,
# PODAGENT_REWARD_TEMPLATE); rewards.openrlhf_m gives each its assistant prefix.
PROMPT_TEMPLATES = ("chatml", "qwen1", "base")

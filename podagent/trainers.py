"""The trainers a job may run, read from the job's own command line: one row per trainer in
TRAINERS, and from it what podagent derives for the job (a `Profile`): the arguments that
resume it from its checkpoint (none where the trainer resumes by itself), the checkpoint
directory it writes (its own option, when PODAGENT_CHECKPOINT_DIR is unset) and where it sends
its rewards (checked against the head's reward server).

The facts, from each trainer's own parser or config:
- OpenRLHF from 0.10.2 (openrlhf/cli/train_ppo_*.py): dotted options without aliases,
  `--ckpt.load_enable` (a switch), `--ckpt.path DIR`, `--reward.remote_url URL`.
- OpenRLHF before 0.10.2, and OpenRLHF-M (a fork of it): `--load_checkpoint`, `--ckpt_path
  DIR`, `--remote_rm_url URL`.
- verl (verl.trainer.main_ppo, Hydra `key=value` overrides): `trainer.resume_mode` is `auto`
  by default, so it resumes from `trainer.default_local_dir` by itself and a flag appended to
  its command line breaks it; its reward function is `reward.custom_reward_function.path`
  (before: `custom_reward_function.path`, still read).
- Any other script: `--load_checkpoint` (podagent's resume flag before the profiles), and no
  checkpoint or reward option podagent could know.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The variable the head gives the job with its reward server's URL (cluster/job_spec.py).
REWARD_URL_VARIABLE = "REMOTE_RM_URL"
# The file verl loads its reward function from when it asks the head's server.
VERL_REWARD_CLIENT = "podagent/rewards/client.py"

_DOTTED = re.compile(r"--[a-z0-9_]+\.[a-z0-9_.]+(=|$)")  # --ckpt.path, --reward.remote_url=...


@dataclass(frozen=True)
class Trainer:
    """One trainer: how its command line is recognised, and the options podagent reads or
    adds. `hydra`: options are `key=value` overrides, not `--flag value`."""
    name: str
    title: str
    recognise: Callable[[Sequence[str]], bool]
    resume: tuple[str, ...]  # appended to resume from a checkpoint; () where it resumes itself
    checkpoint: tuple[str, ...] = ()  # the options that name its checkpoint directory
    reward: tuple[str, ...] = ()  # the options that say where its rewards come from
    hydra: bool = False
    resumes_itself: str = ""  # why nothing is appended, said where the flag would be


def _runs(module: str) -> Callable[[Sequence[str]], bool]:
    return lambda argv: any(module in arg for arg in argv)


def _openrlhf_today(argv: Sequence[str]) -> bool:
    return _runs("openrlhf.cli.")(argv) and any(_DOTTED.match(arg) for arg in argv)


TRAINERS: tuple[Trainer, ...] = (  # the first that recognises the job is its trainer
    Trainer("openrlhf", "OpenRLHF 0.10.2 or newer", _openrlhf_today,
            resume=("--ckpt.load_enable",), checkpoint=("--ckpt.path",),
            reward=("--reward.remote_url",)),
    Trainer("openrlhf-flat", "OpenRLHF before 0.10.2, or OpenRLHF-M", _runs("openrlhf.cli."),
            resume=("--load_checkpoint",), checkpoint=("--ckpt_path",),
            reward=("--remote_rm_url",)),
    Trainer("verl", "verl", _runs("verl.trainer."), resume=(),
            checkpoint=("trainer.default_local_dir",),
            reward=("reward.custom_reward_function.path", "custom_reward_function.path"),
            hydra=True,
            resumes_itself="verl resumes by itself (trainer.resume_mode=auto)"),
    Trainer("script", "a script of your own", lambda argv: True, resume=("--load_checkpoint",)),
)
TRAINER_BY_NAME = {trainer.name: trainer for trainer in TRAINERS}


@dataclass(frozen=True)
class Profile:
    """What the job's command line says, read once."""
    trainer: Trainer
    checkpoint_dir: str | None  # the job's own checkpoint option's value
    reward: tuple[str, str] | None  # (the option, its value) where the job names one

    def describe(self) -> str:
        parts = [f"{self.trainer.title} ({self.trainer.name})"]
        if self.trainer.resumes_itself:
            parts.append(self.trainer.resumes_itself)
        elif self.trainer.resume:
            parts.append(f"resumes with {' '.join(self.trainer.resume)}")
        if self.checkpoint_dir:
            parts.append(f"checkpoints in {self.checkpoint_dir} ({self.trainer.checkpoint[0]})")
        return "; ".join(parts)

    def reward_warning(self, served: bool, url: str) -> str | None:
        """One line when the job would not ask the head's reward server (at `url`, served),
        naming the option to use; None when it does, or when nothing can be told (a value
        made of a variable is the shell's to expand)."""
        trainer = self.trainer
        if not served or not trainer.reward:
            return None
        option = trainer.reward[0]
        if trainer.hydra:
            wanted = f"{option}=<the path of {VERL_REWARD_CLIENT}>"
            if self.reward is None:
                return (f"the job ({trainer.name}) names no reward function, so it will not "
                        f"ask the head's reward server at {url}: add {wanted} "
                        f"(docs/reward-server.md)")
            if "$" not in self.reward[1] and not self.reward[1].endswith(VERL_REWARD_CLIENT):
                return (f"the job's {self.reward[0]}={self.reward[1]} is not podagent's "
                        f"client: its rewards do not come from the head's server at {url}")
            return None
        given = f"{option} ${REWARD_URL_VARIABLE}"
        if self.reward is None:
            return (f"the job ({trainer.title}) has no {option}, so it will not ask the head's "
                    f"reward server at {url}: add {given}")
        if self.reward[1] == url or "$" in self.reward[1]:  # $REMOTE_RM_URL, or not known here
            return None
        return (f"the job sends its rewards to {self.reward[0]} {self.reward[1]}, not to the "
                f"head's reward server at {url}: use {given}")


def words(job: Sequence[str]) -> list[str]:
    """The job's words, a shell command (`bash -c "python -m ..."`) split as well."""
    out: list[str] = []
    for arg in job:
        if any(ch.isspace() for ch in arg):
            try:
                out.extend(shlex.split(arg))
                continue
            except ValueError:  # unbalanced quotes: read it as one word
                pass
        out.append(arg)
    return out


def _value(argv: Sequence[str], options: Sequence[str], hydra: bool) -> tuple[str, str] | None:
    """(option, value) of the last of `options` the command line gives."""
    found = None
    for i, arg in enumerate(argv):
        for option in options:
            if hydra:
                key, eq, value = arg.lstrip("+").partition("=")
                if eq and key == option:
                    found = (option, value)
            elif arg == option and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                found = (option, argv[i + 1])
            elif arg.startswith(option + "="):
                found = (option, arg[len(option) + 1:])
    return found


def read(job: Sequence[str]) -> Profile:
    """The job's trainer and what its command line names."""
    argv = words(job)
    trainer = next(t for t in TRAINERS if t.recognise(argv))
    checkpoint = _value(argv, trainer.checkpoint, trainer.hydra)
    # A value made of a variable ($CKPT, ${trainer.project_name}) is not known here.
    directory = checkpoint[1] if checkpoint and "$" not in checkpoint[1] else None
    return Profile(trainer, directory, _value(argv, trainer.reward, trainer.hydra))

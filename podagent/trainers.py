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
- Any other script: `--load_checkpoint` (podagent's resume flag before the profiles) when Ray
  runs it, and no checkpoint or reward option podagent could know. Run by torchrun or
  accelerate it gets no flag unless PODAGENT_RESUME_FLAG names one: such scripts commonly
  resume themselves, and argparse refuses an option it does not know.

A job is often a shell command (`bash -c "cd /w && python -m openrlhf..."`): bash makes an
argument after the command string `$0`, never an argument of the trainer, so the resume flag
is placed inside the string, at the end of the simple command that runs the trainer
(`with_args()`, reading the string with shell_command.py), or not at all where that command
cannot be told with certainty.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from podagent import shell_command
from podagent.choices import RAY_LAUNCHER

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
    launched_resume: tuple[str, ...] | None = None  # under torchrun/accelerate (None: `resume`)

    def resume_for(self, launcher: str) -> tuple[str, ...]:
        """The resume arguments this trainer gets by default under `launcher`."""
        if launcher != RAY_LAUNCHER and self.launched_resume is not None:
            return self.launched_resume
        return self.resume


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
    Trainer("script", "a script of your own", lambda argv: True, resume=("--load_checkpoint",),
            launched_resume=()),
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
    """The job's words, a shell command string (`bash -c "python -m ...; echo"`) split as the
    shell reads it: its comments left out, its operators (`;`, `&&`, `|`) words of their own.
    A string that cannot be read is one word."""
    out: list[str] = []
    for arg in job:
        if any(ch.isspace() for ch in arg):
            try:
                out.extend(_string_words(arg))
                continue
            except ValueError:  # unbalanced quotes, a here-document: read it as one word
                pass
        out.append(arg)
    return out


def _string_words(text: str) -> list[str]:
    found: list[str] = []
    for segment in shell_command.segments(text):
        found.extend(shell_command.split_words(text[segment.start:segment.end]))
        found.append(";")
    return found[:-1]


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


# --- the resume step placed where the trainer gets it -------------------------------------------

# What runs a trainer in a script of your own: a Python, a launcher, a .py file.
_PROGRAM = re.compile(r"(python[0-9.]*|torchrun|deepspeed|accelerate|.*\.py)$")


def _runs_a_program(found: Sequence[str]) -> bool:
    return bool(found) and bool(_PROGRAM.match(os.path.basename(found[0])))


def _training(found: list[shell_command.Segment]) -> list[shell_command.Segment]:
    """Of several commands, those whose words say `train` (train.py, train_ppo_ray), if any."""
    if len(found) < 2:
        return found
    return [s for s in found if any("train" in w for w in s.words)] or found


def _trainer_segment(script: str, trainer: Trainer) -> shell_command.Segment:
    """The simple command of a command string that runs the trainer: the last one its row
    recognises (of several, the last whose words say `train`); for a script of your own, the
    one command that runs a program (a Python, a launcher, a .py file), or of several the one
    whose words say `train`. Raises
    shell_command.Unreadable (saying why) where none can be told."""
    found = shell_command.segments(script)
    if trainer.name != "script":
        recognised = _training([s for s in found if trainer.recognise(s.words)])
        if recognised:
            return recognised[-1]
    programs = _training([s for s in found if _runs_a_program(s.words)])
    if len(programs) == 1:
        return programs[0]
    if not programs:
        raise shell_command.Unreadable("no command in it runs a Python, a launcher or a .py "
                                       "file")
    raise shell_command.Unreadable(
        f"{len(programs)} of its commands could be the trainer: "
        + "; ".join(shlex.join(s.words[:3]) for s in programs))


def with_args(job: Sequence[str], args: Sequence[str], trainer: Trainer) -> tuple[str, ...]:
    """The job with `args` given to its trainer: appended to the argv, or, for a shell job,
    placed at the end of the simple command in its command string that runs the trainer,
    quoted as that shell reads them. Raises ValueError (shell_command.Unreadable, saying why)
    where that command cannot be told with certainty."""
    job = tuple(job)
    if not args:
        return job
    at = shell_command.command_string_index(job)
    if at is None:
        return (*job, *args)
    script = job[at]
    end = shell_command.end_of_words(script, _trainer_segment(script, trainer))
    placed = f"{script[:end]} {shlex.join(args)}{script[end:]}"
    return (*job[:at], placed, *job[at + 1:])


def has_args(job: Sequence[str], args: Sequence[str], trainer: Trainer) -> bool:
    """Whether the trainer's own command already has `args[0]` (a shell job: the command of
    its string that runs the trainer, not a comment or an `echo`)."""
    job = tuple(job)
    try:
        at = shell_command.command_string_index(job)
        if at is not None:
            return args[0] in _trainer_segment(job[at], trainer).words
    except ValueError:
        return False
    return args[0] in job


def pipe_warning(job: Sequence[str], trainer: Trainer) -> str | None:
    """One line when a shell job pipes its trainer's output (`... | tee log`) without
    pipefail: the job's exit code is then the pipe's last command's, so a failed or lost
    training ends the job as a success (and is not restarted). None otherwise."""
    try:
        at = shell_command.command_string_index(job)
        if at is None or any("pipefail" in arg for arg in job):
            return None
        script = job[at]
        segment = _trainer_segment(script, trainer)
    except ValueError:
        return None
    if not shell_command.piped(script, segment):
        return None
    return (f"the job pipes its trainer's output ({script[segment.end:].strip()[:40]!r}) "
            f"without pipefail: its exit code is the pipe's last command's, so a failed "
            f"training would end the job as SUCCEEDED, never restarted; run it with "
            f"`bash -o pipefail -c ...` or put `set -o pipefail;` first in it")

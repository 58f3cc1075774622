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
(`with_args()`).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    """The job's words, a shell command (`bash -c "python -m ...; echo"`) split as well, its
    operators (`;`, `&&`, `|`) words of their own."""
    out: list[str] = []
    for arg in job:
        if any(ch.isspace() for ch in arg):
            try:
                out.extend(_shell_words(arg))
                continue
            except ValueError:  # unbalanced quotes: read it as one word
                pass
        out.append(arg)
    return out


def _shell_words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


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

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
_SHELL_OPTION_ARG = frozenset({"-o", "+o", "-O", "+O", "--rcfile", "--init-file"})
# Words that start a simple command without being the program it runs.
_PREFIX_WORDS = frozenset({"exec", "time", "then", "else", "do", "{", "!", "nohup", "env"})
# Commands of a shell script that set the stage and are no training.
_SETUP_COMMANDS = frozenset({"cd", "source", ".", "export", "set", "unset", "echo", "printf",
                             "true", "false", "wait", "fi", "done", "}", "ulimit", "mkdir",
                             "trap", "sleep", "tee", "cat", "ls", "pip", "uv", "nvidia-smi"})
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def shell_script_index(job: Sequence[str]) -> int | None:
    """Where the command string of a shell job is (`bash -c STRING`, `bash -lc STRING`,
    `env A=1 sh -euc STRING`), or None when the job is not one."""
    i = 0
    if job and os.path.basename(job[0]) == "env":
        i = 1
        while i < len(job) and _ASSIGNMENT.match(job[i]):
            i += 1
    if i >= len(job) or os.path.basename(job[i]) not in SHELLS:
        return None
    i += 1
    command_string = False
    while i < len(job):
        arg = job[i]
        if arg == "--":
            i += 1
            break
        if arg in _SHELL_OPTION_ARG:
            i += 2
            continue
        if arg.startswith("--") or (arg[:1] in "-+" and len(arg) > 1):
            command_string = command_string or (arg[0] == "-" and not arg.startswith("--")
                                                 and "c" in arg[1:])
            i += 1
            continue
        break
    return i if command_string and i < len(job) else None


def _segments(script: str) -> list[tuple[int, int]]:
    """(start, end) of each simple command of a shell script, as offsets into it: the text
    between the operators `;` `&` `|` `(` `)` and newlines, quotes, `$( )` and backticks
    honoured, a comment cut off. Raises ValueError where quoting does not close."""
    out: list[tuple[int, int]] = []
    start, i, n = 0, 0, len(script)

    def close(end: int) -> None:
        out.append((start, end))

    while i < n:
        ch = script[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "'":
            j = script.find("'", i + 1)
            if j < 0:
                raise ValueError("a single quote does not close")
            i = j + 1
            continue
        if ch == '"':
            i = _skip_double(script, i + 1)
            continue
        if ch == "`":
            j = script.find("`", i + 1)
            if j < 0:
                raise ValueError("a backquote does not close")
            i = j + 1
            continue
        if ch == "$" and script.startswith("(", i + 1):
            i = _skip_parens(script, i + 2)
            continue
        if ch == "#" and (i == start or script[i - 1].isspace()):
            j = script.find("\n", i)
            close(i)
            i = n if j < 0 else j
            start = i
            continue
        if ch == "&" and (script[i - 1:i] in ("<", ">") or script[i + 1:i + 2] == ">"):
            i += 1  # a redirection (2>&1, &>log), not an operator
            continue
        if ch in ";&|()\n":
            close(i)
            i += 1
            start = i
            continue
        i += 1
    close(n)
    return out


def _skip_double(script: str, i: int) -> int:
    """The offset after the double quote that closes one opened before `i`."""
    while i < len(script):
        ch = script[i]
        if ch == "\\":
            i += 2
        elif ch == '"':
            return i + 1
        elif ch == "$" and script.startswith("(", i + 1):
            i = _skip_parens(script, i + 2)
        else:
            i += 1
    raise ValueError("a double quote does not close")


def _skip_parens(script: str, i: int) -> int:
    """The offset after the `)` that closes a `$(` opened before `i`."""
    depth = 1
    while i < len(script):
        ch = script[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "'":
            j = script.find("'", i + 1)
            if j < 0:
                break
            i = j + 1
            continue
        if ch == '"':
            i = _skip_double(script, i + 1)
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        i += 1
        if depth == 0:
            return i
    raise ValueError("a $( does not close")


def _command_words(text: str) -> list[str]:
    """The words of one simple command from the program on (assignments and `exec`, `time`,
    `then`... before it left out); [] when it has none."""
    try:
        found = _shell_words(text)
    except ValueError:
        return []
    while found and (found[0] in _PREFIX_WORDS or _ASSIGNMENT.match(found[0])):
        found.pop(0)
    return found


def _trainer_segment(script: str, trainer: Trainer) -> tuple[int, int] | None:
    """The simple command of the script that runs the trainer: the last one its row
    recognises, else (a script of your own) the last one that is not stage-setting (`cd`,
    `source`, `export`, `echo`, a pipe's `tee`...)."""
    recognised = other = None
    for start, end in _segments(script):
        found = _command_words(script[start:end])
        if not found or os.path.basename(found[0]) in _SETUP_COMMANDS:
            continue
        other = (start, end)
        if trainer.name != "script" and trainer.recognise(found):
            recognised = (start, end)
    return recognised or other


def _end_of_words(script: str, start: int, end: int) -> int:
    """The offset after a command's last word: its trailing blanks and line continuations
    (a backslash before a newline) left after the insertion point."""
    while end > start:
        blank = script[end - 1] in " \t\n"
        continued = (script[end - 1] == "\\" and end < len(script)
                     and script[end] == "\n")
        if not (blank or continued):
            break
        end -= 1
    return end


def with_args(job: Sequence[str], args: Sequence[str], trainer: Trainer) -> tuple[str, ...]:
    """The job with `args` given to its trainer: appended to the argv, or, for a shell job,
    placed at the end of the simple command in its command string that runs the trainer,
    quoted as that shell reads them. Raises ValueError (saying why) where no such command
    can be told."""
    job = tuple(job)
    if not args:
        return job
    at = shell_script_index(job)
    if at is None:
        return (*job, *args)
    script = job[at]
    segment = _trainer_segment(script, trainer)
    if segment is None:
        raise ValueError(f"no command in the shell command string {script!r} runs the "
                         f"trainer")
    end = _end_of_words(script, *segment)
    placed = f"{script[:end]} {shlex.join(args)}{script[end:]}"
    return (*job[:at], placed, *job[at + 1:])


def pipe_warning(job: Sequence[str], trainer: Trainer) -> str | None:
    """One line when a shell job pipes its trainer's output (`... | tee log`) without
    pipefail: the job's exit code is then the pipe's last command's, so a failed or lost
    training ends the job as a success (and is not restarted). None otherwise."""
    at = shell_script_index(job)
    if at is None or any("pipefail" in arg for arg in job):
        return None
    script = job[at]
    try:
        segment = _trainer_segment(script, trainer)
    except ValueError:
        return None
    if segment is None:
        return None
    end = segment[1]
    if script[end:end + 1] != "|" or script[end + 1:end + 2] == "|":
        return None
    return (f"the job pipes its trainer's output ({script[end:].strip()[:40]!r}) without "
            f"pipefail: its exit code is the pipe's last command's, so a failed training "
            f"would end the job as SUCCEEDED, never restarted; run it with "
            f"`bash -o pipefail -c ...` or put `set -o pipefail;` first in it")

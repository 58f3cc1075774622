"""Resuming from a checkpoint, the same for every launcher: does the checkpoint directory hold
one, which arguments resume the job (the trainer's, or PODAGENT_RESUME_FLAG), and the job's
command with them placed where the trainer gets them (inside a `bash -c` string too).

The contract (docs/running.md, "Resuming from a checkpoint"): every start of the job (the
first, a restart after a lost pod or a hang, a restarted container's) while the checkpoint
directory holds a checkpoint gets the resume arguments, unless PODAGENT_RESUME=never or the
job already has them; verl, and a script of your own under torchrun or accelerate, get none
unless PODAGENT_RESUME_FLAG names them (they resume by themselves).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from podagent import trainers
from podagent.config import Settings
from podagent.report import Reporter
from podagent.wire import Event


@dataclass(frozen=True)
class Resume:
    command: tuple[str, ...]  # the job as it runs: with the resume arguments, or as it was
    args: tuple[str, ...]  # what was added; empty: it starts (or resumes by itself) as it is
    reason: str  # one line for the user; empty when there is nothing to say
    warning: bool = False  # the reason is a warning: a checkpoint is there, the flag is not


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest entry of the directory, ignoring hidden ones (editors', W&B's, lock files)
    and entries that cannot be read: a `latest` link to a step that was pruned points nowhere,
    and is no checkpoint to resume from."""
    try:
        entries = [p for p in directory.iterdir() if not p.name.startswith(".")]
    except OSError:  # missing or unreadable: no checkpoint to resume from
        return None
    found: list[tuple[float, Path]] = []
    for entry in entries:
        try:
            found.append((entry.stat().st_mtime, entry))
        except OSError:  # a dangling link, or gone since it was listed (pruned meanwhile)
            continue
    return max(found, default=(0.0, None))[1]


def _trainer(settings: Settings) -> trainers.Trainer:
    return settings.profile.trainer if settings.profile else trainers.TRAINER_BY_NAME["script"]


def resume(settings: Settings, job: Sequence[str]) -> Resume:
    """`job` (the Ray job's entrypoint, or the script a launcher runs with its arguments) as
    it starts now, and why."""
    job = tuple(job)
    if not settings.checkpoint_dir:
        return Resume(job, (), "")
    directory = Path(settings.checkpoint_dir)
    found = latest_checkpoint(directory)
    if found is None:
        return Resume(job, (), f"no checkpoint in {directory}: the job starts fresh")
    if settings.resume == "never":
        return Resume(job, (), f"{directory} holds a checkpoint ({found.name}); not resuming "
                               f"because PODAGENT_RESUME=never")
    flag = settings.resume_flag
    if not flag:
        itself = settings.profile.trainer.resumes_itself if settings.profile else ""
        return Resume(job, (), f"{directory} holds a checkpoint ({found.name}); "
                               f"{itself or 'no resume flag (PODAGENT_RESUME_FLAG)'}: the job "
                               f"is left as it is")
    if trainers.has_args(job, flag, _trainer(settings)):
        return Resume(job, (), f"the job already has {flag[0]}: left as it is")
    try:
        command = trainers.with_args(job, flag, _trainer(settings))
    except ValueError as exc:
        return Resume(job, (), f"{directory} holds a checkpoint ({found.name}), but "
                               f"{shlex.join(flag)} has no certain place in the job's shell "
                               f"command ({exc}): it starts without it; give the trainer its "
                               f"resume flag yourself, or make its command the only one that "
                               f"runs a program", warning=True)
    return Resume(command, flag, f"resuming: {directory} holds a checkpoint ({found.name}), so "
                                 f"the job gets {shlex.join(flag)}")


def starting(settings: Settings, job: Sequence[str], reporter: Reporter) -> Resume:
    """How `job` starts now (`resume()`), said in one line, with the `resume` event when it
    resumes; a shell job whose pipe would hide its trainer's failure is warned of."""
    found = resume(settings, job)
    piped = trainers.pipe_warning(job, _trainer(settings))
    if piped:
        reporter.warn(piped)
    if found.warning:
        reporter.warn(found.reason)
    elif found.reason:
        reporter.say(found.reason)
    if found.args:
        reporter.event(Event.RESUME, checkpoint_dir=settings.checkpoint_dir, args=list(found.args))
    return found


def as_told(settings: Settings, job: Sequence[str], args: Sequence[str],
            reporter: Reporter) -> tuple[str, ...]:
    """`job` with the resume arguments another pod decided (a run without Ray's head, for
    every pod alike: ranks of one run never start at different steps), said in one line."""
    job = tuple(job)
    if not args:
        return job
    try:
        command = trainers.with_args(job, args, _trainer(settings))
    except ValueError as exc:
        reporter.warn(f"the head resumes the training with {shlex.join(args)}, which has no "
                      f"certain place in this pod's job ({exc}): it starts without it")
        return job
    reporter.say(f"resuming as the head decided: the training gets {shlex.join(args)}")
    reporter.event(Event.RESUME, checkpoint_dir=settings.checkpoint_dir, args=list(args))
    return command

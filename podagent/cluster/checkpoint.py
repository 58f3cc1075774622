"""Resume from a checkpoint: does the checkpoint directory already hold one?"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from podagent.config import Settings


@dataclass(frozen=True)
class Resume:
    args: tuple[str, ...]  # appended to the job's entrypoint; empty: start fresh
    reason: str  # one line for the user; empty when there is nothing to say


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


def resume_args(settings: Settings) -> Resume:
    if not settings.checkpoint_dir:
        return Resume((), "")
    directory = Path(settings.checkpoint_dir)
    found = latest_checkpoint(directory)
    if found is None:
        return Resume((), f"no checkpoint in {directory}: the job starts fresh")
    if settings.resume == "never":
        return Resume((), f"{directory} holds a checkpoint ({found.name}); not resuming "
                          f"because PODAGENT_RESUME=never")
    flag = settings.resume_flag
    if not flag:
        itself = settings.profile.trainer.resumes_itself if settings.profile else ""
        return Resume((), f"{directory} holds a checkpoint ({found.name}); "
                          f"{itself or 'no resume flag (PODAGENT_RESUME_FLAG)'}: the job is "
                          f"left as it is")
    if settings.job and flag[0] in settings.job:
        return Resume((), f"the job already has {flag[0]}: left as it is")
    return Resume(flag, f"resuming: {directory} holds a checkpoint ({found.name}), so the job "
                        f"gets {' '.join(flag)}")

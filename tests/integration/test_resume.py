"""Checkpoint resume: a job writes a checkpoint and is stopped; started again (beside a link
that points nowhere), it gets the resume flag, and podagent says why."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tests.integration.conftest import Runs, wait_for

SAVE_ONCE = Path(__file__).resolve().parents[1] / "jobs" / "save_once.py"


def test_a_stopped_job_restarts_with_the_resume_flag(podagent_runs: Runs) -> None:
    first = podagent_runs.new("ckpt1")
    checkpoints = first.scratch / "checkpoints"
    checkpoints.mkdir(parents=True)
    script = SAVE_ONCE
    env = {"PODAGENT_CHECKPOINT_DIR": str(checkpoints), "PODAGENT_REWARD": "none"}
    with first.running(["head", "--", sys.executable, str(script)], env=env):
        wait_for(lambda: first.read("job.log"), lambda log: "saved" in log, timeout=180,
                 what="the job's 'saved' line")
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(60) == 143, first.stdout[-3000:]
    assert "ARGV []" in first.read("job.log")
    assert f"no checkpoint in {checkpoints}: the job starts fresh" in first.stdout
    assert (checkpoints / "step-1" / "model.txt").read_text() == "weights"  # it survived

    # A trainer's `latest` link to a step it pruned since: no checkpoint, and no crash.
    (checkpoints / "latest").symlink_to(checkpoints / "step-0")
    second = podagent_runs.new("ckpt2")
    second.execute(["head", "--", sys.executable, str(script)], env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    out = second.stdout
    assert (f"resuming: {checkpoints} holds a checkpoint (step-1), so the job gets "
            f"--load_checkpoint") in out
    assert "ARGV ['--load_checkpoint']" in out and "resumed from ['model.txt']" in out
    (resume,) = second.events_named("resume")
    assert resume["args"] == ["--load_checkpoint"]

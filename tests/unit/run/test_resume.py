"""When a job resumes: PODAGENT_RESUME, PODAGENT_RESUME_FLAG and what the directory holds; where
the flag goes in the job (a shell command's string too), proven by what the trainer receives."""

from __future__ import annotations

import os

import pytest

from podagent import config
from podagent.errors import ConfigError
from podagent.run import resume as resuming


def _settings(directory, **env):
    return config.build({}, {"PODAGENT_CHECKPOINT_DIR": str(directory), **env},
                        job_argv=("python", "train.py"))


def _resumed(settings):
    return resuming.resume(settings, settings.job)


def test_empty_or_missing_directory_starts_fresh(tmp_path):
    for directory in (tmp_path, tmp_path / "missing"):
        resume = _resumed(_settings(directory))
        assert resume.args == () and "starts fresh" in resume.reason


def test_hidden_entries_are_not_checkpoints(tmp_path):
    (tmp_path / ".lock").write_text("")
    assert _resumed(_settings(tmp_path)).args == ()


def test_a_checkpoint_gives_the_flag_and_names_the_newest(tmp_path):
    old, new = tmp_path / "step-1", tmp_path / "step-2"
    old.mkdir()
    new.mkdir()
    os.utime(old, (1, 1))
    resume = _resumed(_settings(tmp_path))
    assert resume.args == ("--load_checkpoint",)
    assert "(step-2)" in resume.reason


def test_a_link_to_a_pruned_step_is_no_checkpoint_and_no_crash(tmp_path):
    """A trainer's `latest` link outlives the step it pointed at; another entry vanishes
    between the listing and its stat (pruned meanwhile): both are passed over."""
    (tmp_path / "latest").symlink_to(tmp_path / "step-0")
    assert _resumed(_settings(tmp_path)).args == ()
    (tmp_path / "step-3").mkdir()
    resume = _resumed(_settings(tmp_path))
    assert resume.args == ("--load_checkpoint",) and "(step-3)" in resume.reason


@pytest.mark.parametrize(("env", "args", "said"), [
    ({"PODAGENT_RESUME": "never"}, (), "PODAGENT_RESUME=never"),
    ({"PODAGENT_RESUME_FLAG": "--resume-from latest"}, ("--resume-from", "latest"), "resuming"),
])
def test_policy_and_flag_settings(tmp_path, env, args, said):
    (tmp_path / "ckpt.pt").write_text("x")
    resume = _resumed(_settings(tmp_path, **env))
    assert resume.args == args and said in resume.reason


def test_a_job_that_already_has_the_flag_is_left_alone(tmp_path):
    (tmp_path / "ckpt.pt").write_text("x")
    settings = config.build({}, {"PODAGENT_CHECKPOINT_DIR": str(tmp_path)},
                            job_argv=("python", "train.py", "--load_checkpoint"))
    resume = _resumed(settings)
    assert resume.args == () and "already has --load_checkpoint" in resume.reason


def test_default_directory_is_the_volume_or_none(tmp_path):
    settings = config.build({}, {}, job_argv=("python", "train.py"))
    if os.path.isdir("/workspace"):  # RunPod's volume
        assert settings.checkpoint_dir == "/workspace/checkpoints"
    else:
        assert settings.checkpoint_dir is None
        assert _resumed(settings) == resuming.Resume(settings.job, (), "")


def test_bad_resume_setting_is_bad_input():
    with pytest.raises(ConfigError, match="PODAGENT_RESUME='sometimes' must be one of"):
        config.build({}, {"PODAGENT_RESUME": "sometimes"})

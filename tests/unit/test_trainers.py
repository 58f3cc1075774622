"""The trainers' profiles: every restarted job command podagent builds is one its trainer's
parser accepts.

The parsers here are our own, written from each trainer's published parser (openrlhf/cli/
train_ppo_ray.py of OpenRLHF 0.10.2 on and of 0.10.1, and of OpenRLHF-M): argparse without
abbreviations or aliases, exiting on an unknown argument as theirs do. verl's Hydra command
line must come back unchanged: verl resumes by itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import subprocess

import pytest

from podagent import config, trainers
from podagent.cluster import job_spec
from podagent.config.parsers import command_line
from podagent.report import Reporter

HEAD_URL = "http://10.0.0.1:5000/get_reward"


def openrlhf_today() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--actor.model_name_or_path", type=str)
    parser.add_argument("--ckpt.path", type=str, default="./ckpt/checkpoints_ppo_ray")
    parser.add_argument("--ckpt.load_enable", action="store_true", default=False)
    parser.add_argument("--ckpt.save_steps", type=int, default=-1)
    parser.add_argument("--reward.remote_url", type=str, default=None)
    return parser


def openrlhf_flat() -> argparse.ArgumentParser:
    """OpenRLHF before 0.10.2, and OpenRLHF-M: the same flat options."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--pretrain", type=str)
    parser.add_argument("--ckpt_path", type=str, default="./ckpt/checkpoints_ppo_ray")
    parser.add_argument("--load_checkpoint", action="store_true", default=False)
    parser.add_argument("--save_steps", type=int, default=-1)
    parser.add_argument("--remote_rm_url", type=str, default=None)
    return parser


MODULE = ("python3", "-m", "openrlhf.cli.train_ppo_ray")
JOBS = {
    "openrlhf": ((*MODULE, "--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--ckpt.path",
                  "{ckpt}", "--ckpt.save_steps", "20", "--reward.remote_url",
                  "$REMOTE_RM_URL"), openrlhf_today),
    "openrlhf-flat": ((*MODULE, "--pretrain", "Qwen/Qwen2.5-7B", "--ckpt_path", "{ckpt}",
                       "--save_steps", "20", "--remote_rm_url", "$REMOTE_RM_URL"),
                      openrlhf_flat),
}


def _restarted(job: tuple[str, ...], env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The entrypoint the head submits after a lost pod, a checkpoint being there."""
    settings = config.build({"job": " ".join(job)}, env or {})
    return job_spec.entrypoint(settings, Reporter("head", "pod", None, stream=io.StringIO()))


@pytest.mark.parametrize("name", sorted(JOBS))
def test_a_restarted_openrlhf_job_is_one_its_parser_accepts(name, tmp_path):
    (tmp_path / "global_step20").mkdir()
    template, parser = JOBS[name]
    job = tuple(arg.replace("{ckpt}", str(tmp_path)) for arg in template)
    restarted = _restarted(job)
    assert restarted[:len(job)] == job and len(restarted) == len(job) + 1
    args = vars(parser().parse_args(list(restarted[len(MODULE):])))
    assert args["ckpt.load_enable" if name == "openrlhf" else "load_checkpoint"] is True
    # the checkpoints watched are the job's own, without PODAGENT_CHECKPOINT_DIR
    assert config.build({"job": " ".join(job)}, {}).checkpoint_dir == str(tmp_path)


def test_the_flag_of_before_is_refused_by_todays_openrlhf():
    """Why the profiles exist: podagent's old default broke today's restarted jobs."""
    with pytest.raises(SystemExit):
        openrlhf_today().parse_args(["--load_checkpoint"])


def test_a_verl_job_comes_back_unchanged_it_resumes_itself(tmp_path):
    (tmp_path / "global_step_40").mkdir()
    job = ("python3", "-m", "verl.trainer.main_ppo", "trainer.nnodes=2",
           f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=auto")
    assert _restarted(job) == job
    settings = config.build({"job": " ".join(job)}, {})
    assert settings.checkpoint_dir == str(tmp_path) and settings.resume_flag == ()


def test_the_users_settings_win_over_what_the_job_says(tmp_path):
    (tmp_path / "step1").mkdir()
    template, _ = JOBS["openrlhf"]
    job = tuple(arg.replace("{ckpt}", "/elsewhere") for arg in template)
    settings = config.build({"job": " ".join(job)}, {
        "PODAGENT_CHECKPOINT_DIR": str(tmp_path), "PODAGENT_RESUME_FLAG": "--ckpt.load_enable "
                                                                          "--ckpt.save_steps 5"})
    assert settings.checkpoint_dir == str(tmp_path)
    assert settings.resume_flag == ("--ckpt.load_enable", "--ckpt.save_steps", "5")
    assert settings.sources["resume_flag"] == "env"


def test_a_script_of_your_own_keeps_the_flag_of_before():
    settings = config.build({"job": "python train.py --epochs 3"}, {})
    assert settings.profile.trainer.name == "script"
    assert settings.resume_flag == ("--load_checkpoint",)


@pytest.mark.parametrize(("job", "trainer"), [
    ("bash -c 'cd /w && python -m openrlhf.cli.train_ppo_ray --ckpt.path /c'", "openrlhf"),
    ("python -m openrlhf.cli.train_ppo_ray --ckpt_path=/c", "openrlhf-flat"),
    ("deepspeed --module openrlhf.cli.train_ppo_ray --ckpt.path=/c --reward.remote_url=x",
     "openrlhf"),
    ("python3 -m verl.trainer.main_ppo +trainer.default_local_dir=/c", "verl"),
    ("python train.py --ckpt.path /c", "script"),  # not OpenRLHF: its options mean nothing here
])
def test_the_trainer_is_read_from_the_command_line_a_shell_command_too(job, trainer):
    profile = trainers.read(command_line(job))
    assert profile.trainer.name == trainer
    assert profile.checkpoint_dir == ("/c" if trainer != "script" else None)


@pytest.mark.parametrize(("job", "warned"), [
    ("python -m openrlhf.cli.train_ppo_ray --ckpt.path /c --reward.remote_url $REMOTE_RM_URL",
     None),
    (f"python -m openrlhf.cli.train_ppo_ray --ckpt.path /c --reward.remote_url {HEAD_URL}", None),
    ("python -m openrlhf.cli.train_ppo_ray --ckpt.path /c",
     "has no --reward.remote_url, so it will not ask the head's reward server at "
     f"{HEAD_URL}: add --reward.remote_url $REMOTE_RM_URL"),
    ("python -m openrlhf.cli.train_ppo_ray --remote_rm_url http://rm:9/get_reward",
     "the job sends its rewards to --remote_rm_url http://rm:9/get_reward, not to the head's "
     f"reward server at {HEAD_URL}: use --remote_rm_url $REMOTE_RM_URL"),
    ("python3 -m verl.trainer.main_ppo "
     "reward.custom_reward_function.path=/usr/lib/podagent/rewards/client.py", None),
    ("python3 -m verl.trainer.main_ppo custom_reward_function.path=/w/my_reward.py",
     "the job's custom_reward_function.path=/w/my_reward.py is not podagent's client"),
    ('python3 -m verl.trainer.main_ppo reward.custom_reward_function.path="$REWARD_CLIENT"',
     None),  # the docs' way: the shell expands it, podagent cannot tell
    ("python -m openrlhf.cli.train_ppo_ray --reward.remote_url ${MY_RM}", None),
    ("python3 -m verl.trainer.main_ppo trainer.nnodes=2",
     "names no reward function, so it will not ask the head's reward server"),
    ("python train.py", None),  # a script of its own: nothing to tell
])
def test_a_job_that_would_not_ask_the_heads_reward_server_gets_one_line(job, warned):
    profile = trainers.read(command_line(job))
    line = profile.reward_warning(True, HEAD_URL)
    assert (line is None) if warned is None else (warned in line), line
    assert profile.reward_warning(False, HEAD_URL) is None  # PODAGENT_REWARD=none


# --- the resume flag inside a shell command: what the trainer itself receives ---------------

FAKE_TRAINER = '''import json, os, sys
with open(os.environ["ARGV_OUT"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
'''
SHELL_JOBS = [
    # (the job as the user wrote it, the trainer's arguments once resumed)
    ("bash -c 'cd {w} && python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    ("bash -lc 'source {w}/env.sh; python -m openrlhf.cli.train_ppo_ray --ckpt.path {c} "
     "--actor.model_name_or_path \"Qwen 7B\" 2>&1 | tee {w}/log; echo done'",
     ["--ckpt.path", "{c}", "--actor.model_name_or_path", "Qwen 7B", "--ckpt.load_enable"]),
    ("bash -o pipefail -ec 'python -m openrlhf.cli.train_ppo_ray --ckpt.path={c} \\\n"
     "  --reward.remote_url $REMOTE_RM_URL # the trainer\n'",
     ["--ckpt.path={c}", "--reward.remote_url", "http://h:5000/get_reward",
      "--ckpt.load_enable"]),
    ("sh -c 'if true; then exec python -m openrlhf.cli.train_ppo_ray --ckpt_path {c}; fi'",
     ["--ckpt_path", "{c}", "--load_checkpoint"]),
    ("env A=1 bash -c 'X=$(echo \"a)b\") python -m openrlhf.cli.train_ppo_ray --ckpt_path {c}'",
     ["--ckpt_path", "{c}", "--load_checkpoint"]),
    ("python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    # the strict-mode idiom: -o takes pipefail, alone or last of a cluster
    ("bash -euo pipefail -c 'python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    ("bash -ceo pipefail 'python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    # wrappers in front of the shell
    ("env -u NOTHING timeout 600 nohup nice -n 1 bash -c "
     "'python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    # redirections and process substitution are no operators
    ("bash -c 'python -m openrlhf.cli.train_ppo_ray --ckpt.path {c} > >(cat > {w}/out) 2>&1'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    ("bash -c 'python -m openrlhf.cli.train_ppo_ray --ckpt.path {c} >| {w}/out'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    ("bash -c '[[ -d {w} && -n x ]] && python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    ("bash -c 'case a in a) python -m openrlhf.cli.train_ppo_ray --ckpt.path {c};; esac'",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    # a comment with an apostrophe, one naming the flag, an echo of it: today's OpenRLHF
    ("bash -c \"# don't touch (add --ckpt.load_enable by hand)\n"
     "echo --ckpt.load_enable; python -m openrlhf.cli.train_ppo_ray --ckpt.path {c}\"",
     ["--ckpt.path", "{c}", "--ckpt.load_enable"]),
    # a script of your own: the one command that runs a Python, not what comes after it
    ("bash -c 'python train.py --lr 1; rc=$?; exit $rc'", ["--lr", "1", "--load_checkpoint"]),
    ("bash -c 'python train.py --lr 1 || exit 1'", ["--lr", "1", "--load_checkpoint"]),
    ("bash -c 'python train.py --lr 1 && python upload.py'",
     ["--lr", "1", "--load_checkpoint"]),
    ("bash -c 'train() {{ python train.py --lr 1; }}; train'",
     ["--lr", "1", "--load_checkpoint"]),
]


@pytest.mark.parametrize(("job", "received"), SHELL_JOBS)
def test_a_resumed_shell_job_gives_the_flag_to_the_trainer_itself(job, received, tmp_path):
    """bash makes an argument after `-c STRING` its $0: the flag goes inside the string, at the
    end of the command that runs the trainer, and the trainer (a fake of its module, or a
    train.py) gets it among its own arguments; what follows (a pipe, a comment, more
    commands) is untouched, and the shell still exits as the trainer did."""
    work, ckpt = tmp_path / "w", tmp_path / "c"
    (work / "openrlhf" / "cli").mkdir(parents=True)
    for init in (work / "openrlhf", work / "openrlhf" / "cli"):
        (init / "__init__.py").write_text("")
    (work / "openrlhf" / "cli" / "train_ppo_ray.py").write_text(FAKE_TRAINER)
    (work / "train.py").write_text(FAKE_TRAINER)
    (work / "upload.py").write_text("import sys\nassert len(sys.argv) == 1, sys.argv\n")
    (work / "env.sh").write_text("export FROM_ENV_SH=1\n")
    (ckpt / "global_step20").mkdir(parents=True)
    fill = {"w": str(work), "c": str(ckpt)}
    settings = config.build({"job": job.format(**fill), "checkpoint_dir": str(ckpt)}, {})
    screen = io.StringIO()
    command = job_spec.entrypoint(settings, Reporter("head", "pod", None, stream=screen))
    assert "resuming: " in screen.getvalue(), screen.getvalue()
    out = tmp_path / "argv.jsonl"
    env = {**os.environ, "ARGV_OUT": str(out), "PYTHONPATH": str(work),
           "REMOTE_RM_URL": "http://h:5000/get_reward"}
    done = subprocess.run(command, env=env, cwd=work, timeout=60, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, (command, done.stderr)
    assert json.loads(out.read_text()) == [a.format(**fill) for a in received], command


@pytest.mark.parametrize("job", [
    "bash -c 'cd /w'",  # no command that runs anything
    "bash -c 'python -m openrlhf.cli.train_ppo_ray --ckpt.path /c \"unclosed'",
    "bash -c 'python train.py <<EOF\nsome input\nEOF\n'",  # a here-document
    "bash -c 'python prepare.py && python run.py'",  # which one is the trainer?
    "bash -euo pipefail -c",  # -c and no string
])
def test_a_shell_job_with_no_certain_place_for_the_flag_starts_as_it_is_and_says_so(job,
                                                                                   tmp_path):
    (tmp_path / "step1").mkdir()
    settings = config.build({"job": job, "checkpoint_dir": str(tmp_path),
                             "resume_flag": "--load_checkpoint"}, {})
    screen = io.StringIO()
    command = job_spec.entrypoint(settings, Reporter("head", "pod", None, stream=screen))
    assert command == settings.job
    assert "WARNING" in screen.getvalue() and "has no certain place" in screen.getvalue(), \
        screen.getvalue()


def test_a_resume_flag_given_by_the_user_is_quoted_whatever_it_holds(tmp_path):
    """PODAGENT_RESUME_FLAG's words reach the trainer as they are: no shell code in them
    runs."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "train.py").write_text(FAKE_TRAINER)
    (tmp_path / "c" / "step1").mkdir(parents=True)
    flag = "--from=$(touch PWNED) 'a;b' \"`id`\""
    settings = config.build({"job": "bash -c 'cd . && python train.py'",
                             "checkpoint_dir": str(tmp_path / "c"), "resume_flag": flag}, {})
    command = job_spec.entrypoint(settings, Reporter("head", "pod", None,
                                                     stream=io.StringIO()))
    out = tmp_path / "argv.jsonl"
    subprocess.run(command, env={**os.environ, "ARGV_OUT": str(out)}, cwd=work, timeout=60,
                   check=True)
    assert json.loads(out.read_text()) == shlex.split(flag)  # as the setting splits it
    assert not (work / "PWNED").exists()


def test_a_script_of_your_own_under_a_launcher_gets_no_flag_unless_asked(tmp_path):
    """torchrun/accelerate: such scripts resume by themselves; PODAGENT_RESUME_FLAG asks."""
    launched = config.build({"launcher": "torchrun"}, {}, job_argv=("train.py", "--lr", "1"))
    assert launched.resume_flag == () and "torchrun" in launched.sources["resume_flag"]
    asked = config.build({"launcher": "torchrun"}, {"PODAGENT_RESUME_FLAG": "--resume"},
                         job_argv=("train.py",))
    assert asked.resume_flag == ("--resume",)
    sft = config.build({"launcher": "torchrun"}, {},
                       job_argv=("-m", "openrlhf.cli.train_sft", "--ckpt_path", "/c"))
    assert sft.resume_flag == ("--load_checkpoint",) and sft.checkpoint_dir == "/c"


@pytest.mark.parametrize(("job", "warned"), [
    ("bash -c 'cd /w && python -m openrlhf.cli.train_ppo_ray --ckpt.path /c 2>&1 | tee l'",
     True),
    ("bash -c 'python train.py |& tee l'", True),
    ("bash -o pipefail -c 'python train.py | tee l'", False),
    ("bash -c 'set -euo pipefail; python train.py | tee l'", False),
    ("bash -c 'python train.py || echo failed'", False),  # no pipe: || is no pipe
    ("bash -c 'python train.py; echo done | tee l'", False),  # the trainer is not piped
    ("python train.py", False),
])
def test_a_shell_job_that_pipes_its_trainer_without_pipefail_is_warned_of(job, warned, tmp_path):
    """Without pipefail the pipe's last command is the job's exit code: a failed (or lost)
    training would end the job as SUCCEEDED and never be restarted; bash proves it."""
    settings = config.build({"job": job}, {})
    screen = io.StringIO()
    job_spec.entrypoint(settings, Reporter("head", "pod", None, stream=screen))
    said = "without pipefail" in screen.getvalue()
    assert said == warned, screen.getvalue()
    if warned:  # the fact behind the warning, as bash has it
        assert subprocess.run(["bash", "-c", "(exit 3) | cat"], timeout=30).returncode == 0
        assert subprocess.run(["bash", "-o", "pipefail", "-c", "(exit 3) | cat"],
                              timeout=30).returncode == 3

"""The real CLI as a subprocess: one-line errors and exit codes, --version, `podagent env`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import podagent
from podagent import cli, errors
from podagent.config.fields import (
    FIELD_BY_ATTR,
    FIELDS,
    FIRST_RUN,
    GROUPS,
    REWARD_FIELDS,
    REWARD_SERVER_GROUP,
)
from podagent.platform import nccl
from podagent.run import exits, ledger

_DROP_PREFIXES = ("RAY_", "PODAGENT_", "RUNPOD_", "NCCL_", "GLOO_", "WANDB_")
_DROP_NAMES = {"HEAD_POD_ID", "NODE_RANK", "PRIMARY_ADDR", "NUM_NODES", "EXPECTED_WORKERS",
               "DEBUG_RAY", "NODE_ADDR"}


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROP_PREFIXES) and k not in _DROP_NAMES}
    return {**env, **extra}


def run_cli(cwd: Path, args: tuple[str, ...], env: dict[str, str]) -> Run:
    result = subprocess.run(
        [sys.executable, "-m", "podagent", *args], env=clean_env(**env), cwd=cwd,
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    return Run(cwd, result.returncode, result.stdout, result.stderr)


@dataclass(frozen=True)
class Run:
    cwd: Path
    returncode: int
    stdout: str
    stderr: str


SECRET = "wandb-secret-0123456789"

# Every CLI run of this module: (arguments, environment). They run concurrently, once.
BAD_INPUTS = {
    "expected-workers-env": (
        ("env",), {"EXPECTED_WORKERS": "two"},
        "EXPECTED_WORKERS='two' must be a whole number >= 0"),
    "ray-port-no-subcommand": ((), {"PODAGENT_RAY_PORT": "70000"}, "PODAGENT_RAY_PORT='70000'"),
    "head-timeout-head": (
        ("head",), {"PODAGENT_HEAD_TIMEOUT": "nan"}, "PODAGENT_HEAD_TIMEOUT='nan'"),
    "head-pod-id-worker": (("worker",), {"HEAD_POD_ID": "bad id"}, "HEAD_POD_ID='bad id'"),
    "ray-port-flag": (("env", "--ray-port", "abc"), {}, "--ray-port='abc'"),
    "group-flag": (("--expected-workers", "x", "env"), {}, "--expected-workers='x'"),
    "job-quote": (("env",), {"PODAGENT_JOB": "python 'unclosed"}, "PODAGENT_JOB="),
    "preset-env": (("env",), {"PODAGENT_NCCL_PRESET": "bogus"}, "PODAGENT_NCCL_PRESET='bogus'"),
    "min-workers": (
        ("env",), {"EXPECTED_WORKERS": "1", "PODAGENT_MIN_WORKERS": "3"},
        "PODAGENT_MIN_WORKERS='3'"),
    "worker-without-head": (("env",), {"RAY_WORKER": "1"}, "HEAD_POD_ID="),
    "launcher-unknown": ((), {"PODAGENT_LAUNCHER": "mpirun"}, "PODAGENT_LAUNCHER='mpirun'"),
    "launcher-without-job": ((), {"PODAGENT_LAUNCHER": "torchrun"},
                             "PODAGENT_LAUNCHER=torchrun needs the job: PODAGENT_JOB="),
}

# Should a worker wrongly start, it finds no head at once and exits 6 (it starts nothing).
_SAFETY_NET = {"PODAGENT_HEAD_ADDR": "127.0.0.1", "PODAGENT_RAY_PORT": str(_closed_port()),
               "PODAGENT_HEAD_TIMEOUT": "1", "PODAGENT_LOG_DIR": "logs",
               # A pod stops itself after bad input (or stays idle): here, just exit.
               "PODAGENT_AFTER_RUN": "exit"}

CONFLICTS = {
    "env-ray-worker-0-vs-pod-ids": (
        ("env",), {"RAY_WORKER": "0", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1"},
        ["RAY_WORKER=0", "RUNPOD_POD_ID=w1"]),
    "ray-worker-1-vs-pod-ids": (
        (), {"RAY_WORKER": "1", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1"},
        ["RAY_WORKER=1", "RUNPOD_POD_ID=h1"]),
    "ray-worker-1-vs-pod-ids-and-rank": (
        (), {"NODE_RANK": "2", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1", "RAY_WORKER": "1"},
        ["RAY_WORKER=1", "RUNPOD_POD_ID=h1"]),
    "worker-subcommand-vs-ray-worker-0": (
        ("worker",), {"RAY_WORKER": "0"}, ["`podagent worker`", "RAY_WORKER=0"]),
    "worker-subcommand-vs-rank-0": (
        ("worker",), {"NODE_RANK": "0", "PRIMARY_ADDR": "127.0.0.1"},
        ["`podagent worker`", "NODE_RANK=0"]),
}

OTHER_RUNS = {
    "version": (("--version",), {}),
    "env-pod-ids": (("env",), {"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1",
                               "WANDB_API_KEY": SECRET, "WANDB_PROJECT": "proj"}),
    "env-debug": (("env",), {"DEBUG_RAY": "1"}),
    "env-plain": (("env",), {}),
    "env-export": (("env", "--export", "--preset", "runpod-global"), {"WANDB_NAME": "my run"}),
    "env-export-user-ifname": (("env", "--export", "--preset", "runpod-global"),
                               {"NCCL_SOCKET_IFNAME": "eth9"}),
    "env-bogus-preset": (("env", "--preset", "bogus"), {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    jobs = {name: (args, env) for name, (args, env, _) in BAD_INPUTS.items()}
    jobs.update({name: (args, {**_SAFETY_NET, **env})
                 for name, (args, env, _) in CONFLICTS.items()})
    jobs.update(OTHER_RUNS)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {name: pool.submit(run_cli, tmp_path_factory.mktemp(name), args, env)
                   for name, (args, env) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def assert_one_line_error(run: Run, *words: str) -> str:
    assert run.returncode == 2, run
    assert "Traceback" not in run.stderr + run.stdout
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    for word in words:
        assert word in lines[0]
    return lines[0]


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(runs, name):
    run = runs[name]
    line = assert_one_line_error(run)
    assert line.startswith(f"podagent: error: {BAD_INPUTS[name][2]}")
    assert list(run.cwd.iterdir()) == []  # nothing was started or written


@pytest.mark.parametrize("name", CONFLICTS)
def test_role_conflict_exits_2_naming_both_facts(runs, name):
    run = runs[name]
    line = assert_one_line_error(run, *CONFLICTS[name][2])
    assert line.startswith("podagent: error: role conflict")
    assert list(run.cwd.iterdir()) == []


def test_version(runs):
    run = runs["version"]
    assert run.returncode == 0
    assert run.stdout.startswith("podagent")
    assert podagent.__version__ in run.stdout


# --- podagent env -------------------------------------------------------------------------------

def _infiniband_here() -> bool:
    return bool(nccl.infiniband_devices()) and any(n.startswith("ib") for n in nccl.interfaces())


@pytest.mark.skipif(_infiniband_here(), reason="this machine has InfiniBand evidence")
def test_env_shows_role_preset_and_nccl_lines_and_redacts_secrets(runs):
    run = runs["env-pod-ids"]
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    assert out[0] == "# role: head (RUNPOD_POD_ID=h1 equals HEAD_POD_ID)"
    assert out[1].startswith("# NCCL preset runpod-global: ")
    assert "RUNPOD_POD_ID" in out[1]
    for line in ("NCCL_SOCKET_IFNAME=podnet1", "NCCL_IB_DISABLE=1", "NCCL_LAUNCH_MODE=GROUP",
                 "GLOO_SOCKET_IFNAME=podnet1", "WANDB_PROJECT=proj",
                 "# WANDB_API_KEY is set (value redacted)"):
        assert line in out
    assert SECRET not in run.stdout + run.stderr


def test_env_shows_ray_debug_when_asked(runs):
    assert runs["env-debug"].returncode == 0, runs["env-debug"].stderr
    assert "RAY_DEBUG=legacy" in runs["env-debug"].stdout.splitlines()
    assert runs["env-plain"].returncode == 0, runs["env-plain"].stderr
    assert "RAY_DEBUG" not in runs["env-plain"].stdout


def test_env_export_prints_the_preset(runs):
    run = runs["env-export"]
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    assert "# NCCL preset runpod-global: --nccl-preset asks for it" in out
    for line in ("export NCCL_SOCKET_IFNAME=podnet1", "export NCCL_NET_SOCKET_FAMILY=IPv4",
                 "export NCCL_SOCKET_NTHREADS=1", "export FORCE_MODEL_INIT_TO_CUDA=1",
                 "export GLOO_SOCKET_IFNAME=podnet1", "export WANDB_NAME='my run'"):
        assert line in out
    assert all(line.startswith(("export ", "# ")) for line in out), out


def test_env_export_users_own_nccl_socket_ifname_wins(runs):
    run = runs["env-export-user-ifname"]
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    assert not any(line.startswith("export NCCL_SOCKET_IFNAME=") for line in out)
    assert "# NCCL_SOCKET_IFNAME is your own (eth9); the preset's value yields" in out
    assert "export GLOO_SOCKET_IFNAME=eth9" in out
    assert "export NCCL_IB_DISABLE=1" in out


def test_env_unknown_preset_exits_2(runs):
    assert_one_line_error(runs["env-bogus-preset"], "'bogus'", "one of")


def test_env_unknown_preset_names_the_flag_given(runs):
    line = assert_one_line_error(runs["env-bogus-preset"])
    assert line.startswith("podagent: error: --preset='bogus'")


# --- exit codes ---------------------------------------------------------------------------------

EXIT_CODES = [
    (errors.ConfigError("EXPECTED_WORKERS", "two", "must be a whole number >= 0"), 2),
    (errors.RoleConflict("role conflict"), 2),
    (errors.JobFailed("job failed"), 3),
    (errors.JobStopped("job stopped"), 4),
    (errors.WorkersTimeout("1 of 2"), 5),
    (errors.HeadUnreachable("no head"), 6),
    (errors.HeadLost("lost"), 7),
    (errors.RayStartError("ray start failed"), 8),
    (errors.PortInUse(6379, "0.0.0.0", None), 9),
    (errors.RayDied("raylet died"), 10),
    (errors.RewardServerFailed("exited at start"), 11),
    (errors.RewardServerTimeout("never answered"), 12),
    (errors.AuthRefused("wrong token"), 13),
    (errors.JobSubmitFailed("no agent"), 14),
    (errors.StopTimeout("still up"), 15),
    (errors.RestartsExhausted("lost again"), 16),
    (errors.LedgerError("volume full"), 17),
    (errors.RunPodAuthError("401"), 18),
    (errors.NoCapacity("no capacity"), 19),
    (errors.RunPodApiError("gave up"), 20),
    (errors.PodsNotReady("PROVISIONING"), 21),
    (errors.PeerLost("pod w1 was lost"), 22),
    (errors.DataOverlap("ranks 0 and 1 share 16 of 16 samples"), 23),
    (errors.PodGone("pod w1 was stopped at RunPod"), 24),
    (errors.RunHung("no progress for 600 s"), 25),
    (errors.PodsLeftBilling("its pods may still bill"), 26),
    (errors.DeadlineReached("the run reached its deadline"), 27),
    (errors.GpuCheckFailed("GPU 0: 3 uncorrected ECC error(s)"), 28),
    (errors.RunPodNonsense("answered 201 with an empty body"), 20),
    (errors.RunPodConflict("409"), 20),
    (errors.Interrupted(signal.SIGTERM), 143),
    (errors.Interrupted(signal.SIGINT), 130),
    (errors.PodagentError("unclassified"), 70),
    (RuntimeError("a bug"), 70),
    (KeyError("x"), 70),
]


@pytest.mark.parametrize(("exc", "code"), EXIT_CODES, ids=[type(e).__name__ for e, _ in
                                                           EXIT_CODES])
def test_exit_code(exc, code):
    assert exits.exit_code(exc) == code


def test_exit_code_table_documents_every_code():
    documented: set[int] = set()
    for row in exits.table().splitlines()[2:]:
        cell = row.split("|")[1]
        documented.update(int(code) for code in cell.split("/"))
    assert documented == {0} | {code for _, code in EXIT_CODES}


def test_what_the_pod_does_after_each_code_is_said_for_every_code():
    """The table's third column: a pod stops itself after every code a new start cannot mend
    (RunPod would start it again, and again); the others are left to RunPod's restart."""
    rows = {row.split("|")[1].strip(): row.split("|")[3].strip()
            for row in exits.table().splitlines()[2:]}
    assert rows["2"].startswith("stops itself") and rows["13"].startswith("stops itself")
    assert rows["16"].startswith("stops itself") and rows["23"].startswith("stops itself")
    assert rows["28"].startswith("stops itself")  # the same GPUs would fail again
    assert rows["6"].startswith("exits; RunPod starts it again")
    assert rows["19"] == rows["24"] == "—"  # the laptop's codes: no pod exits with them
    assert all(rows.values())


@pytest.mark.parametrize("outcome", (*ledger.FINISHED, ledger.INTERNAL_ERROR))
def test_a_finished_runs_code_follows_from_its_recorded_outcome(outcome):
    """A restarted head repeats a finished run's exit code from the outcome alone (the head
    that finished it may have been killed before it wrote the code)."""
    error = getattr(errors, outcome, None)
    expected = exits.exit_code(error("x")) if error else (70 if outcome == ledger.INTERNAL_ERROR
                                                        else 0)
    assert exits.code_for_outcome(outcome) == expected


# --- dry run: the configuration path that touches nothing -------------------------------------


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path: Path) -> None:
    env = clean_env(HEAD_POD_ID="abc", RUNPOD_POD_ID="xyz", DEBUG_RAY="1",
                    PODAGENT_LOG_DIR=str(tmp_path / "logs"), WANDB_API_KEY="s3cr3t-w4ndb-k3y")
    run = run_cli(tmp_path, ("--dry-run",), env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "dry run: this pod would be the worker (RUNPOD_POD_ID=xyz differs" in out
    assert "would find the head at abc.runpod.internal" in out
    assert "would run: " in out and " start --address HEAD:6379 " in out
    assert "--ray-debugger-external" in out and "with RAY_DEBUG=legacy" in out
    assert "s3cr3t-w4ndb-k3y" not in out + run.stderr
    assert not (tmp_path / "logs").exists()  # no run dir: nothing was touched


def test_dry_run_of_a_head_names_job_and_reward_server(tmp_path: Path) -> None:
    env = clean_env(PODAGENT_LOG_DIR=str(tmp_path / "logs"), PODAGENT_JOB="python train.py")
    run = run_cli(tmp_path, ("head", "--dry-run"), env)
    assert run.returncode == 0, run.stderr
    assert " start --head " in run.stdout
    assert "start reward server: builtin, then run the job: python train.py" in run.stdout
    assert not (tmp_path / "logs").exists()


TYPO = "PODAGENT_WORKER_WAIT_TIMEOUT is not a podagent setting; did you mean " \
       "PODAGENT_WORKER_TIMEOUT? (ignored)"


def test_a_dry_run_warns_as_a_run_does_and_first(tmp_path: Path) -> None:
    run = run_cli(tmp_path, ("head", "--dry-run"), {"PODAGENT_WORKER_WAIT_TIMEOUT": "30"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"[podagent] WARNING: {TYPO}", lines[:3]
    assert any(line.startswith("[head] dry run: ") for line in lines[1:])


def test_a_misspelt_setting_is_said_before_the_part_it_leaves_missing(tmp_path: Path) -> None:
    """PODAGENT_REWARDD=none meant no reward server: the missing reward extra is refused (exit
    2), and the line that explains why is shown too, first."""
    hide = tmp_path / "hide"
    hide.mkdir()
    # As if the reward extra were not installed: the module is looked up and not found.
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['pebble'] = None\n")
    run = run_cli(tmp_path, ("head", "--dry-run"),
                  {"PODAGENT_REWARDD": "none", "PYTHONPATH": str(hide),
                   "PODAGENT_JOB": "python train.py"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert ("PODAGENT_REWARDD is not a podagent setting; did you mean PODAGENT_REWARD? "
            "(ignored)") in run.stdout.splitlines()[0]
    assert "needs podagent's reward extra" in run.stderr


# --- podagent check and podagent torchrun (dry) ------------------------------------------------


def test_check_exit_code_follows_fatal_results(tmp_path):
    import json

    fine = run_cli(tmp_path, ("check", "--json"), {"NCCL_SOCKET_IFNAME": "lo"})
    assert fine.returncode == 0, fine.stderr
    assert json.loads(fine.stdout)["ok"] is True
    broken = run_cli(tmp_path, ("check",), {"NCCL_SOCKET_IFNAME": "nosuch0"})
    assert broken.returncode == 1
    assert "✗ interface" in broken.stdout and "nosuch0" in broken.stdout


def test_check_cluster_without_a_cluster_names_the_dashboard(tmp_path):
    closed = str(_closed_port())
    result = run_cli(tmp_path, ("check", "--cluster"),
                     {"PODAGENT_DASHBOARD_PORT": closed, "PODAGENT_NODE_IP": "127.0.0.1"})
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and f"127.0.0.1:{closed}" in result.stderr


def test_torchrun_dry_run_works_out_ranks_without_node_rank(tmp_path):
    result = run_cli(tmp_path, ("torchrun", "--dry-run", "--max-restarts", "2", "--",
                                "train.py", "--lr", "3"),
                     {"RUNPOD_POD_ID": "podh", "HEAD_POD_ID": "podh",
                      "PODAGENT_NODE_IP": "127.0.0.1", "PODAGENT_NCCL_PRESET": "none"})
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if "training:" in x]
    assert ("--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "
            "127.0.0.1:29500 --rdzv-id podagent-podh --rdzv-conf is_host=1,join_timeout=600 "
            "--local-addr 127.0.0.1 --max-restarts 2 train.py --lr 3") in line
    assert "NODE_RANK" not in result.stdout


def test_torchrun_without_a_script_is_bad_input(tmp_path):
    result = run_cli(tmp_path, ("torchrun",), {})
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_log_format_json_and_quiet_through_the_cli(tmp_path):
    import json

    shown = run_cli(tmp_path, ("--log-format", "json", "head", "--dry-run"), {})
    assert shown.returncode == 0, shown.stderr
    records = [json.loads(line) for line in shown.stdout.splitlines()]
    # Messages and events, one object per line: events carry their name instead of a level.
    messages = [r for r in records if "event" not in r]
    assert messages and all(r["level"] == "info" and r["role"] == "head" for r in messages)
    assert all(r["role"] == "head" and r["event"] for r in records if "event" in r)
    quiet = run_cli(tmp_path, ("head", "--dry-run", "--quiet"), {})
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout
    bad = run_cli(tmp_path, ("--dry-run",), {"PODAGENT_LOG_FORMAT": "xml"})
    assert bad.returncode == 2 and "PODAGENT_LOG_FORMAT='xml' must be one of text, json" in (
        bad.stderr)


def test_a_token_from_ray_auth_token_path_is_redacted_too(tmp_path):
    token = "tokenfromfile-" + "7" * 24
    path = tmp_path / "token"
    path.write_text(token + "\n")
    result = run_cli(tmp_path, ("head", "--dry-run"),
                     {"RAY_AUTH_TOKEN_PATH": str(path),
                      "PODAGENT_JOB": f"python train.py --note {token}"})
    assert result.returncode == 0, result.stderr
    assert "RAY_AUTH_TOKEN=<redacted>" in result.stdout
    assert "--note <redacted>" in result.stdout
    assert token not in result.stdout + result.stderr


# --- the help: one screen, every setting reachable ---------------------------------------------

HELP_LINES = 60


def _help(tmp_path: Path, *args: str) -> Run:
    return run_cli(tmp_path, args, {"COLUMNS": "80"})


def test_the_help_fits_one_screen_and_says_where_every_setting_is(tmp_path):
    shown = _help(tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) <= HELP_LINES, shown.stdout
    assert lines.index("Commands:") < next(i for i, line in enumerate(lines)
                                           if line.startswith("Options"))
    for name in cli.main.commands:
        assert f"  {name} " in shown.stdout
    for attr in FIRST_RUN:
        assert FIELD_BY_ATTR[attr].flag in shown.stdout
    pointer = " ".join(shown.stdout.split())  # as wrapped for 80 columns
    groups = [g.name for g in (*GROUPS, REWARD_SERVER_GROUP)]
    assert f"podagent help settings [{'|'.join(groups)}]" in pointer
    assert _help(tmp_path, "help").stdout == shown.stdout


def test_help_settings_lists_every_setting_in_its_group(tmp_path):
    every = _help(tmp_path, "help", "settings")
    assert every.returncode == 0, every.stderr
    for group in GROUPS:
        one = _help(tmp_path, "help", "settings", group.name)  # the reward server's: below
        assert one.returncode == 0 and one.stdout in every.stdout
        for field in FIELDS:
            listed = f"{field.flag} / {field.env}" in one.stdout
            assert listed == (field.group == group.name), (group.name, field.flag)
    server = _help(tmp_path, "help", "settings", REWARD_SERVER_GROUP.name)
    assert server.stdout in every.stdout
    for field in REWARD_FIELDS:
        assert f"{field.flag} / {field.env}" in server.stdout
    wrong = _help(tmp_path, "help", "settings", "gpus")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip().splitlines() == [
        "podagent: error: GROUP='gpus' is not a group of settings: one of "
        + ", ".join(g.name for g in (*GROUPS, REWARD_SERVER_GROUP))]


def test_a_commands_help_shows_the_first_settings_and_points_at_the_rest(tmp_path):
    head = _help(tmp_path, "head", "--help")
    assert head.returncode == 0 and "--expected-workers" in head.stdout
    assert "--ray-port" not in head.stdout and "podagent help settings" in head.stdout
    assert _help(tmp_path, "help", "head").stdout == head.stdout
    # a setting the help does not show is still taken
    dry = run_cli(tmp_path, ("--ray-port", "7001", "--node-ip", "10.0.0.5", "--dry-run"), {})
    assert dry.returncode == 0, dry.stderr
    assert "ray start --head --port 7001 " in dry.stdout


def test_every_launcher_the_settings_take_has_an_engine():
    from podagent.choices import LAUNCHERS

    assert set(cli.ENGINES) == set(LAUNCHERS)

"""`podagent torchrun` / `podagent accelerate` as a user runs them on one pod: bad input is one
line and exit 2 before anything starts; the data check stops a run whose ranks see the same
samples (exit 23, with the numbers) before its training starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podagent import errors
from podagent.run import exits
from tests.harness.agents import clean_environ
from tests.harness.pods import wait_for

BAD_INPUT = next(code for cls, code, _ in exits.EXIT_CODES if cls is errors.ConfigError)
OVERLAP = next(code for cls, code, _ in exits.EXIT_CODES if cls is errors.DataOverlap)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _podagent(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
    environ = {**clean_environ(), "PODAGENT_LOG_DIR": str(tmp_path / "logs"),
               "PODAGENT_RUN_NAME": "one-pod", "PODAGENT_AFTER_RUN": "exit",
               "RES_OPTIONS": "timeout:1 attempts:1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "podagent", *args], env=environ,
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def _one_line_exit_2(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == BAD_INPUT, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("podagent: error: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_logs := list(Path(done.args[0]).parent.glob("never"))), tmp_logs


def test_accelerate_missing_is_one_line_naming_the_extra(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    # The image has no accelerate: a finder in front of the others says it is not there.
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hidden:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'accelerate':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hidden())\n")
    done = _podagent(tmp_path, "accelerate", "train.py", env={"PYTHONPATH": str(hide)})
    _one_line_exit_2(done, "podagent accelerate needs podagent's accelerate extra",
                     "pip install 'podagent[accelerate]'")
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written


def test_an_accelerate_config_that_does_not_parse_is_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\nnum_machines: [2,\n")
    done = _podagent(tmp_path, "accelerate", "--config_file", str(config), "train.py")
    _one_line_exit_2(done, "--config_file", str(config), "line")
    assert not (tmp_path / "logs").exists()


def test_a_machine_rank_that_contradicts_the_worked_out_one_is_one_line(tmp_path):
    pod = {"HEAD_POD_ID": "abc123", "RUNPOD_POD_ID": "abc123"}  # this pod is the head
    done = _podagent(tmp_path, "accelerate", "--machine_rank", "1", "train.py", env=pod)
    _one_line_exit_2(done, "--machine_rank", "'1'", "machine 0")  # a worker's: test_accelerate
    assert not (tmp_path / "logs").exists()


def test_the_data_check_stops_a_run_whose_ranks_see_the_same_samples(tmp_path):
    (tmp_path / "loaders.py").write_text(
        "import torch\n"
        "def same_for_everyone():\n"
        "    # no sampler: every rank iterates the whole dataset\n"
        "    return torch.utils.data.DataLoader(range(16), batch_size=4)\n")
    train = tmp_path / "train.py"
    train.write_text("open('trained', 'w').close()\n")
    one_pod = {"EXPECTED_WORKERS": "0", "PODAGENT_NODE_IP": "127.0.0.1",
               "PODAGENT_SUPERVISOR_PORT": str(_free_port()),
               "PODAGENT_RENDEZVOUS_PORT": str(_free_port())}
    done = _podagent(tmp_path, "torchrun", "--data-check", "--loader",
                     "loaders.py:same_for_everyone", "--nproc-per-node", "2", str(train),
                     env=one_pod, timeout=120)
    assert done.returncode == OVERLAP, done.stdout + done.stderr
    assert ("data check: 2 ranks saw 32 samples, 32 of them on more than one rank; ranks 0 "
            in done.stderr), done.stderr
    assert "share 16 of 16 samples" in done.stderr
    assert not (tmp_path / "trained").exists()  # the training never started
    # The run's end is in its ledger: a container started again does not run it again.
    again = _podagent(tmp_path, "torchrun", "--data-check", "--loader",
                      "loaders.py:same_for_everyone", "--nproc-per-node", "2", str(train),
                      env=one_pod)
    assert again.returncode == OVERLAP, again.stdout + again.stderr
    assert "finished earlier (DataOverlap" in again.stdout
    assert "data check: " not in again.stdout
    assert os.listdir(tmp_path / "logs" / "one-pod")


def _two_pods_here(tmp_path: Path, script: Path, head_env: dict[str, str],
                   worker_env: dict[str, str], timeout: float = 120) -> tuple[
                       subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """A head and a worker of a run without Ray, both podagents on 127.0.0.1 (each its own
    log directory), running `script` under torchrun; their outcomes."""
    common = {**clean_environ(), "PODAGENT_RUN_NAME": "two", "PODAGENT_AFTER_RUN": "exit",
              "PODAGENT_NODE_IP": "127.0.0.1", "PODAGENT_HEAD_ADDR": "127.0.0.1",
              "PODAGENT_SUPERVISOR_PORT": str(_free_port()),
              "PODAGENT_RENDEZVOUS_PORT": str(_free_port()), "PODAGENT_WORKER_TIMEOUT": "60",
              "PODAGENT_HEAD_TIMEOUT": "60"}
    procs = []
    for role, env in (("head", {"RAY_WORKER": "0", "EXPECTED_WORKERS": "1", **head_env}),
                      ("worker", {"RAY_WORKER": "1", **worker_env})):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "podagent", "torchrun", "--nproc-per-node", "1",
             str(script)], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**common, "PODAGENT_LOG_DIR": str(tmp_path / role), **env}))
    done = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done[0], done[1]


def test_a_head_whose_hang_watch_is_off_declares_no_hang_from_a_workers_beats(tmp_path):
    """PODAGENT_HANG_TIMEOUT=0 on the head turns the watch off for the run: a worker whose
    own watch is on reports its training's silence in its beats, and a training silent far
    longer than that worker's timeout is no hang; both pods exit 0, nothing dumped."""
    script = tmp_path / "silent.py"
    script.write_text("import time\ntime.sleep(6)\nopen('trained-' + __import__('os')"
                      ".environ['RANK'], 'w').close()\n")
    head, worker = _two_pods_here(tmp_path, script, {"PODAGENT_HANG_TIMEOUT": "0"},
                                  {"PODAGENT_HANG_TIMEOUT": "1"})
    assert (head.returncode, worker.returncode) == (0, 0), head.stdout + worker.stdout
    events = [json.loads(line) for path in tmp_path.glob("*/two/**/events.jsonl")
              for line in path.read_text().splitlines()]
    assert {e["event"] for e in events} >= {"role", "rendezvous_done"}, events
    assert not [e for e in events if e["event"] in ("hang", "restart")], events
    assert sorted(p.name for p in tmp_path.glob("trained-*")) == ["trained-0", "trained-1"]
    assert not list(tmp_path.glob("*/two/**/hangs/*")), "stacks were dumped"


def test_at_its_deadline_the_run_ends_on_every_pod_with_a_grace_and_for_good(tmp_path):
    """PODAGENT_DEADLINE reached while the training runs: every rank gets SIGTERM and the
    stop's grace (each writes its "checkpoint"), both pods exit 27, and the head's ledger
    holds the run finished: its container started again ends at once, as it did."""
    script = tmp_path / "forever.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "rank = os.environ['RANK']\n"
        "def saved(*_):\n"
        "    time.sleep(0.5)  # a checkpoint's write\n"
        "    open(f'saved-{rank}', 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, saved)\n"
        "open(f'started-{rank}', 'w').close()\n"
        "while True:\n"
        "    print('step', flush=True)\n"
        "    time.sleep(0.5)\n")
    # Far enough for torch's start on this loaded machine (the ranks' files say it came).
    deadline = {"PODAGENT_DEADLINE": f"{time.time() + 40:.0f}", "PODAGENT_STOP_TIMEOUT": "20"}
    head, worker = _two_pods_here(tmp_path, script, deadline, deadline)
    said = head.stdout + worker.stdout
    capped = exits.exit_code(errors.DeadlineReached("x"))
    assert (head.returncode, worker.returncode) == (capped, capped), said[-4000:]
    assert sorted(p.name for p in tmp_path.glob("started-*")) == ["started-0", "started-1"]
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], said
    assert "DEADLINE: the run reached" in head.stdout
    assert "reached its deadline" in worker.stdout  # the head's word, said on the worker
    again = _podagent(tmp_path, "torchrun", "--nproc-per-node", "1", str(script),
                      env={"PODAGENT_RUN_NAME": "two", "PODAGENT_AFTER_RUN": "exit",
                           "EXPECTED_WORKERS": "1", "RAY_WORKER": "0",
                           "PODAGENT_LOG_DIR": str(tmp_path / "head"), **deadline})
    assert again.returncode == capped, again.stdout + again.stderr
    assert "finished earlier (DeadlineReached" in again.stdout


def test_a_deadline_during_the_rendezvous_ends_it_for_the_pods_that_came(tmp_path):
    """The head waits for two workers, one comes; the deadline passes meanwhile: no training
    starts anywhere, and the head and the worker that came both end with 27, long before
    the rendezvous's own timeout."""
    script = tmp_path / "never.py"
    script.write_text("open('trained', 'w').close()\n")
    # Far enough for the worker's podagent to start and join on this loaded machine.
    deadline = {"PODAGENT_DEADLINE": f"{time.time() + 20:.0f}"}
    started = time.monotonic()
    head, worker = _two_pods_here(tmp_path, script, {"EXPECTED_WORKERS": "2", **deadline},
                                  deadline)
    capped = exits.exit_code(errors.DeadlineReached("x"))
    assert (head.returncode, worker.returncode) == (capped, capped), \
        head.stdout[-3000:] + worker.stdout[-3000:]
    assert time.monotonic() - started < 50  # the rendezvous's timeout is 60 s
    assert not (tmp_path / "trained").exists()
    assert "joined the" in worker.stdout and "reached its deadline" in worker.stdout


@pytest.fixture
def full_volume(tmp_path):
    """A 1 MB volume (a tmpfs; root only) that a printing training fills within seconds."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(volume)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def test_the_head_decides_for_every_pod_whether_the_training_resumes(tmp_path):
    """A worker whose checkpoint directory is its own (no shared volume) and empty still
    starts with the resume flag when the head's holds a checkpoint: the ranks of one run
    never start at different steps. Each rank records the argv it received."""
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "open(f'argv-{os.environ[\"RANK\"]}.json', 'w').write("
                      "json.dumps(sys.argv[1:]))\n")
    (tmp_path / "head-ckpt" / "step-100").mkdir(parents=True)
    flag = {"PODAGENT_RESUME_FLAG": "--resume-from latest"}
    head, worker = _two_pods_here(
        tmp_path, script, {**flag, "PODAGENT_CHECKPOINT_DIR": str(tmp_path / "head-ckpt")},
        {**flag, "PODAGENT_CHECKPOINT_DIR": str(tmp_path / "worker-ckpt")})
    assert (head.returncode, worker.returncode) == (0, 0), head.stdout + worker.stdout
    for rank in (0, 1):
        argv = json.loads((tmp_path / f"argv-{rank}.json").read_text())
        assert argv == ["--resume-from", "latest"], (rank, argv)
    assert "resuming as the head decided: the training gets --resume-from latest" \
        in worker.stdout, worker.stdout


def test_a_training_that_prints_is_no_hang_when_its_log_volume_is_full(tmp_path, full_volume):
    """The watch hears the training's output as it comes, not from the training log: a volume
    that refuses the log (said once) must not make a run that prints look hung."""
    # The watch starts with torchrun, whose start (torch's import) took over 5 s on the loaded
    # machine: the timeout leaves room for it, and the training prints for longer than that.
    train = tmp_path / "train.py"
    train.write_text("import time\nt = time.time()\nwhile time.time() - t < 30:\n"
                     "    print('step', 'x' * 50000, flush=True)\n    time.sleep(0.1)\n")
    one_pod = {"EXPECTED_WORKERS": "0", "PODAGENT_NODE_IP": "127.0.0.1",
               "PODAGENT_SUPERVISOR_PORT": str(_free_port()),
               "PODAGENT_RENDEZVOUS_PORT": str(_free_port()), "PODAGENT_HANG_TIMEOUT": "20",
               "PODAGENT_RESTARTS": "0", "PODAGENT_LOG_DIR": str(full_volume)}
    done = _podagent(tmp_path, "torchrun", "--nproc-per-node", "1", str(train), env=one_pod,
                     timeout=180)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "HANG" not in said
    assert said.count("training.log (No space left on device): going on without it") == 1


def test_two_pods_whose_run_directories_coincide_are_refused_not_mixed(tmp_path):
    """The same host name and no RUNPOD_POD_ID on one volume (containers on a host's network):
    both pods would write one ledger and one data check. The second podagent finds the
    directory held and exits 2 naming the holder and the fix; the first runs on, unharmed."""
    train = tmp_path / "train.py"
    train.write_text("import time\ntime.sleep(15)\n")
    env = {"EXPECTED_WORKERS": "0", "PODAGENT_NODE_IP": "127.0.0.1",
           "PODAGENT_SUPERVISOR_PORT": str(_free_port()),
           "PODAGENT_RENDEZVOUS_PORT": str(_free_port())}
    first = subprocess.Popen(
        [sys.executable, "-m", "podagent", "torchrun", "--nproc-per-node", "1", str(train)],
        env={**clean_environ(), "PODAGENT_LOG_DIR": str(tmp_path / "logs"),
             "PODAGENT_RUN_NAME": "one-pod", "PODAGENT_AFTER_RUN": "exit", **env},
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "training: " in _read(tmp_path / "logs"), timeout=60,
                 what="the first podagent's training to start")
        second = _podagent(tmp_path, "torchrun", "--nproc-per-node", "1", str(train), env=env)
        assert second.returncode == BAD_INPUT, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert "PODAGENT_LOG_DIR=" in line and "another podagent holds (pid" in line, line
        assert "RUNPOD_POD_ID" in line, line
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0, out
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def _read(logs: Path) -> str:
    """Every pod log under `logs`, as text."""
    return "".join(p.read_text(errors="replace") for p in logs.glob("*/*/podagent-*.log"))


def test_every_launcher_the_settings_take_has_its_class():
    from podagent.choices import LAUNCHERS, RAY_LAUNCHER
    from podagent.gang import run as gang_run

    assert set(gang_run.LAUNCHERS) == set(LAUNCHERS) - {RAY_LAUNCHER}


def test_a_launcher_command_runs_its_own_arguments_never_the_pods_job(tmp_path):
    """A pod `up` made for a run without Ray has PODAGENT_JOB set; `podagent torchrun
    --data-check` typed there runs the data check only, and `podagent torchrun` with no script
    is the one line that asks for one: neither starts the pod's training."""
    env = {"PODAGENT_JOB": "train.py --epochs 9", "EXPECTED_WORKERS": "0",
           "PODAGENT_NODE_IP": "127.0.0.1"}
    checked = _podagent(tmp_path, "torchrun", "--data-check", "--dry-run", env=env)
    said = checked.stdout + checked.stderr
    assert checked.returncode == 0, said
    assert "data check:" in said and "training:" not in said and "train.py" not in said, said
    bare = _podagent(tmp_path, "torchrun", "--dry-run", env=env)
    assert bare.returncode == BAD_INPUT, bare.stdout + bare.stderr
    assert "podagent torchrun needs a training script" in bare.stderr
    # A bare `podagent` with PODAGENT_LAUNCHER runs PODAGENT_JOB, as documented.
    job = _podagent(tmp_path, "--dry-run", env={**env, "PODAGENT_LAUNCHER": "torchrun"})
    assert job.returncode == 0 and "train.py --epochs 9" in job.stdout, job.stdout + job.stderr


def test_a_ray_head_resumes_its_job_as_ray_does_whatever_the_launcher_setting(tmp_path):
    """`podagent head` runs the Ray engine; what the settings derive from the launcher (the
    job's resume flag) is Ray's too, or a lost node restarts a script's training from step 0."""
    env = {"PODAGENT_REWARD": "none", "EXPECTED_WORKERS": "0", "PODAGENT_NODE_IP": "127.0.0.1"}
    plain = _podagent(tmp_path, "head", "--dry-run", "--", "python", "train.py", env=env)
    other = _podagent(tmp_path, "head", "--dry-run", "--", "python", "train.py",
                      env={**env, "PODAGENT_LAUNCHER": "torchrun"})
    lines = [[line for line in done.stdout.splitlines() if "after a lost pod" in line]
             for done in (plain, other)]
    assert plain.returncode == other.returncode == 0, other.stdout + other.stderr
    assert lines[0] and lines[0] == lines[1], lines

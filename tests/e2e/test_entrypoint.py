"""The image's entrypoint, run as the container runs it, in a pod (network namespace).

The argv is the Dockerfile's ENTRYPOINT + CMD; the environment is what the Dockerfile's ENV lines
set, plus the RunPod template's env (secret references filled in as RunPod would), plus what
RunPod gives every pod. Both are read from the files, so this test follows them. Where it differs
from a real container, and why:
- /workspace (the pod's volume) is a temp dir, and every path under /workspace moves into it:
  this machine's /workspace is not the test's to create or fill, and tests run side by side;
- the entrypoint script is installed into the temp dir the way the Dockerfile's COPY installs it
  (same mode), since the image's /opt is not this machine's;
- no PID namespace, so tini is not PID 1 (it warns so, harmlessly); on a machine without tini the
  argv starts at the script, and the stop signal goes to the script's process directly;
- each pod gets its own Ray temp dir, as each real pod has its own disk;
- podagent comes from this environment's scripts dir, first on PATH, as pip puts it on the
  image's PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import podagent
from podagent.config.policy import TOKEN_VARIABLES
from tests.harness.agents import clean_environ
from tests.harness.pods import Pod, PodNetwork, wait_for
from tests.unit.test_container import (
    ROOT,
    SECRET_REFERENCE,
    TEMPLATE,
    dockerfile_copies,
    dockerfile_env,
    dockerfile_instructions,
    image_argv,
)

WORKSPACE = "/workspace"
SCRIPTS = sysconfig.get_path("scripts")
BRING_UP_TIMEOUT = 240.0  # one Ray node on a shared 2-core machine: generous, bounded
EXIT_SIGTERM = 143


class Container:
    """One pod running the image's entrypoint; output goes to a file readable while it runs."""

    def __init__(self, pod: Pod, root: Path, env: dict[str, str]):
        self.pod = pod
        self.root = root
        self.workspace = root / "workspace"
        self.workspace.mkdir()  # RunPod mounts the volume before the container starts
        self.ray_tmp = f"/tmp/pae-{uuid.uuid4().hex[:6]}-ep"  # short: Ray's unix sockets
        self.entrypoint = self._install_entrypoint()
        self.env = {**clean_environ(), "PATH": SCRIPTS + os.pathsep + os.environ.get("PATH", "")}
        self.env.update(self._on_volume(dockerfile_env()))
        self.env.update(self._on_volume(self._template_env()))
        # What RunPod gives the pod; HEAD_POD_ID equal to its own id makes it the head.
        self.env.update({"RUNPOD_POD_ID": pod.pod_id, "HEAD_POD_ID": pod.pod_id,
                         "PODAGENT_RAY_TEMP_DIR": self.ray_tmp, **env})
        self.out_path = root / "container.out"
        self.proc: subprocess.Popen | None = None

    def _install_entrypoint(self) -> list[str]:
        instructions = dockerfile_instructions()
        argv = image_argv(instructions)
        for image_path, (source, mode) in dockerfile_copies(instructions).items():
            if image_path in argv:
                installed = self.root / image_path.lstrip("/")
                installed.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / source, installed)
                installed.chmod(int(mode, 8))
                argv[argv.index(image_path)] = str(installed)
        if Path(argv[0]).name == "tini" and not Path(argv[0]).exists():
            argv = argv[argv.index("--") + 1:]  # tini not installed on this machine
        return argv

    def _template_env(self) -> dict[str, str]:
        env = {}
        for key, value in json.loads(TEMPLATE.read_text())["env"].items():
            if SECRET_REFERENCE.fullmatch(value):
                if key not in TOKEN_VARIABLES:
                    continue  # no W&B account here: the user would delete that line
                value = secrets.token_urlsafe(32)  # the secret the user made with podagent token
            env[key] = value
        return env

    def _on_volume(self, env: dict[str, str]) -> dict[str, str]:
        def move(value: str) -> str:
            if value == WORKSPACE or value.startswith(WORKSPACE + "/"):
                return str(self.workspace) + value[len(WORKSPACE):]
            return value

        return {k: move(v) for k, v in env.items()}

    @property
    def log_dir(self) -> Path:
        return Path(self.env["PODAGENT_LOG_DIR"])

    def start(self, *args: str) -> Container:
        self._out = open(self.out_path, "wb")
        self.proc = self.pod.popen([*self.entrypoint, *args], env=self.env, stdout=self._out,
                                   stderr=subprocess.STDOUT)
        return self

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int:
        assert self.proc
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout} s:\n{self.output[-3000:]}") from None

    def entrypoint_process(self) -> psutil.Process:
        """The process the script became: tini's only child, or the started process itself."""
        assert self.proc
        started = psutil.Process(self.proc.pid)
        if Path(self.entrypoint[0]).name != "tini":
            return started
        (child,) = started.children()
        return child

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(AttributeError):
            self._out.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def container(pod_network: PodNetwork, tmp_path: Path) -> Iterator:
    made: list[Container] = []

    def make(**env: str) -> Container:
        c = Container(pod_network.add_pod("pod"), tmp_path, env)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _run_dirs(c: Container) -> list[Path]:
    return sorted(p for p in c.log_dir.glob("*") if p.is_dir()) if c.log_dir.is_dir() else []


def test_entrypoint_brings_a_one_pod_cluster_up_and_runs_the_job(container):
    # Exit after the run: on a RunPod pod podagent would stay up (PODAGENT_AFTER_RUN=stay).
    c = container(EXPECTED_WORKERS="0", PODAGENT_REWARD="none",
                  PODAGENT_JOB="python -c 'print(6 * 7)'", PODAGENT_AFTER_RUN="exit").start()
    code = c.wait_exit(BRING_UP_TIMEOUT)
    out = c.output
    assert code == 0, out[-3000:]
    assert f"this pod is the head (RUNPOD_POD_ID={c.pod.pod_id} equals HEAD_POD_ID)" in out
    assert "NCCL preset runpod-global: PODAGENT_NCCL_PRESET asks for it" in out  # the template's
    assert "job SUCCEEDED" in out

    # The logs land under the image's log dir (on the volume), one dir for the run, named
    # after HEAD_POD_ID (the same name when the container starts again).
    assert c.log_dir == c.workspace / "podagent" / "logs"
    (run_dir,) = _run_dirs(c)
    assert run_dir.name == f"podagent-{c.pod.pod_id}", run_dir.name
    # Inside it, this pod's own directory: pods sharing a volume never collide.
    assert [p.name for p in run_dir.iterdir()] == [c.pod.pod_id]
    run_dir = run_dir / c.pod.pod_id
    assert "42" in (run_dir / "job.log").read_text().split()
    assert "job SUCCEEDED" in (run_dir / f"podagent-head-{c.pod.pod_id}.log").read_text()
    assert (run_dir / "events.jsonl").stat().st_size > 0
    assert c.pod.pids() == [], "processes left behind in the pod"


def test_entrypoint_passes_arguments_and_sigterm_to_podagent(container):
    c = container(EXPECTED_WORKERS="1", PODAGENT_REWARD="none")

    # Arguments after the image name (the pod's start command) reach podagent.
    version = c.pod.run([*c.entrypoint, "--version"], env=c.env, timeout=60)
    assert version.returncode == 0, version.stdout + version.stderr
    assert podagent.__version__ in version.stdout.split()

    c.start()

    def head_is_waiting() -> bool:
        if c.proc and c.proc.poll() is not None:
            raise AssertionError(f"exited {c.proc.returncode} before waiting for its worker:\n"
                                 f"{c.output[-3000:]}")
        logs = [p.read_text() for d in _run_dirs(c) for p in d.glob("*/podagent-head-*.log")]
        return any("waiting for 1 worker(s)" in text for text in logs)

    wait_for(head_is_waiting, timeout=BRING_UP_TIMEOUT, interval=0.2,
             what="the head's log to say it waits for its worker")

    # exec: the script's process is podagent now, not a shell waiting for it.
    entry = c.entrypoint_process()
    cmdline = entry.cmdline()
    assert Path(SCRIPTS, "podagent") == Path(cmdline[1]), cmdline
    assert not any(a.endswith("entrypoint.sh") for a in cmdline), cmdline

    # The runtime's stop signal goes to PID 1 (tini, which passes it on, or the script itself).
    os.kill(c.proc.pid, signal.SIGTERM)
    assert c.wait_exit(120) == EXIT_SIGTERM, c.output[-3000:]
    assert c.pod.pids() == [], "processes left behind in the pod (Ray's included)"

"""RunPod pods as containers of the built image: three containers on one Docker network, each
with its own RUNPOD_POD_ID, the template's environment (entrypoints/runpod-template.json), an
interface named podnet1 and a real DNS server for <id>.runpod.internal; tini is PID 1, /workspace
is a volume that outlives the container, `docker stop` is SIGTERM then SIGKILL.

The Ray 2.48 base (OpenRLHF's pin) has no cluster tokens (Ray 2.52+): its pods run the template
without the PODAGENT_TOKEN line, as a user of such an image must; the last test shows what
happens if they keep it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest

from podagent.config.fields import FIELD_BY_ATTR
from tests.container.engine import images
from tests.container.pods import INTERFACE, PodContainer, PodNet, template_env
from tests.unit.test_container import dockerfile_instructions, image_argv

# Three Ray nodes in containers on a shared 2-core machine: generous, bounded waits.
FORM_TIMEOUT = 300.0
EXIT_BAD_INPUT, EXIT_HEAD_LOST, EXIT_SIGTERM = 2, 7, 143
STOP_TIMEOUT = 10  # `docker stop`'s default, given explicitly
HEALTH_INTERVAL = 10.0  # the image's is 30 s; a test cannot wait minutes per state change
SIGTERM_KILLED = 137  # what `docker stop` leaves when it had to SIGKILL
CHECKPOINT = "checkpoints/global_step1/model.pt"
# The job writes a checkpoint on the head's volume, says so, then trains until stopped.
CHECKPOINTING_JOB = (
    "python -c \"import pathlib, time; p = pathlib.Path('/workspace/" + CHECKPOINT + "'); "
    "p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(b'weights'); "
    "print('training', flush=True); time.sleep(600)\"")
HEAD_GRACE = FIELD_BY_ATTR["head_grace"].default  # not set: the default applies
# Past the grace: the probe that sees it (up to a probe's timeout late) and the worker's own
# teardown (Ray stopped, TERM -> deadline). Measured 13.4 s in all with the suite's other
# lanes loading both cores; 5 s of slack was too little there.
LEAVE_SLACK = 10.0


class Secrets(dict):
    """Secret values given to every pod as environment (template secrets and the user's own)."""

    def __init__(self, token: bool):
        super().__init__(WANDB_API_KEY=f"wandb-{secrets.token_hex(12)}",
                         HF_TOKEN=f"hf_{secrets.token_hex(12)}",
                         RUNPOD_API_KEY=f"rpa_{secrets.token_hex(12)}")
        if token:
            self["PODAGENT_TOKEN"] = secrets.token_urlsafe(32)


def has_tokens(base: str) -> bool:
    pins = dict(p.split("==") for p in images.BASES[base].packages)
    return tuple(map(int, pins["ray[default]"].split(".")[:2])) >= (2, 52)


def form(net: PodNet, pods: list[PodContainer], image: str, given: Secrets, workers: int = 2,
         head_env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None
         ) -> tuple[PodContainer, list[PodContainer]]:
    """A head and N workers (not started) from the template: HEAD_POD_ID filled in on every
    pod, EXPECTED_WORKERS on the head; W&B offline (no internet here); every pod exits when
    the run is over (on RunPod podagent would stay up: PODAGENT_AFTER_RUN=stay)."""
    env = template_env(given.get("PODAGENT_TOKEN", ""), given["WANDB_API_KEY"])
    if "PODAGENT_TOKEN" not in given:
        del env["PODAGENT_TOKEN"]  # the user deleted the line (Ray < 2.52)
    env.update(given, WANDB_MODE="offline", PODAGENT_AFTER_RUN="exit")
    head = PodContainer(net, image, "head", {**env, "EXPECTED_WORKERS": str(workers),
                                             **(head_env or {})})
    head.env["HEAD_POD_ID"] = head.pod_id
    ws = [PodContainer(net, image, f"w{i}", {**env, "HEAD_POD_ID": head.pod_id,
                                              **(worker_env or {})})
          for i in range(1, workers + 1)]
    pods += [head, *ws]
    return head, ws


def finished_at(pod: PodContainer) -> datetime:
    # Docker's own clock: nanoseconds, trimmed to what fromisoformat reads.
    stamp = pod.state()["FinishedAt"]
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", stamp).replace("Z", "+00:00"))


def assert_no_secret_on_a_command_line(given: Secrets, *pods: PodContainer) -> None:
    """Every process of every pod: podagent, Ray's daemons, the job, the reward server."""
    seen = 0
    for pod in pods:
        for pid, argv in pod.cmdlines().items():
            seen += 1
            for name, value in given.items():
                assert not any(value in a for a in argv), f"{name} on the argv of {pod.name}/{pid}"
    assert seen >= 3 * len(pods), f"only {seen} processes seen in {len(pods)} pods"


def assert_no_secret_left_anywhere(given: Secrets, *pods: PodContainer) -> None:
    """docker logs, docker inspect (all but Config.Env, the environment the runtime was given),
    every file of the pod's volume and of Ray's temp dir inside the container."""
    for pod in pods:
        inspected = pod.inspect()
        inspected["Config"].pop("Env")
        texts = {"docker logs": pod.logs, "docker inspect": json.dumps(inspected)}
        texts.update({f"/workspace/{k}": v.decode(errors="replace")
                      for k, v in pod.read_volume().items()})
        with tempfile.TemporaryDirectory(prefix="podagent-ray-") as folder:
            pod.docker("cp", f"{pod.name}:/tmp/ray", folder, timeout=300)
            for path in Path(folder).rglob("*"):
                if path.is_file() and not path.is_symlink():
                    texts[str(path)] = path.read_bytes().decode(errors="replace")
        assert any(k.startswith("/workspace/podagent/logs/") for k in texts), sorted(texts)
        for where, text in texts.items():
            for name, value in given.items():
                assert value not in text, f"{name} appears in {pod.role_name}'s {where}"


def run_dir(files: dict[str, bytes], pod_id: str, role: str) -> str:
    """The run's folder under podagent/logs, found by the pod's own log in it."""
    (log,) = [k for k in files if k.endswith(f"/podagent-{role}-{pod_id}.log")]
    return log.rsplit("/", 1)[0]


def check_rows(out: str) -> dict[str, str]:
    return {m[1]: m[0] for m in re.finditer(r"^check: ([\d.]+) +\d .*$", out, re.M)}


@pytest.mark.parametrize("base", sorted(images.BASES))
def test_head_and_two_workers_form_pass_the_check_and_exit_0(net, pods, built, base):
    """a) head + 2 workers from the template form a cluster, the cluster check passes over
    podnet1, every container exits 0; d) each reports healthy while the run is up;
    f) no secret on any process's argv, in docker logs or inspect, the volume or Ray's logs."""
    given = Secrets(token=has_tokens(base))
    head, workers = form(net, pods, built[base].image.tag, given)
    for pod in (head, *workers):
        pod.start(health_interval=HEALTH_INTERVAL)
    for pod in (head, *workers):
        health = pod.wait_health("healthy", FORM_TIMEOUT)
        assert health["Log"][-1]["Output"].startswith("podagent runs (pid "), health
    head.wait_logs("submitted (the built-in cluster check)", FORM_TIMEOUT)
    assert_no_secret_on_a_command_line(given, head, *workers)

    codes = [pod.wait_exit(FORM_TIMEOUT) for pod in (head, *workers)]
    logs = [pod.logs for pod in (head, *workers)]
    assert codes == [0, 0, 0], "\n\n".join(text[-2500:] for text in logs)
    out = logs[0]
    assert f"this pod is the head (RUNPOD_POD_ID={head.pod_id} equals HEAD_POD_ID)" in out
    assert f"this pod: {head.ip} (address of {INTERFACE} (NCCL_SOCKET_IFNAME))" in out, out
    assert "cluster ready: 3 nodes, 0 GPUs (2 worker(s) joined)" in out
    rows = check_rows(out)
    assert set(rows) == {p.ip for p in (head, *workers)}, out[-4000:]
    for row in rows.values():
        assert f"gloo/TCP via {INTERFACE}" in row and "✗" not in row, row
    assert "check: ALL CHECKS PASSED" in out
    if has_tokens(base):
        assert "NO CLUSTER TOKEN" not in out
    else:  # Ray 2.48: no tokens, and the head says so
        assert "NO CLUSTER TOKEN" in out and "has no cluster tokens (Ray 2.52" in out
    for w, text in zip(workers, logs[1:], strict=True):
        assert f"head is {head.ip} (from DNS ({head.dns_name}))" in text, text[-2000:]
        assert f"joined the cluster at {head.ip}:6379 as {w.ip}" in text
        assert "the head is closing the run (succeeded" in text
    for text in logs:
        assert "[WARN  tini" not in text  # tini is PID 1 (no subreaper warning)
    # The workers asked the system resolver (Docker's, which forwards to the pods' DNS server).
    assert any(q.answers == (head.ip,) for q in net.dns.queries_for(head.dns_name))
    assert_no_secret_left_anywhere(given, head, *workers)


def test_docker_stop_on_the_head_mid_job_exits_143_and_the_volume_keeps_the_run(net, pods,
                                                                               built):
    """b) `docker stop` on the head while the job runs: tini passes SIGTERM to podagent, which
    stops the job, tells the workers and stops Ray within the stop timeout: exit 143, never
    Docker's SIGKILL (137); the workers (PODAGENT_REJOIN=0: they do not wait for the head to
    come back) leave with 0 and no container keeps running.
    e) after `docker rm` of every pod the volumes keep the logs, events and the checkpoint."""
    head, workers = form(net, pods, built["ray2.60"].image.tag, Secrets(token=True),
                         head_env={"PODAGENT_JOB": CHECKPOINTING_JOB,
                                   "PODAGENT_RUN_NAME": "midjob"},
                         worker_env={"PODAGENT_REJOIN": "0"})
    for pod in (head, *workers):
        pod.start()
    head.wait_logs("\ntraining\n", FORM_TIMEOUT)
    for w in workers:
        w.wait_logs("watching the head", 60)

    asked = time.monotonic()
    head.docker("stop", "--time", str(STOP_TIMEOUT), head.name, timeout=STOP_TIMEOUT + 60)
    took = time.monotonic() - asked  # `docker stop` returns once the container is gone
    state = head.state()
    out = head.logs
    assert state["ExitCode"] == EXIT_SIGTERM, (
        f"exit {state['ExitCode']} ({SIGTERM_KILLED}: Docker had to SIGKILL after "
        f"{STOP_TIMEOUT} s):\n{out[-3000:]}")
    assert [w.wait_exit(60) for w in workers] == [0, 0], "\n\n".join(
        w.logs[-2000:] for w in workers)
    assert "job midjob-1 stopped (status STOPPED)" in out, out[-3000:]
    assert "Ray stopped (" in out
    assert "ERROR" not in out  # a signal is no error
    for w in workers:
        assert "the head is closing the run (Interrupted, job STOPPED)" in w.logs
        assert "Ray stopped (" in w.logs
    assert took < STOP_TIMEOUT, f"the head took {took:.1f} s to stop"
    print(f"\ndocker stop -> the head's container exited 143: {took:.1f} s")
    assert not [p.name for p in (head, *workers) if p.state()["Running"] or p.pids()]

    expected = {head: "head", workers[0]: "worker", workers[1]: "worker"}
    for pod in expected:
        pod.remove()
    for pod, role in expected.items():
        files = pod.read_volume()
        folder = run_dir(files, pod.pod_id, role)  # workers name their own run
        # Each pod keeps its own directory under the run's (pods may share one volume).
        assert role == "worker" or folder == f"podagent/logs/midjob/{pod.pod_id}", folder
        assert "Ray stopped (" in files[f"{folder}/podagent-{role}-{pod.pod_id}.log"].decode()
        events = [json.loads(line)["event"]
                  for line in files[f"{folder}/events.jsonl"].decode().splitlines()]
        assert events[-1] == "exit", events
    files = head.read_volume()
    assert files[CHECKPOINT] == b"weights"
    assert "training" in files[f"podagent/logs/midjob/{head.pod_id}/job.log"].decode()
    assert "job_stopped" in files[f"podagent/logs/midjob/{head.pod_id}/events.jsonl"].decode()


def test_docker_kill_on_the_head_workers_leave_with_7_within_grace(net, pods, built):
    """c) `docker kill` on the head (SIGKILL to tini: every process of the pod dies, its address
    is gone): each worker (PODAGENT_REJOIN=0) exits 7 within PODAGENT_HEAD_GRACE + LEAVE_SLACK,
    by Docker's clock."""
    head, workers = form(net, pods, built["ray2.60"].image.tag, Secrets(token=True),
                         head_env={"PODAGENT_JOB": CHECKPOINTING_JOB},
                         worker_env={"PODAGENT_REJOIN": "0"})
    for pod in (head, *workers):
        pod.start()
    head.wait_logs("\ntraining\n", FORM_TIMEOUT)
    for w in workers:
        w.wait_logs("watching the head", 60)

    assert head.docker("kill", head.name).returncode == 0
    codes = [w.wait_exit(HEAD_GRACE + LEAVE_SLACK + 60) for w in workers]
    assert codes == [EXIT_HEAD_LOST] * 2, "\n\n".join(w.logs[-2000:] for w in workers)
    killed = finished_at(head)
    assert head.state()["ExitCode"] == SIGTERM_KILLED
    for w in workers:
        took = (finished_at(w) - killed).total_seconds()
        assert took <= HEAD_GRACE + LEAVE_SLACK, f"{w.role_name} took {took:.1f} s to leave"
        print(f"\ndocker kill -> {w.role_name} exited 7: {took:.1f} s (grace {HEAD_GRACE:g} s)")
        assert "has been unreachable" in w.logs
        assert "Ray stopped (" in w.logs


def test_healthcheck_unhealthy_once_podagent_is_gone_but_the_container_is_not(net, pods, built):
    """d) A pod whose start command keeps the container up after podagent (as RunPod users do to
    stop the restart loop): healthy while podagent runs; podagent killed (as by the OOM killer),
    the container and Ray's daemons live on, and the image's HEALTHCHECK turns it unhealthy."""
    # A head waiting for a worker that never comes: the run stays up, with Ray.
    (head, _) = form(net, pods, built["ray2.60"].image.tag, Secrets(token=True), workers=0,
                     head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none"})
    tini, dash, script = image_argv(dockerfile_instructions())
    head.start(script, entrypoint=[tini, dash, "/bin/sh", "-c", '"$0" "$@"; exec sleep infinity'],
               health_interval=2)
    head.wait_logs("waiting for 1 worker(s)", FORM_TIMEOUT)
    health = head.wait_health("healthy", 60)
    assert re.match(r"podagent runs \(pid \d+\); Ray (runs|not started)",
                    health["Log"][-1]["Output"]), health

    # Not the HEALTHCHECK's own `podagent status --local`, which may be running just then.
    (agent,) = [pid for pid, argv in head.cmdlines().items()
                if argv[1:2] and Path(argv[1]).name == "podagent" and argv[2:3] != ["status"]]
    os.kill(agent, signal.SIGKILL)
    health = head.wait_health("unhealthy", 60)
    assert health["Log"][-1]["Output"].strip() == "podagent is not running on this pod"
    assert head.state()["Running"]
    daemons = {Path(argv[0]).name for argv in head.cmdlines().values() if argv}
    assert {"gcs_server", "raylet"} <= daemons, daemons  # Ray alone does not make it healthy


def test_template_token_on_a_ray_without_tokens_is_refused_at_once(net, pods, built):
    """The template as it is (PODAGENT_TOKEN set) on the Ray 2.48 image: podagent refuses before
    it starts anything (exit 2), naming the Ray version, never the token."""
    given = Secrets(token=True)
    head, _ = form(net, pods, built["openrlhf"].image.tag, given, workers=0)
    head.start()
    assert head.wait_exit(120) == EXIT_BAD_INPUT, head.logs[-3000:]
    out = head.logs
    assert "2.48.0" in out and "2.52" in out, out[-3000:]
    assert given["PODAGENT_TOKEN"] not in out
    assert "Ray head up" not in out

"""Self-healing runs: a worker pod lost mid-training, the run goes on from its last checkpoint
without anyone. The job is a real training run across the nodes (tests/jobs/tiny_train.py):
that the run went on is shown by the training itself (its target step reached, the losses of
a resumed attempt equal to what the first attempt computed for the same steps, no step before
the last checkpoint done twice).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.harness.agents import Agent, form_cluster, wait_exits
from tests.harness.pods import wait_for

TRAIN = Path(__file__).resolve().parents[1] / "jobs" / "tiny_train.py"
FAKE_OPENRLHF = Path(__file__).resolve().parents[1] / "jobs" / "fake_openrlhf"
EXIT_RESTARTS_EXHAUSTED, EXIT_JOB_FAILED = 16, 3
STOPPED_WITHIN = 10.0  # the bound: pod lost -> job stopped
STEPS, EVERY = 120, 10


def _openrlhf_in_bash(checkpoints: Path) -> str:
    """The field's habit: `bash -c "cd ... && python -m openrlhf.cli.train_ppo_ray ..."` (the
    trainer a fake of OpenRLHF's entry point over tiny_train, tests/jobs/fake_openrlhf). With
    pipefail: without it a pipe's last command, not the trainer, is the job's outcome."""
    trainer = shlex.join([sys.executable, "-m", "openrlhf.cli.train_ppo_ray", "--ckpt.path",
                          str(checkpoints), "--steps", str(STEPS), "--every", str(EVERY),
                          "--step-time", "0.1"])
    return shlex.join(["bash", "-o", "pipefail", "-c",
                       f"cd {shlex.quote(str(FAKE_OPENRLHF))} && {trainer} 2>&1 | cat"])


def _trainer_argv(checkpoints: Path) -> list[dict]:
    """What the fake trainer itself received at each start (its own record)."""
    path = checkpoints / ".argv.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_job(steps: int = STEPS, step_time: float = 0.1) -> str:
    return shlex.join([sys.executable, str(TRAIN), "--steps", str(steps), "--every",
                       str(EVERY), "--step-time", str(step_time)])


def _run_dir(agent: Agent) -> Path:
    return agent.run_dir


def _ledger(agent: Agent) -> dict:
    return json.loads((_run_dir(agent) / "ledger.json").read_text())


def _events(agent: Agent, name: str) -> list[dict]:
    text = (_run_dir(agent) / "events.jsonl").read_text()
    return [e for e in map(json.loads, filter(str.strip, text.splitlines()))
            if e["event"] == name]


def _steps(checkpoints: Path) -> list[dict]:
    path = checkpoints / ".steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _restarts(head: Agent) -> str:
    """What the head said of each restart and each job's end: why a test's run went another
    way than it planned."""
    try:
        said = [e for e in map(json.loads, filter(
                    str.strip, (_run_dir(head) / "events.jsonl").read_text().splitlines()))
                if e["event"] in ("restart", "job_finished", "worker_lost", "hang")]
    except OSError as exc:
        return f"no events ({exc})"
    return f"the head's restarts and job ends: {said}"


def _wait_step(checkpoints: Path, attempt: int, step: int, head: Agent) -> None:
    def reached() -> bool:
        done = _steps(checkpoints)
        if head.proc is not None and head.proc.poll() is not None:
            raise AssertionError(f"the head exited {head.proc.returncode}; {_restarts(head)}:\n"
                                 f"{head.output[-3000:]}")
        if any(s["attempt"] > attempt for s in done):  # a restart nobody asked for
            raise AssertionError(f"attempt {attempt} was overtaken; {_restarts(head)}")
        return any(s["attempt"] == attempt and s["step"] >= step for s in done)

    wait_for(reached, timeout=FORM_TIMEOUT, interval=0.2,
             what=f"attempt {attempt} of the training to reach step {step}")


def _cluster(make_pod, dns_server, tmp_path, agents, workers: int, **head_env: str):
    checkpoints = tmp_path / "ckpt"
    head, pods = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=workers,
        head_env={"EXPECTED_WORKERS": str(workers), "PODAGENT_REWARD": "none",
                  "PODAGENT_CHECKPOINT_DIR": str(checkpoints), "PODAGENT_RESTART_BACKOFF": "1",
                  **head_env})
    for a in (head, *pods):
        a.start()
    return head, pods, checkpoints


def _kill(worker: Agent, head: Agent) -> float:
    """SIGKILL the worker's whole pod; returns when the head has acted on it (a restart begun,
    or the run over)."""
    worker.wait_output("watching the head", timeout=FORM_TIMEOUT)
    killed = time.time()
    worker.kill_pod()
    wait_for(lambda: any(e["ts"] > killed
                         for e in _events(head, "restart") + _events(head, "teardown")),
             timeout=60, interval=0.2, what="the head to act on the lost pod")
    return killed


def _assert_training_went_on(steps: list[dict], checkpoints_at: list[int]) -> None:
    """Each attempt after the first starts right after a checkpoint the previous attempt wrote,
    with the loss the previous attempt computed for that step (same weights, same batch)."""
    by_attempt: dict[int, list[dict]] = {}
    for s in steps:
        by_attempt.setdefault(s["attempt"], []).append(s)
    attempts = sorted(by_attempt)
    for earlier, later in itertools.pairwise(attempts):
        first = by_attempt[later][0]["step"]
        before = {s["step"]: s["loss"] for s in by_attempt[earlier]}
        assert first - 1 in checkpoints_at and first - 1 in before, (earlier, later, first)
        assert max(before) < first + EVERY, "more than a checkpoint interval done twice"
        if first in before:  # the step the earlier attempt did after its last checkpoint
            assert abs(before[first] - by_attempt[later][0]["loss"]) < 1e-5, (before[first],
                                                                              by_attempt[later])
        steps_of_later = [s["step"] for s in by_attempt[later]]
        assert steps_of_later == list(range(first, first + len(steps_of_later))), later
    assert by_attempt[attempts[-1]][-1]["step"] == STEPS


def test_lost_workers_replaced_or_restarted_and_the_training_finishes(make_pod, dns_server,
                                                                      tmp_path, agents):
    """A worker pod killed mid-training and a replacement pod (new id, new address) started:
    the job is stopped within 10 s, submitted again once the replacement joined, resuming from
    the newest checkpoint. Then the other worker's pod is killed and the same pod restarted:
    the same again. Training reaches its target step; the ledger shows 3 attempts and the time
    each restart lost. The job is an OpenRLHF command inside `bash -c`: each resubmitted job's
    trainer itself receives `--ckpt.load_enable` (bash would make an argument after the
    string its $0)."""
    checkpoints = tmp_path / "ckpt"
    head, (w1, w2), _ = _cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 PODAGENT_JOB=_openrlhf_in_bash(checkpoints))

    _wait_step(checkpoints, attempt=1, step=EVERY + 3, head=head)
    killed = _kill(w1, head)
    (restart,) = _events(head, "restart")
    assert restart["ts"] - killed <= STOPPED_WITHIN, restart
    assert restart["lost"] == [w1.pod.ip] and restart["n"] == 1, restart
    replacement_pod = make_pod("w3", register=True)
    replacement = Agent(replacement_pod, dns_server, tmp_path,
                        {"HEAD_POD_ID": head.env["HEAD_POD_ID"]})
    agents.append(replacement)
    replacement.start()

    _wait_step(checkpoints, attempt=2, step=2 * EVERY + 3 + 10, head=head)
    joined = [e for e in _events(head, "worker_joined") if e.get("replaces")]
    assert [(e["ip"], e["replaces"]) for e in joined] == [(replacement_pod.ip, w1.pod.ip)]
    # The replacement checked its NCCL preset against its own interfaces, as every worker does.
    preset = "NCCL preset runpod-global: RUNPOD_POD_ID/HEAD_POD_ID are set"
    assert preset in replacement.output and preset in w1.output
    submitted = [e for e in _events(head, "job_submitted") if e.get("result") == "ok"]
    assert [e["submission_id"] for e in submitted] == ["e2e-1", "e2e-2"]
    assert joined[0]["ts"] < submitted[1]["ts"], "resubmitted before the replacement joined"
    ledger = _ledger(head)
    assert [s["id"] for s in ledger["submissions"]] == ["e2e-1", "e2e-2"], ledger
    assert ledger["restarts"][0]["time_lost_s"] > 0, ledger
    assert "--ckpt.load_enable" in head.output.split("job e2e-2 submitted")[1].splitlines()[0]

    killed = _kill(w2, head)
    second = _events(head, "restart")[-1]
    assert second["n"] == 2 and second["lost"] == [w2.pod.ip], second
    assert second["ts"] - killed <= STOPPED_WITHIN, second
    w2_again = w2.restarted()
    agents.append(w2_again)
    w2_again.start()

    assert head.wait_exit(FORM_TIMEOUT) == 0, head.output[-4000:]
    assert f"TRAINED steps={STEPS} attempt=3" in head.output
    assert f"(the lost pod {w2.pod.ip} is back)" in head.output
    ledger = _ledger(head)
    assert [s["id"] for s in ledger["submissions"]] == ["e2e-1", "e2e-2", "e2e-3"], ledger
    assert [s["resumed_from"] for s in ledger["submissions"]] == [None, "e2e-1", "e2e-2"]
    assert [r["n"] for r in ledger["restarts"]] == [1, 2]
    assert all(r["time_lost_s"] > 0 and r["submission"] for r in ledger["restarts"]), ledger
    assert ledger["finished"]["outcome"] == "succeeded", ledger
    saved = sorted(int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt"))
    _assert_training_went_on(_steps(checkpoints), saved)
    starts = _trainer_argv(checkpoints)
    assert [s["attempt"] for s in starts] == [1, 2, 3], starts
    assert "--ckpt.load_enable" not in starts[0]["argv"], starts
    assert all(s["argv"][-1] == "--ckpt.load_enable" for s in starts[1:]), starts
    for w in (replacement, w2_again):
        assert w.wait_exit(30) == 0, w.output[-3000:]


def test_restarts_exhausted_exit_16_with_the_checkpoints_kept(make_pod, dns_server, tmp_path,
                                                              agents):
    """PODAGENT_RESTARTS=1 and two losses: the second ends the run with exit 16, one line
    naming the limit, the checkpoints and the ledger intact."""
    head, (worker,), checkpoints = _cluster(
        make_pod, dns_server, tmp_path, agents, workers=1, PODAGENT_RESTARTS="1",
        PODAGENT_JOB=_train_job(steps=10_000, step_time=0.05))
    for attempt in (1, 2):
        # the first loss comes after a checkpoint: the test then shows it survives
        _wait_step(checkpoints, attempt=attempt, step=EVERY + 1 if attempt == 1 else 1,
                   head=head)
        _kill(worker, head)
        if attempt == 1:  # the second loss ends the run: the head waits for nobody
            worker = worker.restarted()
            agents.append(worker)
            worker.start()
    assert head.wait_exit(60) == EXIT_RESTARTS_EXHAUSTED, head.output[-3000:]
    (error,) = [line for line in head.output.splitlines() if "ERROR" in line]
    assert "already restarted 1 time(s) (PODAGENT_RESTARTS=1): giving up" in error, error
    ledger = _ledger(head)
    assert len(ledger["submissions"]) == 2 and len(ledger["restarts"]) == 1, ledger
    assert ledger["finished"]["outcome"] == "RestartsExhausted", ledger
    assert ledger["finished"]["exit_code"] == EXIT_RESTARTS_EXHAUSTED, ledger
    assert checkpoints.is_dir() and list(checkpoints.glob("step-*.pt")), "checkpoints lost"


def test_a_worker_whose_raylet_exits_joins_again_in_its_own_process(make_pod, dns_server,
                                                                    tmp_path, agents):
    """A worker pod frozen (no CPU) until the head's Ray marks its node dead, then running
    again: its raylet exits (Ray's health checks said the node is dead) and the worker joins
    again in its own process; the head counts the pod once and starts the job on every pod.
    Then the other worker's raylet is killed mid-training: that worker joins again too, and
    the head restarts the job from its checkpoint with the same pod back. Every pod exits 0."""
    checkpoints = tmp_path / "ckpt"
    head, (w1, w2) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=2,
        head_env={"EXPECTED_WORKERS": "2", "PODAGENT_REWARD": "none",
                  "PODAGENT_CHECKPOINT_DIR": str(checkpoints), "PODAGENT_RESTART_BACKOFF": "1",
                  "PODAGENT_JOB": _train_job()})
    head.start()
    w1.start()
    w1.wait_output("watching the head", timeout=FORM_TIMEOUT)
    w1.freeze_pod()
    try:
        head.wait_output(f"worker {w1.pod.ip} left again before the job started", timeout=60)
    finally:
        w1.freeze_pod(False)
    w2.start()

    _wait_step(checkpoints, attempt=1, step=EVERY + 3, head=head)
    (raylet,) = w2.pod_processes("raylet")
    os.kill(raylet, signal.SIGKILL)

    assert wait_exits((head, w1, w2), FORM_TIMEOUT) == [0, 0, 0]
    for w, why in ((w1, "its last error: "), (w2, "")):
        (rejoined,) = [line for line in w.output.splitlines()
                       if "this pod's raylet exited" in line]
        assert why in rejoined and "(rejoin 1 of at most 3)" in rejoined, rejoined
        assert w.output.count("joined the cluster at") == 2, w.said()
    out = head.output
    assert out.count("cluster ready: 3 nodes") == 2, out[-4000:]  # the start and the restart
    assert f"(the lost pod {w2.pod.ip} is back)" in out
    assert "submitting anyway" not in out  # no rank placed on a node Ray still listed
    assert f"TRAINED steps={STEPS} attempt=2" in out
    ledger = _ledger(head)
    assert [(r["n"], r["lost"]) for r in ledger["restarts"]] == [(1, [w2.pod.ip])], ledger
    assert ledger["finished"]["outcome"] == "succeeded", ledger
    saved = sorted(int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt"))
    _assert_training_went_on(_steps(checkpoints), saved)

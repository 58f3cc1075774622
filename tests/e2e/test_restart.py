"""Restarts, as RunPod does them: a pod's container started again with the same environment
and the same volume (here: podagent started again in the same pod, same log dir).

A finished run is never run again; a head that dies mid-job is started again and submits the
job once more, resuming from its checkpoint, while the workers (never restarted) wait for it
and join it again; after the run a pod stays up or exits (a pod that stops itself through
RunPod's API: tests/e2e/test_pod_end.py); a signal ends each pod within RunPod's
SIGTERM-to-SIGKILL window.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path

from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.harness.agents import Agent, form_cluster
from tests.harness.pods import Pod, wait_for

EXIT_JOB_FAILED, EXIT_SIGTERM = 3, 143
GRACE = "3"  # PODAGENT_HEAD_GRACE for the workers: a lost head is noticed in seconds
SIGTERM_WINDOW = 5.0  # RunPod sends SIGKILL about 5 s after SIGTERM
REJOIN_LINE = "this pod's Ray is stopped and podagent waits for the head again"
SAVE_ONCE = Path(__file__).resolve().parents[1] / "jobs" / "save_once.py"
LONG_JOB = "python -c 'import time; print(\"step\", 1, flush=True); time.sleep(600)'"


def _run_dir(agent: Agent) -> Path:
    return agent.run_dir


def _ledger(agent: Agent) -> dict:
    return json.loads((_run_dir(agent) / "ledger.json").read_text())


def _events(agent: Agent) -> list[dict]:
    text = (_run_dir(agent) / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _sigterm(agent: Agent) -> tuple[float, float]:
    """SIGTERM to the pod's podagent: (seconds until it exited, until the pod was empty)."""
    assert agent.proc is not None and agent.proc.poll() is None, agent.output[-3000:]
    sent = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    exited = empty = None
    while time.monotonic() - sent < 30:
        now = time.monotonic()
        if exited is None and agent.proc.poll() is not None:
            exited = now - sent
        if exited is not None and not agent.pod.pids():
            empty = now - sent
            break
        time.sleep(0.02)
    assert exited is not None and empty is not None, (
        f"{agent.pod.name} not gone 30 s after SIGTERM: {agent.pod.pids()}\n"
        f"{agent.output[-3000:]}")
    print(f"\nSIGTERM -> {agent.pod.name}: podagent exited after {exited:.2f} s, "
          f"the pod was empty after {empty:.2f} s")
    return exited, empty


def _joining(pod: Pod) -> bool:
    """Whether the pod's `ray start --address ...` (a worker joining) runs now."""
    for pid in pod.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start" in argv and b"--address" in argv:
            return True
    return False


def test_a_finished_run_is_not_run_again_and_a_staying_pod_leaves_on_sigterm(
        make_pod, dns_server, tmp_path, agents):
    """a) a head whose job failed, started again on the same pod with the same environment,
    submits nothing and exits as the run did; with PODAGENT_AFTER_RUN=stay it stays up until
    SIGTERM, then leaves at once. f) a PODAGENT_* name with a typo is warned about, naming the
    setting it resembles and never its value."""
    job = "python -c 'print(\"job ran\", flush=True); raise SystemExit(1)'"
    head, _ = form_cluster(make_pod, dns_server, tmp_path, agents, workers=0,
                           head_env={"EXPECTED_WORKERS": "0", "PODAGENT_REWARD": "none",
                                     "PODAGENT_JOB": job, "PODAGENT_WORKER_TIMOUT": "4242"})
    first = head.start()
    code = first.wait_exit(FORM_TIMEOUT)
    assert code == EXIT_JOB_FAILED, first.output[-3000:]
    assert "job e2e-1 submitted" in first.output
    (warning,) = [line for line in first.output.splitlines() if "WORKER_TIMOUT" in line]
    assert ("WARNING: PODAGENT_WORKER_TIMOUT is not a podagent setting; did you mean "
            "PODAGENT_WORKER_TIMEOUT? (ignored)") in warning, warning
    for path in [first.out_path, *_run_dir(first).rglob("*")]:
        assert "4242" not in path.read_text(errors="replace"), path  # the value, nowhere
    ledger = _ledger(first)
    assert ledger["finished"]["outcome"] == "JobFailed", ledger
    assert ledger["finished"]["exit_code"] == EXIT_JOB_FAILED, ledger

    again = head.restarted()
    agents.append(again)
    again.start()
    assert again.wait_exit(60) == code, again.output[-3000:]
    out = again.output
    assert "run e2e finished earlier (JobFailed, job FAILED" in out, out[-3000:]
    assert "not running it again" in out
    assert "submitted" not in out and "Ray head up" not in out, out[-3000:]
    assert (_run_dir(head) / "job.log").read_text().splitlines().count("job ran") == 1
    assert [s["id"] for s in _ledger(head)["submissions"]] == ["e2e-1"]
    assert again.pod.pids() == []

    staying = again.restarted({"PODAGENT_AFTER_RUN": "stay"})
    agents.append(staying)
    staying.start()
    staying.wait_output("staying up (PODAGENT_AFTER_RUN=stay)", timeout=60)
    time.sleep(3)
    assert staying.proc is not None and staying.proc.poll() is None, staying.output[-3000:]
    assert "finished earlier" in staying.output and "submitted" not in staying.output
    exited, _ = _sigterm(staying)
    assert exited < 2.0, f"a staying pod took {exited:.2f} s to leave on SIGTERM"
    assert staying.proc.returncode == code, staying.output[-3000:]
    assert len(_ledger(head)["submissions"]) == 1


def test_head_lost_while_a_worker_joins_then_mid_job_the_worker_rejoins_and_the_job_resumes_once(
        make_pod, dns_server, tmp_path, agents):
    """d) the head pod dies while the worker's `ray start` joins it: the worker stops the
    attempt and says so within 15 s, then joins the head started again on that pod.
    c) that head pod dies mid-job (after a checkpoint): the worker (the same process all along)
    waits again; the head started once more submits the job once, as e2e-2 with the resume
    flag, and it finishes; the ledger holds exactly the two submissions."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    script = SAVE_ONCE
    head, (worker,) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=1,
        head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                  "PODAGENT_CHECKPOINT_DIR": str(checkpoints),
                  "PODAGENT_JOB": shlex.join([sys.executable, str(script)])},
        worker_env={"PODAGENT_HEAD_GRACE": GRACE})

    # d) The head dies while the worker joins it.
    head.start()
    head.wait_output("waiting for 1 worker(s)", timeout=FORM_TIMEOUT)
    worker.start()
    wait_for(lambda: _joining(worker.pod), timeout=FORM_TIMEOUT, interval=0.02,
             what="the worker's `ray start --address`")
    killed = time.monotonic()
    head.kill_pod()
    worker.wait_output(REJOIN_LINE, timeout=30)
    took = time.monotonic() - killed
    print(f"\nhead killed while the worker joined: the worker said so after {took:.1f} s")
    assert took <= 15, f"the worker noticed the lost head after {took:.1f} s"
    assert "stopped answering" in worker.output and "while this pod was joining" in \
        worker.output, worker.output[-3000:]

    second = head.restarted()
    agents.append(second)
    started = time.monotonic()
    second.start()
    second.wait_output(f"worker joined: {worker.pod.ip}", timeout=FORM_TIMEOUT)
    print(f"head started again: the worker joined it after {time.monotonic() - started:.1f} s")

    # c) That head dies mid-job, after the job saved a checkpoint.
    second.wait_output("\nsaved\n", timeout=FORM_TIMEOUT)
    worker.wait_output("watching the head", timeout=30)
    assert f"no checkpoint in {checkpoints}: the job starts fresh" in second.output
    killed = time.monotonic()
    second.kill_pod()
    assert second.proc is not None
    second.proc.wait(timeout=10)
    wait_for(lambda: second.pod.pids() == [], timeout=10, what="the head pod to be empty")
    dead_at = time.time()
    wait_for(lambda: worker.output.count(REJOIN_LINE) == 2, timeout=int(GRACE) + 30,
             interval=0.1, what="the worker to wait for the head again")
    took = time.monotonic() - killed
    print(f"head killed mid-job: the worker waited for it again after {took:.1f} s")
    assert "has been unreachable" in worker.output

    third = second.restarted()
    agents.append(third)
    started, third_at = time.monotonic(), time.time()
    third.start()
    third.wait_output(f"worker joined: {worker.pod.ip}", timeout=FORM_TIMEOUT)
    print(f"head started again: the worker joined it after {time.monotonic() - started:.1f} s")
    assert third.wait_exit(FORM_TIMEOUT) == 0, third.output[-3000:]
    assert worker.wait_exit(60) == 0, worker.output[-3000:]

    out = third.output
    assert "run e2e was interrupted (job e2e-1: running when its head stopped)" in out, out[-3000:]
    assert (f"resuming: {checkpoints} holds a checkpoint (step-1), so the job gets "
            f"--load_checkpoint") in out
    assert out.count(" submitted (") == 1 and "job e2e-2 submitted" in out, out[-3000:]
    assert "resumed from ['model.txt']" in out and "[head] job SUCCEEDED" in out
    ledger = _ledger(third)
    first_sub, resubmitted = ledger["submissions"]
    assert first_sub["id"] == "e2e-1" and resubmitted["id"] == "e2e-2", ledger
    assert resubmitted["resumed_from"] == "e2e-1" and resubmitted["status"] == "SUCCEEDED", ledger
    if first_sub.get("ended_at") is not None:
        assert resubmitted["at"] > first_sub["ended_at"], ledger
    else:  # its head was SIGKILLed: nothing recorded its end
        assert first_sub["status"] is None and resubmitted["at"] > dead_at, (ledger, dead_at)
    assert len(ledger["starts"]) == 3 and ledger["finished"]["outcome"] == "succeeded", ledger
    # events.jsonl is the run's: each start of the head appends to it.
    submitted = [e for e in _events(third) if e["event"] == "job_submitted"]
    assert [(e.get("submission_id"), e["ts"] > third_at) for e in submitted] == [
        ("e2e-1", False), ("e2e-2", True)], submitted
    # One worker process throughout: it joined twice (the first attempt was stopped).
    assert worker.output.count("joined the cluster at") == 2, worker.output[-3000:]
    rejoins = [e for e in _events(worker) if e["event"] == "rejoining"]
    assert len(rejoins) == 2, rejoins
    for a in (third, worker):
        assert a.pod.pids() == [], f"{a.pod.name} left processes behind"


def test_sigterm_to_each_role_mid_job_ends_that_pod_within_5_s(make_pod, dns_server, tmp_path,
                                                               agents):
    """e) SIGTERM (as RunPod sends it, SIGKILL about 5 s later) to the worker, then to the head,
    while the job runs: each pod is empty within 5 s; the events say `terminating`; the head's
    ledger records this start as Interrupted and the run as not finished (a restart resumes
    it)."""
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                   head_env={"EXPECTED_WORKERS": "1", "PODAGENT_JOB": LONG_JOB})
    for a in (head, worker):
        a.start()
    head.wait_output("\nstep 1\n", timeout=FORM_TIMEOUT)
    worker.wait_output("watching the head", timeout=30)

    for a in (worker, head):
        exited, empty = _sigterm(a)
        assert a.proc.returncode == EXIT_SIGTERM, a.output[-3000:]
        assert exited < SIGTERM_WINDOW and empty < SIGTERM_WINDOW, (
            f"{a.pod.name}: podagent exited after {exited:.2f} s, the pod was empty after "
            f"{empty:.2f} s\n{a.output[-3000:]}")
        (terminating,) = [e for e in _events(a) if e["event"] == "terminating"]
        assert terminating["signal"] == signal.SIGTERM, terminating
        assert "Ray stopped (" in a.output, a.output[-3000:]
    ledger = _ledger(head)
    assert ledger["starts"][-1]["outcome"] == "Interrupted", ledger
    assert "finished" not in ledger, ledger
    (submission,) = ledger["submissions"]
    assert submission["id"] == "e2e-1" and submission["status"] is not None, ledger


def test_a_head_started_again_at_its_address_before_its_worker_noticed_is_joined_again(
        make_pod, dns_server, tmp_path, agents):
    """The head pod dies mid-job and its container is started again at once, at the same
    address, before the worker's grace ran out (120 s here): the worker must not take the new
    Ray for the one it joined (its raylet belongs to the old one and would die a minute later,
    with the run). It sees the head's start id change, joins the new Ray, and the job resumes
    from its checkpoint and succeeds."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    head, (worker,) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=1,
        head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                  "PODAGENT_CHECKPOINT_DIR": str(checkpoints),
                  "PODAGENT_JOB": shlex.join([sys.executable, str(SAVE_ONCE)])},
        worker_env={"PODAGENT_HEAD_GRACE": "120"})
    for a in (head, worker):
        a.start()
    head.wait_output("\nsaved\n", timeout=FORM_TIMEOUT)
    worker.wait_output("watching the head", timeout=30)
    head.kill_pod()
    assert head.proc is not None
    head.proc.wait(timeout=10)
    again = head.restarted()
    agents.append(again)
    again.start()  # at once: the worker still waits out its grace for the old head
    assert again.wait_exit(FORM_TIMEOUT) == 0, again.output[-3000:]
    assert worker.wait_exit(60) == 0, worker.output[-3000:]
    assert "answers with a new Ray (its pod was started again)" in worker.output, \
        worker.output[-3000:]
    assert worker.output.count("joined the cluster at") == 2, worker.output[-3000:]
    assert "resumed from ['model.txt']" in again.output and "[head] job SUCCEEDED" in \
        again.output, again.output[-3000:]
    for a in (again, worker):
        assert a.pod.pids() == [], f"{a.pod.name} left processes behind"

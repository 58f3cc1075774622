"""A hung rank on the Ray path, three namespaced pods (real DNS, real Ray, gloo): the head's
progress watch finds it within PODAGENT_HANG_TIMEOUT (+10 s), every pod dumps its part of the
job (the head over Ray's key-value store), the head names the actor that is not in a
collective, stops the job and submits it again resuming from the newest checkpoint, and the
training finishes (exit 0). With restarts off, the cluster check's hang drill ends the run
with its own code on the head, and the workers leave; nothing of the job is left running.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from podagent import errors
from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.e2e.test_hang import _code, events
from tests.e2e.test_recovery import TRAIN, _cluster, _ledger
from tests.harness.agents import Agent
from tests.harness.pods import wait_for

STEPS, EVERY, HANG_AT = 40, 5, 13
# Under the suite's load a job's c10d store alone has taken over 15 s to form (each peer's name
# looked up in vain), with no output meanwhile: the cluster check's, and a resumed training's
# (seen in CI three times, once past 35 s). The watch needs room for that, or it rightly fires
# on a start that is only slow; and it must fire well before gloo's own timeout ends the hung
# collective (COLLECTIVE_TIMEOUT, the job's).
WATCH_TIMEOUT = 50.0
COLLECTIVE_TIMEOUT = 150.0
DETECTED_WITHIN = WATCH_TIMEOUT + 10.0  # the acceptance's bound


def _job_processes_gone(pods: list[Agent]) -> None:
    for a in pods:
        wait_for(lambda a=a: not a.pod.pids(), timeout=30, interval=0.2,
                 what=f"{a.pod.name} to hold no process")


def _the_hang(head: Agent, pods: list[Agent], hung_ip: str, hung_at: float) -> dict:
    [hang] = events(head, "hang")
    assert hang["ts"] - hung_at <= DETECTED_WITHIN, hang
    named = {p.pod.ip: f"{p.pod.ip} ({p.pod.pod_id})" for p in pods}
    # Every pod answered with its part of the job, each process in a file there.
    assert set(hang["pods"]) == set(named.values()), hang["pods"]
    for pod, dumped in hang["pods"].items():
        assert dumped["stacks"], (pod, dumped)
        for stack in dumped["stacks"]:
            assert Path(stack["file"]).is_file(), stack
    [culprit] = hang["culprits"]
    assert culprit["pod"] == named[hung_ip], (culprit, named)
    return hang


def test_a_hung_actor_is_named_and_the_job_resumes_from_its_checkpoint(make_pod, dns_server,
                                                                       tmp_path, agents):
    job = shlex.join([sys.executable, str(TRAIN), "--steps", str(STEPS), "--every", str(EVERY),
                      "--step-time", "0.1", "--hang-rank", "2", "--hang-at", str(HANG_AT),
                      "--collective-timeout", f"{COLLECTIVE_TIMEOUT:g}"])
    head, workers, checkpoints = _cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                          PODAGENT_JOB=job,
                                          PODAGENT_HANG_TIMEOUT=f"{WATCH_TIMEOUT:g}")
    pods = [head, *workers]
    assert head.wait_exit(FORM_TIMEOUT + 120) == 0, head.said()
    for w in workers:
        assert w.wait_exit(60) == 0, w.said()
    _job_processes_gone(pods)
    marker = json.loads((checkpoints / ".hung.json").read_text())
    hang = _the_hang(head, pods, marker["ip"], marker["at"])
    [culprit] = hang["culprits"]
    assert "Trainer" in culprit["name"], culprit
    ranks = [s for d in hang["pods"].values() for s in d["stacks"] if "Trainer" in s["label"]]
    assert len(ranks) == 3 and all(not s["error"] for s in ranks), ranks  # every rank's stack
    [restart] = events(head, "restart")
    assert "PODAGENT_HANG_TIMEOUT" in restart["reason"], restart
    assert "likely culprit" in restart["reason"], restart
    assert f"TRAINED steps={STEPS} attempt=2" in head.output
    ledger = _ledger(head)
    assert [s["resumed_from"] for s in ledger["submissions"]] == [None, "e2e-1"], ledger
    resumed = head.output.split("job e2e-2 submitted")[1].splitlines()[0]
    assert "--load_checkpoint" in resumed, resumed
    assert f"resumed from step-{HANG_AT // EVERY * EVERY:06d}.pt" in head.output


def test_with_restarts_off_the_check_drill_ends_the_run_with_its_own_code(make_pod, dns_server,
                                                                          tmp_path, agents):
    head, workers, _ = _cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                PODAGENT_RESTARTS="0", PODAGENT_CHECK_HANG_RANK="1",
                                PODAGENT_HANG_TIMEOUT=f"{WATCH_TIMEOUT:g}")
    pods = [head, *workers]
    assert head.wait_exit(FORM_TIMEOUT + 120) == _code(errors.RunHung), head.said()
    for w in workers:
        assert w.wait_exit(60) == 0, w.said()
    _job_processes_gone(pods)
    [hang] = events(head, "hang")
    assert len(hang["culprits"]) == 1, hang  # what each pod's dump said, when none stood out
    [culprit] = hang["culprits"]
    assert "CheckRank" in culprit["name"], culprit
    assert not events(head, "restart")
    error = next(line for line in head.output.splitlines() if "ERROR" in line)
    assert "PODAGENT_RESTARTS=0" in error and "likely culprit" in error, error
    assert _ledger(head)["finished"]["outcome"] == "RunHung"

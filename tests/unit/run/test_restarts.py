"""One restart count per run (run/restarts.py): the starts a run without Ray began after lost
pods count against PODAGENT_RESTARTS with its hang restarts, once each, on the volume."""

from __future__ import annotations

import io

import pytest

from podagent import config, errors
from podagent.report import Reporter
from podagent.run import policy, restarts
from podagent.run.ledger import Ledger
from podagent.wire import Ending


def _reporter() -> tuple[Reporter, io.StringIO]:
    out = io.StringIO()
    return Reporter("head", "pod", None, stream=out), out


def _number(settings: config.Settings, ledger: Ledger) -> int:
    """The restart this start is (0: none), as the run without Ray counts it."""
    restart = restarts.after_lost_starts(settings, ledger, _reporter()[0])
    return restart.n if restart else 0


def test_hang_restarts_and_lost_pod_restarts_share_one_budget(tmp_path):
    """A run without Ray keeps one PODAGENT_RESTARTS budget whatever the mix of causes: a
    hang's restart (the supervisor records it in the ledger) counts against the restarts
    after lost pods, and each lost pod's restart is recorded there once for the hang's count."""
    settings = config.build({}, {"PODAGENT_RESTARTS": "2", "PODAGENT_LOG_DIR": str(tmp_path)})
    ledger = Ledger.load(tmp_path, "r")
    ledger.started("pod")
    assert _number(settings, ledger) == 0
    # a hang in the first start: restarted in place, as HeadSupervisor does
    reporter, out = _reporter()
    hang = restarts.begin(settings, ledger, reporter, "no progress", "starting it again",
                          Ending.HUNG, culprits="pod-a")
    assert hang.n == 1 and "RESTART 1/2: no progress; starting it again" in out.getvalue()
    ledger.ended("PeerLost", None)  # then a pod was lost: the containers start it again
    ledger.started("pod")
    assert _number(settings, ledger) == 2  # the second restart of the run, not the first
    assert _number(settings, ledger) == 0  # counted once, however often it is asked
    assert len(Ledger.load(tmp_path, "r").restarts) == 2  # on the volume, for the next start
    with pytest.raises(errors.RunHung, match="already restarted 2 time"):
        policy.admit(settings, len(ledger.restarts), "hang", Ending.HUNG)  # a hang now
    ledger.ended("PeerLost", None)
    ledger.started("pod")
    with pytest.raises(errors.RestartsExhausted, match="already restarted 2 time"):
        _number(settings, ledger)


def test_a_run_whose_pods_keep_getting_lost_is_started_again_only_so_often(tmp_path):
    settings = config.build({}, {"PODAGENT_RESTARTS": "2", "PODAGENT_LOG_DIR": str(tmp_path)})
    ledger = Ledger.load(tmp_path, "r")
    for outcome in ("PeerLost", "WorkersTimeout"):  # the first start, then a restart, ended so
        ledger.started("pod")
        ledger.ended(outcome, None)
    ledger.started("pod")
    assert _number(settings, ledger) == 2  # the second restart may run
    ledger.ended("PeerLost", None)
    ledger.started("pod")
    with pytest.raises(errors.RestartsExhausted, match=r"lost or missing 3 time\(s\); the run "
                                                       r"was already restarted 2 time\(s\) "
                                                       r"\(PODAGENT_RESTARTS=2\)"):
        _number(settings, ledger)


def test_a_first_start_is_no_restart_and_the_backoff_doubles(tmp_path):
    settings = config.build({}, {"PODAGENT_RESTARTS": "5", "PODAGENT_RESTART_BACKOFF": "4",
                                 "PODAGENT_LOG_DIR": str(tmp_path)})
    ledger = Ledger.load(tmp_path, "r")
    ledger.started("pod")
    assert _number(settings, ledger) == 0
    ledger.ended("JobFailed", None)  # a finished run is never a restart
    ledger.started("pod")
    assert _number(settings, ledger) == 0
    assert [policy.backoff(settings, n) for n in (1, 2, 3, 8)] == [4.0, 8.0, 16.0, 300.0]


def test_a_ray_heads_hang_and_lost_node_restarts_share_one_budget(tmp_path):
    """The Ray head's restarts (cluster/recovery.py), after a hang or a lost node, count in the
    run's one PODAGENT_RESTARTS budget: once it is used up, a hang ends the run as RunHung and a
    lost node as RestartsExhausted, and each restart is on the volume for the next start."""
    from podagent.cluster.census import WorkerCensus
    from podagent.cluster.job_spec import JobAttempt
    from podagent.cluster.recovery import Recovery
    from podagent.waiting import Signals

    class Submitted:  # a JobRunner's name for its submission is all a restart reads of it
        submission_id = "r-1"

    settings = config.build({}, {"PODAGENT_RESTARTS": "2", "PODAGENT_LOG_DIR": str(tmp_path)})
    ledger = Ledger.load(tmp_path, "r")
    ledger.started("pod")
    reporter, out = _reporter()
    recovery = Recovery(settings, ledger, WorkerCensus(lambda: [], reporter), reporter,
                        Signals())
    job = JobAttempt(Submitted(), status="FAILED", ended_at=1.0)  # type: ignore[arg-type]
    assert recovery.begin("no progress", [], job, Ending.HUNG).n == 1
    assert recovery.begin("lost 10.0.0.2", [], job, Ending.LOST).n == 2
    with pytest.raises(errors.RunHung, match="already restarted 2 time"):
        recovery.begin("no progress", [], job, Ending.HUNG)
    with pytest.raises(errors.RestartsExhausted, match="already restarted 2 time"):
        recovery.begin("lost 10.0.0.3", [], job, Ending.LOST)
    assert [r["n"] for r in Ledger.load(tmp_path, "r").restarts] == [1, 2]
    assert out.getvalue().count("RESTART ") == 2

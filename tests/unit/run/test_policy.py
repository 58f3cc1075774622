"""The run's policy, one for both engines: which cause wins when several show, how each pod of
a run without Ray exits for it (the pod the cause is about, and every other), and whether the
run is started again (a Ray job's end, or a run without Ray's cause)."""

from __future__ import annotations

import pytest

from podagent import config, errors
from podagent.run import exits
from podagent.run.policy import Cause, hurried_stop, restart_reason, stronger
from podagent.wire import Ending

HEAD, W1, W2 = "10.0.0.1 (h)", "10.0.0.2 (a)", "10.0.0.3 (b)"


def _exit(cause: Cause, me: str) -> tuple[int, str]:
    error = cause.error(me, "torchrun")
    return (0, "") if error is None else (exits.exit_code(error), str(error))


def test_a_lost_pod_outranks_the_failures_that_follow_it_whatever_came_first():
    failed = Cause("failed", W2, step="training", rc=1)
    lost = Cause("lost", W1, "its podagent's connection closed")
    assert stronger(stronger(None, failed), lost) is lost
    assert stronger(stronger(None, lost), failed) is lost
    # Of two of a kind, the first stays: it is what happened first.
    assert stronger(lost, Cause("lost", W2, "silent for 5 s")) is lost


def test_every_other_pod_exits_22_naming_the_lost_pod():
    lost = Cause("lost", W1, "silent for 5 s (no heartbeat)")
    for me in (HEAD, W2):
        code, line = _exit(lost, me)
        assert code == 22
        assert line == (f"pod {W1} was lost: silent for 5 s (no heartbeat); stopped this pod's "
                        f"training")


def test_a_failed_training_fails_the_run_on_every_pod_naming_where():
    """Exit 3 everywhere: the run is over for every pod alike (a head that took it for a lost
    pod would start it again and wait for a worker that will not come)."""
    failed = Cause("failed", W2, step="training", rc=7)
    assert _exit(failed, W2) == (3, "the training (torchrun) exited 7 on this pod; stopped it "
                                    "on every pod")
    code, line = _exit(failed, HEAD)
    assert code == 3 and f"the training failed on pod {W2} (torchrun exited 7)" in line


def test_a_stop_a_failed_data_check_and_a_success_exit_alike_on_every_pod():
    for me in (HEAD, W1):
        assert _exit(Cause("stopped", "pod-x"), me)[0] == exits.exit_code(errors.JobStopped("x"))
        assert _exit(Cause("overlap", HEAD, "data check: ..."), me) == (23, "data check: ...")
        assert _exit(Cause("succeeded"), me) == (0, "")


@pytest.mark.parametrize("kind", list(Ending))
def test_the_training_is_hurried_out_only_by_a_signal_or_a_broken_run(kind):
    """A lost pod or a hang leaves ranks in collectives that broke: 3 s, not the stop timeout;
    a stop timeout set by hand (a trainer that saves on SIGTERM) holds for them too."""
    default, given = config.build({}, {}), config.build({}, {"PODAGENT_STOP_TIMEOUT": "60"})
    broken = kind in (Ending.LOST, Ending.HUNG)
    assert hurried_stop(default, Cause(kind), signalled=False) is broken
    assert hurried_stop(given, Cause(kind), signalled=False) is False
    assert hurried_stop(default, Cause(kind), signalled=True)
    assert hurried_stop(given, Cause(kind), signalled=True)
    assert hurried_stop(default, None, signalled=False) is False


def test_a_cause_crosses_the_wire_unchanged():
    cause = Cause("failed", W1, "", "data check", 2)
    assert Cause.from_wire(cause.to_wire()) == cause


def test_a_cause_of_a_kind_this_podagent_does_not_know_is_a_lost_pod():
    cause = Cause.from_wire({"kind": "exploded", "pod": W1, "rc": "7"})
    assert (cause.kind, cause.pod, cause.rc) == (Ending.LOST, W1, None)
    assert stronger(Cause("failed", W2, step="training", rc=1), cause) is cause


def test_with_on_node_loss_fail_a_lost_pod_fails_the_run_on_every_pod():
    """The same policy that keeps a Ray head from resubmitting (see below) keeps a run without
    Ray from exiting for a restart."""
    settings = config.build({}, {"PODAGENT_ON_NODE_LOSS": "fail"})
    lost = Cause("lost", W1, "silent for 5 s (no heartbeat)")
    assert restart_reason(settings, lost) is None
    for me in (HEAD, W2):
        error = lost.error(me, "torchrun", settings)
        assert exits.exit_code(error) == 3 and "PODAGENT_ON_NODE_LOSS=fail" in str(error)
    assert restart_reason(config.build({}, {}), lost) == f"lost {W1}"
    assert exits.exit_code(lost.error(W2, "torchrun", config.build({}, {}))) == 22


# --- a Ray job's end -----------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "status", "lost", "why"), [
    ({}, "SUCCEEDED", ["10.0.0.2"], None),  # it finished anyway
    ({}, "FAILED", ["10.0.0.2"], "lost 10.0.0.2"),
    ({}, None, ["10.0.0.2", "10.0.0.3"], "lost 10.0.0.2, 10.0.0.3"),  # stopped, unconfirmed
    ({"PODAGENT_ON_NODE_LOSS": "wait"}, "FAILED", ["10.0.0.2"], "lost 10.0.0.2"),
    ({"PODAGENT_ON_NODE_LOSS": "fail"}, "FAILED", ["10.0.0.2"], None),
    ({}, "FAILED", [], None),  # failed by itself
    ({}, "STOPPED", [], None),  # someone else stopped it
    ({"PODAGENT_RETRY_FAILED_JOB": "1"}, "FAILED", [],
     "the job failed (PODAGENT_RETRY_FAILED_JOB=1)"),
    ({"PODAGENT_RETRY_FAILED_JOB": "1"}, "STOPPED", [], None),
])
def test_restart_reason(env, status, lost, why):
    assert restart_reason(config.build({}, env), Cause.of_job(status, lost)) == why

"""What a hang adds to the wire and the policy: a worker's beat carries its quiet seconds, its
stacks come back as `dumped`, the Ray path asks for them through the key-value store
(runstate), and a hang is a cause of its own: weaker than a lost pod, stronger than a failure,
restarted within PODAGENT_RESTARTS and then final with its own error."""

from __future__ import annotations

import json

import pytest

from podagent import config
from podagent.cluster import runstate
from podagent.errors import RestartsExhausted, RunHung
from podagent.gang.messages import MAX_QUIET, Beat, Dumped, Malformed, from_worker
from podagent.run import exits
from podagent.run.policy import Cause, admit, restart_reason, stronger
from podagent.wire import Ending

# --- a worker's beat and its stacks -------------------------------------------------------------

def test_a_beat_carries_the_workers_quiet_seconds():
    assert from_worker({"beat": 1, "quiet": 3.5}) == Beat(3.5)
    assert from_worker({"beat": 1, "quiet": 0}) == Beat(0.0)
    assert from_worker({"beat": 1, "quiet": MAX_QUIET}) == Beat(MAX_QUIET)


def test_a_beat_without_quiet_seconds_is_from_a_pod_that_does_not_watch():
    # No training running there, or an older podagent: it says nothing about progress.
    assert from_worker({"beat": 1}) == Beat(None)
    assert from_worker({"beat": 1, "quiet": None}) == Beat(None)


@pytest.mark.parametrize("quiet", [-0.5, True, False, "3", [3], MAX_QUIET * 2,
                                   float("nan"), float("inf")])
def test_a_beat_with_quiet_seconds_out_of_range_or_of_another_type_is_malformed(quiet):
    with pytest.raises(Malformed, match="quiet"):
        from_worker({"beat": 1, "quiet": quiet})


def test_a_workers_stacks_come_back_as_dumped():
    body = {"pod": "podB", "folder": "/runs/r/hangs/1", "seconds": 0.4, "stacks": []}
    assert from_worker({"dumped": body}) == Dumped(body)


@pytest.mark.parametrize("body", [3, "stacks", [], None])
def test_dumped_that_is_no_object_is_malformed(body):
    with pytest.raises(Malformed, match="dumped"):
        from_worker({"dumped": body})


# --- the Ray path's dump request ----------------------------------------------------------------

def test_a_dump_request_round_trips_with_and_without_its_verdict():
    assert runstate.parse_dump_request(runstate.dump_request(3)) == 3
    with_line = runstate.dump_request(4, "likely culprit: rank 2 on pod podB")
    assert runstate.parse_dump_request(with_line) == 4
    assert json.loads(with_line)["line"] == "likely culprit: rank 2 on pod podB"


@pytest.mark.parametrize("raw", [
    None, b"", b"not json", b"\xff\xfe\x00", b"[1]", b'"n"', b"1e400", b"{}",
    b'{"n": "3"}', b'{"n": 1.5}', b'{"n": null}',
])
def test_a_dump_request_that_is_not_the_expected_json_is_none(raw):
    assert runstate.parse_dump_request(raw) is None


@pytest.mark.parametrize("n", [0, -1, True, False])
def test_a_dump_request_for_no_positive_hang_number_is_none(n):
    assert runstate.parse_dump_request(json.dumps({"n": n}).encode()) is None


def test_each_worker_answers_under_its_own_key():
    assert runstate.dumped_key(3, "10.0.0.2") == "dumped/3/10.0.0.2"
    assert runstate.dumped_key(3, "10.0.0.2") != runstate.dumped_key(4, "10.0.0.2")


# --- a hang in the policy -----------------------------------------------------------------------

def test_a_ray_job_podagent_stopped_for_a_hang_ended_hung():
    assert Cause.of_job("STOPPED", [], hung="no progress for 600 s") == Cause(
        Ending.HUNG, detail="no progress for 600 s")


def test_a_lost_node_explains_a_hang_and_a_success_is_a_success():
    assert Cause.of_job("STOPPED", ["10.0.0.2"], hung="x").kind is Ending.LOST
    assert Cause.of_job("SUCCEEDED", [], hung="x").kind is Ending.SUCCEEDED


def test_a_hang_is_weaker_than_a_lost_pod_and_stronger_than_a_failure():
    lost, hung = Cause(Ending.LOST, "podB", "silent"), Cause(Ending.HUNG, detail="d")
    failed = Cause(Ending.FAILED, "podB", step="training", rc=1)
    for first, then, winner in [(lost, hung, lost), (hung, lost, lost),
                                (hung, failed, hung), (failed, hung, hung)]:
        assert stronger(stronger(None, first), then) is winner


def test_a_hang_is_restarted_naming_the_timeout_even_where_a_lost_node_is_not():
    for env in ({"PODAGENT_HANG_TIMEOUT": "600"},
                {"PODAGENT_HANG_TIMEOUT": "600", "PODAGENT_ON_NODE_LOSS": "fail"}):
        assert restart_reason(config.build({}, env), Cause(Ending.HUNG, detail="d")) == (
            "the run made no progress for 600 s (PODAGENT_HANG_TIMEOUT)")


def test_a_hang_once_restarts_are_used_up_ends_the_run_as_hung_with_its_own_code():
    settings = config.build({}, {"PODAGENT_RESTARTS": "2"})
    assert admit(settings, 1, "a hang", Ending.HUNG) == 2  # one left: restarted
    with pytest.raises(RunHung, match="PODAGENT_RESTARTS=2") as hung:
        admit(settings, 2, "a hang", Ending.HUNG)
    assert not isinstance(hung.value, RestartsExhausted)
    assert exits.exit_code(hung.value) == 25


@pytest.mark.parametrize("kind", [Ending.LOST, Ending.FAILED])
def test_other_causes_once_restarts_are_used_up_are_restarts_exhausted(kind):
    settings = config.build({}, {"PODAGENT_RESTARTS": "0"})
    with pytest.raises(RestartsExhausted) as exhausted:
        admit(settings, 0, "lost podB", kind)
    assert exits.exit_code(exhausted.value) == 16


def test_a_final_hang_is_a_run_hung_error_on_every_pod():
    for me in ("podA", "podB"):
        error = Cause(Ending.HUNG, detail="d").error(me, "torchrun")
        assert isinstance(error, RunHung) and str(error) == "d"

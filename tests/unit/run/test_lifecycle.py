"""The shared state loop: an orderly end asked for from outside is a success; the head's waits
look for a stop request; what a stop request says."""

from __future__ import annotations

import enum
import json
import signal

import pytest

from podagent import config
from podagent.cluster.runstate import parse_stop_request as _parse_stop_request
from podagent.cluster.stop_watch import WatchedSignals as _Waits
from podagent.errors import Interrupted, RayStartError
from podagent.platform.roles import Role, RoleDecision
from podagent.report import Reporter
from podagent.run.lifecycle import EndRequested, Lifecycle
from podagent.waiting import Signals


class S(str, enum.Enum):
    A = "a"
    B = "b"
    END = "end"


class Scripted(Lifecycle[S]):
    """Runs A then B; B does what the test says."""
    FIRST, LAST, SUCCESS = S.A, S.END, "succeeded"

    def __init__(self, in_b):
        super().__init__(config.build({}, {}), RoleDecision(Role.HEAD, "test"),
                         Reporter("head", "pod", None), Signals())
        self.in_b, self.outcomes = in_b, []

    def handlers(self):
        return {S.A: lambda: S.B, S.B: self.in_b}

    def _teardown(self, outcome):
        self.outcomes.append(outcome)


def test_a_requested_end_runs_teardown_and_counts_as_success():
    def b():
        raise EndRequested("StopRequested", "stop requested by pod-x")

    life = Scripted(b)
    life.run()  # no exception: the CLI exits 0
    assert life.outcomes == ["StopRequested"]


def test_an_error_still_propagates_after_teardown():
    def b():
        raise RayStartError("no")

    life = Scripted(b)
    with pytest.raises(RayStartError):
        life.run()
    assert life.outcomes == ["RayStartError"]


def test_success_path():
    life = Scripted(lambda: S.END)
    life.run()
    assert life.outcomes == ["succeeded"] and life.adopted_ray is False


# --- the head's waits ----------------------------------------------------------------------------

def test_waits_look_for_a_stop_request_on_every_check_and_sleep():
    looked = []
    waits = _Waits(Signals(), lambda: looked.append(1))
    waits.check()
    waits.sleep(0.0)
    assert len(looked) == 2


def test_waits_raise_what_the_look_raises_before_sleeping():
    def look():
        raise EndRequested("StopRequested", "stop")

    with pytest.raises(EndRequested):
        _Waits(Signals(), look).sleep(60)  # would hang if the look came after the sleep


def test_waits_keep_the_signal_behaviour():
    inner = Signals()
    waits = _Waits(inner, lambda: None)
    inner._handle(signal.SIGTERM, None)
    assert waits.received == signal.SIGTERM and waits.event.is_set()
    with pytest.raises(Interrupted):
        waits.sleep(60)
    with pytest.raises(Interrupted):
        waits.check()


# --- what a stop request says ---------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "by", "at"), [
    (json.dumps({"by": "pod-b", "at": 1795314642.5}).encode(), "pod-b", 1795314642.5),
    (json.dumps({"by": "pod-b"}).encode(), "pod-b", None),
    (json.dumps({"by": "", "at": "soon"}).encode(), "an unnamed pod", None),
    (json.dumps({"at": -5}).encode(), "an unnamed pod", None),
    (b"not json", "an unnamed pod", None),
    (b"[1, 2]", "an unnamed pod", None),
    (json.dumps({"by": "x" * 500}).encode(), "x" * 100, None),
    (json.dumps({"by": "p", "at": 1e300}).encode(), "p", None),  # would not format as a time
    (json.dumps({"by": "p", "at": True}).encode(), "p", None),
    (b"\xff\xfe", "an unnamed pod", None),
])
def test_stop_request_parsing(raw, by, at):
    assert _parse_stop_request(raw) == (by, at)

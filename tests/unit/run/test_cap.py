"""The run's deadline (run/cap.py): PODAGENT_DEADLINE read as a point in time, said once when
it passes, final for the run (never restarted, its own code), and the strongest of the causes
that end a run."""

from __future__ import annotations

import io
import json

import pytest

from podagent import errors
from podagent.config import build
from podagent.config.parsers import duration, moment
from podagent.errors import ConfigError
from podagent.report import Reporter
from podagent.run import cap, exits, policy
from podagent.run.ledger import Ledger
from podagent.wire import Ending


@pytest.mark.parametrize(("raw", "seconds"), [("90s", 90), ("30m", 1800), ("12h", 43200),
                                               ("2d", 172800), ("1.5h", 5400), ("45", 45)])
def test_durations_read_as_up_takes_them(raw, seconds):
    assert duration(raw) == seconds


@pytest.mark.parametrize("raw", ["0s", "-1m", "31d", "1w", "h", "", "nan", "1e9"])
def test_a_bad_duration_names_its_rule(raw):
    with pytest.raises(ValueError, match="must be a duration such as 90s"):
        duration(raw)


def test_a_moment_is_unix_seconds_or_iso_with_its_zone():
    assert moment("2026-11-30T12:00:00Z") == 1796040000.0
    assert moment("2026-11-30T13:00:00+01:00") == 1796040000.0
    assert moment("1796040000") == 1796040000.0
    # No zone: whose noon? Nine digits: a digit lost (2001 and later have ten).
    for bad in ("2026-11-30T12:00:00", "tomorrow", "12", "", "179604000"):
        with pytest.raises(ValueError, match="with its zone"):
            moment(bad)


def test_a_bad_deadline_is_bad_input_naming_the_variable():
    with pytest.raises(ConfigError, match="PODAGENT_DEADLINE='noon' must be a time"):
        build({}, {"PODAGENT_DEADLINE": "noon"})


def test_the_watch_says_the_deadline_once_and_then_gives_its_end(tmp_path):
    now = [1796039940.0]
    settings = build({}, {"PODAGENT_DEADLINE": "2026-11-30T12:00:00Z",
                          "PODAGENT_STOP_TIMEOUT": "45", "PODAGENT_LOG_DIR": str(tmp_path)})
    out = io.StringIO()
    events = tmp_path / "events.jsonl"
    watch = cap.DeadlineWatch(settings, Reporter("head", "pod", tmp_path, stream=out),
                              clock=lambda: now[0])
    assert watch.reached() is None  # a minute early
    now[0] = 1796040000.0
    first, second = watch.reached(), watch.reached()
    assert isinstance(first, errors.DeadlineReached) and isinstance(second,
                                                                    errors.DeadlineReached)
    assert "up to 45 s to checkpoint" in str(first)
    assert out.getvalue().count("DEADLINE: the run reached 2026-11-30 12:00:00 UTC") == 1
    said = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["at"], e["grace_s"]) for e in said if e["event"] == "deadline"] == [
        (1796040000.0, 45.0)]


def test_no_deadline_never_ends_a_run():
    settings = build({}, {})
    assert settings.deadline is None and cap.passed(settings) is None
    cap.check_at_start(settings)


def test_a_start_after_the_deadline_ends_with_its_code_and_is_not_restarted():
    settings = build({}, {"PODAGENT_DEADLINE": "1000000000"})  # 2001
    with pytest.raises(errors.DeadlineReached) as raised:
        cap.check_at_start(settings)
    code = exits.exit_code(raised.value)
    assert code == 27 and not exits.restartable(code)
    assert exits.finished_code("DeadlineReached") == 27


def test_a_worker_leaves_by_itself_only_after_the_heads_end_had_its_time(monkeypatch):
    at = 1_796_040_000.0
    settings = build({}, {"PODAGENT_DEADLINE": f"{at:.0f}", "PODAGENT_STOP_TIMEOUT": "30"})
    monkeypatch.setattr(cap.time, "time", lambda: at + 30 + cap.WORKER_LATE - 1)
    cap.check_late(settings)  # the head is ending it: its job's ranks here checkpoint
    monkeypatch.setattr(cap.time, "time", lambda: at + 30 + cap.WORKER_LATE)
    with pytest.raises(errors.DeadlineReached, match="its head did not end it"):
        cap.check_late(settings)


def test_the_deadline_finishes_the_run_in_its_ledger(tmp_path):
    ledger = Ledger.load(tmp_path, "r")
    ledger.started("pod")
    ledger.ended("DeadlineReached", "STOPPED")
    assert Ledger.load(tmp_path, "r").finished["outcome"] == "DeadlineReached"


def test_the_deadline_is_the_strongest_cause_and_restarts_nothing():
    settings = build({}, {"PODAGENT_RESTARTS": "3"})
    deadline = policy.Cause(Ending.DEADLINE, "head", "the run reached its deadline")
    for other in Ending:
        assert policy.stronger(policy.Cause(other), deadline) is deadline or other is \
            Ending.DEADLINE
    assert policy.restart_reason(settings, deadline) is None
    assert isinstance(deadline.error("head", "torchrun"), errors.DeadlineReached)
    assert not policy.hurried_stop(settings, deadline, signalled=False)  # time to checkpoint

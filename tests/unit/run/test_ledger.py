"""The run's ledger (what a restarted head reads) and the after-run policy."""

from __future__ import annotations

import dataclasses
import io
import json
import signal
import threading
import time

import pytest

from podagent import config
from podagent.errors import LedgerError
from podagent.report import Reporter
from podagent.run import after_run
from podagent.run.ledger import INTERNAL_ERROR, LEDGER, Ledger
from podagent.waiting import Signals
from tests.fakes.runpod_api import FakeRunPodApi


def test_a_new_run_has_nothing_to_resume_and_numbers_its_first_job_1(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    assert ledger.finished is None and ledger.interrupted() is None
    assert ledger.next_submission_id() == "r1-1" == ledger.current_submission_id()
    assert not (tmp_path / LEDGER).exists()  # nothing written until something happened


def test_an_interrupted_run_is_resumed_under_a_new_id_and_finishes_for_good(tmp_path):
    first = Ledger.load(tmp_path, "r1")
    first.started("head-pod")
    first.submitted("r1-1", None)
    first.ended("Interrupted", None)  # SIGTERM: not the end of the run
    first.job_ended("r1-1", "STOPPED")

    again = Ledger.load(tmp_path, "r1")  # the restarted head
    assert again.finished is None
    assert again.interrupted()["id"] == "r1-1"
    assert again.next_submission_id() == "r1-2"
    again.started("head-pod")
    again.submitted("r1-2", resumed_from="r1-1")
    again.job_ended("r1-2", "SUCCEEDED")
    again.ended("succeeded", "SUCCEEDED")
    again.exit_code(0)

    third = Ledger.load(tmp_path, "r1")
    assert third.finished["outcome"] == "succeeded" and third.finished["exit_code"] == 0
    assert [(s["id"], s["status"], s["resumed_from"]) for s in third.submissions] == [
        ("r1-1", "STOPPED", None), ("r1-2", "SUCCEEDED", "r1-1")]
    assert [s["outcome"] for s in third.data["starts"]] == ["Interrupted", "succeeded"]


def test_a_head_killed_mid_job_leaves_an_open_submission(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("head-pod")
    ledger.submitted("r1", None)  # then SIGKILL: no end recorded
    again = Ledger.load(tmp_path, "r1")
    assert again.open_submission()["id"] == "r1" and again.interrupted()["id"] == "r1"


def test_a_failed_job_ends_the_run_but_workers_that_never_came_do_not(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("p")
    ledger.ended("WorkersTimeout", None)
    assert Ledger.load(tmp_path, "r1").finished is None
    ledger.submitted("r1", None)
    ledger.job_ended("r1", "FAILED")
    ledger.ended("JobFailed", "FAILED")
    ledger.exit_code(3)
    ledger.exit_code(0)  # the first code stays
    assert Ledger.load(tmp_path, "r1").finished["exit_code"] == 3


def test_restarts_are_counted_across_container_restarts(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("p")
    ledger.submitted("r1-1", None)
    ledger.job_ended("r1-1", "STOPPED")
    ledger.restarting({"n": 1, "reason": "lost 10.0.0.3", "lost": ["10.0.0.3"]})
    ledger.submitted("r1-2", "r1-1")
    ledger.resubmitted("r1-2", time_lost_s=12.5, replaced=[["10.0.0.3", "10.0.0.9"]])
    again = Ledger.load(tmp_path, "r1")
    assert again.next_submission_id() == "r1-3"
    (restart,) = again.restarts
    assert (restart["n"], restart["submission"], restart["time_lost_s"]) == (1, "r1-2", 12.5)
    assert restart["replaced"] == [["10.0.0.3", "10.0.0.9"]]


def test_exhausted_restarts_end_the_run_for_good(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("p")
    ledger.ended("RestartsExhausted", "STOPPED")
    assert Ledger.load(tmp_path, "r1").finished["outcome"] == "RestartsExhausted"


def test_an_unreadable_ledger_is_kept_aside_not_lost(tmp_path):
    (tmp_path / LEDGER).write_text("{not json")
    ledger = Ledger.load(tmp_path, "r1")
    assert ledger.submissions == []
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(f"{LEDGER}.unreadable-")]
    assert len(kept) == 1 and kept[0].read_text() == "{not json"


def test_three_starts_in_a_row_ending_in_an_internal_error_end_the_run(tmp_path):
    """A bug that meets every start would restart the container forever: the third start in a
    row that ends in one finishes the run; an ordinary end in between resets the count."""
    for outcome in (INTERNAL_ERROR, "Interrupted", INTERNAL_ERROR, INTERNAL_ERROR):
        ledger = Ledger.load(tmp_path, "r1")
        ledger.started("head-pod")
        ledger.ended(outcome, None)
    assert Ledger.load(tmp_path, "r1").finished is None  # two in a row so far
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("head-pod")
    ledger.ended(INTERNAL_ERROR, None)
    finished = Ledger.load(tmp_path, "r1").finished
    assert finished is not None and finished["outcome"] == INTERNAL_ERROR
    assert "3 starts in a row" in finished["reason"]


def test_a_volume_that_refuses_the_ledger_is_one_clear_error_and_memory_keeps_it(tmp_path):
    run_dir = tmp_path / "run"
    ledger = Ledger.load(run_dir, "r1")
    ledger.started("head-pod")
    run_dir.chmod(0o500)  # read-only (root ignores modes, so also take the file's place)
    (run_dir / LEDGER).unlink()
    (run_dir / LEDGER).mkdir()  # a rename onto a directory fails whoever we are
    try:
        with pytest.raises(LedgerError, match="cannot write the run's ledger"):
            ledger.submitted("r1-1", None)
    finally:
        run_dir.chmod(0o700)
    assert ledger.submissions[-1]["id"] == "r1-1"  # kept for the next write
    assert [p.name for p in run_dir.iterdir()] == [LEDGER]  # no temporary file left behind


def test_each_write_is_whole(tmp_path):
    ledger = Ledger.load(tmp_path, "r1")
    ledger.started("p")
    assert json.loads((tmp_path / LEDGER).read_text())["run"] == "r1"
    assert [p.name for p in tmp_path.iterdir()] == [LEDGER]  # no temporary file left


# --- after the run -------------------------------------------------------------------------------

def _reporter() -> tuple[Reporter, io.StringIO, list[dict]]:
    out, events = io.StringIO(), []
    reporter = Reporter("head", "pod", None, stream=out)
    reporter.add_listener(events.append)
    return reporter, out, events


def _settings(**env: str) -> config.Settings:
    return config.build({}, {"RUNPOD_POD_ID": "pod-1", **env})


def _sigterm_soon(signals: Signals, after: float = 0.3) -> threading.Timer:
    timer = threading.Timer(after, signals._handle, (signal.SIGTERM, None))
    timer.start()
    return timer


def _pod(settings: config.Settings) -> after_run.Pod:
    return after_run.Pod(settings.pod_id, settings.runpod_api_key, settings.runpod_api_url)


def test_exit_returns_at_once():
    reporter, out, _ = _reporter()
    after_run.settle("exit", _pod(_settings()), reporter, Signals(), "run r1 is over", "over")
    assert out.getvalue() == ""


def test_stay_stays_until_sigterm_and_says_why():
    reporter, out, events = _reporter()
    signals = Signals()
    _sigterm_soon(signals)
    after_run.settle("stay", _pod(_settings()), reporter, signals, "run r1 is over (exit 0)",
                     "the run is over")
    assert "staying up (PODAGENT_AFTER_RUN=stay) so that RunPod does not start the run " \
           "again: run r1 is over (exit 0)" in out.getvalue()
    assert "stopped by SIGTERM: leaving" in out.getvalue()
    assert [e["event"] for e in events] == ["staying"]


def test_stop_pod_asks_runpod_once_with_the_key_in_a_header_only():
    key = "rpa_" + "K" * 40
    with FakeRunPodApi("127.0.0.1", 0, expected_key=key) as api:
        reporter, out, events = _reporter()
        signals = Signals()
        _sigterm_soon(signals)
        settings = _settings(PODAGENT_AFTER_RUN="stop-pod", RUNPOD_API_KEY=key,
                             RUNPOD_API_URL=api.url)
        after_run.settle("stop-pod", _pod(settings), reporter, signals, "run r1 is over",
                         "the run is over")
    assert [(c.method, c.pod_id, c.action, c.authorized) for c in api.calls] == [
        ("POST", "pod-1", "stop", True)]
    assert "asked RunPod's API to stop pod pod-1" in out.getvalue()
    assert key not in out.getvalue() and key not in json.dumps(events)


@pytest.mark.parametrize("refuse", ["wrong key", "refused key"])
def test_stop_pod_refused_stays_instead_of_exiting(refuse):
    right = "right-key-" + "x" * 30
    with FakeRunPodApi("127.0.0.1", 0, expected_key=right,
                       refuse_key=refuse == "refused key") as api:
        reporter, out, _ = _reporter()
        signals = Signals()
        _sigterm_soon(signals)
        key = right if refuse == "refused key" else "wrong-" + "y" * 30
        settings = _settings(PODAGENT_AFTER_RUN="stop-pod", RUNPOD_API_KEY=key,
                             RUNPOD_API_URL=api.url)
        after_run.settle("stop-pod", _pod(settings), reporter, signals, "run r1 is over",
                         "the run is over")
    assert "RunPod refused to stop pod pod-1 with the key it gave the pod" in out.getvalue()
    assert "staying up idle, not exiting" in out.getvalue() and key not in out.getvalue()
    assert "stop the pod yourself" in out.getvalue()


def _sigterm_once(signals: Signals, done) -> threading.Thread:
    """RunPod's SIGTERM, once the pod is stopped (`done()`), as RunPod sends it."""
    def wait_then_term() -> None:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
        signals._handle(signal.SIGTERM, None)

    thread = threading.Thread(target=wait_then_term, daemon=True)
    thread.start()
    return thread


def test_a_stop_runpod_did_not_answer_is_asked_again_until_it_is_taken(monkeypatch):
    """An API blip as the run ends must not leave the pod idle and billing: the staying pod
    asks again, at growing intervals, and RunPod's SIGTERM then ends the stay."""
    monkeypatch.setattr(after_run, "ASK_AGAIN_AFTER", 0.2)
    key = "rpa_" + "K" * 40
    with FakeRunPodApi("127.0.0.1", 0, expected_key=key, fail_first=6, fail_status=503) as api:
        reporter, out, events = _reporter()
        signals = Signals()
        _sigterm_once(signals, lambda: api.stopped == ["pod-1"])
        settings = _settings(RUNPOD_API_KEY=key, RUNPOD_API_URL=api.url)
        pod = dataclasses.replace(_pod(settings), api_timeout=0.8)
        after_run.settle("stop-pod", pod, reporter, signals, "run r1 is over",
                         "the run is over")
    said = out.getvalue()
    assert api.stopped == ["pod-1"] and len(api.calls) == 7, api.calls
    assert "staying up idle, not exiting" in said and "asking RunPod again in 0.2 s" in said
    assert "asking RunPod again in 0.4 s" in said  # the pause grows
    assert "stopping: RunPod stops pod pod-1 (the run is over)" in said
    assert said.index("stopping: RunPod stops") < said.index("stopped by SIGTERM: leaving")
    assert [e["ok"] for e in events if e["event"] == "stop_pod"][-1] is True
    assert key not in said and key not in json.dumps(events)


def test_a_refused_stop_is_not_asked_again(monkeypatch):
    monkeypatch.setattr(after_run, "ASK_AGAIN_AFTER", 0.05)
    key = "right-key-" + "x" * 30
    with FakeRunPodApi("127.0.0.1", 0, expected_key=key, refuse_key=True) as api:
        reporter, out, _ = _reporter()
        signals = Signals()
        _sigterm_soon(signals, after=0.5)
        settings = _settings(RUNPOD_API_KEY=key, RUNPOD_API_URL=api.url)
        after_run.settle("stop-pod", _pod(settings), reporter, signals, "run r1 is over",
                         "the run is over")
    assert len(api.calls) == 1 and "asking RunPod again" not in out.getvalue()


# --- which ends are left to RunPod's restart ---------------------------------------------------

@pytest.mark.parametrize(("end", "in_a_row", "kept", "final"), [
    (after_run.End(0, over=True, restartable=False), 0, True, "the run is over"),
    (after_run.End(2, over=False, restartable=False), 0, True, "not mended"),
    (after_run.End(6, over=False, restartable=True), 1, True, None),
    (after_run.End(6, over=False, restartable=True), 3, True, "a crash loop: 3 starts"),
    (after_run.End(8, over=False, restartable=True), 1, False, "no volume keeps"),
])
def test_which_ends_are_final(end, in_a_row, kept, final):
    why = after_run.final(end, in_a_row, kept)
    assert (why is None) if final is None else (final in why), why


def test_the_start_book_counts_quick_restartable_ends_in_a_row(tmp_path):
    book = after_run.StartBook(tmp_path, "pod-1")
    quick = after_run.End(6, over=False, restartable=True)
    assert [book.ended(3.0, quick)[0] for _ in range(3)] == [1, 2, 3]
    assert after_run.StartBook(tmp_path, "pod-2").ended(3.0, quick) == (1, 1)  # its own
    assert book.ended(3600.0, quick) == (0, 4)  # a long start is no crash loop, but counts
    assert book.ended(3.0, quick) == (1, 5)
    assert book.ended(3.0, after_run.End(0, over=False, restartable=False)) == (0, 0)
    (tmp_path / after_run.STARTS_FILE).write_text("[not json")
    assert book.ended(3.0, quick) == (1, 1)  # unreadable: counted anew, not a crash


def test_a_worker_that_waits_out_its_head_again_and_again_stops_at_last(tmp_path):
    """Each start waits PODAGENT_HEAD_TIMEOUT (600 s) for a head whose run ended while the
    worker was down: never a quick end, yet the fifth in a row is final (no endless billing)."""
    waited = after_run.End(6, over=False, restartable=True)
    whys = [after_run.ended(waited, time.monotonic() - 610, tmp_path, "w", kept=True)
            for _ in range(after_run.SLOW_LOOP)]
    assert whys[:-1] == [None] * (after_run.SLOW_LOOP - 1)
    assert whys[-1] is not None and "a restart loop: 5 starts in a row" in whys[-1]


def test_only_a_volume_or_a_given_log_dir_is_kept(tmp_path):
    assert after_run.persistent(tmp_path, given=True)
    assert not after_run.persistent("podagent-logs", given=False)
    # /workspace here is no mount point (an image's own directory would be container disk)
    assert not after_run.persistent("/workspace/podagent/logs", given=False)


def test_a_pods_ledger_carries_on_from_the_layout_before_per_pod_directories(tmp_path):
    """A pod upgraded mid-run finds its run's ledger where the earlier layout kept it,
    directly in the run's directory: a run it finished stays finished (never run again),
    and the first write goes to the pod's own directory, the earlier file left as it was."""
    from podagent.run.ledger import Ledger

    run_root = tmp_path / "logs" / "r1"
    run_root.mkdir(parents=True)
    earlier = {"run": "r1", "starts": [{"at": 1.0, "pod": "abc", "pid": 7}],
               "submissions": [], "restarts": [{"n": 1, "reason": "lost"}],
               "finished": {"outcome": "succeeded", "job_status": None, "at": 2.0,
                            "exit_code": 0}}
    (run_root / "ledger.json").write_text(json.dumps(earlier))
    ledger = Ledger.load(run_root / "abc", "r1")
    assert ledger.finished == earlier["finished"] and len(ledger.restarts) == 1
    ledger.exit_code(0)
    assert json.loads((run_root / "abc" / "ledger.json").read_text())["finished"]["outcome"] \
        == "succeeded"
    assert json.loads((run_root / "ledger.json").read_text()) == earlier
    # a pod that already has its own ledger never reads the earlier one
    (run_root / "ledger.json").write_text("not json")
    assert Ledger.load(run_root / "abc", "r1").finished is not None
    assert Ledger.load(run_root / "other", "r1").finished is None  # unreadable: kept as it is
    assert (run_root / "ledger.json").read_text() == "not json"

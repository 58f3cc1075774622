"""The one retry helper: what it returns, how long it pauses, and what it says when it gives up."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from podagent.errors import HeadUnreachable, Interrupted
from podagent.waiting import Backoff, Deadline, Expired, NotYet, Signals, retry


class Probe:
    """Answers NotYet `misses` times (saying which try it was), then `answer`."""

    def __init__(self, misses: int, answer: object = "up", retry_after: float | None = None):
        self.misses, self.answer, self.retry_after, self.tries = misses, answer, retry_after, 0

    def __call__(self) -> object:
        self.tries += 1
        if self.tries <= self.misses:
            raise NotYet(f"try {self.tries}: connection refused", retry_after=self.retry_after)
        return self.answer


def test_it_returns_the_first_answer_after_pauses_that_double_up_to_the_most():
    pauses: list[float] = []
    probe = Probe(misses=5)
    assert retry(probe, awaited="the GCS", backoff=Backoff(0.5, 2.0), attempts=10,
                 sleep=pauses.append) == "up"
    assert probe.tries == 6
    assert pauses == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_giving_up_names_what_was_awaited_and_the_last_thing_seen():
    with pytest.raises(Expired) as caught:
        retry(Probe(misses=99), awaited="the head's GCS at 10.0.0.1:6379",
              backoff=Backoff.every(0.0), attempts=3, sleep=lambda _s: None)
    assert caught.value.tries == 3
    assert caught.value.awaited == "the head's GCS at 10.0.0.1:6379"
    assert str(caught.value).startswith("gave up after ")
    assert str(caught.value).endswith("waiting for the head's GCS at 10.0.0.1:6379; "
                                      "last seen: try 3: connection refused")


def test_the_caller_turns_the_expiry_into_its_own_error():
    with pytest.raises(HeadUnreachable, match="last seen: try 2: connection refused"):
        retry(Probe(misses=99), awaited="the head", backoff=Backoff.every(0.0), attempts=2,
              sleep=lambda _s: None, expired=lambda gave_up: HeadUnreachable(str(gave_up)))


def test_a_deadline_ends_the_wait_in_time_and_no_pause_runs_past_it():
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        time.sleep(seconds)

    started = time.monotonic()
    with pytest.raises(Expired):
        retry(Probe(misses=10**6), awaited="nothing", backoff=Backoff.every(0.2),
              deadline=Deadline.after(0.5), sleep=sleep)
    assert time.monotonic() - started >= 0.5
    # Paused no longer than the deadline allowed: the last pause is cut to what it left.
    assert sum(pauses) <= 0.5 and all(p <= 0.2 for p in pauses) and pauses[-1] < 0.2


def test_a_servers_retry_after_replaces_the_backoffs_pause():
    pauses: list[float] = []
    retry(Probe(misses=2, retry_after=7.0), awaited="RunPod's API", backoff=Backoff(0.5, 8),
          attempts=5, sleep=pauses.append)
    assert pauses == [7.0, 7.0]


def test_an_answer_until_rejects_is_tried_again_and_the_last_one_is_kept():
    answers = iter([3, 2, 1, 1, 1])
    with pytest.raises(Expired) as caught:
        retry(lambda: next(answers), awaited="the pods to be gone", backoff=Backoff.every(0),
              attempts=3, sleep=lambda _s: None, until=lambda left: left == 0,
              seen=lambda left: f"{left} left")
    assert caught.value.last == 1 and caught.value.seen == "1 left"
    assert retry(iter([2, 0]).__next__, awaited="zero", backoff=Backoff.every(0), attempts=3,
                 sleep=lambda _s: None, until=lambda left: left == 0) == 0


def test_another_error_of_the_probe_ends_the_wait_at_once():
    calls = []

    def refused() -> None:
        calls.append(1)
        raise PermissionError("401 Unauthorized")

    with pytest.raises(PermissionError):
        retry(refused, awaited="the API", backoff=Backoff.every(0), attempts=5,
              sleep=lambda _s: None)
    assert len(calls) == 1


def test_the_caller_hears_of_each_miss_before_its_pause_and_not_after_the_last_try():
    heard: list[tuple[str, float]] = []
    with pytest.raises(Expired):
        retry(Probe(misses=99), awaited="x", backoff=Backoff(1, 4), attempts=3,
              sleep=lambda _s: None, before_pause=lambda seen, pause: heard.append((seen, pause)))
    assert heard == [("try 1: connection refused", 1), ("try 2: connection refused", 2)]


def test_a_signal_ends_a_pause_at_once():
    signals = Signals()
    threading.Timer(0.1, lambda: signals._handle(signal.SIGTERM, None)).start()
    started = time.monotonic()
    with pytest.raises(Interrupted):
        retry(Probe(misses=10**6), awaited="the head", backoff=Backoff.every(30),
              deadline=60, sleep=signals.sleep)
    assert time.monotonic() - started < 5


def test_a_wait_without_a_bound_is_refused():
    with pytest.raises(ValueError, match="waiting for the head: a wait needs a deadline"):
        retry(Probe(misses=0), awaited="the head", backoff=Backoff.every(1))


def test_a_backoff_stays_at_its_most_however_many_tries():
    """A probe refused at once (a GCS that asks for a token) is tried thousands of times within
    a three-minute deadline: the pause never overflows (it did past the 1,024th try)."""
    backoff = Backoff(0.02, 0.1)
    assert [backoff.pause(n) for n in (1, 2, 3, 4)] == [0.02, 0.04, 0.08, 0.1]
    assert backoff.pause(1100) == backoff.pause(10**6) == 0.1

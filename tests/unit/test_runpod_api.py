"""runpod_api against FakeRunPodApi over real HTTP: a pod's own stop (v2's action) with its
success, a 409 (stopping already), retries, refusals, an API that cannot be reached or does
not answer; the key never in a message or a chain. And the parts that need no server: the
RateLimit headers and the pace they set, the log stream's cursor, answers that are nonsense."""

from __future__ import annotations

import socket
import time
import traceback

import pytest

from podagent.errors import RunPodApiError, RunPodAuthError, RunPodNonsense
from podagent.platform import runpod_api
from tests.fakes.runpod_api import FakeRunPodApi

KEY = "rpa_" + "K3y" * 12


def _no_key_anywhere(exc: BaseException) -> None:
    assert exc.__cause__ is None and exc.__context__ is None
    assert exc.__suppress_context__
    shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert KEY not in shown and KEY not in repr(exc)
    assert "\n" not in str(exc)


def test_stop_pod_posts_v2s_action_with_the_bearer_key():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        assert api.url.startswith("http://127.0.0.1:")
        assert runpod_api.stop_pod("abc123", KEY, api.url) is True
        [call] = api.calls
    assert (call.method, call.path, call.pod_id, call.action, call.authorized, call.status) == (
        "POST", "/v2/pods/abc123/action", "abc123", "stop", True, 200)
    assert api.stopped == ["abc123"]


def test_a_stop_answered_409_is_a_pod_stopping_already():
    """stop is invalid only in EXITED, ERROR and TERMINATED: a pod running this code that
    gets 409 is being stopped (or is) already."""
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY, statuses={"abc123": "EXITED"}) as api:
        assert runpod_api.stop_pod("abc123", KEY, api.url) is False
        assert [c.status for c in api.calls] == [409]


def test_a_trailing_slash_on_the_base_url_is_fine():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        runpod_api.stop_pod("abc123", KEY, api.url + "/")
        assert [c.path for c in api.calls] == ["/v2/pods/abc123/action"]


@pytest.mark.parametrize("status", [500, 429])
def test_5xx_and_429_are_tried_again(status):
    heard: list[str] = []
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY, fail_first=2,
                       fail_status=status) as api:
        runpod_api.stop_pod("abc123", KEY, api.url, timeout=20, say=heard.append)
        calls = api.calls
    assert [c.status for c in calls] == [status, status, 200]
    assert api.stopped == ["abc123"]
    assert len(heard) == 2
    assert all(f"answered {status}" in line and "trying again" in line for line in heard)
    assert not any(KEY in line for line in heard)


def test_401_fails_at_once_without_the_key():
    with FakeRunPodApi("127.0.0.1", 0, expected_key="the-right-key-" + "x" * 20) as api:
        started = time.monotonic()
        with pytest.raises(RunPodApiError) as info:
            runpod_api.stop_pod("abc123", KEY, api.url, timeout=20)
        assert time.monotonic() - started < 5
        calls = api.calls
    assert len(calls) == 1 and not calls[0].authorized
    message = str(info.value)
    assert "/v2/pods/abc123/action" in message
    assert "401" in message and "invalid api key" in message
    _no_key_anywhere(info.value)


def test_a_key_refused_its_action_is_an_auth_error_at_once():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY, refuse_key=True) as api:
        with pytest.raises(RunPodAuthError, match="answered 403 access denied"):
            runpod_api.stop_pod("abc123", KEY, api.url)
        assert len(api.calls) == 1


def test_an_unknown_path_fails_at_once():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        with pytest.raises(RunPodApiError, match="answered 404 not found"):
            runpod_api.stop_pod("abc123", KEY, api.url + "/v1")
        assert len(api.calls) == 1


def test_5xx_until_the_timeout_gives_up_with_the_last_answer():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY, fail_first=1000) as api:
        started = time.monotonic()
        with pytest.raises(RunPodApiError) as info:
            runpod_api.stop_pod("abc123", KEY, api.url, timeout=1.5)
        elapsed = time.monotonic() - started
        attempts = len(api.calls)
    assert 1.4 <= elapsed < 4, elapsed
    assert attempts >= 2
    message = str(info.value)
    assert "answered 500 injected fault" in message
    assert f"gave up after {attempts} attempts" in message
    _no_key_anywhere(info.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_api_fails_within_the_timeout():
    url = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(RunPodApiError) as info:
        runpod_api.stop_pod("abc123", KEY, url, timeout=1.5)
    elapsed = time.monotonic() - started
    assert 1.4 <= elapsed < 4, elapsed
    message = str(info.value)
    assert message.startswith(f"RunPod API: POST {url}/v2/pods/abc123/action: cannot connect")
    assert "refused" in message.lower() and "gave up after" in message
    _no_key_anywhere(info.value)


def test_an_api_that_never_answers_fails_within_the_timeout():
    # A listening socket nobody accepts on: the connection opens, no answer ever comes.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(RunPodApiError) as info:
            runpod_api.stop_pod("abc123", KEY, url, timeout=1.5)
        elapsed = time.monotonic() - started
    assert elapsed < 4, elapsed
    assert "no answer in time" in str(info.value)
    _no_key_anywhere(info.value)


@pytest.mark.parametrize(("pod_id", "key", "words"), [
    ("abc123", "", "no API key"), ("abc123", "  ", "no API key"), ("", KEY, "no pod id"),
])
def test_missing_inputs_fail_before_any_request(pod_id, key, words):
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        with pytest.raises(RunPodApiError, match=words):
            runpod_api.stop_pod(pod_id, key, api.url)
        assert api.calls == []


def test_the_fake_binds_where_it_is_told():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        port = int(api.url.rsplit(":", 1)[1].split("/")[0])
        assert port != 0
    with pytest.raises(RuntimeError):
        _ = FakeRunPodApi("127.0.0.1", 0, expected_key=KEY).url


# --- RateLimit: the pace ------------------------------------------------------------------------

def test_rate_headers_as_the_document_gives_them():
    parsed = runpod_api.parse_rate_header(
        '"minute";r=0;t=12, "hour";r=2800;t=1812, "day";r=49500;t=45012')
    assert parsed == {"minute": {"r": 0, "t": 12}, "hour": {"r": 2800, "t": 1812},
                      "day": {"r": 49500, "t": 45012}}
    assert runpod_api.parse_rate_header('"minute";q=60;w=60') == {"minute": {"q": 60, "w": 60}}
    assert runpod_api.parse_rate_header("nonsense, ;;, =") == {}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_spreads_the_calls_left_once_half_the_quota_is_used():
    clock = Clock()
    pace = runpod_api.Pace(clock)
    policy = '"minute";q=60;w=60'
    assert pace.reserve() == 0
    pace.heard({"RateLimit": '"minute";r=50;t=40', "RateLimit-Policy": policy})
    assert pace.pause() == 0  # plenty left
    assert pace.reserve() == 0
    pace.heard({"RateLimit": '"minute";r=20;t=40', "RateLimit-Policy": policy})
    assert pace.pause() == pytest.approx(40 / 20, rel=0.01)  # 20 left for 40 s: one every 2 s
    clock.now += 1.0
    assert pace.pause() == pytest.approx(1.0, rel=0.01)  # 1 s since the last one
    pace.heard({"RateLimit": '"minute";r=0;t=7', "RateLimit-Policy": policy})
    assert pace.pause() == pytest.approx(7)  # none left: until the window resets
    clock.now += 7.5
    assert pace.pause() == 0
    assert pace.calls == 2 and pace.quota() == 60


def test_calls_from_several_threads_take_their_turns():
    """Creates that go out together (the workers): each takes its slot in one step, so two
    never both spend the last call left."""
    clock = Clock()
    pace = runpod_api.Pace(clock)
    pace.reserve()
    pace.heard({"RateLimit": '"minute";r=2;t=6', "RateLimit-Policy": '"minute";q=6;w=6'})
    waits = [pace.reserve() for _ in range(3)]  # three threads, before any answer
    assert waits[0] == pytest.approx(3.0)  # 2 left for 6 s
    assert waits[1] == pytest.approx(6.0)  # the last one left, after the first
    assert waits[2] == pytest.approx(6.0)  # none left: when the window has reset
    assert pace.calls == 4


def test_an_answer_counts_the_calls_still_out_as_spent():
    """An answer's count was taken when RunPod answered; calls sent since may not be in it."""
    clock = Clock()
    pace = runpod_api.Pace(clock)
    for _ in range(3):
        pace.reserve()
    pace.heard({"RateLimit": '"minute";r=2;t=60', "RateLimit-Policy": '"minute";q=6;w=60'})
    assert pace.pause() == pytest.approx(60.0)  # 2 left, 2 still out: none to spend
    pace.unanswered()  # one failed without an answer
    pace.heard({"RateLimit": '"minute";r=1;t=60', "RateLimit-Policy": '"minute";q=6;w=60'})
    assert pace.pause() == pytest.approx(0.0 + 60 / 1)  # 1 left, spread over the minute
    assert pace.reserve() == pytest.approx(60.0)


# --- the log stream's cursor ----------------------------------------------------------------------

def _stream(cursor, events, resume_after):
    """What a server gives a resume from `cursor` (events: (ts, line) in order): from the
    first event after (resume_after) or at (not) the cursor's time."""
    cursor.reconnected()
    since = runpod_api.rfc3339_ns(cursor.resume_from()) if cursor.resume_from() else None
    got = []
    for ts, line in events:
        at = runpod_api.rfc3339_ns(ts)
        sent = since is None or at > since or (not resume_after and at == since)
        if sent and cursor.admit(ts, line):
            got.append(line)
    return got


@pytest.mark.parametrize("resume_after", [True, False])
def test_the_cursor_loses_and_repeats_nothing_whatever_a_resume_does(resume_after):
    t = "2026-11-27T10:00:0{}Z"
    events = [(t.format(0), "a"), (t.format(1), "b1"), (t.format(1), "b2"), (t.format(1), "b3"),
              (t.format(2), "c"), (t.format(2), "c")]  # a line may even come twice in a second
    cursor = runpod_api.LogCursor()
    seen = []
    for cut in (2, 3, 5, 6):  # the stream drops after `cut` events, each time
        seen += _stream(cursor, events[:cut], resume_after)
    assert seen == ["a", "b1", "b2", "b3", "c", "c"]
    assert cursor.resume_from() == "2026-11-27T10:00:01.999999Z"


def test_a_line_without_a_time_is_shown_not_lost():
    cursor = runpod_api.LogCursor()
    assert cursor.admit(None, "x") and cursor.admit("yesterday", "y")
    assert cursor.resume_from() is None


# --- answers that are nonsense ----------------------------------------------------------------

@pytest.mark.parametrize("data", [None, [], {"pods": None}, {"pods": [{"name": "x"}]},
                                  {"pods": [{"id": 5, "name": "x", "status": "RUNNING"}]},
                                  {"pods": [{"id": "a", "name": "x", "status": 7}]}])
def test_a_2xx_with_nonsense_is_an_error_of_its_own(data):
    class Canned(runpod_api.Client):
        def call(self, method, path, **kw):
            return runpod_api.Answer(200, data)

    client = Canned(KEY, "http://127.0.0.1:9")
    with pytest.raises(RunPodNonsense, match="GET /v2/pods"):
        client.list_pods()


def test_a_pod_of_a_status_the_document_does_not_list_yet_is_listed_as_it_is():
    """One odd pod in an account (a status RunPod added) must not make the whole list
    nonsense: up's clean-up, down and ls would all stop at it."""
    class Canned(runpod_api.Client):
        def call(self, method, path, **kw):
            return runpod_api.Answer(200, {"pods": [
                {"id": "a", "name": "someone-else", "status": "PAUSED"},
                {"id": "b", "name": "podagent-r-head", "status": "RUNNING", "cost": 2.5}]})

    listed = Canned(KEY, "http://127.0.0.1:9").list_pods()
    assert [(p["id"], p["status"]) for p in listed] == [("a", "PAUSED"), ("b", "RUNNING")]

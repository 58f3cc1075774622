"""runpod_api.stop_pod against FakeRunPodApi over real HTTP: success, retries, refusals,
an API that cannot be reached or does not answer; the key never in a message or a chain."""

from __future__ import annotations

import socket
import time
import traceback

import pytest

from podagent.errors import RunPodApiError
from podagent.platform import runpod_api
from tests.fakes.runpod_api import FakeRunPodApi

KEY = "rpa_" + "K3y" * 12


def _no_key_anywhere(exc: BaseException) -> None:
    assert exc.__cause__ is None and exc.__context__ is None
    assert exc.__suppress_context__
    shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert KEY not in shown and KEY not in repr(exc)
    assert "\n" not in str(exc)


def test_stop_pod_posts_with_the_bearer_key():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        assert api.url.startswith("http://127.0.0.1:") and api.url.endswith("/v1")
        runpod_api.stop_pod("abc123", KEY, api.url)
        [call] = api.calls
    assert (call.method, call.path, call.pod_id, call.authorized, call.status) == (
        "POST", "/v1/pods/abc123/stop", "abc123", True, 200)
    assert api.stopped == ["abc123"]


def test_a_trailing_slash_on_the_base_url_is_fine():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        runpod_api.stop_pod("abc123", KEY, api.url + "/")
        assert [c.path for c in api.calls] == ["/v1/pods/abc123/stop"]


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
    assert "/pods/abc123/stop" in message
    assert "401" in message and "unauthorized" in message
    _no_key_anywhere(info.value)


def test_an_unknown_path_fails_at_once():
    with FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        with pytest.raises(RunPodApiError, match="answered 404 not found"):
            runpod_api.stop_pod("abc123", KEY, api.url.removesuffix("/v1") + "/v2")
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
    assert "answered 500 internal error (fake)" in message
    assert f"gave up after {attempts} attempts" in message
    _no_key_anywhere(info.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_api_fails_within_the_timeout():
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    started = time.monotonic()
    with pytest.raises(RunPodApiError) as info:
        runpod_api.stop_pod("abc123", KEY, url, timeout=1.5)
    elapsed = time.monotonic() - started
    assert 1.4 <= elapsed < 4, elapsed
    message = str(info.value)
    assert message.startswith(f"RunPod API: POST {url}/pods/abc123/stop: cannot connect")
    assert "refused" in message.lower() and "gave up after" in message
    _no_key_anywhere(info.value)


def test_an_api_that_never_answers_fails_within_the_timeout():
    # A listening socket nobody accepts on: the connection opens, no answer ever comes.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
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

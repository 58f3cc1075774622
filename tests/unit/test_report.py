"""Reporter: secrets redacted everywhere it writes; timed steps; events.jsonl."""

from __future__ import annotations

import io
import json
import re

import pytest

from podagent.config.policy import is_secret
from podagent.report import REDACTED, Progress, Reporter

SECRET = "wandb-0123456789abcdef"
OTHER = "hf_TOKENVALUE42"


@pytest.fixture
def stream() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def reporter(tmp_path, stream):
    r = Reporter("head", "pod1", tmp_path / "run", secrets=[SECRET, OTHER, ""], stream=stream)
    yield r
    r.close()


def log_text(tmp_path) -> str:
    return (tmp_path / "run" / "podagent-head-pod1.log").read_text()


def events(tmp_path) -> list[dict]:
    text = (tmp_path / "run" / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_say_redacts_stdout_and_the_pod_log(reporter, stream, tmp_path):
    reporter.say(f"logging in with {SECRET} and {OTHER}")
    out = stream.getvalue()
    assert out == f"[head] logging in with {REDACTED} and {REDACTED}\n"
    log = log_text(tmp_path)
    assert f"[head] logging in with {REDACTED} and {REDACTED}" in log
    assert SECRET not in log and OTHER not in log
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", log)


def test_warn_and_raw_are_redacted(reporter, stream, tmp_path):
    reporter.warn(f"key {SECRET} looks old")
    reporter.raw(f"job output: {OTHER}")
    out = stream.getvalue().splitlines()
    assert out == [f"[head] WARNING: key {REDACTED} looks old", f"job output: {REDACTED}"]
    assert SECRET not in log_text(tmp_path) and OTHER not in log_text(tmp_path)


def test_error_goes_to_stderr_redacted(reporter, stream, capsys, tmp_path):
    reporter.error(f"login failed for {SECRET}")
    captured = capsys.readouterr()
    assert captured.err == f"[head] ERROR: login failed for {REDACTED}\n"
    assert stream.getvalue() == ""
    assert SECRET not in log_text(tmp_path)
    assert "ERROR: login failed" in log_text(tmp_path)


def test_default_stream_is_stdout(capsys):
    r = Reporter("worker", "w1", run_dir=None, secrets=[SECRET])
    r.say(f"token {SECRET}")
    assert capsys.readouterr().out == f"[worker] token {REDACTED}\n"


def test_events_are_redacted(reporter, tmp_path):
    reporter.event("login", token=SECRET, nested={"inner": [OTHER]}, note=f"x{SECRET}y")
    raw = (tmp_path / "run" / "events.jsonl").read_text()
    assert SECRET not in raw and OTHER not in raw
    (record,) = events(tmp_path)
    assert record["event"] == "login"
    assert (record["pod"], record["role"]) == ("pod1", "head")
    assert isinstance(record["ts"], float)
    assert record["token"] == REDACTED
    assert record["nested"] == {"inner": [REDACTED]}
    assert record["note"] == f"x{REDACTED}y"


@pytest.mark.parametrize("secret", ['pa"ss-word', "pa\\ss-word", "pässwörd"])
def test_events_redact_secrets_that_json_escapes(tmp_path, secret):
    r = Reporter("head", "pod1", tmp_path / "run", secrets=[secret], stream=io.StringIO())
    try:
        r.event("login", password=secret)
    finally:
        r.close()
    (record,) = events(tmp_path)
    assert record["password"] == REDACTED


def test_longest_secret_is_replaced_whole(tmp_path, stream):
    r = Reporter("head", "pod1", None, secrets=["abcd", "abcdefgh"], stream=stream)
    r.say("abcdefgh abcd")
    assert stream.getvalue() == f"[head] {REDACTED} {REDACTED}\n"


def test_step_prints_the_message_with_its_duration_and_records_ok(reporter, stream, tmp_path):
    with reporter.step("ray_started") as step:
        step.done(f"Ray started with {SECRET}", port=6379)
    line = stream.getvalue().rstrip("\n")
    assert re.fullmatch(rf"\[head\] Ray started with {REDACTED} \(\d+\.\d s\)", line), line
    (record,) = events(tmp_path)
    assert record["event"] == "ray_started"
    assert record["result"] == "ok"
    assert record["port"] == 6379
    assert isinstance(record["duration_s"], float) and record["duration_s"] >= 0


def test_failed_step_records_failed_and_reraises(reporter, stream, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), reporter.step("ray_started") as step:
        step.done("never printed")
        raise RuntimeError(f"boom {SECRET}")
    assert stream.getvalue() == ""
    (record,) = events(tmp_path)
    assert record["result"] == "failed"
    assert record["error"] == f"boom {REDACTED}"


def test_failed_step_without_message_names_the_exception_type(reporter, tmp_path):
    with pytest.raises(KeyboardInterrupt), reporter.step("wait"):
        raise KeyboardInterrupt
    (record,) = events(tmp_path)
    assert (record["result"], record["error"]) == ("failed", "KeyboardInterrupt")


def test_step_without_done_prints_nothing_but_records(reporter, stream, tmp_path):
    with reporter.step("quiet"):
        pass
    assert stream.getvalue() == ""
    assert [(e["event"], e["result"]) for e in events(tmp_path)] == [("quiet", "ok")]


def test_without_run_dir_nothing_is_written(tmp_path, stream, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = Reporter("head", "pod1", None, stream=stream)
    r.event("ignored", x=1)
    r.say("hello")
    r.close()
    r.close()
    assert stream.getvalue() == "[head] hello\n"
    assert list(tmp_path.iterdir()) == []


def test_progress_is_rate_limited(stream):
    r = Reporter("worker", "w1", None, stream=stream)
    progress = Progress(r, every=0.0)
    progress("still waiting")
    assert stream.getvalue() == "[worker] still waiting\n"
    quiet = Progress(r, every=3600.0)
    quiet("not yet")
    assert "not yet" not in stream.getvalue()


@pytest.mark.parametrize(("name", "secret"), [
    ("WANDB_API_KEY", True), ("HF_TOKEN", True), ("FOO_SECRET", True), ("X_PASSWORD", True),
    ("RAY_AUTH_TOKEN", True), ("RUNPOD_API_KEY", True), ("PODAGENT_TOKEN", True),
    ("aws_secret", True),
    ("PATH", False), ("NCCL_SOCKET_IFNAME", False), ("TOKENIZERS_PARALLELISM", False),
    ("KEYBOARD_LAYOUT", False), ("WANDB_PROJECT", False), ("HEAD_POD_ID", False),
])
def test_is_secret(name, secret):
    assert is_secret(name) is secret

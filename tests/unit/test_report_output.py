"""What a person or a log collector sees: text or JSON lines, --quiet, and live progress on a
real terminal (a pty) versus plain periodic lines elsewhere."""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from podagent.report import Progress, Reporter


def test_json_format_is_one_object_per_line_and_the_log_file_stays_text(tmp_path):
    out = io.StringIO()
    reporter = Reporter("head", "pod1", tmp_path, secrets=["s3cr3t-value"], stream=out,
                        log_format="json")
    reporter.say("Ray head up with s3cr3t-value")
    reporter.warn("a warning")
    reporter.raw("job says hi")
    reporter.close()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["level"], r["message"]) for r in records] == [
        ("info", "Ray head up with <redacted>"), ("warning", "a warning"),
        ("job", "job says hi")]
    assert all(r["role"] == "head" and r["pod"] == "pod1" and r["ts"] for r in records)
    log = (tmp_path / "podagent-head-pod1.log").read_text()
    assert "[head] WARNING: a warning" in log and "s3cr3t-value" not in log


def test_quiet_keeps_warnings_errors_and_the_job_output_but_logs_everything(tmp_path, capsys):
    out = io.StringIO()
    reporter = Reporter("worker", "w1", tmp_path, stream=out, quiet=True)
    reporter.say("joined the cluster")
    reporter.warn("head slow")
    reporter.raw("training step 1")
    reporter.error("it broke")
    reporter.close()
    assert out.getvalue().splitlines() == ["[worker] WARNING: head slow", "training step 1"]
    assert capsys.readouterr().err == "[worker] ERROR: it broke\n"
    log = (tmp_path / "podagent-worker-w1.log").read_text()
    assert "joined the cluster" in log and "it broke" in log


def _pty_stream():
    controller, terminal = os.openpty()
    return open(terminal, "w", buffering=1), controller


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_progress_on_a_terminal_is_one_live_line_cleared_before_the_next_line(tmp_path):
    stream, controller = _pty_stream()
    reporter = Reporter("head", "pod1", tmp_path, stream=stream)
    assert reporter.live
    progress = Progress(reporter, every=3600)
    progress("still waiting: 0/2 workers joined (1 s)")
    time.sleep(0.6)  # the live line is rewritten at most twice a second
    progress("still waiting: 1/2 workers joined (2 s)")
    reporter.say("cluster ready")
    reporter.close()
    screen = _read_all(controller).replace("\r\n", "\n")
    os.close(controller)
    assert screen.count("\r\x1b[2K[head] still waiting") == 2, repr(screen)
    assert screen.endswith("\r\x1b[2K[head] cluster ready\n"), repr(screen)
    # Nothing of the live line reaches the log file but the periodic record.
    assert "still waiting" not in (tmp_path / "podagent-head-pod1.log").read_text()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_progress_elsewhere_is_plain_periodic_lines(fmt):
    out = io.StringIO()
    reporter = Reporter("head", "pod1", None, stream=out, log_format=fmt)
    assert not reporter.live
    progress = Progress(reporter, every=0.2)
    for _ in range(3):
        progress("still waiting")  # within the first period: nothing yet
    time.sleep(0.25)
    progress("still waiting")
    progress("still waiting")  # the next period has not come: nothing
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "still waiting" in lines[0] and "\x1b" not in lines[0]


def test_a_json_terminal_gets_no_live_line():
    stream, controller = _pty_stream()
    assert not Reporter("head", "p", None, stream=stream, log_format="json").live
    assert not Reporter("head", "p", None, stream=stream, quiet=True).live
    stream.close()
    os.close(controller)

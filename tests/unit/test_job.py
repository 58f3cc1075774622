"""What a job may call (podagent/job.py): its heartbeat and its stack dumps do nothing outside a
podagent run, and the names it shares with podagent stay the same without importing it."""

from __future__ import annotations

import ast
import inspect
import os

from podagent import job
from podagent.run import progress, stacks

OLD = 1_000_000.0


def test_heartbeat_touches_the_file_podagent_named(tmp_path, monkeypatch, capsys):
    beat = tmp_path / "heartbeat"
    beat.write_text("")
    os.utime(beat, (OLD, OLD))
    monkeypatch.setenv(job.HEARTBEAT_VARIABLE, str(beat))
    job.heartbeat()
    assert beat.stat().st_mtime > OLD
    assert capsys.readouterr().out == ""  # the file did it: no line in the job's output


def test_heartbeat_creates_the_file_on_its_first_touch(tmp_path, monkeypatch):
    beat = tmp_path / "heartbeat"
    monkeypatch.setenv(job.HEARTBEAT_VARIABLE, str(beat))
    job.heartbeat()
    assert beat.is_file()


def test_heartbeat_outside_a_podagent_run_does_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(job.HEARTBEAT_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    job.heartbeat()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")


def test_heartbeat_prints_the_marker_where_the_file_cannot_be_written(tmp_path, monkeypatch,
                                                                     capsys):
    # A path under a regular file cannot be created, whoever runs the test.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(job.HEARTBEAT_VARIABLE, str(tmp_path / "a-file" / "heartbeat"))
    job.heartbeat()
    assert capsys.readouterr().out == f"{progress.HEARTBEAT_MARKER}\n"


def test_the_names_a_job_shares_with_podagent_are_the_same_on_both_sides():
    assert job.HEARTBEAT_VARIABLE == progress.HEARTBEAT_VARIABLE
    assert job.HEARTBEAT_MARKER == progress.HEARTBEAT_MARKER
    assert job.STACKS_VARIABLE == stacks.STACKS_VARIABLE


def test_the_job_module_imports_nothing_of_podagent():
    # It runs inside the job: importing podagent's other modules would cost the job their
    # imports (Ray, psutil) and tie it to them.
    tree = ast.parse(inspect.getsource(job))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0]
    relative = [node for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert imported and not relative
    assert [name for name in imported if name.split(".")[0] == "podagent"] == []


def test_enable_stack_dumps_outside_a_podagent_run_does_nothing(monkeypatch):
    monkeypatch.delenv(job.STACKS_VARIABLE, raising=False)
    assert job.enable_stack_dumps() is False
    assert job._dump_file is None  # no file opened, no handler registered


def test_enable_stack_dumps_where_its_folder_cannot_be_made_says_so(tmp_path, monkeypatch,
                                                                   capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(job.STACKS_VARIABLE, str(tmp_path / "a-file" / "stacks"))
    assert job.enable_stack_dumps() is False
    assert job._dump_file is None
    assert capsys.readouterr().err.startswith("podagent.job: no stack dumps (")

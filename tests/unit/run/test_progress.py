"""The progress watch (run/progress.py) on a fake clock: what counts as progress (output, a
checkpoint, an explicit heartbeat), what stops counting once the job sends heartbeats, the
bounded look at the checkpoint directory, and the time a file's progress counts from. File
times are set by hand, never waited for: the wall clock the watch reads moves with the fake
clock (EPOCH at 0)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from podagent.run import progress
from podagent.run.progress import HEARTBEAT_MARKER, LOOK_EVERY, ProgressWatch, newest_change

OLD = 1_000_000.0  # an mtime long before anything the test writes
NEW = OLD + 500.0  # a newer one, for the look at a directory
EPOCH = 1_800_000_000.0  # the wall clock when the fake one reads 0


class _Wall:
    """The `time` module as the watch sees it, its wall clock EPOCH + the fake clock."""

    def __init__(self, now: list[float]):
        self._now = now

    def time(self) -> float:
        return EPOCH + self._now[0]

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture(autouse=True)
def now(monkeypatch) -> list[float]:
    """The fake clock's reading, which the test moves by hand; the wall clock follows it."""
    reading = [0.0]
    monkeypatch.setattr(progress, "time", _Wall(reading))
    return reading


def _clock(now: list[float], start: float = 0.0) -> Callable[[], float]:
    """The fake clock, set to `start`."""
    now[0] = start
    return lambda: now[0]


def _at(moment: float) -> float:
    """The file time of something written when the fake clock read `moment`."""
    return EPOCH + moment


def _age(*paths: Path, at: float = OLD) -> None:
    for path in paths:
        os.utime(path, (at, at))


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


# --- the clock ----------------------------------------------------------------------------------

def test_quiet_grows_without_progress_and_a_hang_is_called_only_at_the_timeout(now):
    clock = _clock(now, 100.0)
    watch = ProgressWatch(10.0, clock=clock)
    now[0] = 105.0
    assert watch.quiet() == 5.0
    now[0] = 109.99
    assert watch.hung() is None  # just below the timeout: not yet
    now[0] = 110.0
    assert watch.hung() == 10.0
    now[0] = 125.0
    assert watch.hung() == 25.0  # the quiet seconds, not the timeout


def test_a_timeout_of_zero_turns_the_watch_off(now):
    clock = _clock(now)
    watch = ProgressWatch(0, clock=clock)
    now[0] = 1e7
    assert not watch.enabled
    assert watch.hung() is None
    assert watch.quiet() == 1e7  # the clock still runs; only the verdict is off


def test_reset_starts_the_clock_again(now):
    # A restart's start-up is no hang: the time before it must not count.
    clock = _clock(now)
    watch = ProgressWatch(10.0, clock=clock)
    now[0] = 50.0
    assert watch.hung() == 50.0
    watch.reset("restart 1")
    assert watch.quiet() == 0.0 and watch.hung() is None
    assert watch.last_seen == "restart 1"
    now[0] = 57.0
    assert watch.quiet() == 7.0


# --- output -------------------------------------------------------------------------------------

def test_output_of_only_whitespace_is_no_progress(now):
    clock = _clock(now)
    watch = ProgressWatch(60.0, clock=clock)
    now[0] = 20.0
    watch.saw_output("  \n\t\n")
    assert watch.quiet() == 20.0
    watch.saw_output("loss 0.31\n")
    assert watch.quiet() == 0.0


# --- checkpoints --------------------------------------------------------------------------------

@pytest.mark.parametrize("parts", [("step_10.pt",), ("global_step_10", "model", "shard-0.pt")],
                         ids=["top-level", "two-levels-down"])
def test_a_new_checkpoint_file_is_progress(tmp_path, parts, now):
    root = tmp_path / "checkpoints"
    folders = [root.joinpath(*parts[:i]) for i in range(len(parts))]  # root and the file's
    folders[-1].mkdir(parents=True)
    _age(*folders)
    clock = _clock(now)
    watch = ProgressWatch(60.0, checkpoints=root, clock=clock)
    now[0] = 30.0
    assert watch.quiet() == 30.0
    new = root.joinpath(*parts)
    new.write_bytes(b"weights")
    _age(new, at=_at(30.0 + LOOK_EVERY))
    _age(*folders)  # only the file itself can tell: the look must reach it
    now[0] = 30.0 + LOOK_EVERY
    assert watch.quiet() == 0.0
    assert watch.last_seen == f"a checkpoint in {root}"
    now[0] = 40.0
    assert watch.quiet() == 40.0 - (30.0 + LOOK_EVERY)  # the same file again is not news


def test_newest_change_is_the_newest_mtime_within_its_depth(tmp_path):
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    _age(deep / "f", at=NEW)
    _age(tmp_path, tmp_path / "a", deep)
    assert newest_change(tmp_path, depth=2) == NEW
    assert newest_change(tmp_path, depth=1) == OLD  # f is below the depth asked for


def test_newest_change_of_a_missing_directory_is_zero(tmp_path):
    assert newest_change(tmp_path / "never-written") == 0.0


def test_newest_change_reads_no_more_than_its_limit_of_entries(tmp_path, monkeypatch):
    """A huge directory (a job that writes its dataset under the checkpoint path) must not turn
    every look into a full walk: the look stops after `limit` entries with what it has."""
    for i in range(3000):
        (tmp_path / f"f{i:04}").touch()
    _age(tmp_path, at=NEW)
    read: list[str] = []
    real = os.scandir

    class Counting:
        def __init__(self, path):
            self._entries = real(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._entries.close()

        def __iter__(self):
            for entry in self._entries:
                read.append(entry.name)
                yield entry

    monkeypatch.setattr(progress.os, "scandir", Counting)
    assert newest_change(tmp_path, limit=50) >= NEW  # the directory's own time at least
    # It pulls the entry past the limit to know it is over, and not one more.
    assert len(read) == 51


# --- explicit heartbeats ------------------------------------------------------------------------

def test_a_touched_heartbeat_is_progress_and_then_only_heartbeats_count(tmp_path, now):
    beat = tmp_path / "heartbeat"  # not there yet: the job creates it with its first touch
    clock = _clock(now)
    watch = ProgressWatch(60.0, heartbeat=beat, clock=clock)
    now[0] = 10.0
    beat.touch()
    _age(beat, at=_at(10.0))
    assert watch.quiet() == 0.0
    assert watch.explicit and watch.last_seen == f"a touch of {beat}"
    # A job that sends heartbeats may print from threads that go on while its ranks hang.
    watch.saw_output("dataloader: prefetching\n")
    now[0] = 20.0
    assert watch.quiet() == 10.0
    now[0] = 30.0
    watch.saw_output(f"step 5 {HEARTBEAT_MARKER}\n")
    assert watch.quiet() == 0.0 and watch.last_seen == "a heartbeat line"
    # The file's time unchanged is no new heartbeat; a newer one is.
    now[0] = 40.0
    assert watch.quiet() == 10.0
    _age(beat, at=_at(40.0 + LOOK_EVERY))
    now[0] = 40.0 + LOOK_EVERY
    assert watch.quiet() == 0.0


def test_a_heartbeat_line_makes_the_watch_explicit_too(now):
    clock = _clock(now)
    watch = ProgressWatch(60.0, clock=clock)
    watch.saw_output(f"{HEARTBEAT_MARKER}\n")
    assert watch.explicit
    now[0] = 15.0
    watch.saw_output("step 6\n")
    assert watch.quiet() == 15.0


# --- when a file's progress was made -------------------------------------------------------------

def _watched(tmp_path: Path, now: list[float]) -> tuple[ProgressWatch, dict[str, Path]]:
    """A watch over all three kinds of file, looked at first at 30 s: nothing new then."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    log, beat = tmp_path / "training.log", tmp_path / "heartbeat"
    log.write_text("step 1\n")
    beat.touch()
    _age(root, log, beat)
    watch = ProgressWatch(600.0, checkpoints=root, heartbeat=beat, clock=_clock(now))
    now[0] = 30.0
    assert watch.quiet() == 30.0
    return watch, {"checkpoint": root, "heartbeat": beat}


def _change(kind: str, files: dict[str, Path], at: float) -> None:
    """A new checkpoint, or a touch of the heartbeat, its file time `at`."""
    if kind == "checkpoint":
        (files[kind] / "step_10.pt").write_bytes(b"weights")
        _age(files[kind], files[kind] / "step_10.pt", at=at)
    else:
        _append(files[kind], "step 2\n")
        _age(files[kind], at=at)


SAID = {"checkpoint": "a checkpoint in {}", "heartbeat": "a touch of {}"}


@pytest.mark.parametrize("kind", ["checkpoint", "heartbeat"])
def test_progress_in_a_file_counts_from_its_modification_time_not_from_the_look(tmp_path, now,
                                                                                kind):
    """The files are looked at every LOOK_EVERY: a change found 2 s after it was made is 2 s
    old, or the hang is called up to LOOK_EVERY late."""
    watch, files = _watched(tmp_path, now)
    _change(kind, files, _at(30.5))
    now[0] = 32.5  # the next look, 2 s after the change
    assert watch.quiet() == 2.0
    assert watch.last_seen == SAID[kind].format(files[kind])
    now[0] = 40.0
    assert watch.quiet() == 40.0 - 30.5


@pytest.mark.parametrize("kind", ["checkpoint", "heartbeat"])
@pytest.mark.parametrize(("written", "quiet"), [
    (30.5 + 3600.0, 0.0),  # a volume's clock an hour ahead: progress now, never a quiet < 0
    (30.5 - 3600.0, 2.5),  # an hour behind, or a file copied in with its old time: it was not
                           # there at the last look (30 s), so it came after that
], ids=["ahead", "behind"])
def test_a_file_time_counts_only_between_the_last_look_and_now(tmp_path, now, kind, written,
                                                               quiet):
    watch, files = _watched(tmp_path, now)
    _change(kind, files, _at(written))
    now[0] = 32.5
    assert watch.quiet() == quiet
    assert watch.last_seen == SAID[kind].format(files[kind])


@pytest.mark.parametrize("kind", ["checkpoint", "heartbeat"])
def test_a_file_time_before_the_progress_already_known_is_no_news(tmp_path, now, kind):
    # A restart began at 31 s; what its predecessor wrote at 30.5 s, seen at the next look,
    # must not date the progress back before it.
    watch, files = _watched(tmp_path, now)
    now[0] = 31.0
    watch.reset("restart 1")
    _change(kind, files, _at(30.5))
    now[0] = 32.5
    assert watch.quiet() == 1.5
    assert watch.last_seen == "restart 1"


@pytest.mark.parametrize("kind", ["checkpoint", "heartbeat"])
def test_no_hang_is_called_on_progress_written_since_the_last_look(tmp_path, now, kind):
    """The files are looked at every LOOK_EVERY; the quiet reaching the timeout between two
    looks is looked at once more first: progress written since the last look counts."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    log, beat = tmp_path / "training.log", tmp_path / "heartbeat"
    log.write_text("step 1\n")
    beat.touch()
    _age(root, log, beat)
    files = {"checkpoint": root, "heartbeat": beat}
    watch = ProgressWatch(10.0, checkpoints=root, heartbeat=beat, clock=_clock(now))
    now[0] = 8.5
    assert watch.quiet() == 8.5  # a look: nothing new
    _change(kind, files, _at(9.0))
    now[0] = 10.0  # the timeout, before the next look is due (10.5 s)
    assert watch.hung() is None
    assert watch.quiet() == 1.0 and watch.last_seen == SAID[kind].format(files[kind])
    now[0] = 18.5
    assert watch.hung() is None
    now[0] = 19.5  # past ten quiet seconds since the change: the look once more finds nothing
    assert watch.hung() == 10.5


def test_past_the_timeout_the_files_are_looked_at_once_more_not_at_every_call(tmp_path, now,
                                                                              monkeypatch):
    """A head whose own training stays quiet while a worker's keeps the run going asks its
    watch at every poll: one look more when the timeout is crossed, then one every
    LOOK_EVERY, never a scan of the checkpoints per call."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    looks = []
    real = progress.newest_change
    monkeypatch.setattr(progress, "newest_change",
                        lambda *a, **k: looks.append(now[0]) or real(*a, **k))
    watch = ProgressWatch(10.0, checkpoints=root, clock=_clock(now))
    looks.clear()
    for tick in range(0, 300):  # 30 s of 0.1 s polls
        now[0] = tick / 10
        watch.quiet()
    assert len(looks) <= 30 / progress.LOOK_EVERY + 2, looks

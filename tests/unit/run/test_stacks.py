"""A hung run's stacks (run/stacks.py): reading py-spy's JSON and faulthandler's text, summing a
process up (in a collective or not, and where), naming the odd rank out, the lines a hang
prints, a peer's summary off the wire whatever it holds, and real dumps of live processes
(py-spy where it can read them; faulthandler, through podagent.job, where it cannot)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

import podagent
from podagent.run import stacks
from podagent.run.stacks import WHERE_LIMIT, Frame, PodDump, Stack, Target

SITE = "/usr/lib/python3.11/site-packages"
C10D = f"{SITE}/torch/distributed/distributed_c10d.py"
JOB = "/workspace/train.py"
REPO = Path(podagent.__file__).resolve().parent.parent

# py-spy's `dump --json`: one object per thread, innermost frame first.
PY_SPY_JSON = [
    {"pid": 4242, "thread_id": 1397, "thread_name": "MainThread", "os_thread_id": 4242,
     "active": True, "owns_gil": False,
     "frames": [
         {"name": "wait", "filename": C10D, "module": None, "short_filename":
          "distributed_c10d.py", "line": 3, "locals": None, "is_entry": False},
         {"name": "all_reduce", "filename": C10D, "module": None, "short_filename":
          "distributed_c10d.py", "line": 2500, "locals": None, "is_entry": False},
         {"name": "train_step", "filename": JOB, "module": None, "short_filename": "train.py",
          "line": 42, "locals": None, "is_entry": False},
         {"name": "<module>", "filename": JOB, "module": None, "short_filename": "train.py",
          "line": 90, "locals": None, "is_entry": True}]},
    {"pid": 4242, "thread_id": 1398, "thread_name": "pin_memory", "os_thread_id": 4250,
     "active": False, "owns_gil": False,
     "frames": [{"name": "get", "filename": "/usr/lib/python3.11/queue.py", "module": None,
                 "short_filename": "queue.py", "line": 180, "locals": None,
                 "is_entry": False}]},
]
MAIN_FRAMES = (Frame("wait", C10D, 3), Frame("all_reduce", C10D, 2500),
               Frame("train_step", JOB, 42), Frame("<module>", JOB, 90))
WAITING_WHERE = "wait (distributed_c10d.py:3) from train_step (train.py:42)"


def _wire(rank: int, *, collective: bool = True, where: str = WAITING_WHERE, pod: str = "podA",
          error: str = "", driver: bool = False) -> Stack:
    """A summary as a peer's comes over the wire (its `where` as text)."""
    return Stack(100 + rank, f"rank {rank} (pid {100 + rank})", rank, error=error, pod=pod,
                 in_collective=collective, where_text=where, driver=driver)


# --- py-spy's JSON ------------------------------------------------------------------------------

def test_parse_py_spy_reads_every_thread_and_marks_the_main_one():
    threads = stacks.parse_py_spy(PY_SPY_JSON)
    assert threads == [
        ("MainThread", True, MAIN_FRAMES),
        ("pin_memory", False, (Frame("get", "/usr/lib/python3.11/queue.py", 180),)),
    ]


def test_parse_py_spy_skips_what_is_not_a_thread_or_a_frame():
    threads = stacks.parse_py_spy([
        "not a thread", 7, None,
        {"pid": 9, "thread_name": None, "os_thread_id": 77,
         "frames": ["junk", 3, {"name": "loop", "filename": JOB, "line": None}]},
        {"pid": 9, "thread_name": "t", "os_thread_id": 78, "frames": None},
    ])
    # A nameless thread goes by its id; a frame without a line gets line 0.
    assert threads == [("77", False, (Frame("loop", JOB, 0),)), ("t", False, ())]


@pytest.mark.parametrize("raw", [None, {"threads": []}, "text", 3])
def test_parse_py_spy_of_anything_but_a_list_is_no_thread(raw):
    assert stacks.parse_py_spy(raw) == []


def test_the_py_spy_file_reads_as_py_spy_dump_prints():
    assert stacks.render_py_spy(PY_SPY_JSON) == (
        'Thread 4242 (active): "MainThread"\n'
        f"    wait ({C10D}:3)\n"
        f"    all_reduce ({C10D}:2500)\n"
        f"    train_step ({JOB}:42)\n"
        f"    <module> ({JOB}:90)\n"
        'Thread 4250 (idle): "pin_memory"\n'
        "    get (/usr/lib/python3.11/queue.py:180)\n")


# --- faulthandler's text ------------------------------------------------------------------------

def _park_in_a_named_function(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(10)


def _dump_from_a_named_function(path: Path) -> None:
    import faulthandler
    with path.open("w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)


def test_parse_faulthandler_reads_real_faulthandler_output(tmp_path):
    started, release = threading.Event(), threading.Event()
    parked = threading.Thread(target=_park_in_a_named_function, args=(started, release))
    parked.start()
    path = tmp_path / "dump.txt"
    try:
        assert started.wait(5)
        _dump_from_a_named_function(path)
    finally:
        release.set()
        parked.join(5)
    threads = {int(name, 16): (is_main, frames)
               for name, is_main, frames in stacks.parse_faulthandler(path.read_text())}
    # The thread that wrote the dump is faulthandler's "Current thread": the main one (a
    # signal's handler runs there).
    is_main, frames = threads[threading.get_ident()]
    assert is_main
    names = [f.function for f in frames]
    # Innermost first: the function that called faulthandler, then this test below it.
    assert names[0] == "_dump_from_a_named_function"
    assert names.index("test_parse_faulthandler_reads_real_faulthandler_output") > 0
    assert frames[0].file == __file__ and frames[0].line > 0
    is_main, frames = threads[parked.ident]
    assert not is_main
    assert "_park_in_a_named_function" in [f.function for f in frames]


def test_parse_faulthandler_of_no_dump_is_no_thread():
    assert stacks.parse_faulthandler("") == []
    assert stacks.parse_faulthandler("Fatal Python error: something else\n") == []


# --- one process summed up ----------------------------------------------------------------------

def test_a_process_waiting_in_torch_distributed_is_in_a_collective_named_with_its_own_line():
    stack = stacks.summarize(Target(4242, "rank 1 (pid 4242)", 1),
                             stacks.parse_py_spy(PY_SPY_JSON), "/hang/rank-1-pid-4242.txt")
    assert stack.in_collective and not stack.error
    assert (stack.pid, stack.rank, stack.file) == (4242, 1, "/hang/rank-1-pid-4242.txt")
    assert stack.frames == MAIN_FRAMES
    # The innermost frame, and the job's own line that called into torch.
    assert stack.where == WAITING_WHERE


def test_the_thread_in_a_collective_wins_over_the_main_thread():
    threads = [("MainThread", True, (Frame("join", "/usr/lib/python3.11/threading.py", 1100),
                                     Frame("main", JOB, 7))),
               ("backward", False, (Frame("run_backward", f"{SITE}/torch/autograd/graph.py",
                                          744), Frame("step", JOB, 30)))]
    stack = stacks.summarize(Target(1, "rank 0 (pid 1)", 0), threads, "f")
    assert stack.in_collective
    assert stack.where == "run_backward (graph.py:744) from step (train.py:30)"


def test_without_a_collective_the_main_thread_is_summed_up_even_when_not_listed_first():
    threads = [("pin_memory", False, (Frame("get", "/usr/lib/python3.11/queue.py", 180),)),
               ("MainThread", True, (Frame("load_batch", JOB, 12),))]
    stack = stacks.summarize(Target(1, "rank 0 (pid 1)", 0), threads, "f")
    assert not stack.in_collective
    assert stack.where == "load_batch (train.py:12)"  # its own frame: no "from"


def test_a_dump_without_threads_is_an_error_and_says_so():
    stack = stacks.summarize(Target(1, "rank 0 (pid 1)", 0), [], "f")
    assert stack.error == "no Python thread in the dump"
    assert stack.where == stack.error and not stack.in_collective


def test_a_where_is_cut_to_its_limit():
    long = Frame("f" * 500, JOB, 1)
    assert len(Stack(1, "x", frames=(long,)).where) == WHERE_LIMIT


@pytest.mark.parametrize(("frame", "collective"), [
    (Frame("wait", C10D, 3), True),
    (Frame("allreduce_hook", f"{SITE}/torch/nn/parallel/distributed.py", 1), True),
    (Frame("run_backward", f"{SITE}/torch/autograd/graph.py", 744), True),
    (Frame("synchronize", f"{SITE}/torch/cuda/__init__.py", 800), True),
    (Frame("Event.synchronize", f"{SITE}/torch/cuda/streams.py", 200), True),
    (Frame("wait", "C:\\py\\site-packages\\torch\\distributed\\c10d.py", 3), True),
    (Frame("train_step", JOB, 42), False),
    (Frame("synchronized_save", JOB, 42), False),  # a name that only starts alike
    (Frame("get", "/usr/lib/python3.11/queue.py", 180), False),
])
def test_which_frames_mean_waiting_for_the_other_ranks(frame, collective):
    assert frame.collective is collective


# --- the odd rank out ---------------------------------------------------------------------------

def test_the_one_rank_not_in_a_collective_is_the_culprit():
    odd = _wire(2, collective=False, where="load_batch (train.py:12)", pod="podB")
    found = stacks.culprits([_wire(0), _wire(1), odd, _wire(3)])
    assert found == [odd]
    assert stacks.verdict([_wire(0), _wire(1), odd, _wire(3)]) == (
        "likely culprit: rank 2 on pod podB (load_batch (train.py:12))")


def test_when_every_rank_is_in_a_collective_the_one_at_another_place_is_the_culprit():
    # Three wait in the gradient all-reduce, one in a barrier the others never reached.
    odd = _wire(3, where="barrier (distributed_c10d.py:9) from save (train.py:80)")
    assert stacks.culprits([_wire(0), _wire(1), _wire(2), odd]) == [odd]


def test_nothing_stands_out_when_all_are_at_one_place_or_each_at_its_own():
    assert stacks.culprits([_wire(r) for r in range(4)]) == []
    assert stacks.culprits([_wire(r, where=f"place {r}") for r in range(4)]) == []
    assert stacks.verdict([_wire(r) for r in range(4)]) == (
        "no rank stands out (every one is at the same place, or none could be read)")


def test_drivers_and_unreadable_processes_are_never_culprits():
    # A Ray job's driver waits on its ranks, never in a collective; an unreadable process has
    # no place at all. Neither may be blamed for the ranks' hang.
    driver = _wire(9, collective=False, where="wait (worker.py:3)", driver=True)
    unread = _wire(8, collective=False, where="", error="py-spy: permission denied")
    assert stacks.culprits([_wire(0), _wire(1), driver, unread]) == []
    assert stacks.culprits([_wire(0), driver]) == []  # one rank left: nothing to compare


# --- the lines ----------------------------------------------------------------------------------

def test_a_pod_that_did_not_answer_is_one_line_naming_why():
    assert stacks.pod_line(PodDump("podB", error="no answer in 30 s")) == (
        "pod podB: no answer in 30 s")


def test_a_pod_without_processes_says_so():
    assert stacks.pod_line(PodDump("podB")) == "pod podB: no process of the run to dump"


def test_a_pod_line_names_each_process_and_where_it_is():
    dumped = PodDump("podB", [
        _wire(0, pod="podB"),
        _wire(1, collective=False, where="load_batch (train.py:12)", pod="podB"),
        Stack(7, "driver (pid 7)", error="py-spy: permission denied", pod="podB"),
    ])
    assert stacks.pod_line(dumped) == (
        f"pod podB: rank 0 in a collective: {WAITING_WHERE}; "
        "rank 1 NOT in a collective: load_batch (train.py:12); "
        "driver (pid 7): no stack (py-spy: permission denied)")


# --- the wire -----------------------------------------------------------------------------------

def test_a_stack_crosses_the_wire_with_its_summary():
    stack = Stack(4242, "rank 1 (pid 4242)", 1, MAIN_FRAMES, "/hang/rank-1-pid-4242.txt",
                  pod="here", in_collective=True)
    back = Stack.from_wire(stack.to_wire(), "podB")
    assert back is not None
    assert (back.pid, back.label, back.rank, back.file, back.error, back.driver) == (
        4242, "rank 1 (pid 4242)", 1, "/hang/rank-1-pid-4242.txt", "", False)
    assert back.in_collective and back.where == WAITING_WHERE
    assert back.pod == "podB"  # the pod it came from, whatever the body says


def test_a_pod_dump_crosses_the_wire():
    dumped = PodDump("podB", [_wire(0, pod="podB"), _wire(1, collective=False, where="x")],
                     "/runs/r/hangs/1", 1.23456)
    back = PodDump.from_wire(dumped.to_wire(), "podB")
    assert (back.pod, back.folder, back.seconds, back.error) == (
        "podB", "/runs/r/hangs/1", 1.235, "")
    assert [(s.rank, s.in_collective, s.where) for s in back.stacks] == [
        (0, True, WAITING_WHERE), (1, False, "x")]
    assert stacks.culprits(back.stacks) == [back.stacks[1]]


@pytest.mark.parametrize("body", [
    {}, {"pid": "12"}, {"pid": 12.0}, {"pid": True}, {"pid": None}, {"pid": [12]},
])
def test_a_peer_stack_without_a_whole_number_pid_is_dropped(body):
    assert Stack.from_wire(body, "podB") is None


@pytest.mark.parametrize("rank", [True, False, "3", 3.0, [3], {"r": 3}])
def test_a_peer_stack_rank_that_is_no_whole_number_is_no_rank(rank):
    stack = Stack.from_wire({"pid": 12, "rank": rank}, "podB")
    assert stack is not None and stack.rank is None and stack.name == ""


def test_a_peer_stack_text_is_cut_to_its_limit_whatever_its_type():
    huge = "x" * 1_000_000
    stack = Stack.from_wire({"pid": 12, "label": huge, "where": huge, "file": huge,
                             "error": {"nested": [huge]}}, "podB")
    assert stack is not None
    assert [len(t) for t in (stack.label, stack.where, stack.file, stack.error)] == [
        WHERE_LIMIT] * 4


def test_a_peer_stack_flags_are_true_only_when_they_are_true():
    stack = Stack.from_wire({"pid": 12, "collective": "yes", "driver": 1}, "podB")
    assert stack is not None and not stack.in_collective and not stack.driver


@pytest.mark.parametrize("raw", ["stacks", {"pid": 1}, 3, None])
def test_a_pod_dump_whose_stacks_are_no_list_has_none(raw):
    assert PodDump.from_wire({"stacks": raw}, "podB").stacks == []


def test_a_pod_dump_keeps_only_its_well_formed_stacks():
    back = PodDump.from_wire({"stacks": [1, "x", None, [], {"pid": "bad"}, {"pid": 5}]}, "podB")
    assert [(s.pid, s.pod) for s in back.stacks] == [(5, "podB")]


def test_a_pod_dump_holds_at_most_256_stacks():
    back = PodDump.from_wire({"stacks": [{"pid": i} for i in range(10_000)]}, "podB")
    assert len(back.stacks) == 256


def test_a_pod_dump_with_odd_fields_keeps_defaults():
    back = PodDump.from_wire({"seconds": "3", "folder": "f" * 100_000}, "podB")
    assert back.seconds == 0.0 and len(back.folder) == WHERE_LIMIT


# --- the signal ---------------------------------------------------------------------------------

def test_catches_tells_whether_a_process_handles_a_signal():
    before = signal.getsignal(signal.SIGUSR1)
    if before is None:
        pytest.skip("SIGUSR1's handler here was not set from Python: it cannot be restored")
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        assert not stacks._catches(os.getpid(), signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        assert stacks._catches(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_catches_of_a_process_that_is_not_there_is_false():
    assert not stacks._catches(2**22 + 1, signal.SIGUSR1)  # above any pid_max


def test_faulthandler_sends_no_signal_to_a_handler_that_is_not_faulthandlers(tmp_path):
    # A handler of the job's own for SIGUSR1, but no stacks file of faulthandler's: not ours to
    # trigger (the handler might do anything).
    got: list[int] = []
    before = signal.getsignal(signal.SIGUSR1)
    if before is None:
        pytest.skip("SIGUSR1's handler here was not set from Python: it cannot be restored")
    try:
        signal.signal(signal.SIGUSR1, lambda signum, _: got.append(signum))
        assert stacks._faulthandler(os.getpid(), tmp_path) is None
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert got == []


# --- live processes -----------------------------------------------------------------------------

CHILD = """
import os, sys, time
from pathlib import Path
if os.environ.get("PODAGENT_STACKS"):
    import podagent.job
    assert podagent.job.enable_stack_dumps()

def hang_in_a_named_function(ready):
    Path(ready).write_text(str(os.getpid()))
    while True:
        time.sleep(60)

hang_in_a_named_function(sys.argv[1])
"""


@pytest.fixture
def sleeper(tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts a Python process that sleeps in `hang_in_a_named_function` (with stack dumps
    enabled into `stacks_dir` when given), once it is there; kills every one at the end."""
    children: list[subprocess.Popen] = []

    def start(stacks_dir: Path | None = None) -> subprocess.Popen:
        ready = tmp_path / f"ready-{len(children)}"
        env = {k: v for k, v in os.environ.items() if k != "PODAGENT_STACKS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          env.get("PYTHONPATH")]))
        if stacks_dir is not None:
            env["PODAGENT_STACKS"] = str(stacks_dir)
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(ready)], env=env)
        children.append(child)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert child.poll() is None, f"the child exited {child.returncode}"
            assert time.monotonic() < deadline, "the child never got to its function"
            time.sleep(0.02)
        return child

    try:
        yield start
    finally:
        for child in children:
            child.kill()
            child.wait(10)


def test_dump_pod_reads_a_live_process_with_py_spy(tmp_path, sleeper):
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed")
    child = sleeper()
    dumped = stacks.dump_pod("podA", [Target(child.pid, f"rank 0 (pid {child.pid})", 0)],
                             tmp_path / "hang", None)
    [stack] = dumped.stacks
    if stack.error.startswith("py-spy"):
        pytest.skip(f"py-spy cannot read a process here: {stack.error}")
    assert (dumped.pod, dumped.folder, stack.pod, stack.rank) == (
        "podA", str(tmp_path / "hang"), "podA", 0)
    assert not stack.error and not stack.in_collective
    assert "hang_in_a_named_function" in stack.where
    written = Path(stack.file)
    assert written == tmp_path / "hang" / f"rank-0-pid-{child.pid}.txt"
    assert "hang_in_a_named_function" in written.read_text()


def test_faulthandler_reads_a_job_that_enabled_stack_dumps(tmp_path, sleeper):
    folder = tmp_path / "stacks"
    child = sleeper(folder)
    text = stacks._faulthandler(child.pid, folder)
    assert text is not None
    [(_, is_main, frames)] = stacks.parse_faulthandler(text)
    assert is_main and frames[0].function == "hang_in_a_named_function"
    assert child.poll() is None  # faulthandler's handler wrote, and the job goes on


def test_without_py_spy_dump_pod_falls_back_to_the_jobs_faulthandler(tmp_path, sleeper,
                                                                     monkeypatch):
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    folder = tmp_path / "stacks"
    child = sleeper(folder)
    dumped = stacks.dump_pod("podA", [Target(child.pid, f"rank 3 (pid {child.pid})", 3)],
                             tmp_path / "hang", folder)
    [stack] = dumped.stacks
    assert not stack.error and stack.rank == 3
    assert stack.where.startswith("hang_in_a_named_function (<string>:")
    written = Path(stack.file).read_text()
    assert written.startswith(f"# rank 3 (pid {child.pid})\n")
    assert "Current thread" in written


def test_a_process_without_a_handler_is_never_signalled(tmp_path, sleeper, monkeypatch):
    # SIGUSR1's default action ends a process: a job that did not ask for stack dumps must
    # come out of a dump alive, with a stack that says why there is none.
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    folder = tmp_path / "stacks"
    folder.mkdir()
    child = sleeper()
    dumped = stacks.dump_pod("podA", [Target(child.pid, f"rank 0 (pid {child.pid})", 0)],
                             tmp_path / "hang", folder)
    [stack] = dumped.stacks
    assert child.poll() is None
    assert stack.error.startswith("py-spy is not installed; ")
    assert "podagent.job.enable_stack_dumps()" in stack.error
    assert stack.error in Path(stack.file).read_text()
    assert stacks.culprits([stack, _wire(1), _wire(2)]) == []


# --- a launcher's ranks and what they start -----------------------------------------------------

class _Proc:
    def __init__(self, pid: int, ppid: int):
        self.pid, self._ppid = pid, ppid

    def ppid(self) -> int:
        return self._ppid


def test_what_a_rank_starts_is_no_rank_however_deep_and_only_the_same_rank_hides_it(
        monkeypatch):
    """The process tree decides, on fakes: below podagent (pid 1) a launcher (10) that has a
    RANK from the pod's environment but no LOCAL_RANK, its ranks 0 (20) and 1 (21); rank 0's
    loader worker (30) and a shell (31) without RANK whose child (32) has rank 0's again."""
    env = {10: {"RANK": "0"},
           20: {"RANK": "0", "LOCAL_RANK": "0"}, 21: {"RANK": "1", "LOCAL_RANK": "1"},
           30: {"RANK": "0", "LOCAL_RANK": "0"}, 31: {},
           32: {"RANK": "0", "LOCAL_RANK": "0"}}
    tree = [_Proc(10, 1), _Proc(20, 10), _Proc(21, 10), _Proc(30, 20), _Proc(31, 20),
            _Proc(32, 31)]
    monkeypatch.setattr(stacks.process, "descendants", lambda: tree)
    monkeypatch.setattr(stacks, "_environ", lambda pid: env.get(pid, {}))
    targets = {(t.rank, t.pid) for t in stacks.training_targets()}
    assert {(0, 20), (1, 21)} <= targets  # the launcher's RANK hides none of its ranks
    assert not {pid for _, pid in targets} & {30, 31, 32}
    # The supervisor names its launcher: never a rank, whatever the pod's environment gave it
    # (with RANK and LOCAL_RANK both, it would otherwise hide its own rank 0 and stand in).
    env[10] = {"RANK": "0", "LOCAL_RANK": "0"}
    assert [(t.rank, t.pid) for t in stacks.training_targets(launcher=10)] == [(0, 20), (1, 21)]


LOADER_HANG = REPO / "tests" / "jobs" / "loader_hang.py"


@pytest.fixture
def ranks_with_loaders(tmp_path) -> Iterator[Callable[..., dict[int, int]]]:
    """Starts tests/jobs/loader_hang.py under torchrun (2 ranks, gloo on CPU), each rank with
    two DataLoader workers alive; once both ranks are there, gives {rank: its pid}. Every
    process of it is killed at the end: the launcher and all it started (torch starts each
    rank in a session of its own, so no process group holds them all)."""
    pytest.importorskip("torch")
    launchers: list[subprocess.Popen] = []
    seen: dict[int, psutil.Process] = {}

    def note_descendants() -> None:
        for launcher in launchers:
            with contextlib.suppress(psutil.Error):
                for proc in psutil.Process(launcher.pid).children(recursive=True):
                    seen.setdefault(proc.pid, proc)

    def start(context: str, sleep_rank: int = 1) -> dict[int, int]:
        out = tmp_path / f"loader-hang-{len(launchers)}"
        out.mkdir()
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PODAGENT_STACKS")}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        with (out / "launcher.log").open("w") as log:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", str(LOADER_HANG), str(out), "--sleep-rank",
                 str(sleep_rank), "--context", context],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        launchers.append(launcher)
        deadline = time.monotonic() + 90
        files = {r: out / f"rank{r}.json" for r in (0, 1)}
        while not all(f.exists() for f in files.values()):
            note_descendants()
            assert launcher.poll() is None, (
                f"torchrun exited {launcher.returncode}: {(out / 'launcher.log').read_text()}")
            assert time.monotonic() < deadline, "the ranks never got their loaders' workers up"
            time.sleep(0.1)
        note_descendants()
        return {r: json.loads(f.read_text())["pid"] for r, f in files.items()}

    try:
        yield start
    finally:
        note_descendants()
        for launcher in launchers:
            launcher.kill()
        for proc in seen.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for launcher in launchers:
            launcher.wait(10)
        psutil.wait_procs(list(seen.values()), timeout=10)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_data_loader_workers_of_ranks_are_not_ranks(tmp_path, ranks_with_loaders, context):
    """Torch's DataLoader workers (and whatever else a rank starts) inherit its RANK; idle, they
    are not in a collective. Judged as ranks, they would make every rank's pod a culprit's:
    only the processes the launcher started are ranks, and the one that sleeps is named."""
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed")
    ranks = ranks_with_loaders(context, sleep_rank=1)
    # The case at hand: below each rank, processes that carry its RANK.
    for rank, pid in ranks.items():
        inherited = [p for p in psutil.Process(pid).children(recursive=True)
                     if stacks._rank(p.pid) == rank]
        assert len(inherited) >= 2, f"rank {rank}'s loader workers are not there"
    deadline = time.monotonic() + 30
    while True:  # rank 0 wrote its file just before it entered the all-reduce
        targets = stacks.training_targets()
        dumped = stacks.dump_pod("podA", targets, tmp_path / "hang", None)
        errors = [s.error for s in dumped.stacks if s.error.startswith("py-spy")]
        if errors:
            pytest.skip(f"py-spy cannot read a process here: {errors[0]}")
        by_pid = {s.pid: s for s in dumped.stacks}
        if ranks[0] in by_pid and by_pid[ranks[0]].in_collective:
            break
        assert time.monotonic() < deadline, "rank 0 never waited in its all-reduce"
        time.sleep(0.2)
    assert [(t.rank, t.pid) for t in targets] == [(0, ranks[0]), (1, ranks[1])]
    found = stacks.culprits(dumped.stacks)
    assert [(s.rank, s.pid) for s in found] == [(1, ranks[1])]
    assert "sleep_instead_of_all_reduce" in found[0].where


ACTOR_WITH_LOADER = r"""
import json, os, sys, time
import ray, torch

ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=0)
class Trainer:
    def start(self):
        self.loader = torch.utils.data.DataLoader(range(64), batch_size=4, num_workers=2,
                                                  persistent_workers=True)
        self.batches = iter(self.loader)
        next(self.batches)
        return os.getpid()

trainer = Trainer.remote()
print(json.dumps({"actor": ray.get(trainer.start.remote(), timeout=120)}), flush=True)
time.sleep(300)
"""


def test_a_ray_actors_data_loader_workers_are_not_job_processes(tmp_path):
    """Forked from an actor, a DataLoader's workers carry its `ray::` title and RAY_JOB_ID: the
    job's processes on the Ray path are Ray's workers (each started by the raylet), not what an
    actor starts, which would be named culprits, idle and in no collective."""
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    temp = tempfile.mkdtemp(prefix="pst-", dir="/tmp")  # short: Ray's sockets live under it
    # Ray 2.60's new local cluster turns token auth on and writes a token to ~/.ray/auth_token,
    # which every later Ray on this machine would then demand: auth off, and a home of its own.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "RAY_AUTH_MODE": "disabled", "HOME": temp}
    driver = subprocess.Popen([sys.executable, "-c", ACTOR_WITH_LOADER, temp], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    tree: list[psutil.Process] = []
    try:
        line = _first_line(driver, timeout=180)
        actor = json.loads(line)["actor"]
        tree = psutil.Process(driver.pid).children(recursive=True)
        forked = [p for p in psutil.Process(actor).children() if "RAY_JOB_ID" in
                  stacks._environ(p.pid)]
        assert len(forked) >= 2, "the actor's loader workers are not there"
        targets = stacks.ray_job_targets(tree)
        assert [t.pid for t in targets if not t.driver] == [actor], targets
    finally:
        tree = tree or psutil.Process(driver.pid).children(recursive=True)
        driver.kill()
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        driver.wait(10)
        psutil.wait_procs(tree, timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line a process prints, within `timeout` (its exit first is a failure)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert got and got[0].strip(), f"no line within {timeout:g} s (exit {proc.poll()})"
    return got[0]

"""podagent as a subreaper: adopted orphans are reaped, our own Popen children are not; a
managed process with its output teed."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from podagent import process
from podagent.launch import follow
from podagent.report import Reporter
from podagent.wire import Event
from tests.harness.pods import wait_for

# In a process of its own: being a subreaper is a process-wide setting.
SCRIPT = r"""
import json, subprocess, sys, time
import psutil
from podagent import process

assert process.become_subreaper()
own = subprocess.Popen([sys.executable, "-c", "pass"])  # its Popen collects its status
# A shell that leaves a child behind and exits: the orphan is re-parented to us.
subprocess.run(["/bin/sh", "-c", "sleep 0.3 & exit 0"], check=True)

def zombies():
    return sorted(c.pid for c in psutil.Process().children()
                  if c.status() == psutil.STATUS_ZOMBIE)

deadline = time.monotonic() + 30
while len(zombies()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
before = zombies()
process.reap_zombies(keep=[own.pid])
print(json.dumps({"own": own.pid, "before": before, "after": zombies(),
                  "own_code": own.wait(timeout=5)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers are Linux's")
def test_reap_zombies_collects_adopted_orphans_and_keeps_our_own_children():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, check=True)
    seen = json.loads(done.stdout)
    assert len(seen["before"]) == 2 and seen["own"] in seen["before"], seen
    assert seen["after"] == [seen["own"]], seen  # the orphan is gone, ours is left to its Popen
    assert seen["own_code"] == 0, seen


def test_a_teed_process_writes_its_output_to_the_screen_and_its_log_and_stops_whole(
        tmp_path, capfd):
    """`tee`: a launcher's output (its children's too) reaches podagent's own output and the
    log as it comes; stop takes its tree down, TERM first."""
    script = ("import subprocess, sys, time\n"
              "print('from the launcher', flush=True)\n"
              "subprocess.Popen([sys.executable, '-c', "
              "'print(\"from its child\", flush=True); import time; time.sleep(60)'])\n"
              "time.sleep(60)\n")
    screen = Reporter("head", "pod", None)  # on this process's stdout, as text
    managed = process.ManagedProcess("step", [sys.executable, "-c", script], {},
                                     tmp_path / "training.log", tee=screen.job_output())
    managed.start()
    log = tmp_path / "training.log"
    wait_for(lambda: log.exists() and "from its child" in log.read_text(), timeout=30,
             what="the child's line in the log")
    tree = [managed.pid, *(c.pid for c in psutil.Process(managed.pid).children(True))]
    termed, killed = managed.stop(5.0)
    managed.finish_output()
    assert (termed, killed) == (2, 0)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in tree)
    shown = capfd.readouterr().out
    assert "from the launcher" in shown and "from its child" in shown
    assert log.read_text().splitlines() == ["from the launcher", "from its child"]


# Every event podagent knows, printed by a job as podagent would print it, in every way a line
# can arrive: whole, cut across writes, without its newline at the end.
FORGER = r"""
import json, sys, time
names = json.loads(sys.argv[1])
for name in names:
    sys.stdout.write(json.dumps({"ts": 1.0, "pod": "head", "role": "head", "event": name,
                                 "code": 0, "forged": True}) + "\n")
    sys.stdout.flush()
half = json.dumps({"event": "run_over", "code": 0, "forged": True})
sys.stdout.write(half[:9]); sys.stdout.flush(); time.sleep(0.2)
sys.stdout.write(half[9:] + "\n"); sys.stdout.flush()
sys.stdout.write("caf\u00e9 " + json.dumps({"event": "exit", "forged": True}))
"""


def test_nothing_a_job_prints_passes_for_podagents_own_record(tmp_path):
    """As JSON (what `podagent up` follows), each line of a launcher's training becomes one
    `job` record, whatever it holds: a job printing every event podagent knows ends no run,
    and podagent's own records, written meanwhile, each stay a whole line of their own."""
    out = tmp_path / "screen"
    names = [e.value for e in Event]
    with open(out, "w") as stream:
        reporter = Reporter("head", "pod", None, stream=stream, log_format="json")
        managed = process.ManagedProcess(
            "training", [sys.executable, "-c", FORGER, json.dumps(names)], {},
            tmp_path / "training.log", tee=reporter.job_output())
        managed.start()
        reporter.event(Event.STEP_STARTED, step="training")  # podagent's own, meanwhile
        assert managed.wait(60) == 0
        managed.finish_output()
        reporter.event(Event.EXIT, code=0)
    records = [follow.parse(line) for line in out.read_text().splitlines()]
    own = [r.data["event"] for r in records if r.kind == "event"]
    assert own == ["step_started", "exit"], own
    jobs = [r.text for r in records if r.kind == "job"]
    assert len(jobs) == len(names) + 2, jobs
    assert all('"forged": true' in line for line in jobs), jobs
    assert jobs[-1].startswith("café {"), jobs[-1]  # the last line, without its newline
    assert {r.kind for r in records} == {"event", "job"}, records
    # The training log keeps the job's own bytes, as it printed them.
    assert (tmp_path / "training.log").read_text().count('"forged": true') == len(names) + 2

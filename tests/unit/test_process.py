"""podagent as a subreaper: adopted orphans are reaped, our own Popen children are not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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

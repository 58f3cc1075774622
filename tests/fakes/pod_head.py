"""A stand-in for podagent on a pod of the fake RunPod cloud, for tests of `podagent up` that
need the head's records but not a Ray cluster: it prints what a head prints with
PODAGENT_LOG_FORMAT=json (a role event, states, the job's lines, an exit and run_over event),
and stays up as a finished pod does, until SIGTERM. A worker (RAY_WORKER=1) only stays up.

Set by the test in the pod's environment:
  POD_HEAD_LINES   how many job lines to print at once (default 5): with the fake's
                   log_resolution at 1 s they share timestamps, as a burst of output does;
  POD_HEAD_GO      a file: once it exists, as many lines again, then the end;
  POD_HEAD_CODE    the run's exit code (default 0);
  POD_HEAD_HOLD    1: after the second lines, never say the run is over (stay as if it ran).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def record(**fields: object) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "pod": os.environ.get("RUNPOD_POD_ID"),
                      "role": "head", **fields}), flush=True)


def job_lines(first: int, count: int) -> None:
    for i in range(first, first + count):
        print(json.dumps({"ts": round(time.time(), 3), "level": "job", "role": "head",
                          "message": f"job line {i}"}), flush=True)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.environ.get("RAY_WORKER") == "1":
        while True:
            time.sleep(1)
    lines = int(os.environ.get("POD_HEAD_LINES", "5"))
    record(event="role", role_of="head", run=os.environ.get("PODAGENT_RUN_NAME"))
    record(event="state", state="running")
    job_lines(1, lines)
    go = os.environ.get("POD_HEAD_GO")
    while go and not os.path.exists(go):
        time.sleep(0.1)
    job_lines(lines + 1, lines)
    while os.environ.get("POD_HEAD_HOLD") == "1":
        time.sleep(1)
    code = int(os.environ.get("POD_HEAD_CODE", "0"))
    record(event="exit", code=code)
    record(event="run_over", code=code, over=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())

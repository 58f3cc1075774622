"""What a pod does when podagent's work on it ends (PODAGENT_AFTER_RUN).

RunPod starts a container again whenever its process exits. That is what a run cut short wants
(a lost Ray, a pod lost mid-run: the new start resumes it), and what must never happen to a run
that is over, or after an exit a new start cannot mend (bad input, a refused token, restarts
used up): the run would start again, or fail again, in a loop, each start billing a GPU. So each
end is judged (`final`):

* over: the run ended for good (its ledger says so, or the head said so);
* final: the exit codes' table (run/exits.py) says a new start cannot mend this code; or the
  pod keeps ending in codes a start could mend, CRASH_LOOP times in a row, each soon after it
  started (counted in `StartBook`, on the volume, which a restart keeps); or there is no
  volume, so a new start would remember nothing (RunPod wipes the container disk when it
  starts it again) and begin the run anew;
* otherwise podagent exits and RunPod starts it again.

Over or final, the policy says what happens: `stop-pod` (the default on RunPod) asks RunPod's
API to stop this pod with the pod-scoped key RunPod injects, which ends its GPU billing; when
RunPod refuses, the pod stays idle and says why and how to stop it (when RunPod did not
answer, it asks again while it stays). `stay` stays idle until the pod is stopped, `exit`
exits (and RunPod starts it again: asked for). Run by hand at a terminal, podagent only exits:
a person is there.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podagent.choices import AfterRun
from podagent.config.fields import FIELD_BY_ATTR
from podagent.config.names import UP_RUN_LABEL
from podagent.config.parsers import http_url
from podagent.config.policy import runpod_key
from podagent.errors import Interrupted, RunPodApiError, RunPodAuthError
from podagent.platform import runpod_api
from podagent.run.ledger import legacy
from podagent.waiting import Signals
from podagent.wire import Event

STAY_NOTE_EVERY = 600.0  # a staying pod says once in a while what it is waiting for
# A pod whose stop (or its run's termination) RunPod did not answer asks again after this
# long, doubled each time up to STAY_NOTE_EVERY: a blip of the API at a run's end must not
# leave the pod billing until somebody looks.
ASK_AGAIN_AFTER = 30.0
# Restartable ends in a row, each within CRASH_WINDOW of its start, that make a crash loop:
# the last of them is not left to RunPod's restart.
CRASH_LOOP = 3
CRASH_WINDOW = 600.0
# However long each took: a worker that waits out PODAGENT_HEAD_TIMEOUT for a head whose run
# ended while it was down would otherwise be started again, and wait, for ever.
SLOW_LOOP = 5
STARTS_FILE = "pod-starts.json"
VOLUME = "/workspace"  # where RunPod mounts a pod's volume (volumeMountPath's default)


@dataclass(frozen=True)
class End:
    """How this start of podagent ended: its exit code, whether the run is over for good, and
    whether the exit codes' table (run/exits.py) says a new start may mend the code."""
    code: int
    over: bool
    restartable: bool


def persistent(log_dir: str | Path, given: bool) -> bool:
    """Whether what podagent writes under `log_dir` survives a restart of the container: a
    directory given explicitly (PODAGENT_LOG_DIR: the user knows where it lives), or one on
    RunPod's volume (mounted at /workspace: an image may have a plain /workspace of its own,
    which is container disk)."""
    if given:
        return True
    path = Path(log_dir).absolute()
    return path.is_relative_to(VOLUME) and os.path.ismount(VOLUME)


class StartBook:
    """This pod's ends, kept beside the run's logs (`pod-starts.json`): how long each start ran
    and how it ended. Unwritable (a full volume), it counts in memory only."""

    def __init__(self, run_dir: Path, pod: str):
        self.path = Path(run_dir) / STARTS_FILE
        self.pod = pod

    def _read(self) -> list[dict[str, Any]]:
        # Before per-pod directories this file lay in the run's directory: its count goes on.
        source = self.path if self.path.exists() else legacy(self.path)
        try:
            data = json.loads(source.read_text())
        except (OSError, ValueError):
            return []
        ends = data.get(self.pod) if isinstance(data, dict) else None
        return [e for e in ends if isinstance(e, dict)] if isinstance(ends, list) else []

    def ended(self, took: float, end: End) -> tuple[int, int]:
        """Record this end; how many restartable ends in a row (this one included) came soon
        after their start, and how many however long they took."""
        ends = [*self._read(), {"at": round(time.time(), 3), "took": round(took, 1),
                                "code": end.code, "restartable": end.restartable}][-20:]
        with contextlib.suppress(OSError, ValueError):
            try:
                whole = json.loads(self.path.read_text())
                whole = whole if isinstance(whole, dict) else {}
            except (OSError, ValueError):
                whole = {}
            whole[self.pod] = ends
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{STARTS_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(whole))
            tmp.replace(self.path)
        restartable = 0
        for entry in reversed(ends):
            if not entry.get("restartable"):
                break
            restartable += 1
        quick = 0
        for entry in reversed(ends[len(ends) - restartable:]):
            if not (isinstance(entry.get("took"), (int, float)) and entry["took"] < CRASH_WINDOW):
                break
            quick += 1
        return quick, restartable


def final(end: End, in_a_row: int, kept: bool, slow_in_a_row: int = 0) -> str | None:
    """Why this end must not be left to RunPod's restart (None: a new start may mend it).
    `in_a_row`: restartable ends in a row soon after their start; `slow_in_a_row`: however
    long they took."""
    if end.over:
        return "the run is over"
    if not end.restartable:
        return f"exit {end.code} is not mended by starting again"
    if not kept:
        return (f"exit {end.code}, and no volume keeps the run's state (RunPod wipes the "
                f"container disk when it starts a container again): a new start would begin "
                f"the run anew")
    if in_a_row >= CRASH_LOOP:
        return (f"a crash loop: {in_a_row} starts in a row ended within "
                f"{CRASH_WINDOW / 60:g} min (exit {end.code} last)")
    if slow_in_a_row >= SLOW_LOOP:
        return (f"a restart loop: {slow_in_a_row} starts in a row ended in an exit a new "
                f"start could mend, and none did (exit {end.code} last)")
    return None


def interactive() -> bool:
    """Run by hand at a terminal (a person is there), not as a container's main process."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


class Asked(enum.Enum):
    """What came of asking RunPod to end this pod."""
    DONE = "done"  # RunPod ends it: the SIGTERM it sends ends the stay
    REFUSED = "refused"  # no key or pod id, or the key may not: asking again cannot help
    FAILED = "failed"  # no answer, or RunPod's own error: asked again later


@dataclass(frozen=True)
class Pod:
    """This pod at RunPod, as settling needs it. A head of an `up` run (`up_run`: its label)
    given an account key (`account_key`) terminates every pod of its run at the end."""
    pod_id: str | None
    api_key: str | None
    api_url: str
    account_key: str | None = None
    up_run: str | None = None
    api_timeout: float = 30.0  # each ask of RunPod, its retries included

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], api_url: str | None = None) -> Pod:
        return cls(environ.get("RUNPOD_POD_ID", "").strip() or None,
                   runpod_key(environ, from_file=False),
                   api_url or runpod_api.DEFAULT_URL)


def settle(policy: AfterRun | str, pod: Pod, reporter: Any, signals: Signals,
           summary: str, why: str) -> None:
    """The run is over, or this end is final (`why`): stop the pod, stay, or exit, as `policy`
    says. Returns at once for `exit`; otherwise when a signal ends the stay (RunPod stopping
    the pod sends SIGTERM)."""
    policy = AfterRun(policy)
    if policy is AfterRun.EXIT or signals.received:
        return
    if interactive():
        reporter.say(f"{summary}; run at a terminal, so exiting (PODAGENT_AFTER_RUN={policy} "
                     f"applies to a pod's own podagent)")
        return
    asked = _end_pod(pod, reporter, why, summary) if policy is AfterRun.STOP_POD else None
    if asked is Asked.DONE:
        pass  # said by _end_pod
    elif policy is AfterRun.STOP_POD:
        reporter.say(f"staying up idle, not exiting (RunPod would start the run again): "
                     f"{summary}; stop the pod yourself (RunPod's console; `podagent down "
                     f"RUN` for a run `podagent up` created)"
                     + (f"; asking RunPod again in {ASK_AGAIN_AFTER:g} s"
                        if asked is Asked.FAILED else ""))
    else:
        reporter.say(f"staying up (PODAGENT_AFTER_RUN={policy}) so that RunPod does not start "
                     f"the run again: {summary}; stop the pod to end")
    reporter.event(Event.STAYING, policy=policy, why=why)
    try:
        _stay(pod, reporter, signals, why, summary, asked)
    except Interrupted as exc:
        reporter.say(f"{exc}: leaving")


def _stay(pod: Pod, reporter: Any, signals: Signals, why: str, summary: str,
          asked: Asked | None) -> None:
    """Until a signal ends the stay: a line now and then, and RunPod asked again (at growing
    intervals) while what it answered may pass."""
    pause = ASK_AGAIN_AFTER
    now = time.monotonic()
    note_at, ask_at = now + STAY_NOTE_EVERY, now + pause
    while True:
        wake = min(note_at, ask_at) if asked is Asked.FAILED else note_at
        signals.sleep(max(0.0, wake - time.monotonic()))
        now = time.monotonic()
        if asked is Asked.FAILED and now >= ask_at:
            asked = _end_pod(pod, reporter, why, summary)
            pause = min(2 * pause, STAY_NOTE_EVERY)
            ask_at = now + pause
            if asked is Asked.FAILED:
                reporter.say(f"asking RunPod again in {pause:g} s")
        if now >= note_at:
            note_at = now + STAY_NOTE_EVERY
            reporter.say(f"still staying: {summary}")


def _end_pod(pod: Pod, reporter: Any, why: str, summary: str) -> Asked:
    """Ask RunPod to end this pod: the whole run terminated (an `up` run's head given an
    account key), else this pod stopped with its own key. Said in one line when asked."""
    terminated = terminate_run(pod, reporter) if pod.account_key and pod.up_run else None
    if terminated is Asked.DONE:
        reporter.say(f"terminating: every pod of run {pod.up_run} is being terminated: "
                     f"{summary}")
        return terminated
    stopped = _stop_pod(pod, reporter, why)
    if stopped is Asked.DONE:
        reporter.say(f"stopping: RunPod stops pod {pod.pod_id} ({why}): {summary}")
        return stopped
    return Asked.FAILED if Asked.FAILED in (terminated, stopped) else Asked.REFUSED


def _stop_pod(pod: Pod, reporter: Any, why: str) -> Asked:
    """Ask RunPod to stop this pod; it then sends SIGTERM, which ends the stay. Not DONE when
    it cannot be asked, or RunPod refused or did not answer (said in one line)."""
    missing = [name for name, value in (("RUNPOD_POD_ID", pod.pod_id),
                                        (runpod_api.API_KEY, pod.api_key)) if not value]
    if missing:
        reporter.warn(f"cannot stop this pod through RunPod's API: {' and '.join(missing)} "
                      f"{'is' if len(missing) == 1 else 'are'} not set")
        reporter.event(Event.STOP_POD, pod=pod.pod_id, ok=False, error=f"{missing} not set")
        return Asked.REFUSED
    try:
        took = runpod_api.stop_pod(pod.pod_id or "", pod.api_key or "", pod.api_url,
                                   timeout=pod.api_timeout, say=reporter.warn)
    except RunPodApiError as exc:
        # Exiting instead would only get the container started again: stay, and say so.
        reporter.warn(f"RunPod refused to stop pod {pod.pod_id} with the key it gave the pod "
                      f"({exc})")
        reporter.event(Event.STOP_POD, pod=pod.pod_id, ok=False, error=str(exc))
        return _after(exc)
    reporter.say(f"asked RunPod's API to stop pod {pod.pod_id}"
                 + ("" if took else " (it is being stopped already)"))
    reporter.event(Event.STOP_POD, pod=pod.pod_id, ok=True, why=why)
    return Asked.DONE


def _after(exc: RunPodApiError) -> Asked:
    """A refused key stays refused; anything else (no answer, RunPod's error) may pass."""
    return Asked.REFUSED if isinstance(exc, RunPodAuthError) else Asked.FAILED


def terminate_run(pod: Pod, reporter: Any) -> Asked:
    """The head of an `up` run given an account key, once its workers have left the run:
    every pod of the run is terminated (found by its label), this one last (an Instant
    Cluster's: the cluster). Not DONE, said in one line, when RunPod refuses or does not
    answer: the caller falls back to stopping this pod with its own key."""
    client = runpod_api.Client(pod.account_key or "", pod.api_url, timeout=pod.api_timeout,
                               say=reporter.warn)
    try:
        pods = [p for p in client.list_pods(include_cluster_pods=True)
                if (p.get("env") or {}).get(UP_RUN_LABEL) == pod.up_run]
        clusters = {str(p["cluster"]["id"]) for p in pods if isinstance(p.get("cluster"), dict)}
        alone = [p["id"] for p in pods if not isinstance(p.get("cluster"), dict)]
        for other in (p for p in alone if p != pod.pod_id):
            client.terminate_pod(other)
        # Said before this pod goes: its own termination ends this process.
        reporter.say(f"terminating the {len(pods)} pod(s) of run {pod.up_run}: the others are "
                     f"gone, this one goes last")
        reporter.event(Event.TERMINATE_RUN, run=pod.up_run, ok=True, pods=len(pods))
        for cluster in clusters:
            client.delete_cluster(cluster)
        if pod.pod_id in alone:
            client.terminate_pod(pod.pod_id)
    except RunPodApiError as exc:
        reporter.warn(f"could not terminate the pods of run {pod.up_run} with the account key "
                      f"({exc}); stopping this pod instead")
        reporter.event(Event.TERMINATE_RUN, run=pod.up_run, ok=False, error=str(exc))
        return _after(exc)
    finally:
        client.close()
    return Asked.DONE


def ended(end: End, started: float, run_dir: Path, pod_name: str, kept: bool) -> str | None:
    """Record this end in the pod's start book (when its run dir is kept) and judge it."""
    quick, slow = StartBook(run_dir, pod_name).ended(time.monotonic() - started, end) if kept \
        else (0, 0)
    return final(end, quick, kept, slow)


class _Plain:
    """A reporter for the time before settings exist: lines on stderr."""

    def __init__(self, write: Callable[[str], None]):
        self._write = write

    def say(self, text: str) -> None:
        self._write(f"podagent: {text}")

    def warn(self, text: str) -> None:
        self._write(f"podagent: WARNING: {text}")

    def event(self, event: str, **fields: Any) -> None:
        pass


def settle_unconfigured(environ: Mapping[str, str], code: int,
                        write: Callable[[str], None]) -> None:
    """Bad input found before podagent's settings exist (exit 2): on a RunPod pod a new start
    would meet the same input, so the pod stops itself, or stays idle when RunPod refuses,
    unless PODAGENT_AFTER_RUN asks otherwise."""
    if not environ.get("RUNPOD_POD_ID", "").strip():
        return
    field = FIELD_BY_ATTR["after_run"]  # its variable and rule, as the settings read it
    try:
        policy = field.parse(environ.get(field.env, "").strip())
    except ValueError:  # unset, or itself the bad input: a pod that bills must not stay up
        policy = AfterRun.STOP_POD
    try:  # the address may be the bad input itself
        url = http_url(environ.get(runpod_api.API_URL, "").strip() or
                       runpod_api.DEFAULT_URL)
    except ValueError:
        url = runpod_api.DEFAULT_URL
    signals = Signals()
    signals.install()
    settle(policy, Pod.from_environ(environ, url), _Plain(write), signals,
           f"podagent could not start (exit {code})", f"exit {code} is not mended by starting "
           f"again")

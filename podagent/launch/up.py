"""`podagent up`: from the user's machine to a finished multi-node run, and nothing left billing.

A state machine (Phase) with its policy apart (`judge`, a pure function of what RunPod and the
head said): CHECKING (the key, the GPU type, data centers and registry credential against
RunPod's catalogs, what of the run exists already) → CREATING (the head first, then the
workers with its id, several at once; or one cluster; each create recorded before it goes
out) → STARTING (every pod RUNNING, within --timeout) → FORMING (the head's Ray up, the
workers joining: the head's own events) → RUNNING (the job's output) → FINISHED (the head's
word that the run is over: its code is ours) → CLEANING (every pod terminated and gone from
RunPod's list, unless --keep). With --detach, `up` leaves once the pods run: each pod stops
itself when the run is over.

Money first: once anything may have been created, every way out (an error, a bug, Ctrl-C or
SIGTERM at any moment, the clean-up included) terminates the pods and waits until RunPod lists
none; only a second interrupt leaves them, saying `podagent down RUN`. A pod that ran and is
stopped, fails or is terminated at RunPod is replaced (REPLACING, within --replacements): a
worker by one of the same spec under its name, which the head takes in, resuming the job; the
head by the whole run created again. A lost pod past the budget ends the run. Running it again
with the same --name re-attaches to the run's pods instead of creating more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import queue
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from podagent import errors
from podagent.choices import RAY_LAUNCHER
from podagent.config.fields import FIELD_BY_ATTR
from podagent.errors import (
    DeadlineReached,
    GpuCheckFailed,
    Interrupted,
    PodagentError,
    PodGone,
    PodsLeftBilling,
    PodsNotReady,
)
from podagent.launch import down, state
from podagent.launch import spec as specs
from podagent.launch.create import Checked, Creator, check
from podagent.launch.follow import HeadLog, HeadRecord, LastWords, plain
from podagent.launch.interrupts import Interrupts, Leave, next_item, signum_of
from podagent.launch.spec import UpSpec
from podagent.launch.view import Board, View
from podagent.launch.watch import CostMeter, Watch
from podagent.platform.runpod_api import Client
from podagent.run import exits
from podagent.wire import Event, GangPhase, HeadState

POLL = 2.0  # seconds between looks at the pods' statuses (one list call for all)
RECORD_WAIT = 0.25  # the loop's wait for the head's next record
# The clean-up's look for creates still landing, in call deadlines (this run's, or the
# default an earlier `up` of the run had): a create lands within two of its own; a record
# re-attached to is not trusted for longer.
LANDING_AT_MOST = 4
# A head whose container keeps being started again is a crash loop, billing for nothing.
# (A run resumed after a lost node or a restarted head starts it a few times at most.)
MAX_HEAD_STARTS = 5
# A pod that ran and is now EXITED was stopped outside the run once this long has passed
# without the head's word that the run is over (its log lags a little behind); CLOSING_GRACE
# while the head is closing the run: its workers stop themselves before it has said so.
GONE_GRACE = 10.0
CLOSING_GRACE = 90.0
# The head ends a capped run at its deadline (PODAGENT_DEADLINE), its job given the stop's
# grace; `up` ends it itself this much later still (a head gone silent, say).
DEADLINE_GRACE = 120.0
UNKNOWN_GRACE = 300.0  # the job's stop grace when `up` was not told it (and the head is silent)
GPU_EXIT = exits.code_of(GpuCheckFailed)
# How long `up --name RUN` waits for the head of a detached run to replace a lost worker (its
# look at RunPod every 10 s, the create, the new pod listed).
HEAD_REPLACE_GRACE = 900.0
ADOPT_EVERY = 10.0
# A worker's exits that a pod of the same spec meets again: bad input, a refused cluster token.
SAME_AGAIN = frozenset({exits.code_of(errors.ConfigError), exits.code_of(errors.AuthRefused)})


class Phase(str, enum.Enum):
    CHECKING = "checking"
    CREATING = "creating pods"
    STARTING = "starting pods"
    FORMING = "forming the cluster"
    RUNNING = "running the job"
    REPLACING = "replacing a lost pod"
    FINISHED = "finished"
    DETACHED = "detached"
    CLEANING = "terminating pods"


# The head's states (its `state` events) as phases of the whole run.
# Keyed by the states' values: what the head's events carry (a Ray run's head, or the head of a
# run without Ray).
_HEAD_PHASES = {state.value: phase for state, phase in (
    (HeadState.WAITING_WORKERS, Phase.FORMING), (HeadState.STARTING_REWARD, Phase.FORMING),
    (HeadState.WAITING_REWARD, Phase.FORMING), (HeadState.SUBMITTING, Phase.RUNNING),
    (HeadState.RUNNING, Phase.RUNNING), (HeadState.RECOVERING, Phase.FORMING),
    (GangPhase.RENDEZVOUS, Phase.FORMING), (GangPhase.RUNNING, Phase.RUNNING))}
# The states in which the head's cluster (its Ray, or its rendezvous) is there to join.
_HEAD_UP = (HeadState.WAITING_WORKERS, GangPhase.RENDEZVOUS)


@dataclass(frozen=True)
class Verdict:
    action: str  # "wait", "fail", "replace" (`pod`), "recreate" (the head lost) or "done"
    why: str = ""
    gone: bool = False  # a pod that ran was stopped, failed or terminated at RunPod
    capped: bool = False  # the run is past its deadline and the head did not end it
    pod: str = ""  # the lost pod (to replace)
    gpu: bool = False  # its GPUs failed their check before the job


def judge(statuses: Mapping[str, str | None], started: float, now: float, timeout: float,
          head_exit: int | None, shape: str, head_starts: int = 1,
          ran: Collection[str] = (), exited_since: Mapping[str, float] | None = None,
          grace: float = GONE_GRACE, cluster: bool = False,
          past_deadline: float | None = None, head: str = "", spare: int = 0,
          head_spare: int = 0, born: Mapping[str, float] | None = None,
          failed: Mapping[str, str] | None = None,
          pending: Collection[str] = (), doomed: Mapping[str, str] | None = None,
          awaited: Collection[str] = ()) -> Verdict:
    """What to do next, from each pod's status (None: RunPod no longer lists it), the head's
    code once its run is over for good, how often the head's podagent has started, which pods
    have been RUNNING (one restarting later is not one that never started), since when each
    EXITED pod has been so, and how long ago the head should have ended a capped run. A pod
    that ran and is lost is replaced while replacements are left (`spare` for a worker,
    `head_spare` for the `head`, whose loss has the whole run created again; never a pod of
    an Instant Cluster: RunPod makes those as one). The head is judged first: a worker lost
    with it needs no replacement of its own. `born`: when a replacement was created (its
    --timeout to run counts from then). `failed`: the pods whose GPUs failed their check,
    with why (their own word): replaced at once, whether or not `up` saw them RUNNING, the
    head's before its exit is taken for the run's. `pending`: stopped pods whose own log is
    still being read for why (their loss waits for it). `doomed`: pods that stopped
    themselves for a cause a pod of the same spec would meet again (bad input, a refused
    token), with their words: the run ends, nothing is replaced. `awaited`: lost workers whose
    replacement the run's head makes (a detached run followed again): waited for."""
    def lost(name: str, why: str, gpu: bool = False) -> Verdict:
        if name == head and head_spare > 0 and not cluster:
            return Verdict("recreate", why, gone=True, pod=name, gpu=gpu)
        if name != head and spare > 0 and not cluster:
            return Verdict("replace", why, gone=True, pod=name, gpu=gpu)
        return Verdict("fail", why, gone=True, pod=name, gpu=gpu)

    failed = failed or {}
    if head in failed and head_exit in (None, GPU_EXIT):
        return lost(head, f"pod {head}'s GPUs failed their check before the job: "
                          f"{failed[head]}", gpu=True)
    if head_exit is not None:
        return Verdict("done")
    if past_deadline is not None and past_deadline >= 0:
        return Verdict("fail", f"the run passed its deadline (--max-duration/--max-cost) and "
                               f"the head had not ended it {past_deadline:.0f} s after its "
                               f"grace: ending it here", capped=True)
    if head_starts > MAX_HEAD_STARTS:
        return Verdict("fail", f"the head's podagent has started {head_starts} times without "
                               f"finishing the run (its container keeps exiting: a crash "
                               f"loop); its log above says why")
    exited_since = exited_since or {}
    for name, status in sorted(statuses.items(), key=lambda item: item[0] != head):
        if name in failed:
            return lost(name, f"pod {name}'s GPUs failed their check before the job: "
                              f"{failed[name]}", gpu=True)
        if doomed and name in doomed and status != "RUNNING":
            return Verdict("fail", f"pod {name} stopped itself: {doomed[name]}; a replacement "
                                   f"of the same spec would meet the same, so none is made",
                           gone=True, pod=name)
        if name in awaited and status in (None, "TERMINATED", "EXITED", "ERROR"):
            continue
        if status == "ERROR" and name in ran:
            return lost(name, f"pod {name} failed at RunPod (ERROR) while the run went on "
                              f"(its system log at RunPod says why)")
        if status == "ERROR":
            cause = ("an image RunPod could not pull: an Instant Cluster takes no registry "
                     "credential, so a private image fails there (use pods without --cluster "
                     "and --registry-auth, or a public image)" if cluster else
                     "an image that cannot be pulled (a private one needs --registry-auth), "
                     "or a host fault")
            return Verdict("fail", f"pod {name} is in ERROR at RunPod before it ran: likely "
                                   f"{cause}; its system log at RunPod says more")
        if status in (None, "TERMINATED"):
            why = f"pod {name} was terminated outside this run"
            return lost(name, why) if name in ran else Verdict("fail", why)
        if status == "EXITED" and name in pending:
            continue  # what it said last decides how it is lost
        if status == "EXITED" and now - exited_since.get(name, now) >= grace:
            why = (f"pod {name} was stopped at RunPod (EXITED) while the run went on, "
                   f"{now - exited_since[name]:.0f} s without the head saying the run was over")
            return lost(name, why) if name in ran else Verdict("fail", why, gone=True)
    born = born or {}
    waiting = {n: s for n, s in statuses.items()
               if s not in ("RUNNING", "EXITED") and n not in ran
               and now - max(started, born.get(n, started)) > timeout}
    if waiting:
        listed = ", ".join(f"{n} {s}" for n, s in sorted(waiting.items()))
        return Verdict("fail", f"{len(waiting)} of {len(statuses)} pod(s) not RUNNING after "
                               f"{timeout:g} s ({listed}) for {shape}: RunPod may have no "
                               f"capacity; try another GPU type or data center")
    return Verdict("wait")


class Up:
    """`podagent up`'s state machine: carries out what `judge` decides, from checking the
    account to the last pod gone."""

    def __init__(self, spec: UpSpec, client: Client, view: View,
                 interrupts: Interrupts | None = None,
                 follow_only: bool = False):
        self.spec, self.client, self.view = spec, client, view
        self.interrupts = interrupts or Interrupts()
        self.follow_only = follow_only  # `up --name RUN` alone: never create anything
        self.board = Board(spec.run, spec.shape(), expected=spec.workers)
        self.checked: Checked | None = None
        self.creator: Creator | None = None
        self.watch: Watch | None = None
        self.records: queue.Queue[HeadRecord] = queue.Queue()
        self.head_log: HeadLog | None = None
        self.ran: set[str] = set()  # pods seen RUNNING at least once
        # Any pod of the run seen RUNNING, ever (`ran` starts again with a recreated run):
        # its network volume may hold what they wrote.
        self.ever_ran = False
        self.terminated = False  # the clean-up saw every pod of the run gone
        self.exited_since: dict[str, float] = {}
        self.born: dict[str, float] = {}  # when each replacement was created (monotonic)
        # A detached run followed again: its head replaces lost workers (since when each
        # has been lost, waiting for that).
        self.head_replaces = False
        self.lost_since: dict[str, float] = {}
        self.adopt_next: dict[str, float] = {}
        # Starts of the head's podagent a lost worker caused (a run without Ray starts again
        # on every pod): not a crash loop.
        self.lost_restarts = 0
        # A stopped worker's own log, read for its last exit: a GPU check that failed, or why
        # it stopped.
        self.last_words = LastWords(client, GPU_EXIT)
        self.detached = False
        self.left = False  # a second interrupt: the pods were left as they are
        self.clean_up_failed: Exception | None = None  # the pods may still bill
        self.sweep = down.Sweep()  # what the clean-up saw of them
        self.started = time.monotonic()
        self.started_at = time.time()
        self.head = HeadProgress(spec.run, self.board, view, self.say, self._phase,
                                 self._head_name, self.started)

    @property
    def created(self) -> bool:
        """Something of the run may exist at RunPod: the end terminates it."""
        return bool(self.checked and self.checked.exists) or bool(
            self.creator and self.creator.created)

    @property
    def record(self) -> state.RunRecord | None:
        return self.checked.record if self.checked else None

    def say(self, text: str) -> None:
        self.view.line(f"[up] {text}")

    def _phase(self, phase: Phase) -> None:
        if self.board.set_phase(phase.value):
            self.view.update(self.board)

    # --- the machine ----------------------------------------------------------------------

    def run(self) -> int:
        """The run's exit code; raises what ended it otherwise, once what was created is gone
        (or left, after a second interrupt)."""
        failure: BaseException | None = None
        code: int | None = None
        try:
            try:
                code = self._drive()
            finally:
                # From the run's end on, a first signal only notes itself: the end below
                # terminates the pods anyway, and one raised before its clean-up began would
                # leave them all billing (a second one still leaves them, as it says).
                self.interrupts.hold()
        except BaseException as exc:  # whatever it is, a bug included: the pods go first
            failure = exc
        if self.created and not self._leaves_pods(failure):
            self._clean_up(failure)
        with contextlib.suppress(OSError):  # an output that broke: the end's code stands
            self._volume_end()
        return self._outcome(failure, code)

    def _drive(self) -> int | None:
        spec = self.spec
        self._phase(Phase.CHECKING)
        self.checked = check(spec, self.client, self.follow_only, self.say)
        spec = self.spec = self.checked.spec  # its deadline worked out
        head = specs.pod_name(spec.run, 0)
        self.head_replaces = self._head_replaces(head)
        if self.follow_only and not spec.cluster and self.checked.pod_ids \
                and head not in self.checked.pod_ids:
            # Nothing would ever end this run: its workers wait for a head that is gone.
            raise PodGone(f"run {spec.run}: its head ({head}) is no longer at RunPod; its "
                          f"workers are terminated too")
        if not self.follow_only:
            self._phase(Phase.CREATING)
            self.creator = Creator(spec, self.client, self.checked, self.board, self.view)
            try:
                self.creator.create()
            finally:
                spec = self.spec = self.creator.spec  # with the run's network volume
        self.watch = Watch(spec, self.client, self.board, self.view, self.say,
                           self.checked.pod_ids, self.checked.cluster_id)
        self._phase(Phase.STARTING)
        code = self._follow(self.watch)
        self._phase(Phase.DETACHED if self.detached else Phase.FINISHED)
        return code

    def _volume_end(self) -> None:
        """The run's network volume outlives its pods: said, with what it costs a month and
        how to delete it; one this `up` created that no pod ever ran with holds nothing, and
        is deleted (the run never started)."""
        checked = self.checked
        if checked is None or self.left:
            return
        run = self.spec.run
        created_here = self.creator is not None and checked.volume_data_center is not None
        volume = checked.volume
        unanswered = created_here and self.record is not None and any(
            r.kind == "volume" and r.id is None for r in self.record.resources)
        if volume is None and unanswered:  # a signal, a timeout: looked for by its name
            try:
                volume = self.client.find_network_volume(specs.volume_name(run))
            except PodagentError as exc:
                self.say(f"could not look for the network volume of run {run} ({exc}): "
                         f"`podagent down {run} --volume` deletes it if it was made")
                return
            if volume is None:
                self.say(f"the create of run {run}'s network volume was never answered: if "
                         f"RunPod made it, `podagent ls` lists it and `podagent down {run} "
                         f"--volume` deletes it")
        if volume is None:
            return
        size = int(volume["size"])
        # Deleted only when nothing can be on it: this `up` made it, no pod of the run ever
        # ran, and every pod is gone (not kept, not left, not possibly billing).
        if created_here and not self.ever_ran and self.terminated:
            try:
                self.client.delete_network_volume(str(volume["id"]))
            except PodagentError as exc:
                self.say(f"the network volume {volume['id']} of run {run} holds nothing (no "
                         f"pod ran) and could not be deleted ({exc}): `podagent down {run} "
                         f"--volume` deletes it")
            else:
                self.say(f"deleted the network volume {volume['id']} of run {run}: no pod ran, "
                         f"so it held nothing")
            return
        self.say(f"kept: network volume {specs.volume_name(run)} ({volume['id']}), {size} GB "
                 f"in {volume['dataCenter']}, about ${specs.volume_price(size):.2f}/month at "
                 f"RunPod's rate, with what the run's pods wrote (checkpoints in "
                 f"/workspace/checkpoints by default); `podagent down {run} --volume` deletes "
                 f"it")

    def _leaves_pods(self, failure: BaseException | None) -> bool:
        """Whether this end leaves the pods as they are (and says so)."""
        run = self.spec.run
        if isinstance(failure, Leave):
            self.left = True
            self.say(f"left the pods of run {run} as they are; they bill until `podagent "
                     f"down {run}` terminates them")
            return True
        if failure is None and self.detached:
            self._say_detached()
            return True
        if self.spec.keep and (failure is None or isinstance(failure, KeyboardInterrupt)):
            why = (f"{self.interrupts.name}: leaving run {run} running" if failure else
                   "the pods stay up idle (and bill)")
            self.say(f"--keep: {why}: `podagent up --name {run}` re-attaches, `podagent down "
                     f"{run}` terminates them")
            return True
        return False

    def _clean_up(self, failure: BaseException | None) -> None:
        """Terminate everything of the run; a first signal meanwhile does not stop it."""
        run = self.spec.run
        if self.head_log is not None:
            self.head_log.stop()
        try:
            with self.interrupts.shielded():
                if isinstance(failure, KeyboardInterrupt):
                    self.say(f"{self.interrupts.name}: stopping run {run} and terminating its "
                             f"pods (Ctrl-C again to leave them running)")
                if self.creator is not None:
                    try:
                        self.creator.wait()
                    except Exception as exc:  # (a record it could not write): never skip
                        self.say(f"a create's answer could not be recorded ({exc}); its pod "
                                 f"is looked for by name")
                self._terminate()
        except Leave:
            self.left = True
            self.say(f"left the pods of run {run} as they are; they bill until `podagent down "
                     f"{run}` terminates them")
        except Exception as exc:  # an API that stays down; a bug in the clean-up itself
            self.clean_up_failed = exc  # the end says it, with its own code (_outcome)

    def _terminate(self) -> None:
        """Every pod of the run terminated and gone from RunPod's list (else an error)."""
        self._phase(Phase.CLEANING)
        # A create cut off (a signal, a timeout) or sent again after an error may still land
        # within its own deadline, given once more after it (as `podagent down` waits).
        at_most = LANDING_AT_MOST * max(self.spec.api_timeout, state.DEFAULT_LANDING)
        landing = min(self.record.landing_left(time.time()), at_most) \
            if self.record is not None else 0.0
        down.terminate(self.client, self.spec.run, self.record, self.say, sweep=self.sweep,
                       timeout=down.GONE_TIMEOUT + self.spec.api_timeout + landing,
                       landing_time=landing)
        self.terminated = not self.sweep.cut_short
        if self.watch is not None:  # billing ended when RunPod listed none of the pods
            self.watch.cost.close(self.sweep.gone_at or time.time())
        for row in self.board.pods.values():
            row.status, row.cost, row.since = "TERMINATED", 0.0, time.monotonic()
        self.view.update(self.board)

    def _outcome(self, failure: BaseException | None, code: int | None) -> int:
        if self.left:
            raise Interrupted(signum_of(failure) if isinstance(
                failure, (Leave, KeyboardInterrupt)) else self.interrupts.first or 2)
        if self.clean_up_failed is not None:
            self._left_billing(failure, code)
        if failure is None:
            if self.detached:
                return 0
            assert code is not None
            self._summary(code)
            return code
        if isinstance(failure, KeyboardInterrupt):
            raise Interrupted(signum_of(failure))
        raise failure  # podagent's error: the CLI's code; a bug: its traceback and 70

    # --- following ----------------------------------------------------------------------------

    def _follow(self, watch: Watch) -> int | None:
        """From the pods' creation until the head's run is over for good (its code), or, with
        --detach, until every pod runs (None)."""
        next_look = 0.0
        statuses: dict[str, str | None] = {}
        while True:
            now = time.monotonic()
            if now >= next_look:
                statuses = watch.look_again(statuses)
                next_look = now + POLL
                self.ran |= {name for name, status in statuses.items() if status == "RUNNING"}
                self.ever_ran = self.ever_ran or bool(self.ran)
                for name, status in statuses.items():
                    if status == "EXITED":
                        self.exited_since.setdefault(name, now)
                        self._ask_why(name)
                    else:
                        self.exited_since.pop(name, None)
                self._keep_following(statuses)
                if statuses and all(s == "RUNNING" for s in statuses.values()):
                    if self.board.phase == Phase.STARTING.value:
                        self._phase(Phase.FORMING)
                    if self.spec.detach and self.head.starts:
                        self.detached = True
                        return None
            verdict = judge(statuses, self.started, time.monotonic(), self.spec.timeout,
                            self.head.exit, self.spec.shape(),
                            # A run without Ray starts its head's podagent again after a
                            # lost pod: no crash loop.
                            self.head.starts - self.lost_restarts, self.ran,
                            self.exited_since, cluster=self.spec.cluster,
                            grace=CLOSING_GRACE if self.head.closing else GONE_GRACE,
                            past_deadline=self._past_deadline(), head=self._head_name(),
                            # A head ending the run stops its workers itself; a head that
                            # is gone was lost, whatever it was doing.
                            # A head that replaces its workers itself: none replaced here.
                            spare=0 if self.head.closing or self.head_replaces
                            else self._spare(),
                            head_spare=self._spare(), born=self.born,
                            failed=self._failed_checks(), pending=self._reading(),
                            doomed=(doomed := self._doomed()),
                            awaited=self._awaited(statuses))
            if verdict.pod and not verdict.gpu and verdict.pod not in doomed:
                # a pod lost: what it said last, if known
                verdict = dataclasses.replace(verdict, why=verdict.why + self._words(verdict.pod))
            if verdict.action == "done":
                return self.head.exit
            if verdict.capped:
                raise DeadlineReached(f"run {self.spec.run}: {verdict.why}")
            if verdict.action == "replace":
                self._replace(verdict.pod, verdict.why, restarts=not verdict.gpu)
                statuses = {**statuses, verdict.pod: "PROVISIONING"}
            elif verdict.action == "recreate":
                self._recreate(verdict.pod, verdict.why)
                statuses = dict.fromkeys(watch.pod_ids, "PROVISIONING")
            if verdict.action in ("replace", "recreate"):  # its pods' first look in POLL
                next_look = time.monotonic() + POLL
                continue
            if verdict.action == "fail":
                raise (GpuCheckFailed if verdict.gpu else PodGone if verdict.gone else
                       PodsNotReady)(f"run {self.spec.run}: {verdict.why}")
            with contextlib.suppress(queue.Empty):
                self.head.take(next_item(self.records, RECORD_WAIT))
                while True:  # what else has come meanwhile
                    self.head.take(self.records.get_nowait())

    def _ask_why(self, name: str) -> None:
        """A worker stopped while the run goes on: its log is read for its last exit."""
        assert self.watch is not None
        pod_id = self.watch.pod_ids.get(name)
        if pod_id and name != self._head_name() and self.head.exit is None \
                and not self.head.closing:
            self.last_words.ask(pod_id)

    def _head_replaces(self, head: str) -> bool:
        """Whether the run's head (already at RunPod: a run re-attached to) replaces lost
        workers itself: a detached run's, by what it was created with (its env at RunPod,
        whoever's machine follows it). `up` then replaces none of them: never two of one."""
        assert self.checked is not None
        head_id = self.checked.pod_ids.get(head)
        if self.spec.cluster or not head_id:
            return False
        try:
            pod = self.client.get_pod(head_id)
        except PodagentError:
            return False
        env = (pod or {}).get("env")
        if not isinstance(env, Mapping):
            return False
        budget = str(env.get(specs.REPLACEMENTS_VARIABLE, "0"))
        return budget.isdigit() and int(budget) > 0 and specs.ACCOUNT_KEY in env

    def _awaited(self, statuses: Mapping[str, str | None]) -> set[str]:
        """A detached run followed again (`up --name RUN`): its head replaces a worker RunPod
        lost. Such a worker is waited for (HEAD_REPLACE_GRACE: past the head's own wait for
        it, PODAGENT_WORKER_TIMEOUT, after which the head ends the run itself) and its
        replacement, once RunPod lists it under the name, followed in its place."""
        if not self.head_replaces:
            return set()
        assert self.watch is not None
        now = time.monotonic()
        awaited = set()
        for name, status in statuses.items():
            if name == self._head_name() or status not in (None, "TERMINATED", "EXITED",
                                                             "ERROR"):
                self.lost_since.pop(name, None)
                continue
            since = self.lost_since.setdefault(name, now)
            # One look for it in ADOPT_EVERY: RunPod's list is rate-limited.
            if now >= self.adopt_next.get(name, 0.0):
                self.adopt_next[name] = now + ADOPT_EVERY
                if self._adopt(name):  # its status is the next look's
                    awaited.add(name)
                    continue
            if now - since < HEAD_REPLACE_GRACE:
                awaited.add(name)
        return awaited

    def _adopt(self, name: str) -> bool:
        """The head's replacement of worker `name`, if RunPod lists one: followed instead."""
        assert self.watch is not None
        old = self.watch.pod_ids.get(name, "")
        try:
            found = self.client.find_pod(name, not_these=(old,))
        except PodagentError:
            return False
        if not found or str(found.get("id", "")) in ("", old):
            return False
        self.watch.pod_ids[name] = str(found["id"])
        self.ran.discard(name)
        self.exited_since.pop(name, None)
        self.lost_since.pop(name, None)
        self.born[name] = time.monotonic()
        self.board.row(name).joined = False
        self.say(f"pod {name} ({old}) was replaced by the run's head: following {found['id']} "
                 f"in its place")
        return True

    def _doomed(self) -> dict[str, str]:
        """Stopped workers whose last exit a new pod of the same spec would repeat."""
        assert self.watch is not None
        doomed = {}
        for name, pod_id in self.watch.pod_ids.items():
            words = self.last_words.of(pod_id)
            if words is not None and words.code in SAME_AGAIN:
                doomed[name] = f"exit {words.code}: {words.error}"
        return doomed

    def _reading(self) -> set[str]:
        assert self.watch is not None
        return {name for name, pod_id in self.watch.pod_ids.items()
                if self.last_words.pending(pod_id)}

    def _words(self, name: str) -> str:
        assert self.watch is not None
        words = self.last_words.of(self.watch.pod_ids.get(name, ""))
        return words.suffix() if words is not None else ""

    def _failed_checks(self) -> dict[str, str]:
        """The pods whose GPUs failed their check, by their own word (the head's in its log)."""
        assert self.watch is not None
        failed = {}
        if self.head.gpu_failure:
            failed[self._head_name()] = self.head.gpu_failure
        for name, pod_id in self.watch.pod_ids.items():
            words = self.last_words.of(pod_id)
            if words is not None and words.gpu_failure:
                failed[name] = words.gpu_failure
        return failed

    def _replaced(self) -> int:
        return len(self.record.replacements) if self.record is not None else 0

    def _spare(self) -> int:
        """Replacements left: none past the run's deadline, or for `up --name RUN` alone (it
        creates nothing)."""
        if self.creator is None or (
                self.spec.deadline is not None and time.time() >= self.spec.deadline):
            return 0
        return max(0, self.spec.replacements - self._replaced())

    def _replace(self, name: str, why: str, restarts: bool = True) -> None:
        """The lost pod terminated (a stopped pod's disk still bills) and gone from RunPod's
        list, then one of the same spec created under its name: the head counts it in when
        it joins and resumes the job from its checkpoint (a run without Ray forms again at
        the same world size). Counted in the record once its create was answered.
        `restarts`: the head's podagent starts again for it (a run without Ray whose pod was
        lost mid-run; not one whose GPUs failed before it joined)."""
        assert self.creator is not None and self.record is not None and self.watch is not None
        run = self.spec.run
        if name not in self.spec.names():  # re-attached with fewer --pods than it has
            raise PodGone(f"run {run}: {why}; it is not one of the {self.spec.pods} pods "
                          f"--pods gives, so it is not replaced")
        self._phase(Phase.REPLACING)
        n = self._replaced() + 1
        lost = self.watch.pod_ids.get(name, "")
        self.say(f"{why}: replacing it (replacement {n} of {self.spec.replacements}, "
                 f"--replacements): the lost pod is terminated and a new one of the same spec "
                 f"takes its place; the job resumes from its checkpoint")
        if lost:
            try:
                down.terminate_one(self.client, lost, self.spec.api_timeout, self.say)
            except PodagentError:
                self.say(f"the lost pod {name} ({lost}) could not be terminated: the run ends")
                raise
            self.watch.cost.close(time.time(), name)  # it billed until now, at most
        try:
            self.creator.replace(name, lost)
        except PodagentError:
            self.say(f"the replacement of {name} could not be created: the run ends")
            raise
        self.record.replaced(name, lost, why)
        if self.spec.launcher != RAY_LAUNCHER and restarts:
            self.lost_restarts += 1
        self.ran.discard(name)
        self.exited_since.pop(name, None)
        self.born[name] = time.monotonic()
        self.board.row(name).joined = False
        self._phase(Phase.STARTING)

    def _recreate(self, head: str, why: str) -> None:
        """The head lost: every pod of the run terminated and gone, then the run created
        again under its name, as at the start (the head first, then the workers with its
        id). Each pod's own state is under its pod id, so the new head starts a new ledger;
        the job resumes from the checkpoints the lost run left on a network volume."""
        assert self.creator is not None and self.record is not None and self.watch is not None
        self._phase(Phase.REPLACING)
        n = self._replaced() + 1
        kept = ("it resumes from its checkpoints on the network volume"
                if self.spec.network_volume else
                "WARNING: without a network volume its checkpoints were on the lost pods, "
                "so the job starts over")
        self.say(f"{why}: the run is created again under its name (replacement {n} of "
                 f"{self.spec.replacements}, --replacements): every pod is terminated and "
                 f"created anew; {kept}")
        lost = self.watch.pod_ids.get(head, "")
        if self.head_log is not None:
            self.head_log.stop()
            self.head_log = None
        # A queue of its own for the new head's records: the lost head's stream may still
        # hand one over as it ends.
        self.records = queue.Queue()
        down.terminate(self.client, self.spec.run, self.record, self.say,
                       timeout=down.GONE_TIMEOUT + self.spec.api_timeout)
        self.watch.cost.close(time.time())  # they billed until now
        self.record.try_mark(state.CREATING)  # (the termination marked it down)
        self.watch.pod_ids.clear()
        self.watch.head_id = None
        try:
            self.creator.create()
        except PodagentError:
            self.say(f"run {self.spec.run} could not be created again: the run ends")
            raise
        self.record.replaced(head, lost, why)
        self.lost_restarts = 0
        self.watch.head_id = self.watch.pod_ids.get(specs.pod_name(self.spec.run, 0))
        now = time.monotonic()
        self.born = {name: now for name in self.watch.pod_ids}
        self.ran.clear()
        self.exited_since.clear()
        self.head = HeadProgress(self.spec.run, self.board, self.view, self.say, self._phase,
                                 self._head_name, self.started)
        self.board.joined = 0
        self.board.mark_joined(None, False)
        self._phase(Phase.STARTING)

    def _past_deadline(self) -> float | None:
        """Seconds since the head should have ended the capped run (None: no cap): once it
        said it is ending it, the job's grace it gave (its PODAGENT_STOP_TIMEOUT) and
        DEADLINE_GRACE from then; else from the deadline, or from `up`'s own start when it
        came later (a run re-attached to: what the head said meanwhile is read first)."""
        if self.spec.deadline is None:
            return None
        if self.head.capping is not None:
            since, grace = self.head.capping
            return time.time() - (since + grace + DEADLINE_GRACE)
        stop = FIELD_BY_ATTR["stop_timeout"]
        try:
            grace = stop.parse(dict(self.spec.env).get(stop.env, ""))
        except ValueError:  # unset here: a template or the image may set it on the pods
            grace = UNKNOWN_GRACE
        return time.time() - (max(self.spec.deadline, self.started_at) + grace + DEADLINE_GRACE)

    def _keep_following(self, statuses: Mapping[str, str | None]) -> None:
        """The head's log stream, from when its container starts; started again should its
        thread ever end (it never should)."""
        head_id = self.watch.head_id if self.watch else None
        if (self.head_log is not None and self.head_log.alive) or not head_id:
            return
        if statuses.get(self._head_name()) in ("STARTING", "RUNNING", "EXITED"):
            old = self.head_log
            if old is not None:
                self.say("the head's log stream ended; opening it again")
            self.head_log = HeadLog(self.client, head_id, self.records)
            if old is not None:
                self.head_log.cursor = old.cursor
            self.head_log.start()

    def _head_name(self) -> str:
        return self.watch.head_name() if self.watch else specs.pod_name(self.spec.run, 0)

    # --- the end --------------------------------------------------------------------------

    def _say_detached(self) -> None:
        run = self.spec.run
        if self.record is not None:
            self.record.try_mark(state.DETACHED)
        self.say(f"detached: run {run} goes on without this machine; when it is over each pod "
                 f"stops itself, which ends its GPU billing (given --secret "
                 f"{specs.ACCOUNT_KEY}=..., the head terminates them all). `podagent up --name "
                 f"{run}` follows it again, `podagent ls` shows it, `podagent down {run}` "
                 f"terminates it")
        if specs.REPLACEMENTS_VARIABLE in specs.pod_env(self.spec, 0):
            keyed = any(name == specs.ACCOUNT_KEY for name, _ in self.spec.env)
            self.say(f"a worker RunPod loses is replaced by the run's head (up to "
                     f"{self.spec.replacements}, --replacements)" if keyed else
                     f"WARNING: a worker RunPod loses is not replaced: the head needs --secret "
                     f"{specs.ACCOUNT_KEY}=... for it (without, a lost worker ends the run "
                     f"after PODAGENT_WORKER_TIMEOUT)")

    def _left_billing(self, failure: BaseException | None, code: int | None) -> NoReturn:
        """The pods could not all be terminated: whatever ended the run, `up` ends with
        PodsLeftBilling, naming what may still bill and `podagent down RUN`; the record says
        so too (not DOWN), for `podagent ls` and `podagent down`."""
        run, error = self.spec.run, self.clean_up_failed
        left = self.sweep.left()
        if left is None:  # RunPod never listed them: what this run asked for or found
            known = {r.name: r.id for r in self.record.resources
                     if r.kind != "volume"} if self.record else {}
            known.update(self.checked.pod_ids if self.checked else {})
            left = [f"{name} ({pod_id or 'id unknown'})" for name, pod_id in known.items()]
        if failure is None and code is not None:
            self._summary(code, mark=False)
            ended = f"the run {'succeeded' if code == 0 else 'ended'} (exit {code})"
        elif isinstance(failure, KeyboardInterrupt):
            ended = f"stopped by {self.interrupts.name}"
        elif isinstance(failure, PodagentError):
            ended = str(failure).removeprefix(f"run {run}: ")
        elif failure is not None:  # a bug: its traceback, then the pods' line
            for line in traceback.format_exception(failure):
                self.view.line(line.rstrip("\n"))
            ended = f"a bug in podagent ({type(failure).__name__}: {failure}; traceback above)"
        else:
            ended = "the run ended"
        if self.record is not None:
            self.record.try_mark(state.LEFT_BILLING, run_code=code, may_bill=left,
                                 why=f"{type(error).__name__}: {error}")
        raise PodsLeftBilling(
            f"run {run}: {ended}; its pods could not all be terminated ({type(error).__name__}"
            f": {error}) and may still bill: {', '.join(left) or 'none known'}; `podagent "
            f"down {run}` terminates them") from None

    def _summary(self, code: int, mark: bool = True) -> None:
        """The run's last line: its outcome, what it cost, the API calls it made."""
        took = time.monotonic() - self.started
        cost = self.watch.cost if self.watch else CostMeter()
        hours, dollars = cost.totals(time.time())
        outcome = "succeeded" if code == 0 else f"ended: {exits.meaning(code)}"
        first = (f"; the job's first line after {self.head.first_job_line - self.started:.1f}"
                 f" s" if self.head.first_job_line else "")
        pace = self.client.pace
        quota = pace.quota("minute")
        allowed = f"; RunPod allows {quota}" if quota else ""
        replaced = self._replaced()
        self.say(f"run {self.spec.run} {outcome} (exit {code}) after {took:.1f} s{first}; "
                 f"{len(cost.spans)} pod(s)"
                 + (f" ({replaced} lost and replaced)" if replaced else "")
                 + f", {hours:.3f} pod-hours, about ${dollars:.2f} at RunPod's rates; "
                 f"{pace.calls} RunPod API calls (at most {pace.busiest_minute()} in a "
                 f"minute{allowed})")
        record = self.record
        if record is not None and mark:
            record.cost = {"pod_hours": round(hours, 4), "dollars": round(dollars, 2),
                           "replaced": replaced}
            record.try_mark(state.FINISHED if self.spec.keep else state.DOWN, code=code,
                            took=round(took, 1))


class HeadProgress:
    """What the head's records tell `up`: its phase and who joined (onto the board), the job's
    output and podagent's messages (onto the view), how often its podagent started, and the
    run's code once the head says the run is over."""

    def __init__(self, run: str, board: Board, view: View,
                 say: Callable[[str], None], phase: Callable[[Phase], None],
                 head_name: Callable[[], str], started: float):
        self.run, self.board, self.view, self.say = run, board, view, say
        self.phase, self.head_name, self.started = phase, head_name, started
        self.exit: int | None = None  # the run's code, once it is over for good
        self.last_exit: int | None = None  # the code of the head's podagent's last start
        self._starts: set[Any] = set()  # each start of the head's podagent, by its time
        self.closing = False  # the head's current start is ending the run (its teardown)
        # The head is ending a capped run (its `deadline` event): when `up` heard it, and the
        # grace its job has.
        self.capping: tuple[float, float] | None = None
        self.first_job_line: float | None = None
        self.gpu_failure = ""  # the head's GPUs failed their check (its exit's error)

    @property
    def starts(self) -> int:
        return len(self._starts)

    def take(self, record: HeadRecord) -> None:
        data = record.data
        if record.kind == "job":
            if self.first_job_line is None:
                self.first_job_line = time.monotonic()
                self.say(f"the job's first line came {self.first_job_line - self.started:.1f}"
                         f" s after `up` started")
            self.view.line(record.text)
        elif record.kind == "message":
            label = {"warning": "WARNING: ", "error": "ERROR: "}.get(str(data.get("level")), "")
            self.view.line(f"[{data.get('role', 'head')}] {label}{record.text}")
        elif record.kind == "text":
            self.view.line(record.text)
        elif record.kind == "broken":
            self.say(f"the head's log stream is broken ({data.get('why')}); trying again, and "
                     f"watching the pods' statuses meanwhile")
        elif record.kind == "restored":
            self.say("the head's log stream is back")
        elif record.kind == "lost":
            raise PodsNotReady(f"run {self.run}: the head's log stream was refused: "
                               f"{data.get('why')}")
        elif record.kind == "event":
            self._event(data)

    def _event(self, data: Mapping[str, Any]) -> None:
        event = data.get("event")  # compared with the Event names (str)
        if event == Event.STATE and data.get("state") in _HEAD_PHASES:
            if data["state"] in _HEAD_UP:
                self.board.row(self.head_name()).joined = True
            self.phase(_HEAD_PHASES[str(data["state"])])
        elif event == Event.WORKER_JOINED:
            self.board.joined += 1
            self.board.mark_joined(str(data.get("ip")), True)
            self.view.update(self.board)
        elif event == Event.WORKER_LOST:
            self.board.joined = max(0, self.board.joined - 1)
            self.board.mark_joined(str(data.get("ip")), False)
            self.view.update(self.board)
        elif event == Event.RENDEZVOUS_DONE:  # a run without Ray: every pod came at once
            nodes = data.get("nodes")
            self.board.joined = nodes - 1 if isinstance(nodes, int) and nodes > 0 else 0
            self.board.mark_joined(None, True)
            self.view.update(self.board)
        elif event == Event.WORKERS_COUNTED:
            workers = data.get("workers")
            self.board.joined = workers if isinstance(workers, int) else 0
            self.view.update(self.board)
        elif event == Event.TEARDOWN_STARTED:
            # Ending the run, unless it ends a start that a new one resumes (a run without
            # Ray after a lost pod: exit 22, every pod starting again).
            self.closing = not _resumed_after(data.get("outcome"))
        elif event == Event.ROLE:  # the head's podagent started (again): its workers join anew
            # Counted by the start's own time: the same record read twice is one start.
            self._starts.add((data.get("ts"), data.get("pod")))
            self.closing, self.gpu_failure = False, ""
            self.board.joined = 0
            self.board.mark_joined(None, False)
            self.view.update(self.board)
        elif event == Event.DEADLINE and self.capping is None:
            grace = data.get("grace_s")
            self.capping = (time.time(), float(grace) if isinstance(grace, (int, float)) and
                            not isinstance(grace, bool) and 0 <= grace <= 7 * 86400 else 0.0)
        elif event == Event.EXIT and _code(data.get("code")) is not None:
            # Not the end yet: a start cut short (a lost Ray, a signal) is started again by
            # RunPod and resumes the run. The run is over when the head says so (run_over),
            # or by its code: past the deadline no start runs it again.
            self.last_exit = _code(data.get("code"))
            if self.last_exit == exits.code_of(DeadlineReached):
                self.exit = self.last_exit
            if self.last_exit == GPU_EXIT:
                self.gpu_failure = plain(data.get("error") or "its GPU check")
        elif event == Event.RUN_OVER and _code(data.get("code")) is not None:
            self.exit = _code(data.get("code"))
        elif event == Event.STAYING and self.last_exit is not None \
                and not self.gpu_failure:  # before run_over; a head whose GPUs failed is
            self.exit = self.last_exit  # replaced, not the run's end


def _resumed_after(outcome: Any) -> bool:
    """Whether a head's start that ends so (an error's name, from its `teardown_started`
    event) is started again by RunPod, resuming the run."""
    error = getattr(errors, outcome, None) if isinstance(outcome, str) else None
    return (isinstance(error, type) and issubclass(error, errors.PodagentError)
            and not issubclass(error, errors.Interrupted)
            and exits.restartable(exits.code_of(error)))


def _code(value: Any) -> int | None:
    """An exit code from a record (a stranger's bytes: anything but a small int is none)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 256:
        return value
    return None

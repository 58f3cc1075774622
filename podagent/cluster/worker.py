"""The worker's lifecycle as a named state machine driven by one loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from podagent import process
from podagent.choices import AfterRun
from podagent.cluster import hang, node, ray_node, runstate
from podagent.cluster.stop_watch import WatchedSignals
from podagent.config import Settings
from podagent.errors import HeadLost, HeadUnreachable, RayDied, RayStartError, RayVersionMismatch
from podagent.platform.discovery import HeadFinder, HeadLocation
from podagent.platform.roles import Role, RoleDecision
from podagent.ray_access import ray_compat
from podagent.ray_access.gcs import GcsAuthRefused, GcsClient, GcsLate, GcsUnavailable, Reach
from podagent.report import Reporter
from podagent.run import beacon, cap, pod_setup
from podagent.run.lifecycle import EndRequested, Lifecycle
from podagent.waiting import Backoff, Signals, retry
from podagent.wire import Event, WorkerState

WATCH_INTERVAL = 1.0  # one tiny RPC a second: cheap, and well inside the grace period
JOIN_ATTEMPT_TIMEOUT = 120.0
JOIN_HEAD_GRACE = 3.0  # a head silent this long while `ray start` runs has gone away
JOIN_PROGRESS_EVERY = 10.0
OVER_ASK_EVERY = 2.0  # while the head's Ray is silent: how often to ask whether its run is over
OVER_ASK_TIMEOUT = 0.5
# A head whose GCS still takes connections but lets calls pass their deadline is loaded, not
# gone (seen: a head pod starting its trainers kept its GCS silent for 8.5 s): it is waited for
# this long, not for the grace meant for a head that is gone. Leaving a busy head would cost the
# run a restart.
BUSY_HEAD_GRACE = 60.0
# How often a silent head's port is tried once it took a connection: each try of a frozen GCS
# waits in its accept queue until it runs again (many workers must not fill it).
PROBE_EVERY = 5.0
# A raylet that exits while the head answers is joined again this many times in one podagent:
# one that keeps dying is not saved by joining again, and the pod ends (RayDied).
RAYLET_REJOINS = 3


class HeadSilence:
    """How long the head's GCS has gone unanswered, and whether that makes it gone.

    Past the grace the head is gone when its GCS refused our token, failed otherwise than by a
    deadline (it answered: a reset, a refusal), its port refuses connections (its process
    gone), or two tries in a row got no answer at all (its pod gone, the network cut; one may be
    a lost SYN). A GCS that only lets calls pass their deadline while its port takes
    connections is busy: it is waited for up to BUSY_HEAD_GRACE (or the grace, if longer)."""

    def __init__(self, gcs: GcsClient, grace: float, now: float):
        self.gcs, self.grace = gcs, grace
        self.busy_bound = max(grace, BUSY_HEAD_GRACE)
        self.answered_at = now
        self._reach: Reach | None = None  # the last try of the port in this silence
        self._tried_at = 0.0
        self._unanswered_tries = 0
        self._busy_said = False

    def answered(self, now: float) -> None:
        self.answered_at, self._reach, self._unanswered_tries = now, None, 0
        self._busy_said = False

    def failed(self, error: GcsUnavailable, now: float) -> str | None:
        """Why the head counts as gone after this failed call, or None while it may answer."""
        silent = now - self.answered_at
        if silent < self.grace:
            return None
        if isinstance(error, GcsAuthRefused):
            return f"has refused this pod's token for {silent:.1f} s (grace {self.grace:g} s)"
        if isinstance(error, GcsLate) and self._port_open(now):
            if silent < self.busy_bound:
                return None
            return (f"has let every call pass its deadline for {silent:.1f} s while its port "
                    f"took connections (a busy head is waited for {self.busy_bound:g} s)")
        if self._reach is Reach.SILENT and self._unanswered_tries < 2 and isinstance(
                error, GcsLate):
            return None  # one unanswered try: tried again on the next failed call
        return f"has been unreachable for {silent:.1f} s (grace {self.grace:g} s)"

    def busy_note(self, now: float) -> str | None:
        """Once per silence, when the head is first found busy: the line that says so."""
        if self._reach is not Reach.ACCEPTS or self._busy_said:
            return None
        self._busy_said = True
        return (f"has not answered for {now - self.answered_at:.1f} s but its port "
                f"takes connections (a loaded or frozen pod): waiting for it up to "
                f"{self.busy_bound:g} s")

    def _port_open(self, now: float) -> bool:
        due = self._reach is not Reach.ACCEPTS or now - self._tried_at >= PROBE_EVERY
        if due:
            self._reach, self._tried_at = self.gcs.reach(), now
            self._unanswered_tries = self._unanswered_tries + 1 if (
                self._reach is Reach.SILENT) else 0
        return self._reach is Reach.ACCEPTS


class RunOver(EndRequested):
    """The head says the run is over: this pod was away when it closed it (its container being
    started again). Leaving is the orderly end, and the pod does what the head asked."""

    def __init__(self, over: beacon.Over):
        self.over = over
        super().__init__("left", f"the head says run {over.run} is over ({over.outcome}, "
                                 f"exit {over.code}); leaving")


class _HeadWentAway(Exception):
    """The head stopped answering: while this pod was joining, or once joined (past grace)."""


class _HeadClosing(Exception):
    """The head announced its end while this pod was still joining (its `ray start` slow: the
    head counts a node once its raylet registers, and waits only so long for it to leave)."""

    def __init__(self, closing: dict):
        super().__init__("the head is closing the run")
        self.closing = closing


@dataclass(frozen=True)
class FoundHead:
    """What FINDING_HEAD finds: where the head is, and a client of its Ray's GCS."""
    where: HeadLocation
    gcs: GcsClient


class Worker(Lifecycle[WorkerState]):
    """The worker's lifecycle: find the head, join its Ray, watch it, rejoin a returning
    head, and leave when the run is over."""

    FIRST, LAST, SUCCESS = WorkerState.FINDING_HEAD, WorkerState.LEFT, "left"

    def __init__(self, settings: Settings, decision: RoleDecision, reporter: Reporter,
                 signals: Signals):
        # Every wait also looks at the run's deadline: a head gone for good is not looked for
        # past it (its grace and cap.WORKER_LATE given to the head's own end of the run).
        super().__init__(settings, decision, reporter,
                         WatchedSignals(signals, lambda: cap.check_late(settings)))
        self.finder = self._finder()
        self._found: FoundHead | None = None  # from FINDING_HEAD on
        self.setup: node.NodeSetup | None = None  # from PREPARING on
        self._after_run: AfterRun | None = None  # what the head's closing announcement asked
        # The head's start this pod joined (runstate.KV_HEAD_START): another one at the same
        # address is a new Ray, which knows nothing of this pod's.
        self._head_start: bytes | None = None
        self._join_silence: HeadSilence | None = None
        self._join_progress = 0.0
        self._raylet_rejoins = 0

    def _finder(self) -> HeadFinder:
        self._next_over_ask = 0.0
        return HeadFinder(self.settings, self.reporter, self.signals, self._ask_over,
                          runstate.head_closing)

    def _ask_over(self, ip: str) -> None:
        """The head's Ray is silent: a head whose run is over says so on its supervisor port
        (beacon), and then this worker has nothing to wait for."""
        now = time.monotonic()
        if now < self._next_over_ask:
            return
        self._next_over_ask = now + OVER_ASK_EVERY
        settings = self.settings
        # Briefly: a head cut off answers nothing, and this runs between the GCS's probes.
        over = beacon.ask(ip, settings.supervisor_port, settings.run_name, settings.auth_token,
                          timeout=OVER_ASK_TIMEOUT)
        if over is not None:
            self._after_run = over.heard(self.reporter, ip, settings.after_run)
            raise RunOver(over)

    @property
    def found(self) -> FoundHead:
        if self._found is None:
            raise RuntimeError(f"state {self.state.value}: no head found yet")
        return self._found

    def handlers(self) -> dict[WorkerState, Callable[[], WorkerState]]:
        return {
            WorkerState.FINDING_HEAD: self._find_head,
            WorkerState.PREPARING: self._prepare,
            WorkerState.CLEANING: self._clean,
            WorkerState.JOINING: self._join,
            WorkerState.WATCHING: self._watch,
        }

    def _find_head(self) -> WorkerState:
        if self._found is not None:  # finding it again: a fresh deadline, the DNS name anew
            self._found.gcs.close()
            self._found = None
            self.finder = self._finder()
        self._head_start = None
        # At once, not after the wait for a head: a pod with someone else's Ray is refused.
        node.refuse_foreign_ray(self.settings)
        with self.reporter.step(Event.HEAD_FOUND) as step:
            found = self.finder.locate()
            self.reporter.say(f"head is {', '.join(found.candidates)} (from {found.how}); "
                              f"waiting for its Ray to answer")
            where, gcs = self.finder.wait_for_gcs(found)
            self._found = FoundHead(where, gcs)
            self._check_same_ray(where.ip, self.finder.head_ray_version)
            step.done(f"head's Ray answers at {where.ip}:{self.settings.ray_port}",
                      head=where.ip, how=where.how)
        return WorkerState.PREPARING

    def _read_head_start(self) -> bytes | None:
        try:
            return self.found.gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_HEAD_START,
                                   timeout=WATCH_INTERVAL)
        except GcsUnavailable:
            return None  # watched next: the first id seen then

    def _check_same_ray(self, head_ip: str, head_version: str) -> None:
        """Ray needs one version on every node and in the job: refuse a head of another Ray
        here, in one line, instead of a `ray start` that fails obscurely or a job that breaks."""
        ours = ray_compat.installed()
        if head_version and ours and head_version != ours.version:
            raise RayVersionMismatch(
                f"the head {head_ip} runs Ray {head_version} and "
                f"this pod has Ray {ours.version}: Ray needs the same version on every node "
                f"and in the job; start every pod from the same image")

    def _prepare(self) -> WorkerState:
        self.setup = node.prepare(self.settings, Role.WORKER, self.reporter,
                                  head_ip=self.found.where.ip)
        pod_setup.check_gpus(self.settings, self.reporter, self.signals, self.setup.nccl)
        node.raise_limits(self.settings, Role.WORKER, self.reporter)
        return WorkerState.CLEANING

    def _clean(self) -> WorkerState:
        node.clean_stale_ray(self.settings, self.reporter)
        return WorkerState.JOINING

    def _join(self) -> WorkerState:
        """`ray start --address`; a failed start is retried until the head-wait deadline.

        Seen on loaded machines: "The current node timed out during startup" from one attempt,
        success on the next.
        """
        setup, head, settings = self.setup, self.found.where, self.settings
        if setup is None:
            raise RuntimeError("JOINING before PREPARING")
        remaining = max(1.0, self.finder.deadline - time.monotonic())
        failed: list[str] = []  # each failed attempt's last line

        def attempt() -> None:
            self._join_progress = 0.0  # each attempt's elapsed time starts again at 0
            try:
                ray_node.RayNode(setup.plan, settings.run_dir / "ray-start-worker.log",
                                 min(JOIN_ATTEMPT_TIMEOUT, remaining)).start(self._watch_join)
            except RayStartError as exc:
                failed.append(str(exc).strip().splitlines()[-1] if str(exc).strip() else "?")
                self.reporter.warn(f"joining failed (attempt {len(failed)}): {failed[-1]}; "
                                   f"cleaning up and retrying")
                ray_node.RayNode.stop(settings.stop_timeout)
                raise

        self._join_silence = HeadSilence(self.found.gcs, JOIN_HEAD_GRACE, time.monotonic())
        try:  # outside the step: a join given up on is recorded as one that failed, and why
            with self.reporter.step(Event.JOINED) as step:
                retry(attempt, awaited=f"this pod to join the head's Ray at {head.ip}",
                      backoff=Backoff(0.5, 5.0), deadline=remaining, sleep=self.signals.sleep,
                      on=(RayStartError,), expired=lambda _: HeadUnreachable(
                          f"could not join the head's Ray at {head.ip}:{settings.ray_port} in "
                          f"{len(failed)} attempt(s) within {settings.head_timeout:g} s; "
                          f"last error: {failed[-1]}"))
                # The head's start this pod's Ray joined: another one later is a new Ray.
                self._head_start = self._read_head_start()
                step.done(f"joined the cluster at {head.ip}:{settings.ray_port} as "
                          f"{setup.node_ip} ({setup.gpus} GPUs)",
                          node_ip=setup.node_ip, gpus=setup.gpus, attempts=len(failed) + 1)
        except _HeadWentAway as gone:
            return self._rejoin(f"{gone} while this pod was joining: stopped the attempt")
        except _HeadClosing as closing:
            return self._on_closing(closing.closing, while_joining=True)
        return WorkerState.WATCHING

    def _watch_join(self, elapsed: float) -> None:
        """Called every second while `ray start --address` runs: a signal, a head that went
        away, or a long join is acted on now, not after the attempt's two minutes."""
        head = self.found
        self.signals.check()
        if elapsed - self._join_progress >= JOIN_PROGRESS_EVERY:
            self._join_progress = elapsed
            self.reporter.say(f"still joining the head at {head.where.ip}:"
                              f"{self.settings.ray_port} ({elapsed:.0f} s)")
        silence = self._join_silence
        assert silence is not None  # made by _join before `ray start`
        try:
            head.gcs.check_alive(timeout=1.0)
            silence.answered(time.monotonic())
            state = head.gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_RUN_STATE, timeout=1.0)
        except GcsUnavailable as exc:
            gone = silence.failed(exc, time.monotonic())
            if gone:
                raise _HeadWentAway(f"the head {head.where.ip} stopped answering (it {gone}: "
                                    f"{exc})") from None
            busy = silence.busy_note(time.monotonic())
            if busy:
                self.reporter.warn(f"the head {head.where.ip} {busy}")
            return
        if state:
            raise _HeadClosing(runstate.read_state(state))

    def _rejoin(self, why: str) -> WorkerState:
        """Stop this pod's Ray and find the head again, or (PODAGENT_REJOIN=0) leave."""
        if not self.settings.rejoin:
            raise HeadLost(f"{why} (PODAGENT_REJOIN=0: not waiting for it)")
        ray_node.RayNode.stop(ray_node.stop_timeout(self.settings, gcs_gone=True))
        self.reporter.warn(f"{why}; this pod's Ray is stopped and podagent waits for the head "
                           f"again (up to {self.settings.head_timeout:g} s)")
        self.reporter.event(Event.REJOINING, reason=why)
        return WorkerState.FINDING_HEAD

    def _watch(self) -> WorkerState:
        """Stay in the foreground; leave when the head closes the run or is gone too long."""
        gcs, head_ip = self.found.gcs, self.found.where.ip
        silence = HeadSilence(gcs, self.settings.head_grace, time.monotonic())
        self.reporter.say(f"watching the head (leaving if unreachable for "
                          f"{self.settings.head_grace:g} s, or busy for {silence.busy_bound:g} s)")
        last_error = ""
        # Found once, then checked by pid: a full process-table scan every second costs more
        # CPU than everything else the idle worker does.
        raylet = ray_node.RayNode.find_raylet()
        dumped: int | None = None  # the hang whose stacks this pod gave (None: not read yet)
        while True:
            self.signals.sleep(WATCH_INTERVAL)
            process.reap_orphans()
            try:
                state = gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_RUN_STATE,
                                   timeout=WATCH_INTERVAL)
                start = gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_HEAD_START,
                                   timeout=WATCH_INTERVAL)
                asked = runstate.parse_dump_request(gcs.kv_get(
                    runstate.KV_NAMESPACE, runstate.KV_DUMP, timeout=WATCH_INTERVAL))
            except GcsUnavailable as exc:
                last_error = str(exc)
                gone = silence.failed(exc, time.monotonic())
                if gone:
                    return self._rejoin(f"the head {head_ip}:{self.settings.ray_port} {gone}: "
                                        f"{last_error}")
                busy = silence.busy_note(time.monotonic())
                if busy:
                    self.reporter.warn(f"the head {head_ip} {busy}")
                continue
            if last_error:
                self.reporter.say(f"head reachable again after "
                                  f"{time.monotonic() - silence.answered_at:.1f} s")
                last_error = ""
            silence.answered(time.monotonic())
            if self._head_start is None:
                self._head_start = start  # joined before the head wrote it: the first seen
            elif start != self._head_start:
                return self._rejoin(f"the head {head_ip} answers with a new Ray (its pod "
                                    f"was started again): this pod's Ray belongs to the "
                                    f"earlier one")
            if state:
                return self._on_closing(runstate.read_state(state))
            if dumped is None:
                dumped = asked or 0  # a request from before this pod watched is not for it
            elif asked and asked > dumped:
                dumped = asked
                hang.answer(self.settings, gcs, self.setup.node_ip, asked,
                            self.reporter)
            if raylet is None or not ray_node.RayNode.running(raylet):
                return self._raylet_exited()

    def _raylet_exited(self) -> WorkerState:
        """This pod's raylet is gone while the head answers: the head's GCS marked the node
        dead (a pod frozen past Ray's health checks), or the raylet crashed. The head still
        counts on this pod, while it waits for its workers as after a loss in the job: join
        it again, as a container started again would, but without the container's restart."""
        said = ray_node.raylet_last_words(self.settings)
        why = "this pod's raylet exited" + (f" (its last error: {said})" if said else "")
        if not self.settings.rejoin:
            raise RayDied(f"{why}; PODAGENT_REJOIN=0: not joining again")
        if self._raylet_rejoins >= RAYLET_REJOINS:
            raise RayDied(f"{why}, after {RAYLET_REJOINS} joins again since the first; "
                          f"see Ray's logs in {ray_node.temp_dir(self.settings)}")
        self._raylet_rejoins += 1
        return self._rejoin(f"{why} (rejoin {self._raylet_rejoins} of at most "
                            f"{RAYLET_REJOINS})")

    def _on_closing(self, closing: dict, while_joining: bool = False) -> WorkerState:
        what = (f"{closing.get('outcome')}, job {closing.get('job_status')}"
                if "outcome" in closing else "its announcement unreadable")
        if while_joining:
            what += "; this pod was still joining: stopped the attempt"
        asked = closing.get("after_run") or AfterRun.EXIT.value
        if asked == runstate.REJOIN and self.settings.rejoin:
            return self._rejoin(f"the head closed this start of the run ({what}) and will be "
                                f"back")
        try:
            self._after_run = AfterRun(asked)
        except ValueError:  # REJOIN refused by PODAGENT_REJOIN, or a head newer than this pod
            self._after_run = AfterRun.EXIT
        self.reporter.say(f"the head is closing the run ({what}); leaving")
        return WorkerState.LEFT

    def after_run(self) -> AfterRun | None:
        return self._after_run

    def _teardown(self, outcome: str) -> None:
        if self._found:
            self._found.gcs.close()
        ray_node.stop_at_teardown(self.settings, self.reporter, self._deadline, outcome,
                                  gcs_gone=outcome == HeadLost.__name__)
        self.reporter.say(f"worker done: {outcome} after {time.monotonic() - self.started:.1f} s")

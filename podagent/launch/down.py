"""Finding a run's pods at RunPod and terminating all of them: by the local record's ids, by
their names and by their label, so that a pod created just before this machine crashed (its
id never recorded) is found too. Shared by `podagent down`, `podagent ls` and `up`'s own
clean-up.

Terminating goes in rounds until RunPod lists nothing of the run: a create that was still on
its way when the first round looked (its answer lost, or a parallel create) is found and
terminated by a later one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podagent.errors import RunPodApiError
from podagent.launch import spec as names
from podagent.launch.state import DOWN, RunRecord
from podagent.platform.runpod_api import BILLING_STATUSES, Client
from podagent.waiting import Backoff, Expired, NotYet, retry

GONE_TIMEOUT = 120.0  # terminated pods are gone from RunPod's list within this
GONE_POLL = Backoff(0.5, 2.0)  # a first look soon after the terminate, then every 2 s
AGAIN_EVERY = 10  # rounds: pods still listed this long after their terminate get another
PARALLEL = 8  # terminates asked at once


@dataclass(frozen=True)
class Found:
    pods: list[dict[str, Any]]  # every pod of the run RunPod lists (cluster members too)
    clusters: list[dict[str, Any]]

    @property
    def billing(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if p.get("status") in BILLING_STATUSES]

    def __bool__(self) -> bool:
        return bool(self.live_by_name())

    def live_names(self) -> set[str]:
        return set(self.live_by_name())

    def live_by_name(self) -> dict[str, set[str]]:
        """name -> ids of the live pods, and of the clusters, of that name (a create sent
        twice may make two)."""
        by_name: dict[str, set[str]] = {}
        live = [p for p in self.pods if p.get("status") != "TERMINATED"]
        for item in (*live, *self.clusters):
            by_name.setdefault(str(item.get("name")), set()).add(str(item.get("id")))
        return by_name


def find(client: Client, run: str, record: RunRecord | None) -> Found:
    pod_ids = set(record.ids("pod")) if record else set()
    cluster_ids = set(record.ids("cluster")) if record else set()
    pods = [p for p in client.list_pods(include_cluster_pods=True)
            if p.get("id") in pod_ids or names.belongs(p, run)]
    cluster_ids |= {str(p["cluster"]["id"]) for p in pods
                    if isinstance(p.get("cluster"), dict) and p["cluster"].get("id")}
    clusters = [c for c in client.list_clusters()
                if c.get("id") in cluster_ids or c.get("name") == names.cluster_name(run)]
    # A cluster its own live pods name, that RunPod does not list (yet, or any more): deleted
    # all the same (its members refuse a delete of their own); one already gone answers 404.
    listed = {str(c.get("id")) for c in clusters}
    clusters += [{"id": cid, "name": names.cluster_name(run)} for cid in sorted(
        {str(p["cluster"]["id"]) for p in pods if p.get("status") != "TERMINATED"
         and isinstance(p.get("cluster"), dict) and p["cluster"].get("id")} - listed)]
    return Found(pods, clusters)


@dataclass
class Sweep:
    """What a termination saw, for when it fails: the run's pods as RunPod last listed them
    (None: it never answered the list), and those whose terminate (or cluster's delete) it
    accepted."""

    listed: list[dict[str, Any]] | None = None
    accepted: set[str] = field(default_factory=set)
    # name -> ids of the run's live pods and clusters it saw (seen once, known to exist: a
    # terminated pod leaves the list, and the create that made it can make no other)
    landed: dict[str, set[str]] = field(default_factory=dict)
    # The caller's --timeout ended the look while a create whose answer never came may still
    # make a pod (its pod was not seen meanwhile).
    cut_short: bool = False
    # When RunPod first listed none of the run's pods (wall time): their billing ended then,
    # whatever the look for a create still landing waited after it.
    gone_at: float | None = None

    def saw(self, found: Found) -> None:
        for name, ids in found.live_by_name().items():
            self.landed.setdefault(name, set()).update(ids)

    def left(self) -> list[str] | None:
        """'name (id)' of each pod RunPod last listed (those whose terminate it accepted but
        still listed said so); None when it never listed them."""
        if self.listed is None:
            return None
        return [f"{p.get('name')} ({p.get('id')}"
                + (", terminate accepted)" if str(p.get("id")) in self.accepted else ")")
                for p in self.listed if p.get("status") != "TERMINATED"]


def _terminate_found(client: Client, found: Found, sweep: Sweep) -> int:
    """One round: every cluster deleted, every pod outside them terminated; how many pods.
    Each is asked whatever became of the others, at once (a RunPod that does not answer
    costs one call's time, not one per pod): one pod RunPod refused must not leave the rest
    billing. The first refusal is raised once all were asked."""
    in_cluster = {str(c["id"]) for c in found.clusters}
    live = [p for p in found.pods if p.get("status") != "TERMINATED"]
    asks: list[tuple[Callable[[], Any], set[str]]] = []
    for cluster in found.clusters:
        members = {str(p.get("id")) for p in found.pods
                   if str((p.get("cluster") or {}).get("id")) == str(cluster["id"])}
        asks.append((lambda c=str(cluster["id"]): client.delete_cluster(c), members))
    for pod in live:
        member = pod.get("cluster")
        if isinstance(member, dict) and str(member.get("id")) in in_cluster:
            continue  # goes with its cluster (RunPod refuses a member's own delete)
        asks.append((lambda i=str(pod["id"]): client.terminate_pod(i), {str(pod["id"])}))
    failures: list[BaseException] = []
    lock = threading.Lock()
    pending = list(asks)

    def asker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                ask, ids = pending.pop(0)
            try:
                ask()
            except Exception as exc:
                with lock:
                    failures.append(exc)
            else:
                with lock:
                    sweep.accepted.update(ids)

    # Threads of their own, not a pool's: a second signal (Leave) ends the command at once,
    # and no exit waits for terminates still being retried.
    threads = [threading.Thread(target=asker, name="terminate", daemon=True)
               for _ in range(min(len(asks), PARALLEL))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return len(live)


def terminate_one(client: Client, pod_id: str, timeout: float,
                  say: Callable[[str], None]) -> None:
    """One pod terminated (a lost pod before its replacement is created: a stopped pod's
    disk still bills), and awaited until RunPod lists it live no more, within `timeout`, so
    that it bills no longer. Still listed then: said, and the run's clean-up terminates it
    by its label (the replacement's create never takes it for its own: `not_these`)."""
    client.terminate_pod(pod_id)

    def gone() -> bool:
        pod = client.get_pod(pod_id)
        if pod is not None and pod.get("status") != "TERMINATED":
            raise NotYet(f"pod {pod_id} is {pod.get('status')}")
        return True

    try:
        retry(gone, awaited=f"the lost pod {pod_id} to leave RunPod's list", backoff=GONE_POLL,
              deadline=timeout)
    except Expired as exc:
        say(f"{exc}; creating its replacement all the same (the run's end terminates it)")


def _terminate_known(client: Client, record: RunRecord | None, sweep: Sweep) -> None:
    """Every pod and cluster the record has an id of, asked to go without a list (RunPod's
    list failed): what it refuses is found by the rounds after, or said by the caller."""
    if record is None:
        return
    pods = [{"id": i, "status": "?"} for i in record.ids("pod")]
    clusters = [{"id": i} for i in record.ids("cluster")]
    with contextlib.suppress(RunPodApiError):
        _terminate_found(client, Found(pods, clusters), sweep)


def terminate(client: Client, run: str, record: RunRecord | None,
              say: Callable[[str], None], timeout: float = GONE_TIMEOUT,
              sweep: Sweep | None = None, landing_time: float = 0.0,
              landing_cut: bool = False) -> int:
    """Terminate every pod and cluster of the run, in rounds, until RunPod lists none of them
    (and, while the record holds a create whose answer never came, not before `landing_time`
    seconds: such a pod may still appear; `landing_cut`: one may still appear after that, so
    the end claims nothing and the record is not marked down; `sweep.cut_short` says whether
    that still held at the end). Returns how many pods there were. Raises
    RunPodApiError when some may still be there (`sweep`, if given, then says which)."""
    sweep = sweep if sweep is not None else Sweep()
    started = time.monotonic()
    seen: set[str] = set()
    first = True
    rounds = 0
    # A create whose answer never came (cut off by a signal, or timed out) may still make a
    # pod: while one may, an empty list is not the end, until `landing` has passed, or until
    # every such create's pod was listed (a create makes one pod: it has landed; a create
    # sent twice may make two).

    def unlanded() -> set[str]:
        return record.unlanded(sweep.landed) if record is not None else set()

    landing = started + (landing_time if unlanded() else 0.0)
    waited_landing: list[bool] = []

    def round_() -> Found:
        nonlocal first, rounds
        rounds += 1
        try:
            found = find(client, run, record)
        except RunPodApiError:
            if first:  # no list, but the ids this machine knows are asked for all the same
                first = False
                _terminate_known(client, record, sweep)
            raise
        sweep.listed = found.pods
        sweep.saw(found)
        if found:  # (a list that left them out a moment ago was not their end)
            sweep.gone_at = None
        elif sweep.gone_at is None:
            sweep.gone_at = time.time()
        new = {str(p["id"]) for p in found.pods if p.get("status") != "TERMINATED"} - seen
        # Again now and then for what is still listed: a terminate RunPod lost is sent anew.
        if found and (first or new or rounds % AGAIN_EVERY == 0):
            count = _terminate_found(client, found, sweep)
            seen.update(new)
            if first and (count or found.clusters):
                say(f"terminating {count} pod(s) of run {run}"
                    + (f" ({len(found.clusters)} cluster)" if found.clusters else ""))
            first = False
            raise NotYet("terminated; not gone yet")
        if not found and time.monotonic() < landing and unlanded():
            if not waited_landing:
                waited_landing.append(True)
                say(f"a create of run {run} may still make a pod (its answer was lost, or "
                    f"was an error RunPod may have acted on): looking for it for "
                    f"{landing - time.monotonic():.0f} s more")
            raise NotYet("a create whose answer never came may still make a pod")
        return found

    try:
        retry(round_, awaited=f"run {run}'s pods to be gone", backoff=GONE_POLL,
              deadline=timeout, until=lambda left: not left)
    except Expired as exc:
        left = exc.last if isinstance(exc.last, Found) else find(client, run, record)
    else:
        left = Found([], [])
    # A last look that lists nothing, once no unanswered create can land any more, is the end
    # the rounds were waiting for (their calls took the time: a slow RunPod, a short timeout).
    if left or (time.monotonic() < landing and unlanded()):
        listed = ", ".join(f"{p.get('name')} ({p.get('id')}: {p.get('status')})"
                           for p in left.pods) or ", ".join(str(c.get("name"))
                                                            for c in left.clusters)
        raise RunPodApiError(f"run {run}: still at RunPod {timeout:g} s after termination: "
                             f"{listed or 'unknown'}; run `podagent down {run}` again"
                             ) from None
    # What the record knows and no round asked for (RunPod's list left it out): asked by its
    # id all the same; one that was there after all is said, and counted.
    unasked = [i for i in (record.ids("pod") if record else []) if i not in sweep.accepted]
    for pod_id in unasked:
        if client.terminate_pod(pod_id):
            sweep.accepted.add(pod_id)
            sweep.gone_at = time.time()  # it billed until now
            seen.add(pod_id)
            say(f"pod {pod_id} of run {run} was not in RunPod's list but was there: "
                f"terminated")
    # Cut short by the caller's --timeout, unless every such create's pod was seen after all.
    landing_cut = sweep.cut_short = landing_cut and bool(unlanded())
    if seen:
        say(f"terminated {len(seen)} pod(s) of run {run} in "
            f"{time.monotonic() - started:.1f} s"
            + ("" if landing_cut else ": nothing of it is billing"))
    if record is not None and not landing_cut:
        record.try_mark(DOWN)
    return len(seen)

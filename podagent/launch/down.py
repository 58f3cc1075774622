"""Finding a run's pods at RunPod and terminating all of them: by the local record's ids, by
their names and by their label, so that a pod created just before this machine crashed (its
id never recorded) is found too. Shared by `podagent down`, `podagent ls` and `up`'s own
clean-up.

Terminating goes in rounds until RunPod lists nothing of the run: a create that was still on
its way when the first round looked (its answer lost, or a parallel create) is found and
terminated by a later one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
        return bool(self.clusters) or any(p.get("status") != "TERMINATED" for p in self.pods)


def find(client: Client, run: str, record: RunRecord | None) -> Found:
    pod_ids = set(record.ids("pod")) if record else set()
    cluster_ids = set(record.ids("cluster")) if record else set()
    pods = [p for p in client.list_pods(include_cluster_pods=True)
            if p.get("id") in pod_ids or names.belongs(p, run)]
    cluster_ids |= {str(p["cluster"]["id"]) for p in pods
                    if isinstance(p.get("cluster"), dict) and p["cluster"].get("id")}
    clusters = [c for c in client.list_clusters()
                if c.get("id") in cluster_ids or c.get("name") == names.cluster_name(run)]
    return Found(pods, clusters)


@dataclass
class Sweep:
    """What a termination saw, for when it fails: the run's pods as RunPod last listed them
    (None: it never answered the list), and those whose terminate (or cluster's delete) it
    accepted."""

    listed: list[dict[str, Any]] | None = None
    accepted: set[str] = field(default_factory=set)

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
    if asks:
        with ThreadPoolExecutor(max_workers=min(len(asks), PARALLEL),
                                thread_name_prefix="terminate") as pool:
            futures = [(pool.submit(ask), ids) for ask, ids in asks]
        for future, ids in futures:
            failure = future.exception()
            if failure is None:
                sweep.accepted |= ids
            else:
                failures.append(failure)
    if failures:
        raise failures[0]
    return len(live)


def terminate(client: Client, run: str, record: RunRecord | None,
              say: Callable[[str], None], timeout: float = GONE_TIMEOUT,
              sweep: Sweep | None = None) -> int:
    """Terminate every pod and cluster of the run, in rounds, until RunPod lists none of them.
    Returns how many pods there were. Raises RunPodApiError when some may still be there
    (`sweep`, if given, then says which)."""
    sweep = sweep if sweep is not None else Sweep()
    started = time.monotonic()
    seen: set[str] = set()
    first = True
    rounds = 0

    def round_() -> Found:
        nonlocal first, rounds
        rounds += 1
        found = find(client, run, record)
        sweep.listed = found.pods
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
        return found

    try:
        retry(round_, awaited=f"run {run}'s pods to be gone", backoff=GONE_POLL,
              deadline=timeout, until=lambda left: not left)
    except Expired as exc:
        left = exc.last if isinstance(exc.last, Found) else find(client, run, record)
        listed = ", ".join(f"{p.get('name')} ({p.get('id')}: {p.get('status')})"
                           for p in left.pods) or ", ".join(str(c.get("name"))
                                                            for c in left.clusters)
        raise RunPodApiError(f"run {run}: still at RunPod {timeout:g} s after termination: "
                             f"{listed or 'unknown'}; run `podagent down {run}` again"
                             ) from None
    if seen:
        say(f"terminated {len(seen)} pod(s) of run {run} in "
            f"{time.monotonic() - started:.1f} s: nothing of it is billing")
    if record is not None:
        record.try_mark(DOWN)
    return len(seen)

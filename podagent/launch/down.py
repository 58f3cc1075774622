"""Finding a run's pods at RunPod and terminating all of them: by the local record's ids, by
their names and by their label, so that a pod created just before this machine crashed (its
id never recorded) is found too. Shared by `podagent down`, `podagent ls` and `up`'s own
clean-up."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from podagent.errors import RunPodApiError
from podagent.launch import spec as names
from podagent.launch.state import DOWN, RunRecord
from podagent.platform.runpod_api import BILLING_STATUSES, Client
from podagent.waiting import Backoff, Expired, retry

GONE_TIMEOUT = 120.0  # terminated pods are gone from RunPod's list within this
GONE_POLL = 2.0


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
    cluster_ids |= {str(p["cluster"]["id"]) for p in pods if p.get("cluster")}
    clusters = [c for c in client.list_clusters()
                if c.get("id") in cluster_ids or c.get("name") == names.cluster_name(run)]
    return Found(pods, clusters)


def terminate(client: Client, run: str, record: RunRecord | None,
              say: Callable[[str], None], timeout: float = GONE_TIMEOUT) -> int:
    """Terminate every pod and cluster of the run and wait until RunPod lists none of them.
    Returns how many pods there were. Raises RunPodApiError when some are still there."""
    found = find(client, run, record)
    in_cluster = {str(c["id"]) for c in found.clusters}
    for cluster in found.clusters:
        client.delete_cluster(str(cluster["id"]))
    count = len([p for p in found.pods if p.get("status") != "TERMINATED"])
    for pod in found.pods:
        member = pod.get("cluster")
        if member and str(member.get("id")) in in_cluster:
            continue  # went with its cluster (RunPod refuses a member's own delete)
        if pod.get("status") != "TERMINATED":
            client.terminate_pod(str(pod["id"]))
    if count or found.clusters:
        say(f"terminating {count} pod(s) of run {run}"
            + (f" ({len(found.clusters)} cluster)" if found.clusters else ""))
    started = time.monotonic()
    left = _wait_gone(client, run, record, timeout)
    if left:
        listed = ", ".join(f"{p.get('name')} ({p.get('id')}: {p.get('status')})"
                           for p in left.pods) or ", ".join(str(c.get("name"))
                                                            for c in left.clusters)
        raise RunPodApiError(f"run {run}: still at RunPod {timeout:g} s after termination: "
                             f"{listed}; run `podagent down {run}` again")
    if count:
        say(f"terminated {count} pod(s) of run {run} in {time.monotonic() - started:.1f} s: "
            f"nothing of it is billing")
    if record is not None:
        record.mark(DOWN)
    return count


def _wait_gone(client: Client, run: str, record: RunRecord | None, timeout: float) -> Found:
    """What of the run RunPod still lists once it lists nothing, or when `timeout` ran out."""
    try:
        return retry(lambda: find(client, run, record), awaited=f"run {run}'s pods to be gone",
                     backoff=Backoff.every(GONE_POLL), deadline=timeout,
                     until=lambda left: not left)
    except Expired as exc:
        return exc.last

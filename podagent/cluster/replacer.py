"""A detached `podagent up` run's head replaces a worker pod RunPod lost, as `up` does when it
follows the run: given the account key (PODAGENT_RUNPOD_API_KEY, a RunPod secret) and a budget
(PODAGENT_REPLACEMENTS, which `up --detach` sets), the head terminates the lost pod (a stopped
pod's disk still bills) and creates one of the same spec under its name; the census takes it
in place of the lost one and the job resumes from its checkpoint.

Which pods are the run's and what each was created with come from RunPod's own list (the
pods carry the run's label, PODAGENT_UP_RUN, and v2's Pod holds what a create takes: image,
GPU, env with its secret references, mounts, data center). They are remembered once the
workers have joined, so that a pod terminated from outside, no longer listed, can still be
made again. Replacements are counted in the run's ledger: a restarted head does not spend
the budget twice.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from podagent.config import Settings
from podagent.config.fields import FIELD_BY_ATTR
from podagent.config.names import UP_RUN_LABEL
from podagent.config.policy import RUNPOD_ACCOUNT_KEY, runpod_key
from podagent.errors import PodagentError
from podagent.platform import runpod_api
from podagent.report import Reporter
from podagent.run.ledger import Ledger, record_or_warn
from podagent.wire import Event

LOOK_EVERY = 10.0  # seconds between looks at RunPod's list while the cluster is not whole
# RunPod's list may show a pod later than its create's answer: a pod the head made is not
# lost for not being listed this long; a create whose answer was lost is looked for as long.
LISTED_WITHIN = 120.0
SETTLE_WITHIN = 120.0
LOST_STATUSES = ("EXITED", "ERROR", "TERMINATED")  # and no longer listed
# What a create takes of a listed Pod (v2: Pod is ContainerConfig and more; CreatePodRequest
# is ContainerConfig and these).
_CONTAINER = ("image", "args", "disk", "env", "ports", "registry", "cloud", "mounts")
TRIES = 3  # creates of one replacement RunPod refuses before the head gives up on it
REPLACEMENTS_VARIABLE = FIELD_BY_ATTR["replacements"].env


def create_body(pod: Mapping[str, Any]) -> dict[str, Any]:
    """CreatePodRequest for a pod of the same spec as `pod` (as RunPod lists it), in its data
    center (its network volume is there). Never the account key or the replacing itself: a
    worker holds neither, and a body that did would make a second head."""
    body: dict[str, Any] = {"name": str(pod["name"])}
    for key in _CONTAINER:
        if pod.get(key) not in (None, "", [], {}):
            body[key] = pod[key]
    env = body.get("env")
    if not isinstance(env, Mapping):
        raise ValueError(f"pod {pod.get('id')}'s env is not an object")
    body["env"] = {str(k): str(v) for k, v in env.items()
                   if k not in (RUNPOD_ACCOUNT_KEY, REPLACEMENTS_VARIABLE)}
    gpu = pod.get("gpu")
    if isinstance(gpu, Mapping) and gpu.get("id"):
        body["gpu"] = {"id": str(gpu["id"]), "count": int(gpu.get("count") or 1)}
    if pod.get("dataCenterId"):
        body["dataCenterIds"] = [str(pod["dataCenterId"])]
    networking = pod.get("globalNetworking")  # a Pod's: {enabled, ip, internalDns}
    if isinstance(networking, Mapping):
        networking = networking.get("enabled")
    if isinstance(networking, bool):
        body["globalNetworking"] = networking
    return body


@dataclass
class Worker:
    """One worker of the run as the head knows it: what it was created with, its pod now."""
    name: str
    body: dict[str, Any]
    pod_id: str | None  # None: a create whose outcome is not known yet
    since: float = 0.0  # monotonic: when the head created it, or its create went out
    refused: int = 0  # creates RunPod refused


def _ours(pod: Mapping[str, Any], run: str, own_id: str) -> bool:
    """A live worker of this head's run: the run's label, a worker's role, this head's id (a
    stranger's pod with the label, an earlier head, a terminated pod are not)."""
    env = pod.get("env")
    return (isinstance(env, Mapping) and env.get(UP_RUN_LABEL) == run
            and env.get("RAY_WORKER") == "1" and env.get("HEAD_POD_ID") == own_id
            and pod.get("status") != "TERMINATED" and str(pod.get("id", "")) != own_id
            and isinstance(pod.get("name"), str))


class PodReplacer:
    """The head's hand at RunPod for its lost workers (None where it has none: see `of`).
    Each worker is known by its name: a pod of the name that RunPod lists later than asked
    (its list lags a create) or a create whose answer was lost is found by it, never made
    twice."""

    def __init__(self, client: runpod_api.Client, run: str, own_id: str, budget: int,
                 ledger: Ledger, reporter: Reporter):
        self.client, self.run, self.own_id, self.budget = client, run, own_id, budget
        self.ledger, self.reporter = ledger, reporter
        self.workers: dict[str, Worker] = {}
        self._next_look = 0.0

    @classmethod
    def of(cls, settings: Settings, ledger: Ledger, reporter: Reporter) -> PodReplacer | None:
        """One for a head of an `up` run given replacements and the account key; else None
        (said when replacements were asked for without the key)."""
        run = settings.environ.get(UP_RUN_LABEL, "").strip()
        if settings.replacements == 0 or not run or not settings.pod_id:
            return None
        key = runpod_key(settings.environ, from_file=False, names=(RUNPOD_ACCOUNT_KEY,))
        if not key:
            reporter.warn(f"PODAGENT_REPLACEMENTS={settings.replacements} but no account key "
                          f"({RUNPOD_ACCOUNT_KEY}, a RunPod secret): a worker RunPod loses is "
                          f"not replaced")
            return None
        client = runpod_api.Client(key, settings.runpod_api_url, say=reporter.warn)
        return cls(client, run, settings.pod_id, settings.replacements, ledger, reporter)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The ledger's replacements (a damaged entry read as none)."""
        replaced = self.ledger.data.get("replaced")
        if not isinstance(replaced, list):
            replaced = self.ledger.data["replaced"] = []
        return replaced

    @property
    def used(self) -> int:
        """Creates that may have made a pod (RunPod's refusals are not counted)."""
        return len(self.records)

    def _lost_ids(self) -> set[str]:
        return {str(r.get("lost")) for r in self.records if isinstance(r, dict)}

    def remember(self) -> None:
        """The run's live workers as RunPod lists them now, and what each was created with
        (one pod at a time: a pod of nonsense costs its own line, not the others)."""
        try:
            pods = self.client.list_pods()
        except Exception as exc:  # RunPod's error, or an answer of nonsense
            self.reporter.warn(f"could not list the run's pods to replace a lost one later "
                               f"({exc})")
            return
        lost = self._lost_ids()
        for pod in pods if isinstance(pods, list) else []:
            try:
                if not isinstance(pod, Mapping) or not _ours(pod, self.run, self.own_id) \
                        or str(pod["id"]) in lost:
                    continue
                known = self.workers.get(pod["name"])
                if known is None:
                    self.workers[pod["name"]] = Worker(pod["name"], create_body(pod),
                                                       str(pod["id"]))
                elif known.pod_id is None:
                    known.pod_id = str(pod["id"])
            except (KeyError, TypeError, ValueError) as exc:
                self.reporter.warn(f"a pod RunPod listed could not be read ({exc}); skipped")

    def tick(self) -> None:
        """While the cluster is not whole: every LOOK_EVERY seconds, each worker that RunPod
        lists stopped or failed, or no longer lists (past a new pod's LISTED_WITHIN), is
        replaced within the budget; a create whose outcome was unknown is found by its name
        first (SETTLE_WITHIN), and made again only then."""
        now = time.monotonic()
        if now < self._next_look or not self.workers:
            return
        self._next_look = now + LOOK_EVERY
        try:
            pods = self.client.list_pods()
            by_id = {str(p["id"]): p for p in pods
                     if isinstance(p, Mapping) and _ours(p, self.run, self.own_id)}
        except Exception as exc:  # RunPod's error, or an answer of nonsense: look again
            self.reporter.warn(f"could not list the run's pods ({exc}); looking again in "
                               f"{LOOK_EVERY:g} s")
            return
        lost = self._lost_ids()
        for worker in list(self.workers.values()):
            listed = by_id.get(worker.pod_id or "")
            status = listed.get("status") if listed else None
            if listed is not None and status not in LOST_STATUSES:
                continue  # running, or on its way
            if worker.pod_id and listed is None and worker.since \
                    and now - worker.since < LISTED_WITHIN:
                continue  # a pod the head created that RunPod does not list yet
            named = [i for i, p in by_id.items() if p["name"] == worker.name
                     and i != worker.pod_id and i not in lost
                     and p.get("status") not in LOST_STATUSES]
            if named:  # a create that landed after all, or RunPod's list caught up
                if listed is not None:  # the lost one's disk still bills
                    self._terminate(worker.name, str(worker.pod_id))
                worker.pod_id, worker.since = named[0], now
                continue
            if worker.pod_id is None and now - worker.since < SETTLE_WITHIN:
                continue  # a create whose outcome is not known: looked for a while first
            self._replace(worker, status or ("its replacement never listed"
                                             if worker.pod_id is None else "no longer listed"),
                          now)

    def _terminate(self, name: str, pod_id: str) -> bool:
        try:
            self.client.terminate_pod(pod_id)
        except PodagentError as exc:  # its create waits: two pods of a name would bill
            self.reporter.warn(f"the lost pod {name} ({pod_id}) could not be terminated "
                               f"({exc}); trying again in {LOOK_EVERY:g} s")
            return False
        return True

    def _replace(self, worker: Worker, status: str, now: float) -> None:
        name, lost_id = worker.name, worker.pod_id
        if self.used >= self.budget:
            self.reporter.warn(f"pod {name} ({lost_id}) is {status} at RunPod and no "
                               f"replacement is left ({self.used} of PODAGENT_REPLACEMENTS="
                               f"{self.budget} used): the run waits for a worker as without "
                               f"replacements")
            del self.workers[name]
            return
        n = self.used + 1
        self.reporter.say(f"pod {name} ({lost_id}) is {status} at RunPod: replacing it "
                          f"(replacement {n} of {self.budget}, PODAGENT_REPLACEMENTS): the lost "
                          f"pod is terminated and one of the same spec created under its name")
        if lost_id and status not in ("no longer listed", "its replacement never listed") \
                and not self._terminate(name, lost_id):
            return
        worker.since = now
        try:
            made = self.client.create_pod(worker.body, not_these=tuple(
                filter(None, (lost_id, *self._lost_ids()))))
        except PodagentError as exc:
            if getattr(exc, "answered", False):  # refused: nothing was made, nor is awaited
                worker.refused, worker.since = worker.refused + 1, 0.0
                if worker.refused >= TRIES:
                    del self.workers[name]
                    self.reporter.warn(f"the replacement of pod {name} was refused ({exc}); "
                                       f"given up after {worker.refused} tries")
                else:
                    self.reporter.warn(f"the replacement of pod {name} was refused ({exc}); "
                                       f"trying again in {LOOK_EVERY:g} s")
                return
            # It may have been made: counted, and looked for by its name before any other.
            self.reporter.warn(f"the replacement of pod {name} may or may not have been made "
                               f"({exc}); looking for it by its name")
            made = {}
        new_id = str(made.get("id", "")) if isinstance(made, Mapping) else ""
        worker.pod_id = new_id or None
        self.records.append({"name": name, "lost": lost_id, "new": new_id or None,
                             "status": status, "at": time.time()})
        record_or_warn(self.ledger.save, self.reporter)
        self.reporter.event(Event.POD_REPLACED, name=name, lost=lost_id, new=new_id or None,
                            status=status, n=n)

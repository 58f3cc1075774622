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
from typing import Any

from podagent.config import Settings
from podagent.config.names import UP_RUN_LABEL
from podagent.config.policy import RUNPOD_ACCOUNT_KEY, runpod_key
from podagent.errors import PodagentError
from podagent.platform import runpod_api
from podagent.report import Reporter
from podagent.run.ledger import Ledger, record_or_warn
from podagent.wire import Event

LOOK_EVERY = 10.0  # seconds between looks at RunPod's list while the cluster is not whole
LOST_STATUSES = ("EXITED", "ERROR", "TERMINATED")  # and no longer listed
# What a create takes of a listed Pod (v2: Pod is ContainerConfig and more; CreatePodRequest
# is ContainerConfig and these).
_CONTAINER = ("image", "args", "disk", "env", "ports", "registry", "cloud", "mounts")
TRIES = 3  # creates of one replacement that fail before the head gives up on it


def create_body(pod: Mapping[str, Any]) -> dict[str, Any]:
    """CreatePodRequest for a pod of the same spec as `pod` (as RunPod lists it), in its data
    center (its network volume is there)."""
    body: dict[str, Any] = {"name": str(pod["name"])}
    for key in _CONTAINER:
        if pod.get(key) not in (None, "", [], {}):
            body[key] = pod[key]
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


class PodReplacer:
    """The head's hand at RunPod for its lost workers (None where it has none: see `of`)."""

    def __init__(self, client: runpod_api.Client, run: str, own_id: str, budget: int,
                 ledger: Ledger, reporter: Reporter):
        self.client, self.run, self.own_id, self.budget = client, run, own_id, budget
        self.ledger, self.reporter = ledger, reporter
        self.bodies: dict[str, dict[str, Any]] = {}  # each worker pod's id -> its create
        self.failed: dict[str, int] = {}  # creates of a replacement that failed, by lost pod
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
    def used(self) -> int:
        return len(self.ledger.data.get("replaced", []))

    def remember(self) -> None:
        """The run's worker pods as RunPod lists them now, and what each was created with."""
        try:
            for pod in self._listed().values():
                self.bodies[str(pod["id"])] = create_body(pod)
        except (PodagentError, KeyError, TypeError, ValueError) as exc:
            self.reporter.warn(f"could not list the run's pods to replace a lost one later "
                               f"({exc})")

    def _listed(self) -> dict[str, Mapping[str, Any]]:
        return {str(p["id"]): p for p in self.client.list_pods()
                if (p.get("env") or {}).get(UP_RUN_LABEL) == self.run
                and str(p["id"]) != self.own_id}

    def tick(self) -> None:
        """While the cluster is not whole: every LOOK_EVERY seconds, each remembered worker
        that RunPod lists stopped, failed or not at all is replaced, within the budget."""
        now = time.monotonic()
        if now < self._next_look or not self.bodies:
            return
        self._next_look = now + LOOK_EVERY
        try:
            listed = self._listed()
        except PodagentError as exc:
            self.reporter.warn(f"could not list the run's pods ({exc}); looking again in "
                               f"{LOOK_EVERY:g} s")
            return
        for pod_id in list(self.bodies):
            status = (listed.get(pod_id) or {}).get("status")
            if pod_id in listed and status not in LOST_STATUSES:
                continue
            self._replace(pod_id, status or "no longer listed")

    def _replace(self, pod_id: str, status: str) -> None:
        body = self.bodies[pod_id]
        name = body["name"]
        if self.used >= self.budget:
            self.reporter.warn(f"pod {name} ({pod_id}) is {status} at RunPod and no replacement "
                               f"is left ({self.used} of PODAGENT_REPLACEMENTS={self.budget} "
                               f"used): the run waits for a worker as without replacements")
            del self.bodies[pod_id]
            return
        n = self.used + 1
        self.reporter.say(f"pod {name} ({pod_id}) is {status} at RunPod: replacing it "
                          f"(replacement {n} of {self.budget}, PODAGENT_REPLACEMENTS): the lost "
                          f"pod is terminated and one of the same spec created under its name")
        try:
            if status != "no longer listed":
                self.client.terminate_pod(pod_id)
            made = self.client.create_pod(body, not_these=(pod_id,))
        except PodagentError as exc:
            tries = self.failed[pod_id] = self.failed.get(pod_id, 0) + 1
            if tries >= TRIES:  # RunPod refuses it: the run waits as without replacements
                del self.bodies[pod_id]
                self.reporter.warn(f"the replacement of pod {name} could not be made ({exc}); "
                                   f"given up after {tries} tries")
            else:
                self.reporter.warn(f"the replacement of pod {name} could not be made ({exc}); "
                                   f"trying again in {LOOK_EVERY:g} s")
            return
        new_id = str(made.get("id", ""))
        del self.bodies[pod_id]
        if new_id:
            self.bodies[new_id] = body
        replaced = self.ledger.data.setdefault("replaced", [])
        replaced.append({"name": name, "lost": pod_id, "new": new_id, "status": status,
                         "at": time.time()})
        record_or_warn(self.ledger.save, self.reporter)
        self.reporter.event(Event.POD_REPLACED, name=name, lost=pod_id, new=new_id,
                            status=status, n=n)

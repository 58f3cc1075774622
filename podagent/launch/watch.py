"""`podagent up`'s look at the pods: every pod of the run in one list call, onto the board and
the cost meter; a list that fails is borne for a while (the last statuses stand), one that
keeps failing ends the run."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from podagent.errors import RunPodApiError, RunPodAuthError
from podagent.launch import spec as specs
from podagent.launch.view import Board, View
from podagent.platform.runpod_api import BILLING_STATUSES, Client, rfc3339_ns

API_OUTAGE = 300.0  # RunPod's API unable to list the pods this long ends the run


@dataclass
class CostMeter:
    """What the run's pods cost at RunPod's own rates: each pod's `cost` ($/h while it bills)
    times the time it billed, from its `createdAt` (else when `up` first saw it) until `up` saw
    it no longer billing (EXITED, ERROR, terminated)."""

    spans: dict[str, list[list[float]]] = field(default_factory=dict)  # [start, end, $/h]
    ids: dict[str, str] = field(default_factory=dict)  # the pod each name's spans are of

    def observe(self, name: str, pod: Mapping[str, Any] | None, now: float) -> None:
        spans = self.spans.setdefault(name, [])
        open_span = spans[-1] if spans and spans[-1][1] < 0 else None
        status = pod.get("status") if pod else None
        if pod is not None and status in BILLING_STATUSES:
            # A pod seen for the first time (a replacement under the name included) bills
            # from its creation; one that bills again after a stop, from now.
            fresh = str(pod.get("id")) != self.ids.get(name)
            self.ids[name] = str(pod.get("id"))
            if open_span is not None and fresh:  # another pod now: the last one's span ends
                open_span[1] = now
                open_span = None
            if open_span is None:
                created = rfc3339_ns(pod.get("createdAt")) if fresh else None
                spans.append([min(now, created / 1e9) if created else now, -1.0, 0.0])
                open_span = spans[-1]
            rate = pod.get("cost")
            if isinstance(rate, (int, float)) and rate > 0:
                open_span[2] = float(rate)
        elif open_span is not None:
            open_span[1] = now

    def close(self, now: float, name: str | None = None) -> None:
        """Every pod's open span ends now (`name`: that pod's alone, its pod terminated)."""
        for spans in ([self.spans.get(name, [])] if name is not None
                      else self.spans.values()):
            if spans and spans[-1][1] < 0:
                spans[-1][1] = now

    def totals(self, now: float) -> tuple[float, float]:
        """(pod-hours, dollars) so far."""
        hours = dollars = 0.0
        for spans in self.spans.values():
            for start, end, rate in spans:
                span = max(0.0, (now if end < 0 else end) - start) / 3600.0
                hours += span
                dollars += span * rate
        return hours, dollars


class Watch:
    """The run's pods as RunPod lists them: by name, their ids (a cluster's are learnt from
    its pod list), the head's id, and their statuses."""

    def __init__(self, spec: specs.UpSpec, client: Client, board: Board,
                 view: View, say: Callable[[str], None],
                 pod_ids: dict[str, str], cluster_id: str | None):
        self.spec, self.client, self.board, self.view, self.say = spec, client, board, view, say
        self.pod_ids, self.cluster_id = pod_ids, cluster_id
        self.head_id: str | None = pod_ids.get(specs.pod_name(spec.run, 0))
        self.cost = CostMeter()
        self._ok_at = time.monotonic()
        self._said = False

    def look(self) -> dict[str, str | None]:
        """Every pod's status now (one API call; None: RunPod no longer lists it)."""
        now = time.time()
        if self.spec.cluster:
            assert self.cluster_id is not None
            listed = self.client.cluster_pods(self.cluster_id)
            if not listed:  # gone (None), or its pods not placed yet (RunPod adds them)
                name = specs.cluster_name(self.spec.run)
                return {name: None if listed is None else "PROVISIONING"}
            pods = listed
            for pod in pods:
                if (pod.get("cluster") or {}).get("rank") == 0:
                    self.head_id = str(pod["id"])
                self.pod_ids[str(pod["name"])] = str(pod["id"])
        else:
            listed = {str(p["id"]): p for p in self.client.list_pods()}
            pods = [listed[i] for i in self.pod_ids.values() if i in listed]
        by_id = {str(p["id"]): p for p in pods}
        statuses: dict[str, str | None] = {}
        for name, pod_id in self.pod_ids.items():
            pod = by_id.get(pod_id)
            row = self.board.row(name)
            row.id = pod_id
            self.cost.observe(name, pod, now)
            if pod is None:
                row.status = "GONE"
                statuses[name] = None
            else:
                row.show(pod)
                statuses[name] = row.status
        self.view.update(self.board)
        return statuses

    def look_again(self, last: dict[str, str | None]) -> dict[str, str | None]:
        """A look, or (RunPod's API failing for now) the last one: one failed list must not
        end a long run, but an API gone for API_OUTAGE seconds does."""
        try:
            statuses = self.look()
        except RunPodAuthError:
            raise
        except RunPodApiError as exc:
            down_for = time.monotonic() - self._ok_at
            if down_for > API_OUTAGE:
                raise RunPodApiError(f"run {self.spec.run}: RunPod's API has not listed the "
                                     f"pods for {down_for:.0f} s ({exc})") from None
            if not self._said:
                self._said = True
                self.say(f"RunPod's API did not list the pods ({exc}); still following "
                         f"(their last known states stand)")
            return last
        if self._said:
            self._said = False
            self.say("RunPod's API answers again")
        self._ok_at = time.monotonic()
        return statuses

    def head_name(self) -> str:
        for name, pod_id in self.pod_ids.items():
            if pod_id == self.head_id:
                return name
        return specs.pod_name(self.spec.run, 0)

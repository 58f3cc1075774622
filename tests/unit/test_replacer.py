"""A detached run's head replacing a worker RunPod lost (cluster/replacer.py): the create made
from RunPod's own Pod (checked against v2's CreatePodRequest schema), when a pod counts as lost,
the budget across the head's starts (the ledger), and a refused create given up on."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from podagent.cluster.replacer import PodReplacer, create_body
from podagent.errors import RunPodApiError, RunPodNonsense
from podagent.report import Reporter
from podagent.run.ledger import Ledger

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "fakes" /
                     "runpod_v2_schema.json").read_text())
RUN = "demo"


def pod(pod_id: str, status: str = "RUNNING", name: str = "podagent-demo-w1",
        **env: str) -> dict[str, Any]:
    """A worker as GET /v2/pods lists it (v2's Pod)."""
    return {"id": pod_id, "name": name, "status": status, "image": "ghcr.io/me/trainer:1",
            "args": "", "disk": 50, "ports": [], "registry": None, "cloud": "SECURE",
            "env": {"RAY_WORKER": "1", "HEAD_POD_ID": "head1", "PODAGENT_UP_RUN": RUN,
                    "WANDB_API_KEY": "{{ RUNPOD_SECRET_wandb }}", **env},
            "gpu": {"id": "NVIDIA H100 80GB HBM3", "count": 8},
            "mounts": {"network": [{"volumeId": "vol1", "path": "/workspace"}]},
            "dataCenterId": "US-KS-2",
            "globalNetworking": {"enabled": True, "ip": "10.65.0.3",
                                 "internalDns": f"{pod_id}.runpod.internal"}}


def test_the_create_is_the_lost_pods_spec_as_runpods_document_takes_it():
    body = create_body(pod("w1"))
    validator = jsonschema.Draft202012Validator(
        {"components": SCHEMA, "$ref": "#/components/schemas/CreatePodRequest"})
    assert list(validator.iter_errors(body)) == []
    assert body == {"name": "podagent-demo-w1", "image": "ghcr.io/me/trainer:1", "disk": 50,
                    "env": pod("w1")["env"], "cloud": "SECURE",
                    "mounts": {"network": [{"volumeId": "vol1", "path": "/workspace"}]},
                    "gpu": {"id": "NVIDIA H100 80GB HBM3", "count": 8},
                    "dataCenterIds": ["US-KS-2"], "globalNetworking": True}


class Api:
    """RunPod as the head's replacer sees it (a stand-in: the e2e test has the fake RunPod),
    with what RunPod may do: list a new pod late (`lag` looks), keep a terminated one listed
    TERMINATED, carry out a create whose answer is nonsense (`ambiguous`), refuse (`refuse`)."""

    def __init__(self, pods: list[dict[str, Any]], lag: int = 0, ambiguous: int = 0):
        self.pods = {p["id"]: p for p in pods}
        self.calls: list[tuple[str, str]] = []
        self.refuse, self.lag, self.ambiguous = False, lag, ambiguous
        self.hidden: dict[str, int] = {}

    def list_pods(self) -> list[dict[str, Any]]:
        for pod_id in list(self.hidden):
            self.hidden[pod_id] -= 1
            if self.hidden[pod_id] < 0:
                del self.hidden[pod_id]
        return [p for p in self.pods.values() if p["id"] not in self.hidden]

    def terminate_pod(self, pod_id: str) -> bool:
        self.calls.append(("terminate", pod_id))
        if pod_id in self.pods:
            self.pods[pod_id]["status"] = "TERMINATED"
        return True

    def create_pod(self, body: dict[str, Any], not_these: tuple[str, ...] = ()) -> dict:
        self.calls.append(("create", body["name"]))
        if self.refuse:
            refused = RunPodApiError("RunPod API: POST /v2/pods answered 400")
            refused.answered = True
            raise refused
        new = {**pod(f"new{len(self.calls)}", name=body["name"]), "env": dict(body["env"])}
        self.pods[new["id"]] = new
        if self.lag:
            self.hidden[new["id"]] = self.lag
        if self.ambiguous:
            self.ambiguous -= 1
            raise RunPodNonsense("RunPod API: POST /v2/pods answered 200 without the pod")
        return new

    def live(self, name: str) -> list[str]:
        return [p["id"] for p in self.pods.values()
                if p["name"] == name and p["status"] != "TERMINATED"]


def replacer(tmp_path: Path, api: Api, budget: int = 2) -> tuple[PodReplacer, io.StringIO]:
    out = io.StringIO()
    ledger = Ledger.load(tmp_path, RUN)
    api.pods.setdefault("head1", {**pod("head1", name="podagent-demo-head"),
                                  "env": {"PODAGENT_UP_RUN": RUN}})
    return PodReplacer(api, RUN, "head1", budget, ledger, Reporter("head", "h", None,
                                                                   stream=out)), out


def look(rep: PodReplacer, times: int = 1) -> None:
    for _ in range(times):
        rep._next_look = 0.0
        rep.tick()


@pytest.mark.parametrize(("status", "terminated"), [("EXITED", True), ("ERROR", True),
                                                    (None, False)])
def test_a_worker_stopped_failed_or_gone_is_replaced_under_its_name(tmp_path, status,
                                                                    terminated):
    api = Api([pod("w1")])
    rep, out = replacer(tmp_path, api)
    rep.remember()
    assert set(rep.workers) == {"podagent-demo-w1"}  # the head is not its own to replace
    if status is None:
        del api.pods["w1"]
    else:
        api.pods["w1"]["status"] = status
    look(rep)
    assert api.calls == ([("terminate", "w1")] if terminated else []) + [
        ("create", "podagent-demo-w1")]
    assert "replacement 1 of 2, PODAGENT_REPLACEMENTS" in out.getvalue()
    assert [r["lost"] for r in Ledger.load(tmp_path, RUN).data["replaced"]] == ["w1"]
    assert api.live("podagent-demo-w1") == [rep.workers["podagent-demo-w1"].pod_id]


def test_a_running_worker_is_left_and_the_budget_holds_across_starts(tmp_path):
    api = Api([pod("w1"), pod("w2", name="podagent-demo-w2")])
    rep, _ = replacer(tmp_path, api, budget=1)
    rep.remember()
    look(rep)
    assert api.calls == []  # both RUNNING: Ray lost a node RunPod still runs (it may rejoin)
    api.pods["w1"]["status"] = "EXITED"
    rep.tick()  # within LOOK_EVERY of the last look: nothing yet
    assert api.calls == []
    look(rep)
    assert ("create", "podagent-demo-w1") in api.calls
    # A head started again reads the ledger: the budget is spent, and the pod it replaced
    # (still listed, TERMINATED) is not remembered as one to replace.
    again, out = replacer(tmp_path, api, budget=1)
    again.remember()
    assert sorted(again.workers) == ["podagent-demo-w1", "podagent-demo-w2"]
    assert again.workers["podagent-demo-w1"].pod_id != "w1"
    api.pods["w2"]["status"] = "EXITED"
    look(again)
    assert ("create", "podagent-demo-w2") not in api.calls
    assert "no replacement is left (1 of PODAGENT_REPLACEMENTS=1 used)" in out.getvalue()
    assert len(api.live("podagent-demo-w1")) == 1


def test_a_refused_create_is_tried_a_few_times_then_given_up(tmp_path):
    api = Api([pod("w1")])
    rep, out = replacer(tmp_path, api)
    rep.remember()
    del api.pods["w1"]
    api.refuse = True
    look(rep, 5)
    assert api.calls.count(("create", "podagent-demo-w1")) == 3
    assert "given up after 3 tries" in out.getvalue() and rep.workers == {}
    assert "replaced" not in Ledger.load(tmp_path, RUN).data  # refusals spend nothing


def test_a_new_pod_runpod_lists_late_is_not_lost_and_made_again(tmp_path):
    """RunPod's list may lag a create: the new pod is not lost for not being listed yet."""
    api = Api([pod("w1")], lag=3)
    rep, _ = replacer(tmp_path, api, budget=3)
    rep.remember()
    api.pods["w1"]["status"] = "EXITED"
    look(rep, 6)
    assert api.calls.count(("create", "podagent-demo-w1")) == 1
    assert len(api.live("podagent-demo-w1")) == 1


def test_a_create_whose_answer_was_nonsense_is_found_by_its_name_not_made_again(tmp_path):
    api = Api([pod("w1")], ambiguous=1)
    rep, out = replacer(tmp_path, api, budget=3)
    rep.remember()
    del api.pods["w1"]
    look(rep, 4)
    assert api.calls.count(("create", "podagent-demo-w1")) == 1
    assert "may or may not have been made" in out.getvalue()
    assert rep.workers["podagent-demo-w1"].pod_id == api.live("podagent-demo-w1")[0]
    assert len(Ledger.load(tmp_path, RUN).data["replaced"]) == 1  # counted: it may bill


def test_only_this_heads_live_workers_are_its_own_and_never_with_the_key(tmp_path):
    """A stranger's pod with the run's label, an earlier head, a terminated pod, a pod of
    nonsense: none is remembered; a body never carries the account key or the replacing."""
    old_head = {**pod("oldhead", name="podagent-demo-head", status="TERMINATED"),
                "env": {"PODAGENT_UP_RUN": RUN, "PODAGENT_RUNPOD_API_KEY": "{{ RUNPOD_SECRET_a }}",
                        "PODAGENT_REPLACEMENTS": "3", "EXPECTED_WORKERS": "1"}}
    stranger = pod("x1", name="podagent-demo-w9", HEAD_POD_ID="someone-else")
    odd = {**pod("odd"), "name": "podagent-demo-w7", "env": ["not", "an", "object"]}
    keyed = pod("w2", name="podagent-demo-w2", PODAGENT_RUNPOD_API_KEY="{{ RUNPOD_SECRET_a }}",
                PODAGENT_REPLACEMENTS="3")
    api = Api([old_head, stranger, odd, pod("w1"), keyed])
    rep, _ = replacer(tmp_path, api)
    rep.remember()
    assert sorted(rep.workers) == ["podagent-demo-w1", "podagent-demo-w2"]
    env = rep.workers["podagent-demo-w2"].body["env"]
    assert "PODAGENT_RUNPOD_API_KEY" not in env and "PODAGENT_REPLACEMENTS" not in env
    api.pods["odd"]["status"] = "EXITED"
    look(rep)  # a pod of nonsense in the list costs nothing
    assert api.calls == []

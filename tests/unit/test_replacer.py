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
from podagent.errors import RunPodApiError
from podagent.report import Reporter
from podagent.run.ledger import Ledger

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "fakes" /
                     "runpod_v2_schema.json").read_text())
RUN = "demo"


def pod(pod_id: str, status: str = "RUNNING", name: str = "podagent-demo-w1") -> dict[str, Any]:
    """A worker as GET /v2/pods lists it (v2's Pod)."""
    return {"id": pod_id, "name": name, "status": status, "image": "ghcr.io/me/trainer:1",
            "args": "", "disk": 50, "ports": [], "registry": None, "cloud": "SECURE",
            "env": {"RAY_WORKER": "1", "HEAD_POD_ID": "head1", "PODAGENT_UP_RUN": RUN,
                    "WANDB_API_KEY": "{{ RUNPOD_SECRET_wandb }}"},
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
    """RunPod as the head's replacer sees it (a stand-in: the e2e test has the fake RunPod)."""

    def __init__(self, pods: list[dict[str, Any]]):
        self.pods = {p["id"]: p for p in pods}
        self.calls: list[tuple[str, str]] = []
        self.refuse = False

    def list_pods(self) -> list[dict[str, Any]]:
        return list(self.pods.values())

    def terminate_pod(self, pod_id: str) -> bool:
        self.calls.append(("terminate", pod_id))
        self.pods.pop(pod_id, None)
        return True

    def create_pod(self, body: dict[str, Any], not_these: tuple[str, ...] = ()) -> dict:
        self.calls.append(("create", body["name"]))
        if self.refuse:
            raise RunPodApiError("RunPod API: POST /v2/pods answered 400")
        new = {**pod(f"new{len(self.calls)}", name=body["name"])}
        self.pods[new["id"]] = new
        return new


def replacer(tmp_path: Path, api: Api, budget: int = 2) -> tuple[PodReplacer, io.StringIO]:
    out = io.StringIO()
    ledger = Ledger.load(tmp_path, RUN)
    head = {**pod("head1", name="podagent-demo-head")}
    api.pods["head1"] = head
    return PodReplacer(api, RUN, "head1", budget, ledger, Reporter("head", "h", None,
                                                                   stream=out)), out


@pytest.mark.parametrize(("status", "terminated"), [("EXITED", True), ("ERROR", True),
                                                    (None, False)])
def test_a_worker_stopped_failed_or_gone_is_replaced_under_its_name(tmp_path, status,
                                                                    terminated):
    api = Api([pod("w1")])
    rep, out = replacer(tmp_path, api)
    rep.remember()
    assert set(rep.bodies) == {"w1"}  # the head itself is not its own to replace
    if status is None:
        del api.pods["w1"]
    else:
        api.pods["w1"]["status"] = status
    rep.tick()
    assert api.calls == ([("terminate", "w1")] if terminated else []) + [
        ("create", "podagent-demo-w1")]
    assert "replacement 1 of 2, PODAGENT_REPLACEMENTS" in out.getvalue()
    assert [r["lost"] for r in Ledger.load(tmp_path, RUN).data["replaced"]] == ["w1"]
    assert set(rep.bodies) == {"new2" if terminated else "new1"}  # the new one, if lost too


def test_a_running_worker_is_left_and_the_budget_holds_across_starts(tmp_path):
    api = Api([pod("w1"), pod("w2", name="podagent-demo-w2")])
    rep, _ = replacer(tmp_path, api, budget=1)
    rep.remember()
    rep.tick()
    assert api.calls == []  # both RUNNING: Ray lost a node RunPod still runs (it may rejoin)
    api.pods["w1"]["status"] = "EXITED"
    rep.tick()  # within LOOK_EVERY of the last look: nothing yet
    assert api.calls == []
    rep._next_look = 0.0
    rep.tick()
    assert ("create", "podagent-demo-w1") in api.calls
    # A head started again reads the ledger: the budget is spent.
    again, out = replacer(tmp_path, api, budget=1)
    again.remember()
    api.pods["w2"]["status"] = "EXITED"
    again.tick()
    assert ("create", "podagent-demo-w2") not in api.calls
    assert "no replacement is left (1 of PODAGENT_REPLACEMENTS=1 used)" in out.getvalue()


def test_a_refused_create_is_tried_a_few_times_then_given_up(tmp_path):
    api = Api([pod("w1")])
    rep, out = replacer(tmp_path, api)
    rep.remember()
    del api.pods["w1"]
    api.refuse = True
    for _ in range(5):
        rep._next_look = 0.0
        rep.tick()
    assert api.calls.count(("create", "podagent-demo-w1")) == 3
    assert "given up after 3 tries" in out.getvalue() and rep.bodies == {}

"""podagent up's parts that need no RunPod: the run's spec and its bad inputs, the create
bodies, the local record, the policy, the head's records, the plain view."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time

import click
import pytest

from podagent import cli
from podagent.errors import ConfigError, InputError
from podagent.launch import down, state
from podagent.launch import spec as specs
from podagent.launch.follow import parse
from podagent.launch.up import judge
from podagent.launch.view import Board, PlainView

H100 = "NVIDIA H100 80GB HBM3"
CATALOG = [{"id": H100, "name": "H100 SXM", "manufacturer": "NVIDIA",
            "maxCount": {"secure": 8, "community": 0}, "price": {"secure": 2.99, "community": 0.0}},
           {"id": "AMD Instinct MI300X OAM", "name": "MI300X", "manufacturer": "AMD",
            "maxCount": {"secure": 8, "community": 0}, "price": {"secure": 2.49, "community": 0}}]
DATA_CENTERS = [{"id": "US-KS-2", "globalNetwork": True}, {"id": "EU-RO-1", "globalNetwork": True},
                {"id": "EUR-IS-1", "globalNetwork": False}]


def build(**over):
    args = dict(run="demo", gpu_type=H100, gpus_per_pod=8, pods=3, image="ghcr.io/me/trainer:1",
                template=None, cluster=False, cloud="SECURE", data_centers=(), volume_gb=None,
                network_volume=None, disk_gb=None, env=(), secrets=(), job=(), keep=False,
                timeout=900.0, api_url="https://api.runpod.io", state_dir=None, detach=False,
                registry_auth=None)
    args.update(over)
    return specs.build(**args)


@pytest.mark.parametrize(("over", "says"), [
    ({"pods": 0}, "--pods=0 must be at least 1"),
    ({"pods": 1, "cluster": True}, "--pods=1 must be at least 2 with --cluster"),
    ({"pods": 251}, "at most 250"),
    ({"gpus_per_pod": 0}, "--gpus=0 must be at least 1"),
    ({"image": "Trainer:latest"}, "--image='Trainer:latest' is not a container image"),
    ({"image": "ghcr.io/me/trainer:1 --privileged"}, "is not a container image"),
    ({"image": None}, "give exactly one of --image IMAGE or --template"),
    ({"template": "tpl1"}, "give exactly one of --image IMAGE or --template"),
    ({"image": None, "template": "tpl1", "cluster": True}, "cannot be used with --cluster"),
    ({"run": "a b"}, "--name='a b' must be 1-64 characters"),
    ({"cloud": "CHEAP"}, "--cloud='CHEAP' must be one of SECURE, COMMUNITY"),
    ({"cloud": "COMMUNITY"}, "--cloud='COMMUNITY' cannot be used: a run's pods reach each "
                             "other over RunPod's Global Networking or an Instant Cluster, both "
                             "Secure Cloud only"),
    ({"registry_auth": "cred", "cluster": True}, "--registry-auth cannot be used with --cluster"),
    ({"registry_auth": " "}, "--registry-auth=' ' must name a registry credential"),
    ({"detach": True, "keep": True}, "give at most one of --detach and --keep"),
    ({"launcher": "torchrun"}, "--launcher torchrun needs the training script"),
    ({"launcher": "mpirun", "job": ("x.py",)}, "--launcher='mpirun' must be one of ray, "
                                               "torchrun, accelerate"),
    ({"env": ("PODAGENT_LAUNCHER=torchrun",)}, "is set by `podagent up` itself"),
    ({"volume_gb": 5}, "--volume=5 must be at least 10"),
    ({"env": ("NOEQUALS",)}, "--env='NOEQUALS' must be NAME=VALUE"),
    ({"env": ("EXPECTED_WORKERS=3",)}, "is set by `podagent up` itself"),
    ({"secrets": ("HF_TOKEN=has space",)}, "--secret='HF_TOKEN=has space'"),
    ({"api_url": "ftp://x"}, "RUNPOD_API_URL='ftp://x' must be an http"),
    ({"max_duration": "3 weeks"}, "--max-duration='3 weeks' must be a duration such as 90s"),
    ({"max_duration": "0s"}, "--max-duration='0s' must be a duration"),
    ({"max_cost": -5.0}, "--max-cost=-5.0 must be a positive number of US dollars"),
    ({"max_cost": float("nan")}, "--max-cost=nan must be a positive number"),
    ({"max_cost": 10.0, "keep": True}, "give at most one of --keep and --max-duration"),
    ({"env": ("PODAGENT_DEADLINE=1796040000",)}, "is set by `podagent up` itself"),
    ({"max_duration": "30s"}, "--max-duration='30s' must be at least 60 s"),
    ({"replacements": -1}, "--replacements=-1 must be between 0 and"),
    ({"shared_volume_gb": 5}, "--shared-volume=5 must be between 10 and 4096"),
    ({"shared_volume_gb": 50, "volume_gb": 20}, "give at most one of --shared-volume GB"),
    ({"shared_volume_gb": 50, "no_shared_volume": True}, "give at most one of --shared-vol"),
    ({"shared_volume_gb": 50, "network_volume": "v"}, "give at most one of --shared-volume"),
    ({"replacements": 2, "detach": True, "launcher": "torchrun", "job": ("t.py",)},
     "--replacements cannot be used with --detach and --launcher torchrun"),
    ({"replacements": 2, "cluster": True}, "--replacements cannot be used with --cluster"),
])
def test_bad_input_is_one_line_naming_it(over, says):
    with pytest.raises(ConfigError) as caught:
        build(**over)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_secret_by_value_is_refused_without_echoing_it():
    with pytest.raises(ConfigError) as caught:
        build(env=("WANDB_API_KEY=abc123secretvalue",))
    assert "abc123secretvalue" not in str(caught.value)
    assert "--secret WANDB_API_KEY=" in str(caught.value)


def test_a_secret_goes_by_runpod_reference():
    spec = build(secrets=("WANDB_API_KEY=wandb_key",),
                 env=("HF_TOKEN={{ RUNPOD_SECRET_hf }}", "LR=1e-5"))
    env = dict(spec.env)
    assert env == {"WANDB_API_KEY": "{{ RUNPOD_SECRET_wandb_key }}",
                   "HF_TOKEN": "{{ RUNPOD_SECRET_hf }}", "LR": "1e-5"}


@pytest.mark.parametrize("image", ["trainer", "ghcr.io/me/trainer:1.2", "localhost:5000/a/b",
                                   "me/trainer@sha256:" + "a" * 64, "a.b/c_d/e-f:T_1"])
def test_image_references_that_are_fine(image):
    assert build(image=image).image == image


def test_the_head_and_workers_get_their_roles_and_the_run():
    spec = build(job=("python", "-m", "train", "--lr", "1e-5 x"), volume_gb=50,
                 data_centers=("US-TX-3",))
    head, worker = specs.pod_body(spec, 0), specs.pod_body(spec, 2, head_id="abc")
    assert head["name"] == "podagent-demo-head" and worker["name"] == "podagent-demo-w2"
    assert head["env"]["EXPECTED_WORKERS"] == "2" and "RAY_WORKER" not in head["env"]
    assert head["env"]["PODAGENT_JOB"] == "python -m train --lr '1e-5 x'"
    assert head["env"]["PODAGENT_LOG_FORMAT"] == "json"
    assert worker["env"]["RAY_WORKER"] == "1" and worker["env"]["HEAD_POD_ID"] == "abc"
    for body in (head, worker):
        assert body["env"][specs.LABEL] == "demo" and body["env"]["PODAGENT_RUN_NAME"] == "demo"
        # Each pod stops itself once the run is over: a closed laptop leaves nothing billing.
        assert body["env"]["PODAGENT_AFTER_RUN"] == "stop-pod"
        assert body["gpu"] == {"id": H100, "count": 8} and body["globalNetworking"] is True
        assert body["mounts"] == {"persistent": {"size": 50, "path": "/workspace"}}
        assert body["dataCenterIds"] == ["US-TX-3"]
    cluster = specs.cluster_body(build(cluster=True))
    assert cluster["type"] == "TRAINING" and cluster["compute"] == {
        "gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 3}
    assert "RAY_WORKER" not in cluster["env"] and cluster["env"]["EXPECTED_WORKERS"] == "2"
    assert specs.pod_body(build(keep=True), 0)["env"]["PODAGENT_AFTER_RUN"] == "stay"


def test_what_checking_resolved_goes_into_the_bodies():
    """The GPU by its catalog id (a short name given), the data centers that support Global
    Networking, the registry credential of a private image; a cluster gets no registry."""
    spec = build(gpu_type="H100 SXM", registry_auth="my-creds")
    placement = specs.Placement(specs.check_gpu(spec, CATALOG)["id"],
                                specs.check_data_centers(spec, DATA_CENTERS),
                                specs.check_registry(spec, [{"id": "r1", "name": "my-creds"}]))
    body = specs.pod_body(spec, 1, "abc", placement)
    assert body["gpu"] == {"id": H100, "count": 8}
    assert body["dataCenterIds"] == ["EU-RO-1", "US-KS-2"] and body["registry"] == "r1"
    cluster = specs.cluster_body(build(cluster=True, gpu_type="H100 SXM"),
                                 specs.Placement(H100, ()))
    assert cluster["compute"]["gpuTypeId"] == H100 and "registry" not in cluster


@pytest.mark.parametrize(("over", "says"), [
    ({"data_centers": ("EUR-IS-1",)}, "--data-center='EUR-IS-1' does not support Global "
                                      "Networking, which a run's pods need to reach each other "
                                      "(those that do: EU-RO-1, US-KS-2"),
    ({"data_centers": ("MARS-1",)}, "--data-center='MARS-1' is not a RunPod data center"),
])
def test_data_centers_that_cannot_hold_the_run_are_refused(over, says):
    with pytest.raises(ConfigError) as caught:
        specs.check_data_centers(build(**over), DATA_CENTERS)
    assert says in str(caught.value)
    # An Instant Cluster needs no Global Networking: any known data center does.
    assert specs.check_data_centers(build(cluster=True, data_centers=("EUR-IS-1",)),
                                    DATA_CENTERS) == ("EUR-IS-1",)


def test_a_registry_credential_by_id_or_name_or_one_line():
    creds = [{"id": "r1", "name": "ghcr"}, {"id": "r2", "name": "ecr"}]
    assert specs.check_registry(build(registry_auth="ecr"), creds) == "r2"
    assert specs.check_registry(build(registry_auth="r1"), creds) == "r1"
    assert specs.check_registry(build(), creds) is None
    with pytest.raises(ConfigError, match=r"is not a registry credential of this RunPod "
                                          r"account \(it has: ghcr \(r1\), ecr \(r2\)"):
        specs.check_registry(build(registry_auth="dockerhub"), creds)


def test_the_spec_survives_its_record_for_a_reattach(tmp_path):
    spec = build(job=("python", "-m", "train"), env=("LR=1e-5",), data_centers=("US-KS-2",),
                 detach=True)
    again = specs.UpSpec.from_record(spec.to_record(), api_url=spec.api_url,
                                     api_timeout=spec.api_timeout, state_dir=spec.state_dir)
    assert again == dataclasses.replace(spec, detach=False)


def test_a_runs_pods_are_known_by_label_or_exact_name():
    assert specs.belongs({"name": "podagent-demo-w12"}, "demo")
    assert specs.belongs({"name": "x", "env": {specs.LABEL: "demo"}}, "demo")
    assert not specs.belongs({"name": "podagent-demo-x-head"}, "demo")  # run demo-x's
    assert not specs.belongs({"name": "podagent-demo-w0"}, "demo")


def test_the_gpu_type_is_checked_against_the_catalog():
    assert specs.check_gpu(build(), CATALOG)["id"] == H100
    assert specs.check_gpu(build(gpu_type="H100 SXM"), CATALOG)["id"] == H100
    with pytest.raises(ConfigError, match="not a GPU type RunPod offers; did you mean "
                                          "'NVIDIA H100 80GB HBM3'"):
        specs.check_gpu(build(gpu_type="NVIDIA H100 80GB"), CATALOG)
    with pytest.raises(ConfigError, match=r"--gpus=9 is more than .* SECURE cloud \(8\)"):
        specs.check_gpu(build(gpus_per_pod=9), CATALOG)
    with pytest.raises(ConfigError, match="is a AMD GPU: RunPod's Global Networking needs an "
                                          "NVIDIA GPU"):
        specs.check_gpu(build(gpu_type="MI300X"), CATALOG)


def test_the_record_is_written_before_the_call_and_survives_reading_back(tmp_path):
    record = state.new(tmp_path, "demo", "https://api.runpod.io", "3 x 8 H100")
    asked = record.asking("pod", "podagent-demo-head", 0, 60.0)
    on_disk = json.loads(state.path_of(tmp_path, "demo").read_text())
    assert on_disk["resources"][0] == {"kind": "pod", "name": "podagent-demo-head", "rank": 0,
                                       "id": None, "asked_at": asked.asked_at,
                                       "lands_by": asked.asked_at + 60.0, "sent": 1,
                                       "window_from": 0.0}
    # Unanswered, it may still land until its call's deadline, and as long again after it
    # (RunPod may carry a create out after the client stopped waiting); a record from before
    # `lands_by` was kept counts the default deadline.
    assert record.landing_left(asked.asked_at + 20.0) == pytest.approx(100.0)
    assert record.landing_left(asked.asked_at + 121.0) == 0.0
    # A create makes one pod: once RunPod lists it live, that create has landed.
    assert record.landing_left(asked.asked_at + 20.0, {"podagent-demo-head": {"p1"}}) == 0.0
    assert record.landing_left(asked.asked_at + 20.0, {"podagent-demo-w1": {"p1"}}) > 0.0
    asked.lands_by = 0.0
    assert record.landing_left(asked.asked_at) == 2 * state.DEFAULT_LANDING
    record.got(asked, "pod123")
    assert record.landing_left(asked.asked_at) == 0.0  # answered: nothing lands unseen
    again = state.load(tmp_path, "demo")
    assert again is not None and again.ids("pod") == ["pod123"]
    assert [r.run for r in state.all_records(tmp_path)] == ["demo"]
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside it
    # Its pod gone, asked again: a new create, whose answer is awaited as the first one's.
    again = record.asking("pod", "podagent-demo-head", 0, 10.0)
    assert again is asked and again.id is None and again.lands_by == again.asked_at + 10.0
    assert record.landing_left(again.asked_at) == pytest.approx(20.0)


def test_a_create_sent_again_after_a_lost_answer_may_make_a_second_pod(tmp_path):
    """RunPod may list a pod some time after making it: a create whose answer was lost, sent
    again because no pod of its name was listed yet, may land beside the second. Its name is
    settled only once as many pods of it are known as creates went out; one RunPod refused
    made nothing."""
    record = state.new(tmp_path, "demo", "https://api.runpod.io", "1 x 8 H100")
    asked = record.asking("pod", "podagent-demo-head", 0, 60.0)
    record.resent(asked)
    record.got(asked, "second")  # the second create's answer: its pod is known
    assert record.unlanded() == {"podagent-demo-head"}  # the first may still land
    # The second create went out now: it may land within a deadline from now.
    assert record.landing_left(asked.asked_at + 30.0) == pytest.approx(90.0, abs=1.0)
    assert record.landing_left(asked.asked_at, {"podagent-demo-head": {"second"}}) > 0.0
    assert record.landing_left(asked.asked_at, {"podagent-demo-head": {"first", "second"}}
                               ) == 0.0
    assert record.landing_left(asked.asked_at, {"podagent-demo-head": {"first"}}) == 0.0
    assert state.load(tmp_path, "demo").resources[0].sent == 2  # kept for `podagent down`
    # Sent twice and the second refused (no capacity): the first may still land.
    worker = record.asking("pod", "podagent-demo-w1", 1, 60.0)
    record.resent(worker)
    record.refused(worker)
    assert record.unlanded({"podagent-demo-head": {"first"}}) == {"podagent-demo-w1"}
    assert record.unlanded({"podagent-demo-head": {"first"}, "podagent-demo-w1": {"x"}}) == set()
    # Asked again while the first may still land (a second `up`, with a shorter deadline):
    # both are counted, and the first is awaited as long as its own window says.
    first_ends = worker.landing_ends()
    again = record.asking("pod", "podagent-demo-w1", 1, 10.0)
    assert again.sent == 2 and again.landing_ends() == pytest.approx(first_ends)


def test_creates_sent_again_and_again_keep_one_deadline_from_the_last(tmp_path):
    """Each create sent again may land within the call's deadline from when it went out
    (given once more): the window ends there, and does not grow with each resend."""
    record = state.new(tmp_path, "demo", "https://api.runpod.io", "1 x 8 H100")
    asked = record.asking("pod", "podagent-demo-head", 0, 8.0)
    for _ in range(5):
        record.resent(asked)
    assert asked.landing_ends() == pytest.approx(time.time() + 16.0, abs=1.0)


def test_a_create_sent_again_after_a_slow_look_is_awaited_a_deadline_from_then(tmp_path):
    record = state.new(tmp_path, "demo", "https://api.runpod.io", "1 x 8 H100")
    asked = record.asking("pod", "podagent-demo-head", 0, 4.0)
    asked.asked_at -= 7.0  # the look took 7 s of a 4 s deadline: the POST goes out after it
    asked.lands_by -= 7.0
    record.resent(asked)
    assert record.landing_left(time.time()) >= 4.0


def test_clusters_listed_count_as_landed_as_pods_do():
    found = down.Found([{"id": "p1", "name": "podagent-c-head", "status": "RUNNING"},
                        {"id": "p0", "name": "podagent-c-head", "status": "TERMINATED"}],
                       [{"id": "c1", "name": "podagent-c"}, {"id": "c2", "name": "podagent-c"}])
    assert found.live_by_name() == {"podagent-c-head": {"p1"}, "podagent-c": {"c1", "c2"}}


@pytest.mark.parametrize("sent", [-1, 1.5, True, "2", 10**6])
def test_a_record_with_a_count_of_creates_podagent_never_writes_is_unreadable(tmp_path, sent):
    record = state.new(tmp_path, "demo", "https://api.runpod.io", "1 x 8 H100")
    record.asking("pod", "podagent-demo-head", 0, 60.0)
    path = state.path_of(tmp_path, "demo")
    data = json.loads(path.read_text())
    data["resources"][0]["sent"] = sent
    path.write_text(json.dumps(data))
    with pytest.raises(state.Unreadable):
        state.load(tmp_path, "demo")


@pytest.mark.parametrize("written", [
    '{"run": "demo", "api_url": "https://api.runpod.io", "status": "runn',  # truncated
    "\x00\xff garbage", "[1, 2]", '{"run": "demo", "status": "running"}',  # no api_url
    '{"run": "demo", "api_url": "u", "outcome": 5}',  # a field of the wrong type
    '{"run": "demo", "api_url": "u", "resources": [{"name": "x"}]}',  # a resource's kind
    '{"run": "demo", "api_url": "u", "resources": [{"kind": "pod", "name": "x", '
    '"lands_by": "soon"}]}',  # a deadline that is no number: never waited on
    '{"run": "demo", "api_url": "u", "resources": [{"kind": "pod", "name": "x", '
    '"lands_by": Infinity}]}',  # nor for ever
    '{"run": "other", "api_url": "u"}',  # another run's record
])
def test_an_unreadable_record_is_one_line_set_aside_and_kept(tmp_path, written):
    """A record is a hint: one that cannot be read is said in one line (which file, why) and
    set aside as it was, and the command goes on as without one; `ls` leaves it and reads
    the others."""
    state.new(tmp_path, "good", "https://api.runpod.io", "2 x H100")
    path = state.path_of(tmp_path, "demo")
    path.write_text(written)
    with pytest.raises(state.Unreadable):
        state.load(tmp_path, "demo")
    said: list[str] = []
    assert [r.run for r in state.all_records(tmp_path, said.append)] == ["good"]
    assert len(said) == 1 and str(path) in said[0] and "cannot be read (" in said[0], said
    assert path.read_text() == written  # a look leaves it as it is
    said.clear()
    assert state.load_hint(tmp_path, "demo", said.append) is None
    assert len(said) == 1 and str(path) in said[0] and "\n" not in said[0], said
    assert not path.exists() and (tmp_path / "demo.json.unreadable").read_text() == written
    path.write_text(written)  # broken again: the first one set aside is kept too
    assert state.load_hint(tmp_path, "demo", said.append) is None
    assert (tmp_path / "demo.json.unreadable.1").read_text() == written
    assert state.load_hint(tmp_path, "demo", said.append) is None and len(said) == 2


def test_a_cap_is_one_deadline_from_the_nearer_limit_given_to_every_pod():
    """--max-duration and --max-cost become one point in time, counted from the check: the
    nearer of the two, the cost at the run's list price; every pod's env holds it."""
    now = 1_796_000_000.0
    price = specs.price_per_hour(build(), CATALOG[0])  # 3 pods x 8 x $2.99
    assert price == pytest.approx(71.76)
    by_cost, line = specs.capped(build(max_cost=35.88, max_duration="2h"), price, now)
    assert by_cost.deadline == pytest.approx(now + 1800)  # half an hour of $71.76/h
    assert "1800 s from now (--max-cost $35.88 at $71.76/h)" in line
    by_time, line = specs.capped(build(max_cost=1000.0, max_duration="20m"), price, now)
    assert by_time.deadline == now + 1200 and "(--max-duration 1200 s)" in line
    for rank in range(3):
        env = specs.pod_env(by_time, rank, "headid" if rank else None)
        assert env["PODAGENT_DEADLINE"] == f"{now + 1200:.0f}"
    assert specs.capped(build(), price, now) == (build(), "")
    assert "PODAGENT_DEADLINE" not in specs.pod_env(build(), 0)


def test_a_cap_on_cost_without_a_price_is_refused_and_a_reattach_keeps_its_deadline():
    with pytest.raises(InputError, match="--max-cost needs the run's price"):
        specs.capped(build(max_cost=10.0), None, 0.0)
    # The run exists: its pods hold the deadline of its record, whatever is asked now.
    kept, line = specs.capped(build(max_duration="5m"), 71.76, 2e9, 1.9e9)
    assert kept.deadline == 1.9e9 and line.startswith("capped: the run ends by")
    again = specs.UpSpec.from_record(kept.to_record(), api_url="https://api.runpod.io",
                                     api_timeout=60.0, state_dir=None)
    assert again.deadline == 1.9e9 and again.max_duration == 300
    # Its pods hold it too: a run found at RunPod without a record here.
    assert specs.deadline_of([{"env": {}}, {"env": {"PODAGENT_DEADLINE": "1900000000"}}]) == 1.9e9
    assert specs.deadline_of([{"env": {"PODAGENT_DEADLINE": "soon"}}, {"env": None}]) is None
    # up re-attached from the pods alone waits the job's grace the pods were given.
    from podagent.launch.commands import _stop_timeout
    assert _stop_timeout([{"env": {"PODAGENT_STOP_TIMEOUT": "900"}}, {"env": {
        "PODAGENT_STOP_TIMEOUT": "900"}}]) == (("PODAGENT_STOP_TIMEOUT", "900"),)
    assert _stop_timeout([{"env": {}}, {"env": None}]) == ()
    # A cap nearer than a pod's start is refused, not run into exit 27 on every start.
    with pytest.raises(InputError, match="give at least 60 s"):
        specs.capped(build(max_cost=0.5), 71.76, 2e9)


def test_up_ends_a_capped_run_itself_when_the_head_does_not():
    t0, shape = 100.0, "3 x H100"
    running = {"a": "RUNNING", "b": "RUNNING"}
    assert judge(running, t0, t0 + 60, 900, None, shape, past_deadline=-1).action == "wait"
    late = judge(running, t0, t0 + 60, 900, None, shape, past_deadline=0.5)
    assert late.action == "fail" and late.capped and "passed its deadline" in late.why
    # The head's own end (its code) comes first.
    assert judge(running, t0, t0 + 60, 900, 27, shape, past_deadline=30).action == "done"


def test_the_policy():
    t0, shape = 100.0, "3 x H100"
    running = {"a": "RUNNING", "b": "RUNNING"}
    assert judge(running, t0, t0 + 5000, 900, None, shape).action == "wait"
    assert judge(running, t0, t0 + 1, 900, 3, shape).action == "done"
    slow = judge({"a": "RUNNING", "b": "PROVISIONING"}, t0, t0 + 901, 900, None, shape)
    assert slow.action == "fail" and "b PROVISIONING" in slow.why and "900 s" in slow.why
    assert judge({"a": "RUNNING", "b": "PROVISIONING"}, t0, t0 + 899, 900, None,
                 shape).action == "wait"
    assert "ERROR" in judge({"a": "ERROR"}, t0, t0, 900, None, shape).why
    assert "terminated outside" in judge({"a": None}, t0, t0, 900, None, shape).why
    # A pod that ran and is being started again by RunPod is not one that never started.
    restarting = {"a": "RUNNING", "b": "STARTING"}
    assert judge(restarting, t0, t0 + 5000, 900, None, shape, ran={"a", "b"}).action == "wait"
    assert judge(restarting, t0, t0 + 5000, 900, None, shape, ran={"a"}).action == "fail"
    loop = judge(running, t0, t0 + 60, 900, None, shape, head_starts=6)
    assert loop.action == "fail" and "started 6 times" in loop.why
    assert judge(running, t0, t0 + 60, 900, None, shape, head_starts=5).action == "wait"


def test_a_pod_stopped_or_failed_at_runpod_ends_the_run_after_a_grace():
    t0, shape = 100.0, "3 x H100"
    stopped = {"a": "RUNNING", "b": "EXITED"}
    # Pods stop themselves once the run is over: the head's word may be on its way.
    assert judge(stopped, t0, t0 + 29, 900, None, shape, ran={"a", "b"},
                 exited_since={"b": t0 + 20}).action == "wait"
    gone = judge(stopped, t0, t0 + 31, 900, None, shape, ran={"a", "b"},
                 exited_since={"b": t0 + 20})
    assert gone.action == "fail" and gone.gone and "pod b was stopped at RunPod (EXITED)" in \
        gone.why
    # While the head closes the run its workers stop themselves before it says it is over.
    assert judge(stopped, t0, t0 + 31, 900, None, shape, ran={"a", "b"},
                 exited_since={"b": t0 + 20}, grace=90).action == "wait"
    assert judge(stopped, t0, t0 + 51, 900, 0, shape, ran={"a", "b"},
                 exited_since={"b": t0 + 20}).action == "done"  # the head said: over
    failed = judge({"a": "ERROR"}, t0, t0 + 5, 900, None, shape, ran={"a"})
    assert failed.gone and "failed at RunPod (ERROR) while the run went on" in failed.why
    never = judge({"a": "ERROR"}, t0, t0 + 5, 900, None, shape, cluster=True)
    assert not never.gone and "Instant Cluster takes no registry credential" in never.why
    assert "--registry-auth" in judge({"a": "ERROR"}, t0, t0 + 5, 900, None, shape).why


def test_the_cost_of_a_run_from_runpods_own_fields():
    from podagent.launch.watch import CostMeter
    from podagent.platform.runpod_api import rfc3339_ns

    meter = CostMeter()
    created = "2026-11-27T10:00:00Z"
    t = rfc3339_ns(created) / 1e9
    meter.observe("head", {"status": "PROVISIONING", "cost": 2.99, "createdAt": created},
                  t + 60)
    meter.observe("head", {"status": "RUNNING", "cost": 2.99}, t + 1800)
    meter.observe("head", {"status": "EXITED", "cost": 0.0}, t + 3600)  # stopped itself
    meter.observe("w1", {"status": "RUNNING", "cost": 1.0, "createdAt": "nonsense"}, t + 1800)
    meter.close(t + 5400)
    hours, dollars = meter.totals(t + 9999)
    assert hours == pytest.approx(1.0 + 1.0)  # from createdAt; w1 from when it was seen
    assert dollars == pytest.approx(2.99 + 1.0)


def test_a_replacement_under_the_same_name_bills_from_its_own_creation():
    from podagent.launch.watch import CostMeter
    from podagent.platform.runpod_api import rfc3339_ns

    meter = CostMeter()
    t = rfc3339_ns("2026-11-27T10:00:00Z") / 1e9
    meter.observe("w1", {"id": "a", "status": "RUNNING", "cost": 1.0,
                         "createdAt": "2026-11-27T10:00:00Z"}, t + 10)
    meter.close(t + 3600, "w1")  # lost and terminated after an hour
    meter.observe("w1", {"id": "b", "status": "RUNNING", "cost": 2.0,
                         "createdAt": "2026-11-27T11:00:00Z"}, t + 3700)  # seen a bit later
    meter.observe("w1", {"id": "c", "status": "RUNNING", "cost": 2.0,
                         "createdAt": "2026-11-27T12:00:00Z"}, t + 7300)  # never seen gone
    meter.close(t + 10800)
    hours, dollars = meter.totals(t + 99999)
    # b billed until c was first seen (the last look that could tell), c from its creation.
    b = 3700 / 3600
    assert hours == pytest.approx(1.0 + b + 1.0)
    assert dollars == pytest.approx(1.0 + 2.0 * b + 2.0)


def test_a_record_read_twice_is_one_start_and_run_over_ends_the_run():
    from podagent.launch.up import HeadProgress

    board = Board("demo", "2 x H100", expected=1)
    progress = HeadProgress("demo", board, PlainView(io.StringIO()), lambda text: None,
                            lambda phase: None, lambda: "head", 0.0)
    role = parse('{"ts": 1.5, "pod": "p", "event": "role"}')
    for record in (role, role, parse('{"ts": 9.5, "pod": "p", "event": "role"}')):
        progress.take(record)
    assert progress.starts == 2
    progress.take(parse('{"ts": 10, "event": "exit", "code": 3}'))
    assert progress.exit is None  # a start's end is not the run's
    progress.take(parse('{"ts": 11, "event": "run_over", "code": true}'))
    assert progress.exit is None  # a stranger's bytes: not a code
    progress.take(parse('{"ts": 11, "event": "run_over", "code": 3}'))
    assert progress.exit == 3


def test_the_heads_word_on_a_capped_run_reaches_up():
    """The head ending a capped run says its job's grace (`up` waits that long before ending
    the run itself); a start past the deadline ends the run by its code alone (27: nothing
    starts it again), whatever else it said."""
    from podagent.launch.up import HeadProgress

    def progress() -> HeadProgress:
        return HeadProgress("demo", Board("demo", "2 x H100", expected=1),
                            PlainView(io.StringIO()), lambda text: None, lambda phase: None,
                            lambda: "head", 0.0)

    ending = progress()
    ending.take(parse('{"ts": 1, "event": "deadline", "at": 5, "grace_s": 900}'))
    assert ending.capping is not None and ending.capping[1] == 900.0
    hostile = progress()
    hostile.take(parse('{"ts": 1, "event": "deadline", "grace_s": "forever"}'))
    assert hostile.capping is not None and hostile.capping[1] == 0.0
    late = progress()
    late.take(parse('{"ts": 1, "event": "exit", "code": 27}'))
    assert late.exit == 27


def test_the_heads_records():
    assert parse('{"ts": 1, "event": "exit", "code": 3}').kind == "event"
    job = parse('{"ts": "t", "level": "job", "role": "head", "message": "step 1"}')
    assert job.kind == "job" and job.text == "step 1"
    assert parse('{"level": "info", "message": "hi"}').kind == "message"
    assert parse("Traceback (most recent call last):").kind == "text"
    assert parse("[1, 2]").kind == "text"


def test_the_plain_view_says_each_change_once():
    out = io.StringIO()
    view, board = PlainView(out), Board("demo", "2 x H100", expected=1)
    board.row("podagent-demo-head").status = "PROVISIONING"
    view.update(board)
    view.update(board)
    board.row("podagent-demo-head").status = "RUNNING"
    board.joined = 1
    board.set_phase("running the job")
    view.update(board)
    lines = out.getvalue().splitlines()
    assert [line.split(" at ")[0] for line in lines] == [
        "[up] pod podagent-demo-head: PROVISIONING", "[up] run demo: checking",
        "[up] pod podagent-demo-head: RUNNING (was PROVISIONING)", "[up] workers joined: 1/1",
        "[up] run demo: running the job"]


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    return subprocess.run([sys.executable, "-m", "podagent", *argv], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=60)


def test_no_key_is_one_line_and_exit_2():
    result = _cli("up", "--image", "a/b:1", "--gpu", H100)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "podagent: error: no RunPod API key: set RUNPOD_API_KEY, or give --api-key-file FILE "
        "(a key is never taken from the command line)"]


def test_the_key_from_a_file_and_bad_input_before_any_call(tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32 + "\n")
    # An address nothing answers at: a call would fail differently (exit 20, not 2).
    env = {"RUNPOD_API_URL": "http://127.0.0.1:9"}
    result = _cli("up", "--api-key-file", str(key), "--image", "a/b:1", "--gpu", H100,
                  "--pods", "0", env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--pods=0 must be at least 1" in result.stderr


@pytest.mark.parametrize("over", [{}, {"cluster": True}, {"volume_gb": 20},
                                  {"network_volume": "vol_1", "data_centers": ("EU-RO-1",)},
                                  {"image": None, "template": "tpl_abc", "disk_gb": 50},
                                  {"secrets": ("HF_TOKEN=hf",), "registry_auth": "r1"}])
def test_every_body_up_sends_follows_runpods_published_schema(over):
    from tests.fakes.runpod_cloud import SCHEMAS

    spec = build(**over)
    if spec.cluster:
        assert SCHEMAS.errors("CreateClusterRequest", specs.cluster_body(spec)) == []
        return
    placement = specs.Placement(H100, ("US-KS-2",), spec.registry_auth)
    for rank in range(spec.pods):
        body = specs.pod_body(spec, rank, "abc" if rank else None, placement)
        assert SCHEMAS.errors("CreatePodRequest", body) == [], body


def test_the_log_follower_never_dies_of_what_it_meets(monkeypatch):
    """A stream that fails in any way (a bug's exception included) is opened again with a
    growing pause; a failure that lasts is reported once, its end once; a refused key ends
    the follower with a 'lost' record."""
    import queue
    import time

    from podagent.errors import RunPodApiError, RunPodAuthError
    from podagent.launch import follow
    from podagent.waiting import Backoff

    monkeypatch.setattr(follow, "BROKEN_SAY", 0.2)
    monkeypatch.setattr(follow, "BROKEN_BACKOFF", Backoff(0.01, 0.05))
    monkeypatch.setattr(follow, "RECONNECT_PAUSE", 0.01)
    script = [RuntimeError("a reading bug"), RunPodApiError("503")] * 6 + [
        [{"line": '{"event": "role", "ts": 1}'}, {"line": "plain text"}],
        ValueError("odd"), RunPodAuthError("401 invalid api key")]

    class Flaky:
        def stream_logs(self, pod_id, cursor, idle, opened):
            step = script.pop(0)
            if isinstance(step, Exception):
                raise step
            opened()
            yield from step

    records: queue.Queue = queue.Queue()
    log = follow.HeadLog(Flaky(), "pod1", records).start()
    deadline = time.monotonic() + 10
    while log.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    kinds = []
    while not records.empty():
        kinds.append(records.get().kind)
    assert not log.alive and kinds == ["broken", "restored", "event", "text", "lost"]
    assert log.connections == 15


def test_a_run_without_ray_gives_every_pod_the_launcher_and_the_job():
    spec = build(launcher="torchrun", job=("--nproc-per-node", "8", "train.py", "--lr", "1"))
    for rank in (0, 1, 2):
        env = specs.pod_env(spec, rank, head_id="h1")
        assert env["PODAGENT_LAUNCHER"] == "torchrun"
        assert env["PODAGENT_JOB"] == "--nproc-per-node 8 train.py --lr 1"
        assert env["EXPECTED_WORKERS"] == "2"
    ray = specs.pod_env(build(job=("python", "train.py")), 1, head_id="h1")
    assert "PODAGENT_LAUNCHER" not in ray and "PODAGENT_JOB" not in ray


def test_up_takes_exactly_the_declared_options_and_errors_name_their_flag():
    """launch/options.py declares each option once: `up`'s command line is made from it, and
    an error about a value names the flag the declaration gives."""
    from podagent.launch import options

    up = cli.main.commands["up"]
    made = {opt.name: tuple(opt.opts) for opt in up.params if isinstance(opt, click.Option)}
    declared = {o.attr: o.flags for o in options.UP_OPTIONS}
    assert {k: v for k, v in made.items() if k in declared} == declared
    assert set(made) - set(declared) == {"list_gpus", "key_file"}  # actions, not the spec
    defaults = {opt.name: opt.default for opt in up.params if opt.name in declared}
    assert defaults == {o.attr: o.default for o in options.UP_OPTIONS}
    with pytest.raises(ConfigError) as caught:
        build(pods=0)
    assert caught.value.name == options.flag("pods") == "--pods"


def test_a_lost_worker_is_replaced_while_replacements_are_left():
    t0, shape = 100.0, "3 x H100"
    ran = {"head", "w1", "w2"}
    cases = {"terminated": ({"head": "RUNNING", "w1": None, "w2": "RUNNING"}, {}),
             "failed": ({"head": "RUNNING", "w1": "ERROR", "w2": "RUNNING"}, {}),
             "stopped": ({"head": "RUNNING", "w1": "EXITED", "w2": "RUNNING"},
                         {"w1": t0 + 20})}
    for what, (statuses, exited) in cases.items():
        verdict = judge(statuses, t0, t0 + 31, 900, None, shape, ran=ran,
                        exited_since=exited, head="head", spare=1)
        assert (verdict.action, verdict.pod, verdict.gone) == ("replace", "w1", True), what
        # No replacement left, or an Instant Cluster's pod: the run ends, as before.
        for spare, cluster in ((0, False), (1, True)):
            ends = judge(statuses, t0, t0 + 31, 900, None, shape, ran=ran,
                         exited_since=exited, head="head", spare=spare, cluster=cluster)
            assert ends.action == "fail" and ends.gone, (what, spare, cluster)
    # The head lost: the whole run is created again; with no replacement left, it ends.
    head_gone = judge({"head": None, "w1": "RUNNING"}, t0, t0 + 5, 900, None, shape,
                      ran={"head", "w1"}, head="head", spare=3, head_spare=3)
    assert (head_gone.action, head_gone.pod) == ("recreate", "head")
    assert judge({"head": None, "w1": "RUNNING"}, t0, t0 + 5, 900, None, shape,
                 ran={"head", "w1"}, head="head", spare=3, head_spare=0).action == "fail"
    # Lost with a worker listed before it: the head is judged first (the worker's
    # replacement would join a head that is gone).
    both = judge({"w1": None, "head": None}, t0, t0 + 5, 900, None, shape,
                 ran={"head", "w1"}, head="head", spare=1, head_spare=1)
    assert (both.action, both.pod) == ("recreate", "head")
    # A pod that stopped before it ever ran is not a lost one either.
    assert judge({"head": "RUNNING", "w1": "EXITED"}, t0, t0 + 31, 900, None, shape,
                 ran={"head"}, exited_since={"w1": t0}, head="head", spare=3).action == "fail"
    # A pod that never ran is not a lost one.
    never = judge({"head": "RUNNING", "w1": None}, t0, t0 + 5, 900, None, shape, ran={"head"},
                  head="head", spare=3)
    assert never.action == "fail" and not never.gone
    # A replacement gets --timeout to run from its own creation, not from the run's start.
    late = {"head": "RUNNING", "w1": "PROVISIONING"}
    assert judge(late, t0, t0 + 1000, 900, None, shape, ran={"head"}, head="head",
                 born={"w1": t0 + 500}).action == "wait"
    slow = judge(late, t0, t0 + 1401, 900, None, shape, ran={"head"}, head="head",
                 born={"w1": t0 + 500})
    assert slow.action == "fail" and "w1 PROVISIONING" in slow.why


def test_the_record_counts_replacements_and_refuses_a_damaged_list(tmp_path):
    record = state.new(tmp_path, "r", "https://rest.runpod.io", "2 x H100")
    record.replaced("podagent-r-w1", "pod123", "pod podagent-r-w1 was terminated outside")
    again = state.load(tmp_path, "r")
    assert again is not None and [r["lost"] for r in again.replacements] == ["pod123"]
    data = json.loads(state.path_of(tmp_path, "r").read_text())
    data["replacements"] = "many"
    state.path_of(tmp_path, "r").write_text(json.dumps(data))
    with pytest.raises(state.Unreadable, match="replacements are not a list"):
        state.load(tmp_path, "r")


def test_a_head_that_starts_again_after_a_lost_pod_is_not_closing_the_run():
    """A run without Ray ends a start at a lost pod (exit 22) and starts again: its teardown
    is no end of the run, so a lost worker is still replaced meanwhile."""
    from podagent.launch.up import HeadProgress

    progress = HeadProgress("demo", Board("demo", "2 x H100", expected=1),
                            PlainView(io.StringIO()), lambda text: None, lambda phase: None,
                            lambda: "head", 0.0)
    for outcome, closing in (("PeerLost", False), ("JobFailed", True), ("Interrupted", True),
                             ("success", True), ("__class__", True), (7, True)):
        progress.take(parse(json.dumps({"event": "teardown_started", "outcome": outcome})))
        assert progress.closing is closing, outcome


def test_a_run_of_several_pods_gets_a_network_volume_sized_from_its_model():
    assert build().shared_volume_gb == specs.SHARED_DEFAULT  # no model size in the job
    job = ("python", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", "Qwen/Qwen2.5-7B-Instruct",
           "--reward_pretrain", "google/gemma-2-27b", "--lr", "1e-6", "--wandb_run_name",
           "exp-5b", "--prompt_data", "cerebras/SlimPajama-627B")
    # The policy's 7 billion parameters: three checkpoints of 14 bytes each and the 2-byte
    # model, a fifth more (the reward model, the run's name and the dataset do not count).
    assert build(job=job).shared_volume_gb == 370
    size = specs.shared_volume_size
    assert size(("verl.trainer.main_ppo", "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B",
                 "data.train_files=gsm8k")) == 160
    assert size(("bash", "-c", "cd /w && python -m x --pretrain meta-llama/Meta-Llama-3-8B "
                 "--max_len 2048")) == 430
    assert size(("--pretrain", "mistralai/Mixtral-8x7B-v0.1")) == 2960  # 8 x 7, a bound
    assert size(("--pretrain", "Qwen/Qwen1.5-MoE-A2.7B")) == specs.SHARED_DEFAULT
    assert size(("--pretrain=meta-llama/Llama-3.1-405B",)) == specs.SHARED_MAX
    assert build(shared_volume_gb=500).shared_volume_gb == 500
    for none in ({"pods": 1}, {"no_shared_volume": True}, {"volume_gb": 50},
                 {"network_volume": "vol_1"}):
        assert build(**none).shared_volume_gb is None, none
    assert specs.volume_price(100) == pytest.approx(7.0)  # $0.07/GB/month
    assert specs.volume_price(2000) == pytest.approx(70.0 + 50.0)  # $0.05 beyond 1 TB


def test_a_pod_whose_gpus_failed_their_check_is_replaced_at_once():
    """Its own word (a worker's last exit in its log, the head's in the head's): replaced
    without the EXITED grace and whether or not `up` saw it RUNNING; the head's has the run
    created again; past the budget the run ends as a GPU check failure (28), never as a
    lost pod."""
    t0, shape = 100.0, "2 x H100"
    failed = {"w1": "GPU 0 (GPU-1): 2 uncorrected ECC error(s) since the driver loaded"}
    for status in ("RUNNING", "EXITED", "STARTING"):
        verdict = judge({"head": "RUNNING", "w1": status}, t0, t0 + 1, 900, None, shape,
                        ran={"head"}, exited_since={"w1": t0}, head="head", spare=1,
                        failed=failed)
        assert (verdict.action, verdict.pod, verdict.gpu) == ("replace", "w1", True), status
        assert verdict.why == ("pod w1's GPUs failed their check before the job: GPU 0 "
                               "(GPU-1): 2 uncorrected ECC error(s) since the driver loaded")
    head = judge({"head": "EXITED", "w1": "RUNNING"}, t0, t0 + 1, 900, None, shape,
                 ran={"head", "w1"}, head="head", spare=1, head_spare=1,
                 failed={"head": "GPU 0: slow"})
    assert (head.action, head.pod, head.gpu) == ("recreate", "head", True)
    spent = judge({"head": "RUNNING", "w1": "EXITED"}, t0, t0 + 1, 900, None, shape,
                  ran={"head", "w1"}, head="head", spare=0, failed=failed)
    assert (spent.action, spent.gpu) == ("fail", True)
    # The head's exit 28 is not the run's end while a replacement is left (its pod stays or
    # stops after saying it); past the budget it ends the run as a GPU failure.
    for head_exit in (None, 28):
        again = judge({"head": "EXITED", "w1": "RUNNING"}, t0, t0 + 1, 900, head_exit, shape,
                      ran={"head", "w1"}, head="head", head_spare=1,
                      failed={"head": "GPU 0: slow"})
        assert (again.action, again.gpu) == ("recreate", True), head_exit
    assert judge({"head": "EXITED"}, t0, t0 + 1, 900, 28, shape, ran={"head"}, head="head",
                 failed={"head": "GPU 0: slow"}).action == "fail"
    # A stopped worker whose log is still being read is not judged lost before it is read,
    # however long its grace: a GPU failure read late must not end the run as a loss.
    reading = judge({"head": "RUNNING", "w1": "EXITED"}, t0, t0 + 60, 900, None, shape,
                    ran={"head"}, exited_since={"w1": t0}, head="head", spare=1,
                    pending={"w1"})
    assert reading.action == "wait"
    # A detached run followed again: a lost worker is its head's to replace, waited for.
    for status in (None, "EXITED"):
        awaited = judge({"head": "RUNNING", "w1": status}, t0, t0 + 60, 900, None, shape,
                        ran={"head", "w1"}, exited_since={"w1": t0}, head="head",
                        awaited={"w1"})
        assert awaited.action == "wait", status
    # A worker that stopped itself for a cause its replacement would meet (bad input, a
    # refused token) ends the run at once: replacing it would only spend pods.
    doomed = judge({"head": "RUNNING", "w1": "EXITED"}, t0, t0 + 1, 900, None, shape,
                   ran={"head", "w1"}, exited_since={"w1": t0}, head="head", spare=3,
                   doomed={"w1": "exit 13: the head refused this pod's cluster token"})
    assert (doomed.action, doomed.gone, doomed.pod) == ("fail", True, "w1")
    assert doomed.why == ("pod w1 stopped itself: exit 13: the head refused this pod's cluster "
                          "token; a replacement of the same spec would meet the same, so none "
                          "is made")


def test_a_stopped_pods_last_words_are_its_last_exit():
    from podagent.launch.follow import last_words

    lines = ['{"ts": 1, "event": "role"}', "a traceback line",
             '{"ts": 2, "event": "exit", "code": 7, "error": "the head went away"}',
             '{"ts": 3, "event": "exit", "code": 28, "error": "GPU 0: 3 uncorrected  ECC"}']
    words = last_words([parse(x) for x in lines], 28)
    assert words is not None and words.gpu_failure == "GPU 0: 3 uncorrected ECC"
    assert words.suffix() == " (its podagent last exited 28: GPU 0: 3 uncorrected ECC)"
    earlier = last_words([parse(x) for x in lines[:3]], 28)
    assert earlier is not None and earlier.gpu_failure == "" and earlier.code == 7
    # A stranger's bytes: no code is not a code, and nothing is no words.
    odd = last_words([parse('{"event": "exit", "code": true, "error": ["x"]}')], 28)
    assert odd is not None and odd.code is None and odd.suffix() == ""
    assert last_words([parse("plain text")], 28) is None


def test_the_heads_failed_gpu_check_reaches_up_and_a_new_start_clears_it():
    from podagent.launch.up import HeadProgress

    progress = HeadProgress("demo", Board("demo", "2 x H100", expected=1),
                            PlainView(io.StringIO()), lambda text: None, lambda phase: None,
                            lambda: "head", 0.0)
    progress.take(parse('{"ts": 1, "event": "exit", "code": 28, "error": "GPU 1: slow"}'))
    assert progress.gpu_failure == "GPU 1: slow" and progress.exit is None
    progress.take(parse('{"ts": 1.1, "event": "staying", "policy": "stop-pod"}'))
    assert progress.exit is None  # its pod stopping itself: replaced, not the run's end
    progress.take(parse('{"ts": 2, "pod": "p", "event": "role"}'))
    assert progress.gpu_failure == ""
    hostile = '{"event": "exit", "code": 28, "error": "\\u001b]0;owned\\u0007' + "x" * 9000 + '"}'
    progress.take(parse(hostile))
    assert "\x1b" not in progress.gpu_failure and "\x07" not in progress.gpu_failure
    assert len(progress.gpu_failure) == 500 and progress.gpu_failure.startswith("]0;owned x")


def test_every_pod_of_an_up_run_logs_json_and_checks_its_gpu_type():
    """`up` reads a stopped worker's last exit from its log (JSON records), and every pod
    checks that its GPUs are of the catalog's type asked for; the user's own value wins."""
    spec = build(pods=2, job=("python", "x.py"))
    for rank in (0, 1):
        env = specs.pod_body(spec, rank, head_id="h1")["env"]
        assert env["PODAGENT_LOG_FORMAT"] == "json" and env["PODAGENT_GPU_TYPE"] == H100
    assert specs.cluster_body(build(pods=2, cluster=True))["env"]["PODAGENT_GPU_TYPE"] == H100
    own = build(pods=2, env=("PODAGENT_GPU_TYPE=",))
    assert specs.pod_body(own, 1, head_id="h1")["env"]["PODAGENT_GPU_TYPE"] == ""


def test_a_stopped_pods_log_is_read_once_in_its_own_thread_and_never_waited_for_long(
        monkeypatch):
    """Its exit is known as soon as its line comes; a stream kept alive after it (heartbeats,
    no lines) neither holds `up` (pending ends after LAST_WITHIN) nor is read twice; an API
    error means no words."""
    import threading

    from podagent.launch import follow

    monkeypatch.setattr(follow, "LAST_WITHIN", 1.0)
    release = threading.Event()
    opened: list[str] = []

    class Api:  # RunPod's log stream as the reading sees it (a stand-in: no HTTP here)
        def stream_logs(self, pod_id, cursor, idle, tail):
            opened.append(pod_id)
            if pod_id == "gone":
                raise RuntimeError("404")
            yield {"line": '{"event": "exit", "code": 28, "error": "GPU 0: 3 ECC"}'}
            release.wait(30)  # a stream that stays open with nothing more to say

    words = follow.LastWords(Api(), 28)
    words.ask("p1")
    words.ask("p1")  # once
    words.ask("gone")
    deadline = time.monotonic() + 10
    while words.of("p1") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert words.of("p1") is not None and words.of("p1").gpu_failure == "GPU 0: 3 ECC"
    assert words.pending("p1")  # still reading, within LAST_WITHIN
    time.sleep(1.1)
    assert not words.pending("p1") and not words.pending("gone")
    assert words.of("gone") is None and not words.pending("never-asked")
    assert sorted(opened) == ["gone", "p1"]
    release.set()


def test_up_reattached_to_a_run_whose_head_replaces_replaces_no_worker_itself():
    """The head's own env at RunPod says whether it replaces (a detached run's, with the
    account key), whoever's machine follows it: never two replacements of one worker."""
    from types import SimpleNamespace

    from podagent.launch.up import Up

    def head_replaces(env: dict[str, str] | None) -> bool:
        up = Up.__new__(Up)
        up.spec = build(pods=2)
        up.checked = SimpleNamespace(pod_ids={"podagent-demo-head": "h1"})
        up.client = SimpleNamespace(get_pod=lambda pod_id: None if env is None else
                                    {"id": pod_id, "env": env})
        return up._head_replaces("podagent-demo-head")

    key = {"PODAGENT_RUNPOD_API_KEY": "{{ RUNPOD_SECRET_acct }}"}
    assert head_replaces({"PODAGENT_REPLACEMENTS": "3", **key})
    assert not head_replaces({"PODAGENT_REPLACEMENTS": "3"})  # no key: it cannot
    assert not head_replaces({"PODAGENT_REPLACEMENTS": "0", **key})
    assert not head_replaces({"PODAGENT_REPLACEMENTS": "many", **key})
    assert not head_replaces(None)  # the head is gone

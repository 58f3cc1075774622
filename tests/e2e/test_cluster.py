"""Multi-pod bring-up: each pod a network namespace whose cluster interface is named as RunPod
names it (podnet1), a real DNS server for *.runpod.internal, the real podagent in every pod."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from podagent.config.fields import FIELD_BY_ATTR
from podagent.ray_access import ray_compat
from tests.harness.agents import Agent, form_cluster, wait_exits
from tests.harness.pods import wait_for

# Three Ray nodes on a 2-core machine are slow to form: generous, bounded waits.
FORM_TIMEOUT = 240.0
# Before Ray 2.52 a head's `ray start` gives its dashboard a fixed 20 s, and the head starts it
# again each time that is missed (docs/ray-versions.md): with the suite's other lanes busy
# beside the Ray 2.48 run (tests/compat), the head's node was up only after 220 s.
FIXED_DASHBOARD_FORM_TIMEOUT = 480.0
LONG_JOB = "python -c 'import time; print(\"training\", flush=True); time.sleep(600)'"
EXIT_WORKERS_TIMEOUT, EXIT_HEAD_LOST, EXIT_AUTH_REFUSED = 5, 7, 13


@pytest.mark.ray_matrix
def test_cluster_forms_with_workers_started_before_head_dns(make_pod, dns_server, tmp_path,
                                                            agents):
    """a) head + 2 workers form a cluster, the default cluster check passes on 3 nodes, all exit 0;
    b) the workers start first and get NXDOMAIN for the head until it appears in DNS.
    ray_matrix: on Ray 2.48 this check once failed on every rank (ActorDiedError, the driver's
    "SchedulingCancelled: Actor creation cancelled"): see clustercheck.own_node_address."""
    ray_version = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                                 capture_output=True, text=True, timeout=120).stdout.strip()
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                             head_env={"EXPECTED_WORKERS": "2"}, register_head=False)
    # One worker declares itself as the seed did (RAY_WORKER=1); the other is found a worker
    # by comparing RUNPOD_POD_ID with HEAD_POD_ID.
    workers[0].env["RAY_WORKER"] = "1"
    for w in workers:
        w.start()
    head_name = head.pod.dns_name
    wait_for(lambda: len({q.client[0] for q in dns_server.queries_for(head_name)
                          if q.result == "NXDOMAIN"}) >= 2 or None,
             timeout=30, what=f"both workers to get NXDOMAIN for {head_name}")
    for w in workers:
        w.wait_output("NXDOMAIN", timeout=30)

    dns_server.set_record(head_name, head.pod.ip)
    head.start()
    ray = ray_compat.installed()
    codes = wait_exits((head, *workers), FORM_TIMEOUT if ray and ray.has(
        "dashboard_startup_timeout") else FIXED_DASHBOARD_FORM_TIMEOUT)
    assert codes == [0, 0, 0], "\n\n".join(a.output[-2500:] for a in (head, *workers))

    out = head.output
    assert f"(Ray {ray_version}): this pod is the head" in out.splitlines()[0], out[:500]
    assert "CHECK FAILED" not in out, out[-4000:]
    _check_passed_on(out, [head, *workers])
    assert re.search(r"cluster ready: 3 nodes, 0 GPUs .*\(\d+\.\d s\)", out)
    for w in workers:
        assert f"worker joined: {w.pod.ip}" in out
        assert "NCCL preset runpod-global" in w.output
        # podnet1 exists in the pod: the preset check passes. A join attempt that Ray timed out
        # on a loaded machine (seen on Ray 2.48) is retried, and warned of: not a failure; nor
        # is a raylet that exited soon after joining (seen on Ray 2.48 under CI load), which
        # the worker joins again; nor a head whose GCS was slow to answer while its port took
        # connections (seen under CI load: the worker waits for a busy head, as it should).
        tolerated = ("joining failed (attempt", "this pod's raylet exited (rejoin 1 of",
                     "but its port takes connections (a loaded or frozen pod)")
        warnings = [line for line in w.output.splitlines()
                    if "WARNING" in line and not any(t in line for t in tolerated)]
        assert warnings == [], warnings
        assert "the head is closing the run" in w.output
    assert "RAY_WORKER=1" in workers[0].output
    assert "differs from HEAD_POD_ID" in workers[1].output
    # Per run: the pod's podagent log, job.log and events.jsonl.
    run_dir = head.run_dir
    assert "check: ALL CHECKS PASSED" in (run_dir / "job.log").read_text()
    assert (run_dir / f"podagent-head-{head.pod.pod_id}.log").exists()
    assert '"event": "worker_joined"' in (run_dir / "events.jsonl").read_text()


def _check_passed_on(out: str, pods: list[Agent]) -> None:
    """The cluster check's table: one row per pod, every check ticked, gloo over podnet1."""
    assert "check: 3 ranks on 3 nodes, backend gloo" in out, out[-4000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^check: ([\d.]+) +\d .*$", out, re.M)}
    assert set(rows) == {a.pod.ip for a in pods}, out[-4000:]
    for row in rows.values():
        assert "gloo/TCP via podnet1" in row and "✗" not in row, row
        # all_reduce, gather, all_gather, gathers, reward, data, a DDP training step
        assert row.count("✓") == 7, row
    # Data distribution: 1000 samples, batch 8: the steps per epoch shrink as nodes are added.
    assert ("steps per epoch 125 on 1 node (world 1), 63 on 2 nodes (world 2), "
            "42 on 3 nodes (world 3)") in out
    assert re.search(r"^check: all_reduce 16 MiB: algbw [\d.]+ GB/s, busbw [\d.]+ GB/s$", out,
                     re.M)
    assert re.search(r"^check: ddp step: \d+ parameters on 3 ranks, each its own batch: "
                     r"averaged gradients equal on every rank", out, re.M), out[-4000:]
    assert "check: ALL CHECKS PASSED" in out


def _freeze_ray_start_once_its_raylet_runs(pod) -> None:
    """SIGSTOP the pod's `ray start` once it has started its raylet: the raylet registers (the
    head counts the node) while `ray start` never returns, as on a loaded pod whose join is
    slow past the head's timeout."""
    def frozen() -> bool:
        procs = [p for pid in pod.pids() if (p := _process(pid))]
        if not any(p.name() == "raylet" for p in procs):
            return False
        starts = [p for p in procs if "start" in p.cmdline()
                  and any(a.startswith("--address") for a in p.cmdline())]
        assert starts, "`ray start` ended before the raylet was seen: nothing to freeze"
        for p in starts:
            p.send_signal(signal.SIGSTOP)
        return True

    wait_for(frozen, timeout=FORM_TIMEOUT, interval=0.02,
             what=f"{pod.name}'s raylet started by `ray start`", ignore=(psutil.Error,))


def _process(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid)
    return None


def test_missing_worker_times_out_naming_who_joined(make_pod, dns_server, tmp_path, agents):
    """c) EXPECTED_WORKERS=3 with 2 workers: the head exits 5 and names the two that joined.
    The workers do not wait for the head to come back (PODAGENT_REJOIN=0). One of them is
    still in its `ray start` when the head gives up (its raylet registered, `ray start` frozen):
    it sees the head's closing there too, and leaves with 0 rather than see the head vanish."""
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                             head_env={"EXPECTED_WORKERS": "3",
                                       "PODAGENT_WORKER_TIMEOUT": "60"},
                             worker_env={"PODAGENT_REJOIN": "0"})
    for a in (head, *workers):
        a.start()
    _freeze_ray_start_once_its_raylet_runs(workers[1].pod)
    assert head.wait_exit(FORM_TIMEOUT) == EXIT_WORKERS_TIMEOUT, head.output[-3000:]
    error = [line for line in head.output.splitlines() if "ERROR" in line]
    assert len(error) == 1, head.output[-3000:]
    assert "only 2 of 3 workers joined" in error[0]
    for w in workers:
        assert w.pod.ip in error[0]
    # The head closed the cluster in order: the workers leave with 0.
    assert wait_exits(workers, 60) == [0, 0], "\n\n".join(w.output[-2500:] for w in workers)
    assert "this pod was still joining: stopped the attempt" in workers[1].output
    assert not workers[1].pod.pids()


REWARD_CLIENT = """
import json, sys, urllib.request
body = {"query": ["Compute 6 * 7. The answer is \\\\boxed{42}", "Compute 6 * 7. \\\\boxed{41}"],
        "prompts": ["Compute 6 * 7.", "Compute 6 * 7."], "labels": ["42", "42"]}
request = urllib.request.Request(sys.argv[1], json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as reply:
    print(reply.status, json.dumps(json.load(reply)["rewards"]))
"""


def _worker_gets_rewards_from_the_head(head: Agent, worker: Agent) -> None:
    """A process in a worker pod calls REMOTE_RM_URL: it must reach the head, never loopback."""
    (url,) = re.findall(r"answers a real request at (http://\S+/get_reward)", head.output)
    assert url.startswith(f"http://{head.pod.ip}:"), url
    result = worker.pod.run([sys.executable, "-c", REWARD_CLIENT, url], timeout=60)
    assert result.returncode == 0, result.stderr
    # openrlhf-m, the default profile: accuracies 1 and 0; no format bonus (no <think> block).
    assert result.stdout.strip() == "200 [1.0, 0.0]", result.stdout


# Secrets set on every pod, as a RunPod template's secrets would be.
SECRETS = {"WANDB_API_KEY": "wandb-e2e-3f9a1c77d2", "HF_TOKEN": "hf_e2eTokenZq81",
           "RUNPOD_API_KEY": "rpa_e2e_K3y_91xx", "MY_SERVICE_SECRET": "svc-e2e-S3cr3t"}


def _no_secret_on_any_command_line(*agents: Agent) -> None:
    """Every process of every pod (podagent, Ray's daemons, the job, the reward server)."""
    for agent in agents:
        for pid in agent.pod.pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue  # it exited meanwhile
            for name, value in SECRETS.items():
                assert value not in cmdline, f"{name} on the command line of pid {pid}"


def _no_secret_in_output_or_logs(root: Path, *agents: Agent) -> None:
    # podagent's output and run dirs, and Ray's own logs in each pod's Ray temp dir.
    roots = [root, *(Path(a.ray_tmp) for a in agents)]
    files = [p for r in roots for p in r.rglob("*") if p.is_file() and not p.is_symlink()]
    for path in files:
        text = path.read_bytes().decode(errors="replace")
        for name, value in SECRETS.items():
            assert value not in text, f"{name} appears in {path}"


def test_head_killed_workers_leave_within_grace(make_pod, dns_server, tmp_path, agents):
    """d) the head pod dies after the cluster formed: both workers exit 7 within grace + 5 s
    (PODAGENT_REJOIN=0: they do not wait for the head to come back); every pod's checkpoint dir
    and logs survive. Before that the head pod gets no CPU for longer than the grace (a loaded
    pod: its Ray takes connections and answers nothing): the workers stay."""
    grace = FIELD_BY_ATTR["head_grace"].default  # the default: not set here
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                             head_env={"EXPECTED_WORKERS": "2", "PODAGENT_JOB": LONG_JOB,
                                       "WANDB_MODE": "offline",
                                       **SECRETS},
                             worker_env={**SECRETS, "PODAGENT_REJOIN": "0"})
    checkpoints = {}
    for a in (head, *workers):
        # A checkpoint the job wrote before the fault (on a real pod: the network volume).
        saved = tmp_path / "checkpoints" / a.pod.name / "global_step10" / "model.pt"
        saved.parent.mkdir(parents=True)
        saved.write_bytes(b"weights")
        checkpoints[a.pod.name] = saved
        a.env["PODAGENT_CHECKPOINT_DIR"] = str(saved.parent.parent)
    for a in (head, *workers):
        a.start()
    # The job's own line, not the submission line that shows its command.
    head.wait_output("\ntraining\n", timeout=FORM_TIMEOUT)
    for w in workers:
        w.wait_output("watching the head", timeout=30)
    _worker_gets_rewards_from_the_head(head, workers[0])
    _no_secret_on_any_command_line(head, *workers)
    head.freeze_pod()
    try:
        for w in workers:
            w.wait_output("but its port takes connections", timeout=grace + 30)
    finally:
        head.freeze_pod(False)
    for w in workers:
        w.wait_output("head reachable again after", timeout=30)
        assert "has been unreachable" not in w.output and w.proc.poll() is None, w.said()
    killed_at = time.monotonic()
    head.kill_pod()
    codes = wait_exits(workers, grace + 5 + 30)
    took = time.monotonic() - killed_at
    assert codes == [EXIT_HEAD_LOST] * 2, "\n\n".join(w.output[-2000:] for w in workers)
    assert took <= grace + 5, f"workers took {took:.1f} s to leave"
    for w in workers:
        assert "has been unreachable" in w.output
        assert w.pod.pids() == [], f"{w.pod.name} left processes behind: {w.pod.pids()}"
    _no_secret_in_output_or_logs(tmp_path, head, *workers)
    for a in (head, *workers):
        assert checkpoints[a.pod.name].read_bytes() == b"weights", a.pod.name
        run_dir = a.run_dir
        role = "head" if a is head else "worker"
        assert (run_dir / f"podagent-{role}-{a.pod.pod_id}.log").stat().st_size > 0
        assert (run_dir / "events.jsonl").stat().st_size > 0
    assert "training" in (head.run_dir / "job.log").read_text()
    assert "resuming: " in head.output  # the head saw the checkpoint (PODAGENT_RESUME=auto)


def test_worker_with_a_wrong_token_is_refused_and_never_joins(make_pod, dns_server, tmp_path,
                                                             agents):
    """l) token auth: a worker whose cluster token differs is refused at once (exit 13)."""
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                               head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                                         "PODAGENT_TOKEN": "right-" + "1" * 32},
                               worker_env={"PODAGENT_TOKEN": "wrong-" + "2" * 32})
    head.start()
    head.wait_output("waiting for 1 worker(s)", timeout=FORM_TIMEOUT)
    worker.start()
    assert worker.wait_exit(60) == EXIT_AUTH_REFUSED, worker.output[-3000:]
    errors = [line for line in worker.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "refused this pod: it has a different cluster token" in errors[0]
    assert "joined the cluster" not in worker.output
    assert "worker joined" not in head.output
    assert "NO CLUSTER TOKEN" not in head.output
    assert worker.pod.pids() == []


def test_flaky_dns_then_answers_with_a_stale_record_first_worker_joins(make_pod, dns_server,
                                                                      tmp_path, agents):
    """b) the DNS server answers SERVFAIL, then not at all, then properly but with a stale
    record (an earlier head pod's address, first) beside the head's: the worker asks both and
    joins the one that answers, and what it printed told DNS trouble apart from a name that
    does not exist."""
    earlier = make_pod("oldhead")  # its address comes first; nothing listens there any more
    # What is tested is finding the head: a trivial job, not the cluster check.
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                               head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                                         "PODAGENT_JOB": f"{sys.executable} -c pass"})
    dns_server.mode = "servfail"
    worker.start()
    worker.wait_output("SERVFAIL (the DNS server failed or refused to answer", timeout=30)
    dns_server.mode = "timeout"
    worker.wait_output("timeout (no DNS server answered in time)", timeout=30)
    dns_server.set_records(head.pod.dns_name, [earlier.ip, head.pod.ip])
    dns_server.mode = "normal"
    head.start()
    assert wait_exits((head, worker), FORM_TIMEOUT) == [0, 0], (
        head.output[-2000:] + "\n\n" + worker.output[-2000:])
    assert f"worker joined: {worker.pod.ip}" in head.output
    assert (f"the head's name has 2 addresses ({earlier.ip}, {head.pod.ip}): {head.pod.ip} "
            f"answers") in worker.output
    assert "NXDOMAIN" not in worker.output  # the name existed all along

"""Runs without Ray on three namespaced pods (real DNS): `podagent torchrun` and `podagent
accelerate` with a gloo DDP loop give every rank its place; a pod lost mid-run (killed, or cut
off and then killed) takes every other pod out within seconds, naming it; `podagent stop`,
`status` and `logs` work from a worker; a finished run is not started again."""

from __future__ import annotations

import json
import time
from pathlib import Path

from podagent import errors
from podagent.run import exits
from tests.harness.agents import Agent, form_cluster, wait_exits
from tests.harness.pods import _ip, wait_for

JOBS = Path(__file__).resolve().parents[1] / "jobs"
LOOP = JOBS / "ddp_loop.py"
# torch looks up the host name of every TCPStore peer (getnameinfo; "The hostname of the client
# socket cannot be retrieved. err=-3" when it fails). Pods reach no name server of this
# machine's resolv.conf, so each lookup would wait out glibc's 2 x 5 s: one try of 1 s.
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}
LOSS_DEADLINE = 15.0  # the acceptance's bound: every other pod out this soon after a loss


def _code(error: type[errors.PodagentError]) -> int:
    return next(code for cls, code, _ in exits.EXIT_CODES if cls is error)


def _three_pods(make_pod, dns_server, tmp_path, agents, launcher: str, *launcher_args: str,
                env: dict[str, str] | None = None) -> tuple[list[Agent], Path]:
    out = tmp_path / "ranks"
    out.mkdir(exist_ok=True)
    pod_env = {**QUICK_RESOLVER, "EXPECTED_WORKERS": "2", **(env or {})}
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env=pod_env, worker_env=pod_env)
    pods = [head, *workers]
    for a in pods:
        a.argv = (*a.argv, launcher, *launcher_args)
    return pods, out


def _start(pods: list[Agent]) -> None:
    for a in reversed(pods):  # the workers first: they wait for the head
        a.start()


def _ranks(out: Path, world: int = 3) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _under_way(out: Path, pods: list[Agent]) -> None:
    """Every rank has done a step: the run is mid-way."""
    def started() -> bool:
        for a in pods:
            if a.proc and a.proc.poll() is not None:
                raise AssertionError(f"{a.pod.name} exited {a.proc.returncode} early:\n"
                                     f"{a.output[-3000:]}")
        return all((out / f"rank{r}.json").exists() for r in range(3))

    wait_for(started, timeout=120, interval=0.2, what="every rank's first step")


def _mid_run(make_pod, dns_server, tmp_path, agents, launcher: str,
             *launcher_args: str, env: dict[str, str] | None = None) -> list[Agent]:
    """Three pods in a loop that runs until stopped, every rank past its first step."""
    loop = ("--accelerate",) if launcher == "accelerate" else ()
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents, launcher, *launcher_args,
                            str(LOOP), str(tmp_path / "ranks"), *loop, "--steps", "100000",
                            "--step-seconds", "0.1", env=env)
    _start(pods)
    _under_way(out, pods)
    return pods


def _all_out(pods: list[Agent], since: float, deadline: float) -> list[int]:
    codes = wait_exits(pods, max(0.1, since + deadline - time.monotonic()))
    for a in pods:  # nothing of the run is left in any pod: no launcher, no training process
        wait_for(lambda a=a: not a.pod.pids(), timeout=10, interval=0.1,
                 what=f"{a.pod.name} to hold no process")
    return codes


def _assert_ranks(out: Path, mode: str) -> None:
    ranks = _ranks(out)
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert {r["world"] for r in ranks} == {3}
    assert sorted(r["node"] for r in ranks) == [0, 1, 2]  # every pod its own machine rank
    assert {r["mode"] for r in ranks} == {mode}
    assert not any(r["node_rank_set"] for r in ranks)  # nobody typed a NODE_RANK


def test_torchrun_on_three_pods_with_the_data_check_first_then_not_again_once_finished(
        make_pod, dns_server, tmp_path, agents):
    # With a cluster token: every hello carries it; the training never sees it. With a hang
    # watch far shorter than its default: a healthy run never trips it.
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents, "torchrun", "--data-check",
                            "--", str(LOOP), str(tmp_path / "ranks"),
                            env={"PODAGENT_TOKEN": "e2e-cluster-token-0123456789",
                                 "PODAGENT_HANG_TIMEOUT": "30"})
    _start(pods)
    codes = wait_exits(pods, 180)
    assert codes == [0, 0, 0], "\n\n".join(a.output[-3000:] for a in pods)
    _assert_ranks(out, "torchrun")
    assert not any(r["token_seen"] for r in _ranks(out))
    assert all("HANG" not in a.output for a in pods)
    head = pods[0]
    # The data check ran through the same launcher first, and passed with its numbers.
    assert "data check: 3 ranks" in head.output and "none seen by two ranks" in head.output
    assert head.output.index("data check: 3 ranks") < head.output.index("training: ")
    assert f"--rdzv-endpoint {head.pod.ip}:29500" in head.output
    for w in pods[1:]:
        assert f"worker {w.pod.ip} ({w.pod.pod_id}) joined the rendezvous" in head.output
    # The run dir holds the ledger and events, as for a Ray run: a container started again
    # finds the run finished and does not run it again.
    again = head.restarted()
    agents.append(again)
    assert again.start().wait_exit(60) == 0, again.output[-3000:]
    assert "run e2e finished earlier (succeeded" in again.output
    assert "training: " not in again.output


def test_accelerate_on_three_pods_gives_each_machine_its_rank(make_pod, dns_server, tmp_path,
                                                              agents):
    config = tmp_path / "accelerate.yaml"
    # A config written for one machine, as a user copies it to every pod: podagent overrides
    # its per-machine keys and says so.
    config.write_text("distributed_type: MULTI_GPU\nnum_machines: 1\nmachine_rank: 0\n"
                      "num_processes: 1\nmixed_precision: 'no'\n")
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents, "accelerate",
                            "--config_file", str(config), str(LOOP), str(tmp_path / "ranks"),
                            "--accelerate")
    _start(pods)
    codes = wait_exits(pods, 180)
    assert codes == [0, 0, 0], "\n\n".join(a.output[-3000:] for a in pods)
    _assert_ranks(out, "DistributedType.MULTI_CPU")
    head = pods[0]
    assert "num_machines 1 -> 3" in head.output.replace(":", "")
    assert "--machine_rank 0" in head.output
    ranks_of = {r["node"] for r in _ranks(out)}
    assert ranks_of == {0, 1, 2}


def test_a_worker_killed_mid_run_takes_every_pod_out_naming_it(make_pod, dns_server, tmp_path,
                                                               agents):
    pods = _mid_run(make_pod, dns_server, tmp_path, agents, "torchrun", "--")
    lost = pods[1]
    lost.kill_pod()
    t0 = time.monotonic()
    codes = _all_out([pods[0], pods[2]], t0, LOSS_DEADLINE)
    assert codes == [_code(errors.PeerLost)] * 2
    for a in (pods[0], pods[2]):
        assert f"ERROR: pod {lost.pod.ip} ({lost.pod.pod_id}) was lost" in a.output, \
            a.output[-3000:]


def test_fewer_workers_will_do_down_to_the_minimum(make_pod, dns_server, tmp_path, agents):
    """PODAGENT_MIN_WORKERS, as on the Ray path: one of two workers never comes; after
    PODAGENT_WORKER_TIMEOUT the run goes on with the pods that came, ranked among themselves."""
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents, "torchrun", "--",
                            str(LOOP), str(tmp_path / "ranks"),
                            env={"PODAGENT_MIN_WORKERS": "1", "PODAGENT_WORKER_TIMEOUT": "8"})
    came = pods[:2]
    _start(came)
    codes = wait_exits(came, 180)
    assert codes == [0, 0], "\n\n".join(a.output[-3000:] for a in came)
    ranks = _ranks(out, world=2)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    head = came[0]
    assert "1 of 2 workers joined" in head.output and "PODAGENT_MIN_WORKERS=1" in head.output
    assert "only 2 node(s) came" in head.output


def test_without_the_minimum_the_run_is_not_started(make_pod, dns_server, tmp_path, agents):
    pods, _ = _three_pods(make_pod, dns_server, tmp_path, agents, "torchrun", "--",
                          str(LOOP), str(tmp_path / "ranks"),
                          env={"PODAGENT_WORKER_TIMEOUT": "8"})
    came = pods[:2]
    _start(came)
    codes = wait_exits(came, 120)
    assert codes == [_code(errors.WorkersTimeout)] * 2, "\n\n".join(a.output[-3000:]
                                                                     for a in came)
    assert not (tmp_path / "ranks" / "rank0.json").exists()


def test_a_lost_pod_with_on_node_loss_fail_ends_the_run_for_good(make_pod, dns_server,
                                                                tmp_path, agents):
    """PODAGENT_ON_NODE_LOSS=fail, as on the Ray path: the training decides, a lost pod breaks
    it, and the run is not started again (a restarted container finds it finished)."""
    pods = _mid_run(make_pod, dns_server, tmp_path, agents, "torchrun", "--",
                    env={"PODAGENT_ON_NODE_LOSS": "fail"})
    lost = pods[1]
    lost.kill_pod()
    t0 = time.monotonic()
    codes = _all_out([pods[0], pods[2]], t0, LOSS_DEADLINE)
    assert codes == [_code(errors.JobFailed)] * 2, pods[0].output[-3000:]
    assert "PODAGENT_ON_NODE_LOSS=fail" in pods[0].output
    again = pods[0].restarted()
    agents.append(again)
    assert again.start().wait_exit(60) == _code(errors.JobFailed), again.output[-3000:]
    assert "finished earlier (JobFailed" in again.output
    assert "training: " not in again.output


def test_a_worker_cut_off_then_killed_takes_every_pod_out_naming_it(make_pod, dns_server,
                                                                    tmp_path, agents):
    pods = _mid_run(make_pod, dns_server, tmp_path, agents, "accelerate")
    cut = pods[2]
    # Its host vanishes: the link goes down first, so nobody gets a reset; the collectives of
    # the others would wait for it until gloo's own timeout.
    _ip("link", "set", cut.pod.host_veth, "down")
    t0 = time.monotonic()
    codes = _all_out(pods[:2], t0, LOSS_DEADLINE)
    assert codes == [_code(errors.PeerLost)] * 2
    for a in pods[:2]:
        line = f"ERROR: pod {cut.pod.ip} ({cut.pod.pod_id}) was lost: silent for 5 s"
        assert line in a.output, a.output[-3000:]
    # The pod cut off stopped its own training too: it heard nothing from its head.
    assert cut.wait_exit(LOSS_DEADLINE) == _code(errors.PeerLost), cut.output[-3000:]
    assert "was lost: silent for 5 s" in cut.output
    cut.kill_pod()
    assert not cut.pod.pids()


def test_status_logs_and_stop_from_a_worker(make_pod, dns_server, tmp_path, agents):
    pods = _mid_run(make_pod, dns_server, tmp_path, agents, "torchrun", "--")
    worker = pods[2]

    def ask(*command: str) -> tuple[str, str]:
        done = worker.pod.run([*worker.argv[:3], *command], env=worker.env, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout, done.stderr

    status = json.loads(ask("status", "--json")[0])
    assert status["launcher"] == "torchrun" and status["step"] == "training"
    # The head is machine 0, the workers follow in the order of their pod ids.
    workers = sorted(a.pod.pod_id for a in pods[1:])
    assert [(p["rank"], p["pod"]) for p in status["pods"]] == [
        (0, pods[0].pod.pod_id), (1, workers[0]), (2, workers[1])]
    assert {p["state"] for p in status["pods"][1:]} == {"running"}
    assert "rank 0 step 1" in ask("logs")[0]  # the head's training output, from a worker
    assert "every pod of the run is out" in ask("stop")[1]
    codes = wait_exits(pods, 30)
    assert codes == [_code(errors.JobStopped)] * 3, "\n\n".join(a.output[-2000:] for a in pods)
    for a in pods:
        wait_for(lambda a=a: not a.pod.pids(), timeout=10, interval=0.1,
                 what=f"{a.pod.name} to hold no process")

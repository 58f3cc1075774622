"""`podagent torchrun` on namespaced pods: a DDP step with gloo, ranks from the rendezvous
(nobody sets NODE_RANK), and both pods agree on the averaged gradient; a rendezvous that not
every pod came to ends at the deadline with a line that says who came."""

from __future__ import annotations

import json

import torch

from podagent import cli, errors
from tests.harness.agents import Agent, form_cluster

EXIT_WORKERS_TIMEOUT = next(code for cls, code, _ in cli.EXIT_CODES
                            if cls is errors.WorkersTimeout)
EXIT_HEAD_UNREACHABLE = next(code for cls, code, _ in cli.EXIT_CODES
                             if cls is errors.HeadUnreachable)

DDP_STEP = """
import json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ddp = DistributedDataParallel(model)  # kept referenced: its reducer syncs in backward()
x = torch.full((8, 4), float(rank + 1))
loss = torch.nn.functional.mse_loss(ddp(x), torch.zeros(8, 1))
loss.backward()  # DDP averages the gradient over the ranks here
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"world": dist.get_world_size(), "node": int(os.environ["GROUP_RANK"]),
               "node_rank_set": "NODE_RANK" in os.environ,
               "master": os.environ["MASTER_ADDR"],
               "grad": [g for p in model.parameters() for g in p.grad.flatten().tolist()]}, f)
dist.destroy_process_group()
# Leave without finalizing the interpreter. The allreduce that backward() started holds a Python
# object (autograd's context); when gloo's worker thread drops the last reference to it only
# after this interpreter began to finalize, that thread takes the GIL, is ended by Python, and
# the process aborts ("terminate called without an active exception", SIGABRT; torch's bug,
# pytorch/pytorch#190489). Under CPU load that was one run in five, and the other pod's
# torchrun, whose ranks had succeeded, then waited out torch's 300 s exit barrier: the "hang".
sys.stdout.flush()
os._exit(0)
"""


def _expected_mean_gradient(world: int) -> list[float]:
    grads = []
    for rank in range(world):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        x = torch.full((8, 4), float(rank + 1))
        torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return (sum(grads) / world).tolist()


def test_ddp_step_over_two_pods_agrees_on_the_averaged_gradient(make_pod, dns_server, tmp_path,
                                                                 agents):
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_STEP)
    out = tmp_path / "ranks"
    out.mkdir()
    # torch looks up the host name of every TCPStore peer (getnameinfo; "The hostname of the
    # client socket cannot be retrieved. err=-3" when it fails). Pods reach no name server of
    # this machine's resolv.conf, so each lookup waits out glibc's 2 x 5 s: harmless, but
    # 20 s of this test. One try of 1 s ends it the same way.
    quick_resolver = {"RES_OPTIONS": "timeout:1 attempts:1"}
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                   head_env=quick_resolver, worker_env=quick_resolver)
    argv = ("torchrun", "--", str(script), str(out))
    pods: list[Agent] = []
    for a in (worker, head):  # the worker first: it waits for the head's rendezvous
        a.argv = (*a.argv, *argv)
        pods.append(a.start())
    codes = [a.wait_exit(180) for a in pods]
    assert codes == [0, 0], "\n\n".join(a.output[-3000:] for a in pods)

    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in results] == [2, 2]
    assert sorted(r["node"] for r in results) == [0, 1]  # the rendezvous gave each node a rank
    assert not any(r["node_rank_set"] for r in results)
    expected = _expected_mean_gradient(2)
    for r in results:
        assert r["grad"] == results[0]["grad"]  # the same averaged gradient on both pods
        assert all(abs(a - b) < 1e-6 for a, b in zip(r["grad"], expected, strict=True))
    assert results[0]["master"] in (head.pod.ip, worker.pod.ip)
    assert f"--rdzv-endpoint {head.pod.ip}:29500" in head.output
    assert f"head found at {head.pod.ip}" in worker.output
    assert "is_host=0" in worker.output and "is_host=1" in head.output
    assert f"worker {worker.pod.ip} ({worker.pod.pod_id}) joined the rendezvous" in head.output


def _torchrun(agent: Agent, tmp_path) -> Agent:
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('torchrun must not have started')\n")
    agent.argv = (*agent.argv, "torchrun", "--", str(script))
    return agent.start()


def test_the_head_gives_up_on_a_worker_that_never_comes_and_names_who_came(
        make_pod, dns_server, tmp_path, agents):
    head, (came, _never) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                        head_env={"EXPECTED_WORKERS": "2",
                                                  "PODAGENT_WORKER_TIMEOUT": "8"},
                                        worker_env={"EXPECTED_WORKERS": "2"})
    _torchrun(came, tmp_path)
    # The head starts once the worker tries to reach it: the head's 8 s are not spent on the
    # worker's own start.
    came.wait_output(f"rendezvous e2e at {head.pod.ip}:29500, 3 node(s)", timeout=60)
    _torchrun(head, tmp_path)
    assert head.wait_exit(60) == EXIT_WORKERS_TIMEOUT, head.output[-3000:]
    line = (f"podagent: error: rendezvous e2e at {head.pod.ip}:29500: 2 of 3 nodes joined "
            f"within 8 s (head {head.pod.ip} ({head.pod.pod_id}), worker {came.pod.ip} "
            f"({came.pod.pod_id})); missing: 1 worker (EXPECTED_WORKERS=2)")
    assert line in head.output.splitlines(), head.output[-3000:]
    # The worker that came is told, and exits as the head did, with the head's line.
    assert came.wait_exit(60) == EXIT_WORKERS_TIMEOUT, came.output[-3000:]
    assert f"the head gave up: {line.removeprefix('podagent: error: ')}" in came.output
    assert "exec:" not in head.output + came.output  # torchrun never started
    assert "Traceback" not in head.output + came.output


def test_a_worker_gives_up_on_a_head_that_never_comes_at_its_deadline(
        make_pod, dns_server, tmp_path, agents):
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                   worker_env={"PODAGENT_HEAD_TIMEOUT": "5"})
    _torchrun(worker, tmp_path)  # the head's pod is up and named, its podagent never starts
    assert worker.wait_exit(60) == EXIT_HEAD_UNREACHABLE, worker.output[-3000:]
    assert (f"podagent: error: rendezvous e2e at {head.pod.ip}:29500: the head's podagent "
            f"torchrun did not answer within 5 s (last try: Connection refused)"
            in worker.output.splitlines()), worker.output[-3000:]
    assert "exec:" not in worker.output

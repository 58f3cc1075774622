"""`podagent torchrun` on namespaced pods: a rendezvous that not every pod came to ends at the
deadline with a line that says who came (a run that forms: tests/e2e/test_without_ray.py)."""

from __future__ import annotations

from podagent import cli, errors
from tests.harness.agents import Agent, form_cluster

EXIT_WORKERS_TIMEOUT = next(code for cls, code, _ in cli.EXIT_CODES
                            if cls is errors.WorkersTimeout)
EXIT_HEAD_UNREACHABLE = next(code for cls, code, _ in cli.EXIT_CODES
                             if cls is errors.HeadUnreachable)

def _torchrun(agent: Agent, tmp_path) -> Agent:
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('torchrun must not have started')\n")
    agent.argv = (*agent.argv, "torchrun", "--", str(script))
    return agent.start()


def test_the_head_gives_up_on_a_worker_that_never_comes_and_names_who_came(
        make_pod, dns_server, tmp_path, agents):
    head, (came, _never) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                        head_env={"EXPECTED_WORKERS": "2",
                                                  "PODAGENT_WORKER_TIMEOUT": "4"},
                                        worker_env={"EXPECTED_WORKERS": "2"})
    _torchrun(came, tmp_path)
    # The head starts once the worker tries to reach it: the head's 4 s are not spent on the
    # worker's own start.
    came.wait_output(f"rendezvous e2e at {head.pod.ip}:29510: 3 node(s)", timeout=60)
    _torchrun(head, tmp_path)
    assert head.wait_exit(60) == EXIT_WORKERS_TIMEOUT, head.output[-3000:]
    line = (f"rendezvous e2e at {head.pod.ip}:29510: 2 of 3 nodes joined "
            f"within 4 s (head {head.pod.ip} ({head.pod.pod_id}), worker {came.pod.ip} "
            f"({came.pod.pod_id})); missing: 1 worker (EXPECTED_WORKERS=2)")
    assert f"[head] ERROR: {line}" in head.output.splitlines(), head.output[-3000:]
    # The worker that came is told, and exits as the head did, with the head's line.
    assert came.wait_exit(60) == EXIT_WORKERS_TIMEOUT, came.output[-3000:]
    assert f"[worker] ERROR: the head gave up: {line}" in came.output
    assert "training:" not in head.output + came.output  # torchrun never started
    assert "Traceback" not in head.output + came.output


def test_a_worker_gives_up_on_a_head_that_never_comes_at_its_deadline(
        make_pod, dns_server, tmp_path, agents):
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                   worker_env={"PODAGENT_HEAD_TIMEOUT": "5"})
    _torchrun(worker, tmp_path)  # the head's pod is up and named, its podagent never starts
    assert worker.wait_exit(60) == EXIT_HEAD_UNREACHABLE, worker.output[-3000:]
    assert (f"[worker] ERROR: rendezvous e2e at {head.pod.ip}:29510: the head's podagent "
            f"did not answer within 5 s (last try: Connection refused)"
            in worker.output.splitlines()), worker.output[-3000:]
    assert "training:" not in worker.output

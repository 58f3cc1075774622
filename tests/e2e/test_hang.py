"""A hung rank on three namespaced pods (real DNS, gloo): the progress watch finds it within
PODAGENT_HANG_TIMEOUT (+10 s), every pod dumps its ranks' stacks, the head names the rank that
is not in a collective, and the run is restarted from its checkpoint and finishes (exit 0);
with restarts off it ends with its own code (RunHung) and nothing of it is left running.

Runs without Ray here; the Ray path's are in test_hang_ray.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from podagent import errors
from podagent.run import exits
from tests.harness.agents import Agent, form_cluster, wait_exits
from tests.harness.pods import wait_for

JOBS = Path(__file__).resolve().parents[1] / "jobs"
HANG_LOOP = JOBS / "hang_loop.py"
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}  # see test_without_ray.py
HANG_TIMEOUT = 25.0  # torch's start on three pods under the suite's load took past 15 s
DETECTED_WITHIN = HANG_TIMEOUT + 10.0  # the acceptance's bound
HUNG_RANK = 2


def _code(error: type[errors.PodagentError]) -> int:
    return next(code for cls, code, _ in exits.EXIT_CODES if cls is error)


def events(agent: Agent, name: str) -> list[dict]:
    path = agent.run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def hung_at(out: Path) -> float:
    return json.loads((out / "hung").read_text())["at"]


def assert_dumped_and_named(pods: list[Agent], out: Path) -> dict:
    """The head's hang event: within the bound of the hang, every rank dumped to a file on its
    pod, and the sleeping rank (on the last pod) the one culprit."""
    head = pods[0]
    [hang] = events(head, "hang")[:1] or [None]
    assert hang is not None, head.said()
    assert hang["ts"] - hung_at(out) <= DETECTED_WITHIN, hang
    dumped = {s["rank"]: (pod, s) for pod, d in hang["pods"].items() for s in d["stacks"]}
    assert sorted(dumped) == [0, 1, 2], hang["pods"]
    for rank, (_, stack) in dumped.items():
        assert Path(stack["file"]).read_text().count("Thread") >= 1, stack
        assert stack["collective"] is (rank != HUNG_RANK), stack
    assert [c["name"] for c in hang["culprits"]] == [f"rank {HUNG_RANK}"], hang["culprits"]
    assert hang["culprits"][0]["pod"] == dumped[HUNG_RANK][0]
    assert pods[2].pod.pod_id in dumped[HUNG_RANK][0]
    assert f"likely culprit: rank {HUNG_RANK} on pod" in head.output
    return hang


def _three_pods(make_pod, dns_server, tmp_path, agents, env: dict[str, str]
                ) -> tuple[list[Agent], Path]:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    pod_env = {**QUICK_RESOLVER, "EXPECTED_WORKERS": "2",
               "PODAGENT_HANG_TIMEOUT": f"{HANG_TIMEOUT:g}", "PODAGENT_RESTART_BACKOFF": "0",
               **env}
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env=pod_env, worker_env=pod_env)
    pods = [head, *workers]
    for a in pods:
        a.argv = (*a.argv, "torchrun", "--", str(HANG_LOOP), str(out), str(ckpt),
                  "--steps", "12", "--hang-rank", str(HUNG_RANK), "--hang-at", "5")
    for a in reversed(pods):
        a.start()
    return pods, out


def _nothing_left(pods: list[Agent]) -> None:
    for a in pods:
        wait_for(lambda a=a: not a.pod.pids(), timeout=10, interval=0.1,
                 what=f"{a.pod.name} to hold no process")


def test_a_hung_rank_is_named_and_the_run_resumes_from_its_checkpoint(make_pod, dns_server,
                                                                      tmp_path, agents):
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents, {})
    codes = wait_exits(pods, 300)
    assert codes == [0, 0, 0], "\n\n".join(a.said() for a in pods)
    _nothing_left(pods)
    assert_dumped_and_named(pods, out)
    head = pods[0]
    [restart] = events(head, "restart")
    assert "PODAGENT_HANG_TIMEOUT" in restart["reason"] and restart["n"] == 1
    # Every rank of the second attempt started after the last checkpoint before the hang.
    finished = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert {f["first"] for f in finished} == {5}, finished
    assert "starting at step 5 (checkpoint: 4)" in head.output


def test_with_restarts_off_a_hang_ends_the_run_with_its_own_code(make_pod, dns_server,
                                                                 tmp_path, agents):
    pods, out = _three_pods(make_pod, dns_server, tmp_path, agents,
                            {"PODAGENT_RESTARTS": "0"})
    started = time.monotonic()
    codes = wait_exits(pods, 300)
    assert codes == [_code(errors.RunHung)] * 3, "\n\n".join(a.said() for a in pods)
    _nothing_left(pods)
    assert time.monotonic() - started < 240
    assert_dumped_and_named(pods, out)
    assert not events(pods[0], "restart")
    assert not (out / "rank0.json").exists()  # never finished
    for a in pods:
        assert "PODAGENT_RESTARTS=0" in a.output, a.said()

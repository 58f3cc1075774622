"""One volume on every pod (`up --network-volume`, an Instant Cluster's /workspace): every pod's
own state (its run directory: ledger, logs, events, the data check's reports, temp files)
lives in a directory of its own, named after the pod; only what is meant to be shared (the
checkpoints) is. A run without Ray's data check and a Ray run both finish on such pods, each
pod with a ledger of its own."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.e2e.test_without_ray import LOOP, QUICK_RESOLVER
from tests.harness.agents import Agent, form_cluster, pod_run_dir, wait_exits


def _on_one_volume(make_pod, dns_server, tmp_path, agents, **env: str
                   ) -> tuple[list[Agent], Path]:
    """A head and a worker whose log and checkpoint directories are one, as a network volume
    mounted at /workspace on both makes them."""
    volume = tmp_path / "volume"
    shared = {"PODAGENT_LOG_DIR": str(volume / "podagent" / "logs"),
              "PODAGENT_CHECKPOINT_DIR": str(volume / "checkpoints"), "EXPECTED_WORKERS": "1",
              **QUICK_RESOLVER, **env}
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                 head_env=shared, worker_env=shared)
    return [head, *workers], volume


def _ledgers_apart(pods: list[Agent], volume: Path, keepers: list[Agent]) -> None:
    """One directory per pod under the run's, each with the pod's own log; each ledger (every
    pod of a run without Ray keeps one, a Ray run's head does) its pod's own: one start, by
    that pod, finished as the run did."""
    run_root = volume / "podagent" / "logs" / "e2e"
    assert sorted(p.name for p in run_root.iterdir()) == sorted(a.pod.pod_id for a in pods)
    for a in pods:
        run_dir = pod_run_dir(volume / "podagent" / "logs", "e2e", a.pod.pod_id)
        assert a.run_dir == run_dir
        role = "head" if a is pods[0] else "worker"
        assert (run_dir / f"podagent-{role}-{a.pod.pod_id}.log").stat().st_size > 0
        assert list(run_dir.glob(".*")) == [], "a temp file was left behind"
        if a not in keepers:
            assert not (run_dir / "ledger.json").exists()
            continue
        ledger = json.loads((run_dir / "ledger.json").read_text())
        assert [s["pod"] for s in ledger["starts"]] == [a.pod.pod_id], ledger
        assert ledger["finished"]["outcome"] == "succeeded", ledger
        assert ledger["finished"]["exit_code"] == 0, ledger


def test_a_data_check_on_two_pods_sharing_one_volume_passes(make_pod, dns_server, tmp_path,
                                                             agents):
    """2 pods x 2 ranks: each pod reads its own ranks' reports, never the other pod's (before,
    both pods read every rank-*.json in one folder: "rank 0 was reported by 2 pods", exit 23)."""
    pods, volume = _on_one_volume(make_pod, dns_server, tmp_path, agents)
    (tmp_path / "ranks").mkdir()
    for a in pods:
        a.argv = (*a.argv, "torchrun", "--data-check", "--nproc-per-node", "2", "--",
                  str(LOOP), str(tmp_path / "ranks"))
    for a in reversed(pods):
        a.start()
    codes = wait_exits(pods, 240)
    assert codes == [0, 0], "\n\n".join(a.output[-3000:] for a in pods)
    assert "data check: 4 ranks" in pods[0].output, pods[0].output[-3000:]
    assert "none seen by two ranks" in pods[0].output
    for a in pods:
        reports = sorted(p.name for p in (a.run_dir / "data-check").glob("rank-*.json"))
        assert len(reports) == 2, (a.pod.name, reports)  # this pod's own two ranks
    _ledgers_apart(pods, volume, keepers=pods)


def test_a_ray_run_on_two_pods_sharing_one_volume_finishes(make_pod, dns_server, tmp_path,
                                                           agents):
    pods, volume = _on_one_volume(make_pod, dns_server, tmp_path, agents,
                                  PODAGENT_REWARD="none")
    for a in reversed(pods):
        a.start()
    codes = wait_exits(pods, FORM_TIMEOUT)
    assert codes == [0, 0], "\n\n".join(a.output[-3000:] for a in pods)
    assert "check: ALL CHECKS PASSED" in (pods[0].run_dir / "job.log").read_text()
    _ledgers_apart(pods, volume, keepers=pods[:1])

"""A restarted head reads its run's ledger first: a finished run is not run again, and the head
exits with the code of the run's recorded outcome, whatever the earlier head managed to write."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.conftest import PodagentRun, Runs


def _ledger(run: PodagentRun, finished: dict, starts: list[dict] | None = None) -> None:
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "ledger.json").write_text(json.dumps({
        "run": run.run_name,
        "starts": starts or [{"at": time.time() - 60, "pod": "head", "pid": 1}],
        "submissions": [{"id": f"{run.run_name}-1", "at": time.time() - 50,
                         "resumed_from": None, "status": finished.get("job_status")}],
        "finished": {"at": time.time() - 10, **finished},
    }))


@pytest.mark.parametrize(("outcome", "job_status", "code"), [
    ("JobFailed", "FAILED", 3),
    ("JobStopped", "STOPPED", 4),
    ("RestartsExhausted", "FAILED", 16),
    ("succeeded", "SUCCEEDED", 0),
])
def test_a_finished_run_is_not_run_again_and_its_code_is_repeated(
        podagent_runs: Runs, outcome: str, job_status: str, code: int) -> None:
    """The earlier head wrote the run's end and was killed before it wrote its exit code
    (`exit_code` is missing): the code still follows from the outcome, never 0 for a failure."""
    run = podagent_runs.new(f"recall-{code}")
    _ledger(run, {"outcome": outcome, "job_status": job_status})
    assert run.execute(["head"], env={"PODAGENT_AFTER_RUN": "exit"}, timeout=60
                       ).returncode == code, run.stdout + run.stderr
    assert f"run {run.run_name} finished earlier ({outcome}" in run.stdout
    assert "not running it again" in run.stdout
    assert json.loads(run.read("ledger.json"))["finished"]["exit_code"] == code


def test_a_run_whose_starts_kept_failing_is_given_up(podagent_runs: Runs) -> None:
    """The third start in a row that ends in an internal error finishes the run: the next
    start repeats exit 70 instead of running it again (a container restarted in a loop)."""
    run = podagent_runs.new("crashloop")
    crashed = [{"at": time.time() - 30 * i, "pod": "head", "pid": i, "outcome": "InternalError",
                "exit_code": 70} for i in (3, 2, 1)]
    _ledger(run, {"outcome": "InternalError", "job_status": None,
                  "reason": "3 starts in a row ended in an internal error"}, crashed)
    assert run.execute(["head"], env={"PODAGENT_AFTER_RUN": "exit"}, timeout=60
                       ).returncode == 70, run.stdout + run.stderr
    assert "3 starts in a row ended in an internal error" in run.stdout


def test_a_finished_runs_code_is_written_on_its_end_and_no_earlier_start_is_rewritten(
        podagent_runs: Runs) -> None:
    """The start that finished the run recorded its own code; the run's end has none (its head
    was killed before it wrote it). A later start fills in the end's code from the outcome and
    leaves the earlier start's record as it was."""
    run = podagent_runs.new("recall-keep")
    # (a code of its own that differs from the outcome's, so that a rewrite would show)
    earlier = {"at": time.time() - 60, "pod": "head", "pid": 1, "outcome": "JobFailed",
               "exit_code": 143}
    _ledger(run, {"outcome": "JobFailed", "job_status": "FAILED"}, [earlier])
    assert run.execute(["head"], env={"PODAGENT_AFTER_RUN": "exit"}, timeout=60
                       ).returncode == 3, run.stdout + run.stderr
    ledger = json.loads(run.read("ledger.json"))
    assert ledger["finished"]["exit_code"] == 3
    assert ledger["starts"] == [earlier]  # no start of its own: it ran nothing

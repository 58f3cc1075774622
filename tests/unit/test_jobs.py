"""JobRunner against a Jobs API that answers 503, never answers, or drops the connection:
the submission is retried to its deadline and never sends a second job; a refusal ends it at
once; a dashboard silent while the job runs ends the following with DashboardSilent."""

from __future__ import annotations

import io

import pytest

from podagent import config
from podagent.cluster import jobs, reattach
from podagent.cluster.jobs import JobRunner
from podagent.errors import DashboardSilent, JobSubmitFailed
from podagent.report import Reporter
from podagent.waiting import Deadline, Signals
from tests.fakes.jobs_api import FakeJobsApi

ENTRYPOINT = ("python", "train.py")


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch):
    # The fake holds a "hang" for 4 s: each request must give up well before.
    monkeypatch.setattr(jobs, "HTTP_TIMEOUT", 1.0)
    monkeypatch.setattr(jobs, "CLIENT_REQUEST_TIMEOUT", 1.0)


def _runner(api: FakeJobsApi, tmp_path, sid: str = "r-1") -> JobRunner:
    return JobRunner(api.url, sid, Reporter("head", "p", None, stream=io.StringIO()),
                     tmp_path / "job.log")


def _submit(runner: JobRunner, seconds: float = 30.0) -> bool:
    return runner.submit(ENTRYPOINT, {"A": "1"}, None, {"podagent_run": "r"}, Signals(),
                         Deadline.after(seconds))


def test_transient_trouble_at_each_call_is_retried_and_one_job_is_sent(tmp_path):
    trouble = [("GET /api/jobs/r-1", "503"), ("GET /api/jobs/r-1", "hang"),
               ("POST /api/jobs/", "503"), ("POST /api/jobs/", "drop"),
               ("POST /api/jobs/", "hang")]
    with FakeJobsApi(trouble, hang_for=4.0) as api:
        assert _submit(_runner(api, tmp_path)) is True
        posts = [r.answered for r in api.requests if r.route == "POST /api/jobs/"]
    # (on a loaded machine an answer may come after the client gave up: then the next
    # attempt finds the job and sends nothing more; never a second job, never a refusal)
    assert posts[:3] == ["503", "drop", "hang"] and posts[3:] == ["200"], posts
    assert list(api.jobs) == ["r-1"]


def test_earlier_attempts_are_listed_again_while_the_api_is_unreachable(tmp_path):
    with FakeJobsApi([("GET /api/jobs/", "503"), ("GET /api/jobs/", "drop")]) as api:
        _runner(api, tmp_path).stop_earlier_attempts("r", 1.0, Signals(),
                                                      Deadline.after(30))
        lists = [r.answered for r in api.requests if r.route == "GET /api/jobs/"]
    assert lists[:2] == ["503", "drop"] and lists[-1] == "200", lists


def test_a_job_of_the_run_already_there_is_followed_not_sent_again(tmp_path):
    with FakeJobsApi() as api:
        api.jobs["r-2"] = {"submission_id": "r-2", "status": "RUNNING"}
        assert _submit(_runner(api, tmp_path, sid="r-2")) is False  # a re-attaching head
        assert "POST /api/jobs/" not in [r.route for r in api.requests]


def test_a_refusal_is_not_retried(tmp_path):
    with FakeJobsApi() as api:
        runner = _runner(api, tmp_path)
        runner.client._do_request = _bad_request(runner.client._do_request)
        with pytest.raises(JobSubmitFailed, match="refused"):
            _submit(runner)
        assert [r.answered for r in api.requests if r.route == "POST /api/jobs/"] == ["400"]


def _bad_request(do_request):
    def sends_a_field_ray_does_not_know(method, endpoint, **kwargs):
        if method == "POST":
            kwargs["json_data"] = {**kwargs.get("json_data", {}), "not_a_field": 1}
        return do_request(method, endpoint, **kwargs)

    return sends_a_field_ray_does_not_know


def test_an_api_unreachable_to_the_deadline_is_one_error_naming_the_last_answer(tmp_path):
    with FakeJobsApi([("GET /api/jobs/r-1", "503")] * 100) as api, \
            pytest.raises(JobSubmitFailed) as failed:
        _submit(_runner(api, tmp_path), seconds=2.0)
    assert "did not accept the job" in str(failed.value)
    assert "HTTP 503" in str(failed.value)


def test_a_dashboard_silent_while_the_job_runs_ends_the_following(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "DASHBOARD_SILENT_LIMIT", 1.5)
    with FakeJobsApi() as api:
        runner = _runner(api, tmp_path)
        assert _submit(runner)
        api.trouble = [("GET /api/jobs/r-1", "drop")] * 1000
        with pytest.raises(DashboardSilent, match="has not answered for"):
            runner.follow(Signals(), poll=0.1)


def test_a_busy_dashboard_at_reattach_is_asked_again_not_taken_for_no_job(tmp_path):
    """A restarted head asks its pod's Jobs API whether the run's job still runs: a 503 is a
    busy dashboard, not "no job" (which would get the running job's Ray cleaned up)."""
    with FakeJobsApi([("GET /api/jobs/r-1", "503")] * 3) as api:
        api.jobs["r-1"] = {"submission_id": "r-1", "status": "RUNNING"}
        status = reattach.job_status(config.build({}, {}), "r-1", api.url, Signals())
    assert status == "RUNNING"

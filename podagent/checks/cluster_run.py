"""`podagent check --cluster`: submit the cluster check (clustercheck.py) to the running
cluster's Jobs API, from any pod, and follow it to its end."""

from __future__ import annotations

import sys
import time

from podagent import config, extras
from podagent.errors import JobSubmitFailed, PodagentError
from podagent.platform import discovery
from podagent.platform.roles import Role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.waiting import Signals

CHECK_MODULE = "podagent.checks.clustercheck"


def check_cluster(settings: config.Settings, role: Role, reporter: Reporter) -> bool:
    """Whether the check job succeeded. Raises when this image cannot run it (no Ray, no
    torch), the head is not found, or the Jobs API does not take it (JobSubmitFailed)."""
    from podagent.cluster.jobs import JobRunner

    ray_compat.require()
    extras.require_torch("the cluster check")
    signals = Signals()
    signals.install()
    head_ip = "the head"
    try:
        head_ip = discovery.head_ip_now(settings, role, reporter)
        url = f"http://{head_ip}:{settings.dashboard_port}"
        submission = time.strftime(f"{settings.run_name}-check-%H%M%S", time.gmtime())
        log = settings.run_dir / f"{submission}.log"
        runner = JobRunner(url, submission, reporter, log, headers=settings.auth_headers(),
                           check=True)
        env = {}
        if settings.reward != "none":
            env["REMOTE_RM_URL"] = f"http://{head_ip}:{settings.reward_port}/get_reward"
        runner.submit((sys.executable, "-m", CHECK_MODULE), env, None,
                      {"podagent_check": "1"}, signals)
        reporter.say(f"cluster check {submission} submitted to {url}")
        status = runner.follow(signals)
    except PodagentError:
        raise
    except Exception as exc:  # the Jobs API client raises plain exceptions
        raise JobSubmitFailed(f"the Jobs API at {head_ip}:{settings.dashboard_port} did not "
                              f"take the check: {exc}") from exc
    return status == "SUCCEEDED"

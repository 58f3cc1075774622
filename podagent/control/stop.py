"""`podagent stop`: a request the head acts on (GCS KV), so the cluster comes down in podagent's
own order; then wait until the head's Ray is gone."""

from __future__ import annotations

import time

from podagent.cluster import runstate
from podagent.config import Settings
from podagent.control.lookup import HTTP_TIMEOUT
from podagent.errors import HeadUnreachable, StopTimeout
from podagent.platform import discovery
from podagent.platform.roles import Role
from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter
from podagent.waiting import Backoff, Expired, retry


def request_stop(settings: Settings, role: Role, reporter: Reporter, by: str,
                 timeout: float, ip: str | None = None) -> float:
    """Ask the head to end the run, then wait until its Ray is gone; returns seconds taken."""
    ip = ip or discovery.head_ip_now(settings, role, reporter)
    gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
    started = time.monotonic()
    try:
        gcs.kv_put(runstate.KV_NAMESPACE, runstate.KV_STOP_REQUEST,
                   runstate.stop_request(by, time.time()), timeout=HTTP_TIMEOUT)
    except GcsUnavailable as exc:
        gcs.close()
        raise HeadUnreachable(f"the head's Ray at {ip}:{settings.ray_port} does not answer: "
                              f"{exc}") from None
    reporter.say(f"asked the head at {ip} to stop the run; waiting for the cluster to go down")

    def head_answers() -> bool:
        try:
            gcs.check_alive(timeout=1.0)
            return True
        except GcsUnavailable:
            return False

    try:
        try:
            still_up = retry(head_answers, awaited=f"the head's Ray at {ip} to be gone",
                             backoff=Backoff.every(0.5), deadline=timeout,
                             until=lambda answers: not answers)
        except Expired:
            still_up = True
        podagents = not still_up or _holds_a_podagent_run(gcs)
    finally:
        gcs.close()
    if still_up and not podagents:
        raise StopTimeout(f"the head at {ip} still runs {timeout:g} s after the stop request, "
                          f"and its Ray holds no podagent run: a Ray that podagent did not "
                          f"start (as a RunPod cluster of type RAY brings) ignores `podagent "
                          f"stop`, and podagent stops no Ray it did not start; stop it yourself")
    if still_up:
        raise StopTimeout(f"the head at {ip} still runs {timeout:g} s after the stop request "
                          f"(is its podagent running? `podagent status` shows the cluster)")
    return time.monotonic() - started


def _holds_a_podagent_run(gcs: GcsClient) -> bool:
    """Whether a podagent head ever started this Ray (it marks each start in the GCS; a head
    whose `ray start` has not finished has not yet, which is why this is asked only after
    the wait). A Ray that does not answer now is given the benefit of the doubt."""
    try:
        return gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_HEAD_START,
                          timeout=HTTP_TIMEOUT) is not None
    except GcsUnavailable:
        return True

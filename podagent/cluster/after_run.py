"""What a pod does once its run is over (PODAGENT_AFTER_RUN).

On RunPod a container whose process exits is started again: a head that exits after its job
would start the run again, billing GPUs in a loop. So on a RunPod pod podagent stays up, idle
and healthy, until the pod is stopped (`stay`), or asks RunPod's API to stop the pod
(`stop-pod`). Elsewhere it exits with the run's outcome (`exit`). The head's closing
announcement tells the workers which one, and they do the same.
"""

from __future__ import annotations

from podagent.choices import AfterRun
from podagent.config import Settings
from podagent.errors import Interrupted, RunPodApiError
from podagent.platform import runpod_api
from podagent.report import Reporter
from podagent.waiting import Signals

STAY_NOTE_EVERY = 600.0  # a staying pod says once in a while what it is waiting for


def settle(policy: AfterRun, settings: Settings, reporter: Reporter, signals: Signals,
           summary: str) -> None:
    """Returns at once for `exit`; otherwise returns when a signal ends the stay."""
    policy = AfterRun(policy)
    if policy is AfterRun.EXIT:
        return
    if policy is AfterRun.STOP_POD:
        _stop_pod(settings, reporter)
    reporter.say(f"staying up (PODAGENT_AFTER_RUN={policy}) so that RunPod does not start the "
                 f"run again: {summary}; stop the pod to end")
    reporter.event("staying", policy=policy)
    try:
        while True:
            signals.sleep(STAY_NOTE_EVERY)
            reporter.say(f"still staying: {summary}")
    except Interrupted as exc:
        reporter.say(f"{exc}: leaving")


def _stop_pod(settings: Settings, reporter: Reporter) -> None:
    """Ask RunPod to stop this pod; it then sends SIGTERM, which ends the stay."""
    pod_id = settings.pod_id or ""
    try:
        runpod_api.stop_pod(pod_id, settings.runpod_api_key or "", settings.runpod_api_url,
                            say=reporter.warn)
    except RunPodApiError as exc:
        # Exiting instead would only get the container started again: stay, and say so.
        reporter.warn(f"could not stop pod {pod_id} through RunPod's API ({exc}); staying up "
                      f"instead")
        reporter.event("stop_pod", pod=pod_id, ok=False, error=str(exc))
        return
    reporter.say(f"asked RunPod's API to stop pod {pod_id}")
    reporter.event("stop_pod", pod=pod_id, ok=True)

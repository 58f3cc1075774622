"""RunPod's REST API: what podagent asks of it, which is to stop the pod it runs on.

Why: RunPod restarts a pod's container whenever its main process exits, so a pod whose run is
over would start the run again (or sit there billing for its GPUs). Stopping the pod through
the API ends the billing for its GPUs (a volume stays, and stays billed); this is what
PODAGENT_AFTER_RUN=stop-pod does. Documented at docs.runpod.io as
POST https://rest.runpod.io/v1/pods/{podId}/stop with `Authorization: Bearer <key>`.

The API key goes in that header only: never in a URL, a message, a log line, or an exception
chain (a requests exception holds the request, and so the header).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from urllib.parse import quote

import requests
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from podagent import __version__
from podagent.errors import RunPodApiError

DEFAULT_BASE_URL = "https://rest.runpod.io/v1"
_CONNECT_TIMEOUT = 10.0  # seconds one attempt may take to connect
_BACKOFF = wait_exponential(multiplier=0.5, min=0.5, max=8)
_REASON_MAX = 200


class _Retry(Exception):
    """An attempt that may succeed later: no connection, a timeout, 429 or 5xx."""


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _one_line(text: str, limit: int = _REASON_MAX) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(response: requests.Response) -> str:
    """RunPod's short reason: the error field of a JSON body, else the body's start, else the
    HTTP reason phrase."""
    body = response.text[:4096] if response.content else ""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message", "detail", "title"):
            if isinstance(data.get(key), str) and data[key].strip():
                return _one_line(data[key])
    return _one_line(body) or _one_line(response.reason or "") or "no reason given"


def _why(exc: requests.RequestException) -> str:
    """A connection failure in a few words (requests' own text is a paragraph)."""
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(exc))
    if found:
        return f"cannot connect ({found.group(1).strip()})"
    return f"cannot connect ({type(exc).__name__})"


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "<redacted>") if secret else text


def stop_pod(pod_id: str, api_key: str, base_url: str = DEFAULT_BASE_URL,
             timeout: float = 30.0, say: Callable[[str], None] | None = None) -> None:
    """Ask RunPod to stop pod `pod_id`: POST {base_url}/pods/{pod_id}/stop.

    No connection, a timeout, 429 and 5xx are tried again with backoff until `timeout`
    seconds have passed; any other answer outside 2xx fails at once. `say` (optional) hears
    each retry in one line. Raises RunPodApiError naming the request, the status and RunPod's
    reason, never the key, with no exception chained to it.
    """
    if not pod_id:
        raise RunPodApiError("RunPod API: no pod id to stop (RUNPOD_POD_ID is not set)")
    if not api_key or not api_key.strip():
        raise RunPodApiError("RunPod API: no API key (RUNPOD_API_KEY is not set)")
    api_key = api_key.strip()
    url = f"{base_url.rstrip('/')}/pods/{quote(pod_id, safe='')}/stop"
    what = f"POST {url}"
    headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json",
               "User-Agent": f"podagent/{__version__}"}
    started = time.monotonic()
    deadline = started + timeout

    def attempt() -> None:
        remaining = max(deadline - time.monotonic(), 0.1)
        failure = None
        try:
            # No redirects: one could send the key elsewhere, or turn the POST into a GET.
            response = requests.post(url, headers=headers, allow_redirects=False,
                                     timeout=(min(_CONNECT_TIMEOUT, remaining), remaining))
        except requests.RequestException as exc:
            failure = _why(exc)
        if failure is not None:  # raised here, not in the handler: nothing chained
            raise _Retry(f"{what}: {failure}")
        status = response.status_code
        if 200 <= status < 300:
            return
        message = f"{what} answered {status} {_reason(response)}"
        if _retryable(status):
            raise _Retry(message)
        raise RunPodApiError(_redact(f"RunPod API: {message}", api_key))

    def wait(state: RetryCallState) -> float:
        return min(_BACKOFF(state), max(deadline - time.monotonic(), 0.0))

    def before_sleep(state: RetryCallState) -> None:
        if say and state.outcome is not None and state.next_action is not None:
            say(_redact(f"RunPod API: {state.outcome.exception()}; trying again in "
                        f"{state.next_action.sleep:.1f} s", api_key))

    retrying = Retrying(retry=retry_if_exception_type(_Retry),
                        stop=lambda state: time.monotonic() >= deadline,
                        wait=wait, before_sleep=before_sleep, reraise=True)
    # Raised after the handlers, not in them: the error carries no context that could lead
    # to a request and its headers.
    last = refused = None
    try:
        retrying(attempt)
    except _Retry as exc:
        last = str(exc)
    except RunPodApiError as exc:
        refused = str(exc)
    if refused is not None:
        raise RunPodApiError(refused) from None
    if last is None:
        return
    attempts = retrying.statistics.get("attempt_number", 1)
    elapsed = time.monotonic() - started
    raise RunPodApiError(_redact(
        f"RunPod API: {last}; gave up after {attempts} attempt{'s' if attempts != 1 else ''} "
        f"in {elapsed:.1f} s", api_key)) from None

"""RunPod's REST API: the one module that talks to it.

Two users: a pod stops itself when its run is over (v1: POST /v1/pods/{podId}/stop, what
PODAGENT_AFTER_RUN=stop-pod does: RunPod restarts a container whose process exits, so a pod
whose run is over would run it again or sit there billing), and `podagent up/down/ls` on the
user's machine creates, watches and terminates pods and clusters (v2, documented in RunPod's
api-reference-v2/openapi.json: server https://api.runpod.io, paths /v2/...).

Every request: `Authorization: Bearer <key>`, no redirects (one could send the key elsewhere,
or turn a POST into a GET), a deadline. No connection, a timeout, 429 (after its Retry-After)
and 5xx are tried again with backoff until the deadline; any other answer outside 2xx fails at
once, in one line naming the request, the status and RunPod's reason. The key goes in that
header only: never in a URL, a message, a log line, or an exception chain (a requests
exception holds the request, and so the header).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import requests.auth

from podagent import __version__
from podagent.errors import NoCapacity, RunPodApiError, RunPodAuthError
from podagent.waiting import Backoff, Deadline, Expired, NotYet, retry

DEFAULT_BASE_URL = "https://rest.runpod.io/v1"  # v1, which the pod's stop-pod uses
DEFAULT_V2_URL = "https://api.runpod.io"  # the v2 document's server; paths add /v2/...
_CONNECT_TIMEOUT = 10.0  # seconds one attempt may take to connect
_BACKOFF = Backoff(0.5, 8.0)
_RETRY_AFTER_MAX = 60.0  # a Retry-After beyond this is not waited for in one go
_REASON_MAX = 200
# RunPod's statuses for a pod (PodStatus); billing stops only in the last two.
POD_STATUSES = ("PROVISIONING", "STARTING", "RUNNING", "EXITED", "ERROR", "TERMINATED")
BILLING_STATUSES = frozenset({"PROVISIONING", "STARTING", "RUNNING"})


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _one_line(text: str, limit: int = _REASON_MAX) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(response: requests.Response) -> str:
    """RunPod's short reason: an ErrorResponse's detail (with its validation errors), else the
    error field of a JSON body, else the body's start, else the HTTP reason phrase."""
    body = response.text[:4096] if response.content else ""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("detail", "error", "message", "title"):
            if isinstance(data.get(key), str) and data[key].strip():
                found = data[key]
                listed = data.get("errors")
                if isinstance(listed, list) and listed:
                    found += ": " + "; ".join(str(e) for e in listed[:3])
                return _one_line(found)
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


def _retry_after(response: requests.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), _RETRY_AFTER_MAX)
    except ValueError:
        return None


class _Bearer(requests.auth.AuthBase):
    def __init__(self, key: str):
        self._key = key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self._key}"
        return request


@dataclass(frozen=True)
class Answer:
    status: int
    data: Any  # the parsed JSON body, or None (204, or not JSON)


class Client:
    """Requests to one RunPod API root with one key, each within `timeout` seconds (retries
    included). `say` (optional) hears each retry in one line; `on_call` (optional) hears every
    answer (method, path, status), e.g. to count the calls a run made."""

    def __init__(self, api_key: str, base_url: str, timeout: float = 60.0,
                 say: Callable[[str], None] | None = None,
                 on_call: Callable[[str, str, int], None] | None = None):
        if not api_key or not api_key.strip():
            raise RunPodApiError("RunPod API: no API key (RUNPOD_API_KEY is not set)")
        self._key = api_key.strip()
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.say = say
        self.on_call = on_call
        self._session = requests.Session()
        # The key as an auth of its own: requests then never puts a netrc login in its place
        # (it would for a plain header), and the environment's proxies still apply.
        self._session.auth = _Bearer(self._key)
        self._session.headers.update({"Accept": "application/json",
                                      "User-Agent": f"podagent/{__version__}"})

    def close(self) -> None:
        self._session.close()

    def _error(self, text: str, status: int | None = None) -> RunPodApiError:
        text = _redact(text, self._key)
        if status in (401, 403):
            return RunPodAuthError(text)
        return RunPodApiError(text)

    def call(self, method: str, path: str, *, body: Any = None,
             params: Mapping[str, Any] | None = None, missing_ok: bool = False,
             timeout: float | None = None,
             before_retry: Callable[[], Any] | None = None) -> Answer:
        """One request, tried again while that may help. `missing_ok`: a 404 is an answer
        (the thing is gone), not an error. `before_retry` runs before each retry: a create that
        may have happened despite the failure looks first (see create_pod); what it returns,
        when not None, is the answer."""
        url = f"{self.base_url}{path}"
        what = f"{method} {url}"
        deadline = Deadline.after(self.timeout if timeout is None else timeout)
        ambiguous = False  # a failure since the last look may have done what was asked

        def attempt() -> Answer:
            nonlocal ambiguous
            if ambiguous and before_retry is not None:
                found = before_retry()
                if found is not None:
                    return Answer(200, found)
                ambiguous = False
            remaining = max(deadline.left(), 0.1)
            failure = None
            try:
                response = self._session.request(
                    method, url, json=body, params=params, allow_redirects=False,
                    timeout=(min(_CONNECT_TIMEOUT, remaining), remaining))
            except requests.RequestException as exc:
                failure = _why(exc)
            if failure is not None:  # raised here, not in the handler: nothing chained
                ambiguous = True
                raise NotYet(f"{what}: {failure}")  # may succeed later
            status = response.status_code
            if self.on_call:
                self.on_call(method, path, status)
            if 200 <= status < 300 or (missing_ok and status == 404):
                try:
                    data = response.json() if response.content else None
                except ValueError:
                    data = None
                return Answer(status, data)
            message = f"{what} answered {status} {_reason(response)}"
            if _retryable(status):
                # RunPod refuses a rate-limited call before acting on it; a 5xx may come after.
                ambiguous = ambiguous or status != 429
                raise NotYet(message, _retry_after(response) if status == 429 else None)
            raise self._error(f"RunPod API: {message}", status)

        def trying_again(seen: str, pause: float) -> None:
            if self.say:
                self.say(_redact(f"RunPod API: {seen}; trying again in {pause:.1f} s",
                                 self._key))

        # Raised after the handlers, not in them: the error carries no context that could
        # lead to a request and its headers.
        gave_up = refused = None
        try:
            return retry(attempt, awaited=what, backoff=_BACKOFF, deadline=deadline,
                         before_pause=trying_again)
        except Expired as exc:
            gave_up = exc
        except RunPodApiError as exc:
            refused = exc
        if refused is not None:
            raise type(refused)(str(refused)) from None
        assert gave_up is not None
        tries = gave_up.tries
        raise self._error(
            f"RunPod API: {gave_up.seen}; gave up after {tries} attempt{'s' if tries != 1 else ''}"
            f" in {gave_up.waited:.1f} s") from None

    # --- v2 ----------------------------------------------------------------------------------

    def gpu_types(self) -> list[dict[str, Any]]:
        return list((self.call("GET", "/v2/catalog/gpus").data or {}).get("gpus", []))

    def create_pod(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v2/pods. A create is not idempotent: after a failure that may have created
        the pod anyway (no answer, 5xx), the pod is looked up by its name before trying again,
        so a retry never makes a second one."""
        return self._create("/v2/pods", body, lambda: self.find_pod(body["name"]))

    def create_cluster(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._create("/v2/clusters", body, lambda: self.find_cluster(body["name"]))

    def _create(self, path: str, body: Mapping[str, Any],
                find: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        try:
            answer = self.call("POST", path, body=dict(body), before_retry=find)
        except RunPodApiError as exc:
            if isinstance(exc, RunPodAuthError) or " answered 400 " not in str(exc):
                raise
            # 400 is both "breaks a rule" and "no capacity" (RunPod: capacity has no code of
            # its own, only a detail); the caller names the GPU type and data centers.
            raise NoCapacity(str(exc)) from None
        return answer.data

    def list_pods(self, include_cluster_pods: bool = False) -> list[dict[str, Any]]:
        params = {"includeClusterPods": "true"} if include_cluster_pods else None
        return list((self.call("GET", "/v2/pods", params=params).data or {}).get("pods", []))

    def find_pod(self, name: str) -> dict[str, Any] | None:
        return next((p for p in self.list_pods() if p.get("name") == name), None)

    def get_pod(self, pod_id: str) -> dict[str, Any] | None:
        """None when RunPod no longer knows it (terminated)."""
        answer = self.call("GET", f"/v2/pods/{quote(pod_id, safe='')}", missing_ok=True)
        return None if answer.status == 404 else answer.data

    def terminate_pod(self, pod_id: str) -> bool:
        """DELETE /v2/pods/{id}: True when it was there, False when already gone."""
        answer = self.call("DELETE", f"/v2/pods/{quote(pod_id, safe='')}", missing_ok=True)
        return answer.status != 404

    def list_clusters(self) -> list[dict[str, Any]]:
        return list((self.call("GET", "/v2/clusters").data or {}).get("clusters", []))

    def find_cluster(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.list_clusters() if c.get("name") == name), None)

    def cluster_pods(self, cluster_id: str) -> list[dict[str, Any]] | None:
        """None when the cluster is gone."""
        answer = self.call("GET", f"/v2/clusters/{quote(cluster_id, safe='')}/pods",
                           missing_ok=True)
        return None if answer.status == 404 else list((answer.data or {}).get("pods", []))

    def delete_cluster(self, cluster_id: str) -> bool:
        answer = self.call("DELETE", f"/v2/clusters/{quote(cluster_id, safe='')}",
                           missing_ok=True)
        return answer.status != 404

    def stream_logs(self, pod_id: str, last_event_id: str | None = None,
                    idle: float = 60.0) -> Iterator[tuple[str, dict[str, Any]]]:
        """GET /v2/pods/{id}/logs, Server-Sent Events: (event id, {ts, source, line}) as they
        come. Ends when the server closes the stream or is silent for `idle` seconds; the
        caller reconnects with the last id (Last-Event-ID: RunPod resumes after it)."""
        url = f"{self.base_url}/v2/pods/{quote(pod_id, safe='')}/logs"
        headers = {"Accept": "text/event-stream"}
        params: dict[str, Any] = {"source": "container"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        else:
            params["tail"] = 5000  # the document's maximum: the run's start, when we are late
        failure = None
        try:
            response = self._session.get(url, params=params, headers=headers, stream=True,
                                         allow_redirects=False,
                                         timeout=(_CONNECT_TIMEOUT, idle))
        except requests.RequestException as exc:
            failure = _why(exc)
        if failure is not None:
            raise RunPodApiError(f"RunPod API: GET {url}: {failure}")
        with response:
            if self.on_call:
                self.on_call("GET", f"/v2/pods/{pod_id}/logs", response.status_code)
            if response.status_code != 200:
                raise self._error(f"RunPod API: GET {url} answered {response.status_code} "
                                  f"{_reason(response)}", response.status_code)
            yield from _events(response)


def _arriving(response: requests.Response) -> Iterator[bytes]:
    """The body as it arrives: an event of a few bytes must not wait for a buffer to fill
    (requests' iter_lines reads 512 bytes at a time, holding a short event back until more
    comes). urllib3 2's read1 returns what one read of the socket gave."""
    raw = response.raw
    if hasattr(raw, "read1"):
        while True:
            data = raw.read1(65536)
            if not data:
                return
            yield data
    else:  # urllib3 1.26: one byte at a time is slow but never late
        yield from response.iter_content(chunk_size=1)


def _lines(response: requests.Response) -> Iterator[str]:
    pending = b""
    for data in _arriving(response):
        pending += data
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


def _events(response: requests.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """Server-Sent Events: `id:` and `data:` lines, an empty line ends an event; a line
    starting with ':' is a comment (a heartbeat)."""
    event_id, data = "", []
    try:
        for raw in _lines(response):
            if raw == "":
                if data:
                    try:
                        payload = json.loads("\n".join(data))
                    except ValueError:
                        payload = {"line": "\n".join(data)}
                    if isinstance(payload, dict):
                        yield event_id, payload
                data = []
                continue
            field, _, value = raw.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "id":
                event_id = value
            elif field == "data":
                data.append(value)
    except (requests.RequestException, OSError, ValueError):
        return  # a dropped or silent stream: the caller reconnects
    except Exception as exc:  # urllib3's own read errors are not requests'
        if type(exc).__module__.startswith("urllib3"):
            return
        raise


def stop_pod(pod_id: str, api_key: str, base_url: str = DEFAULT_BASE_URL,
             timeout: float = 30.0, say: Callable[[str], None] | None = None) -> None:
    """Ask RunPod to stop pod `pod_id`: POST {base_url}/pods/{pod_id}/stop (v1).

    Raises RunPodApiError naming the request, the status and RunPod's reason, never the key,
    with no exception chained to it.
    """
    if not pod_id:
        raise RunPodApiError("RunPod API: no pod id to stop (RUNPOD_POD_ID is not set)")
    client = Client(api_key, base_url, timeout=timeout, say=say)
    try:
        client.call("POST", f"/pods/{quote(pod_id, safe='')}/stop")
    finally:
        client.close()

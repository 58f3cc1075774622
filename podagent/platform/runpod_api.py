"""RunPod's REST API v2: the one module that talks to it (RunPod's api-reference-v2/openapi.json:
server https://api.runpod.io, paths /v2/...; v1 was retired on November 15, 2026).

Two users: a pod stops itself once its run is over (`stop_pod`: POST /v2/pods/{id}/action with
the pod-scoped key RunPod injects: RunPod starts a container again whenever its process exits,
so a pod whose run is over would run it again or sit there billing), and `podagent up/down/ls`
on the user's machine creates, watches and terminates pods and clusters.

Every request: `Authorization: Bearer <key>`, no redirects (one could send the key elsewhere,
or turn a POST into a GET), a deadline. No connection, a timeout, 429 (after its Retry-After)
and 5xx are tried again with backoff until the deadline; any other answer outside 2xx fails at
once, in one line naming the request, the status and RunPod's reason. A 2xx answer whose body
is not what the document says is an error of its own (`RunPodNonsense`), never a KeyError
further on. Calls are paced by RunPod's `RateLimit` headers so that a long run never meets a
429. The key goes in that header only: never in a URL, a message, a log line, or an exception
chain (a requests exception holds the request, and so the header).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import requests.auth

from podagent import __version__
from podagent.config.fields import FIELD_BY_ATTR, RUNPOD_API_URL
from podagent.config.policy import RUNPOD_API_KEY
from podagent.errors import (
    CreateUnsettled,
    NoCapacity,
    RunPodApiError,
    RunPodAuthError,
    RunPodConflict,
    RunPodNonsense,
)
from podagent.waiting import Backoff, Deadline, Expired, NotYet, retry

# The v2 document's server (paths add /v2/...), RUNPOD_API_URL's default.
DEFAULT_URL = FIELD_BY_ATTR["runpod_api_url"].default
# The key: on a pod RunPod injects a pod-scoped RUNPOD_API_KEY (what it may do is not
# documented); on the user's machine it is the account's (config.policy.runpod_key reads either).
API_URL, API_KEY = RUNPOD_API_URL, RUNPOD_API_KEY
_CONNECT_TIMEOUT = 10.0  # seconds one attempt may take to connect
_BACKOFF = Backoff(0.5, 8.0)
_RETRY_AFTER_MAX = 60.0  # a Retry-After beyond this is not waited for in one go
_REASON_MAX = 200
# RunPod's statuses for a pod (PodStatus); billing stops only in the last three.
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


# --- rate limits -------------------------------------------------------------------------------

# One member of a RateLimit / RateLimit-Policy header (IETF ratelimit-headers, as the document
# gives them): "minute";r=59;t=12 or "minute";q=60;w=60.
_MEMBER = re.compile(r'\s*"?([A-Za-z0-9_-]+)"?\s*((?:;\s*[a-z]+\s*=\s*-?\d+(?:\.\d+)?\s*)*)')
_PARAM = re.compile(r";\s*([a-z]+)\s*=\s*(-?\d+(?:\.\d+)?)")


def parse_rate_header(value: str) -> dict[str, dict[str, float]]:
    """{"minute": {"r": 59, "t": 12}, ...}; members that do not parse are left out."""
    out: dict[str, dict[str, float]] = {}
    for part in value.split(","):
        m = _MEMBER.fullmatch(part)
        if m:
            params = {k: float(v) for k, v in _PARAM.findall(m.group(2))}
            if params:
                out[m.group(1)] = params
    return out


@dataclass
class _Window:
    remaining: int
    resets_at: float  # monotonic
    quota: int | None


class Pace:
    """RunPod's quota as its answers tell it (RateLimit: calls left per window and seconds to
    its reset; RateLimit-Policy: the quota): before a call, the pause that keeps the calls left
    in every window from running out before it resets. Nothing is paced while more than half of
    a window's quota is left; below that the calls left are spread over the time left. Also
    counts the calls made.

    Calls may go out from several threads at once (the workers are created together), so a
    call takes its slot in one step (`reserve`), and an answer's count of calls left is read
    less the calls still out, which RunPod may not have counted yet."""

    SPREAD_BELOW = 0.5

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._last_call = 0.0
        self._out = 0  # calls sent (or about to be) and not answered yet
        self._times: list[float] = []  # when each call went out (a run's few thousand)
        self.waited = 0.0  # seconds of pauses so far

    def heard(self, headers: Mapping[str, str]) -> None:
        """An answer came: what it says is left, less the other calls still out."""
        now = self._clock()
        state = parse_rate_header(headers.get("RateLimit", "") or "")
        policy = parse_rate_header(headers.get("RateLimit-Policy", "") or "")
        with self._lock:
            self._out = max(0, self._out - 1)
            for name, params in state.items():
                if "r" not in params:
                    continue
                quota = policy.get(name, {}).get("q")
                self._windows[name] = _Window(int(params["r"]) - self._out,
                                              now + params.get("t", 60.0),
                                              int(quota) if quota is not None else None)

    def unanswered(self) -> None:
        """A call ended without an answer (it may or may not have counted)."""
        with self._lock:
            self._out = max(0, self._out - 1)

    def _pause(self, now: float) -> float:
        at = now  # when the next call may go
        for window in self._windows.values():
            if window.resets_at <= now:
                continue  # a new window: its quota is whole
            if window.remaining <= 0:
                at = max(at, window.resets_at)
                continue
            half = (window.quota or 0) * self.SPREAD_BELOW
            if window.quota is None or window.remaining < half:
                # The calls left, evenly between the last one and the window's reset.
                gap = (window.resets_at - self._last_call) / window.remaining
                at = max(at, min(self._last_call + gap, window.resets_at))
        return at - now

    def pause(self) -> float:
        """Seconds the next call would wait (0: go)."""
        with self._lock:
            return self._pause(self._clock())

    def reserve(self) -> float:
        """Takes the next call's slot: the seconds to wait before sending it (0: go now). The
        slot is counted at once, so a call from another thread meanwhile waits its turn."""
        now = self._clock()
        with self._lock:
            wait = self._pause(now)
            at = now + wait
            self._times.append(at)
            self._last_call = at
            self._out += 1
            for window in self._windows.values():
                if window.resets_at > at:
                    window.remaining -= 1
            return wait

    def quota(self, window: str = "minute") -> int | None:
        with self._lock:
            found = self._windows.get(window)
            return found.quota if found else None

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self._times)

    def busiest_minute(self) -> int:
        """The most calls made within any 60 seconds (what RunPod's minute window counts)."""
        with self._lock:
            times = list(self._times)
        most, first = 0, 0
        for last, now in enumerate(times):
            while now - times[first] >= 60.0:
                first += 1
            most = max(most, last - first + 1)
        return most


@dataclass(frozen=True)
class Answer:
    status: int
    data: Any  # the parsed JSON body, or None (204, or not JSON)


# --- reading what RunPod answered ----------------------------------------------------------------

def _object(answer: Answer, what: str) -> dict[str, Any]:
    if not isinstance(answer.data, dict):
        raise RunPodNonsense(f"RunPod API: {what} answered {answer.status} without the JSON "
                             f"object the document gives ({_shape(answer.data)})")
    return answer.data


def _items(answer: Answer, key: str, what: str, required: tuple[str, ...] = ("id",)
           ) -> list[dict[str, Any]]:
    """The list under `key` of an answer, each item an object with string `required` fields."""
    items = _object(answer, what).get(key)
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and all(isinstance(i.get(f), str) and i[f] for f in required)
            for i in items):
        raise RunPodNonsense(f"RunPod API: {what} answered {answer.status} without a list of "
                             f"{key} with {', '.join(required)} ({_shape(items)})")
    return items


def _shape(value: Any) -> str:
    if value is None:
        return "an empty body"
    return f"got {type(value).__name__} {_one_line(json.dumps(value, default=str), 60)}"


def check_pod(pod: Any, what: str) -> dict[str, Any]:
    """A Pod object as podagent reads it: an id, a name, a status, a number for cost. A status
    the document does not list yet (one RunPod adds) is a status all the same: one odd pod
    in an account must not stop the termination of a run's pods, nor `down` and `ls`."""
    ok = (isinstance(pod, dict) and isinstance(pod.get("id"), str) and pod["id"]
          and isinstance(pod.get("name"), str) and isinstance(pod.get("status"), str)
          and pod["status"]
          and isinstance(pod.get("cost", 0.0), (int, float))
          and not isinstance(pod.get("cost", 0.0), bool))
    if not ok:
        raise RunPodNonsense(f"RunPod API: {what}: not a pod as the document gives one "
                             f"({_shape(pod)})")
    return pod


def check_volume(volume: Any, what: str) -> dict[str, Any]:
    """A NetworkVolume as podagent reads it: an id, a name, its size (GB) and data center."""
    ok = (isinstance(volume, dict) and isinstance(volume.get("id"), str) and volume["id"]
          and isinstance(volume.get("name"), str) and isinstance(volume.get("dataCenter"), str)
          and type(volume.get("size")) is int)
    if not ok:
        raise RunPodNonsense(f"RunPod API: {what}: not a network volume as the document gives "
                             f"one ({_shape(volume)})")
    return volume


class Transport:
    """Requests to one RunPod API root with one key, each within `timeout` seconds (retries
    included). `say` (optional) hears each retry in one line; `on_call` (optional) hears every
    answer (method, path, status). `pace` counts the calls and paces them by RunPod's
    RateLimit headers (one per key: give a second client of the same key the same Pace)."""

    def __init__(self, api_key: str, base_url: str, timeout: float = 60.0,
                 say: Callable[[str], None] | None = None,
                 on_call: Callable[[str, str, int], None] | None = None,
                 pace: Pace | None = None):
        if not api_key or not api_key.strip():
            raise RunPodApiError(f"RunPod API: no API key ({API_KEY} is not set)")
        self._key = api_key.strip()
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.say = say
        self.on_call = on_call
        self.pace = pace or Pace()
        self._session = requests.Session()
        # The key as an auth of its own: requests then never puts a netrc login in its place
        # (it would for a plain header), and the environment's proxies still apply.
        self._session.auth = _Bearer(self._key)
        self._session.headers.update({"Accept": "application/json",
                                      "User-Agent": f"podagent/{__version__}"})

    def close(self) -> None:
        self._session.close()

    def _error(self, text: str, status: int | None = None) -> RunPodApiError:
        kind = {401: RunPodAuthError, 403: RunPodAuthError, 409: RunPodConflict}.get(
            status or 0, RunPodApiError)
        error = kind(_redact(text, self._key))
        error.answered = status is not None
        return error

    def _paced(self, deadline: Deadline | None = None) -> None:
        """Wait as RunPod's quota asks before a call (never past the call's deadline)."""
        wait = self.pace.reserve()
        if deadline is not None:
            wait = min(wait, deadline.left())
        if wait > 0:
            self.pace.waited += wait
            time.sleep(wait)

    def _send(self, method: str, path: str, send: Callable[[], requests.Response],
              deadline: Deadline | None = None) -> tuple[requests.Response | None, str]:
        """One request in its turn: its response (whose rate headers are heard), or None and
        why none came."""
        self._paced(deadline)
        try:
            response = send()
        except requests.RequestException as exc:
            self.pace.unanswered()
            return None, _why(exc)
        except BaseException:
            self.pace.unanswered()
            raise
        self.pace.heard(response.headers)
        if self.on_call:
            self.on_call(method, path, response.status_code)
        return response, ""

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
            def send() -> requests.Response:
                remaining = max(deadline.left(), 0.1)
                return self._session.request(
                    method, url, json=body, params=params, allow_redirects=False,
                    timeout=(min(_CONNECT_TIMEOUT, remaining), remaining))

            response, failure = self._send(method, path, send, deadline)
            if response is None:
                ambiguous = True
                raise NotYet(f"{what}: {failure}")  # may succeed later
            status = response.status_code
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
            again = type(refused)(str(refused))
            again.answered = refused.answered
            raise again from None
        assert gave_up is not None
        tries = gave_up.tries
        raise self._error(
            f"RunPod API: {gave_up.seen}; gave up after {tries} attempt{'s' if tries != 1 else ''}"
            f" in {gave_up.waited:.1f} s") from None



class Client(Transport):
    """RunPod's endpoints podagent uses, each answer read as the document gives it."""

    # --- the catalog --------------------------------------------------------------------------

    def gpu_types(self) -> list[dict[str, Any]]:
        what = "GET /v2/catalog/gpus"
        return _items(self.call("GET", "/v2/catalog/gpus"), "gpus", what, ("id", "name"))

    def data_centers(self, global_network: bool | None = None,
                     gpu_availability: bool = False) -> list[dict[str, Any]]:
        params: dict[str, str] = {} if global_network is None else {
            "globalNetwork": "true" if global_network else "false"}
        if gpu_availability:
            params["include"] = "GPU_AVAILABILITY"
        answer = self.call("GET", "/v2/catalog/datacenters", params=params or None)
        return _items(answer, "dataCenters", "GET /v2/catalog/datacenters")

    def registries(self) -> list[dict[str, Any]]:
        """The account's container registry credentials ({id, name})."""
        return _items(self.call("GET", "/v2/registries"), "registries", "GET /v2/registries",
                      ("id", "name"))

    # --- pods and clusters --------------------------------------------------------------------

    def create_pod(self, body: Mapping[str, Any],
                   resending: Callable[[], None] | None = None,
                   not_these: Collection[str] = ()) -> dict[str, Any]:
        """POST /v2/pods. A create is not idempotent: after a failure that may have created
        the pod anyway (no answer, 5xx, a 2xx without the pod), the pod is looked up by its
        name before the create is sent again (never one of the ids `not_these`: a lost pod
        of that name still listed is not its replacement). RunPod may list a pod some time
        after making it, so a look that finds nothing does not prove there is none:
        `resending` is told before each create sent again that way (both may land)."""
        return check_pod(self._create(
            "/v2/pods", body, lambda: self.find_pod(body["name"], not_these), resending),
            "POST /v2/pods")

    def create_cluster(self, body: Mapping[str, Any],
                       resending: Callable[[], None] | None = None) -> dict[str, Any]:
        return self._create("/v2/clusters", body, lambda: self.find_cluster(body["name"]),
                            resending)

    def _create(self, path: str, body: Mapping[str, Any],
                find: Callable[[], dict[str, Any] | None],
                resending: Callable[[], None] | None = None) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            """The look for a create that may have been carried out; its failure is its own,
            never the create's refusal (a key refused stays that)."""
            try:
                return find()
            except RunPodAuthError:
                raise
            except RunPodApiError as exc:
                raise CreateUnsettled(f"RunPod API: a create of {body['name']!r} may have been "
                                      f"carried out, and the look for it failed: {exc}"
                                      ) from None

        def look() -> dict[str, Any] | None:
            found = settled()
            if found is None and resending is not None:
                resending()  # nothing listed: the create goes out again
            return found

        try:
            answer = self.call("POST", path, body=dict(body), before_retry=look)
        except RunPodApiError as exc:
            if isinstance(exc, (RunPodAuthError, CreateUnsettled)) or \
                    " answered 400 " not in str(exc):
                raise
            # 400 is both "breaks a rule" and "no capacity" (RunPod: capacity has no code of
            # its own, only a detail); the caller names the GPU type and data centers.
            refused = NoCapacity(str(exc))
            refused.answered = True
            raise refused from None
        if isinstance(answer.data, dict) and isinstance(answer.data.get("id"), str) and \
                answer.data["id"]:
            return answer.data
        # A 2xx without what was created: it may exist all the same. Found by its name, or
        # the answer is nonsense (and its pod may still be listed later).
        found = settled()
        if found is not None:
            return found
        # Not a refusal: RunPod took the create (2xx), and may list its pod later. Left
        # unanswered, so that the run's end looks for that pod.
        raise RunPodNonsense(
            f"RunPod API: POST {self.base_url}{path} answered {answer.status} without what it "
            f"created ({_shape(answer.data)}), and nothing named {body['name']!r} is listed "
            f"yet")

    def list_pods(self, include_cluster_pods: bool = False) -> list[dict[str, Any]]:
        params = {"includeClusterPods": "true"} if include_cluster_pods else None
        pods = _items(self.call("GET", "/v2/pods", params=params), "pods", "GET /v2/pods")
        return [check_pod(p, "GET /v2/pods") for p in pods]

    def find_pod(self, name: str, not_these: Collection[str] = ()) -> dict[str, Any] | None:
        """The live pod of that name (a terminated one of an earlier run is not a create's
        answer), other than those of ids `not_these`."""
        return next((p for p in self.list_pods()
                     if p["name"] == name and p.get("status") != "TERMINATED"
                     and p["id"] not in not_these), None)

    def get_pod(self, pod_id: str) -> dict[str, Any] | None:
        """None when RunPod no longer knows it (terminated)."""
        path = f"/v2/pods/{quote(pod_id, safe='')}"
        answer = self.call("GET", path, missing_ok=True)
        return None if answer.status == 404 else check_pod(answer.data, f"GET {path}")

    def terminate_pod(self, pod_id: str) -> bool:
        """DELETE /v2/pods/{id}: True when it was there, False when already gone."""
        answer = self.call("DELETE", f"/v2/pods/{quote(pod_id, safe='')}", missing_ok=True)
        return answer.status != 404

    def pod_action(self, pod_id: str, action: str) -> Answer:
        """POST /v2/pods/{id}/action (start, stop, restart, terminate); 409: RunPodConflict."""
        return self.call("POST", f"/v2/pods/{quote(pod_id, safe='')}/action",
                         body={"action": action})

    # --- network volumes (they outlive the pods: a run's checkpoints and model) -------------

    def create_network_volume(self, body: Mapping[str, Any],
                              resending: Callable[[], None] | None = None) -> dict[str, Any]:
        """POST /v2/network-volumes (CreateNetworkVolumeRequest: name, size, dataCenter). Not
        idempotent either: after a failure that may have created it, looked up by name."""
        return check_volume(self._create(
            "/v2/network-volumes", body, lambda: self.find_network_volume(body["name"]),
            resending), "POST /v2/network-volumes")

    def network_volumes(self) -> list[dict[str, Any]]:
        what = "GET /v2/network-volumes"
        return [check_volume(v, what) for v in _items(
            self.call("GET", "/v2/network-volumes"), "networkVolumes", what, ("id", "name"))]

    def find_network_volume(self, name: str) -> dict[str, Any] | None:
        return next((v for v in self.network_volumes() if v["name"] == name), None)

    def delete_network_volume(self, volume_id: str) -> bool:
        """DELETE /v2/network-volumes/{id}: True when it was there, False when already gone."""
        answer = self.call("DELETE", f"/v2/network-volumes/{quote(volume_id, safe='')}",
                           missing_ok=True)
        return answer.status != 404

    def list_clusters(self) -> list[dict[str, Any]]:
        return _items(self.call("GET", "/v2/clusters"), "clusters", "GET /v2/clusters",
                      ("id", "name"))

    def find_cluster(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.list_clusters() if c["name"] == name), None)

    def cluster_pods(self, cluster_id: str) -> list[dict[str, Any]] | None:
        """None when the cluster is gone."""
        path = f"/v2/clusters/{quote(cluster_id, safe='')}/pods"
        answer = self.call("GET", path, missing_ok=True)
        if answer.status == 404:
            return None
        return [check_pod(p, f"GET {path}") for p in _items(answer, "pods", f"GET {path}")]

    def delete_cluster(self, cluster_id: str) -> bool:
        answer = self.call("DELETE", f"/v2/clusters/{quote(cluster_id, safe='')}",
                           missing_ok=True)
        return answer.status != 404

    # --- logs ---------------------------------------------------------------------------------

    def stream_logs(self, pod_id: str, cursor: LogCursor, idle: float = 60.0,
                    opened: Callable[[], None] = lambda: None,
                    tail: int = 5000) -> Iterator[dict[str, Any]]:
        """GET /v2/pods/{id}/logs, Server-Sent Events: each new container line's payload
        ({ts, source, line}) as it comes, resumed where `cursor` says and never one twice;
        `opened()` once RunPod answered 200; a first call gets the last `tail` lines before
        the new ones. Ends when the server closes the stream or is silent for `idle` seconds;
        the caller calls again with the same cursor."""
        url = f"{self.base_url}/v2/pods/{quote(pod_id, safe='')}/logs"
        headers = {"Accept": "text/event-stream"}
        params: dict[str, Any] = {"source": "container"}
        resume = cursor.resume_from()
        if resume:
            headers["Last-Event-ID"] = resume
        else:
            params["tail"] = tail  # 5000, the document's maximum: the run's start, when late
        response, failure = self._send(
            "GET", f"/v2/pods/{pod_id}/logs",
            lambda: self._session.get(url, params=params, headers=headers, stream=True,
                                      allow_redirects=False, timeout=(_CONNECT_TIMEOUT, idle)))
        if response is None:
            raise RunPodApiError(f"RunPod API: GET {url}: {failure}")
        with response:
            if response.status_code != 200:
                raise self._error(f"RunPod API: GET {url} answered {response.status_code} "
                                  f"{_reason(response)}", response.status_code)
            cursor.reconnected()
            opened()
            for _event_id, payload in _events(response):
                if payload.get("source", "container") != "container":
                    continue
                if cursor.admit(payload.get("ts"), str(payload.get("line", ""))):
                    yield payload


# --- the log stream's cursor -----------------------------------------------------------------

_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?"
                      r"([Zz]|[+-]\d\d:\d\d)")


def rfc3339_ns(text: Any) -> int | None:
    """Nanoseconds since the epoch of an RFC 3339 date-time (RunPod may give 9 digits of a
    second, more than datetime keeps); None when `text` is none."""
    m = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if not m:
        return None
    zone = "+00:00" if m.group(6) in ("Z", "z") else m.group(6)
    try:
        whole = dt.datetime.fromisoformat(
            f"{m.group(1)}T{m.group(2)}:{m.group(3)}:{m.group(4)}{zone}")
    except ValueError:
        return None
    return int(whole.timestamp()) * 10**9 + int((m.group(5) or "0").ljust(9, "0"))


def rfc3339_of(ns: int) -> str:
    seconds, rest = divmod(ns, 10**9)
    stamp = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{rest // 1000:06d}Z"


class LogCursor:
    """Where a pod's log stream resumes, whatever RunPod does with a repeated timestamp.

    Event ids are the lines' timestamps (the document), several lines can share one, and what
    a resume from a timestamp repeats is not documented: lines of that timestamp not yet sent
    could be lost ("after") or those sent could come again ("at"). So a resume asks from just
    before the last timestamp seen, which either way sends every line of it again, and what
    comes again is recognized: lines older than it, and those of it already seen, in order."""

    def __init__(self) -> None:
        self.last: int | None = None  # the latest timestamp seen (ns)
        self._at_last: list[str] = []  # the lines seen with it, in order
        self._matched = 0  # how many of them a resumed stream has repeated so far
        self.repeats = 0  # lines recognized and not handed on (for tests and figures)

    def resume_from(self) -> str | None:
        """The Last-Event-ID to resume with: one microsecond before the latest timestamp."""
        return None if self.last is None else rfc3339_of(max(0, self.last - 1000))

    def reconnected(self) -> None:
        self._matched = 0

    def admit(self, ts: Any, line: str) -> bool:
        """Whether this line is new (and so handed on)."""
        ns = rfc3339_ns(ts)
        if ns is None:
            return True  # no time to place it by: shown rather than lost
        if self.last is None or ns > self.last:
            self.last, self._at_last, self._matched = ns, [line], 1
            return True
        if ns < self.last:
            self.repeats += 1
            return False
        if self._matched < len(self._at_last) and self._at_last[self._matched] == line:
            self._matched += 1
            self.repeats += 1
            return False
        self._at_last.append(line)
        self._matched = len(self._at_last)
        return True


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


_LINE_MAX = 1 << 20  # a line of the stream longer than this is cut (a stranger's bytes)


def _lines(response: requests.Response) -> Iterator[str]:
    pending = b""
    for data in _arriving(response):
        pending += data
        *complete, pending = pending.split(b"\n")
        if len(pending) > _LINE_MAX:
            complete.append(pending[:_LINE_MAX])
            pending = b""
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


def stop_pod(pod_id: str, api_key: str, base_url: str = DEFAULT_URL,
             timeout: float = 30.0, say: Callable[[str], None] | None = None) -> bool:
    """Ask RunPod to stop pod `pod_id` (POST /v2/pods/{id}/action {"action": "stop"}), which
    ends its GPU billing: RunPod then sends the container SIGTERM. True when RunPod took the
    stop; False when it answered 409: stop is valid in every status but EXITED, ERROR and
    TERMINATED, and a pod whose container runs this is in none of them unless it is being
    stopped already.

    Raises RunPodApiError naming the request, the status and RunPod's reason, never the key,
    with no exception chained to it.
    """
    if not pod_id:
        raise RunPodApiError("RunPod API: no pod id to stop (RUNPOD_POD_ID is not set)")
    client = Client(api_key, base_url, timeout=timeout, say=say)
    try:
        client.pod_action(pod_id, "stop")
    except RunPodConflict:
        return False
    finally:
        client.close()
    return True

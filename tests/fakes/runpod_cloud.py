"""FakeRunPodCloud: RunPod's REST API v2 control plane over real HTTP, whose pods are real test
pods (network namespaces of tests/harness/pods.py running the container's real process), so that
a client creating pods and clusters through the API can be tested end to end.

    images = {"podagent:test": [sys.executable, "-m", "podagent"]}
    with FakeRunPodCloud(net, dns, tmp_path, api_key=KEY, images=images) as cloud:
        env = {**os.environ, "RUNPOD_API_KEY": KEY, "RUNPOD_API_URL": cloud.url}
        subprocess.run([sys.executable, "-m", "podagent", "up", ...], env=env, check=True)
        assert cloud.invalid_requests() == [] and cloud.fake_errors == []
        assert cloud.billing() == []

`cloud.url` is the server root (http://127.0.0.1:PORT), as RunPod's document names
https://api.runpod.io: the client appends /v2/....

Faithful to RunPod's published v2 document (runpod_v2_schema.json holds its schemas):
- the endpoints for the GPU and data center catalogs, registry credentials (list, get), pods
  (create, list, get, terminate, actions, the SSE log stream), clusters (create, list, get,
  their pods, delete) and network volumes (create, list, get, delete), with Bearer auth, the
  status codes the document gives (201, 204, 400, 401, 403, 404, 409, 422, 429 with
  Retry-After) and application/problem+json ErrorResponse bodies;
- every request body and query parameter is checked against the schemas (unknown fields are
  refused with 422, each violation listed in `errors` as RunPod words it:
  "$: additional properties 'bogus' not allowed"), and so is every answer of the fake's own; a
  query parameter the document does not have is answered (as servers commonly ignore one) but
  recorded among the request's schema_errors;
- pods go PROVISIONING, STARTING, RUNNING; stop is EXITED with cost 0.0; the actions valid in
  each status are those the document lists (409 otherwise); cluster members are refused (409)
  by the pod endpoints and excluded from GET /v2/pods unless includeClusterPods=true;
- a pod's container is started again when its process exits (as RunPod's runtime does), what was
  left in the pod is killed then, and a stop or terminate sends SIGTERM to the container's main
  process (as `docker stop` does to PID 1) and SIGKILL to everything after the grace;
- the environment RunPod injects (RUNPOD_* with a pod-scoped RUNPOD_API_KEY, and on cluster
  members PRIMARY_ADDR/MASTER_ADDR, PRIMARY_PORT/MASTER_PORT, NODE_ADDR, NODE_RANK, NUM_NODES,
  NUM_TRAINERS, HOST_NODE_ADDR, WORLD_SIZE); Global Networking pods answer in DNS as
  <id>.runpod.internal on interface podnet1, cluster members talk over ens1.

Rules the document states beyond its schema (paths in RunPod's docs repository):
- Global Networking (api-reference-v2/openapi.json, CreatePodRequest.globalNetworking: "Requires
  an NVIDIA GPU and a global-networking-enabled data center", DataCenter.globalNetwork;
  pods/networking.mdx: NVIDIA GPU pods only, in the data centers it lists;
  runpodctl/reference/runpodctl-pod.mdx, --global-networking: "Secure Cloud only"): 400 for a CPU
  pod, a GPU whose catalog manufacturer is not NVIDIA, or COMMUNITY cloud. A pod is placed in
  the first of its dataCenterIds whose globalNetwork is true (400 when none is), without
  dataCenterIds in the default data center if it supports it, else the catalog's first that does.
- Data centers (openapi.json, GET /v2/catalog/datacenters and /{id}, CreatePodRequest and
  CreateClusterRequest.dataCenterIds: "Preferred data centers"; "A cluster is always placed within
  a single data center"): the catalog (`data_centers`) is served with the document's filters
  (regions: any of; networkVolumeTypes, compliance: all of; globalNetwork) and
  include=GPU_AVAILABILITY; a dataCenterIds entry that is not in it is 400 ("unknown data
  center"); a pod or cluster goes to the first listed (the default `data_center` when none is),
  which its dataCenterId and RUNPOD_DC_ID (pods/templates/environment-variables.mdx) show.
- Network volumes (openapi.json, /v2/network-volumes, CreateNetworkVolumeRequest,
  DataCenter.networkVolumeTypes: "Empty = none", NetworkMount.volumeId: "ID of an existing
  NetworkVolume in the same data center as the pod"): a volume's dataCenter must be in the
  catalog with networkVolumeTypes not empty, and its type one of them (omitted: the first,
  "the requested data center's default (primary) storage tier"), else 400; a pod or cluster
  whose mounts.network names a volume that does not exist is 400 ("network volume ... not
  found"), else it goes to the volume's data center, which its dataCenterIds (if any) must
  include (400 otherwise; with Global Networking it must support that too). The account's
  volumes at the start are `network_volumes`; `volumes` lists them.
- GPU type ids (openapi.json, GpuType.id: "use for pod creation"; ClusterCompute.gpuTypeId: "as
  returned by GET /v2/catalog/gpus"): gpu.id and compute.gpuTypeId must be a catalog `id` (a
  display name such as "H100 SXM" is 400, naming the valid ids).
- Registry credentials (openapi.json, ContainerConfig.registry: "Container registry credential ID
  (for private images)", GET /v2/registries and /{id}; CreateClusterRequest: "Private registries
  are not yet supported for clusters"): a pod's `registry` must name a credential (`registries`)
  or it is 400 ("registry credential ... not found"), and the Pod echoes it; an image of
  `private_images` pulls only with its credential: without it (always, for cluster members) the
  pull fails ("unauthorized: authentication required") and the pod is ERROR.
- Log events (openapi.json, GET /v2/pods/{id}/logs: "Log-event `id` values are the event `ts`
  timestamp"; parameters LogLastEventID, LogSince, LogTail): an event's id is its ts (RFC 3339),
  stamped at `log_resolution` (lines close together share one); Last-Event-ID must be a
  date-time (else 422) and takes precedence over `since` (inclusive), both over `tail`. (The
  path's example event still has an id "<ts>/<seq>": the text and the header's `format:
  date-time` win.) Where the
  stream "resumes from this point" is left open, so `log_resume` plays it either way: "after"
  (lines later than the cursor: unsent lines sharing its ts are lost) or "again" (lines at or
  after it: those sharing its ts are sent again).
- Rate limits (openapi.json, components.responses.TooManyRequestsError,
  components.schemas.RateLimitHeader and RateLimitPolicyHeader, the IETF ratelimit-headers
  draft): every answer to an authenticated request carries RateLimit ("minute";r=59;t=60, ...)
  and RateLimit-Policy ("minute";q=60;w=60, ...); over a quota it is 429 with Retry-After and
  "rate limit exceeded for the <window> window", and nothing is done. Counted per key (the
  account's, each pod's apart) in fixed windows from a key's first request (`rate_limits`,
  `rate_windows`); a refused request is not counted; 401s are not counted and carry no such
  headers, and neither does any answer with `rate_limits={}` ("omitted for rate-limit-exempt
  callers").
- Pod-scoped keys (pods/templates/environment-variables.mdx: "RUNPOD_API_KEY | Pod-scoped API
  key"; openapi.json, securitySchemes.bearerAuth: "requests may return 403 when a valid key lacks
  access"): what such a key may do is not documented, so `pod_key` chooses: "refuse" (403 for
  everything), "own" (GET and actions of its own pod only) or "account" (what the account may).
- Secrets (pods/templates/secrets.mdx, environment-variables.mdx: an env value
  `{{ RUNPOD_SECRET_<name> }}` is the secret's value in the container): the account's secrets
  (`secrets`, name -> value) are put in at each container start; the API echoes the reference,
  never the value. An unknown name stays as written.
- Actions (openapi.json, POST /v2/pods/{id}/action: "Requesting an action that is not valid for
  the pod's current status returns 409"): a stop makes the pod EXITED at once, while its container
  still gets the grace, so a second stop is 409.

Fault injection and measurement (the fake's own, no rule of the document):
- `fail_next` answers with an error (after carrying the request out, if asked) and is not
  counted against the rate limits; `garble_next` carries a request out (counted, as the API saw
  it) and answers it with a 2xx and a body of nonsense, unchecked and without RateLimit
  headers; `drop_log_streams` closes every open log stream (as a proxy does) and
  `log_connections` counts a pod's streams;
- `create_delay`: creates of pods and clusters wait this long before they are carried out (in
  parallel, not in turn);
- each pod's time in a billing status and its price (`PodView.billed_seconds`, `.price`: pods
  are billed by the second, pods/pricing.mdx).

Simplified (the fake's own choices):
- capacity is unlimited unless `no_capacity()` says otherwise, in every data center; no templates
  (templateId is 400), no PATCH (of pods, clusters or network volumes), no registry changes,
  no CPU catalog (501 for what the fake does not serve); RAY and SLURM clusters are 400;
- a terminated pod leaves the API at once: it is no longer listed and GET answers 404, while its
  processes are stopped and its namespace deleted in the background (`pods[id].torn_down` says
  when that is over, `wait_torn_down()` waits for it); log streams already open end only then,
  so they carry the container's last lines; its pod-scoped key stays valid (never 401);
- ERROR costs 0.0 and does not bill; after `max_restarts` automatic restarts in a row the pod is
  ERROR; an image missing from `images` fails to pull (ERROR);
- volumes: a persistent mount is a directory of its own per pod under `root`, a network volume
  one per volumeId shared by the pods that mount it (deleting the volume, allowed while pods
  mount it, leaves it to them; its size is not enforced, nor is it billed); there is no mount
  namespace, so request env values under the mount path are rewritten to that directory, and
  with the volume at /workspace (where podagent looks) PODAGENT_LOG_DIR and
  PODAGENT_CHECKPOINT_DIR point into it unless the request sets them;
- what a test pod needs on this machine is added to the environment: PODAGENT_DNS_SERVER, a short
  PODAGENT_RAY_TEMP_DIR, PYTHONUNBUFFERED, PYTHONPATH (this repository); the process starts in a
  directory of its own under `root`; no GPUs exist (RUNPOD_GPU_COUNT is what was asked for;
  PODAGENT_GPU_CHECK=off unless the pod's env says otherwise).

Not thread-safe towards the PodNetwork it is given: while it provisions, add no pods to that
network from other threads.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import datetime as dt
import http
import json
import math
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.fakes.served import ServedFake
from tests.harness.agents import clean_environ
from tests.harness.pods import (
    RUNPOD_ZONE,
    DnsServer,
    Pod,
    PodNetwork,
    _kill_netns_processes,
    netns_pids,
    random_pod_id,
    wait_for,
)

__all__ = [
    "BILLING",
    "DEFAULT_DATA_CENTERS",
    "DEFAULT_GPUS",
    "DEFAULT_RATE_LIMITS",
    "DEFAULT_RATE_WINDOWS",
    "SCHEMAS",
    "Exit",
    "FakeRunPodCloud",
    "Leftover",
    "LogLine",
    "PodView",
    "RateLimiter",
    "RequestRecord",
    "Schemas",
]

SCHEMA_FILE = Path(__file__).with_name("runpod_v2_schema.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
_DOC_URI = "urn:runpod:api-v2"
_SECRET_REF = re.compile(r"\{\{\s*RUNPOD_SECRET_([A-Za-z0-9_.-]+)\s*\}\}")
_REF_PREFIX = "#/components/schemas/"

BILLING = ("PROVISIONING", "STARTING", "RUNNING")
# The actions the document allows in each status.
ACTIONS = {
    "PROVISIONING": ["stop", "terminate"],
    "STARTING": ["stop", "terminate"],
    "RUNNING": ["stop", "restart", "terminate"],
    "EXITED": ["start", "terminate"],
    "ERROR": ["start", "terminate"],
    "TERMINATED": [],
}
PRIMARY_PORT = "29500"  # RunPod's documentation uses it; "all ports are available"
CPUS_PER_GPU = 16
CPU_PRICE_PER_VCPU = 0.03
DEFAULT_DISK_GB = 20
CUDA_VERSION = "12.8"
_HEARTBEAT_S = 5.0  # an idle log stream writes an SSE comment this often (finds gone clients)

DEFAULT_GPUS: tuple[dict[str, Any], ...] = (
    {"id": "NVIDIA H100 80GB HBM3", "name": "H100 SXM", "pool": "ADA_80_PRO",
     "manufacturer": "NVIDIA", "memory": 80, "secure": True, "community": True,
     "price": {"secure": 2.99, "community": 2.69}, "maxCount": {"secure": 8, "community": 8}},
    {"id": "NVIDIA A100 80GB PCIe", "name": "A100 PCIe", "pool": "AMPERE_80",
     "manufacturer": "NVIDIA", "memory": 80, "secure": True, "community": True,
     "price": {"secure": 1.64, "community": 1.19}, "maxCount": {"secure": 8, "community": 8}},
    {"id": "NVIDIA GeForce RTX 4090", "name": "RTX 4090", "pool": "ADA_24",
     "manufacturer": "NVIDIA", "memory": 24, "secure": True, "community": True,
     "price": {"secure": 0.44, "community": 0.31}, "maxCount": {"secure": 8, "community": 4}},
)
# The first is the default placement. EUR-IS-1 is not among the data centers that
# pods/networking.mdx lists for Global Networking.
DEFAULT_DATA_CENTERS: tuple[dict[str, Any], ...] = (
    {"id": "US-KS-2", "name": "US Kansas 2", "region": "NORTH_AMERICA", "globalNetwork": True,
     "networkVolumeTypes": ["STANDARD"], "compliance": []},
    {"id": "EU-RO-1", "name": "EU Romania 1", "region": "EUROPE", "globalNetwork": True,
     "networkVolumeTypes": ["STANDARD", "HIGH_PERFORMANCE"], "compliance": ["GDPR"]},
    {"id": "EUR-IS-1", "name": "EUR Iceland 1", "region": "EUROPE", "globalNetwork": False,
     "networkVolumeTypes": ["STANDARD"], "compliance": ["GDPR"]},
)
# The document's example (components.schemas.RateLimitPolicyHeader): quota per window, and
# each window's length in seconds.
DEFAULT_RATE_LIMITS = {"minute": 60, "hour": 3000, "day": 50000}
DEFAULT_RATE_WINDOWS = {"minute": 60.0, "hour": 3600.0, "day": 86400.0}
LOG_RESUME = ("after", "again")
POD_KEY = ("refuse", "own", "account")


# --------------------------------------------------------------------------------------------
# schemas


class Schemas:
    """RunPod's v2 component schemas as validators; messages name the place and the field."""

    def __init__(self, path: Path = SCHEMA_FILE) -> None:
        doc = json.loads(path.read_text())
        self.schemas: dict[str, Any] = doc["schemas"]
        self.parameters: dict[str, dict[str, Any]] = {
            p["name"]: p for p in doc["parameters"].values()}
        resource = DRAFT202012.create_resource({"components": {"schemas": self.schemas}})
        self._registry = Registry().with_resource(_DOC_URI, resource)
        self._validators: dict[str, Draft202012Validator] = {}
        self._lock = threading.Lock()

    def _validator(self, key: str, schema: Any) -> Draft202012Validator:
        with self._lock:
            if key not in self._validators:
                self._validators[key] = Draft202012Validator(
                    _absolute_refs(schema), registry=self._registry)
            return self._validators[key]

    def errors(self, name: str, instance: Any) -> list[str]:
        """Every violation of schema `name` by `instance`, "<json path>: <what>"; [] if valid."""
        if name not in self.schemas:
            raise KeyError(f"no schema {name!r}")
        ref = {"$ref": _REF_PREFIX + name}
        found = self._validator(name, ref).iter_errors(instance)
        return sorted({m for e in found if (m := self._message(ref, e)) is not None})

    def parameter_errors(self, name: str, value: Any) -> list[str]:
        """A query or header parameter of the document (e.g. "tail") against its schema."""
        return self.value_errors(name, self.parameters[name]["schema"], value)

    def value_errors(self, name: str, schema: Any, value: Any) -> list[str]:
        """A value named `name` (in messages: "$.<name>...") against a schema of its own, whose
        refs point into the document's schemas (a parameter defined inline in a path)."""
        key = "value:" + json.dumps(schema, sort_keys=True)
        found = self._validator(key, schema).iter_errors(value)
        out = []
        for e in found:
            m = self._message(schema, e)
            if m is not None:
                out.append(m.replace("$", f"$.{name}", 1))
        return sorted(out)

    def _message(self, root: Any, error: ValidationError) -> str | None:
        where = error.json_path
        if error.validator in ("unevaluatedProperties", "additionalProperties"):
            names = re.findall(r"'((?:[^'\\]|\\.)*)'", error.message.partition("(")[2])
            # A field whose own value is wrong makes its branch fail, and 2020-12 then counts
            # every field of that branch as unevaluated: those were reported at their place.
            declared = self._declared(root, list(error.absolute_path))
            names = [n for n in names if n not in declared]
            if not names:
                return None
            return f"{where}: additional properties {', '.join(repr(n) for n in names)} not allowed"
        if error.validator == "required":
            name = error.message.split("'")[1] if "'" in error.message else error.message
            return f"{where}: missing property '{name}'"
        return f"{where}: {error.message}"

    def _resolve(self, schema: Any) -> Any:
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and \
                schema["$ref"].startswith(_REF_PREFIX):
            schema = self.schemas[schema["$ref"][len(_REF_PREFIX):]]
        return schema

    def _branches(self, schema: Any) -> list[dict[str, Any]]:
        """The schema and every subschema that applies to the same instance."""
        schema = self._resolve(schema)
        if not isinstance(schema, dict):
            return []
        out = [schema]
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in schema.get(key, []):
                out += self._branches(sub)
        for key in ("then", "else"):
            if key in schema:
                out += self._branches(schema[key])
        return out

    def _declared(self, schema: Any, path: list[Any]) -> set[str]:
        branches = self._branches(schema)
        for part in path:
            subs: list[Any] = []
            for b in branches:
                if isinstance(part, int):
                    if isinstance(b.get("items"), dict):
                        subs.append(b["items"])
                elif part in b.get("properties", {}):
                    subs.append(b["properties"][part])
                elif isinstance(b.get("additionalProperties"), dict):
                    subs.append(b["additionalProperties"])
            branches = [x for s in subs for x in self._branches(s)]
        return {name for b in branches for name in b.get("properties", {})}


def _absolute_refs(schema: Any) -> Any:
    """Refs of the document ("#/components/...") made to point into the registered resource."""
    if isinstance(schema, dict):
        return {k: (_DOC_URI + v if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _absolute_refs(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_absolute_refs(x) for x in schema]
    return schema


SCHEMAS = Schemas()


def _catalog(schema: str, entries: Sequence[Mapping[str, Any]],
             empty: bool = True) -> list[dict[str, Any]]:
    """Copies of `entries`, each checked against the document's `schema`, their ids unique."""
    out = [json.loads(json.dumps(e)) for e in entries]
    if not out and not empty:
        raise ValueError(f"a catalog of {schema} needs at least one entry")
    for entry in out:
        errors = SCHEMAS.errors(schema, entry)
        if errors:
            raise ValueError(f"{entry.get('id')!r} is no {schema}: {errors}")
    ids = [e["id"] for e in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"ids of {schema} entries repeat: {ids}")
    return out


# --------------------------------------------------------------------------------------------
# what tests see


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON, or None (no body, or not JSON)
    status: int  # what the fake answered
    schema_errors: list[str]  # the request against the document; [] when valid
    time: float  # time.time() when it arrived
    fault: bool = False  # answered by fail_next or garble_next
    key: str | None = None  # whose key: "account", "pod:<pod id>", None (none or unknown)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)  # RateLimit, Retry-After..


@dataclasses.dataclass(frozen=True)
class Exit:
    start: int  # the how-manieth container start of its pod (1, 2, ...)
    code: int  # as a container runtime reports it: 128 + n for a signal n
    time: float  # time.time()
    output: Path  # that start's stdout and stderr
    stopped_by: str | None  # None: it exited by itself; else "stop", "restart" or "terminate"


@dataclasses.dataclass(frozen=True)
class LogLine:
    seq: int
    ts: float  # its arrival, rounded down to the fake's log_resolution
    source: str  # "container" or "system"
    line: str

    @property
    def us(self) -> int:
        """ts in whole microseconds: what resuming compares (floats of two origins may not)."""
        return round(self.ts * 1_000_000)

    @property
    def event_id(self) -> str:
        # The document: "Log-event `id` values are the event `ts` timestamp".
        return _rfc3339(self.ts)

    def sse(self) -> bytes:
        data = json.dumps({"ts": _rfc3339(self.ts), "source": self.source, "line": self.line},
                          separators=(",", ":"))
        return f"id: {self.event_id}\ndata: {data}\n\n".encode()


@dataclasses.dataclass(frozen=True)
class PodView:
    id: str
    name: str
    status: str
    env: dict[str, str]  # the request's env, as the API echoes it
    process_env: dict[str, str]  # what the latest container start got ({} before the first)
    cluster: dict[str, Any] | None  # {"id", "rank"[, "ip"]} for a cluster member
    exits: tuple[Exit, ...]
    harness: Pod | None  # its network namespace, once provisioned (None again once torn down)
    api_key: str  # its pod-scoped RUNPOD_API_KEY
    volume: Path | None  # the directory its mount path stands for
    starts: int
    torn_down: bool  # terminated and its namespace deleted
    ip: str | None
    registry: str | None  # the registry credential id it was created with
    data_center: str  # where it was placed
    price: float  # $/h while billing
    billed_seconds: float  # time in PROVISIONING, STARTING, RUNNING (until now, if still so)

    @property
    def billed_dollars(self) -> float:
        """What it cost so far (RunPod bills pods by the second: pods/pricing.mdx)."""
        return self.billed_seconds * self.price / 3600


@dataclasses.dataclass(frozen=True)
class Leftover:
    pod_id: str
    pid: int
    cmdline: str


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def parse_rfc3339_us(text: str) -> int | None:
    """Whole microseconds since the epoch (finer digits dropped), or None when `text` is no
    RFC 3339 date-time."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\d)[Tt ](\d\d:\d\d:\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)", text)
    if not m:
        return None
    frac = (m.group(3) or ".0")[1:7].ljust(6, "0")
    zone = "+00:00" if m.group(4) in ("Z", "z") else m.group(4)
    try:
        when = dt.datetime.fromisoformat(f"{m.group(1)}T{m.group(2)}.{frac}{zone}")
    except ValueError:
        return None
    return (when - _EPOCH) // dt.timedelta(microseconds=1)


def parse_rfc3339(text: str) -> float | None:
    """Seconds since the epoch, or None when `text` is no RFC 3339 date-time."""
    us = parse_rfc3339_us(text)
    return None if us is None else us / 1_000_000


# --------------------------------------------------------------------------------------------
# rate limits


@dataclasses.dataclass
class _Window:
    start: float  # the clock at its first request
    used: int = 0


class RateLimiter:
    """RunPod's per-window quotas (components.responses.TooManyRequestsError): fixed windows per
    key, each from the key's first request in it until its length is over; the state goes out
    as the IETF ratelimit-headers draft's RateLimit and RateLimit-Policy, in the document's
    format (components.schemas.RateLimitHeader, RateLimitPolicyHeader)."""

    def __init__(self, limits: Mapping[str, int], windows: Mapping[str, float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        missing = sorted(set(limits) - set(windows))
        if missing:
            raise ValueError(f"no window length for {missing}")
        if any(q < 0 for q in limits.values()) or any(float(windows[n]) <= 0 for n in limits):
            raise ValueError(f"bad rate limits {dict(limits)} / windows {dict(windows)}")
        self.limits = {n: int(q) for n, q in limits.items()}
        self.lengths = {n: float(windows[n]) for n in limits}
        self.clock = clock
        self.policy = ", ".join(f'"{n}";q={q};w={math.ceil(self.lengths[n])}'
                                for n, q in self.limits.items())
        self._keys: dict[str, dict[str, _Window]] = {}
        self._lock = threading.Lock()

    def admit(self, key: str) -> tuple[str | None, dict[str, str]]:
        """Count a request of `key`: (None, headers) when every quota allows it; else (the
        exceeded window, headers with Retry-After) and it is not counted (nothing was done).
        Without limits: (None, {}), an exempt caller's."""
        if not self.limits:
            return None, {}
        with self._lock:
            now = self.clock()
            windows = self._current(key, now)
            over = [n for n, w in windows.items() if w.used >= self.limits[n]]
            if not over:
                for w in windows.values():
                    w.used += 1
            headers = {"RateLimit": self._state(windows, now), "RateLimit-Policy": self.policy}
        if not over:
            return None, headers
        # The one to wait for longest: retrying before it resets is refused again.
        worst = max(over, key=lambda n: self._left(windows[n], n, now))
        headers["Retry-After"] = str(max(1, math.ceil(self._left(windows[worst], worst, now))))
        return worst, headers

    def used(self, key: str) -> dict[str, int]:
        """Requests of `key` counted in each window now (0 in one that is over: looking starts
        no window)."""
        with self._lock:
            now, windows = self.clock(), self._keys.get(key, {})
            return {n: (windows[n].used if n in windows and now < windows[n].start + length
                        else 0) for n, length in self.lengths.items()}

    def _current(self, key: str, now: float) -> dict[str, _Window]:
        windows = self._keys.setdefault(key, {})
        for name, length in self.lengths.items():
            if name not in windows or now >= windows[name].start + length:
                windows[name] = _Window(now)
        return windows

    def _left(self, window: _Window, name: str, now: float) -> float:
        return window.start + self.lengths[name] - now

    def _state(self, windows: dict[str, _Window], now: float) -> str:
        return ", ".join(
            f'"{n}";r={self.limits[n] - w.used};t={max(0, math.ceil(self._left(w, n, now)))}'
            for n, w in windows.items())


# --------------------------------------------------------------------------------------------
# internal state


@dataclasses.dataclass(eq=False)
class _PodState:
    id: str
    name: str
    created: float
    image: str
    args: str
    env: dict[str, str]
    ports: list[str]
    disk: int
    mounts: dict[str, Any]
    gpu: dict[str, Any] | None
    cpu: dict[str, Any] | None
    cloud: str
    dc: str
    price: float  # per hour while billing
    global_networking: bool = False
    cluster: dict[str, Any] | None = None
    start_jupyter: bool = False
    registry: str | None = None
    status: str = "PROVISIONING"  # change it with set_status: billing follows it
    want: str = "run"  # run | stop | terminate: what the API last asked for
    generation: int = 0  # bumped by start and restart: the container to run is a new one
    gone: bool = False  # terminated: no longer in the API
    torn_down: bool = False
    started_at: float | None = None
    harness: Pod | None = None
    ip: str | None = None
    pulled: bool = False
    proc: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    out_path: Path | None = None
    stopping: str | None = None  # why the running container is being stopped
    starts: int = 0
    auto_restarts: int = 0
    exits: list[Exit] = dataclasses.field(default_factory=list)
    logs: list[LogLine] = dataclasses.field(default_factory=list)
    api_key: str = ""
    hostname: str = ""
    ray_tmp: str = ""
    home: Path | None = None
    volume: Path | None = None
    mount_path: str | None = None
    process_env: dict[str, str] = dataclasses.field(default_factory=dict)
    thread: threading.Thread | None = None
    log_connections: int = 0
    billed: float = 0.0  # seconds in a billing status, up to billing_since
    billing_since: float | None = None  # when it last went into a billing status, if it is in one

    def __post_init__(self) -> None:
        if self.status in BILLING:
            self.billing_since = self.created

    def set_status(self, status: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.billing_since is not None and status not in BILLING:
            self.billed += now - self.billing_since
            self.billing_since = None
        elif self.billing_since is None and status in BILLING:
            self.billing_since = now
        self.status = status

    def billed_seconds(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return self.billed + (now - self.billing_since if self.billing_since is not None else 0.0)

    @property
    def gpu_count(self) -> int:
        return int(self.gpu.get("count", 1)) if self.gpu else 0

    @property
    def vcpus(self) -> int:
        return int(self.cpu["vcpuCount"]) if self.cpu else CPUS_PER_GPU * self.gpu_count

    def view(self) -> PodView:
        return PodView(self.id, self.name, self.status, dict(self.env), dict(self.process_env),
                       dict(self.cluster) if self.cluster else None, tuple(self.exits),
                       self.harness, self.api_key, self.volume, self.starts, self.torn_down,
                       self.ip, self.registry, self.dc, self.price, self.billed_seconds())


@dataclasses.dataclass(eq=False)
class _ClusterState:
    id: str
    name: str
    type: str
    compute: dict[str, Any]
    dc: str
    created: float
    members: list[_PodState]
    gone: bool = False


def pod_json(pod: _PodState, now: float | None = None) -> dict[str, Any]:
    """The Pod object the API answers with (a pure function of the state: tests render any)."""
    now = time.time() if now is None else now
    out: dict[str, Any] = {
        "id": pod.id,
        "name": pod.name,
        "image": pod.image,
        "args": pod.args,
        "disk": pod.disk,
        "ports": list(pod.ports),
        "env": dict(pod.env),
        "registry": pod.registry,
        "status": pod.status,
        "actions": list(ACTIONS[pod.status]),
        "mounts": json.loads(json.dumps(pod.mounts)),
        "cloud": pod.cloud,
        "dataCenterId": pod.dc,
        "cudaVersion": CUDA_VERSION if pod.gpu else None,
        "ssh": {"proxy": {"host": "ssh.runpod.io", "port": 22,
                          "username": f"{pod.id}-{pod.hostname[-8:]}",
                          "command": f"ssh {pod.id}-{pod.hostname[-8:]}@ssh.runpod.io"},
                "direct": None},
        "template": None,
        "cost": round(pod.price, 4) if pod.status in BILLING else 0.0,
        "locked": False,
        "globalNetworking": {"enabled": False},
        "runtime": ({"uptime": int(now - pod.started_at)}
                    if pod.status == "RUNNING" and pod.started_at else None),
        "createdAt": _rfc3339(pod.created),
        "startedAt": _rfc3339(pod.started_at) if pod.started_at else None,
    }
    if pod.gpu:
        out["gpu"] = {"id": pod.gpu["id"], "count": pod.gpu_count}
    if pod.cpu:
        out["cpu"] = {"id": pod.cpu["id"], "vcpuCount": pod.vcpus, "memory": 4 * pod.vcpus}
    if pod.global_networking:
        out["globalNetworking"] = {"enabled": True, "internalDns": f"{pod.id}.{RUNPOD_ZONE}"}
        if pod.ip:
            out["globalNetworking"]["ip"] = pod.ip
    if pod.cluster:
        out["cluster"] = dict(pod.cluster)
    return out


def cluster_json(cluster: _ClusterState, cidr: str | None) -> dict[str, Any]:
    members = [p for p in cluster.members if not p.gone]
    out: dict[str, Any] = {
        "id": cluster.id,
        "name": cluster.name,
        "type": cluster.type,
        "compute": dict(cluster.compute),
        "dataCenterId": cluster.dc,
        "pods": {"total": len(members),
                 "byStatus": dict(collections.Counter(p.status for p in members))},
        "createdAt": _rfc3339(cluster.created),
    }
    primary = next((p for p in members if p.cluster and p.cluster["rank"] == 0), None)
    if primary is not None:
        out["primary"] = {"podId": primary.id, "status": primary.status}
    if cidr and any(p.ip for p in members):
        out["network"] = {"cidr": cidr}
    return out


@dataclasses.dataclass
class _Reply:
    status: int
    body: Any = None
    schema: str | None = None  # what body must match (errors: ErrorResponse)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    stream: Callable[[BaseHTTPRequestHandler], None] | None = None
    raw: bytes | None = None  # sent as it is (garble_next), unchecked


def _problem(status: int, detail: str, errors: Sequence[str] | None = None,
             headers: Mapping[str, str] | None = None) -> _Reply:
    body: dict[str, Any] = {"title": http.HTTPStatus(status).phrase, "status": status,
                            "detail": detail}
    if errors:
        body["errors"] = list(errors)
    return _Reply(status, body, "ErrorResponse", dict(headers or {}))


class _Refused(Exception):
    """A handler's way out with an error answer."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.reply = _problem(status, detail)


@dataclasses.dataclass
class _Fault:
    remaining: int
    status: int
    retry_after: int | None
    match: re.Pattern[str] | None
    after_acting: bool = False  # the request is carried out, and then answered with status
    lands_after: float | None = None  # ... carried out that many seconds after the answer


@dataclasses.dataclass
class _Garble:
    remaining: int
    status: int
    body: bytes
    match: re.Pattern[str] | None
    lands_after: float | None = None  # carried out that many seconds after the answer


# The v2 document's endpoints the fake knows: path pattern, then per method the handler, the
# schema of the request body and the query parameters it takes. A handler of None: in the
# document but not served by the fake (501).
_CATALOG_PARAMS = {"include", "product", "count", "cloud", "countryCodes", "cudaVersions",
                   "minCudaVersion"}
# GET /v2/catalog/datacenters: its comma-separated (style form, explode false) parameters and
# the schema of their items, as the path defines them inline; globalNetwork is a boolean.
_DC_LISTS = {"include": "DataCenterInclude", "regions": "DataCenterRegion",
             "networkVolumeTypes": "VolumeType", "compliance": "Compliance"}
_DC_FILTERS = {"regions", "networkVolumeTypes", "compliance", "globalNetwork"}
_ROUTES: list[tuple[re.Pattern[str], dict[str, tuple[str | None, str | None, set[str]]]]] = [
    (re.compile(r"/v2/catalog/gpus"), {"GET": ("_list_gpus", None, _CATALOG_PARAMS)}),
    (re.compile(r"/v2/catalog/gpus/(?P<id>[^/]+)"),
     {"GET": ("_get_gpu", None, _CATALOG_PARAMS)}),
    (re.compile(r"/v2/catalog/cpus"), {"GET": (None, None, set())}),
    (re.compile(r"/v2/catalog/cpus/(?P<id>[^/]+)"), {"GET": (None, None, set())}),
    (re.compile(r"/v2/catalog/datacenters"),
     {"GET": ("_list_data_centers", None, {"include", *_DC_FILTERS})}),
    (re.compile(r"/v2/catalog/datacenters/(?P<id>[^/]+)"),
     {"GET": ("_get_data_center", None, {"include"})}),
    (re.compile(r"/v2/registries"), {"GET": ("_list_registries", None, set()),
                                     "POST": (None, None, set())}),
    (re.compile(r"/v2/registries/delegations"), {"GET": (None, None, set()),
                                                 "POST": (None, None, set())}),
    (re.compile(r"/v2/registries/delegations/(?P<id>[^/]+)"), {"DELETE": (None, None, set())}),
    (re.compile(r"/v2/registries/(?P<id>[^/]+)"), {"GET": ("_get_registry", None, set()),
                                                    "DELETE": (None, None, set())}),
    (re.compile(r"/v2/pods"), {"GET": ("_list_pods", None, {"includeClusterPods"}),
                               "POST": ("_create_pod", "CreatePodRequest", set())}),
    (re.compile(r"/v2/pods/(?P<id>[^/]+)"), {"GET": ("_get_pod", None, set()),
                                              "DELETE": ("_delete_pod", None, set()),
                                              "PATCH": (None, None, set())}),
    (re.compile(r"/v2/pods/(?P<id>[^/]+)/action"),
     {"POST": ("_pod_action", "PodActionRequest", set())}),
    (re.compile(r"/v2/pods/(?P<id>[^/]+)/logs"),
     {"GET": ("_pod_logs", None, {"source", "tail", "since"})}),
    (re.compile(r"/v2/clusters"), {"GET": ("_list_clusters", None, set()),
                                   "POST": ("_create_cluster", "CreateClusterRequest", set())}),
    (re.compile(r"/v2/clusters/(?P<id>[^/]+)"), {"GET": ("_get_cluster", None, set()),
                                                  "DELETE": ("_delete_cluster", None, set()),
                                                  "PATCH": (None, None, set())}),
    (re.compile(r"/v2/clusters/(?P<id>[^/]+)/pods"), {"GET": ("_cluster_pods", None, set())}),
    (re.compile(r"/v2/network-volumes"),
     {"GET": ("_list_network_volumes", None, set()),
      "POST": ("_create_network_volume", "CreateNetworkVolumeRequest", set())}),
    (re.compile(r"/v2/network-volumes/(?P<id>[^/]+)"),
     {"GET": ("_get_network_volume", None, set()),
      "PATCH": (None, "UpdateNetworkVolumeRequest", set()),
      "DELETE": ("_delete_network_volume", None, set())}),
]
_SCHEMA_OF_ANSWER = {"_list_gpus": "ListGpuTypesResponse", "_get_gpu": "GpuType",
                     "_list_pods": "ListPodsResponse", "_create_pod": "Pod", "_get_pod": "Pod",
                     "_pod_action": "Pod", "_list_clusters": "ListClustersResponse",
                     "_create_cluster": "Cluster", "_get_cluster": "Cluster",
                     "_cluster_pods": "ListPodsResponse",
                     "_list_data_centers": "ListDataCentersResponse",
                     "_get_data_center": "DataCenter", "_list_registries": "ListRegistriesResponse",
                     "_get_registry": "Registry",
                     "_list_network_volumes": "ListNetworkVolumesResponse",
                     "_create_network_volume": "NetworkVolume",
                     "_get_network_volume": "NetworkVolume"}
_CREATES = ("_create_pod", "_create_cluster")


@dataclasses.dataclass
class _Call:
    """A request as read and routed; answered in turn by auth, rate limits, the route's own
    refusal, the schema checks and at last the handler `op`."""

    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: Any
    op: str | None = None  # the handler; None: no route, or one the fake does not serve
    params: dict[str, str] = dataclasses.field(default_factory=dict)  # from the path
    refusal: _Reply | None = None  # the route's own answer: 404, 405, 501
    malformed: str | None = None  # the body is no JSON (400)
    errors: list[str] = dataclasses.field(default_factory=list)  # against the document (422)
    slips: list[str] = dataclasses.field(default_factory=list)  # recorded, not refused


# --------------------------------------------------------------------------------------------
# the fake


class FakeRunPodCloud(ServedFake):
    """RunPod's v2 REST API whose pods really run; use as a context manager."""

    name = "fake-runpod-cloud"

    def __init__(self, net: PodNetwork, dns: DnsServer, root: Path, *, api_key: str,
                 images: Mapping[str, Sequence[str]],
                 gpus: Sequence[Mapping[str, Any]] | None = None,
                 data_centers: Sequence[Mapping[str, Any]] | None = None,
                 data_center: str | None = None,
                 registries: Sequence[Mapping[str, str]] = (),
                 private_images: Mapping[str, str] | None = None,
                 provision_delay: float = 0.0, create_delay: float = 0.0,
                 max_restarts: int = 3, stop_grace: float = 5.0,
                 log_resolution: float = 0.001, log_resume: str = "after",
                 rate_limits: Mapping[str, int] | None = None,
                 rate_windows: Mapping[str, float] | None = None,
                 pod_key: str = "refuse", secrets: Mapping[str, str] | None = None,
                 network_volumes: Mapping[str, str] | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        """`gpus`, `data_centers` (None: DEFAULT_GPUS, DEFAULT_DATA_CENTERS) and `registries`
        are the catalogs, each entry checked against the document's GpuType, DataCenter and
        Registry; `data_center` is the default placement (None: the catalog's first);
        `private_images` maps an image of `images` to the registry credential id that pulls
        it. `create_delay`: seconds a create of a pod or cluster waits before it is carried
        out.
        `log_resolution`: seconds to which log timestamps (and so event ids) are rounded down;
        `log_resume`: "after" or "again" (see the module's docstring). `rate_limits`: quota
        per window name (None: DEFAULT_RATE_LIMITS; {}: exempt, no limits and no headers),
        `rate_windows`: their lengths in seconds (those not given: DEFAULT_RATE_WINDOWS).
        `pod_key`: what a pod-scoped key may do, "refuse", "own" or "account".
        `network_volumes`: the account's network volumes at the start, id -> data center id
        (each of size 50, named after its id, of its data center's first networkVolumeTypes
        entry)."""
        super().__init__(host, port)
        self.net, self.dns, self.root = net, dns, Path(root)
        self.api_key = api_key
        self.images = {k: list(v) for k, v in images.items()}
        self.gpus = _catalog("GpuType", DEFAULT_GPUS if gpus is None else gpus)
        self.data_centers = _catalog("DataCenter", DEFAULT_DATA_CENTERS if data_centers is None
                                     else data_centers, empty=False)
        self._dcs = {dc["id"]: dc for dc in self.data_centers}
        self.data_center = self.data_centers[0]["id"] if data_center is None else data_center
        if self.data_center not in self._dcs:
            raise ValueError(f"data center {self.data_center!r} is not in the catalog")
        self.registries = _catalog("Registry", registries)
        self._registries = {r["id"]: r for r in self.registries}
        self.private_images = dict(private_images or {})
        for image, registry in self.private_images.items():
            if image not in self.images or registry not in self._registries:
                raise ValueError(f"private image {image!r}: not in images, or its registry "
                                 f"credential {registry!r} is not in registries")
        if log_resume not in LOG_RESUME or pod_key not in POD_KEY or log_resolution <= 0:
            raise ValueError(f"log_resume must be one of {LOG_RESUME}, pod_key one of "
                             f"{POD_KEY}, log_resolution positive")
        self.provision_delay = provision_delay
        self.create_delay = create_delay
        self.max_restarts = max_restarts
        self.stop_grace = stop_grace
        self._log_res_us = max(1, round(log_resolution * 1_000_000))
        self.log_resume = log_resume
        self.pod_key = pod_key
        self.secrets = dict(secrets or {})
        self.rate_limiter = RateLimiter(
            DEFAULT_RATE_LIMITS if rate_limits is None else rate_limits,
            {**DEFAULT_RATE_WINDOWS, **(rate_windows or {})})
        state = threading.RLock()  # guards pods, clusters and their logs
        self._cond = threading.Condition(state)
        # The same lock, for log streams only: output lines come often and need not wake the
        # pods' supervisors.
        self._logs_changed = threading.Condition(state)
        self._net_lock = threading.Lock()  # PodNetwork is not thread-safe
        self._pods: dict[str, _PodState] = {}
        self._clusters: dict[str, _ClusterState] = {}
        self._volumes: dict[str, dict[str, Any]] = {}  # NetworkVolume objects by id
        for volume_id, dc_id in (network_volumes or {}).items():
            try:
                kind = self._volume_type(dc_id, None)
            except _Refused as refused:
                raise ValueError(f"network volume {volume_id!r}: {refused}") from None
            volume = {"id": volume_id, "name": volume_id, "size": 50, "dataCenter": dc_id,
                      "type": kind}
            errors = SCHEMAS.errors("NetworkVolume", volume)
            if errors:
                raise ValueError(f"{volume_id!r} is no NetworkVolume: {errors}")
            self._volumes[volume_id] = volume
        self._records: list[RequestRecord] = []
        self._answering = 0  # requests carried out whose record is not appended yet
        self._errors: list[str] = []
        self._faults: list[_Fault] = []
        self._garbles: list[_Garble] = []
        self._pod_keys: dict[str, str] = {}  # a pod-scoped key -> its pod's id
        self._stream_epoch = 0  # drop_log_streams ends the streams opened before it bumped this
        self._no_capacity: set[str] = set()
        self._holds: list[re.Pattern[str]] = []
        self._callbacks: list[Callable[[RequestRecord], None]] = []
        self._harness_names = 0
        self._closing = False

    # -- what tests read ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL for the client (RUNPOD_API_URL): the server root; it appends /v2/...."""
        return self.origin

    @property
    def requests(self) -> list[RequestRecord]:
        return self._copy(self._records)

    def invalid_requests(self) -> list[RequestRecord]:
        """Requests that broke the document (a client bug), whatever was answered."""
        return [r for r in self.requests if r.schema_errors]

    @property
    def fake_errors(self) -> list[str]:
        """Bugs of the fake itself (an answer that broke the schema, a supervisor that failed);
        `__exit__` raises when there are any."""
        return self._copy(self._errors)

    @property
    def pods(self) -> dict[str, PodView]:
        """Every pod ever created, terminated ones included (status TERMINATED)."""
        with self._cond:
            return {p.id: p.view() for p in self._pods.values()}

    @property
    def volumes(self) -> list[dict[str, Any]]:
        """The network volumes there are now (deleted ones not), as GET /v2/network-volumes
        gives them."""
        with self._cond:
            return [dict(v) for v in self._volumes.values()]

    def billing(self) -> list[PodView]:
        """Pods that still cost money (PROVISIONING, STARTING, RUNNING)."""
        return [p for p in self.pods.values() if p.status in BILLING]

    def leftover_processes(self) -> list[Leftover]:
        """Every process alive in a network namespace of any of the fake's pods (running ones
        included, and terminated ones not torn down yet)."""
        with self._cond:
            harnesses = [(p.id, p.harness) for p in self._pods.values() if p.harness]
        out = []
        for pod_id, harness in harnesses:
            for pid in netns_pids(harness.netns):
                with contextlib.suppress(psutil.Error):
                    out.append(Leftover(pod_id, pid, " ".join(psutil.Process(pid).cmdline())))
        return out

    def logs(self, pod_id: str) -> list[LogLine]:
        with self._cond:
            return list(self._pods[pod_id].logs)

    def log_connections(self, pod_id: str) -> int:
        """How many log streams of the pod were opened (answered 200) so far."""
        with self._cond:
            return self._pods[pod_id].log_connections

    def calls_per_window(self, key: str | None = None) -> dict[str, int]:
        """Requests counted against the rate limits in each window now, of the account's key
        (None) or of a pod's ("pod:<id>", as RequestRecord.key says)."""
        return self.rate_limiter.used(key or "account")

    def wait_status(self, pod_id: str, *statuses: str, timeout: float = 30.0) -> PodView:
        def reached() -> PodView | None:
            view = self.pods[pod_id]
            return view if view.status in statuses else None

        view = wait_for(reached, timeout=timeout, interval=0.05,
                        what=f"pod {pod_id} to be {' or '.join(statuses)}")
        # The request that changed the status is in `requests` once its answer is recorded:
        # the change is made before (under load, a schema check apart).
        with self._cond:
            if not self._cond.wait_for(lambda: self._answering == 0, timeout=timeout):
                raise TimeoutError(f"requests still being answered {timeout:g} s after pod "
                                   f"{pod_id} was {view.status}")
        return view

    def wait_torn_down(self, timeout: float = 30.0) -> None:
        """Until every terminated pod's processes are gone and its namespace deleted."""
        wait_for(lambda: all(p.torn_down for p in self.pods.values() if p.status ==
                             "TERMINATED"), timeout=timeout, interval=0.05,
                 what="terminated pods to be torn down")

    # -- fault injection -----------------------------------------------------------------------

    def fail_next(self, n: int, status: int, retry_after: int | None = None,
                  match: str | None = None, after_acting: bool = False,
                  lands_after: float | None = None) -> None:
        """Answer the next `n` requests (only those whose "METHOD /path" matches the regex
        `match`, if given) with `status` and an ErrorResponse; a 429 carries Retry-After
        (`retry_after` seconds, default 1), another status only when `retry_after` is given.
        `after_acting`: the request is carried out first (a pod is created, say) and only its
        answer is lost, as when a gateway gives up on a backend that went on. `lands_after`:
        the request is carried out that many seconds after its answer (a pod that RunPod
        lists only some time after the create: a look by its name finds nothing meanwhile)."""
        if status < 400:
            raise ValueError("a fault answers with an error status")
        with self._lock:
            self._faults.append(_Fault(n, status, retry_after,
                                       re.compile(match) if match else None, after_acting,
                                       lands_after))

    def clear_faults(self) -> None:
        """Forget every fail_next and garble_next still pending."""
        with self._lock:
            self._faults.clear()
            self._garbles.clear()

    def garble_next(self, n: int, status: int = 200, body: bytes = b"",
                    match: str | None = None, lands_after: float | None = None) -> None:
        """Carry out the next `n` requests (only those whose "METHOD /path" matches the regex
        `match`, if given) and answer each with `status` and exactly `body` (b"": none;
        Content-Type application/json otherwise): an answer that makes no sense. Recorded as
        a fault; the answer is not checked against the document. `lands_after`: carried out
        that many seconds after the answer, as fail_next's."""
        with self._lock:
            self._garbles.append(_Garble(n, status, bytes(body),
                                         re.compile(match) if match else None, lands_after))

    def drop_log_streams(self) -> None:
        """Close every log stream open now, from the server's side (as a proxy that drops
        long connections): a client must connect again to read on."""
        with self._cond:
            self._stream_epoch += 1
            self._logs_changed.notify_all()

    def no_capacity(self, gpu_type_id: str, on: bool = True) -> None:
        """Creates of pods and clusters with this GPU type are refused (400), until off."""
        with self._lock:
            (self._no_capacity.add if on else self._no_capacity.discard)(gpu_type_id)

    def hold_provisioning(self, name_regex: str) -> None:
        """Pods whose name matches stay PROVISIONING (and billing) until released, stopped or
        terminated."""
        with self._cond:
            self._holds.append(re.compile(name_regex))

    def release_provisioning(self, name_regex: str | None = None) -> None:
        """Drop that hold (every hold when None)."""
        with self._cond:
            self._holds = [h for h in self._holds
                           if name_regex is not None and h.pattern != name_regex]
            self._cond.notify_all()

    def after_response(self, callback: Callable[[RequestRecord], None]) -> None:
        """Call `callback(record)` after each response's last byte was written (for a log
        stream: once it ended), on the server's thread; exceptions land in fake_errors."""
        with self._lock:
            self._callbacks.append(callback)

    def clear_after_response(self) -> None:
        with self._lock:
            self._callbacks.clear()

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> FakeRunPodCloud:
        self.root.mkdir(parents=True, exist_ok=True)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                fake._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no stderr lines
                pass

        self._serve(Handler)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate_all()
        finally:
            with self._cond:
                self._closing = True
                self._logs_changed.notify_all()
            super().__exit__(*exc)
        errors = self.fake_errors
        if errors and exc[0] is None:
            raise AssertionError("the fake RunPod cloud failed itself:\n  " + "\n  ".join(errors))

    def terminate_all(self, timeout: float | None = None) -> None:
        """Terminate every pod still there (a test's leftovers) and wait until all are torn
        down."""
        with self._cond:
            for cluster in self._clusters.values():
                cluster.gone = True
            for pod in self._pods.values():
                self._terminate_locked(pod)
            threads = [p.thread for p in self._pods.values() if p.thread]
        deadline = time.monotonic() + (timeout or self.stop_grace + 60)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self._fake_error(f"pods not torn down in time: {stuck}")

    # -- HTTP ------------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        arrived = time.time()
        call = self._read(h)
        fault, acting, later = self._take_fault(call.method, call.path)
        # A fault answered in the API's stead: the request never reached it to be garbled.
        garbled, garble_later = (None, None) if fault and not acting else \
            self._take_garble(call.method, call.path)
        later = later if garble_later is None else garble_later
        who = self._whose(call.headers.get("Authorization"))
        told = fault or garbled  # what the client hears instead of the API's answer
        carried = False  # carried out now: counted in _answering until its record is in
        if told is not None and later is not None:
            reply = told
            threading.Timer(later, self._carry_out_late, (call, who)).start()
        elif fault is not None and not acting:
            reply = fault
        else:
            with self._cond:
                self._answering += 1
            carried = True
            reply = self._answer(call, who, counted=fault is None)
            if fault is not None:
                reply = fault  # done, but the client never hears so
        try:
            if garbled is not None:
                reply = garbled
            else:
                self._check_answer(call.method, call.path, reply)
            record = RequestRecord(call.method, call.path, call.query, call.body, reply.status,
                                   call.errors + call.slips, arrived,
                                   fault is not None or garbled is not None, who,
                                   dict(reply.headers))
            with self._lock:
                self._records.append(record)  # before answering: a client's next look sees it
        finally:
            if carried:
                with self._cond:
                    self._answering -= 1
                    self._cond.notify_all()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client left
            self._send(h, reply)
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(record)
            except Exception as exc:
                self._fake_error(f"after_response callback {callback!r}: {exc!r}")

    def _read(self, h: BaseHTTPRequestHandler) -> _Call:
        """The request, its route, and what it does against the document."""
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        call = _Call(h.command, url.path, query, h.headers, None)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        if raw:
            try:
                call.body = json.loads(raw)
            except ValueError as exc:
                call.malformed = f"$: the body is not JSON ({exc})"
                call.errors.append(call.malformed)
        methods = None
        for pattern, table in _ROUTES:
            m = pattern.fullmatch(call.path)
            if m:
                methods, call.params = table, m.groupdict()
                break
        if methods is None:
            call.errors.append(f"no endpoint {call.path} in the v2 document")
            call.refusal = _problem(404, f"no route for {call.method} {call.path}")
            return call
        if call.method not in methods:
            call.errors.append(f"{call.method} is not a method of {call.path} in the v2 document")
            call.refusal = _problem(405, f"method {call.method} not allowed for {call.path}",
                                    headers={"Allow": ", ".join(methods)})
            return call
        call.op, body_schema, known = methods[call.method]
        if call.op is None:
            call.refusal = _problem(501, f"{call.method} {call.path} is not supported by the fake")
        # Recorded as the client's slip but answered: servers commonly ignore them.
        for name in sorted(set(query) - known):
            call.slips.append(f"unknown query parameter {name!r} for {call.method} {call.path}")
        if body_schema and call.malformed is None:
            call.errors += (SCHEMAS.errors(body_schema, call.body) if call.body is not None
                            else ["$: a JSON body is required"])
        call.errors += self._query_errors(call.op, {k: v for k, v in query.items() if k in known},
                                          h.headers)
        return call

    def _answer(self, call: _Call, who: str | None, counted: bool) -> _Reply:
        """What the API answers (and does): auth, rate limits, the key's permissions, the
        route, the checks, then the handler."""
        if who is None:  # 401s carry no rate limit headers: no caller to count against
            auth = call.headers.get("Authorization") or ""
            return _problem(401, "invalid api key" if auth.startswith("Bearer ")
                            else "missing bearer token")
        limits: dict[str, str] = {}
        if counted:
            window, limits = self.rate_limiter.admit(who)
            if window is not None:
                return _problem(429, f"rate limit exceeded for the {window} window",
                                headers=limits)
        reply = self._forbidden(call, who) or self._dispatch(call)
        reply.headers.update(limits)
        return reply

    def _dispatch(self, call: _Call) -> _Reply:
        if call.refusal is not None:
            return call.refusal
        if call.malformed:
            return _problem(400, call.malformed)
        if call.errors:
            return _problem(422, "Request validation failed.", call.errors)
        assert call.op is not None
        if call.op in _CREATES and self.create_delay > 0:
            time.sleep(self.create_delay)  # on this request's own thread: others go on
        try:
            reply: _Reply = getattr(self, call.op)(call)
        except _Refused as refused:
            reply = refused.reply
        except Exception as exc:  # a bug of the fake: say so, loudly
            self._fake_error(f"{call.method} {call.path}: {exc!r}")
            reply = _problem(500, f"the fake failed: {exc!r}")
        if reply.stream is None and reply.body is not None and reply.status < 400:
            reply.schema = _SCHEMA_OF_ANSWER.get(call.op)
        return reply

    def _send(self, h: BaseHTTPRequestHandler, reply: _Reply) -> None:
        h.send_response(reply.status)
        for k, v in reply.headers.items():
            h.send_header(k, v)
        if reply.raw is not None:
            self._send_raw(h, reply.raw)
            return
        if reply.stream is not None:
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Connection", "keep-alive")
            h.send_header("X-Accel-Buffering", "no")
            h.end_headers()
            h.wfile.flush()
            try:
                reply.stream(h)
            finally:
                # The stream has no length: its end is the connection's (the keep-alive header
                # above would have the server wait for another request on it).
                h.close_connection = True
            return
        data = b"" if reply.body is None else json.dumps(reply.body).encode()
        if data:
            kind = "application/problem+json" if reply.status >= 400 else "application/json"
            h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()

    @staticmethod
    def _send_raw(h: BaseHTTPRequestHandler, data: bytes) -> None:
        if data:
            h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()

    def _check_answer(self, method: str, path: str, reply: _Reply) -> None:
        schema = reply.schema or ("ErrorResponse" if reply.status >= 400 else None)
        if reply.body is None or schema is None:
            return
        errors = SCHEMAS.errors(schema, reply.body)
        if errors:
            self._fake_error(f"{method} {path}: the answer is no {schema}: {errors}")
            replacement = _problem(500, f"the fake's answer broke the {schema} schema")
            reply.status, reply.body, reply.schema = (replacement.status, replacement.body,
                                                      "ErrorResponse")

    def _carry_out_late(self, call: _Call, who: str | None) -> None:
        if self._closing:  # the fake is being closed: nothing lands any more
            return
        try:
            self._answer(call, who, counted=False)
        except Exception as exc:
            self._fake_error(f"a request carried out late ({call.method} {call.path}): {exc!r}")

    def _take_fault(self, method: str, path: str
                    ) -> tuple[_Reply | None, bool, float | None]:
        """The fault's answer for this request (None: no fault), whether the request is to be
        carried out all the same, and in how many seconds if not now."""
        with self._lock:
            for fault in self._faults:
                if fault.remaining > 0 and (fault.match is None or
                                            fault.match.search(f"{method} {path}")):
                    fault.remaining -= 1
                    break
            else:
                return None, False, None
        headers = {}
        retry = fault.retry_after if fault.retry_after is not None else (
            1 if fault.status == 429 else None)
        if retry is not None:
            headers["Retry-After"] = str(int(retry))
        detail = ("rate limit exceeded for the minute window" if fault.status == 429
                  else "injected fault")
        return (_problem(fault.status, detail, headers=headers), fault.after_acting,
                fault.lands_after)

    def _take_garble(self, method: str, path: str) -> tuple[_Reply | None, float | None]:
        with self._lock:
            for garble in self._garbles:
                if garble.remaining > 0 and (garble.match is None or
                                             garble.match.search(f"{method} {path}")):
                    garble.remaining -= 1
                    return _Reply(garble.status, raw=garble.body), garble.lands_after
        return None, None

    def _whose(self, authorization: str | None) -> str | None:
        """"account", "pod:<id>" for a pod-scoped key, None for none or an unknown one."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[len("Bearer "):]
        if secrets.compare_digest(key.encode(), self.api_key.encode()):
            return "account"
        with self._cond:
            pod_id = self._pod_keys.get(key)
        return None if pod_id is None else f"pod:{pod_id}"

    def _forbidden(self, call: _Call, who: str) -> _Reply | None:
        """403 where a pod-scoped key may not go (pod_key); None where it may."""
        if who == "account" or self.pod_key == "account":
            return None
        if self.pod_key == "own":
            own = who.partition(":")[2]
            if call.op in ("_get_pod", "_pod_action") and call.params.get("id") == own:
                return None
            return _problem(403, "access denied: a pod-scoped key may only get its own pod "
                                 "and act on it")
        return _problem(403, "access denied: a pod-scoped key")

    def _query_errors(self, op: str | None, query: dict[str, str], headers: Any) -> list[str]:
        """The parameters the route takes (`query`) and Last-Event-ID, against the document."""
        errors = []
        for name in ("includeClusterPods", "globalNetwork"):  # the booleans
            if name in query and query[name] not in ("true", "false"):
                errors.append(f"$.{name}: {query[name]!r} is not of type 'boolean'")
        if op in ("_list_data_centers", "_get_data_center"):
            for name, item in _DC_LISTS.items():
                if name in query:
                    schema = {"type": "array", "items": {"$ref": _REF_PREFIX + item}}
                    errors += SCHEMAS.value_errors(name, schema, query[name].split(","))
        if op == "_pod_logs":
            if "source" in query:
                errors += SCHEMAS.parameter_errors("source", query["source"])
            if "tail" in query:
                tail = query["tail"]
                errors += SCHEMAS.parameter_errors(
                    "tail", int(tail) if re.fullmatch(r"-?\d+", tail) else tail)
            if "since" in query and parse_rfc3339(query["since"]) is None:
                errors.append(f"$.since: {query['since']!r} is not a 'date-time'")
            last = headers.get("Last-Event-ID")
            if last is not None and parse_rfc3339(last) is None:  # format: date-time
                errors.append(f"$.Last-Event-ID: {last!r} is not a 'date-time'")
        return errors

    # -- endpoints ---------------------------------------------------------------------------

    def _gpu_type(self, gpu_id: str, field: str = "gpu.id") -> dict[str, Any]:
        """The catalog entry of a GPU type id (GpuType.id: "use for pod creation"): never its
        display name or anything else."""
        for g in self.gpus:
            if g["id"] == gpu_id:
                return g
        valid = ", ".join(repr(g["id"]) for g in self.gpus)
        raise _Refused(400, f"unknown GPU type {gpu_id!r}: {field} must be a GPU type id from "
                            f"GET /v2/catalog/gpus, one of {valid}")

    def _availability(self, gpu_id: str) -> str:
        with self._lock:
            return "NONE" if gpu_id in self._no_capacity else "HIGH"

    def _gpu_json(self, g: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        out = json.loads(json.dumps(g))
        if query.get("include") == "AVAILABILITY":
            level = self._availability(g["id"])
            out["availability"] = level
            if level != "NONE":  # every data center has every GPU type
                out["dataCenters"] = [{"id": dc["id"], "name": dc["name"], "availability": level}
                                      for dc in self.data_centers]
        return out

    def _check_catalog_query(self, query: dict[str, str]) -> None:
        if ("include" in query) != ("product" in query):
            raise _Refused(400, "product is required with include=AVAILABILITY, and valid "
                                "only with it")

    def _list_gpus(self, call: _Call) -> _Reply:
        self._check_catalog_query(call.query)
        return _Reply(200, {"gpus": [self._gpu_json(g, call.query) for g in self.gpus]})

    def _get_gpu(self, call: _Call) -> _Reply:
        self._check_catalog_query(call.query)
        for g in self.gpus:
            if g["id"] == call.params["id"]:
                return _Reply(200, self._gpu_json(g, call.query))
        raise _Refused(404, "GPU type not found")

    def _dc_json(self, dc: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        out = json.loads(json.dumps(dc))
        # "Present only when requested"; CPU_AVAILABILITY adds nothing: "omitted entirely when
        # the data center offers no CPU flavors", and the fake has no CPU catalog.
        out.pop("gpuAvailability", None)
        out.pop("cpuAvailability", None)
        if "GPU_AVAILABILITY" in query.get("include", "").split(",") and self.gpus:
            out["gpuAvailability"] = [{"id": g["id"], "name": g["name"],
                                       "availability": self._availability(g["id"])}
                                      for g in self.gpus]
        return out

    @staticmethod
    def _dc_matches(dc: dict[str, Any], query: dict[str, str]) -> bool:
        """The document's filters: regions any of, networkVolumeTypes and compliance all of,
        globalNetwork equal; different ones all."""
        def listed(name: str) -> set[str]:
            return set(query[name].split(",")) if name in query else set()

        regions = listed("regions")
        return ((not regions or dc["region"] in regions)
                and listed("networkVolumeTypes") <= set(dc["networkVolumeTypes"])
                and listed("compliance") <= set(dc["compliance"])
                and ("globalNetwork" not in query
                     or dc["globalNetwork"] == (query["globalNetwork"] == "true")))

    def _list_data_centers(self, call: _Call) -> _Reply:
        return _Reply(200, {"dataCenters": [self._dc_json(dc, call.query)
                                            for dc in self.data_centers
                                            if self._dc_matches(dc, call.query)]})

    def _get_data_center(self, call: _Call) -> _Reply:
        dc = self._dcs.get(call.params["id"])
        if dc is None:
            raise _Refused(404, "data center not found")
        return _Reply(200, self._dc_json(dc, call.query))

    def _list_registries(self, call: _Call) -> _Reply:
        return _Reply(200, {"registries": [dict(r) for r in self.registries]})

    def _get_registry(self, call: _Call) -> _Reply:
        registry = self._registries.get(call.params["id"])
        if registry is None:
            raise _Refused(404, "registry credential not found")
        return _Reply(200, dict(registry))

    def _list_pods(self, call: _Call) -> _Reply:
        members = call.query.get("includeClusterPods") == "true"
        with self._cond:
            pods = [pod_json(p) for p in self._pods.values()
                    if not p.gone and (members or p.cluster is None)]
        return _Reply(200, {"pods": pods})

    def _pod(self, pod_id: str) -> _PodState:
        pod = self._pods.get(pod_id)
        if pod is None or pod.gone:
            raise _Refused(404, "pod not found")
        return pod

    def _get_pod(self, call: _Call) -> _Reply:
        with self._cond:
            return _Reply(200, pod_json(self._pod(call.params["id"])))

    def _create_pod(self, call: _Call) -> _Reply:
        b = call.body
        if "templateId" in b:
            raise _Refused(400, "templates are not supported by the fake: send image")
        if ("gpu" in b) == ("cpu" in b):
            raise _Refused(400, "supply exactly one of gpu or cpu")
        mounts = self._check_mounts(b.get("mounts") or {})
        volume = self._network_volume(mounts)
        self._check_registry(b.get("registry"))
        cloud = b.get("cloud", "SECURE")
        networked = bool(b.get("globalNetworking"))
        if "gpu" in b:
            gpu = {"id": b["gpu"]["id"], "count": b["gpu"].get("count", 1)}
            if networked:
                self._check_global_networking(self._gpu_type(gpu["id"]), cloud)
        else:
            gpu = None
            if mounts.get("persistent"):
                raise _Refused(400, "persistent mounts are not allowed on CPU pods")
            if networked:
                raise _Refused(400, "global networking requires an NVIDIA GPU")
        dc = self._place(b.get("dataCenterIds"), networked, volume)
        if gpu is not None:
            price = self._gpu_price(gpu["id"], gpu["count"], cloud,
                                    self._where(b.get("dataCenterIds")))
        else:
            price = CPU_PRICE_PER_VCPU * b["cpu"]["vcpuCount"]
        with self._cond:
            pod = self._new_pod(b["name"], b, gpu=gpu, cpu=b.get("cpu"), cloud=cloud, dc=dc,
                                price=price, global_networking=networked)
            self._launch(pod)
            return _Reply(201, pod_json(pod))

    def _check_registry(self, registry: str | None) -> None:
        if registry is not None and registry not in self._registries:
            raise _Refused(400, f"registry credential {registry!r} not found (see GET "
                                "/v2/registries)")

    @staticmethod
    def _check_global_networking(gpu: dict[str, Any], cloud: str) -> None:
        # CreatePodRequest.globalNetworking: "Requires an NVIDIA GPU"; runpodctl's
        # --global-networking: "Secure Cloud only".
        if gpu["manufacturer"] != "NVIDIA":
            raise _Refused(400, f"global networking requires an NVIDIA GPU ({gpu['id']} is "
                                f"{gpu['manufacturer']})")
        if cloud != "SECURE":
            raise _Refused(400, "global networking requires Secure Cloud")

    def _known_data_centers(self, ids: list[str]) -> list[dict[str, Any]]:
        unknown = [i for i in ids if i not in self._dcs]
        if unknown:
            valid = ", ".join(repr(dc["id"]) for dc in self.data_centers)
            raise _Refused(400, f"unknown data center {', '.join(map(repr, unknown))}: "
                                "dataCenterIds must be ids from GET /v2/catalog/datacenters, "
                                f"one of {valid}")
        return [self._dcs[i] for i in ids]

    def _place(self, ids: list[str] | None, networked: bool = False,
               volume: dict[str, Any] | None = None) -> str:
        """Where a pod or cluster goes: the first of its dataCenterIds, or the default; with
        Global Networking the first of those (or of the catalog, the default first) whose
        globalNetwork is true; with a network volume the volume's (NetworkMount.volumeId: "in
        the same data center as the pod"), which dataCenterIds must then include."""
        listed = self._known_data_centers(ids or [])
        if volume is not None:
            where = volume["dataCenter"]
            if listed and where not in [dc["id"] for dc in listed]:
                raise _Refused(400, f"network volume {volume['id']!r} is in data center "
                                    f"{where}, which dataCenterIds ({', '.join(ids or [])}) "
                                    "does not include")
            if networked and not self._dcs[where]["globalNetwork"]:
                raise _Refused(400, f"network volume {volume['id']!r} is in data center "
                                    f"{where}, which does not support global networking")
            return where
        if not networked:
            return listed[0]["id"] if listed else self.data_center
        candidates = listed or [self._dcs[self.data_center], *self.data_centers]
        for dc in candidates:
            if dc["globalNetwork"]:
                return dc["id"]
        if not listed:
            raise _Refused(400, "no data center supports global networking")
        several = len(listed) > 1
        raise _Refused(400, f"data center{'s' if several else ''} {', '.join(ids or [])} "
                            f"do{'' if several else 'es'} not support global networking (see "
                            "GET /v2/catalog/datacenters?globalNetwork=true)")

    def _check_mounts(self, mounts: dict[str, Any]) -> dict[str, Any]:
        if mounts.get("persistent") and mounts.get("network"):
            raise _Refused(400, "mounts: at most one of persistent or network may be set")
        return mounts

    def _network_volume(self, mounts: dict[str, Any]) -> dict[str, Any] | None:
        """The network volume the mounts name (None: none), which must exist."""
        network = mounts.get("network") or []
        if not network:
            return None
        volume_id = network[0]["volumeId"]  # the document allows one (maxItems 1)
        with self._cond:
            volume = self._volumes.get(volume_id)
        if volume is None:
            raise _Refused(400, f"network volume {volume_id!r} not found (see GET "
                                "/v2/network-volumes)")
        return dict(volume)

    def _where(self, dcs: list[str] | None) -> str:
        return f"data center {', '.join(dcs)}" if dcs else "any data center"

    def _gpu_price(self, gpu_id: str, count: int, cloud: str, where: str,
                   pods: int | None = None, field: str = "gpu.id") -> float:
        g = self._gpu_type(gpu_id, field)
        tier = cloud.lower()
        if not g[tier]:
            raise _Refused(400, f"{gpu_id} is not offered on {cloud} cloud")
        if count > g["maxCount"][tier]:
            raise _Refused(400, f"gpu count {count} exceeds the maximum of "
                                f"{g['maxCount'][tier]} for {gpu_id} on {cloud} cloud")
        with self._lock:
            none = gpu_id in self._no_capacity
        if none:
            what = f"{count} x {gpu_id}" if pods is None else f"{pods} pods of {count} x {gpu_id}"
            raise _Refused(400, f"no capacity for {what} in {where}")
        return float(g["price"][tier]) * count

    def _delete_pod(self, call: _Call) -> _Reply:
        with self._cond:
            pod = self._pod(call.params["id"])
            self._refuse_member(pod, "terminated")
            self._terminate_locked(pod)
        return _Reply(204)

    def _refuse_member(self, pod: _PodState, what: str) -> None:
        if pod.cluster is not None:
            raise _Refused(409, f"pod {pod.id} belongs to cluster {pod.cluster['id']} and "
                                f"cannot be {what} via the pod endpoints: use "
                                f"/v2/clusters/{pod.cluster['id']}")

    def _pod_action(self, call: _Call) -> _Reply:
        action = call.body["action"]
        with self._cond:
            pod = self._pod(call.params["id"])
            self._refuse_member(pod, "modified")
            if action not in ACTIONS[pod.status]:
                raise _Refused(409, f"action {action} is not valid for a pod that is "
                                    f"{pod.status} (valid: {', '.join(ACTIONS[pod.status])})")
            if action == "terminate":
                self._terminate_locked(pod)
                return _Reply(204)
            if action == "stop":
                # EXITED (and no longer billing) at once, while the container still has its
                # grace: a second stop is 409 as for any EXITED pod.
                pod.want = "stop"
                pod.set_status("EXITED")
            else:  # start, restart: a new container
                pod.want = "run"
                pod.generation += 1
                pod.set_status("STARTING" if pod.harness else "PROVISIONING")
            self._cond.notify_all()
            return _Reply(200, pod_json(pod))

    def _pod_logs(self, call: _Call) -> _Reply:
        source = call.query.get("source")
        with self._cond:
            pod = self._pod(call.params["id"])
            start = self._log_start(pod.logs, call, source)
        return _Reply(200, stream=lambda h: self._stream(h, pod, start, source))

    def _log_start(self, logs: list[LogLine], call: _Call, source: str | None) -> int:
        """The index of the first line to send: Last-Event-ID before since before tail."""
        stamps = [x.us for x in logs]
        last = call.headers.get("Last-Event-ID")
        if last is not None:
            cursor = parse_rfc3339_us(last)  # checked before: a date-time
            # "resumes from this point": strictly after it, or at it again (log_resume).
            find = bisect.bisect_right if self.log_resume == "after" else bisect.bisect_left
            return find(stamps, cursor)
        if "since" in call.query:
            return bisect.bisect_left(stamps, parse_rfc3339_us(call.query["since"]))
        tail = int(call.query.get("tail", "100"))
        start, seen = len(logs), 0
        while start > 0 and seen < tail:
            start -= 1
            seen += source is None or logs[start].source == source
        return start

    def _stream(self, h: BaseHTTPRequestHandler, pod: _PodState, index: int,
                source: str | None) -> None:
        with self._cond:
            pod.log_connections += 1
            epoch = self._stream_epoch
        last_write = time.monotonic()
        while True:
            if _hung_up(h.connection):
                return
            with self._cond:
                if len(pod.logs) == index and not (pod.torn_down or self._closing) and \
                        self._stream_epoch == epoch:
                    self._logs_changed.wait(0.25)
                if self._stream_epoch != epoch:
                    return  # dropped (drop_log_streams): what is pending is not sent
                batch = pod.logs[index:]
                index += len(batch)
                ended = pod.torn_down or self._closing
            data = b"".join(x.sse() for x in batch if source is None or x.source == source)
            try:
                if data:
                    h.wfile.write(data)
                    h.wfile.flush()
                    last_write = time.monotonic()
                elif time.monotonic() - last_write > _HEARTBEAT_S:
                    h.wfile.write(b": keep-alive\n\n")
                    h.wfile.flush()
                    last_write = time.monotonic()
            except OSError:  # the client went away
                return
            if ended and not batch:
                return

    def _list_clusters(self, call: _Call) -> _Reply:
        with self._cond:
            return _Reply(200, {"clusters": [cluster_json(c, str(self.net.subnet))
                                             for c in self._clusters.values() if not c.gone]})

    def _cluster(self, cluster_id: str) -> _ClusterState:
        cluster = self._clusters.get(cluster_id)
        if cluster is None or cluster.gone:
            raise _Refused(404, "cluster not found")
        return cluster

    def _get_cluster(self, call: _Call) -> _Reply:
        with self._cond:
            return _Reply(200, cluster_json(self._cluster(call.params["id"]),
                                            str(self.net.subnet)))

    def _cluster_pods(self, call: _Call) -> _Reply:
        with self._cond:
            cluster = self._cluster(call.params["id"])
            return _Reply(200, {"pods": [pod_json(p) for p in cluster.members if not p.gone]})

    def _create_cluster(self, call: _Call) -> _Reply:
        b = call.body
        if b["type"] not in ("TRAINING", "APPLICATION"):
            raise _Refused(400, f"cluster type {b['type']} is not supported by the fake")
        if "image" not in b:
            raise _Refused(400, "image is required (the fake has no templates)")
        volume = self._network_volume(self._check_mounts(b.get("mounts") or {}))
        compute = b["compute"]
        count, pods = compute["gpuCountPerPod"], compute["podCount"]
        # "always placed within a single data center"
        dc = self._place(b.get("dataCenterIds"), volume=volume)
        price = self._gpu_price(compute["gpuTypeId"], count, "SECURE",
                                self._where(b.get("dataCenterIds")), pods=pods,
                                field="compute.gpuTypeId")
        with self._cond:
            cluster = _ClusterState(random_pod_id(), b["name"], b["type"], dict(compute), dc,
                                    time.time(), [])
            for rank in range(pods):
                pod = self._new_pod(f"{b['name']}-{rank}", b,
                                    gpu={"id": compute["gpuTypeId"], "count": count}, cpu=None,
                                    cloud="SECURE", dc=dc, price=price,
                                    global_networking=False)
                pod.cluster = {"id": cluster.id, "rank": rank}
                cluster.members.append(pod)
            self._clusters[cluster.id] = cluster
            for pod in cluster.members:
                self._launch(pod)
            return _Reply(201, cluster_json(cluster, str(self.net.subnet)))

    def _delete_cluster(self, call: _Call) -> _Reply:
        with self._cond:
            cluster = self._cluster(call.params["id"])
            cluster.gone = True
            for pod in cluster.members:
                self._terminate_locked(pod)
        return _Reply(204)

    def _volume_type(self, dc_id: str, kind: str | None) -> str:
        """The storage tier of a new volume in data center `dc_id`: `kind`, or without it the
        data center's first (CreateNetworkVolumeRequest.type: "the requested data center's
        default (primary) storage tier"); 400 where the data center offers no such volumes."""
        dc = self._dcs.get(dc_id)
        if dc is None:
            valid = ", ".join(repr(d["id"]) for d in self.data_centers)
            raise _Refused(400, f"unknown data center {dc_id!r}: dataCenter must be an id from "
                                f"GET /v2/catalog/datacenters, one of {valid}")
        kinds = dc["networkVolumeTypes"]
        if not kinds:  # DataCenter.networkVolumeTypes: "Empty = none"
            raise _Refused(400, f"data center {dc_id} offers no network volumes (its "
                                "networkVolumeTypes is empty)")
        if kind is not None and kind not in kinds:
            raise _Refused(400, f"data center {dc_id} offers no {kind} network volumes (its "
                                f"networkVolumeTypes: {', '.join(kinds)})")
        return kind or kinds[0]

    def _list_network_volumes(self, call: _Call) -> _Reply:
        return _Reply(200, {"networkVolumes": self.volumes})

    def _volume(self, volume_id: str) -> dict[str, Any]:
        volume = self._volumes.get(volume_id)
        if volume is None:
            raise _Refused(404, "network volume not found")
        return volume

    def _get_network_volume(self, call: _Call) -> _Reply:
        with self._cond:
            return _Reply(200, dict(self._volume(call.params["id"])))

    def _create_network_volume(self, call: _Call) -> _Reply:
        b = call.body
        kind = self._volume_type(b["dataCenter"], b.get("type"))
        with self._cond:
            volume_id = random_pod_id()
            while volume_id in self._volumes:
                volume_id = random_pod_id()
            volume = {"id": volume_id, "name": b["name"], "size": b["size"],
                      "dataCenter": b["dataCenter"], "type": kind}
            self._volumes[volume_id] = volume
            return _Reply(201, dict(volume))

    def _delete_network_volume(self, call: _Call) -> _Reply:
        with self._cond:
            del self._volumes[self._volume(call.params["id"])["id"]]
        return _Reply(204)

    # -- pods ------------------------------------------------------------------------------------

    def _new_pod(self, name: str, b: dict[str, Any], *, gpu: dict[str, Any] | None,
                 cpu: dict[str, Any] | None, cloud: str, dc: str, price: float,
                 global_networking: bool) -> _PodState:
        pod_id = random_pod_id()
        while pod_id in self._pods:
            pod_id = random_pod_id()
        pod = _PodState(
            id=pod_id, name=name, created=time.time(), image=b["image"],
            args=b.get("args", ""), env=dict(b.get("env") or {}), ports=list(b.get("ports", [])),
            disk=b.get("disk", DEFAULT_DISK_GB), mounts=json.loads(json.dumps(b.get("mounts")
                                                                               or {})),
            gpu=gpu, cpu=dict(cpu) if cpu else None, cloud=cloud, dc=dc, price=price,
            global_networking=global_networking, start_jupyter=bool(b.get("startJupyter")),
            registry=b.get("registry"),  # clusters have none (CreateClusterRequest)
            api_key="rpa_pod_" + secrets.token_hex(16),
            hostname=f"{pod_id}-{secrets.token_hex(4)}",
            ray_tmp=f"/tmp/prc-{uuid.uuid4().hex[:8]}")
        home = self.root / "pods" / pod_id
        pod.home = home / "cwd"
        pod.home.mkdir(parents=True)
        if "persistent" in pod.mounts:
            pod.volume, pod.mount_path = home / "volume", pod.mounts["persistent"]["path"]
        elif pod.mounts.get("network"):
            net_mount = pod.mounts["network"][0]
            pod.volume = self.root / "network-volumes" / net_mount["volumeId"]
            pod.mount_path = net_mount["path"]
        if pod.volume is not None:
            pod.volume.mkdir(parents=True, exist_ok=True)
        self._pods[pod_id] = pod
        self._pod_keys[pod.api_key] = pod_id
        return pod

    def _launch(self, pod: _PodState) -> None:
        pod.thread = threading.Thread(target=self._supervise, args=(pod,),
                                      name=f"pod-{pod.id}", daemon=True)
        pod.thread.start()

    def _terminate_locked(self, pod: _PodState) -> None:
        if pod.want == "terminate":
            return
        pod.want, pod.gone = "terminate", True
        pod.set_status("TERMINATED")
        self._cond.notify_all()

    def _log(self, pod: _PodState, source: str, line: str) -> None:
        with self._cond:
            us = time.time_ns() // 1000
            us -= us % self._log_res_us  # lines this close together share a ts, so an id
            if pod.logs:  # the stream is ordered by ts: never before the last line's
                us = max(us, pod.logs[-1].us)
            pod.logs.append(LogLine(len(pod.logs) + 1, us / 1_000_000, source, line))
            self._logs_changed.notify_all()

    def _fake_error(self, text: str) -> None:
        with self._lock:
            self._errors.append(text)

    def _supervise(self, pod: _PodState) -> None:
        """The pod's runtime: the only thread that starts and stops its processes; the API only
        says what it wants (want, generation) and this follows."""
        done = -1  # the generation whose container was started last
        try:
            while True:
                with self._cond:
                    while True:
                        want, gen = pod.want, pod.generation
                        exited = pod.proc is not None and pod.proc.poll() is not None
                        stopping = want == "stop" and pod.proc is not None
                        if want == "terminate" or exited or stopping or \
                                (want == "run" and gen != done):
                            break
                        self._cond.wait(0.05)
                if want == "terminate":
                    self._stop_container(pod, "terminate")
                    return
                if want == "stop":
                    self._stop_container(pod, "stop")
                    continue
                if gen != done:
                    done = gen
                    if pod.proc is not None:
                        self._stop_container(pod, "restart")
                    with self._cond:
                        pod.auto_restarts = 0
                    if self._provision(pod, gen) and self._pull(pod, gen):
                        self._start_container(pod, gen)
                    continue
                self._finish_container(pod, None)
                with self._cond:
                    current = pod.want == "run" and pod.generation == gen
                    again = current and pod.auto_restarts < self.max_restarts
                    if again:
                        pod.auto_restarts += 1
                    elif current:
                        pod.set_status("ERROR")
                if again:
                    self._start_container(pod, gen)
                elif current:
                    self._log(pod, "system", f"container exited {self.max_restarts + 1} times "
                                             "in a row: not started again")
        except Exception as exc:
            self._fake_error(f"pod {pod.id}: {exc!r}")
            with self._cond:
                if pod.status != "TERMINATED":
                    pod.set_status("ERROR")
            with contextlib.suppress(Exception):
                self._stop_container(pod, "terminate")
        finally:
            with self._cond:
                terminate = pod.want == "terminate"
            if terminate:
                self._teardown(pod)

    def _provision(self, pod: _PodState, gen: int) -> bool:
        """A machine for the pod: its network namespace, after the delay and any hold."""
        if pod.harness is not None:
            return True
        deadline = time.monotonic() + self.provision_delay
        with self._cond:
            while True:
                if pod.want != "run" or pod.generation != gen:
                    return False
                held = any(h.search(pod.name) for h in self._holds)
                if not held and time.monotonic() >= deadline:
                    break
                self._cond.wait(0.05)
            self._harness_names += 1
            short = f"rp{self._harness_names}"
        ifname = "ens1" if pod.cluster else ("podnet1" if pod.global_networking else "eth0")
        with self._net_lock:
            harness = self.net.add_pod(short, ifname=ifname, pod_id=pod.id)
        if pod.global_networking:
            self.dns.set_record(harness.dns_name, harness.ip)
        with self._cond:
            pod.harness, pod.ip = harness, harness.ip
            if pod.cluster is not None:
                pod.cluster["ip"] = harness.ip
            if pod.status == "PROVISIONING":
                pod.set_status("STARTING")
            self._cond.notify_all()
        self._log(pod, "system", f"pod placed in {pod.dc}")
        return True

    def _pull(self, pod: _PodState, gen: int) -> bool:
        if pod.pulled:
            return True
        self._log(pod, "system", f"pulling image {pod.image}")
        why = self._pull_error(pod)
        if why is not None:
            self._log(pod, "system", f"failed to pull image {pod.image}: {why}")
            with self._cond:
                if pod.want == "run" and pod.generation == gen:
                    pod.set_status("ERROR")
            return False
        pod.pulled = True
        self._log(pod, "system", f"image {pod.image} pulled")
        return True

    def _pull_error(self, pod: _PodState) -> str | None:
        """Why the pod's image cannot be pulled (as a registry says it), None if it can."""
        if pod.image not in self.images:
            return "manifest unknown"
        needed = self.private_images.get(pod.image)
        if needed is not None and pod.registry != needed:
            return "unauthorized: authentication required"
        return None

    def _primary_ip(self, pod: _PodState, gen: int) -> str | None:
        """Rank 0's address (members start only once it has one); None if no longer wanted."""
        assert pod.cluster is not None
        cluster = self._clusters.get(pod.cluster["id"])
        with self._cond:
            while True:
                if pod.want != "run" or pod.generation != gen:
                    return None
                primary = cluster.members[0] if cluster else pod
                if primary.ip:
                    return primary.ip
                self._cond.wait(0.05)

    def _container_env(self, pod: _PodState, primary_ip: str | None) -> dict[str, str]:
        assert pod.harness is not None
        env = clean_environ()
        env.update({
            "RUNPOD_POD_ID": pod.id,
            "RUNPOD_POD_HOSTNAME": pod.hostname,
            "RUNPOD_DC_ID": pod.dc,
            "RUNPOD_GPU_COUNT": str(pod.gpu_count),
            "RUNPOD_CPU_COUNT": str(pod.vcpus),
            "RUNPOD_API_KEY": pod.api_key,  # pod-scoped: never the account's key
        })
        if pod.mounts.get("network"):
            env["RUNPOD_VOLUME_ID"] = pod.mounts["network"][0]["volumeId"]
        if pod.start_jupyter:
            env["JUPYTER_PASSWORD"] = secrets.token_hex(8)
        if pod.cluster is not None and primary_ip is not None:
            cluster = self._clusters[pod.cluster["id"]]
            nodes, per_node = len(cluster.members), pod.gpu_count
            env.update({
                "PRIMARY_ADDR": primary_ip, "MASTER_ADDR": primary_ip,
                "PRIMARY_PORT": PRIMARY_PORT, "MASTER_PORT": PRIMARY_PORT,
                "HOST_NODE_ADDR": f"{primary_ip}:{PRIMARY_PORT}",
                "NODE_ADDR": pod.harness.ip, "NODE_RANK": str(pod.cluster["rank"]),
                "NUM_NODES": str(nodes), "NUM_TRAINERS": str(per_node),
                "WORLD_SIZE": str(nodes * per_node),
            })
        # What a test pod needs on this machine (not RunPod's).
        env.update({
            "PODAGENT_DNS_SERVER": f"{self.dns.address}:{self.dns.port}",
            "PODAGENT_RAY_TEMP_DIR": pod.ray_tmp,  # short: Ray's unix sockets (108 bytes)
            # No GPU exists to check (a test asks for a check with its own PODAGENT_GPU_CHECK
            # and a stand-in nvidia-smi on its PATH).
            "PODAGENT_GPU_CHECK": "off",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        })
        if pod.volume is not None and pod.mount_path == "/workspace":
            # podagent's defaults when /workspace exists, which here it cannot.
            env["PODAGENT_LOG_DIR"] = str(pod.volume / "podagent" / "logs")
            env["PODAGENT_CHECKPOINT_DIR"] = str(pod.volume / "checkpoints")
        env.update({k: self._on_volume(pod, self._secret(v)) for k, v in pod.env.items()})
        return env

    def _secret(self, value: str) -> str:
        """A RunPod secret reference, as the container sees it: the secret's value."""
        found = _SECRET_REF.fullmatch(value.strip())
        if found and found.group(1) in self.secrets:
            return self.secrets[found.group(1)]
        return value

    @staticmethod
    def _on_volume(pod: _PodState, value: str) -> str:
        """A path under the mount path, as the volume's directory here (no mount namespace)."""
        mount = (pod.mount_path or "").rstrip("/")
        if pod.volume is None or not mount:
            return value
        if value == mount or value.startswith(mount + "/"):
            return str(pod.volume) + value[len(mount):]
        return value

    def _start_container(self, pod: _PodState, gen: int) -> None:
        assert pod.harness is not None
        primary_ip = self._primary_ip(pod, gen) if pod.cluster is not None else None
        if pod.cluster is not None and primary_ip is None:
            return
        env = self._container_env(pod, primary_ip)
        argv = [*self.images[pod.image], *shlex.split(pod.args)]
        with self._cond:
            if pod.want != "run" or pod.generation != gen:
                return
            pod.starts += 1
            pod.set_status("STARTING")
            pod.process_env = env
            n = pod.starts
        assert pod.home is not None
        out_path = pod.home.parent / f"container.{n}.out"
        try:
            proc = pod.harness.popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, cwd=str(pod.home))
        except OSError as exc:  # as a runtime whose entrypoint cannot be executed
            out_path.write_text(f"{exc}\n")
            self._log(pod, "system", f"failed to start container: {exc}")
            with self._cond:
                pod.exits.append(Exit(n, 127, time.time(), out_path, None))
                if pod.want == "run" and pod.generation == gen:
                    pod.set_status("ERROR")
            return
        pump = threading.Thread(target=self._pump, args=(pod, proc, out_path),
                                name=f"pod-{pod.id}-out{n}", daemon=True)
        with self._cond:
            pod.proc, pod.pump, pod.out_path = proc, pump, out_path
            if pod.want == "run" and pod.generation == gen:
                pod.set_status("RUNNING")
                pod.started_at = time.time()
            self._cond.notify_all()
        # Said before the container's first line is read, as RunPod's log shows it (a loaded
        # machine once logged the container's "hello" first).
        self._log(pod, "system", "container started")
        pump.start()

    def _pump(self, pod: _PodState, proc: subprocess.Popen[bytes], out_path: Path) -> None:
        """The container's output: to its file and to the pod's log, line by line."""
        assert proc.stdout is not None
        with open(out_path, "wb") as out:
            for raw in iter(proc.stdout.readline, b""):
                out.write(raw)
                out.flush()
                self._log(pod, "container", raw.decode(errors="replace").rstrip("\r\n"))
        proc.stdout.close()

    def _stop_container(self, pod: _PodState, why: str) -> None:
        """SIGTERM to the main process (as `docker stop` to PID 1), the grace, then SIGKILL to
        everything in the pod."""
        proc = pod.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self._finish_container(pod, why)

    def _finish_container(self, pod: _PodState, why: str | None) -> None:
        """Its main process ended (or is to end now): kill what is left, as a runtime does when
        PID 1 exits, and record the exit."""
        proc, pump = pod.proc, pod.pump
        assert proc is not None and pod.harness is not None and pod.out_path is not None
        _kill_netns_processes(pod.harness.netns, 10.0)
        rc = proc.wait(timeout=10)
        if pump is not None and pump.ident is not None:  # started (it is, but for a moment)
            pump.join(timeout=10)
        code = rc if rc >= 0 else 128 - rc
        with self._cond:
            pod.exits.append(Exit(pod.starts, code, time.time(), pod.out_path, why))
            pod.proc = pod.pump = None
            self._cond.notify_all()
        self._log(pod, "system", f"container exited with code {code}"
                                 + (f" ({why})" if why else ""))

    def _teardown(self, pod: _PodState) -> None:
        harness = pod.harness
        try:
            if harness is not None:
                if pod.global_networking:
                    self.dns.remove_record(harness.dns_name)
                with self._net_lock:
                    self.net.remove_pod(harness)
        except Exception as exc:
            self._fake_error(f"pod {pod.id}: teardown: {exc!r}")
        shutil.rmtree(pod.ray_tmp, ignore_errors=True)
        self._log(pod, "system", "pod terminated")
        with self._cond:
            pod.harness = None
            pod.torn_down = True
            self._cond.notify_all()
            self._logs_changed.notify_all()


def _hung_up(sock: socket.socket) -> bool:
    """Whether the client closed its end (it sends nothing more on a stream)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True

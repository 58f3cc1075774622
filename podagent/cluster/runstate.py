"""What the head, its workers and the asking commands say to each other, through Ray's own
key-value store (namespace `podagent` in the head's GCS): no extra port, no extra service.

* `run_state`: the head's announcement that it is closing the run (JSON: state, outcome, the
  job's status, and what the workers do next: `after_run` = stay, exit or stop-pod when the
  run is over, `rejoin` when only this start of it is and the head will be back). Workers read
  it once a second.
* `stop_request`: `podagent stop` asks the head to end the run in order (JSON: by, at).
* `dump`: after a hang the head asks every worker for its stacks (JSON: n, the hang's number);
  each worker answers under `dumped/<n>/<its node address>` (run/stacks.PodDump's JSON).
* `head_start`: which start of the head's Ray this is (a random id the head writes once its
  GCS answers). A head pod restarted at its old address answers again at once, but with a new
  Ray that knows nothing of the workers that had joined: they notice the id changed (or gone)
  and join again.

Beside the store, one line of the job's log: the cluster check's result (`CHECK_JSON_PREFIX`).
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from podagent.choices import AfterRun

if TYPE_CHECKING:  # the cluster check's ranks import this module: no grpc for them
    from podagent.ray_access.gcs import GcsClient

KV_NAMESPACE = "podagent"
KV_RUN_STATE = "run_state"
KV_STOP_REQUEST = "stop_request"
KV_HEAD_START = "head_start"
KV_DUMP = "dump"

# The cluster check job's one machine-readable line, which the head reads from the job's log.
CHECK_JSON_PREFIX = "podagent-check-json: "
# The labels of each Ray node podagent starts (Ray 2.49 on): a job selects by them, `podagent
# status` names each node's pod by them.
LABEL_POD = "podagent.io/pod"
LABEL_ROLE = "podagent.io/role"


REJOIN = "rejoin"


def closing(outcome: str, job_status: str | None, after_run: str = AfterRun.EXIT.value) -> bytes:
    """The head's announcement, as stored."""
    return json.dumps({"state": "closing", "outcome": outcome, "job_status": job_status,
                       "after_run": after_run}).encode()


def read_state(raw: bytes | None) -> dict[str, Any]:
    """The run's state as announced; a run nobody has announced anything of is running."""
    if not raw:
        return {"state": "running"}
    try:
        state = json.loads(raw)
    except ValueError:
        return {"state": "unreadable"}
    return state if isinstance(state, dict) else {"state": "unreadable"}


def dump_request(n: int, line: str = "") -> bytes:
    """The request for hang n's stacks; once they are in, with the head's verdict (`line`,
    which `podagent status` shows)."""
    return json.dumps({"n": n, "line": line} if line else {"n": n}).encode()


def parse_dump_request(raw: bytes | None) -> int | None:
    """The hang's number a dump request asks for (None: none, or not the expected JSON)."""
    if not raw:
        return None
    try:
        n = json.loads(raw).get("n")
    except (ValueError, AttributeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def dumped_key(n: int, node_ip: str) -> str:
    return f"dumped/{n}/{node_ip}"


def head_start() -> bytes:
    """A new id for this start of the head's Ray, as stored."""
    return secrets.token_hex(8).encode()


def stop_request(by: str, at: float) -> bytes:
    return json.dumps({"by": by, "at": at}).encode()


def parse_stop_request(raw: bytes) -> tuple[str, float | None]:
    """(who asked, when); a request that is not the expected JSON still stops the run."""
    try:
        request = json.loads(raw)
    except ValueError:
        return "an unnamed pod", None
    if not isinstance(request, dict):
        return "an unnamed pod", None
    by = str(request.get("by") or "an unnamed pod")[:100]
    at = request.get("at")
    # Epoch seconds up to the year 5000; anything else is not a time (and would not format).
    valid = isinstance(at, (int, float)) and not isinstance(at, bool) and 0 < at < 95e9
    return by, float(at) if valid else None


def head_closing(client: GcsClient) -> bool:
    """Whether the head whose GCS this client asks is closing this start of its run (its
    announcement is up): a worker joining it now would end with its Ray in a moment."""
    from podagent.platform.discovery import GCS_PROBE_TIMEOUT

    return bool(client.kv_get(KV_NAMESPACE, KV_RUN_STATE, timeout=GCS_PROBE_TIMEOUT))

"""A run's local record (one JSON file per run): what `podagent up` asked RunPod to create,
written before each create call goes out and again when its id comes back, so that `podagent
down RUN` finds every pod even after this machine crashed mid-create (a pod created but not
yet recorded is found by its name, which the record holds before the call).

Each write replaces the whole file atomically (a temporary file, fsync, rename): a crash
leaves the old record or the new one, never half of one. No secret is ever in it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from podagent.errors import InputError
from podagent.launch.options import UP_OPTION

# A run's life as the record tells it (DETACHED: `up --detach` left it running on its own;
# LEFT_BILLING: `up` could not terminate its pods, which may still bill: `podagent down RUN`).
CREATING, RUNNING, DETACHED, FINISHED, DOWN = ("creating", "running", "detached", "finished",
                                               "down")
LEFT_BILLING = "clean-up failed"
SET_ASIDE = ".unreadable"  # an unreadable record is renamed RUN.json.unreadable[.N], kept
# A record from before `lands_by` was kept: its creates had `--api-timeout`'s default.
DEFAULT_LANDING = float(UP_OPTION["api_timeout"].default)
_SAVING = threading.RLock()
MAX_SENT = 1000  # creates of one name a record may hold: more is not a record podagent wrote


class Unreadable(InputError):
    """A run's record that cannot be read, or is not one podagent wrote. It is only a hint:
    the run's pods are found at RunPod by their names and label all the same."""

    def __init__(self, run: str, path: Path, why: str):
        self.run, self.path, self.why = run, path, why
        super().__init__(f"the record of run {run} ({path}) cannot be read ({why})")


@dataclass
class Resource:
    """One pod or cluster asked for: its name before the call, its id once RunPod gave it."""

    kind: str  # "pod", "cluster" or "volume" (a network volume, kept after the run)
    name: str
    rank: int | None = None  # 0 = the head; None for a cluster
    id: str | None = None
    asked_at: float = 0.0
    # Unanswered, the create may still make its pod until then (wall time): the call's own
    # deadline, retries included. 0: a record from before it was kept (DEFAULT_LANDING then).
    lands_by: float = 0.0
    # Creates sent for it that may each make a pod: one more each time the call sends its
    # create again after one whose answer never came, when RunPod listed no pod of the name
    # meanwhile (both may land: RunPod may list a pod some time after making it); one less
    # when RunPod refused one (it made nothing).
    sent: int = 1
    # When its latest create went out (0: when it was asked): each may land within the call's
    # deadline from then, given once more. Asked again, an earlier create's window is kept.
    window_from: float = 0.0

    def unseen(self, seen: Collection[str] = ()) -> int:
        """How many pods its creates may still make: those sent, less the pods of its name
        known to exist (`seen`: ids RunPod listed live under its name; its own id)."""
        known = set(seen) | ({self.id} if self.id else set())
        return max(0, self.sent - len(known))

    def landing_ends(self) -> float:
        """Until when (wall time) its creates may make a pod: RunPod may carry a create out
        after the client stopped waiting, so the call's deadline is given once more after
        it."""
        return max(self.asked_at, self.window_from) + 2 * self.deadline()

    def deadline(self) -> float:
        """The create call's own deadline, retries included."""
        return (self.lands_by - self.asked_at) if self.lands_by else DEFAULT_LANDING


@dataclass
class RunRecord:
    """What `up` asked RunPod to create for one run and what came of it, as saved."""

    run: str
    api_url: str
    shape: str = ""
    status: str = CREATING
    created_at: float = field(default_factory=time.time)
    resources: list[Resource] = field(default_factory=list)
    outcome: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None  # UpSpec.to_record(): `up --name RUN` re-attaches
    cost: dict[str, Any] | None = None  # pod-hours and dollars so far (RunPod's rates)
    # Lost pods replaced (up.Up._replace), each {name, lost (its id), why, at}: counted
    # against the spec's replacements, also when `up` is run again on the run.
    replacements: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None

    # --- what was asked -------------------------------------------------------------------

    def asking(self, kind: str, name: str, rank: int | None, call_deadline: float) -> Resource:
        """Record the intent (and save it) before the create call goes out; `call_deadline`:
        the longest the call may take, its retries included."""
        now = time.time()
        for resource in self.resources:
            if resource.kind == kind and resource.name == name:
                # Asked again (refused before, or its pod gone): a new create, which may land
                # as the first did; an id it had is of a pod that is no longer there. Earlier
                # creates of it that may still land are still counted, within the new window.
                ends = resource.landing_ends()
                earlier = resource.unseen() if now < ends else 0
                resource.id, resource.asked_at, resource.sent = None, now, earlier + 1
                resource.lands_by = now + call_deadline
                resource.window_from = ends - 2 * call_deadline if earlier else 0.0
                self.save()
                return resource
        resource = Resource(kind, name, rank, None, now, now + call_deadline)
        self.resources.append(resource)
        self.save()
        return resource

    def got(self, resource: Resource, resource_id: str) -> None:
        resource.id = resource_id
        self.save()

    def refused(self, resource: Resource) -> None:
        """RunPod answered the create with a refusal: that create made nothing (an id of "");
        one sent before it whose answer never came still may."""
        resource.id = ""
        resource.sent = max(0, resource.sent - 1)
        self.save()

    def resent(self, resource: Resource) -> None:
        """The call sends its create again after one whose answer never came, and RunPod
        lists no pod of the name: the first may still land beside the second, and the second
        (sent now, perhaps past the call's deadline after a slow look) within a deadline from
        now."""
        resource.sent += 1
        resource.window_from = max(resource.window_from, time.time())
        self.save()

    def unlanded(self, landed: Mapping[str, Collection[str]] | None = None) -> set[str]:
        """The names whose creates may still make a pod nobody knows of: more were sent than
        pods of the name are known (`landed`: name -> ids RunPod listed live)."""
        landed = landed or {}
        # (A network volume is kept after the run, and never listed among its pods.)
        return {r.name for r in self.resources
                if r.kind != "volume" and r.unseen(landed.get(r.name, ()))}

    def landing_left(self, now: float, landed: Mapping[str, Collection[str]] | None = None
                     ) -> float:
        """Seconds until a create whose answer never came can no longer make its pod (0: none
        can). RunPod may carry a create out after the client stopped waiting: as `up`'s own
        clean-up does, its call's deadline is given once more after the call's end. `landed`:
        name -> ids of the pods RunPod lists live; a create makes one pod, so a name with as
        many pods known as creates sent can make no other."""
        unlanded = self.unlanded(landed)
        ends = [r.landing_ends() for r in self.resources if r.name in unlanded]
        return max([0.0, *(end - now for end in ends)])

    def ids(self, kind: str) -> list[str]:
        return [r.id for r in self.resources if r.kind == kind and r.id]

    def names(self) -> set[str]:
        return {r.name for r in self.resources}

    def replaced(self, name: str, lost: str, why: str) -> None:
        """A lost pod replaced: counted, with why (saved once its replacement's create was
        answered)."""
        self.replacements.append({"name": name, "lost": lost, "why": why, "at": time.time()})
        self.save()

    def mark(self, status: str, **outcome: Any) -> None:
        self.status = status
        if outcome:
            self.outcome = outcome
        self.save()

    def try_mark(self, status: str, **outcome: Any) -> bool:
        """mark(), where a record that cannot be written (a full disk) must not stop what is
        under way (terminating pods, say): False then."""
        try:
            self.mark(status, **outcome)
        except OSError:
            return False
        return True

    def try_save(self) -> bool:
        try:
            self.save()
        except OSError:
            return False
        return True

    # --- the file -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("path")
        return data

    def save(self) -> None:
        # One at a time: creates answer on threads of their own, and a write of what was
        # seen before another thread's change must not replace the file after it.
        with _SAVING:
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # the rename itself survives a crash
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def path_of(state_dir: Path, run: str) -> Path:
    return state_dir / f"{run}.json"


def load(state_dir: Path, run: str) -> RunRecord | None:
    """The run's record; None when there is none; Unreadable when it cannot be read (a
    truncated file, garbage, a missing key, a field of the wrong type)."""
    path = path_of(state_dir, run)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Unreadable(run, path, f"{type(exc).__name__}: {exc}") from None
    try:
        if not isinstance(data, dict) or not isinstance(data.get("resources", []), list):
            raise TypeError("not a JSON object with a list of resources")
        resources = [Resource(**{k: v for k, v in r.items()
                                 if k in Resource.__dataclass_fields__ and k != "kind"},
                              kind=str(r["kind"]))
                     for r in data.pop("resources", [])]
        known = {k: v for k, v in data.items()
                 if k in RunRecord.__dataclass_fields__ and k not in ("path", "resources")}
        record = RunRecord(**known, resources=resources, path=path)
    except (TypeError, KeyError, AttributeError) as exc:
        raise Unreadable(run, path, f"not one podagent wrote: {type(exc).__name__}: {exc}"
                         ) from None
    wrong = _wrong_field(record)
    if wrong or record.run != run:
        raise Unreadable(run, path, f"not one podagent wrote: "
                                    f"{wrong or f'it is the record of run {record.run!r}'}")
    return record


def _wrong_field(record: RunRecord) -> str:
    """The first field whose value is not of the type podagent writes ('' if none)."""
    optional_dicts = ("outcome", "spec", "cost")
    for name in ("run", "api_url", "shape", "status"):
        if not isinstance(getattr(record, name), str):
            return f"its {name} is not a string"
    if not isinstance(record.created_at, (int, float)) or isinstance(record.created_at, bool):
        return "its created_at is not a number"
    for name in optional_dicts:
        if not isinstance(getattr(record, name), (dict, type(None))):
            return f"its {name} is not an object"
    if not isinstance(record.replacements, list) or not all(
            isinstance(r, dict) for r in record.replacements):
        return "its replacements are not a list of objects"
    for resource in record.resources:
        if (resource.kind not in ("pod", "cluster", "volume") or not isinstance(resource.name, str)
                or not isinstance(resource.id, (str, type(None)))
                or not isinstance(resource.rank, (int, type(None)))
                or not isinstance(resource.asked_at, (int, float))
                or not isinstance(resource.lands_by, (int, float))
                or not math.isfinite(resource.lands_by)
                or not isinstance(resource.window_from, (int, float))
                or not math.isfinite(resource.window_from)
                or type(resource.sent) is not int or not 0 <= resource.sent <= MAX_SENT):
            return f"a resource is not one podagent writes ({resource})"
    return ""


def set_aside(error: Unreadable) -> Path | None:
    """Keep an unreadable record under another name (RUN.json.unreadable, .1, ...), so that
    a new record of the run can be written; None when it cannot be moved (then it stays)."""
    for n in range(1000):
        target = error.path.with_name(error.path.name + SET_ASIDE + (f".{n}" if n else ""))
        if target.exists():
            continue
        try:
            os.rename(error.path, target)
        except OSError:
            return None
        return target
    return None


def load_hint(state_dir: Path, run: str, say: Callable[[str], None]) -> RunRecord | None:
    """The run's record for a command that needs it only as a hint (`down`, `up`'s check,
    re-attaching): one that cannot be read is said in one line and set aside (kept, never
    deleted), and the command goes on as without a record, finding the run's pods at RunPod
    by name and label."""
    try:
        return load(state_dir, run)
    except Unreadable as exc:
        kept = set_aside(exc)
        where = f"set aside as {kept}" if kept else "left as it is"
        say(f"{exc}: {where}; looking for the run's pods at RunPod by their names and label")
        return None


def new(state_dir: Path, run: str, api_url: str, shape: str,
        spec: dict[str, Any] | None = None) -> RunRecord:
    record = RunRecord(run=run, api_url=api_url, shape=shape, spec=spec,
                       path=path_of(state_dir, run))
    record.save()
    return record


def all_records(state_dir: Path, say: Callable[[str], None] = lambda line: None
                ) -> list[RunRecord]:
    """Every readable record; one that cannot be read is said in one line and left as it
    is (a look changes nothing), and the others are read on."""
    found = []
    for path in sorted(state_dir.glob("*.json")) if state_dir.is_dir() else []:
        try:
            record = load(state_dir, path.stem)
        except Unreadable as exc:
            say(f"{exc}: left as it is; its pods are listed by their label")
            continue
        if record is not None:
            found.append(record)
    return found

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
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from podagent.errors import ConfigError, InputError

# A run's life as the record tells it (DETACHED: `up --detach` left it running on its own).
CREATING, RUNNING, DETACHED, FINISHED, DOWN = ("creating", "running", "detached", "finished",
                                               "down")


@dataclass
class Resource:
    """One pod or cluster asked for: its name before the call, its id once RunPod gave it."""

    kind: str  # "pod" or "cluster"
    name: str
    rank: int | None = None  # 0 = the head; None for a cluster
    id: str | None = None
    asked_at: float = 0.0


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
    path: Path | None = None

    # --- what was asked -------------------------------------------------------------------

    def asking(self, kind: str, name: str, rank: int | None) -> Resource:
        """Record the intent (and save it) before the create call goes out."""
        for resource in self.resources:
            if resource.name == name:
                return resource
        resource = Resource(kind, name, rank, None, time.time())
        self.resources.append(resource)
        self.save()
        return resource

    def got(self, resource: Resource, resource_id: str) -> None:
        resource.id = resource_id
        self.save()

    def ids(self, kind: str) -> list[str]:
        return [r.id for r in self.resources if r.kind == kind and r.id]

    def names(self) -> set[str]:
        return {r.name for r in self.resources}

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
    path = path_of(state_dir, run)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"the record of run {run} ({path}) cannot be read ({exc}): "
                          f"`podagent down {run}` still finds its pods by name") from None
    try:
        resources = [Resource(**{k: v for k, v in r.items()
                                 if k in Resource.__dataclass_fields__ and k != "kind"},
                              kind=str(r["kind"]))
                     for r in data.pop("resources", [])]
        known = {k: v for k, v in data.items()
                 if k in RunRecord.__dataclass_fields__ and k not in ("path", "resources")}
        record = RunRecord(**known, resources=resources, path=path)
    except (TypeError, KeyError, AttributeError) as exc:
        raise InputError(f"the record of run {run} ({path}) is not one podagent wrote "
                         f"({type(exc).__name__}: {exc}): `podagent down {run}` still finds "
                         f"its pods by name") from None
    if not isinstance(record.run, str) or not isinstance(record.status, str):
        raise InputError(f"the record of run {run} ({path}) is not one podagent wrote")
    return record


def new(state_dir: Path, run: str, api_url: str, shape: str,
        spec: dict[str, Any] | None = None) -> RunRecord:
    record = RunRecord(run=run, api_url=api_url, shape=shape, spec=spec,
                       path=path_of(state_dir, run))
    record.save()
    return record


def all_records(state_dir: Path) -> list[RunRecord]:
    found = []
    for path in sorted(state_dir.glob("*.json")) if state_dir.is_dir() else []:
        with contextlib.suppress(ConfigError):
            record = load(state_dir, path.stem)
            if record is not None:
                found.append(record)
    return found

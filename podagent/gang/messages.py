"""What may come in on the supervisor port, typed and checked in one place.

Every line the head reads is a stranger's until its token is checked: `first` turns the first
line of a connection into a Hello or an Ask, `from_worker` a joined worker's later lines into
a Beat, a StepDone, a Dumped or a Leaving. Anything else (not JSON, not an object, a field of
the wrong type or out of range) raises Malformed, which the hub takes as that connection's
fault: it is dropped, never the run.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_RANK = 4096  # a machine rank a worker may ask for; runs have far fewer pods
MAX_OFFSET = 1 << 53  # a log offset (a file's size is far below)
TEXT_LIMIT = 200  # a name, a step or a reason: longer is cut
ASKS = ("status", "logs", "stop")


class Malformed(ValueError):
    """A line that is not what podagent sends: the fault of the connection that sent it."""


class TooLong(Malformed):
    def __init__(self, limit: int):
        super().__init__(f"a line longer than {limit} bytes")


def decode(raw: bytes) -> dict[str, Any]:
    """One line: a JSON object, else Malformed (deep nesting and huge numbers included)."""
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise Malformed(f"a JSON {type(message).__name__}, not an object")
    return message


def authorized(token: str | None, message: Mapping[str, Any]) -> bool:
    """The line carries the cluster token (any line does when the run has none). Compared as
    bytes in constant time; a given token that is no valid text (a lone surrogate) is wrong."""
    if not token:
        return True
    given = message.get("token")
    if not isinstance(given, str):
        return False
    try:
        given_bytes = given.encode()
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given_bytes, token.encode())


# --- the fields --------------------------------------------------------------------------------

def _int(body: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Malformed(f"{key} must be a whole number from {low} to {high}")
    return value


def _text(body: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if value is None:
        raise Malformed(f"{key} is missing")
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise Malformed(f"{key} must be text")
    text = str(value)[:TEXT_LIMIT]
    return text.encode(errors="replace").decode()  # a lone surrogate never reaches a log


def _object(message: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    body = message.get(key)
    if not isinstance(body, dict):
        raise Malformed(f"{key} must be an object")
    return body


# --- the messages ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """A worker joining the rendezvous."""
    addr: str
    pod: str
    rank: int | None  # the machine rank it asks for

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Hello:
        body = _object(message, "hello")
        addr = _text(body, "addr")
        if not addr:
            raise Malformed("addr is empty")
        rank = None if body.get("rank") is None else _int(body, "rank", 1, MAX_RANK)
        return cls(addr, _text(body, "pod", ""), rank)


@dataclass(frozen=True)
class Ask:
    """A question of `podagent status`, `stop` or `logs`."""
    what: str
    offset: int = 0  # logs: from this byte of the head's training log
    by: str = ""  # stop: who asks

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Ask:
        what = message.get("ask")
        if what not in ASKS:
            raise Malformed(f"ask must be one of {', '.join(ASKS)}")
        offset = 0 if message.get("offset") is None else _int(message, "offset", 0, MAX_OFFSET)
        return cls(what, offset, _text(message, "by", "") or "an unnamed pod")


def first(message: Mapping[str, Any]) -> Hello | Ask:
    """A connection's first line, its token already checked."""
    if "hello" in message:
        return Hello.parse(message)
    if "ask" in message:
        return Ask.parse(message)
    raise Malformed("neither a hello nor a question")


MAX_QUIET = 1e9  # seconds without progress a worker may report


@dataclass(frozen=True)
class Beat:
    """A heartbeat, with the seconds since the worker's training last made progress (none
    while no training runs there, or from a podagent that does not watch)."""
    quiet: float | None = None

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Beat:
        quiet = message.get("quiet")
        if quiet is None:
            return cls()
        if isinstance(quiet, bool) or not isinstance(quiet, (int, float)) \
                or not 0 <= quiet <= MAX_QUIET:
            raise Malformed(f"quiet must be seconds from 0 to {MAX_QUIET:g}")
        return cls(float(quiet))


@dataclass(frozen=True)
class Dumped:
    """A worker's answer to the head's dump request: its processes' stacks, summed up (what
    run/stacks.PodDump.from_wire reads, field by field, leniently)."""
    body: Mapping[str, Any]

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Dumped:
        return cls(_object(message, "dumped"))


@dataclass(frozen=True)
class StepDone:
    """A worker's step ended with its launcher's exit code, and (the data check) its reports."""
    step: str
    rc: int
    reports: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> StepDone:
        body = _object(message, "done")
        reports = body.get("reports") or []
        if not isinstance(reports, list) or not all(isinstance(r, dict) for r in reports):
            raise Malformed("reports must be a list of objects")
        return cls(_text(body, "step"), _int(body, "rc", -(1 << 31), (1 << 31) - 1),
                   tuple(reports))


@dataclass(frozen=True)
class Leaving:
    """A worker's podagent is stopping (a signal)."""
    why: str

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> Leaving:
        return cls(_text(message, "leaving"))


def from_worker(message: Mapping[str, Any]) -> Beat | StepDone | Dumped | Leaving:
    if "done" in message:
        return StepDone.parse(message)
    if "dumped" in message:
        return Dumped.parse(message)
    if "leaving" in message:
        return Leaving.parse(message)
    if "beat" in message:
        return Beat.parse(message)
    raise Malformed("not a worker's message")


"""Value parsers of settings: each turns the raw string of a flag or variable into its value, or
raises ValueError(rule) with the rule it breaks (the caller names the flag or variable).

Two parsers look at the file system for what they accept: the NCCL presets (their folder and
names) and a user's reward_func file (compiled to check it, never run).
"""

from __future__ import annotations

import ast
import ipaddress
import math
import os
import re
import shlex
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

E = TypeVar("E", bound=Enum)

_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def whole(minimum: int = 0, maximum: int = 1_000_000) -> Callable[[str], int]:
    rule = f"must be a whole number >= {minimum}"

    def parse(raw: str) -> int:
        if not re.fullmatch(r"[0-9]{1,7}", raw):
            raise ValueError(rule)
        value = int(raw)
        if not minimum <= value <= maximum:
            raise ValueError(f"{rule} and <= {maximum}")
        return value

    return parse


def seconds_or_zero(raw: str) -> float:
    """As `seconds`, 0 included (no wait at all)."""
    try:
        return 0.0 if float(raw) == 0 else seconds(raw)
    except ValueError:
        raise ValueError("must be a number of seconds >= 0 (at most 7 days)") from None


def seconds(raw: str) -> float:
    rule = "must be a number of seconds > 0 (at most 7 days)"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(rule) from None
    if not 0 < value <= 7 * 86400:  # also rejects nan and inf
        raise ValueError(rule)
    return value


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION = 30 * 86400  # a run capped past a month is not capped


def duration(raw: str) -> float:
    """Seconds from `90s`, `30m`, `12h`, `2d` (a bare number: seconds)."""
    rule = "must be a duration such as 90s, 30m, 12h or 2d (more than 0, at most 30d)"
    found = _DURATION.fullmatch(raw.strip().lower())
    if not found:
        raise ValueError(rule)
    value = float(found[1]) * _UNIT[found[2]]
    if not 0 < value <= MAX_DURATION:
        raise ValueError(rule)
    return value


def moment(raw: str) -> float:
    """A point in time as Unix seconds: Unix seconds themselves, or ISO 8601 with its zone
    (`2026-11-30T12:00:00Z`). A time without a zone is refused: a pod's zone is not the
    user's."""
    import datetime

    rule = ("must be a time: Unix seconds, or ISO 8601 with its zone "
            "(e.g. 2026-11-30T12:00:00Z)")
    text = raw.strip()
    if re.fullmatch(r"[0-9]{10,11}(\.[0-9]+)?", text):  # 2001 on: a digit lost is refused
        return float(text)
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(rule) from None
    if when.tzinfo is None:
        raise ValueError(rule)
    return when.timestamp()


def port(raw: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", raw) or not 1 <= int(raw) <= 65535:
        raise ValueError("must be a TCP port number from 1 to 65535")
    return int(raw)


def zero_one(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


def pod_id(raw: str) -> str:
    if not _LABEL.fullmatch(raw.lower()):
        raise ValueError("must be a pod id: letters, digits and '-', at most 63 characters")
    return raw.lower()


def host(raw: str) -> str:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(raw):
        raise ValueError("must be an IP address or a host name")
    return raw.lower()


def ipv4(raw: str) -> str:
    try:
        return str(ipaddress.IPv4Address(raw))
    except ValueError:
        raise ValueError("must be an IPv4 address such as 10.0.0.2") from None


def host_port(raw: str) -> tuple[str, int]:
    rule = "must be HOST or HOST:PORT (e.g. 10.0.0.53 or 10.0.0.53:5353)"
    name, sep, p = raw.rpartition(":") if raw.count(":") == 1 else (raw, "", "")
    try:
        return host(name), (port(p) if sep else 53)
    except ValueError:
        raise ValueError(rule) from None


def dns_suffix(raw: str) -> str:
    raw = raw.strip(".")
    if not _HOSTNAME.fullmatch(raw):
        raise ValueError("must be a DNS domain such as runpod.internal")
    return raw.lower()


def run_name(raw: str) -> str:
    if not _RUN_NAME.fullmatch(raw):
        raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-'")
    return raw


def http_url(raw: str) -> str:
    rule = "must be an http:// or https:// URL such as https://api.runpod.io"
    try:
        parts = urlsplit(raw)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise ValueError(rule) from None
    # No credentials, query or fragment: the key goes in a header, never in a URL.
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username
            or parts.password or parts.query or parts.fragment or "#" in raw or "?" in raw
            or any(c.isspace() or not c.isprintable() for c in raw)):
        raise ValueError(rule)
    return raw.rstrip("/")


def named(kind: type[E]) -> Callable[[str], E]:
    """One of an enum's names, parsed into its member: code then holds the member, never the
    name to convert again."""
    allowed = tuple(member.value for member in kind)

    def parse(raw: str) -> E:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return kind(raw)

    return parse


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return raw

    return parse


def preset_dir() -> Path:
    """Where the NCCL presets are: installed wheels carry them inside the package; a source
    checkout has env/ at its top."""
    package = Path(__file__).resolve().parents[1]  # podagent/, above this config package
    for candidate in (package / "presets", package.parent / "env"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("no NCCL preset directory (env/) found")


def preset_names() -> tuple[str, ...]:
    """The presets' names (their files' stems), which PODAGENT_NCCL_PRESET accepts."""
    return tuple(sorted(file.stem for file in preset_dir().glob("*.env")))


def preset_name(raw: str) -> str:
    names = ("auto", *preset_names())
    if raw not in names:
        raise ValueError(f"must be one of {', '.join(names)}")
    return raw


def command_line(raw: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(raw))
    except ValueError as exc:
        raise ValueError(f"must be a command line ({exc})") from None
    if not argv:
        raise ValueError("must be a command line")
    return argv


def directory(raw: str) -> str:
    if not Path(raw).is_dir():
        raise ValueError("must be an existing directory")
    return str(Path(raw).resolve())


def path(raw: str) -> str:
    if "\x00" in raw:
        raise ValueError("must be a file system path")
    return raw


def short_path(raw: str) -> str:
    # Ray puts unix sockets under its temp dir; their paths must stay under 108 bytes.
    if "\x00" in raw or len(raw.encode()) > 60:
        raise ValueError("must be a path of at most 60 bytes (Ray puts sockets under it)")
    return raw


_SIZE = re.compile(r"([0-9]{1,10})\s*(|B|KiB|MiB|GiB)")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size(raw: str) -> int:
    rule = "must be a size in bytes from 1KiB to 1GiB (e.g. 16MiB or 1048576)"
    m = _SIZE.fullmatch(raw)
    if not m:
        raise ValueError(rule)
    value = int(m.group(1)) * _UNITS[m.group(2)]
    if not 1 << 10 <= value <= 1 << 30:
        raise ValueError(rule)
    return value


def gpu_name(raw: str) -> str:
    """A GPU type's name (nvidia-smi's, RunPod's GPU type id); empty: any."""
    value = " ".join(raw.split())
    if len(value) > 100 or not value.isprintable():
        raise ValueError("must be a GPU type's name such as NVIDIA H100 80GB HBM3 (at most "
                         "100 printable characters), or empty for any")
    return value


def number(minimum: float, maximum: float) -> Callable[[str], float]:
    rule = f"must be a number >= {minimum:g} and <= {maximum:g}"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(rule) from None
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise ValueError(rule)
        return value

    return parse


def key(raw: str) -> str:
    if not raw or len(raw) > 200:
        raise ValueError("must be a JSON field name (1-200 characters)")
    return raw


def existing_file(raw: str) -> str:
    if "\x00" in raw or not os.path.isfile(raw):
        raise ValueError("must be an existing JSONL file")
    return raw


REWARD_FUNC_RULE = "must be a Python file defining reward_func(queries, prompts, labels)"


def reward_func_file(raw: str) -> str:
    """A file upstream OpenRLHF's --remote_rm_url could name: read and compiled, never run
    (running it is the reward server's business, in its own processes)."""
    if "\x00" in raw or not os.path.isfile(raw):
        raise ValueError(f"{REWARD_FUNC_RULE} (no such file)")
    try:
        tree = ast.parse(Path(raw).read_bytes(), filename=raw)
    except SyntaxError as exc:
        raise ValueError(f"{REWARD_FUNC_RULE} (line {exc.lineno}: {exc.msg})") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{REWARD_FUNC_RULE} (cannot be read: {exc})") from None
    if not any(_binds(node, "reward_func") for node in tree.body):
        raise ValueError(f"{REWARD_FUNC_RULE} (it defines no reward_func at the top level)")
    return raw


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether a top-level statement binds `name` (def, assignment or import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Name) and t.id == name for t in targets)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name) == name for alias in node.names)
    return False


"""Settings: built once (flags > environment > defaults) into one frozen object.

Each setting is declared once in FIELDS: its attribute, environment variable, flag, default,
parser and help. `Settings` is made from that table, the CLI makes its options from it and the
README's settings table is generated from it (`python -m podagent.config`), so none can drift
apart. The reward server's own table (REWARD_FIELDS, its PODAGENT_REWARD_* variables) is here
too, beside the parsers it uses, so that a misspelt variable of either table is named at start
without this module importing the reward server.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import inspect
import ipaddress
import math
import os
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from podagent.choices import (
    PROMPT_TEMPLATES,
    REWARD_KINDS,
    SCORING,
    AfterRun,
    OnNodeLoss,
    one_of,
)
from podagent.errors import ConfigError, InputError

# Variables whose values must never be shown or put on a command line.
SECRET_NAMES = frozenset(
    {"WANDB_API_KEY", "RAY_AUTH_TOKEN", "PODAGENT_TOKEN", "RUNPOD_API_KEY", "HF_TOKEN",
     "PODAGENT_RUNPOD_API_KEY"}
)
RUNPOD_API_URL = "RUNPOD_API_URL"  # the one setting for RunPod's API (on a pod and for `up`)
UP_RUN_LABEL = "PODAGENT_UP_RUN"  # every pod `podagent up` creates carries its run's name in it
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")


REDACTED_VALUE = "<redacted>"


def is_secret(name: str) -> bool:
    return name in SECRET_NAMES or name.upper().endswith(SECRET_SUFFIXES)


# --- parsers: each returns the value or raises ValueError(rule) --------------------------------

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


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return raw

    return parse


def preset_dir() -> Path:
    """Where the NCCL presets are: installed wheels carry them inside the package; a source
    checkout has env/ at its top."""
    package = Path(__file__).resolve().parent
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


def reward_scoring(raw: str) -> str:
    return choice(*SCORING)(raw)


def reward_template(raw: str) -> str:
    return choice(*PROMPT_TEMPLATES)(raw)


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


# --- the table ----------------------------------------------------------------------------------

AFTER_RUN = tuple(policy.value for policy in AfterRun)
ON_NODE_LOSS = tuple(policy.value for policy in OnNodeLoss)


@dataclass(frozen=True)
class Field:
    attr: str
    env: str
    flag: str | None
    parse: Callable[[str], Any]
    help: str
    # The value when nothing gives one; where default_doc is set, build derives the value
    # first and this is only what a Settings made without build holds.
    default: Any = None
    default_doc: str = ""  # the default as the README and --help say it, when not `default`
    is_flag: bool = False  # the CLI option takes no value and means "1"


FIELDS: tuple[Field, ...] = (
    # Role and discovery (the seed's and RunPod's own names stay as they are).
    Field("ray_worker", "RAY_WORKER", "--ray-worker", zero_one,
          "1 makes this pod a worker, 0 the head (unset: decided by the rules below)."),
    Field("head_pod_id", "HEAD_POD_ID", "--head-pod-id", pod_id,
          "RunPod id of the head pod; workers resolve HEAD_POD_ID.DNS_SUFFIX."),
    Field("pod_id", "RUNPOD_POD_ID", "--pod-id", pod_id,
          "This pod's own id (RunPod sets it); compared with HEAD_POD_ID."),
    Field("node_rank", "NODE_RANK", "--node-rank", whole(0),
          "Instant Cluster rank of this node (RunPod sets it; 0 is the head)."),
    Field("primary_addr", "PRIMARY_ADDR", "--primary-addr", host,
          "Instant Cluster head address (RunPod sets it)."),
    Field("num_nodes", "NUM_NODES", "--num-nodes", whole(1),
          "Instant Cluster size (RunPod sets it)."),
    Field("node_addr", "NODE_ADDR", "--node-addr", ipv4,
          "Instant Cluster address of this node (RunPod sets it)."),
    Field("expected_workers", "EXPECTED_WORKERS", "--expected-workers", whole(0),
          "Worker nodes the head waits for.", default=0,
          default_doc="1 with HEAD_POD_ID, NUM_NODES-1 on an Instant Cluster, else 0"),
    Field("min_workers", "PODAGENT_MIN_WORKERS", "--min-workers", whole(0),
          "Go on after the worker wait times out if at least this many joined.",
          default_doc="unset: all expected workers are required"),
    Field("head_addr", "PODAGENT_HEAD_ADDR", "--head-addr", host,
          "Head address for workers; skips DNS."),
    Field("dns_suffix", "PODAGENT_DNS_SUFFIX", "--dns-suffix", dns_suffix,
          "Domain after HEAD_POD_ID in the head's DNS name.", default="runpod.internal"),
    Field("dns_server", "PODAGENT_DNS_SERVER", "--dns-server", host_port,
          "DNS server HOST[:PORT] to ask instead of the system resolver.",
          default_doc="system resolver"),
    Field("ray_port", "PODAGENT_RAY_PORT", "--ray-port", port,
          "Ray GCS port on the head.", default=6379),
    Field("dashboard_port", "PODAGENT_DASHBOARD_PORT", "--dashboard-port", port,
          "Ray dashboard and Jobs API port on the head.", default=8265),
    Field("node_ip", "PODAGENT_NODE_IP", "--node-ip", ipv4,
          "This pod's cluster-private address.",
          default_doc="detected (NODE_ADDR, the preset's interface, the route to the head)"),
    Field("num_gpus", "PODAGENT_NUM_GPUS", "--num-gpus", whole(0, 1024),
          "GPUs this node offers to Ray.", default_doc="detected"),
    Field("worker_timeout", "PODAGENT_WORKER_TIMEOUT", "--worker-timeout", seconds,
          "Seconds the head waits for the expected workers.", default=600.0),
    Field("head_timeout", "PODAGENT_HEAD_TIMEOUT", "--head-timeout", seconds,
          "Seconds a worker waits to find the head and join it.", default=600.0),
    Field("head_grace", "PODAGENT_HEAD_GRACE", "--head-grace", seconds,
          "Seconds a joined worker tolerates an unreachable head before it leaves.",
          default=8.0),
    Field("rejoin", "PODAGENT_REJOIN", "--rejoin", zero_one,
          "1: a worker whose head is gone goes back to finding it (a restarted head is joined "
          "again) instead of exiting; 0: it exits.", default=True),
    Field("on_node_loss", "PODAGENT_ON_NODE_LOSS", "--on-node-loss", choice(*ON_NODE_LOSS),
          "What the head does when a node of the running job is lost: restart (stop the job at "
          "once, wait until the cluster is whole again, a replacement pod counting, and submit "
          "it again resuming from the newest checkpoint), wait (leave the job to decide; if it "
          "fails, restart it as above) or fail (leave the job to decide, never restart).",
          default=OnNodeLoss.RESTART.value,
          default_doc="restart when PODAGENT_RESTARTS > 0, else fail"),
    Field("restarts", "PODAGENT_RESTARTS", "--restarts", whole(0, 1000),
          "How many times a run may be restarted after a lost node (or a failed job with "
          "PODAGENT_RETRY_FAILED_JOB=1); then the run ends with exit code 16.", default=3),
    Field("retry_failed_job", "PODAGENT_RETRY_FAILED_JOB", "--retry-failed-job", zero_one,
          "1: a job that fails with no node lost is restarted too (within PODAGENT_RESTARTS).",
          default=False),
    Field("restart_backoff", "PODAGENT_RESTART_BACKOFF", "--restart-backoff", seconds_or_zero,
          "Seconds before the first restart's submission, doubled for each later one (at most "
          "300 s); the wait for the cluster runs meanwhile.", default=5.0),
    Field("stop_timeout", "PODAGENT_STOP_TIMEOUT", "--stop-timeout", seconds,
          "Seconds a child gets after SIGTERM before SIGKILL.", default=10.0),
    Field("after_run", "PODAGENT_AFTER_RUN", "--after-run", choice(*AFTER_RUN),
          "What podagent does when the run is over, or after an exit a new start cannot mend "
          "(bad input, a refused token, restarts used up, a crash loop): "
          + one_of([f"{policy} ({policy.meaning})" for policy in AfterRun]) + ".",
          default=AfterRun.EXIT.value,
          default_doc="stop-pod on RunPod (RUNPOD_POD_ID and its RUNPOD_API_KEY set; stay "
                      "without the key), else exit"),
    Field("runpod_api_url", RUNPOD_API_URL, "--runpod-api-url", http_url,
          "Base URL of RunPod's REST API v2 (paths /v2/... follow it), for a pod stopping "
          "itself and for `podagent up/down/ls`.", default="https://api.runpod.io"),
    Field("over_linger", "PODAGENT_OVER_LINGER", "--over-linger", seconds_or_zero,
          "Seconds a head whose run is over stays to tell workers that did not leave with it "
          "(their containers were being started again) that the run is over, before its "
          "pod stops; 0: no wait.", default=120.0),
    Field("nccl_preset", "PODAGENT_NCCL_PRESET", "--nccl-preset", preset_name,
          "NCCL preset from env/ (auto picks by evidence).", default="auto"),
    Field("run_name", "PODAGENT_RUN_NAME", "--run-name", run_name,
          "Name of this run: its log directory and the job's submission id. The default is "
          "the same after a container restart, so a restarted pod finds its run again.",
          default="podagent",
          default_doc="podagent-HEAD_POD_ID, else podagent-PRIMARY_ADDR-NUM_NODESn (Instant "
                      "Cluster), else podagent-RUNPOD_POD_ID, else podagent-YYYYmmdd-HHMMSS "
                      "(UTC, at start)"),
    Field("log_dir", "PODAGENT_LOG_DIR", "--log-dir", path,
          "Parent of the per-run log directories.", default="podagent-logs",
          default_doc="/workspace/podagent/logs if /workspace exists, else ./podagent-logs"),
    Field("job", "PODAGENT_JOB", "--job", command_line,
          "Job entrypoint (a command line); `podagent head -- CMD ...` also sets it.",
          default_doc="the built-in cluster check"),
    Field("working_dir", "PODAGENT_WORKING_DIR", "--working-dir", directory,
          "Directory uploaded as the job's working dir."),
    Field("ray_temp_dir", "PODAGENT_RAY_TEMP_DIR", "--ray-temp-dir", short_path,
          "Ray's temp dir on this pod.", default_doc="Ray's default (/tmp/ray)"),
    Field("reward", "PODAGENT_REWARD", "--reward", choice(*REWARD_KINDS),
          "Reward server the head runs: builtin (scoring by PODAGENT_REWARD_SCORING), func "
          "(the built-in server serving PODAGENT_REWARD_FUNC), cmd (PODAGENT_REWARD_CMD) or "
          "none.", default="builtin"),
    Field("reward_func", "PODAGENT_REWARD_FUNC", "--reward-func", reward_func_file,
          "PODAGENT_REWARD=func: a Python file defining reward_func(queries, prompts, labels) "
          "as upstream OpenRLHF's --remote_rm_url takes; served with pooled CPUs and a "
          "per-item timeout."),
    Field("reward_cmd", "PODAGENT_REWARD_CMD", "--reward-cmd", command_line,
          "Reward server command line for PODAGENT_REWARD=cmd (split without a shell); it "
          "must listen on PODAGENT_REWARD_HOST:PODAGENT_REWARD_PORT, which podagent sets."),
    Field("reward_port", "PODAGENT_REWARD_PORT", "--reward-port", port,
          "Reward server port on the head.", default=5000),
    Field("reward_timeout", "PODAGENT_REWARD_TIMEOUT", "--reward-timeout", seconds,
          "Seconds the reward server gets to answer a real request at start.", default=600.0),
    Field("reward_restarts", "PODAGENT_REWARD_RESTARTS", "--reward-restarts", whole(0, 100),
          "Restarts of a reward server that dies or stops answering during the job.",
          default=3),
    Field("reward_scoring", "PODAGENT_REWARD_SCORING", "--reward-scoring", reward_scoring,
          "Built-in reward server's scoring: openrlhf-m (OpenRLHF-M's reward server, item for "
          "item), boxed or openrlhf-boxed (upstream OpenRLHF's math reward function); see "
          "Reward server.", default="openrlhf-m"),
    Field("reward_template", "PODAGENT_REWARD_TEMPLATE", "--reward-template", reward_template,
          "openrlhf-m: the chat template of the trainer's queries (chatml, qwen1 or base, as "
          "OpenRLHF-M's --prompt-template).", default="chatml"),
    Field("reward_strict", "PODAGENT_REWARD_STRICT", "--reward-strict", zero_one,
          "openrlhf-m: 1 scores an unparseable gold answer accuracy 0 instead of OpenRLHF-M's 1.",
          default=False),
    Field("debug_ray", "DEBUG_RAY", "--debug-ray", zero_one,
          "1 starts Ray with RAY_DEBUG=legacy and --ray-debugger-external.", default=False),
    Field("checkpoint_dir", "PODAGENT_CHECKPOINT_DIR", "--checkpoint-dir", path,
          "Directory the job writes checkpoints to; podagent checks its free space and "
          "resumes from it (PODAGENT_RESUME).",
          default_doc="/workspace/checkpoints if /workspace exists, else unset"),
    Field("resume", "PODAGENT_RESUME", "--resume", choice("auto", "never"),
          "auto: when PODAGENT_CHECKPOINT_DIR already holds a checkpoint, append "
          "PODAGENT_RESUME_FLAG to the job; never: do not.", default="auto"),
    Field("resume_flag", "PODAGENT_RESUME_FLAG", "--resume-flag", command_line,
          "Arguments appended to the job to resume from a checkpoint.",
          default=("--load_checkpoint",), default_doc="--load_checkpoint"),
    Field("rendezvous_port", "PODAGENT_RENDEZVOUS_PORT", "--rendezvous-port", port,
          "Port of torch's rendezvous on the head (`podagent torchrun`; accelerate's main "
          "process port with `podagent accelerate`).", default=29500),
    Field("supervisor_port", "PODAGENT_SUPERVISOR_PORT", "--supervisor-port", port,
          "Port of the head's podagent in a run without Ray (`podagent torchrun/accelerate`): "
          "podagent's own rendezvous, heartbeats, status, stop and logs.", default=29510),
    Field("peer_grace", "PODAGENT_PEER_GRACE", "--peer-grace", seconds,
          "Seconds a run without Ray tolerates a silent pod (heartbeats every second) before "
          "it stops the training on every pod.", default=5.0),
    Field("log_format", "PODAGENT_LOG_FORMAT", "--log-format", choice("text", "json"),
          "Screen output: text, or json (one object per line, for log collectors); the pod's "
          "log file stays text.", default="text"),
    Field("quiet", "PODAGENT_QUIET", "--quiet", zero_one,
          "Show only warnings, errors and the job's own output (the variable: 1).",
          default=False, is_flag=True),
    Field("listen", "PODAGENT_LISTEN", "--listen", choice("private", "all"),
          "Where the head's dashboard (Jobs API) and reward server listen: private (this "
          "pod's cluster address) or all (0.0.0.0: every interface; use a cluster token).",
          default="private"),
)

FIELD_BY_ATTR = {f.attr: f for f in FIELDS}


# --- the reward server's table (`podagent reward-server`, PODAGENT_REWARD_*) --------------------

REWARD_ENV_PREFIX = "PODAGENT_REWARD_"
REWARD_PRELOAD = "PODAGENT_REWARD_PRELOAD"
# The weight of the format rule in a reward (rewards.verify scores with it by default).
FORMAT_WEIGHT = 0.5


@dataclass(frozen=True)
class RewardField:
    """A reward server setting: its flag is --ATTR, its variable REWARD_ENV_PREFIX + ATTR."""

    attr: str
    parse: Callable[[str], Any]
    help: str
    default: Any = None  # as Field.default
    default_doc: str = ""
    flag_name: str = ""  # when the flag is not --ATTR (the seed's own flag name)

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.attr.replace("_", "-")

    @property
    def env(self) -> str:
        return REWARD_ENV_PREFIX + self.attr.upper()


REWARD_FIELDS: tuple[RewardField, ...] = (
    RewardField("scoring", choice(*SCORING),
                "Scoring profile: openrlhf-m (OpenRLHF-M's reward server, item for item), "
                "boxed (the last \\boxed{} or <answer> block) or openrlhf-boxed (upstream "
                "OpenRLHF's math reward function, item for item); see docs/reward-server.md.",
                "openrlhf-m"),
    RewardField("template", choice(*PROMPT_TEMPLATES),
                "openrlhf-m: the chat template whose assistant prefix starts the response "
                "(the seed's --prompt-template).", "chatml", flag_name="--prompt-template"),
    RewardField("strict", zero_one,
                "openrlhf-m: 1 scores an unparseable gold answer, or a comparison that raises, "
                "as accuracy 0; 0 scores them 1, as OpenRLHF-M's server does.", False),
    RewardField("func", reward_func_file,
                "Serve this file's reward_func(queries, prompts, labels) instead of a profile "
                "(upstream OpenRLHF's reward function contract), one item per call, in the "
                "verifier processes."),
    RewardField("default_reward", number(-1e9, 1e9),
                "--func and openrlhf-boxed: the reward and score of an item whose function "
                "raised or ran past --item-timeout (each such item is logged).", 0.0),
    # Upstream OpenRLHF logs an extra_logs dict; OpenRLHF-M's client makes a tensor of every
    # reply key, so a dict there would crash the trainer: off unless asked for.
    RewardField("extra_logs", zero_one,
                "1 adds extra_logs (per-item format and accuracy lists) to every reply, for "
                "upstream OpenRLHF; 0 keeps every key a list of numbers, as OpenRLHF-M's "
                "client needs.", False),
    # Loopback by default: the server has no authentication. The head passes its
    # cluster-private address.
    RewardField("host", host, "Address to listen on.", "127.0.0.1"),
    RewardField("port", port, "TCP port to listen on.", 5000),
    RewardField("workers", whole(1, 1024), "Verifier processes.", 1,
                default_doc="CPUs this process may use"),
    RewardField("listeners", whole(1, 64),
                "Server processes accepting requests on the port, each with its share of the "
                "workers: with one sample per request one process's event loop caps the rate.",
                1, default_doc="1 per 8 CPUs, at most 4"),
    RewardField("item_timeout", number(0.1, 600),
                "Seconds one item may take to verify; past it the worker is killed and the "
                "item scores 0.", 5.0),
    # A reward function that allocates without bound fails its item, not the pod (on the head
    # the trainer shares the pod's memory, and the kernel's OOM killer picks the largest).
    RewardField("item_memory", size,
                "Memory one verifier process may allocate (bytes, or with KiB/MiB/GiB); an "
                "item that needs more fails and scores the default (--func) or 0.", None,
                default_doc="a quarter of the pod's memory"),
    RewardField("batch_wait", number(0, 50),
                "Milliseconds a small request may wait for others to be verified with it "
                "(trainers that send one sample per request); 0 sends each on its own.", 2.0),
    # A request's budget: preparing it takes time linear in its bytes, a slice at a time,
    # turn about with other requests; the limits bound its memory and its share. The defaults
    # are four times the batches trainers send (OpenRLHF-M: one batch per call, 256 to 1,024
    # items of a few KB, say 16 KB at most; upstream OpenRLHF: one item per request).
    RewardField("max_items", whole(1, 1_000_000),
                "Most items in one request; a request with more gets HTTP 413 naming this "
                "limit.", 4096),
    RewardField("max_body", size,
                "Largest request body (bytes, or with KiB/MiB/GiB); a larger one gets HTTP 413 "
                "naming this limit.", 64 << 20, default_doc="64MiB"),
    RewardField("format_weight", number(0, 100),
                "FORMAT_WEIGHT in reward = accuracy + FORMAT_WEIGHT × format.", FORMAT_WEIGHT),
    RewardField("dataset", existing_file,
                "JSONL of prompts and gold answers. openrlhf-m: gold answers come from it by "
                "the request's prompts (labels are used only without it); boxed: for requests "
                "that send no labels."),
    RewardField("prompt_key", key, "Prompt field of --dataset records.", "prompt"),
    RewardField("answer_key", key, "Gold answer field of --dataset records.", "answer"),
)


def settings_class(table: Iterable[Any]) -> Callable[[type], type]:
    """Make the decorated class a frozen dataclass with one attribute per field of `table`,
    in its order and with its default, then the attributes the class itself declares (which
    are not settings a user gives: they must have defaults too)."""
    table = tuple(table)

    def make(cls: type) -> type:
        own = inspect.get_annotations(cls)
        cls.__annotations__ = {**{f.attr: Any for f in table}, **own}
        for f in table:
            setattr(cls, f.attr, f.default)
        return dataclass(frozen=True)(cls)

    return make


@settings_class(FIELDS)
class Settings:
    """One attribute per field of FIELDS, then what build adds beside them."""

    # The cluster token read from the file RAY_AUTH_TOKEN_PATH names (read once, at build).
    token_from_file: str | None = field(default=None, repr=False)
    # The process environment as it was at start (user variables win over presets). Not in
    # repr: it holds secrets (RUNPOD_API_KEY, the cluster token).
    environ: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}),
                                       repr=False)
    # Where each setting came from: "flag", "env" or "default"; a derived default says from
    # what (run_name: "derived from HEAD_POD_ID", ...). "default" alone for run_name means the
    # timestamp: a name that never repeats.
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # One line each, for the CLI to show: PODAGENT_* variables podagent does not know.
    warnings: tuple[str, ...] = ()

    @property
    def run_dir(self) -> Path:
        return Path(self.log_dir) / self.run_name

    @property
    def auth_token(self) -> str | None:
        """The cluster token: RAY_AUTH_TOKEN, or PODAGENT_TOKEN mapped onto it, or the content
        of the file RAY_AUTH_TOKEN_PATH names (Ray's own way to keep it out of environments).

        Never a flag: a secret must not appear on a command line.
        """
        for name in TOKEN_VARIABLES:
            value = self.environ.get(name, "").strip()
            if value:
                return value
        return self.token_from_file

    def auth_headers(self) -> dict[str, str]:
        token = self.auth_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.auth_token
        return (("authorization", f"Bearer {token}"),) if token else ()

    @property
    def runpod_api_key(self) -> str | None:
        """RUNPOD_API_KEY: on a pod, the pod-scoped key RunPod injects (PODAGENT_AFTER_RUN=
        stop-pod). Never a flag, never shown."""
        return runpod_key(self.environ, from_file=False)

    @property
    def run_name_shared(self) -> bool:
        """Whether the run name is one name for the whole cluster: set explicitly, or derived
        from what every pod shares (HEAD_POD_ID, PRIMARY_ADDR). Not when derived from this
        pod's own RUNPOD_POD_ID or from the start time."""
        return self.sources.get("run_name", "default") in (
            "flag", "env", RUN_NAME_FROM_HEAD_POD_ID, RUN_NAME_FROM_PRIMARY_ADDR)

    @property
    def instant_cluster(self) -> bool:
        return self.node_rank is not None or self.primary_addr is not None

    @property
    def head_dns_name(self) -> str | None:
        return f"{self.head_pod_id}.{self.dns_suffix}" if self.head_pod_id else None

    def source_name(self, attr: str) -> str:
        """The name a user set this value by, for messages: the flag or the variable."""
        f = FIELD_BY_ATTR[attr]
        return f.flag if self.sources.get(attr) == "flag" and f.flag else f.env


def _default_log_dir() -> str:
    return "/workspace/podagent/logs" if Path("/workspace").is_dir() else "podagent-logs"


def _default_checkpoint_dir() -> str | None:
    # RunPod's volume survives the pod; elsewhere there is no safe guess.
    return "/workspace/checkpoints" if Path("/workspace").is_dir() else None


def read_fields(
    table: Iterable[Any], flags: Mapping[str, str | None], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse each field of a table (attr, flag, env, parse): flag, else environment.

    Returns (values given, source of every field: "flag", "env" or "default"); raises
    ConfigError naming the flag or variable, the value and the rule.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in table:
        raw, name, source = flags.get(f.attr), f.flag, "flag"
        if raw is None or not str(raw).strip():
            raw, name, source = env.get(f.env), f.env, "env"
        # Templates leave placeholders empty: an empty value means "not set".
        if raw is None or not str(raw).strip():
            sources[f.attr] = "default"
            continue
        raw = str(raw).strip()
        try:
            values[f.attr] = f.parse(raw)
        except ValueError as exc:
            raise ConfigError(name or f.env, raw, str(exc)) from None
        sources[f.attr] = source
    return values, sources


def markdown_table(table: Iterable[Any]) -> str:
    """flag | variable | default | meaning, one row per field (for the README)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for f in table:
        default = f.default_doc or ("" if f.default is None else str(f.default))
        if isinstance(f.default, bool):
            default = str(int(f.default))
        elif isinstance(f.default, float):
            default = f"{f.default:g}"
        rows.append(f"| `{f.flag}` | `{f.env}` | {default or '—'} | {f.help} |")
    return "\n".join(rows)


def build(
    flags: Mapping[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
    job_argv: tuple[str, ...] | None = None,
    now: float | None = None,
) -> Settings:
    """Flags > environment > defaults. Raises ConfigError naming the variable, value and rule."""
    env = dict(os.environ if environ is None else environ)
    values, sources = read_fields(FIELDS, flags or {}, env)
    if job_argv:
        values["job"], sources["job"] = tuple(job_argv), "flag"
    if "expected_workers" not in values:
        if values.get("head_pod_id"):
            values["expected_workers"] = 1  # as the seed's script did
        elif values.get("num_nodes"):
            values["expected_workers"] = values["num_nodes"] - 1
    if "run_name" not in values:
        derived = derived_run_name(values)
        if derived:
            values["run_name"], sources["run_name"] = derived
        else:
            started = time.gmtime(time.time() if now is None else now)
            values["run_name"] = time.strftime("podagent-%Y%m%d-%H%M%S", started)
    # A RunPod pod whose process exits is restarted, and would run again: stay up instead.
    values.setdefault("after_run", AfterRun.default(
        on_runpod=bool(values.get("pod_id")), can_stop=bool(runpod_key(env, from_file=False))
    ).value)
    restarts = values.get("restarts", FIELD_BY_ATTR["restarts"].default)
    values.setdefault("on_node_loss", OnNodeLoss.default(restarts).value)
    values.setdefault("log_dir", _default_log_dir())
    if "checkpoint_dir" not in values and _default_checkpoint_dir():
        values["checkpoint_dir"] = _default_checkpoint_dir()
    for f in FIELDS:
        if f.attr not in values and f.default is not None:
            values[f.attr] = f.default

    settings = Settings(
        **values, environ=MappingProxyType(env), sources=MappingProxyType(sources),
        token_from_file=_read_token_file(env), warnings=tuple(unknown_settings(env)),
    )
    _check_relations(settings)
    _check_token(settings)
    _check_after_run(settings)
    return settings


# --- the default run name: the same after a container restart --------------------------------

RUN_NAME_FROM_HEAD_POD_ID = "derived from HEAD_POD_ID"
RUN_NAME_FROM_PRIMARY_ADDR = "derived from PRIMARY_ADDR/NUM_NODES"
RUN_NAME_FROM_POD_ID = "derived from RUNPOD_POD_ID"
_RUN_NAME_MAX = 64
_RUN_NAME_HASH = 8  # hex digits of the full derived part kept when it must be shortened


def _run_name_from(part: str) -> str | None:
    """podagent-PART, made to satisfy the run-name rule: characters outside [A-Za-z0-9._-]
    become '-'; a name too long keeps PART's start and a short hash of all of it, so two long
    ids that share a prefix still give two names (the same on every pod, every start)."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", part).strip("-._")
    if not clean:
        return None
    name = f"podagent-{clean}"
    if len(name) > _RUN_NAME_MAX:
        digest = hashlib.sha256(part.encode()).hexdigest()[:_RUN_NAME_HASH]
        keep = _RUN_NAME_MAX - len("podagent-") - 1 - _RUN_NAME_HASH
        name = f"podagent-{clean[:keep].rstrip('-._')}-{digest}"
    return run_name(name)


def derived_run_name(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(run name, source) from what stays the same when a container restarts, first match:
    HEAD_POD_ID (RunPod Global Networking: one value on every pod of the cluster), the Instant
    Cluster's PRIMARY_ADDR (and NUM_NODES), RUNPOD_POD_ID (a single pod). None: no such
    fact, so the caller falls back to the start time (a name that never repeats)."""
    if values.get("head_pod_id"):
        name = _run_name_from(values["head_pod_id"])
        if name:
            return name, RUN_NAME_FROM_HEAD_POD_ID
    if values.get("primary_addr"):
        part = re.sub(r"[.:]", "-", values["primary_addr"])
        if values.get("num_nodes"):
            part += f"-{values['num_nodes']}n"
        name = _run_name_from(part)
        if name:
            return name, RUN_NAME_FROM_PRIMARY_ADDR
    if values.get("pod_id"):
        name = _run_name_from(values["pod_id"])
        if name:
            return name, RUN_NAME_FROM_POD_ID
    return None


# --- PODAGENT_* variables podagent does not know ------------------------------------------------

PREFIX = "PODAGENT_"

# In the environment of every `ray start` podagent runs, so that Ray's daemons and all they
# start inherit it: a Ray on this pod without it is someone else's (process.pod_ray).
RAY_OWNER = "PODAGENT_RAY_OWNER"


def ray_owner(settings: Settings) -> str:
    """The mark's value: who started that Ray (for a person reading a process's environment)."""
    return f"podagent run {settings.run_name}"

# PODAGENT_* variables that are podagent's own but not settings in FIELDS (nor the reward
# server's PODAGENT_REWARD_* table), so never warned about; each with why it exists.
OTHER_VARIABLES: Mapping[str, str] = MappingProxyType({
    "PODAGENT_TOKEN": "the cluster token (a secret: the environment only, never a flag)",
    "PODAGENT_NUM_NODES": "set by the head for the job: nodes in the cluster",
    "PODAGENT_SUBMISSION_ID": "set by the head for the job: its Ray submission id (<run>-N)",
    "PODAGENT_ATTEMPT": "set by the head for the job: N, 1 at first, one more per restart",
    "PODAGENT_CHECK_BACKEND": "the built-in cluster check's collective backend (nccl, gloo)",
    "PODAGENT_CHECK_START_TIMEOUT": "seconds the cluster check gives its ranks to start",
    "PODAGENT_CHECK_RUN_TIMEOUT": "seconds the cluster check gives a collective to finish",
    "PODAGENT_RAY_MATRIX_ONLY": "set by the test suite when it runs itself under another Ray",
    UP_RUN_LABEL: "set by `podagent up` on the pods it creates: the run they belong to "
                       "(how `podagent down` finds them)",
    "PODAGENT_RUNPOD_API_KEY": "a RunPod account key for the pods of an `up` run (a RunPod "
                               "secret): the head terminates every pod of its run at its end",
    RAY_OWNER: "set by podagent on every Ray it starts (and so on that Ray's jobs): its mark",
    "PODAGENT_REWARD_URL": "verl's reward function (podagent.rewards.client): the reward "
                           "server's URL, used before the REMOTE_RM_URL the head sets for the job",
    REWARD_PRELOAD: "set by the reward server for its verifier pool: the reward rule (a "
                    "reward_func file, openrlhf-boxed) every worker starts with",
})


# Names podagent read once and reads no more: set, each gets its own line.
RETIRED_VARIABLES: Mapping[str, str] = MappingProxyType({
    "PODAGENT_RUNPOD_API_URL": "is retired with RunPod's API v1: RUNPOD_API_URL is the one "
                               "setting for RunPod's API (v2, https://api.runpod.io)",
})


def known_variables() -> frozenset[str]:
    """Every variable podagent reads or sets: FIELDS, the reward server's table, the rest."""
    return frozenset({f.env for f in FIELDS} | {f.env for f in REWARD_FIELDS}
                     | set(OTHER_VARIABLES) | set(TOKEN_VARIABLES) | set(RETIRED_VARIABLES))


def _shown_name(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_]+", name) else ascii(name)


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """One warning per PODAGENT_* variable podagent does not know, with the closest known
    name when one is close (a typo). Names only: a value may be a secret. An empty value
    means "not set" (as for every setting), so it is not warned about."""
    known = known_variables()
    # Compared without the prefix, so that the shared PODAGENT_ does not make every name
    # look close; FIELDS first, so a setting wins over a name podagent sets for the job.
    by_stem: dict[str, str] = {}
    for name in [f.env for f in FIELDS] + sorted(known):
        by_stem.setdefault(name.removeprefix(PREFIX), name)
    warnings = []
    for name in sorted(environ):
        if name in RETIRED_VARIABLES and str(environ[name]).strip():
            warnings.append(f"{name} {RETIRED_VARIABLES[name]} (ignored)")
            continue
        if not name.startswith(PREFIX) or name in known or not str(environ[name]).strip():
            continue
        close = difflib.get_close_matches(name.removeprefix(PREFIX), list(by_stem), n=1)
        hint = f"; did you mean {by_stem[close[0]]}?" if close else ""
        warnings.append(f"{_shown_name(name)} is not a podagent setting{hint} (ignored)")
    return warnings


RUNPOD_API_KEY = "RUNPOD_API_KEY"  # RunPod's own name; a secret, read from the environment
# An account key given to the pods of an `up` run (a RunPod secret) to terminate them all at
# its end; the pod-scoped RUNPOD_API_KEY may not be allowed to.
RUNPOD_ACCOUNT_KEY = "PODAGENT_RUNPOD_API_KEY"
RUNPOD_API_KEY_FILE = "RUNPOD_API_KEY_FILE"


def runpod_key(environ: Mapping[str, str], key_file: str | None = None,
               names: tuple[str, ...] = (RUNPOD_API_KEY,), from_file: bool = True) -> str | None:
    """RunPod's API key, the one place podagent reads one: from the first of `names` set in the
    environment, else (`from_file`) from a file (`key_file`, or RUNPOD_API_KEY_FILE), never from
    a command line, where every user of the machine could read it. None when there is none; a
    file that cannot be read is InputError."""
    for name in names:
        key = environ.get(name, "").strip()
        if key:
            return key
    path = (key_file or environ.get(RUNPOD_API_KEY_FILE, "").strip()) if from_file else ""
    if not path:
        return None
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise InputError(f"--api-key-file {path!r}: cannot be read "
                         f"({exc.strerror or exc})") from None
    if not key:
        raise InputError(f"--api-key-file {path!r}: is empty (it should hold the key)")
    return key
TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "PODAGENT_TOKEN")
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"  # Ray's own: a file that holds the token
TOKEN_RULE = "at least 16 printable characters without spaces (`podagent token` makes one)"

# Which child gets which secret (docs/secrets.md). RUNPOD_API_KEY is podagent's alone (it stops
# the pod); Ray and the job keep every other one (the job's W&B key, the cluster token Ray
# needs); a reward server never talks to Ray, so never gets the cluster token, and the built-in
# one, which runs sympy on model output, gets no secret at all.
ONLY_PODAGENTS = (RUNPOD_API_KEY, RUNPOD_ACCOUNT_KEY)
CLUSTER_TOKEN = (*TOKEN_VARIABLES, TOKEN_PATH_VARIABLE)


def child_environ(environ: Mapping[str, str], also_drop: Callable[[str], bool] = lambda _: False
                  ) -> dict[str, str]:
    """The environment a child of podagent starts with: never ONLY_PODAGENTS's secrets, nor
    the variables `also_drop` names."""
    return {k: v for k, v in environ.items() if k not in ONLY_PODAGENTS and not also_drop(k)}


def _valid_token(value: str) -> bool:
    return len(value) >= 16 and not any(c.isspace() for c in value) and value.isprintable()


def _read_token_file(env: Mapping[str, str]) -> str | None:
    """The token in the file RAY_AUTH_TOKEN_PATH names, read once; errors name the variable,
    the path and the rule, never the content."""
    raw = env.get(TOKEN_PATH_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        # A token file is tiny; reading a few KiB at most keeps a wrong path (a device, a
        # huge log) from hanging or flooding podagent.
        with open(raw, "rb") as f:
            content = f.read(4096)
        value = content.decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        raise ConfigError(TOKEN_PATH_VARIABLE, raw,
                          f"must name a readable file that holds the cluster token ({why})"
                          ) from None
    if not _valid_token(value):
        raise ConfigError(TOKEN_PATH_VARIABLE, raw, f"must name a file that holds {TOKEN_RULE}")
    return value


def _check_token(settings: Settings) -> None:
    # Values are never shown: the message names the variable and the rule only.
    environ = settings.environ
    given = {n: environ[n].strip() for n in TOKEN_VARIABLES if environ.get(n, "").strip()}
    for name, value in given.items():
        if not _valid_token(value):
            raise ConfigError(name, REDACTED_VALUE, f"must be {TOKEN_RULE}")
    if len(set(given.values())) > 1:
        raise ConfigError("PODAGENT_TOKEN", REDACTED_VALUE,
                          "must equal RAY_AUTH_TOKEN when both are set")
    if settings.token_from_file and given and settings.token_from_file not in given.values():
        raise ConfigError(TOKEN_PATH_VARIABLE, settings.environ[TOKEN_PATH_VARIABLE].strip(),
                          f"must name a file holding the same token as {', '.join(given)} "
                          f"when both are set")


def _check_relations(settings: Settings) -> None:
    if settings.min_workers is not None and settings.min_workers > settings.expected_workers:
        raise ConfigError(
            settings.source_name("min_workers"), str(settings.min_workers),
            f"must be <= EXPECTED_WORKERS ({settings.expected_workers})",
        )
    ports = {"ray_port": settings.ray_port, "dashboard_port": settings.dashboard_port}
    if settings.reward != "none":
        ports["reward_port"] = settings.reward_port
    seen: dict[int, str] = {}
    for attr, taken in ports.items():
        if taken in seen:
            raise ConfigError(settings.source_name(attr), str(taken),
                              f"must differ from {FIELD_BY_ATTR[seen[taken]].env}")
        seen[taken] = attr
    if settings.reward == "cmd" and not settings.reward_cmd:
        raise ConfigError(settings.source_name("reward_cmd"), "",
                          "must be set when PODAGENT_REWARD=cmd")
    if settings.reward == "func" and not settings.reward_func:
        raise ConfigError(settings.source_name("reward_func"), "",
                          "must be set when PODAGENT_REWARD=func")


def _check_after_run(settings: Settings) -> None:
    if settings.after_run != AfterRun.STOP_POD:
        return
    when = f"when {settings.source_name('after_run')}=stop-pod"
    if not settings.runpod_api_key:
        raise ConfigError(RUNPOD_API_KEY, "",
                          f"must be set {when} (podagent stops this pod through RunPod's API)")
    if not settings.pod_id:
        raise ConfigError(settings.source_name("pod_id"), "",
                          f"must be set {when} (the id of the pod to stop; RunPod sets it)")


def settings_table() -> str:
    """The README's settings table, generated from FIELDS."""
    return markdown_table(FIELDS)


if __name__ == "__main__":
    print(settings_table())

"""Settings: built once (flags > environment > defaults) into one frozen object.

Each setting is declared once in FIELDS: its attribute, environment variable, flag, default,
parser and help. The CLI makes its options from the same table and the README's settings table
is generated from it (`python -m podagent.config`), so the three cannot drift apart.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from podagent.choices import AfterRun
from podagent.errors import ConfigError

# Variables whose values must never be shown or put on a command line.
SECRET_NAMES = frozenset(
    {"WANDB_API_KEY", "RAY_AUTH_TOKEN", "PODAGENT_TOKEN", "RUNPOD_API_KEY", "HF_TOKEN"}
)
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
    rule = "must be an http:// or https:// URL such as https://rest.runpod.io/v1"
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


def preset_name(raw: str) -> str:
    from podagent.platform import nccl  # late: nccl reads the preset files

    names = ("auto", *nccl.preset_names())
    if raw not in names:
        raise ValueError(f"must be one of {', '.join(names)}")
    return raw


def reward_scoring(raw: str) -> str:
    from podagent.rewards.settings import SCORING  # late: that module builds on this one

    return choice(*SCORING)(raw)


def reward_template(raw: str) -> str:
    from podagent.rewards.openrlhf_m import TEMPLATES

    return choice(*TEMPLATES)(raw)


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


# --- the table ----------------------------------------------------------------------------------

AFTER_RUN = tuple(policy.value for policy in AfterRun)
ON_NODE_LOSS = ("restart", "wait", "fail")


@dataclass(frozen=True)
class Field:
    attr: str
    env: str
    flag: str | None
    parse: Callable[[str], Any]
    help: str
    default: Any = None
    default_doc: str = ""
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
          "Worker nodes the head waits for.",
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
          "What podagent does when the run is over: stay (stay up idle until SIGTERM; RunPod "
          "would otherwise restart the container and run again), exit (exit with the run's "
          "outcome) or stop-pod (ask RunPod's API to stop this pod, which ends its GPU "
          "billing; needs RUNPOD_API_KEY).",
          default_doc="stay on RunPod (RUNPOD_POD_ID set), else exit"),
    Field("runpod_api_url", "PODAGENT_RUNPOD_API_URL", "--runpod-api-url", http_url,
          "Base URL of RunPod's REST API (for PODAGENT_AFTER_RUN=stop-pod).",
          default="https://rest.runpod.io/v1"),
    Field("nccl_preset", "PODAGENT_NCCL_PRESET", "--nccl-preset", preset_name,
          "NCCL preset from env/ (auto picks by evidence).", default="auto"),
    Field("run_name", "PODAGENT_RUN_NAME", "--run-name", run_name,
          "Name of this run: its log directory and the job's submission id. The default is "
          "the same after a container restart, so a restarted pod finds its run again.",
          default_doc="podagent-HEAD_POD_ID, else podagent-PRIMARY_ADDR-NUM_NODESn (Instant "
                      "Cluster), else podagent-RUNPOD_POD_ID, else podagent-YYYYmmdd-HHMMSS "
                      "(UTC, at start)"),
    Field("log_dir", "PODAGENT_LOG_DIR", "--log-dir", path,
          "Parent of the per-run log directories.",
          default_doc="/workspace/podagent/logs if /workspace exists, else ./podagent-logs"),
    Field("job", "PODAGENT_JOB", "--job", command_line,
          "Job entrypoint (a command line); `podagent head -- CMD ...` also sets it.",
          default_doc="the built-in cluster check"),
    Field("working_dir", "PODAGENT_WORKING_DIR", "--working-dir", directory,
          "Directory uploaded as the job's working dir."),
    Field("ray_temp_dir", "PODAGENT_RAY_TEMP_DIR", "--ray-temp-dir", short_path,
          "Ray's temp dir on this pod.", default_doc="Ray's default (/tmp/ray)"),
    Field("reward", "PODAGENT_REWARD", "--reward", choice("builtin", "none", "cmd"),
          "Reward server the head runs: builtin, none, or cmd (PODAGENT_REWARD_CMD).",
          default="builtin"),
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
          "item) or boxed (see Reward server).", default="openrlhf-m"),
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
          "Port of torch's c10d rendezvous on the head (`podagent torchrun`).", default=29500),
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


@dataclass(frozen=True)
class Settings:
    ray_worker: bool | None = None
    head_pod_id: str | None = None
    pod_id: str | None = None
    node_rank: int | None = None
    primary_addr: str | None = None
    num_nodes: int | None = None
    node_addr: str | None = None
    expected_workers: int = 0
    min_workers: int | None = None
    head_addr: str | None = None
    dns_suffix: str = "runpod.internal"
    dns_server: tuple[str, int] | None = None
    ray_port: int = 6379
    dashboard_port: int = 8265
    node_ip: str | None = None
    num_gpus: int | None = None
    worker_timeout: float = 600.0
    head_timeout: float = 600.0
    head_grace: float = 8.0
    rejoin: bool = True
    stop_timeout: float = 10.0
    after_run: str = AfterRun.EXIT.value
    on_node_loss: str = "restart"
    restarts: int = 3
    retry_failed_job: bool = False
    restart_backoff: float = 5.0
    runpod_api_url: str = "https://rest.runpod.io/v1"
    nccl_preset: str = "auto"
    run_name: str = "podagent"
    log_dir: str = "podagent-logs"
    job: tuple[str, ...] | None = None
    working_dir: str | None = None
    ray_temp_dir: str | None = None
    reward: str = "builtin"
    reward_cmd: tuple[str, ...] | None = None
    reward_port: int = 5000
    reward_timeout: float = 600.0
    reward_restarts: int = 3
    reward_scoring: str = "openrlhf-m"
    reward_template: str = "chatml"
    reward_strict: bool = False
    debug_ray: bool = False
    checkpoint_dir: str | None = None
    resume: str = "auto"
    resume_flag: tuple[str, ...] = ("--load_checkpoint",)
    rendezvous_port: int = 29500
    log_format: str = "text"
    quiet: bool = False
    listen: str = "private"
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
        """RUNPOD_API_KEY (for PODAGENT_AFTER_RUN=stop-pod). Never a flag, never shown."""
        return self.environ.get(RUNPOD_API_KEY, "").strip() or None

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
    values.setdefault("after_run", AfterRun.default(on_runpod=bool(values.get("pod_id"))).value)
    restarts = values.get("restarts", FIELD_BY_ATTR["restarts"].default)
    values.setdefault("on_node_loss", "restart" if restarts else "fail")
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
    "PODAGENT_UP_RUN": "set by `podagent up` on the pods it creates: the run they belong to "
                       "(how `podagent down` finds them)",
    RAY_OWNER: "set by podagent on every Ray it starts (and so on that Ray's jobs): its mark",
})


def known_variables() -> frozenset[str]:
    """Every variable podagent reads or sets: FIELDS, the reward server's table, the rest."""
    from podagent.rewards.settings import FIELDS as REWARD_FIELDS  # late: it builds on this

    return frozenset({f.env for f in FIELDS} | {f.env for f in REWARD_FIELDS}
                     | set(OTHER_VARIABLES) | set(TOKEN_VARIABLES))


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
        if not name.startswith(PREFIX) or name in known or not str(environ[name]).strip():
            continue
        close = difflib.get_close_matches(name.removeprefix(PREFIX), list(by_stem), n=1)
        hint = f"; did you mean {by_stem[close[0]]}?" if close else ""
        warnings.append(f"{_shown_name(name)} is not a podagent setting{hint} (ignored)")
    return warnings


RUNPOD_API_KEY = "RUNPOD_API_KEY"  # RunPod's own name; a secret, read from the environment
TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "PODAGENT_TOKEN")
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"  # Ray's own: a file that holds the token
TOKEN_RULE = "at least 16 printable characters without spaces (`podagent token` makes one)"

# Which child gets which secret (docs/secrets.md). RUNPOD_API_KEY is podagent's alone (it stops
# the pod); Ray and the job keep every other one (the job's W&B key, the cluster token Ray
# needs); a reward server never talks to Ray, so never gets the cluster token, and the built-in
# one, which runs sympy on model output, gets no secret at all.
ONLY_PODAGENTS = (RUNPOD_API_KEY,)
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


def _check_token(s: Settings) -> None:
    # Values are never shown: the message names the variable and the rule only.
    given = {n: s.environ[n].strip() for n in TOKEN_VARIABLES if s.environ.get(n, "").strip()}
    for name, value in given.items():
        if not _valid_token(value):
            raise ConfigError(name, REDACTED_VALUE, f"must be {TOKEN_RULE}")
    if len(set(given.values())) > 1:
        raise ConfigError("PODAGENT_TOKEN", REDACTED_VALUE,
                          "must equal RAY_AUTH_TOKEN when both are set")
    if s.token_from_file and given and s.token_from_file not in given.values():
        raise ConfigError(TOKEN_PATH_VARIABLE, s.environ[TOKEN_PATH_VARIABLE].strip(),
                          f"must name a file holding the same token as {', '.join(given)} "
                          f"when both are set")


def _check_relations(s: Settings) -> None:
    if s.min_workers is not None and s.min_workers > s.expected_workers:
        raise ConfigError(
            s.source_name("min_workers"), str(s.min_workers),
            f"must be <= EXPECTED_WORKERS ({s.expected_workers})",
        )
    ports = {"ray_port": s.ray_port, "dashboard_port": s.dashboard_port}
    if s.reward != "none":
        ports["reward_port"] = s.reward_port
    seen: dict[int, str] = {}
    for attr, number in ports.items():
        if number in seen:
            raise ConfigError(s.source_name(attr), str(number),
                              f"must differ from {FIELD_BY_ATTR[seen[number]].env}")
        seen[number] = attr
    if s.reward == "cmd" and not s.reward_cmd:
        raise ConfigError(s.source_name("reward_cmd"), "",
                          "must be set when PODAGENT_REWARD=cmd")


def _check_after_run(s: Settings) -> None:
    if s.after_run != AfterRun.STOP_POD:
        return
    when = f"when {s.source_name('after_run')}=stop-pod"
    if not s.runpod_api_key:
        raise ConfigError(RUNPOD_API_KEY, "",
                          f"must be set {when} (podagent stops this pod through RunPod's API)")
    if not s.pod_id:
        raise ConfigError(s.source_name("pod_id"), "",
                          f"must be set {when} (the id of the pod to stop; RunPod sets it)")


def settings_table() -> str:
    """The README's settings table, generated from FIELDS."""
    return markdown_table(FIELDS)


assert {f.attr for f in FIELDS} <= {f.name for f in fields(Settings)}

if __name__ == "__main__":
    print(settings_table())

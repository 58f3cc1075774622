"""The settings' declarations, each setting once: the reward server's as RewardFields of
REWARD_FIELDS (its PODAGENT_REWARD_* variables, which it reads when it runs alone as `python -m
podagent.rewards`); podagent's as Fields of FIELDS (attribute, variable, flag, parser, default,
help), where the server's settings that the head forwards to it are made from REWARD_FIELDS by
reward_setting(); the frozen Settings class made from FIELDS; the Markdown tables the README
embeds.

The CLI makes its options from the same tables, so none of these can drift apart. The reward
server's table is here, not in podagent.rewards, so that podagent can name a misspelt
PODAGENT_REWARD_* variable without importing the reward server.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from podagent.choices import (
    LAUNCHERS,
    PROMPT_TEMPLATES,
    RAY_LAUNCHER,
    REWARD_KINDS,
    SCORING,
    AfterRun,
    OnNodeLoss,
    one_of,
)
from podagent.config.parsers import (
    choice,
    command_line,
    directory,
    dns_suffix,
    existing_file,
    gpu_name,
    host,
    host_port,
    http_url,
    ipv4,
    key,
    moment,
    named,
    number,
    path,
    pod_id,
    port,
    preset_name,
    reward_func_file,
    run_name,
    seconds,
    seconds_or_zero,
    short_path,
    size,
    whole,
    zero_one,
)
from podagent.config.policy import TOKEN_VARIABLES, runpod_key
from podagent.trainers import TRAINER_BY_NAME, Profile

RUNPOD_API_URL = "RUNPOD_API_URL"  # the one setting for RunPod's API (on a pod and for `up`)

# --- the reward server's table (`podagent reward-server`, PODAGENT_REWARD_*) --------------------

REWARD_ENV_PREFIX = "PODAGENT_REWARD_"
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

REWARD_FIELD_BY_ATTR = {f.attr: f for f in REWARD_FIELDS}
# The reward server's settings its --help shows (the rest: `podagent help settings
# reward-server`).
REWARD_FIRST = ("scoring", "func", "dataset", "host", "port")


# --- podagent's table ---------------------------------------------------------------------------

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
    # The reward server's setting this field is (reward_setting made it): the head forwards
    # the value to the server by this field's variable.
    server: RewardField | None = None
    group: str = ""  # the name of its group in GROUPS (`_in` sets it)


def reward_setting(attr: str, help: str) -> Field:
    """The head's field for the reward server's setting `attr`, which the head forwards: the
    server's variable, parser and default, declared once in REWARD_FIELDS; on the head its
    attribute is reward_ATTR, its flag --reward-ATTR, and its help says what it is there."""
    server = REWARD_FIELD_BY_ATTR[attr]
    return Field("reward_" + attr, server.env, "--reward-" + attr.replace("_", "-"),
                 server.parse, help, default=server.default, default_doc=server.default_doc,
                 server=server)


@dataclass(frozen=True)
class Group:
    """Settings that belong together: what `podagent help settings NAME` lists, and one table
    of docs/settings.md."""
    name: str
    title: str


GROUPS: tuple[Group, ...] = (
    Group("roles", "Roles and discovery"),
    Group("ray", "Ray and the pod's network"),
    Group("run", "The run and its job"),
    Group("restarts", "Restarts and checkpoints"),
    Group("reward", "The reward server"),
    Group("output", "Output"),
)
GROUP_BY_NAME = {group.name: group for group in GROUPS}
# `podagent help settings reward-server`: the settings of `podagent reward-server` itself (on
# the head, those it takes too are in the reward group: reward_setting()).
REWARD_SERVER_GROUP = Group("reward-server", "`podagent reward-server` itself")
# The settings a first run needs: what `podagent --help` shows (the rest: `podagent help
# settings`).
FIRST_RUN = ("head_pod_id", "expected_workers", "job", "checkpoint_dir", "reward")


def _in(group: str, *fields: Field) -> tuple[Field, ...]:
    return tuple(dataclasses.replace(field, group=GROUP_BY_NAME[group].name) for field in fields)


FIELDS: tuple[Field, ...] = (
    *_in("roles",  # the seed's and RunPod's own names stay as they are
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
        Field("worker_timeout", "PODAGENT_WORKER_TIMEOUT", "--worker-timeout", seconds,
              "Seconds the head waits for the expected workers.", default=600.0),
        Field("head_timeout", "PODAGENT_HEAD_TIMEOUT", "--head-timeout", seconds,
              "Seconds a worker waits to find the head and join it.", default=600.0),
        Field("head_grace", "PODAGENT_HEAD_GRACE", "--head-grace", seconds,
              "Seconds a joined worker tolerates an unreachable head before it leaves (a head "
              "whose Ray still takes connections but is slow to answer, a loaded pod, is "
              "waited for up to 60 s, or this long if longer).",
              default=8.0),
        Field("rejoin", "PODAGENT_REJOIN", "--rejoin", zero_one,
              "1: a worker whose head is gone goes back to finding it (a restarted head is joined "
              "again) instead of exiting; 0: it exits.", default=True),
    ),
    *_in("ray",
        Field("ray_port", "PODAGENT_RAY_PORT", "--ray-port", port,
              "Ray GCS port on the head.", default=6379),
        Field("dashboard_port", "PODAGENT_DASHBOARD_PORT", "--dashboard-port", port,
              "Ray dashboard and Jobs API port on the head.", default=8265),
        Field("node_ip", "PODAGENT_NODE_IP", "--node-ip", ipv4,
              "This pod's cluster-private address.",
              default_doc="detected (NODE_ADDR, the preset's interface, the route to the head)"),
        Field("num_gpus", "PODAGENT_NUM_GPUS", "--num-gpus", whole(0, 1024),
              "GPUs this node offers to Ray.", default_doc="detected"),
        Field("gpu_check", "PODAGENT_GPU_CHECK", "--gpu-check", choice("full", "smi", "off"),
              "Before the job, this pod's GPUs are checked (a pod with GPUs only): smi: "
              "nvidia-smi's facts (as many GPUs as RUNPOD_GPU_COUNT, of PODAGENT_GPU_TYPE, no "
              "uncorrected ECC error, no page retirement or row remapping pending or failed); "
              "full: also each GPU's BF16 matmul (PODAGENT_GPU_MIN_SPEED) and an all-reduce "
              "across the pod's GPUs; off. A pod that fails exits 28 and stops.",
              default="full"),
        Field("gpu_type", "PODAGENT_GPU_TYPE", "--gpu-type", gpu_name,
              "The GPU type this pod must have, as nvidia-smi names it (RunPod's GPU type id); "
              "`podagent up` sets it.", default="", default_doc="any"),
        Field("gpu_min_speed", "PODAGENT_GPU_MIN_SPEED", "--gpu-min-speed", number(0.0, 1.0),
              "PODAGENT_GPU_CHECK=full: the least fraction of its type's rated dense BF16 "
              "throughput a GPU's matmul must reach (a GPU of a type podagent has no rating "
              "for is compared with its siblings: 0.75 of their median).", default=0.5),
        Field("nccl_preset", "PODAGENT_NCCL_PRESET", "--nccl-preset", preset_name,
              "NCCL preset from env/ (auto picks by evidence).", default="auto"),
        Field("ray_temp_dir", "PODAGENT_RAY_TEMP_DIR", "--ray-temp-dir", short_path,
              "Ray's temp dir on this pod.", default_doc="Ray's default (/tmp/ray)"),
        Field("debug_ray", "DEBUG_RAY", "--debug-ray", zero_one,
              "1 starts Ray with RAY_DEBUG=legacy and --ray-debugger-external.", default=False),
        Field("listen", "PODAGENT_LISTEN", "--listen", choice("private", "all"),
              "Where the head's dashboard (Jobs API) and reward server listen: private (this "
              "pod's cluster address) or all (0.0.0.0: every interface; use a cluster token).",
              default="private"),
    ),
    *_in("run",
        Field("run_name", "PODAGENT_RUN_NAME", "--run-name", run_name,
              "Name of this run: its log directory and the job's submission id. The default is "
              "the same after a container restart, so a restarted pod finds its run again.",
              default="podagent",
              default_doc="podagent-HEAD_POD_ID, else podagent-PRIMARY_ADDR-NUM_NODESn (Instant "
                          "Cluster), else podagent-RUNPOD_POD_ID, else podagent-YYYYmmdd-HHMMSS "
                          "(UTC, at start)"),
        Field("log_dir", "PODAGENT_LOG_DIR", "--log-dir", path,
              "Parent of the per-run log directories; each pod writes in <run>/<its pod id>/ "
              "(its host name off RunPod), so pods sharing one volume never collide.",
              default="podagent-logs",
              default_doc="/workspace/podagent/logs if /workspace exists, else ./podagent-logs"),
        Field("job", "PODAGENT_JOB", "--job", command_line,
              "Job entrypoint (a command line); `podagent head -- CMD ...` also sets it. With "
              "PODAGENT_LAUNCHER=torchrun or accelerate: the launcher's [OPTIONS] [--] SCRIPT "
              "ARGS.",
              default_doc="the built-in cluster check"),
        Field("launcher", "PODAGENT_LAUNCHER", "--launcher", choice(*LAUNCHERS),
              "What runs the job when `podagent` runs with no command: ray (a Ray cluster, the job "
              "submitted to it), or torchrun / accelerate on every pod without Ray, as `podagent "
              "torchrun` does (what `podagent up --launcher` sets).", default=RAY_LAUNCHER),
        Field("working_dir", "PODAGENT_WORKING_DIR", "--working-dir", directory,
              "Directory uploaded as the job's working dir."),
        Field("stop_timeout", "PODAGENT_STOP_TIMEOUT", "--stop-timeout", seconds,
              "Seconds a child gets after SIGTERM before SIGKILL; left unset, a training "
              "without Ray that a lost pod or a hang ends gets at most 3 s.", default=10.0),
        Field("after_run", "PODAGENT_AFTER_RUN", "--after-run", named(AfterRun),
              "What podagent does when the run is over, or after an exit a new start cannot mend "
              "(bad input, a refused token, restarts used up, a crash loop): "
              + one_of([f"{policy} ({policy.meaning})" for policy in AfterRun]) + ".",
              default=AfterRun.EXIT,
              default_doc="stop-pod on RunPod (RUNPOD_POD_ID and its RUNPOD_API_KEY set; stay "
                          "without the key), else exit"),
        Field("runpod_api_url", RUNPOD_API_URL, "--runpod-api-url", http_url,
              "Base URL of RunPod's REST API v2 (paths /v2/... follow it), for a pod stopping "
              "itself and for `podagent up/down/ls`.", default="https://api.runpod.io"),
        Field("over_linger", "PODAGENT_OVER_LINGER", "--over-linger", seconds_or_zero,
              "Seconds a head whose run is over stays to tell workers that did not leave with it "
              "(their containers were being started again) that the run is over, before its "
              "pod stops; 0: no wait.", default=120.0),
        Field("rendezvous_port", "PODAGENT_RENDEZVOUS_PORT", "--rendezvous-port", port,
              "Port of torch's rendezvous on the head (`podagent torchrun`; accelerate's main "
              "process port with `podagent accelerate`).", default=29500),
        Field("supervisor_port", "PODAGENT_SUPERVISOR_PORT", "--supervisor-port", port,
              "Port of the head's podagent in a run without Ray (`podagent torchrun/accelerate`): "
              "podagent's own rendezvous, heartbeats, status, stop and logs.", default=29510),
        Field("peer_grace", "PODAGENT_PEER_GRACE", "--peer-grace", seconds,
              "Seconds a run without Ray tolerates a silent pod (heartbeats every second) before "
              "it stops the training on every pod.", default=5.0),
    ),
    *_in("restarts",
        Field("on_node_loss", "PODAGENT_ON_NODE_LOSS", "--on-node-loss", named(OnNodeLoss),
              "What the head does when a node of the running job is lost: restart (stop the job at "
              "once, wait until the cluster is whole again, a replacement pod counting, and submit "
              "it again resuming from the newest checkpoint), wait (leave the job to decide; if it "
              "fails, restart it as above) or fail (leave the job to decide, never restart).",
              default=OnNodeLoss.RESTART,
              default_doc="restart when PODAGENT_RESTARTS > 0, else fail"),
        Field("restarts", "PODAGENT_RESTARTS", "--restarts", whole(0, 1000),
              "How many times a run may be restarted after a lost node, a hang "
              "(PODAGENT_HANG_TIMEOUT) or a failed job with PODAGENT_RETRY_FAILED_JOB=1; then the "
              "run ends with exit code 16 (25 after a hang).", default=3),
        Field("retry_failed_job", "PODAGENT_RETRY_FAILED_JOB", "--retry-failed-job", zero_one,
              "1: a job that fails with no node lost is restarted too (within PODAGENT_RESTARTS).",
              default=False),
        Field("restart_backoff", "PODAGENT_RESTART_BACKOFF", "--restart-backoff", seconds_or_zero,
              "Seconds before the first restart's submission, doubled for each later one (at most "
              "300 s); the wait for the cluster runs meanwhile.", default=5.0),
        Field("hang_timeout", "PODAGENT_HANG_TIMEOUT", "--hang-timeout", seconds_or_zero,
              "Seconds the run may go without progress (a new line of the job's output on any "
              "pod, a new or updated checkpoint, or a heartbeat: PODAGENT_HEARTBEAT) before "
              "podagent dumps every rank's stack, names the rank that is not in a collective, "
              "and stops the run, restarting it from its checkpoint within PODAGENT_RESTARTS "
              "(else exit 25); 0: no watch. The default is above a healthy trainer's longest "
              "silence (a large checkpoint save, a long rollout) and far below NCCL's timeout.",
              default=1800.0),
        Field("replacements", "PODAGENT_REPLACEMENTS", "--replacements", whole(0, 100),
              "The head of a detached `podagent up` run (which sets it): how many worker pods "
              "RunPod loses it replaces itself (terminated, and one of the same spec created "
              "under the name), with the account key PODAGENT_RUNPOD_API_KEY; 0: none.",
              default=0),
        Field("deadline", "PODAGENT_DEADLINE", "--deadline", moment,
              "When the run must be over (Unix seconds, or ISO 8601 with its zone: "
              "2026-11-30T12:00:00Z): then the head stops the job (SIGTERM, "
              "PODAGENT_STOP_TIMEOUT to checkpoint), ends the run on every pod and exits 27; a "
              "start after it ends at once. `podagent up --max-duration/--max-cost` sets it.",
              default_doc="none"),
        Field("checkpoint_dir", "PODAGENT_CHECKPOINT_DIR", "--checkpoint-dir", path,
              "Directory the job writes checkpoints to; podagent checks its free space and "
              "resumes from it (PODAGENT_RESUME).",
              default_doc="the job's own (--ckpt.path, --ckpt_path, trainer.default_local_dir), "
                          "else /workspace/checkpoints if /workspace exists, else unset"),
        Field("resume", "PODAGENT_RESUME", "--resume", choice("auto", "never"),
              "auto: every start of the job (the first, a restart, a restarted container's) "
              "while PODAGENT_CHECKPOINT_DIR holds a checkpoint gets PODAGENT_RESUME_FLAG, "
              "inside a bash -c command too; never: it does not.", default="auto"),
        Field("resume_flag", "PODAGENT_RESUME_FLAG", "--resume-flag", command_line,
              "Arguments the job gets to resume from a checkpoint (a Ray job's, or the "
              "script torchrun/accelerate runs); set it for a script that resumes only when "
              "told.",
              default=TRAINER_BY_NAME["script"].resume,
              default_doc="the job's trainer's: --ckpt.load_enable (OpenRLHF 0.10.2 or newer), "
                          "--load_checkpoint (older OpenRLHF, OpenRLHF-M, a Ray job of your "
                          "own), none (verl, and a script of your own under torchrun or "
                          "accelerate: they resume by themselves)"),
    ),
    *_in("reward",
        Field("reward", "PODAGENT_REWARD", "--reward", choice(*REWARD_KINDS),
              "Reward server the head runs: builtin (scoring by PODAGENT_REWARD_SCORING), func "
              "(the built-in server serving PODAGENT_REWARD_FUNC), cmd (PODAGENT_REWARD_CMD) or "
              "none.", default="builtin"),
        reward_setting("func", "PODAGENT_REWARD=func: a Python file defining reward_func(queries, "
                       "prompts, labels) as upstream OpenRLHF's --remote_rm_url takes; served "
                       "with pooled CPUs and a per-item timeout."),
        Field("reward_cmd", "PODAGENT_REWARD_CMD", "--reward-cmd", command_line,
              "Reward server command line for PODAGENT_REWARD=cmd (split without a shell); it "
              "must listen on PODAGENT_REWARD_HOST:PODAGENT_REWARD_PORT, which podagent sets."),
        reward_setting("port", "Reward server port on the head."),
        Field("reward_timeout", "PODAGENT_REWARD_TIMEOUT", "--reward-timeout", seconds,
              "Seconds the reward server gets to answer a real request at start.", default=600.0),
        Field("reward_restarts", "PODAGENT_REWARD_RESTARTS", "--reward-restarts", whole(0, 100),
              "Restarts of a reward server that dies or stops answering during the job.",
              default=3),
        reward_setting("scoring", "Built-in reward server's scoring: openrlhf-m (OpenRLHF-M's "
                       "reward server, item for item), boxed or openrlhf-boxed (upstream "
                       "OpenRLHF's math reward function); see Reward server."),
        reward_setting("template", "openrlhf-m: the chat template of the trainer's queries "
                       "(chatml, qwen1 or base, as OpenRLHF-M's --prompt-template)."),
        reward_setting("strict", "openrlhf-m: 1 scores an unparseable gold answer accuracy 0 "
                       "instead of OpenRLHF-M's 1."),
    ),
    *_in("output",
        Field("log_format", "PODAGENT_LOG_FORMAT", "--log-format", choice("text", "json"),
              "Screen output: text, or json (one object per line, for log collectors); the pod's "
              "log file stays text.", default="text"),
        Field("quiet", "PODAGENT_QUIET", "--quiet", zero_one,
              "Show only warnings, errors and the job's own output (the variable: 1).",
              default=False, is_flag=True),
    ),
)

FIELD_BY_ATTR = {f.attr: f for f in FIELDS}


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


def path_component(name: str) -> str:
    """`name` as one safe directory name: letters, digits, `.`, `_` and `-`, at most 63, never
    `.` or `..` (a pod id always is such a name; a host name nearly always)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:63].strip(".") or "pod"
    return safe


# The sources of a derived run name (build derives it; Settings.run_name_shared reads them).
RUN_NAME_FROM_HEAD_POD_ID = "derived from HEAD_POD_ID"
RUN_NAME_FROM_PRIMARY_ADDR = "derived from PRIMARY_ADDR/NUM_NODES"
RUN_NAME_FROM_POD_ID = "derived from RUNPOD_POD_ID"


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
    # The job's trainer and what its command line names (trainers.py); None without a job.
    profile: Profile | None = None

    @property
    def pod_name(self) -> str:
        """This pod as podagent names it: its RunPod pod id, else its host name."""
        return self.pod_id or socket.gethostname()

    @property
    def pod_dir_name(self) -> str:
        """This pod's directory under the run's: its name made a safe path component."""
        return path_component(self.pod_name)

    @property
    def run_dir(self) -> Path:
        """This pod's own directory of the run, under the run's: pods that share a volume (one
        network volume on every pod) never write each other's ledger, logs, events or temp
        files. Only what is meant to be shared (the checkpoints) is shared."""
        return Path(self.log_dir) / self.run_name / self.pod_dir_name

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


def default_text(f: Any) -> str:
    """A field's default as the docs and the help say it ("" when it has none)."""
    if f.default_doc:
        return str(f.default_doc)
    if isinstance(f.default, bool):
        return str(int(f.default))
    if isinstance(f.default, float):
        return f"{f.default:g}"
    if isinstance(f.default, tuple):
        return " ".join(f.default)
    return "" if f.default is None else str(f.default)


def markdown_table(table: Iterable[Any]) -> str:
    """flag | variable | default | meaning, one row per field (for the docs)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for f in table:
        rows.append(f"| `{f.flag}` | `{f.env}` | {default_text(f) or '—'} | {f.help} |")
    return "\n".join(rows)



def first_run_table() -> str:
    """The README's table: the settings a first run needs (FIRST_RUN)."""
    return markdown_table(FIELD_BY_ATTR[attr] for attr in FIRST_RUN)


def settings_page() -> str:
    """docs/settings.md's tables, one per group, generated from FIELDS."""
    parts = []
    for group in GROUPS:
        parts.append(f"## {group.title}\n\n`podagent help settings {group.name}`\n\n"
                     + markdown_table(f for f in FIELDS if f.group == group.name))
    return "\n\n".join(parts)

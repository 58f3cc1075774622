"""A run's shape as `podagent up` takes it (UpSpec, frozen, checked once) and what RunPod is
asked to create for it: pure functions from the spec to RunPod's create bodies.

Names are facts that `up`, `down` and `ls` share: a run's pods are `podagent-RUN-head` and
`podagent-RUN-w1`…, its cluster `podagent-RUN`, and each pod carries PODAGENT_UP_RUN=RUN, so
a run's pods are found again from RunPod's own list even when the local state is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podagent.choices import LAUNCHERS, RAY_LAUNCHER, AfterRun
from podagent.config.fields import FIELD_BY_ATTR, RUNPOD_API_URL
from podagent.config.names import UP_RUN_LABEL
from podagent.config.parsers import duration, http_url, moment, run_name
from podagent.config.policy import RUNPOD_ACCOUNT_KEY, is_secret
from podagent.errors import ConfigError, InputError
from podagent.launch.options import default, flag

PREFIX = "podagent"
LABEL = UP_RUN_LABEL  # the env label every pod of a run carries
HEAD_NAME, WORKER_NAME = "head", "w"
VOLUME_PATH = "/workspace"  # where RunPod mounts the volume: podagent's logs and checkpoints
CLOUDS = ("SECURE", "COMMUNITY")
MAX_PODS = 250  # RunPod's cluster maximum (ClusterCompute.podCount)
# RunPod's secret reference, written into an env value: {{ RUNPOD_SECRET_<name> }}.
_SECRET_REF = re.compile(r"\{\{\s*RUNPOD_SECRET_[A-Za-z0-9_.-]+\s*\}\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A container image reference (the distribution project's grammar, simplified only in that a
# registry host's characters are not checked one by one): [host[:port]/]path[:tag][@digest].
_IMAGE = re.compile(
    r"(?:(?P<host>[a-zA-Z0-9.-]+(?::[0-9]+)?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}))?")
# What podagent on the pods is told by `up` itself: a user's -e may not set these.
DEADLINE = FIELD_BY_ATTR["deadline"].env  # --max-duration/--max-cost, as the pods hold them
GPU_TYPE = FIELD_BY_ATTR["gpu_type"].env
REPLACEMENTS_VARIABLE = FIELD_BY_ATTR["replacements"].env
OWN_VARIABLES = ("PODAGENT_RUN_NAME", "EXPECTED_WORKERS", "PODAGENT_JOB", "HEAD_POD_ID",
                 "RAY_WORKER", "PODAGENT_LOG_FORMAT", "PODAGENT_AFTER_RUN", "PODAGENT_LAUNCHER",
                 DEADLINE, LABEL, RUNPOD_API_URL, REPLACEMENTS_VARIABLE)
# The one variable a run's pods may be given an account key in (--secret NAME=SECRET only):
# the head then terminates every pod of the run at its end.
ACCOUNT_KEY = RUNPOD_ACCOUNT_KEY


def pod_name(run: str, rank: int) -> str:
    return f"{PREFIX}-{run}-{HEAD_NAME if rank == 0 else f'{WORKER_NAME}{rank}'}"


def cluster_name(run: str) -> str:
    return f"{PREFIX}-{run}"


def belongs(pod: Mapping[str, Any], run: str) -> bool:
    """Is this pod (RunPod's JSON) one of the run's? By its label, or by its exact name."""
    if (pod.get("env") or {}).get(LABEL) == run:
        return True
    own = rf"{re.escape(PREFIX)}-{re.escape(run)}-(?:{HEAD_NAME}|{WORKER_NAME}[1-9][0-9]*)"
    return re.fullmatch(own, str(pod.get("name"))) is not None


def run_of(pod: Mapping[str, Any]) -> str | None:
    """The run a pod belongs to, from its label (None: not a pod `up` created)."""
    return (pod.get("env") or {}).get(LABEL)


def default_state_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                          "state")
    return Path(base) / "podagent" / "runs"


REPLACEMENTS = 3  # lost pods `up` replaces in a run when --replacements is not given
# The network volume `up` creates for a run of several pods (RunPod's CreateNetworkVolumeRequest:
# size 10 to 4096 GB; storage/network-volumes.mdx: $0.07 per GB and month for the first TB,
# $0.05 beyond).
SHARED_MIN, SHARED_MAX, SHARED_DEFAULT = 10, 4096, 100
CHECKPOINT_BYTES, CHECKPOINTS_KEPT = 14, 3  # OpenRLHF keeps 3 (--max_ckpt_num)
FIRST_TB_RATE, BEYOND_RATE = 0.07, 0.05  # $ per GB and month


def volume_price(gb: int) -> float:
    """What a network volume of `gb` costs a month at RunPod's published rate."""
    return min(gb, 1000) * FIRST_TB_RATE + max(0, gb - 1000) * BEYOND_RATE


def volume_name(run: str) -> str:
    """Never a name of the run's pods or cluster (`podagent-RUN`): the record tells them apart
    by kind and name, RunPod's lists by name."""
    return f"{PREFIX}-{run}-volume"


@dataclass(frozen=True)
class UpSpec:
    """A run's shape as `podagent up` was asked for it, checked once."""

    run: str
    gpu_type: str
    gpus_per_pod: int
    pods: int  # the head included
    image: str | None = None
    template: str | None = None
    cluster: bool = False
    cloud: str = "SECURE"
    data_centers: tuple[str, ...] = ()
    volume_gb: int | None = None  # a persistent volume of the pod at /workspace
    network_volume: str | None = None  # or a network volume's id, mounted at /workspace
    # The size of the network volume `up` creates for the run (None: none is created): the
    # run's results outlive its pods (create.Creator._volume).
    shared_volume_gb: int | None = None
    disk_gb: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    job: tuple[str, ...] = ()
    launcher: str = RAY_LAUNCHER  # what runs the job on the pods (PODAGENT_LAUNCHER)
    keep: bool = False
    detach: bool = False  # leave once the pods run: they stop themselves at the run's end
    registry_auth: str | None = None  # a registry credential's id or name (a private image)
    max_duration: float | None = None  # seconds from the run's creation (--max-duration)
    max_cost: float | None = None  # USD at RunPod's list price (--max-cost)
    deadline: float | None = None  # Unix seconds: the two above from the creation (capped())
    replacements: int = REPLACEMENTS  # lost pods replaced (up.Up._replace, _recreate)
    timeout: float = 900.0  # every pod RUNNING within this
    api_url: str = ""
    api_timeout: float = 60.0  # one API call, its retries included
    state_dir: Path = field(default_factory=lambda: default_state_dir(os.environ))

    @property
    def workers(self) -> int:
        return self.pods - 1

    def names(self) -> list[str]:
        return [pod_name(self.run, rank) for rank in range(self.pods)]

    def shape(self) -> str:
        how = "an Instant Cluster" if self.cluster else "Global Networking pods"
        return f"{self.pods} x {self.gpus_per_pod} {self.gpu_type} ({how})"

    def to_record(self) -> dict[str, Any]:
        """What the run's local record keeps of the spec, so that `podagent up --name RUN`
        alone re-attaches to it (no secret: secrets are RunPod references)."""
        kept = {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("state_dir", "api_url", "api_timeout", "detach")}
        kept["env"] = [list(pair) for pair in self.env]
        return kept

    @classmethod
    def from_record(cls, data: dict[str, Any], *, api_url: str, api_timeout: float,
                    state_dir: Path, timeout: float | None = None) -> UpSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in data.items() if k in fields}
        given.update(env=tuple(tuple(pair) for pair in given.get("env", ())),
                     job=tuple(given.get("job", ())),
                     data_centers=tuple(given.get("data_centers", ())),
                     api_url=api_url, api_timeout=api_timeout, state_dir=state_dir)
        if timeout is not None:
            given["timeout"] = timeout
        return cls(**given)


@dataclass(frozen=True)
class Placement:
    """What CHECKING resolved against RunPod's catalogs: the GPU type's catalog id, the data
    centers to allow, and the registry credential's id (a private image)."""
    gpu_id: str
    data_centers: tuple[str, ...] = ()
    registry: str | None = None


def _fail(name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(name, value, rule)


def default_run_name() -> str:
    return time.strftime("up-%Y%m%d-%H%M%S")


def build(*, run: str | None, gpu_type: str, gpus_per_pod: int, pods: int, image: str | None,
          template: str | None, cluster: bool, cloud: str, data_centers: tuple[str, ...],
          volume_gb: int | None, network_volume: str | None, disk_gb: int | None,
          env: tuple[str, ...], secrets: tuple[str, ...], job: tuple[str, ...], keep: bool,
          timeout: float, api_url: str, state_dir: Path | None,
          api_timeout: float = default("api_timeout"), detach: bool = default("detach"),
          registry_auth: str | None = default("registry_auth"),
          launcher: str = default("launcher"), max_duration: str | None = None,
          max_cost: float | None = None,
          replacements: int | None = None, shared_volume_gb: int | None = None,
          no_shared_volume: bool = False) -> UpSpec:
    """The spec from the command line (options.UP_OPTIONS), or one line naming the flag, the
    value and the rule that is broken (ConfigError)."""
    run = run or default_run_name()
    try:
        run_name(run)
    except ValueError as exc:
        raise _fail(flag("run"), run, str(exc)) from None
    if pods < 1:
        raise _fail(flag("pods"), pods, "must be at least 1 (the head; the rest are workers)")
    if pods > MAX_PODS:
        raise _fail(flag("pods"), pods, f"must be at most {MAX_PODS} (RunPod's limit)")
    if cluster and pods < 2:
        raise _fail(flag("pods"), pods, "must be at least 2 with --cluster (an Instant Cluster "
                                        "has 2 to 250 pods)")
    if gpus_per_pod < 1:
        raise _fail(flag("gpus_per_pod"), gpus_per_pod, "must be at least 1 (GPUs per pod)")
    if not gpu_type.strip():
        raise _fail(flag("gpu_type"), gpu_type, "must name a RunPod GPU type, e.g. 'NVIDIA "
                                                "H100 80GB HBM3' (see `podagent up "
                                                "--list-gpus`)")
    if bool(image) == bool(template):
        raise InputError("give exactly one of --image IMAGE or --template TEMPLATE_ID "
                          "(the image podagent runs in, on every pod)")
    if image and (len(image) > 255 or not _IMAGE.fullmatch(image)):
        raise _fail(flag("image"), image, "is not a container image reference such as "
                                          "registry.example.com/team/trainer:1.2 (lowercase "
                                          "name, optional :tag or @sha256:digest)")
    if template and cluster:
        raise _fail(flag("template"), template, "cannot be used with --cluster: RunPod's cluster "
                                                "create takes an image, not a template")
    if cloud.upper() not in CLOUDS:
        raise _fail(flag("cloud"), cloud, f"must be one of {', '.join(CLOUDS)}")
    if cloud.upper() != "SECURE":
        # RunPod's document (CreatePodRequest.globalNetworking) and runpodctl's page: Global
        # Networking is Secure Cloud only; an Instant Cluster is Secure Cloud too.
        raise _fail(flag("cloud"), cloud, "cannot be used: a run's pods reach each other over "
                                          "RunPod's Global Networking or an Instant Cluster, both "
                                          "Secure Cloud only (--cloud SECURE)")
    if registry_auth is not None and not registry_auth.strip():
        raise _fail(flag("registry_auth"), registry_auth, "must name a registry credential (its "
                                                          "id or name at RunPod)")
    if registry_auth and cluster:
        raise InputError("--registry-auth cannot be used with --cluster: RunPod's cluster "
                         "create takes no registry credential (private images are not yet "
                         "supported for clusters); use pods (no --cluster), or a public image")
    if launcher not in LAUNCHERS:
        raise _fail(flag("launcher"), launcher, f"must be one of {', '.join(LAUNCHERS)}")
    if launcher != RAY_LAUNCHER and not job:
        raise InputError(f"--launcher {launcher} needs the training script: podagent up ... "
                         f"--launcher {launcher} -- [{launcher.upper()} OPTIONS] [--] SCRIPT "
                         f"ARGS")
    if detach and keep:
        raise InputError("give at most one of --detach and --keep (a detached run's pods stop "
                         "themselves at its end; --keep leaves them running)")
    if volume_gb is not None and volume_gb < 10:
        raise _fail(flag("volume_gb"), volume_gb, "must be at least 10 (GB; RunPod's floor)")
    if volume_gb is not None and network_volume:
        raise InputError("give at most one of --volume GB and --network-volume ID (RunPod "
                          "mounts one volume at /workspace)")
    shared = _shared_volume(pods, volume_gb, network_volume, shared_volume_gb,
                            no_shared_volume, job)
    if disk_gb is not None and disk_gb < 1:
        raise _fail(flag("disk_gb"), disk_gb, "must be at least 1 (GB of container disk)")
    seconds = None
    if max_duration is not None:
        try:
            seconds = duration(max_duration)
        except ValueError as exc:
            raise _fail(flag("max_duration"), max_duration, str(exc)) from None
        if seconds < MIN_CAP:
            raise _fail(flag("max_duration"), max_duration,
                        f"must be at least {MIN_CAP:g} s (for the run's pods to start)")
    if max_cost is not None and not 0 < max_cost < float("inf"):
        raise _fail(flag("max_cost"), max_cost, "must be a positive number of US dollars")
    if keep and (seconds is not None or max_cost is not None):
        raise InputError("give at most one of --keep and --max-duration/--max-cost (at the "
                         "cap every pod of the run ends; --keep leaves them running)")
    if replacements is not None and not 0 <= replacements <= MAX_PODS:
        raise _fail(flag("replacements"), replacements,
                    f"must be between 0 and {MAX_PODS} (lost pods replaced)")
    if replacements is not None and cluster:
        raise InputError("--replacements cannot be used with --cluster: RunPod creates an "
                         "Instant Cluster's pods as one")
    if replacements and detach and launcher != RAY_LAUNCHER:
        raise InputError(f"--replacements cannot be used with --detach and --launcher "
                         f"{launcher}: a detached run's head replaces lost workers on Ray only "
                         f"(give --replacements 0, or follow the run)")
    if timeout <= 0:
        raise _fail(flag("timeout"), timeout, "must be a positive number of seconds")
    if api_timeout <= 0:
        raise _fail(flag("api_timeout"), api_timeout, "must be a positive number of seconds")
    try:
        http_url(api_url)
    except ValueError as exc:
        raise _fail("RUNPOD_API_URL", api_url, str(exc).replace(
            "https://rest.runpod.io/v1", "https://api.runpod.io")) from None
    return UpSpec(run=run, gpu_type=gpu_type.strip(), gpus_per_pod=gpus_per_pod, pods=pods,
                  image=image, template=template, cluster=cluster, cloud=cloud.upper(),
                  data_centers=tuple(d.strip() for d in data_centers if d.strip()),
                  volume_gb=volume_gb, network_volume=network_volume or None,
                  shared_volume_gb=shared, disk_gb=disk_gb,
                  env=_environment(env, secrets), job=tuple(job), launcher=launcher,
                  keep=keep, detach=detach,
                  registry_auth=registry_auth.strip() if registry_auth else None,
                  max_duration=seconds, max_cost=max_cost,
                  replacements=REPLACEMENTS if replacements is None else replacements,
                  timeout=timeout,
                  api_url=api_url.rstrip("/"), api_timeout=api_timeout,
                  state_dir=state_dir or default_state_dir(os.environ))


def _shared_volume(pods: int, volume_gb: int | None, network_volume: str | None,
                   asked: int | None, none: bool, job: tuple[str, ...]) -> int | None:
    """The size of the network volume `up` creates for the run, or None: a run of one pod, a
    volume given (--volume, --network-volume), or --no-shared-volume."""
    if asked is not None:
        if none or volume_gb is not None or network_volume:
            raise InputError("give at most one of --shared-volume GB, --no-shared-volume, "
                             "--volume GB and --network-volume ID (one volume at /workspace)")
        if not SHARED_MIN <= asked <= SHARED_MAX:
            raise _fail(flag("shared_volume_gb"), asked,
                        f"must be between {SHARED_MIN} and {SHARED_MAX} (GB; RunPod's bounds)")
        return asked
    if none or pods < 2 or volume_gb is not None or network_volume:
        return None
    return shared_volume_size(job)


def shared_volume_size(job: tuple[str, ...]) -> int:
    """GB for the run's checkpoints and model, from the size of the model its policy flag
    names (MODEL_FLAGS: `--pretrain Qwen/Qwen2.5-7B-Instruct` is 7 billion parameters;
    `Mixtral-8x7B`, 8 x 7): CHECKPOINT_BYTES per parameter (bf16 weights, fp32 Adam's master
    weights and two moments: 2 + 12) for each of CHECKPOINTS_KEPT checkpoints and 2 more for
    the final model, a fifth more for what else lands there; else SHARED_DEFAULT. Within
    RunPod's bounds. Only the policy's model: a reward model, a critic or a dataset named
    elsewhere on the line is not counted (--shared-volume sizes those runs)."""
    words = [w for word in job for w in _split_shell(word)]
    models = [value for flag, value in itertools.pairwise(words)
              if flag in MODEL_FLAGS]
    models += [w.split("=", 1)[1] for w in words
               if "=" in w and w.split("=", 1)[0].lstrip("-") in MODEL_KEYS]
    sizes = [size for model in models if (size := _billions(model)) is not None]
    if not sizes:
        return SHARED_DEFAULT
    gb = max(sizes) * (CHECKPOINT_BYTES * CHECKPOINTS_KEPT + 2) * 1.2
    return int(min(SHARED_MAX, max(SHARED_MIN, math.ceil(gb / 10) * 10)))


# The flags that name the policy's model: OpenRLHF's, Hugging Face scripts', verl's keys.
MODEL_FLAGS = frozenset({"--pretrain", "--model_name_or_path", "--model", "--model_path"})
MODEL_KEYS = frozenset({"pretrain", "model_name_or_path", "actor_rollout_ref.model.path",
                        "model.path", "model.partial_pretrain"})


def _billions(model: str) -> float | None:
    """The parameters (billions) a model's name says: `8x7B` is 56, `7B`/`7b` is 7; an MoE's
    active count (`A2.7B`) is not its size."""
    experts = re.search(rf"{_ALONE}([0-9]+)x{_BILLIONS}", model)
    if experts:
        return int(experts.group(1)) * float(experts.group(2))
    found = [float(m.group(1)) for m in re.finditer(rf"{_ALONE}{_BILLIONS}", model)]
    return max(found) if found else None


# A size in a model's name: a number not inside another word (`A2.7B`, `Qwen2.5` are not),
# then B, then the word's end.
_ALONE = r"(?<![0-9.A-Za-z])"
_BILLIONS = r"([0-9]+(?:\.[0-9]+)?)[bB](?![a-zA-Z0-9])"


def _split_shell(word: str) -> list[str]:
    """A job given as one shell string (`bash -c "..."`) read as its words; else the word."""
    if " " not in word:
        return [word]
    try:
        return shlex.split(word)
    except ValueError:
        return word.split()


def _environment(pairs: tuple[str, ...], secrets: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """-e NAME=VALUE and --secret NAME=RUNPOD_SECRET_NAME: a secret only by reference (RunPod
    puts the value in at the pod's start; it is never on this machine's command line)."""
    found: dict[str, str] = {}
    for raw in pairs:
        name, eq, value = raw.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name):
            raise _fail(flag("env"), raw, "must be NAME=VALUE with NAME of letters, digits and _")
        if name in OWN_VARIABLES:
            raise _fail(flag("env"), name, "is set by `podagent up` itself (give the job after "
                                           "--, the run's name with --name)")
        if is_secret(name) and not _SECRET_REF.fullmatch(value.strip()):
            # The value is not echoed: it may be the secret itself.
            raise InputError(f"--env {name}=...: a secret is passed by RunPod secret "
                              f"reference, never by value: --secret {name}=<name of a RunPod "
                              f"secret>")
        found[name] = value
    for raw in secrets:
        name, eq, ref = raw.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name) or not re.fullmatch(r"[A-Za-z0-9_.-]+",
                                                                         ref):
            raise _fail(flag("secrets"), raw, "must be NAME=SECRET, SECRET being the name of a "
                                              "secret in your RunPod account")
        if name in OWN_VARIABLES:
            raise _fail(flag("secrets"), name, "is set by `podagent up` itself")
        found[name] = f"{{{{ RUNPOD_SECRET_{ref} }}}}"
    return tuple(sorted(found.items()))


def check_gpu(spec: UpSpec, catalog: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The GPU type from RunPod's catalog, or one line: unknown (with the closest names), or
    more GPUs per pod than one machine of that type has in the cloud asked for."""
    import difflib

    by_id = {str(g.get("id")): g for g in catalog}
    gpu = by_id.get(spec.gpu_type)
    if gpu is None:
        names = {str(g.get("name")): i for i, g in by_id.items()}
        gpu = by_id.get(names.get(spec.gpu_type, ""))  # its short name is fine too
    if gpu is None:
        close = difflib.get_close_matches(spec.gpu_type, list(by_id), n=3, cutoff=0.4)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
            "; `podagent up --list-gpus` lists them")
        raise _fail(flag("gpu_type"), spec.gpu_type, f"is not a GPU type RunPod offers{hint}")
    cloud = spec.cloud.lower()
    most = (gpu.get("maxCount") or {}).get(cloud)
    if isinstance(most, int) and spec.gpus_per_pod > most:
        raise _fail(flag("gpus_per_pod"), spec.gpus_per_pod,
                    f"is more than a {gpu['id']} pod has in the {spec.cloud} cloud ({most})")
    if not spec.cluster and gpu.get("manufacturer") not in (None, "NVIDIA"):
        raise _fail(flag("gpu_type"), spec.gpu_type,
                    f"is a {gpu.get('manufacturer')} GPU: RunPod's Global Networking needs an "
                    f"NVIDIA GPU (use --cluster, or an NVIDIA type)")
    return gpu


def check_data_centers(spec: UpSpec, catalog: list[Mapping[str, Any]]) -> tuple[str, ...]:
    """The data centers to allow: those asked for, each known to RunPod's catalog (and, for
    Global Networking pods, one that supports it); none asked for, every one that supports
    Global Networking (RunPod places the pods only there), or any for a cluster."""
    known = {str(dc.get("id")): dc for dc in catalog}
    for asked in spec.data_centers:
        if asked not in known:
            raise _fail(flag("data_centers"), asked, f"is not a RunPod data center (the catalog "
                                                     f"has {', '.join(sorted(known)) or 'none'})")
    if spec.cluster:
        return spec.data_centers
    networked = sorted(i for i, dc in known.items() if dc.get("globalNetwork") is True)
    for asked in spec.data_centers:
        if asked not in networked:
            raise _fail(flag("data_centers"), asked,
                             f"does not support Global Networking, which a run's pods need to "
                             f"reach each other (those that do: {', '.join(networked) or 'none'}; "
                             f"or use --cluster)")
    if not networked:
        raise InputError("no RunPod data center supports Global Networking now (RunPod's "
                         "catalog): use --cluster")
    return spec.data_centers or tuple(networked)


def check_registry(spec: UpSpec, registries: list[Mapping[str, Any]]) -> str | None:
    """The registry credential's id, given its id or its name."""
    if not spec.registry_auth:
        return None
    for entry in registries:
        if spec.registry_auth in (entry.get("id"), entry.get("name")):
            return str(entry["id"])
    names = ", ".join(f"{r.get('name')} ({r.get('id')})" for r in registries) or "none"
    raise _fail(flag("registry_auth"), spec.registry_auth,
                    f"is not a registry credential of this RunPod account (it has: {names}; "
                    f"create one under Settings, Container Registry Auth)")


def price_per_hour(spec: UpSpec, gpu: Mapping[str, Any]) -> float | None:
    """The list price of the whole run per hour (RunPod bills each pod's own `cost`)."""
    each = (gpu.get("price") or {}).get(spec.cloud.lower())
    return None if each is None else float(each) * spec.gpus_per_pod * spec.pods


MIN_CAP = 60.0  # a cap nearer than this ends a run before its pods could start


def deadline_of(pods: list[Mapping[str, Any]]) -> float | None:
    """The run's deadline as its pods hold it (a stranger's value is none)."""
    for pod in pods:
        raw = (pod.get("env") or {}).get(DEADLINE)
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            return moment(raw)
    return None


def capped(spec: UpSpec, price: float | None, now: float,
           held: float | None = None) -> tuple[UpSpec, str]:
    """The spec with its deadline (Unix seconds) from --max-duration and --max-cost counted
    from `now`, and the line that says it ("" without a cap). A run that exists keeps the
    deadline it has (`held`: its record's, or its pods'): its pods hold that one."""
    if held is not None:
        spec = dataclasses.replace(spec, deadline=held)
    if spec.deadline is not None:
        return spec, f"capped: the run ends by {utc(spec.deadline)}"
    limits: list[tuple[float, str]] = []
    if spec.max_duration is not None:
        limits.append((spec.max_duration, f"{flag('max_duration')} {spec.max_duration:g} s"))
    if spec.max_cost is not None:
        if not price:
            raise InputError(f"{flag('max_cost')} needs the run's price, and RunPod's catalog "
                             f"gives none for {spec.gpu_type} in the {spec.cloud} cloud: use "
                             f"{flag('max_duration')}")
        limits.append((spec.max_cost / price * 3600.0,
                       f"{flag('max_cost')} ${spec.max_cost:g} at ${price:.2f}/h"))
    if not limits:
        return spec, ""
    seconds, why = min(limits)
    if seconds < MIN_CAP:
        raise InputError(f"the cap ({why}) ends the run {seconds:.0f} s after its creation: "
                         f"give at least {MIN_CAP:g} s, for its pods to start")
    spec = dataclasses.replace(spec, deadline=now + seconds)
    return spec, (f"capped: the run ends by {utc(spec.deadline)}, {seconds:.0f} s from now "
                  f"({why})")


def utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


# --- what RunPod is asked to create ----------------------------------------------------------

def pod_env(spec: UpSpec, rank: int | None, head_id: str | None = None) -> dict[str, str]:
    """The environment podagent on a pod gets from `up`: the user's, then the run's own.
    rank None: every pod of a cluster (the same env; NODE_RANK picks the head)."""
    env = dict(spec.env)
    if spec.api_url and spec.api_url != FIELD_BY_ATTR["runpod_api_url"].default:
        env[RUNPOD_API_URL] = spec.api_url  # a pod stops itself where `up` creates
    env.update({"PODAGENT_RUN_NAME": spec.run, LABEL: spec.run,
                # Once the run is over each pod stops itself, which ends its GPU billing
                # whether or not `up` is still there to terminate it (a closed laptop).
                # --keep: they stay up, idle (RunPod would start an exited container again).
                "PODAGENT_AFTER_RUN": (AfterRun.STAY if spec.keep else AfterRun.STOP_POD).value,
                # One JSON record per line: `up` reads the head's events and the job's output
                # from RunPod's log stream, and a stopped worker's last exit from its own.
                "PODAGENT_LOG_FORMAT": "json"})
    if rank in (0, None):
        env["EXPECTED_WORKERS"] = str(spec.workers)
        if spec.detach and spec.launcher == RAY_LAUNCHER and not spec.cluster:
            # No `up` follows a detached run: its head replaces a lost worker itself (with
            # the account key, which `up` says when it is not given).
            env[REPLACEMENTS_VARIABLE] = str(spec.replacements)
        if spec.job:
            env["PODAGENT_JOB"] = shlex.join(spec.job)
    if spec.deadline is not None:  # every pod holds it: a detached run, a worker whose head
        env[DEADLINE] = f"{spec.deadline:.0f}"  # is gone, a container started again
    if spec.launcher != RAY_LAUNCHER:  # every pod runs the launcher, and the same script
        env.update({"PODAGENT_LAUNCHER": spec.launcher, "PODAGENT_JOB": shlex.join(spec.job),
                    "EXPECTED_WORKERS": str(spec.workers)})
    if rank not in (0, None):
        env.update({"RAY_WORKER": "1", "HEAD_POD_ID": str(head_id)})
        env.pop(ACCOUNT_KEY, None)  # the head alone terminates the run's pods
    return env


def _gpu_type(env: dict[str, str], placement: Placement) -> dict[str, str]:
    """Each pod checks its GPUs are of the type asked for (nvidia-smi names them as RunPod's
    catalog ids do), unless the user's own PODAGENT_GPU_TYPE says otherwise."""
    env.setdefault(GPU_TYPE, placement.gpu_id)
    return env


def _container(spec: UpSpec, placement: Placement) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if spec.image:
        body["image"] = spec.image
    if spec.disk_gb is not None:
        body["disk"] = spec.disk_gb
    if spec.volume_gb is not None:
        body["mounts"] = {"persistent": {"size": spec.volume_gb, "path": VOLUME_PATH}}
    elif spec.network_volume:
        body["mounts"] = {"network": [{"volumeId": spec.network_volume, "path": VOLUME_PATH}]}
    if placement.data_centers:
        body["dataCenterIds"] = list(placement.data_centers)
    return body


def pod_body(spec: UpSpec, rank: int, head_id: str | None = None,
             placement: Placement | None = None) -> dict[str, Any]:
    """POST /v2/pods (CreatePodRequest) for the head (rank 0) or worker `rank`: the GPU by its
    catalog id, Global Networking in the data centers that support it, the registry
    credential of a private image."""
    placement = placement or Placement(spec.gpu_type, spec.data_centers)
    body = {"name": pod_name(spec.run, rank), **_container(spec, placement),
            "gpu": {"id": placement.gpu_id, "count": spec.gpus_per_pod}, "cloud": spec.cloud,
            "globalNetworking": True, "env": _gpu_type(pod_env(spec, rank, head_id), placement)}
    if placement.registry:
        body["registry"] = placement.registry
    if spec.template:
        body["templateId"] = spec.template
    return body


def cluster_body(spec: UpSpec, placement: Placement | None = None) -> dict[str, Any]:
    """POST /v2/clusters (CreateClusterRequest). TRAINING: podagent brings Ray up itself (a RAY
    cluster's own Ray would be refused by podagent on the pods). No registry: RunPod takes
    none for clusters."""
    placement = placement or Placement(spec.gpu_type, spec.data_centers)
    return {"name": cluster_name(spec.run), "type": "TRAINING",
            "compute": {"gpuTypeId": placement.gpu_id, "gpuCountPerPod": spec.gpus_per_pod,
                        "podCount": spec.pods},
            **_container(spec, placement), "env": _gpu_type(pod_env(spec, None), placement)}

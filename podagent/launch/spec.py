"""A run's shape as `podagent up` takes it (UpSpec, frozen, checked once) and what RunPod is
asked to create for it: pure functions from the spec to RunPod's create bodies.

Names are facts that `up`, `down` and `ls` share: a run's pods are `podagent-RUN-head` and
`podagent-RUN-w1`…, its cluster `podagent-RUN`, and each pod carries PODAGENT_UP_RUN=RUN, so
a run's pods are found again from RunPod's own list even when the local state is lost.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podagent import config
from podagent.choices import AfterRun
from podagent.errors import ConfigError, InputError

PREFIX = "podagent"
LABEL = "PODAGENT_UP_RUN"  # the env label every pod of a run carries
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
OWN_VARIABLES = ("PODAGENT_RUN_NAME", "EXPECTED_WORKERS", "PODAGENT_JOB", "HEAD_POD_ID",
                 "RAY_WORKER", "PODAGENT_LOG_FORMAT", "PODAGENT_AFTER_RUN", LABEL)


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


@dataclass(frozen=True)
class UpSpec:
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
    disk_gb: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    job: tuple[str, ...] = ()
    keep: bool = False
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


def _fail(name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(name, value, rule)


def default_run_name() -> str:
    return time.strftime("up-%Y%m%d-%H%M%S")


def build(*, run: str | None, gpu_type: str, gpus_per_pod: int, pods: int, image: str | None,
          template: str | None, cluster: bool, cloud: str, data_centers: tuple[str, ...],
          volume_gb: int | None, network_volume: str | None, disk_gb: int | None,
          env: tuple[str, ...], secrets: tuple[str, ...], job: tuple[str, ...], keep: bool,
          timeout: float, api_url: str, state_dir: Path | None,
          api_timeout: float = 60.0) -> UpSpec:
    """The spec from the command line, or one line naming what is wrong (ConfigError)."""
    run = run or default_run_name()
    try:
        config.run_name(run)
    except ValueError as exc:
        raise _fail("--name", run, str(exc)) from None
    if pods < 1:
        raise _fail("--pods", pods, "must be at least 1 (the head; the rest are workers)")
    if pods > MAX_PODS:
        raise _fail("--pods", pods, f"must be at most {MAX_PODS} (RunPod's limit)")
    if cluster and pods < 2:
        raise _fail("--pods", pods, "must be at least 2 with --cluster (an Instant Cluster "
                                    "has 2 to 250 pods)")
    if gpus_per_pod < 1:
        raise _fail("--gpus", gpus_per_pod, "must be at least 1 (GPUs per pod)")
    if not gpu_type.strip():
        raise _fail("--gpu", gpu_type, "must name a RunPod GPU type, e.g. 'NVIDIA H100 80GB "
                                       "HBM3' (see `podagent up --list-gpus`)")
    if bool(image) == bool(template):
        raise InputError("give exactly one of --image IMAGE or --template TEMPLATE_ID "
                          "(the image podagent runs in, on every pod)")
    if image and (len(image) > 255 or not _IMAGE.fullmatch(image)):
        raise _fail("--image", image, "is not a container image reference such as "
                                      "registry.example.com/team/trainer:1.2 (lowercase "
                                      "name, optional :tag or @sha256:digest)")
    if template and cluster:
        raise _fail("--template", template, "cannot be used with --cluster: RunPod's cluster "
                                            "create takes an image, not a template")
    if cloud.upper() not in CLOUDS:
        raise _fail("--cloud", cloud, f"must be one of {', '.join(CLOUDS)}")
    if volume_gb is not None and volume_gb < 10:
        raise _fail("--volume", volume_gb, "must be at least 10 (GB; RunPod's floor)")
    if volume_gb is not None and network_volume:
        raise InputError("give at most one of --volume GB and --network-volume ID (RunPod "
                          "mounts one volume at /workspace)")
    if disk_gb is not None and disk_gb < 1:
        raise _fail("--disk", disk_gb, "must be at least 1 (GB of container disk)")
    if timeout <= 0:
        raise _fail("--timeout", timeout, "must be a positive number of seconds")
    if api_timeout <= 0:
        raise _fail("--api-timeout", api_timeout, "must be a positive number of seconds")
    try:
        config.http_url(api_url)
    except ValueError as exc:
        raise _fail("RUNPOD_API_URL", api_url, str(exc).replace(
            "https://rest.runpod.io/v1", "https://api.runpod.io")) from None
    return UpSpec(run=run, gpu_type=gpu_type.strip(), gpus_per_pod=gpus_per_pod, pods=pods,
                  image=image, template=template, cluster=cluster, cloud=cloud.upper(),
                  data_centers=tuple(d.strip() for d in data_centers if d.strip()),
                  volume_gb=volume_gb, network_volume=network_volume or None, disk_gb=disk_gb,
                  env=_environment(env, secrets), job=tuple(job), keep=keep, timeout=timeout,
                  api_url=api_url.rstrip("/"), api_timeout=api_timeout,
                  state_dir=state_dir or default_state_dir(os.environ))


def _environment(pairs: tuple[str, ...], secrets: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """-e NAME=VALUE and --secret NAME=RUNPOD_SECRET_NAME: a secret only by reference (RunPod
    puts the value in at the pod's start; it is never on this machine's command line)."""
    found: dict[str, str] = {}
    for raw in pairs:
        name, eq, value = raw.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name):
            raise _fail("--env", raw, "must be NAME=VALUE with NAME of letters, digits and _")
        if name in OWN_VARIABLES:
            raise _fail("--env", name, "is set by `podagent up` itself (give the job after "
                                       "--, the run's name with --name)")
        if config.is_secret(name) and not _SECRET_REF.fullmatch(value.strip()):
            # The value is not echoed: it may be the secret itself.
            raise InputError(f"--env {name}=...: a secret is passed by RunPod secret "
                              f"reference, never by value: --secret {name}=<name of a RunPod "
                              f"secret>")
        found[name] = value
    for raw in secrets:
        name, eq, ref = raw.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name) or not re.fullmatch(r"[A-Za-z0-9_.-]+",
                                                                         ref):
            raise _fail("--secret", raw, "must be NAME=SECRET, SECRET being the name of a "
                                         "secret in your RunPod account")
        if name in OWN_VARIABLES:
            raise _fail("--secret", name, "is set by `podagent up` itself")
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
        raise _fail("--gpu", spec.gpu_type, f"is not a GPU type RunPod offers{hint}")
    cloud = spec.cloud.lower()
    most = (gpu.get("maxCount") or {}).get(cloud)
    if isinstance(most, int) and spec.gpus_per_pod > most:
        raise _fail("--gpus", spec.gpus_per_pod,
                    f"is more than a {gpu['id']} pod has in the {spec.cloud} cloud ({most})")
    return gpu


def price_per_hour(spec: UpSpec, gpu: Mapping[str, Any]) -> float | None:
    """The list price of the whole run per hour (RunPod bills each pod's own `cost`)."""
    each = (gpu.get("price") or {}).get(spec.cloud.lower())
    return None if each is None else float(each) * spec.gpus_per_pod * spec.pods


# --- what RunPod is asked to create ----------------------------------------------------------

def pod_env(spec: UpSpec, rank: int | None, head_id: str | None = None) -> dict[str, str]:
    """The environment podagent on a pod gets from `up`: the user's, then the run's own.
    rank None: every pod of a cluster (the same env; NODE_RANK picks the head)."""
    env = dict(spec.env)
    env.update({"PODAGENT_RUN_NAME": spec.run, LABEL: spec.run,
                # A finished run stays up until `up` has read its outcome and terminates it
                # (RunPod would restart an exited container and run it again).
                "PODAGENT_AFTER_RUN": AfterRun.STAY.value})
    if rank in (0, None):
        env.update({"EXPECTED_WORKERS": str(spec.workers),
                    # One JSON record per line: `up` reads the head's events and the job's
                    # output from RunPod's log stream.
                    "PODAGENT_LOG_FORMAT": "json"})
        if spec.job:
            env["PODAGENT_JOB"] = shlex.join(spec.job)
    if rank not in (0, None):
        env.update({"RAY_WORKER": "1", "HEAD_POD_ID": str(head_id)})
    return env


def _container(spec: UpSpec) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if spec.image:
        body["image"] = spec.image
    if spec.disk_gb is not None:
        body["disk"] = spec.disk_gb
    if spec.volume_gb is not None:
        body["mounts"] = {"persistent": {"size": spec.volume_gb, "path": VOLUME_PATH}}
    elif spec.network_volume:
        body["mounts"] = {"network": [{"volumeId": spec.network_volume, "path": VOLUME_PATH}]}
    if spec.data_centers:
        body["dataCenterIds"] = list(spec.data_centers)
    return body


def pod_body(spec: UpSpec, rank: int, head_id: str | None = None) -> dict[str, Any]:
    """POST /v2/pods (CreatePodRequest) for the head (rank 0) or worker `rank`."""
    body = {"name": pod_name(spec.run, rank), **_container(spec),
            "gpu": {"id": spec.gpu_type, "count": spec.gpus_per_pod}, "cloud": spec.cloud,
            "globalNetworking": True, "env": pod_env(spec, rank, head_id)}
    if spec.template:
        body["templateId"] = spec.template
    return body


def cluster_body(spec: UpSpec) -> dict[str, Any]:
    """POST /v2/clusters (CreateClusterRequest). TRAINING: podagent brings Ray up itself (a RAY
    cluster's own Ray would be refused by podagent on the pods)."""
    return {"name": cluster_name(spec.run), "type": "TRAINING",
            "compute": {"gpuTypeId": spec.gpu_type, "gpuCountPerPod": spec.gpus_per_pod,
                        "podCount": spec.pods},
            **_container(spec), "env": pod_env(spec, None)}

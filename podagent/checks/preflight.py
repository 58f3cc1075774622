"""`podagent check`: is this pod fit to be a node? One row per check, each with a fix.

Every check is a small function returning one CheckResult; run_checks runs each behind a guard,
so a check that crashes becomes a FAIL row naming the exception and the others still run.
Checks: the image's Ray and torch, GPUs and their health (nvidia-smi's memory errors), the NCCL
interface, /dev/shm, open-file limit, free disk for logs and checkpoints, and on a worker: the
head's DNS name and its Ray, dashboard and reward ports.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import os
import resource
import shutil
import socket
import subprocess
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from podagent import config
from podagent.platform import discovery, nccl, roles
from podagent.platform.head_location import OTHER_WAYS, head_location
from podagent.platform.pod import detect_gpus
from podagent.ray_access import ray_compat


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str  # what was seen, one line
    fix: str = ""  # one line, for WARN and FAIL


GiB = 1024**3
NVIDIA_SMI_TIMEOUT = 15.0  # it can take seconds per GPU when persistence mode is off
NOFILE_WANTED = 65536  # Ray and NCCL open a socket per peer and a file per object
LOG_MIN_FREE = 1 * GiB
CHECKPOINT_MIN_FREE = 10 * GiB  # one checkpoint of a 7B model with optimizer state is ~80 GB
DNS_LIFETIME = 2.0  # one lookup: the long wait belongs to `podagent worker`, not to a check
CONNECT_TIMEOUT = 2.0

CPU_NODE = "no GPUs (CPU node; the check job uses gloo)"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 1024**2:.0f} MiB"


# --- GPUs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    model: str
    driver: str  # "" when the source does not tell


@dataclass(frozen=True)
class GpuSighting:
    gpus: tuple[Gpu, ...]
    source: str  # "nvidia-smi", "torch", or "" when nothing could look
    note: str = ""  # why a source could not answer


def parse_nvidia_smi(text: str) -> tuple[Gpu, ...]:
    """Lines of `--query-gpu=name,driver_version --format=csv,noheader`."""
    gpus = []
    for line in text.splitlines():
        if line.strip():
            model, _, driver = line.rpartition(",")
            gpus.append(Gpu(model.strip(), driver.strip()))
    return tuple(gpus)


def _nvidia_smi() -> tuple[tuple[Gpu, ...] | None, str]:
    """(GPUs, note); None when nvidia-smi is absent or failed (the note says which)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no nvidia-smi"
    argv = [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=NVIDIA_SMI_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer in {NVIDIA_SMI_TIMEOUT:g} s"
    if done.returncode != 0:
        # e.g. "Failed to initialize NVML: Driver/library version mismatch"
        said = (done.stdout + done.stderr).strip().splitlines()
        return None, f"nvidia-smi exited {done.returncode}: {said[-1] if said else 'no output'}"
    return parse_nvidia_smi(done.stdout), ""


def _torch_gpus() -> tuple[tuple[Gpu, ...], str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's note that NumPy is missing
            import torch
    except ImportError:
        return (), "torch is not installed"
    if not torch.cuda.is_available():
        return (), "torch sees no CUDA device"
    # torch does not tell the driver version; its CUDA runtime version is the next best fact.
    driver = f"unknown (CUDA runtime {torch.version.cuda})"
    return tuple(Gpu(torch.cuda.get_device_name(i), driver)
                 for i in range(torch.cuda.device_count())), ""


def look_for_gpus(offered: int) -> GpuSighting:
    gpus, note = _nvidia_smi()
    if gpus is not None:
        return GpuSighting(gpus, "nvidia-smi")
    if offered == 0:
        # Nothing claims a GPU (not even /dev/nvidia*): importing torch to confirm would only
        # cost seconds on every CPU node.
        return GpuSighting((), "", note)
    seen, torch_note = _torch_gpus()
    return GpuSighting(seen, "torch" if seen else "", "; ".join(filter(None, (note, torch_note))))


def judge_gpus(sighting: GpuSighting, offered: int, offered_how: str) -> CheckResult:
    """Compare what Ray will be offered (pod.detect_gpus) with the GPUs that can be seen."""
    name = "gpus"
    seen = len(sighting.gpus)
    note = f" ({sighting.note})" if sighting.note else ""
    if seen == 0:
        if offered == 0:
            return CheckResult(name, Status.OK, CPU_NODE + note)
        return CheckResult(
            name, Status.FAIL,
            f"Ray would be offered {offered} GPU(s) ({offered_how}) but none are visible{note}",
            "start the pod with GPUs and a working NVIDIA driver (nvidia-smi must list them), "
            "or set PODAGENT_NUM_GPUS=0 for a CPU node")
    models = ", ".join(f"{count} × {model}"
                       for model, count in Counter(g.model for g in sighting.gpus).items())
    drivers = sorted({g.driver for g in sighting.gpus if g.driver})
    seen_text = f"{models}, driver {'/'.join(drivers) or 'unknown'} ({sighting.source})"
    if offered > seen:
        return CheckResult(
            name, Status.WARN,
            f"{seen_text}; but {offered_how} offers Ray {offered}",
            f"set PODAGENT_NUM_GPUS={seen} (Ray would schedule work on GPUs that do not exist)")
    return CheckResult(name, Status.OK, f"{seen_text}; Ray is offered {offered} ({offered_how})")


def check_gpus(settings: config.Settings) -> CheckResult:
    offered, how = detect_gpus(settings)
    if settings.num_gpus is not None:
        how = f"{how}={offered}"
    return judge_gpus(look_for_gpus(offered), offered, how)


def check_gpu_health(settings: config.Settings) -> CheckResult:
    """nvidia-smi's facts as a start's GPU check judges them (PODAGENT_GPU_CHECK=smi): the
    count, the type, memory errors. The speed is the start's to measure (seconds of GPU)."""
    from podagent.run import gpu_check

    name = "gpu health"
    offered, how = detect_gpus(settings)
    if offered == 0:
        return CheckResult(name, Status.SKIP, "no GPUs")
    expected, expected_how = gpu_check.expected_gpus(settings, offered, how)
    verdict = gpu_check.Verdict()
    gpu_check.judge_smi(gpu_check.look(), expected, expected_how, settings.gpu_type, verdict)
    if not verdict.ok:
        return CheckResult(name, Status.FAIL, "; ".join(verdict.failures),
                           "replace the pod (`podagent up` does, within --replacements): a "
                           "start on these GPUs exits 28")
    said = f"{expected} GPU(s) as expected ({expected_how}), no memory errors"
    if verdict.notes:
        return CheckResult(name, Status.WARN, f"{said}; {'; '.join(verdict.notes)}",
                           "a newer NVIDIA driver reports ECC and remapped rows")
    return CheckResult(name, Status.OK, said)


# --- NCCL interface ------------------------------------------------------------------------------


def selected_interfaces(spec: str, names: Sequence[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME selects, exclusion lists ('^lo,docker') included."""
    chosen = nccl.match_ifname(spec, list(names))
    if chosen is not None:
        return chosen
    excluded = nccl.match_ifname(spec[1:], list(names)) or []
    return [n for n in names if n not in excluded]


def _candidates(ifaces: Mapping[str, list[str]], head_ip: str | None) -> list[str]:
    """Interfaces worth naming in a fix: the route to the head first, then others with IPv4."""
    names = [n for n, addrs in sorted(ifaces.items())
             if addrs and not all(a.startswith("127.") for a in addrs)]
    if head_ip:
        try:
            via, _ = nccl.route_to(head_ip, ifaces)
        except OSError:
            via = None
        if via in names:
            names.remove(via)
            names.insert(0, via)
    return names or sorted(n for n, addrs in ifaces.items() if addrs)


def check_interface(settings: config.Settings, head_ip: str | None = None,
                    ifaces: Mapping[str, list[str]] | None = None) -> CheckResult:
    name = "interface"
    ifaces = nccl.interfaces() if ifaces is None else ifaces
    env = nccl.effective(settings, head_ip=head_ip, ifaces=ifaces)
    user = settings.environ.get("NCCL_SOCKET_IFNAME", "").strip()
    spec = user or env.variables.get("NCCL_SOCKET_IFNAME", "")
    origin = "your environment" if user else f"preset {env.preset}: {env.reason}"
    if not spec:
        return CheckResult(name, Status.OK, f"NCCL_SOCKET_IFNAME unset (preset {env.preset}): "
                                            "NCCL and gloo pick an interface themselves")
    selected = selected_interfaces(spec, sorted(ifaces))
    usable = [n for n in selected if ifaces[n]]
    if usable:
        shown = ", ".join(f"{n} ({', '.join(ifaces[n])})" for n in usable)
        return CheckResult(name, Status.OK, f"NCCL_SOCKET_IFNAME={spec} ({origin}) -> {shown}")
    if selected:
        which = "it has" if len(selected) == 1 else "they have"
        detail = (f"NCCL_SOCKET_IFNAME={spec} ({origin}) matches {', '.join(selected)}, "
                  f"but {which} no IPv4 address")
    else:
        # nccl.effective already wrote this message (with the route to the head, if known).
        missing = [w for w in env.warnings if "names no interface" in w]
        detail = (missing[0] if missing else
                  f"NCCL_SOCKET_IFNAME={spec} leaves no interface on this pod") + f" ({origin})"
    choices = ", ".join(_candidates(ifaces, head_ip)) or "none has IPv4"
    where = "NCCL_SOCKET_IFNAME" if user else "PODAGENT_NCCL_PRESET (or NCCL_SOCKET_IFNAME)"
    return CheckResult(name, Status.FAIL, detail,
                       f"set {where} to fit one of this pod's interfaces: {choices}")


# --- shared memory, open files, disk -------------------------------------------------------------


def shm_wanted(ram: int) -> int:
    """Free /dev/shm below which this pod is slow.

    Ray 2.60 sizes its object store at 30% of RAM, capped at max(10 GB, 95% of free /dev/shm),
    and puts it on disk (its temp dir) when /dev/shm has less free than that: so /dev/shm needs
    min(30% of RAM, 10 GB) free. NCCL keeps intra-node buffers there too; Docker's default 64 MiB
    fails it with several GPUs, hence a 1 GiB floor.
    """
    return max(GiB, min(int(0.3 * ram), 10**10))


def check_shm(path: str = "/dev/shm", ram: int | None = None) -> CheckResult:
    name = "shm"
    fix = ("give the container more shared memory (docker run --shm-size=..., or a larger "
           f"tmpfs on {path})")
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return CheckResult(name, Status.WARN, f"{path} does not exist: Ray's object store goes "
                                              "to disk and NCCL cannot share memory", fix)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    wanted = shm_wanted(psutil.virtual_memory().total if ram is None else ram)
    detail = f"{path}: {_gib(free)} free of {_gib(size)}"
    if free < wanted:
        return CheckResult(name, Status.WARN,
                           f"{detail}; below {_gib(wanted)} Ray puts its object store on disk "
                           "and NCCL may fail between GPUs of this node", fix)
    return CheckResult(name, Status.OK, detail)


def check_nofile(wanted: int = NOFILE_WANTED) -> CheckResult:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    detail = f"open files: soft limit {soft}, hard {shown}"
    if soft != resource.RLIM_INFINITY and soft < wanted:
        return CheckResult(
            "nofile", Status.WARN,
            f"{detail}; below {wanted} Ray and NCCL can run out of sockets and files",
            f"run `ulimit -n {wanted}` before podagent, or raise the container's nofile "
            f"limit (docker run --ulimit nofile={wanted}:{wanted})")
    return CheckResult("nofile", Status.OK, detail)


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(name: str, directory: str | None, minimum: int, setting: str) -> CheckResult:
    if directory is None:
        return CheckResult(name, Status.SKIP, f"{setting} unset: nothing to check")
    target = Path(directory).expanduser().absolute()
    probe = nearest_existing(target)
    where = str(target) if probe == target else f"{probe} ({target} does not exist yet)"
    if not probe.is_dir():
        return CheckResult(name, Status.FAIL, f"{probe} is not a directory",
                           f"point {setting} at a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        return CheckResult(name, Status.FAIL, f"{where} is not writable by this user",
                           f"point {setting} at a writable directory")
    free = shutil.disk_usage(probe).free
    detail = f"{_gib(free)} free at {where}"
    if free < minimum:
        return CheckResult(name, Status.WARN, f"{detail}; below {_gib(minimum)}",
                           f"free space there or point {setting} at a larger volume")
    return CheckResult(name, Status.OK, detail)


# --- the head, from a worker ---------------------------------------------------------------------


def find_head(settings: config.Settings,
              head_ip: str | None = None) -> tuple[CheckResult, str | None]:
    """(the head_dns row, the head's address or None). One lookup, never the long wait.

    Where it looks is where the worker would (head_location).
    """
    name = "head_dns"
    if head_ip:
        return CheckResult(name, Status.OK, f"head address given: {head_ip}"), head_ip
    location = head_location(settings)
    if location is None:
        return CheckResult(name, Status.FAIL, "no head location on this worker",
                           f"set HEAD_POD_ID {OTHER_WAYS}"), None
    target, how = location.target, location.setting
    if location.is_address:
        return CheckResult(name, Status.OK, f"given by {how}: {target}"), target
    server = (f"{settings.dns_server[0]}:{settings.dns_server[1]}" if settings.dns_server
              else "the system resolver")
    result = discovery.resolve(target, discovery.make_resolver(settings.dns_server, DNS_LIFETIME))
    if result.outcome is discovery.DnsOutcome.ANSWER:
        row = CheckResult(name, Status.OK, f"{result.describe()} ({how}, asked {server})")
        return row, result.addresses[0]
    fix = {
        discovery.DnsOutcome.NXDOMAIN: f"start the head first, and check {how} names it "
                                       f"(its RUNPOD_POD_ID)",
        discovery.DnsOutcome.NO_ANSWER: "start the head first; its address appears once it runs",
    }.get(result.outcome, "check PODAGENT_DNS_SERVER and that this pod can reach a DNS server")
    return CheckResult(name, Status.FAIL, f"{result.describe()} (asked {server})", fix), None


def connect_error(ip: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None when a TCP connection to ip:port opens, else why not."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "refused (nothing listens there)"
    except TimeoutError:
        return f"no answer in {timeout:g} s (a firewall, or the wrong address)"
    except OSError as exc:
        return exc.strerror or str(exc)


def check_port(name: str, ip: str | None, port: int, what: str, unreachable: Status,
               fix: str) -> CheckResult:
    if ip is None:
        return CheckResult(name, Status.SKIP, "the head was not located")
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    error = connect_error(ip, port)
    if error is None:
        return CheckResult(name, Status.OK, f"{what} at {address} accepts connections")
    return CheckResult(name, unreachable, f"{what} at {address}: {error}", fix)


def check_head_ray(settings: config.Settings, ip: str | None) -> CheckResult:
    return check_port("head_ray", ip, settings.ray_port, "Ray GCS", Status.FAIL,
                      "start the head first, check PODAGENT_RAY_PORT matches the head's and that "
                      "this pod can reach it (same account's private network)")


def check_head_dashboard(settings: config.Settings, ip: str | None) -> CheckResult:
    return check_port("head_dashboard", ip, settings.dashboard_port, "Ray dashboard", Status.WARN,
                      "the dashboard starts after Ray's GCS; if this stays, check "
                      "PODAGENT_DASHBOARD_PORT matches the head's")


def check_head_reward(settings: config.Settings, ip: str | None) -> CheckResult:
    if settings.reward == "none":
        return CheckResult("head_reward", Status.SKIP, "PODAGENT_REWARD=none: no reward server")
    return check_port("head_reward", ip, settings.reward_port, "reward server", Status.WARN,
                      "the head starts it after Ray and may still be loading; if this stays, "
                      "check PODAGENT_REWARD_PORT matches the head's")


# --- Ray and torch -------------------------------------------------------------------------------


def check_ray(settings: config.Settings) -> CheckResult:
    """The image's own Ray: there, in the tested range, able to do what the settings ask."""
    name = "ray"
    ray = ray_compat.installed()
    if ray is None:
        return CheckResult(name, Status.FAIL, "this Python has no Ray",
                           "use the trainer's image (podagent runs the image's own Ray), or pip "
                           f"install 'ray[default]>={ray_compat.SUPPORTED_FROM}'")
    refused = ray_compat.refusal(settings, ray)
    if refused:
        return CheckResult(name, Status.FAIL, refused[0], refused[1])
    note = ray_compat.untested_note(ray)
    if note:
        return CheckResult(name, Status.WARN, note,
                           "use a Ray podagent is tested with if anything misbehaves")
    return CheckResult(name, Status.OK, f"{ray} (tested: {', '.join(ray_compat.TESTED)}; "
                                        f"every release from {ray_compat.SUPPORTED_FROM} to "
                                        f"{ray_compat.NEWEST_PROVEN}.x checked)")


def check_torch() -> CheckResult:
    name = "torch"
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult(name, Status.WARN, "not installed (podagent never installs it)",
                           "the cluster check and `podagent torchrun` need torch: use an image "
                           "with torch, or give your own job")
    return CheckResult(name, Status.OK, f"torch {version}")


# --- running and showing -------------------------------------------------------------------------


def crashed(name: str, exc: BaseException) -> CheckResult:
    return CheckResult(name, Status.FAIL,
                       _one_line(f"the check itself failed: {type(exc).__name__}: {exc}"),
                       "a bug in podagent's preflight: please report it with this line")


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; a crash becomes its FAIL row instead of ending the whole run."""
    try:
        return check()
    except Exception as exc:
        return crashed(name, exc)


def run_checks(settings: config.Settings, role: roles.Role,
               head_ip: str | None = None) -> list[CheckResult]:
    head_rows: list[CheckResult] = []
    if role is roles.Role.WORKER:
        # Located first so that the interface check can name the route to the head.
        try:
            dns_row, head_ip = find_head(settings, head_ip)
        except Exception as exc:
            dns_row, head_ip = crashed("head_dns", exc), None
        head_rows = [
            dns_row,
            guarded("head_ray", lambda: check_head_ray(settings, head_ip)),
            guarded("head_dashboard", lambda: check_head_dashboard(settings, head_ip)),
            guarded("head_reward", lambda: check_head_reward(settings, head_ip)),
        ]
    return [
        guarded("ray", lambda: check_ray(settings)),
        guarded("torch", check_torch),
        guarded("gpus", lambda: check_gpus(settings)),
        guarded("gpu health", lambda: check_gpu_health(settings)),
        guarded("interface", lambda: check_interface(settings, head_ip)),
        guarded("shm", check_shm),
        guarded("nofile", check_nofile),
        guarded("disk:logs", lambda: check_disk(
            "disk:logs", settings.log_dir, LOG_MIN_FREE, settings.source_name("log_dir"))),
        guarded("disk:checkpoints", lambda: check_disk(
            "disk:checkpoints", settings.checkpoint_dir, CHECKPOINT_MIN_FREE,
            settings.source_name("checkpoint_dir"))),
        *head_rows,
    ]


def fatal(results: Sequence[CheckResult]) -> bool:
    return any(r.status is Status.FAIL for r in results)


MARKS = {Status.OK: "✓", Status.WARN: "!", Status.FAIL: "✗", Status.SKIP: "-"}


def render_table(results: Sequence[CheckResult]) -> str:
    """One row per check (mark, name, detail); the fix on the line under a WARN or FAIL row."""
    width = max((len(r.name) for r in results), default=0)
    lines = []
    for r in results:
        lines.append(f"{MARKS[r.status]} {r.name:<{width}}  {_one_line(r.detail)}")
        if r.fix and r.status in (Status.WARN, Status.FAIL):
            lines.append(f"  {'':<{width}}  fix: {_one_line(r.fix)}")
    counts = Counter(r.status for r in results)
    lines.append(", ".join(f"{counts[s]} {s.value}" for s in Status))
    return "\n".join(lines)


def to_json(results: Sequence[CheckResult]) -> str:
    return json.dumps({
        "ok": not fatal(results),
        "checks": [{"name": r.name, "status": r.status.value, "detail": r.detail, "fix": r.fix}
                   for r in results],
    }, indent=2, ensure_ascii=False)

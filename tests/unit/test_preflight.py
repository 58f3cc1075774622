"""`podagent check` on this pod: each check against real conditions (interfaces, rlimits in a
child process, a real DNS server, real sockets, real file systems), plus the result shapes."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from podagent import config
from podagent.checks import preflight
from podagent.checks.preflight import CheckResult, Status
from podagent.platform import nccl
from podagent.platform.roles import Role
from tests.harness.pods import DnsServer

ROOT = Path(__file__).resolve().parents[2]
HEAD_IP = "127.0.0.7"  # any 127/8 address is this machine; a distinct one shows it was used


def settings(tmp_path: Path, **env: str) -> config.Settings:
    # Logs under tmp_path, so the disk check never depends on the current directory.
    return config.build({}, {"PODAGENT_LOG_DIR": str(tmp_path / "logs"), **env})


def row(results: list[CheckResult], name: str) -> CheckResult:
    (found,) = [r for r in results if r.name == name]
    return found


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with DnsServer(address="127.0.0.1", port=0) as server:
        yield server


def worker_env(dns: DnsServer, tmp_path: Path, **env: str) -> config.Settings:
    return settings(tmp_path, RAY_WORKER="1", PODAGENT_DNS_SERVER=f"127.0.0.1:{dns.port}", **env)


@pytest.fixture
def listening() -> Iterator[int]:
    """A port on HEAD_IP where something really listens."""
    with socket.socket() as sock:
        sock.bind((HEAD_IP, 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def closed() -> Iterator[tuple[int, int]]:
    """Two ports on HEAD_IP that nobody listens on: bound (so nobody else takes them), never
    listening, so a connection is refused."""
    with socket.socket() as a, socket.socket() as b:
        a.bind((HEAD_IP, 0))
        b.bind((HEAD_IP, 0))
        yield a.getsockname()[1], b.getsockname()[1]


# --- interface -----------------------------------------------------------------------------------

def test_a_missing_interface_fails_naming_the_ones_that_exist(tmp_path):
    result = preflight.check_interface(settings(tmp_path, NCCL_SOCKET_IFNAME="nosuch0"))
    assert result.status is Status.FAIL
    assert "nosuch0" in result.detail and "your environment" in result.detail
    for name in nccl.interfaces():
        assert name in result.detail
    assert "NCCL_SOCKET_IFNAME" in result.fix


@pytest.mark.parametrize("spec", ["lo", "=lo", "lo,nosuch0", "^nosuch0"])
def test_an_interface_with_ipv4_passes(tmp_path, spec):
    result = preflight.check_interface(settings(tmp_path, NCCL_SOCKET_IFNAME=spec))
    assert result.status is Status.OK, result
    assert "lo (127.0.0.1)" in result.detail


def test_an_exclusion_of_every_interface_fails(tmp_path):
    spec = "^=" + ",".join(nccl.interfaces())
    result = preflight.check_interface(settings(tmp_path, NCCL_SOCKET_IFNAME=spec))
    assert result.status is Status.FAIL
    assert "leaves no interface" in result.detail


def test_the_presets_interface_without_ipv4_fails(tmp_path):
    # HEAD_POD_ID picks the runpod-global preset (podnet1); here podnet1 exists but has no IPv4.
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"], "podnet1": []}
    s = settings(tmp_path, HEAD_POD_ID="h1")
    result = preflight.check_interface(s, ifaces=ifaces)
    assert result.status is Status.FAIL
    assert "podnet1" in result.detail and "no IPv4" in result.detail
    assert "preset runpod-global" in result.detail
    assert "PODAGENT_NCCL_PRESET" in result.fix and "eth0" in result.fix


def test_the_presets_missing_interface_names_the_alternatives(tmp_path):
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"]}
    result = preflight.check_interface(settings(tmp_path, HEAD_POD_ID="h1"), ifaces=ifaces)
    assert result.status is Status.FAIL
    assert "NCCL_SOCKET_IFNAME=podnet1 names no interface" in result.detail
    assert "eth0 (172.17.0.2)" in result.detail
    assert result.fix.endswith("eth0")  # loopback is no way to another pod


def test_no_preset_interface_means_nccl_chooses(tmp_path):
    result = preflight.check_interface(settings(tmp_path))
    assert result.status is Status.OK
    assert "NCCL_SOCKET_IFNAME unset" in result.detail


# --- open files, in a child process with its own limit -------------------------------------------

CHILD = """
import json, sys
from podagent import config
from podagent.platform import roles
from podagent.checks import preflight
s = config.build({}, json.loads(sys.argv[1]))
print(preflight.to_json(preflight.run_checks(s, roles.Role.HEAD)))
"""


def checks_in_child(tmp_path: Path, nofile: tuple[int, int]) -> dict:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    env = json.dumps({"PODAGENT_LOG_DIR": str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", CHILD, env], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_small_open_file_limit_warns(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    report = checks_in_child(tmp_path, (1024, hard))
    (nofile,) = [c for c in report["checks"] if c["name"] == "nofile"]
    assert nofile["status"] == "warn"
    assert "soft limit 1024" in nofile["detail"]
    assert "ulimit -n 65536" in nofile["fix"]


def may_raise_hard_limits() -> bool:
    # CAP_SYS_RESOURCE (bit 24 of the effective set); containers often drop it, even for root.
    status = Path("/proc/self/status").read_text()
    (effective,) = [line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")]
    return bool(int(effective, 16) & (1 << 24))


def test_a_large_open_file_limit_passes(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = preflight.NOFILE_WANTED
    if hard != resource.RLIM_INFINITY and hard < wanted:
        if not may_raise_hard_limits():
            # This host cannot hold 65536 open files: the passing side is shown at the
            # highest limit it allows instead.
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            result = preflight.check_nofile(wanted=soft)
            assert result.status is preflight.Status.OK, result
            assert f"soft limit {soft}" in result.detail
            return
        hard = wanted
    report = checks_in_child(tmp_path, (wanted, hard))
    (nofile,) = [c for c in report["checks"] if c["name"] == "nofile"]
    assert nofile["status"] == "ok", nofile
    assert f"soft limit {wanted}" in nofile["detail"]


# --- the head, from a worker ---------------------------------------------------------------------

HEAD_ROWS = ["head_dns", "head_ray", "head_dashboard", "head_reward"]


@pytest.mark.parametrize(("mode", "outcome"), [
    ("normal", "NXDOMAIN"), ("servfail", "SERVFAIL"), ("timeout", "timeout")])
def test_an_unresolvable_head_fails_and_skips_the_ports(dns, tmp_path, mode, outcome):
    dns.mode = mode
    s = worker_env(dns, tmp_path, HEAD_POD_ID="nohead1")
    results = preflight.run_checks(s, Role.WORKER)
    assert [r.name for r in results][-4:] == HEAD_ROWS
    head_dns = row(results, "head_dns")
    assert head_dns.status is Status.FAIL
    assert "nohead1.runpod.internal" in head_dns.detail
    assert outcome in head_dns.detail
    assert f"127.0.0.1:{dns.port}" in head_dns.detail  # which server was asked
    assert head_dns.fix
    for name in HEAD_ROWS[1:]:
        assert row(results, name).status is Status.SKIP
    assert preflight.fatal(results)
    if mode == "normal":
        # One lookup, not the worker's wait-until-it-appears loop.
        assert len(dns.queries_for("nohead1.runpod.internal")) == 1


def test_a_resolvable_head_with_ray_up_and_the_dashboard_not_yet(dns, tmp_path, listening,
                                                                  closed):
    dns.set_record("head7.runpod.internal", HEAD_IP)
    dashboard, reward = closed
    s = worker_env(dns, tmp_path, HEAD_POD_ID="head7", PODAGENT_RAY_PORT=str(listening),
                   PODAGENT_DASHBOARD_PORT=str(dashboard), PODAGENT_REWARD_PORT=str(reward))
    results = preflight.run_checks(s, Role.WORKER)
    head_dns = row(results, "head_dns")
    assert head_dns.status is Status.OK
    assert f"head7.runpod.internal -> {HEAD_IP}" in head_dns.detail
    ray = row(results, "head_ray")
    assert ray.status is Status.OK
    assert f"{HEAD_IP}:{listening}" in ray.detail
    for name, port in (("head_dashboard", dashboard), ("head_reward", reward)):
        result = row(results, name)
        assert result.status is Status.WARN, result
        assert f"{HEAD_IP}:{port}" in result.detail and "refused" in result.detail
        assert result.fix


def test_the_heads_ray_port_closed_is_fatal(dns, tmp_path, closed):
    dns.set_record("head8.runpod.internal", HEAD_IP)
    ray_port, dashboard = closed
    s = worker_env(dns, tmp_path, HEAD_POD_ID="head8", PODAGENT_RAY_PORT=str(ray_port),
                   PODAGENT_DASHBOARD_PORT=str(dashboard), PODAGENT_REWARD="none")
    results = preflight.run_checks(s, Role.WORKER)
    assert row(results, "head_ray").status is Status.FAIL
    assert "PODAGENT_RAY_PORT" in row(results, "head_ray").fix
    assert row(results, "head_reward").status is Status.SKIP
    assert "PODAGENT_REWARD=none" in row(results, "head_reward").detail
    assert preflight.fatal(results)


def test_a_given_head_address_needs_no_lookup(dns, tmp_path, listening):
    s = worker_env(dns, tmp_path, HEAD_POD_ID="h1", PODAGENT_HEAD_ADDR=HEAD_IP,
                   PODAGENT_RAY_PORT=str(listening))
    results = preflight.run_checks(s, Role.WORKER)
    head_dns = row(results, "head_dns")
    assert head_dns.status is Status.OK
    assert head_dns.detail == f"given by PODAGENT_HEAD_ADDR: {HEAD_IP}"
    assert row(results, "head_ray").status is Status.OK
    assert dns.queries == []


def test_a_head_ip_from_the_caller_needs_no_lookup(dns, tmp_path, listening):
    s = worker_env(dns, tmp_path, HEAD_POD_ID="h1", PODAGENT_RAY_PORT=str(listening))
    results = preflight.run_checks(s, Role.WORKER, head_ip=HEAD_IP)
    assert row(results, "head_dns").status is Status.OK
    assert row(results, "head_ray").status is Status.OK
    assert dns.queries == []


def test_the_head_runs_no_head_checks(dns, tmp_path):
    s = worker_env(dns, tmp_path, HEAD_POD_ID="h1")
    names = [r.name for r in preflight.run_checks(s, Role.HEAD)]
    assert names == ["ray", "torch", "gpus", "gpu health", "interface", "shm", "nofile",
                     "disk:logs", "disk:checkpoints"]
    assert dns.queries == []


# --- disk ----------------------------------------------------------------------------------------

def test_disk_of_an_existing_directory(tmp_path):
    result = preflight.check_disk("disk:logs", str(tmp_path), preflight.LOG_MIN_FREE, "X")
    assert result.status is Status.OK
    assert result.detail.endswith(f" GiB free at {tmp_path}")
    free = float(result.detail.split()[0]) * preflight.GiB
    assert abs(free - shutil.disk_usage(tmp_path).free) < preflight.GiB  # others write too


def test_disk_of_a_directory_not_made_yet_uses_its_parent(tmp_path):
    target = tmp_path / "ckpt" / "run1"
    s = settings(tmp_path, PODAGENT_CHECKPOINT_DIR=str(target))
    result = row(preflight.run_checks(s, Role.HEAD), "disk:checkpoints")
    assert result.status in (Status.OK, Status.WARN)  # depends on this machine's free space
    assert f"GiB free at {tmp_path} ({target} does not exist yet)" in result.detail
    assert not target.parent.exists()  # a check creates nothing


def test_disk_below_the_minimum_warns(tmp_path):
    result = preflight.check_disk("disk:checkpoints", str(tmp_path), 1 << 62,
                                  "PODAGENT_CHECKPOINT_DIR")
    assert result.status is Status.WARN
    assert "PODAGENT_CHECKPOINT_DIR" in result.fix


def test_disk_of_a_file_fails(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    result = preflight.check_disk("disk:logs", str(file / "logs"), 1, "PODAGENT_LOG_DIR")
    assert result.status is Status.FAIL
    assert "not a directory" in result.detail


def test_no_checkpoint_dir_is_skipped(tmp_path):
    s = settings(tmp_path)
    if s.checkpoint_dir is not None:
        pytest.skip("this machine has /workspace, so a checkpoint dir is always set")
    result = row(preflight.run_checks(s, Role.HEAD), "disk:checkpoints")
    assert result.status is Status.SKIP


# --- shared memory -------------------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Path]:
    """A real 64 MiB tmpfs: Docker's default /dev/shm."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_docker_sized_shm_warns(small_tmpfs):
    result = preflight.check_shm(str(small_tmpfs), ram=2 * preflight.GiB)
    assert result.status is Status.WARN
    assert result.detail == f"{small_tmpfs}: 64 MiB free of 64 MiB; below 1.0 GiB Ray puts its " \
        "object store on disk and NCCL may fail between GPUs of this node"
    assert "--shm-size" in result.fix


def test_a_missing_shm_warns(tmp_path):
    result = preflight.check_shm(str(tmp_path / "nosuch"))
    assert result.status is Status.WARN
    assert "does not exist" in result.detail


def test_this_machines_shm_is_reported():
    result = preflight.check_shm()
    assert result.status in (Status.OK, Status.WARN)
    assert result.detail.startswith("/dev/shm: ") and "GiB free of" in result.detail


@pytest.mark.parametrize(("ram_gib", "wanted"), [
    (2, preflight.GiB),  # the floor for NCCL
    (16, int(0.3 * 16 * preflight.GiB)),  # Ray's object store: 30% of RAM
    (1024, 10**10),  # Ray caps what it insists on at 10 GB
])
def test_shm_wanted(ram_gib, wanted):
    assert preflight.shm_wanted(ram_gib * preflight.GiB) == wanted


# --- GPUs ----------------------------------------------------------------------------------------

H100 = preflight.Gpu("NVIDIA H100 80GB HBM3", "550.54.15")


def test_parse_nvidia_smi():
    text = "NVIDIA H100 80GB HBM3, 550.54.15\nNVIDIA H100 80GB HBM3, 550.54.15\n"
    assert preflight.parse_nvidia_smi(text) == (H100, H100)


@pytest.mark.parametrize(("gpus", "offered", "status", "words"), [
    ((), 0, Status.OK, "no GPUs (CPU node; the check job uses gloo)"),
    ((), 2, Status.FAIL, "Ray would be offered 2 GPU(s) (X) but none are visible"),
    ((H100, H100), 2, Status.OK, "2 × NVIDIA H100 80GB HBM3, driver 550.54.15 (nvidia-smi)"),
    ((H100, H100), 1, Status.OK, "Ray is offered 1 (X)"),
    ((H100,), 2, Status.WARN, "but X offers Ray 2"),
])
def test_judge_gpus(gpus, offered, status, words):
    sighting = preflight.GpuSighting(gpus, "nvidia-smi" if gpus else "")
    result = preflight.judge_gpus(sighting, offered, "X")
    assert result.status is status
    assert words in result.detail
    assert bool(result.fix) == (status is not Status.OK)


def test_this_machines_gpus_when_none_are_promised(tmp_path):
    result = preflight.check_gpus(settings(tmp_path, PODAGENT_NUM_GPUS="0"))
    assert result.status is Status.OK, result


def test_more_gpus_promised_than_any_pod_has(tmp_path):
    result = preflight.check_gpus(settings(tmp_path, PODAGENT_NUM_GPUS="1024"))
    assert result.status in (Status.FAIL, Status.WARN)  # FAIL with none, WARN with some
    assert "PODAGENT_NUM_GPUS=1024" in result.detail


# --- results: guard, fatal, table, JSON ----------------------------------------------------------

def test_a_check_that_raises_becomes_a_fail_row():
    def broken() -> CheckResult:
        raise RuntimeError("boom\nsecond line")

    result = preflight.guarded("shm", broken)
    assert result.name == "shm"
    assert result.status is Status.FAIL
    assert result.detail == "the check itself failed: RuntimeError: boom second line"
    assert result.fix


@pytest.mark.parametrize(("statuses", "expected"), [
    ((), False),
    ((Status.OK,), False),
    ((Status.OK, Status.WARN, Status.SKIP), False),
    ((Status.FAIL,), True),
    ((Status.OK, Status.FAIL, Status.WARN), True),
])
def test_fatal(statuses, expected):
    results = [CheckResult(f"c{i}", s, "d") for i, s in enumerate(statuses)]
    assert preflight.fatal(results) is expected


SAMPLE = [
    CheckResult("gpus", Status.OK, "no GPUs"),
    CheckResult("nofile", Status.WARN, "soft limit 1024", "ulimit -n 65536"),
    CheckResult("head_dns", Status.FAIL, "h.runpod.internal: NXDOMAIN", "start the head"),
    CheckResult("head_ray", Status.SKIP, "the head was not located"),
]


def test_render_table():
    assert preflight.render_table(SAMPLE).splitlines() == [
        "✓ gpus      no GPUs",
        "! nofile    soft limit 1024",
        "            fix: ulimit -n 65536",
        "✗ head_dns  h.runpod.internal: NXDOMAIN",
        "            fix: start the head",
        "- head_ray  the head was not located",
        "1 ok, 1 warn, 1 fail, 1 skip",
    ]


def test_to_json():
    report = json.loads(preflight.to_json(SAMPLE))
    assert report["ok"] is False
    assert report["checks"][1] == {"name": "nofile", "status": "warn",
                                   "detail": "soft limit 1024", "fix": "ulimit -n 65536"}
    assert [c["status"] for c in report["checks"]] == ["ok", "warn", "fail", "skip"]
    assert json.loads(preflight.to_json(SAMPLE[:2]))["ok"] is True


def test_a_full_run_on_this_pod_gives_one_row_per_check(tmp_path):
    results = preflight.run_checks(settings(tmp_path), Role.HEAD)
    assert all(isinstance(r.status, Status) and r.detail for r in results)
    assert all("the check itself failed" not in r.detail for r in results)
    table = preflight.render_table(results)
    assert len([line for line in table.splitlines() if line[:1] in "✓!✗-"]) == len(results)


def test_gpu_health_is_nvidia_smis_facts_as_a_start_judges_them(tmp_path, monkeypatch):
    """`podagent check` says before a start would: a GPU with memory errors fails the row."""
    from tests.fakes import nvidia_smi

    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = {"RUNPOD_GPU_COUNT": "1", "PODAGENT_LOG_DIR": str(tmp_path)}
    nvidia_smi.install(bin_dir, {"gpus": [{"name": "NVIDIA H200", "ecc": 0,
                                           "remap_pending": True}]})
    row = preflight.check_gpu_health(config.build({}, env))
    assert row.status is Status.FAIL and "a row remapping is pending" in row.detail
    assert "exits 28" in row.fix
    nvidia_smi.install(bin_dir, {"gpus": [{"name": "NVIDIA H200", "ecc": 0}]})
    assert preflight.check_gpu_health(config.build({}, env)).status is Status.OK
    nvidia_smi.install(bin_dir, {"mode": "old-driver", "gpus": [{"name": "NVIDIA H200"}]})
    assert preflight.check_gpu_health(config.build({}, env)).status is Status.WARN
    assert preflight.check_gpu_health(
        config.build({}, {**env, "PODAGENT_NUM_GPUS": "0"})).status is Status.SKIP

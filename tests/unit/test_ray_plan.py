"""ray_node: the `ray start` plan, GPU detection, node address choice, port check.

Runs on every tested Ray (ray_matrix): the plan must be one the installed `ray start` takes.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from podagent import config, limits
from podagent.cluster import ray_node
from podagent.config.names import RAY_OWNER
from podagent.errors import ConfigError, PortInUse
from podagent.platform import pod
from podagent.platform.roles import Role

pytestmark = pytest.mark.ray_matrix


def settings(**env: str) -> config.Settings:
    return config.build({}, env)


def after(argv: tuple[str, ...], option: str) -> str:
    assert argv.count(option) == 1, f"{option} appears {argv.count(option)} times in {argv}"
    return argv[argv.index(option) + 1]


# --- plan ---------------------------------------------------------------------------------------


def test_every_planned_option_is_one_the_installed_ray_start_takes():
    """Head and worker plans with every option on, against this image's own `ray start`."""
    s = settings(DEBUG_RAY="1", PODAGENT_RAY_TEMP_DIR="/tmp/r", PODAGENT_LISTEN="all")
    planned = set()
    for role in Role:
        argv = ray_node.plan(s, role, "10.0.0.2", 1, {}, head_ip="10.0.0.1").argv
        planned |= {word for word in argv if word.startswith("--")}
    # The options `ray start` declares, hidden ones too (--labels is, while it is beta).
    shown = subprocess.run([sys.executable, "-c", "from ray.scripts.scripts import start\n"
                            "print(' '.join(o for p in start.params for o in p.opts))"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    offered = set(re.findall(r"(?<![\w-])(--[a-z0-9-]+)", shown.stdout))
    assert planned <= offered, sorted(planned - offered)

def test_head_plan():
    p = ray_node.plan(settings(PODAGENT_RUN_NAME="podagent-t"), Role.HEAD, "10.0.0.5", 2,
                      {"NCCL_SOCKET_IFNAME": "podnet1"})
    argv = p.argv
    assert argv[0].endswith("ray") and argv[1] == "start"
    assert "--head" in argv
    assert after(argv, "--port") == "6379"
    assert after(argv, "--dashboard-host") == "10.0.0.5"
    assert after(argv, "--dashboard-port") == "8265"
    assert after(argv, "--node-ip-address") == "10.0.0.5"
    assert after(argv, "--num-gpus") == "2"
    assert "0.0.0.0" not in argv
    assert "--address" not in argv
    assert "--temp-dir" not in argv
    assert all(isinstance(word, str) for word in argv)
    assert dict(p.env_overrides) == {"NCCL_SOCKET_IFNAME": "podnet1",
                                     **ray_node.HEALTH_CHECK_ENV,
                                     "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "150",
                                     **ray_node.auth_env(settings()),
                                     RAY_OWNER: "podagent run podagent-t"}


def test_head_plan_uses_the_configured_ports_and_temp_dir():
    s = settings(PODAGENT_RAY_PORT="7000", PODAGENT_DASHBOARD_PORT="7001",
                 PODAGENT_RAY_TEMP_DIR="rt")
    argv = ray_node.plan(s, Role.HEAD, "10.0.0.5", 0, {}).argv
    assert after(argv, "--port") == "7000"
    assert after(argv, "--dashboard-port") == "7001"
    assert after(argv, "--temp-dir") == "rt"
    assert after(argv, "--num-gpus") == "0"


def test_worker_plan():
    s = settings(PODAGENT_RAY_PORT="7000", PODAGENT_RUN_NAME="run-7")
    p = ray_node.plan(s, Role.WORKER, "10.0.0.6", 1, {}, head_ip="10.0.0.5")
    # A worker's Ray is podagent's too: a later podagent on its pod stops it, never refuses it.
    assert p.env_overrides[RAY_OWNER] == "podagent run run-7"
    argv = p.argv
    assert argv[1] == "start"
    assert after(argv, "--address") == "10.0.0.5:7000"
    assert after(argv, "--node-ip-address") == "10.0.0.6"
    assert after(argv, "--num-gpus") == "1"
    for head_only in ("--head", "--port", "--dashboard-host", "--dashboard-port"):
        assert head_only not in argv


@pytest.mark.parametrize("role", [Role.HEAD, Role.WORKER])
def test_debug_ray_is_an_environment_entry_and_a_flag(role):
    nccl_vars = {"NCCL_IB_DISABLE": "1"}
    p = ray_node.plan(settings(DEBUG_RAY="1"), role, "10.0.0.5", 0, nccl_vars,
                      head_ip="10.0.0.1")
    assert p.env_overrides["RAY_DEBUG"] == "legacy"
    assert p.env_overrides["NCCL_IB_DISABLE"] == "1"
    assert p.argv[-1] == "--ray-debugger-external"
    assert not any("RAY_DEBUG" in word for word in p.argv)
    assert nccl_vars == {"NCCL_IB_DISABLE": "1"}  # the caller's mapping is left alone


@pytest.mark.parametrize("debug", [None, "0", ""])
@pytest.mark.parametrize("role", [Role.HEAD, Role.WORKER])
def test_without_debug_ray_neither(role, debug):
    env = {} if debug is None else {"DEBUG_RAY": debug}
    p = ray_node.plan(settings(**env), role, "10.0.0.5", 0, {}, head_ip="10.0.0.1")
    assert "RAY_DEBUG" not in p.env_overrides
    assert "--ray-debugger-external" not in p.argv


# --- listen addresses and node-loss detection -------------------------------------------------

@pytest.mark.parametrize("env", [{}, {"PODAGENT_LISTEN": "private"}])
def test_dashboard_listens_on_the_private_address_by_default(env):
    argv = ray_node.plan(settings(**env), Role.HEAD, "10.0.0.5", 0, {}).argv
    assert after(argv, "--dashboard-host") == "10.0.0.5"
    assert "0.0.0.0" not in argv


def test_listen_all_opens_the_dashboard_on_every_interface():
    s = settings(PODAGENT_LISTEN="all")
    argv = ray_node.plan(s, Role.HEAD, "10.0.0.5", 0, {}).argv
    assert after(argv, "--dashboard-host") == "0.0.0.0"
    assert after(argv, "--node-ip-address") == "10.0.0.5"  # Ray's own address stays private
    assert pod.listen_address(s, "10.0.0.5") == "0.0.0.0"
    assert pod.listen_address(settings(), "10.0.0.5") == "10.0.0.5"


def test_listen_rejects_anything_else():
    with pytest.raises(ConfigError, match="PODAGENT_LISTEN='public' must be one of"):
        settings(PODAGENT_LISTEN="public")


def test_head_gets_faster_health_checks_and_workers_do_not_need_them():
    head = ray_node.plan(settings(), Role.HEAD, "10.0.0.5", 0, {}).env_overrides
    worker = ray_node.plan(settings(), Role.WORKER, "10.0.0.6", 0, {},
                           head_ip="10.0.0.5").env_overrides
    for name, value in ray_node.HEALTH_CHECK_ENV.items():
        assert head[name] == value
        assert name not in worker  # the GCS (on the head) runs the checks
    period, timeout, threshold = (int(ray_node.HEALTH_CHECK_ENV[f"RAY_health_check_{n}"])
                                  for n in ("period_ms", "timeout_ms", "failure_threshold"))
    # A pod gone from the network (every check times out) is dead within the 15 s the head
    # promises; a live one must miss several checks in a row first.
    assert threshold * (timeout + period) <= 13_000 and threshold >= 3


def test_users_own_health_check_setting_wins():
    s = settings(RAY_health_check_period_ms="3000")
    env = ray_node.plan(s, Role.HEAD, "10.0.0.5", 0, {}).env_overrides
    assert "RAY_health_check_period_ms" not in env  # inherited from the user's environment
    assert env["RAY_health_check_failure_threshold"] == "4"


def test_head_gives_its_dashboard_time_to_start_and_a_users_value_wins():
    head = ray_node.plan(settings(), Role.HEAD, "10.0.0.5", 0, {}).env_overrides
    worker = ray_node.plan(settings(), Role.WORKER, "10.0.0.6", 0, {},
                           head_ip="10.0.0.5").env_overrides
    # Longer than Ray's own 60 s, inside the head's bound on the whole `ray start`.
    assert 60 < int(head["RAY_DASHBOARD_STARTUP_TIMEOUT_S"]) < 180
    assert "RAY_DASHBOARD_STARTUP_TIMEOUT_S" not in worker  # workers start no dashboard
    own = ray_node.plan(settings(RAY_DASHBOARD_STARTUP_TIMEOUT_S="30"), Role.HEAD,
                        "10.0.0.5", 0, {}).env_overrides
    assert "RAY_DASHBOARD_STARTUP_TIMEOUT_S" not in own  # inherited from the user's env


# --- detect_gpus --------------------------------------------------------------------------------

@pytest.fixture
def fake_dev(tmp_path, monkeypatch):
    """Points detect_gpus's /dev at an empty temporary directory; returns that directory."""
    real = pathlib.Path

    def path(*parts):
        return tmp_path if parts == ("/dev",) else real(*parts)

    monkeypatch.setattr(pod, "Path", path)
    return tmp_path


def _devices(dev: pathlib.Path, *names: str) -> None:
    for name in names:
        (dev / name).touch()


# (environment, flags, device files in /dev, expected count, expected source)
GPUS = [
    ({"PODAGENT_NUM_GPUS": "3", "CUDA_VISIBLE_DEVICES": "0"}, {}, ["nvidia0"], 3,
     "PODAGENT_NUM_GPUS"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, {"num_gpus": "5"}, [], 5, "--num-gpus"),
    ({"PODAGENT_NUM_GPUS": "0", "RUNPOD_GPU_COUNT": "8"}, {}, [], 0, "PODAGENT_NUM_GPUS"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {}, ["nvidia0", "nvidia1", "nvidia2", "nvidia3"], 2,
     "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d,GPU-5e6f"}, {}, [], 3, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": ""}, {}, ["nvidia0"], 0, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, {}, ["nvidia0"], 0, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "-1", "RUNPOD_GPU_COUNT": "4"}, {}, [], 0, "CUDA_VISIBLE_DEVICES"),
    ({}, {}, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"], 2,
     "/dev/nvidia*"),
    ({"RUNPOD_GPU_COUNT": "8"}, {}, ["nvidia0"], 1, "/dev/nvidia*"),
    ({"RUNPOD_GPU_COUNT": "4"}, {}, ["nvidiactl"], 4, "RUNPOD_GPU_COUNT"),
    ({"RUNPOD_GPU_COUNT": "four"}, {}, [], 0, "no GPU found"),
    ({}, {}, [], 0, "no GPU found"),
]


@pytest.mark.parametrize(("env", "flags", "devices", "count", "source"), GPUS)
def test_detect_gpus(fake_dev, env, flags, devices, count, source):
    _devices(fake_dev, *devices)
    assert pod.detect_gpus(config.build(flags, env)) == (count, source)


def test_detect_gpus_stops_at_an_invalid_index(fake_dev):
    assert pod.detect_gpus(settings(CUDA_VISIBLE_DEVICES="0,-1,1")) == (
        1, "CUDA_VISIBLE_DEVICES")


# --- choose_node_ip -----------------------------------------------------------------------------

IFACES = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"], "podnet1": ["10.0.0.5"]}
TWO = {"EXPECTED_WORKERS": "1"}  # a head that waits for a worker: others must reach it

# (environment, head ip, interfaces, NCCL_SOCKET_IFNAME, address, words of the reason)
NODE_IPS = [
    ({"PODAGENT_NODE_IP": "10.0.0.7", "NODE_ADDR": "10.65.0.2"}, "127.0.0.1", IFACES, "podnet1",
     "10.0.0.7", ["PODAGENT_NODE_IP"]),
    ({"NODE_ADDR": "10.65.0.2"}, "127.0.0.1", IFACES, "podnet1", "10.65.0.2", ["NODE_ADDR"]),
    ({}, "127.0.0.1", IFACES, "podnet1", "10.0.0.5", ["podnet1", "NCCL_SOCKET_IFNAME"]),
    ({}, None, {"lo": ["127.0.0.1"], "ens1": [], "ens2": ["10.1.0.2"]}, "ens", "10.1.0.2",
     ["ens2", "NCCL_SOCKET_IFNAME"]),
    (TWO, None, {"lo": ["127.0.0.1"], "eth1": ["192.168.1.2"], "eth0": ["172.17.0.2"]},
     "^docker", "172.17.0.2", ["first non-loopback", "eth0"]),
    ({}, "127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"]}, "podnet1", "127.0.0.1",
     ["route to the head", "lo"]),
    ({}, "127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"]}, None, "127.0.0.1",
     ["route to the head", "lo"]),
    (TWO, None, {"lo": ["127.0.0.1"], "eth1": ["192.168.1.2"], "eth0": ["172.17.0.2"]}, None,
     "172.17.0.2", ["first non-loopback address (eth0)"]),
    (TWO, None, {"lo": ["127.0.0.1"]}, None, "127.0.0.1", ["no other address"]),
    (TWO, None, {}, None, "127.0.0.1", ["no other address"]),
    # The head of a one-node cluster: nothing else needs to reach it, whatever this machine has.
    ({}, None, {"lo": ["127.0.0.1"], "eth0": ["203.0.113.5"]}, None, "127.0.0.1",
     ["loopback: a one-node cluster"]),
]


@pytest.mark.parametrize(("env", "head_ip", "ifaces", "ifname", "address", "words"), NODE_IPS)
def test_choose_node_ip(env, head_ip, ifaces, ifname, address, words):
    ip, reason = pod.choose_node_ip(settings(**env), head_ip, ifaces, ifname)
    assert ip == address
    for word in words:
        assert word in reason


def test_choose_node_ip_flag_is_named_as_a_flag():
    s = config.build({"node_ip": "10.0.0.8"}, {"PODAGENT_NODE_IP": "10.0.0.7"})
    assert pod.choose_node_ip(s, None, IFACES) == ("10.0.0.8", "--node-ip")


# --- check_port_free ----------------------------------------------------------------------------

def test_port_in_use_names_the_port_and_this_process():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse) as info:
            ray_node.check_port_free("127.0.0.1", port)
    assert info.value.port == port
    message = str(info.value)
    assert f"port {port} on 127.0.0.1 is already in use" in message
    assert f"pid {os.getpid()}" in message


def test_free_port_passes():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert ray_node.check_port_free("127.0.0.1", port) is None


@pytest.mark.parametrize(("address", "private"), [
    ("10.65.0.9", True), ("172.16.4.1", True), ("172.32.0.1", False), ("192.168.1.5", True),
    ("100.64.0.7", True), ("100.128.0.1", False), ("127.0.0.1", True), ("fd12::1", True),
    ("::1", True), ("203.0.113.5", False), ("192.0.2.2", False), ("8.8.8.8", False),
    ("2001:db8::1", False), ("not an address", False),
])
def test_which_addresses_count_as_private(address, private):
    """RFC 1918, CGNAT, ULA and loopback; not the documentation ranges Python calls private."""
    assert pod.is_private(address) is private


def test_listen_private_refuses_a_public_address_naming_it_and_how_it_was_chosen():
    settings = config.build({}, {})
    with pytest.raises(ConfigError) as refused:
        pod.require_private(settings, "203.0.113.5", "first non-loopback address (eth0)")
    assert "203.0.113.5 (first non-loopback address (eth0)) is not one" in str(refused.value)
    pod.require_private(settings, "10.0.0.2", "address of podnet1")  # private: fine
    pod.require_private(config.build({}, {"PODAGENT_LISTEN": "all"}), "203.0.113.5", "")


LIMITS_PROBE = """
import resource, sys
from podagent import limits
nofile_hard = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, nofile_hard))
raised, warnings = limits.raise_to_hard(int(sys.argv[2]))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
print(raised)
print(warnings)
"""


def _limits_probe(nofile_hard: int, nodes: int) -> list[str]:
    # In a child: a process cannot raise its hard limit again once it lowered it.
    out = subprocess.run([sys.executable, "-c", LIMITS_PROBE, str(nofile_hard), str(nodes)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.splitlines()


def test_soft_limits_are_raised_to_the_hard_ones_and_said():
    soft, raised, warnings = _limits_probe(8192, 4)
    assert soft == "8192"
    assert "open files 256 -> 8,192" in raised
    assert "open files" not in warnings  # 8,192 covers 4 nodes


def test_a_hard_limit_short_for_the_cluster_is_warned_with_the_number_needed():
    needed = limits.OPEN_FILES_BASE + limits.OPEN_FILES_PER_NODE * 1000
    _, _, warnings = _limits_probe(4096, 1000)
    assert (f"the open files limit of this pod is 4,096 (hard), and a cluster of 1000 node(s) "
            f"needs about {needed:,} here") in warnings


@pytest.mark.parametrize(("pod_id", "host", "label"), [
    ("abc123xyz", "ignored", "abc123xyz"),  # a RunPod pod id is a label value as it is
    (None, "node-7.cluster.local", "node-7.cluster.local"),
    (None, "odd host/name:1", "odd-host-name-1"),
    (None, "h" * 80, "h" * 63),
    (None, "---", None)])  # nothing left of it: no pod label
def test_each_node_carries_its_pod_and_role_as_labels(
        pod_id, host, label, monkeypatch):
    from podagent.cluster import runstate

    monkeypatch.setattr(ray_node.socket, "gethostname", lambda: host)
    env = {"RUNPOD_POD_ID": pod_id} if pod_id else {}
    for role in Role:
        plan = ray_node.plan(settings(**env), role, "10.0.0.2", 0, {}, head_ip="10.0.0.1")
        labels = dict(pair.split("=") for pair in after(plan.argv, "--labels").split(","))
        expected = {runstate.LABEL_ROLE: role.value}
        if label is not None:
            expected[runstate.LABEL_POD] = label
        assert labels == expected


# --- a raylet's last words ----------------------------------------------------------------------


@pytest.fixture
def temp(tmp_path, monkeypatch) -> pathlib.Path:
    """Ray's default temp dir moved to tmp_path (the setting's own path must be short)."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return tmp_path / "ray"


def _raylet_log(temp: pathlib.Path, text: str) -> None:
    logs = temp / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(text)


def test_a_raylets_last_error_line_says_why_it_exited(temp):
    _raylet_log(temp, "\n".join([
        "[2026-11-28 05:01:58,100 I 41 41] main.cc:120: Raylet started",
        "[2026-11-28 05:02:01,200 E 41 60] node_manager.cc:900: first error",
        "[2026-11-28 05:02:02,300 W 41 41] node_manager.cc:910: a warning",
        "[2026-11-28 05:02:02,400 C 41 41] (raylet) node_manager.cc:1040: [Timeout] the "
        "node was marked dead\x1b",
        "*** StackTrace Information ***",
        "    /usr/lib/raylet(+0x1234)",
    ]) + "\n")
    said = ray_node.raylet_last_words(settings())
    assert said == "[Timeout] the node was marked dead"


@pytest.mark.parametrize("text", [None, "", "[2026-11-28 05:01:58,100 I 41 41] main.cc:1: ok\n",
                                  "\x00\xff garbage without a single Ray log line\n"])
def test_a_raylet_that_left_no_error_line_says_nothing(temp, text):
    if text is not None:
        _raylet_log(temp, text)
    assert ray_node.raylet_last_words(settings()) == ""


def test_only_the_end_of_a_large_raylet_log_is_read_and_the_line_is_bounded(temp):
    early = "[2026-11-28 05:00:00,000 E 41 41] a.cc:1: an early error\n"
    filler = "[2026-11-28 05:00:01,000 I 41 41] a.cc:2: " + "x" * 200 + "\n"
    last = "[2026-11-28 05:02:00,000 E 41 41] a.cc:3: " + "y" * 1000 + "\n"
    _raylet_log(temp, early + filler * (2 * ray_node.LAST_WORDS_READ // len(filler)) + last)
    said = ray_node.raylet_last_words(settings())
    assert said == "y" * ray_node.LAST_WORDS_MAX

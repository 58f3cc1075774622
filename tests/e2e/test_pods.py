"""Prove the fake-pod harness is real: routing, DNS, interface names, teardown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import MakePod
from tests.harness.pods import (
    RUNPOD_ZONE,
    CommandError,
    DnsServer,
    Pod,
    PodNetwork,
    cleanup_stale,
    list_netns,
    wait_for,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

ECHO_SERVER = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen()
while True:
    conn, (peer, _) = srv.accept()
    with conn:
        conn.sendall(f"{peer} {conn.recv(1024).decode()}".encode())
"""

ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    c.sendall(sys.argv[3].encode())
    c.shutdown(socket.SHUT_WR)
    print(c.recv(1024).decode())
"""

# Prints one word classifying the outcome, so the test asserts on what a
# resolver inside the pod really saw.
RESOLVE = """
import sys
import dns.exception, dns.resolver
server, port, name, rdtype, proto, lifetime = sys.argv[1:]
r = dns.resolver.Resolver(configure=False)
r.nameservers = [server]
r.port = int(port)
try:
    ans = r.resolve(name, rdtype, tcp=proto == "tcp", lifetime=float(lifetime), search=False)
except dns.resolver.NXDOMAIN:
    print("NXDOMAIN")
except dns.resolver.NoAnswer:
    print("NOANSWER")
except dns.resolver.NoNameservers:
    print("NONAMESERVERS")
except dns.exception.Timeout:
    print("TIMEOUT")
else:
    print("OK", " ".join(sorted(a.address for a in ans)))
"""

IF_NAMES = "import socket; print(' '.join(n for _, n in socket.if_nameindex()))"

# Leaves a child in a new session (escaping the process group) so only the
# namespace-wide kill can catch it.
SLEEPER = """
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

# A run that crashes: builds a network with a busy pod and exits without close().
CRASHING_RUN = """
import json, os, subprocess, sys
from tests.harness.pods import PodNetwork
net = PodNetwork()
pod = net.add_pod("x")
p = pod.popen([sys.executable, "-c", "import time; time.sleep(600)"],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
info = {"token": net.token, "netns": pod.netns, "bridge": net.bridge, "pid": p.pid}
print(json.dumps(info), flush=True)
os._exit(1)
"""


def _dead(pid: int) -> bool:
    # Orphans may stay zombies if PID 1 does not reap; zombies count as dead.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _resources(token: str) -> list[str]:
    return [n for n in list_netns() + [n for _, n in socket.if_nameindex()] if token in n]


def test_pods_reach_each_other_over_tcp(make_pod: MakePod) -> None:
    a, b = make_pod("a"), make_pod("b")
    assert (a.ip.split(".")[-1], b.ip.split(".")[-1]) == ("1", "2")
    server = a.popen([sys.executable, "-c", ECHO_SERVER, a.ip, "7000"])
    wait_for(lambda: a.tcp_listening(7000), timeout=5, what="echo server in pod a")
    assert server.poll() is None
    out = b.run([sys.executable, "-c", ECHO_CLIENT, a.ip, "7000", "hello"], timeout=10, check=True)
    # The server saw pod b's own address: traffic really crossed the bridge.
    assert out.stdout.strip() == f"{b.ip} hello"


def test_dns_answers_inside_pod(make_pod: MakePod, dns_server: DnsServer) -> None:
    a = make_pod("a", register=True)
    b = make_pod("b")
    late = make_pod("late")

    def resolve(name: str, rdtype: str = "A", proto: str = "udp", lifetime: float = 2.0) -> str:
        argv = [
            sys.executable,
            "-c",
            RESOLVE,
            dns_server.address,
            str(dns_server.port),
            name,
            rdtype,
            proto,
            str(lifetime),
        ]
        return b.run(argv, timeout=10, check=True).stdout.strip()

    assert resolve(a.dns_name) == f"OK {a.ip}"
    assert resolve(a.dns_name.upper() + ".") == f"OK {a.ip}"
    assert resolve(a.dns_name, proto="tcp") == f"OK {a.ip}"
    assert resolve(a.dns_name, "AAAA") == "NOANSWER"
    assert resolve(f"nosuchpod.{RUNPOD_ZONE}") == "NXDOMAIN"
    assert resolve(late.dns_name) == "NXDOMAIN"
    dns_server.set_record(late.dns_name, late.ip)
    assert resolve(late.dns_name) == f"OK {late.ip}"
    dns_server.remove_record(late.dns_name)
    assert resolve(late.dns_name) == "NXDOMAIN"

    log = dns_server.queries_for(a.dns_name)
    assert [(q.qtype, q.result, q.answers, q.protocol) for q in log] == [
        ("A", "NOERROR", (a.ip,), "udp"),
        ("A", "NOERROR", (a.ip,), "udp"),
        ("A", "NOERROR", (a.ip,), "tcp"),
        ("AAAA", "NOERROR", (), "udp"),
    ]
    assert {q.client[0] for q in dns_server.queries} == {b.ip}


def test_dns_failure_modes(make_pod: MakePod, dns_server: DnsServer) -> None:
    a = make_pod("a", register=True)
    b = make_pod("b")

    def resolve(lifetime: float) -> str:
        argv = [
            sys.executable,
            "-c",
            RESOLVE,
            dns_server.address,
            str(dns_server.port),
            a.dns_name,
            "A",
            "udp",
            str(lifetime),
        ]
        return b.run(argv, timeout=10, check=True).stdout.strip()

    dns_server.mode = "servfail"
    assert resolve(2.0) == "NONAMESERVERS"
    dns_server.mode = "timeout"
    assert resolve(0.3) == "TIMEOUT"
    dns_server.mode = "normal"
    assert resolve(2.0) == f"OK {a.ip}"
    results = [q.result for q in dns_server.queries_for(a.dns_name)]
    assert results[0] == "SERVFAIL"
    assert "DROPPED" in results
    assert results[-1] == "NOERROR"
    with pytest.raises(ValueError):
        dns_server.mode = "bogus"


@pytest.mark.parametrize("ifname", ["podnet1", "ens1"])
def test_interface_named_as_asked(make_pod: MakePod, pod_network: PodNetwork, ifname: str) -> None:
    pod = make_pod("p", ifname=ifname)
    assert pod.ifname == ifname
    assert pod.run([sys.executable, "-c", IF_NAMES], check=True).stdout.split() == ["lo", ifname]
    addrs = pod.run(["ip", "-o", "-4", "addr", "show", "dev", ifname], check=True).stdout
    assert f"inet {pod.ip}/24" in addrs
    route = pod.run(["ip", "route", "show", "default"], check=True).stdout
    assert f"via {pod_network.host_ip} dev {ifname}" in route


def test_env_is_exactly_what_caller_gives(make_pod: MakePod) -> None:
    pod = make_pod("p")
    env = {"PATH": os.environ.get("PATH", os.defpath), "ONLY_THIS": "1"}
    out = pod.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        env=env,
        check=True,
    )
    # LC_CTYPE may be added by Python's own C-locale coercion in the child.
    assert {k: v for k, v in json.loads(out.stdout).items() if k != "LC_CTYPE"} == env


def test_close_removes_everything_and_kills_pod_processes(
    pod_network: PodNetwork, tmp_path: Path
) -> None:
    pods: list[Pod] = [pod_network.add_pod("a"), pod_network.add_pod("b", ifname="ens1")]
    pidfiles = [tmp_path / f"{p.name}.pids" for p in pods]
    procs = [
        p.popen([sys.executable, "-c", SLEEPER, str(f)])
        for p, f in zip(pods, pidfiles, strict=True)
    ]
    pids = [
        int(x)
        for f in pidfiles
        for x in wait_for(lambda f=f: f.exists() and f.read_text(), 5, what=str(f)).split()
    ]
    assert all(not _dead(pid) for pid in pids)
    assert set(pods[0].pids()) >= {procs[0].pid}

    # A failing ip command names argv, exit code and stderr; its half-built pod is still torn down.
    with pytest.raises(CommandError) as err:
        pod_network.add_pod("bad", ifname="x" * 20)
    assert err.value.argv[0] == "ip" and err.value.returncode != 0 and err.value.stderr
    assert "'ip'" in str(err.value) and str(err.value.returncode) in str(err.value)
    assert _resources(pod_network.token)

    pod_network.close()
    pod_network.close()  # idempotent
    assert _resources(pod_network.token) == []
    assert all(_dead(pid) for pid in pids), [(pid, _dead(pid)) for pid in pids]
    assert all(p.returncode is not None for p in procs)


def test_remove_pod_kills_and_deletes_that_pod_only(
    pod_network: PodNetwork, tmp_path: Path
) -> None:
    gone, kept = pod_network.add_pod("gone"), pod_network.add_pod("kept")
    pidfile = tmp_path / "gone.pids"
    proc = gone.popen([sys.executable, "-c", SLEEPER, str(pidfile)])
    pids = [int(x) for x in wait_for(lambda: pidfile.exists() and pidfile.read_text(), 5,
                                     what=str(pidfile)).split()]

    pod_network.remove_pod(gone)
    assert all(_dead(pid) for pid in pids) and proc.returncode is not None
    assert gone.netns not in list_netns() and kept.netns in list_netns()
    assert gone.host_veth not in [n for _, n in socket.if_nameindex()]
    assert pod_network.pods == [kept]
    with pytest.raises(ValueError):
        pod_network.remove_pod(gone)
    # Its address is reused last; the next pod gets a fresh one.
    assert pod_network.add_pod("next").ip not in (gone.ip, kept.ip)
    pod_network.close()
    assert _resources(pod_network.token) == []


def _mac(link: str) -> str:
    return Path(f"/sys/class/net/{link}/address").read_text().strip()


def test_the_host_stays_reachable_when_a_pod_is_removed(pod_network: PodNetwork) -> None:
    """The host's address (the DNS server, a fake API) answers the pods left at once: a bridge
    that took its lowest port's MAC would change it with that pod gone, and each other pod's
    ARP entry for the host would point nowhere for half a minute."""
    pods = [pod_network.add_pod(f"m{i}") for i in range(4)]
    bridge_mac = _mac(pod_network.bridge)
    with socket.create_server((pod_network.host_ip, 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(10)

        def reached_from(pod: Pod) -> str:
            client = pod.popen([sys.executable, "-c", ECHO_CLIENT, pod_network.host_ip,
                                str(port), pod.name], stdout=subprocess.PIPE)
            conn, (peer, _) = server.accept()
            with conn:
                conn.sendall(b"ok")
            client.communicate(timeout=10)
            return peer

        assert [reached_from(p) for p in pods] == [p.ip for p in pods]  # each has its entry
        lowest = min(pods, key=lambda p: _mac(p.host_veth))
        pod_network.remove_pod(lowest)
        left = [p for p in pods if p is not lowest]
        assert _mac(pod_network.bridge) == bridge_mac
        # ECHO_CLIENT's 5 s connect timeout: far below the half minute of a stale entry.
        assert [reached_from(p) for p in left] == [p.ip for p in left]


def test_cleanup_stale_removes_crashed_run_only(pod_network: PodNetwork) -> None:
    live = pod_network.add_pod("live")
    out = subprocess.run(
        [sys.executable, "-c", CRASHING_RUN],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1, out.stderr
    crashed = json.loads(out.stdout)
    assert crashed["netns"] in list_netns()
    assert not _dead(crashed["pid"])

    removed = cleanup_stale()
    assert crashed["netns"] in removed and crashed["bridge"] in removed
    assert _resources(crashed["token"]) == []
    wait_for(lambda: _dead(crashed["pid"]), 5, what="crashed run's pod process to die")
    # The live network (lock held) is untouched.
    assert live.netns in list_netns()
    assert live.run(["ip", "-o", "link", "show", live.ifname], check=True).returncode == 0

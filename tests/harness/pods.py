"""Fake RunPod "pods" for end-to-end tests: Linux network namespaces on a
private bridge, plus a real DNS server answering ``<pod_id>.runpod.internal``.

Plain module (no pytest import) so benchmarks can reuse it. Needs root and
iproute2's ``ip``, or pyroute2 where ``ip`` is missing (netlink.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import tenacity
from dnslib import QTYPE, RCODE, RR, SOA, A, DNSError, DNSRecord
from dnslib.server import DNSHandler, DNSServer

__all__ = [
    "DEFAULT_PREFIX",
    "NETNS_DIR",
    "RUNPOD_ZONE",
    "CommandError",
    "DnsServer",
    "Pod",
    "PodNetwork",
    "QueryLogEntry",
    "cleanup_stale",
    "list_netns",
    "netns_pids",
    "random_pod_id",
    "run_cmd",
    "wait_for",
]

RUNPOD_ZONE = "runpod.internal"
DEFAULT_PREFIX = "pa"
NETNS_DIR = "/var/run/netns"
IFNAMSIZ = 15  # kernel limit on interface names (16 incl. NUL)

# Lock files live where namespaces do (cleared on reboot, like them). A live
# PodNetwork holds an flock on its own file; cleanup_stale only touches
# resources whose lock nobody holds, so concurrent runs never clobber each
# other.
_LOCK_DIR = Path("/run" if os.path.isdir("/run") else tempfile.gettempdir()) / "podagent-e2e"
_ALLOC_LOCK = "alloc.lock"
_DEFAULT_SUPERNET = ipaddress.IPv4Network("10.213.0.0/16")
_CMD_TIMEOUT = 30.0

T = TypeVar("T")


# --------------------------------------------------------------------------
# small helpers


class CommandError(RuntimeError):
    """A helper command (e.g. ``ip``) failed."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, stdout: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        detail = stderr.strip() or stdout.strip() or "<no output>"
        super().__init__(f"command {self.argv!r} exited with {returncode}: {detail}")


def run_cmd(
    argv: Sequence[str], *, check: bool = True, timeout: float = _CMD_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run an argv list (never a shell string); raise CommandError on failure."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr, proc.stdout)
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if shutil.which("ip") is not None:
        return run_cmd(["ip", *args], check=check)
    from tests.harness import netlink  # a host without iproute2: the same lines via pyroute2

    proc = netlink.ip(args)
    if check and proc.returncode != 0:
        raise CommandError(proc.args, proc.returncode, proc.stderr)
    return proc


def _local_mac() -> str:
    """A random locally administered unicast MAC address."""
    return ":".join(f"{b:02x}" for b in (0x02, *secrets.token_bytes(5)))


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that.

    Exceptions listed in ``ignore`` count as "not yet" (e.g. OSError while a
    server starts). On expiry raises TimeoutError naming ``what`` and the last
    value or exception seen.
    """
    last: list[Any] = ["<never called>"]

    def attempt() -> T:
        try:
            value = predicate()
        except ignore as exc:
            last[0] = exc
            raise
        last[0] = value
        return value

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout),
        wait=tenacity.wait_fixed(interval),
        retry=tenacity.retry_if_result(lambda v: not v) | tenacity.retry_if_exception_type(ignore),
        reraise=False,
    )
    try:
        return retrying(attempt)
    except tenacity.RetryError:
        raise TimeoutError(
            f"timed out after {timeout:g}s waiting for {what}; last value: {last[0]!r}"
        ) from None


def random_pod_id(length: int = 14) -> str:
    """A RunPod-like pod id: lowercase alphanumerics."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(netns: str) -> list[int]:
    """PIDs of all processes whose network namespace is ``netns``."""
    proc = _ip("netns", "pids", netns, check=False)
    if proc.returncode != 0:
        if not os.path.exists(os.path.join(NETNS_DIR, netns)):
            return []
        raise CommandError(["ip", "netns", "pids", netns], proc.returncode, proc.stderr)
    return [int(tok) for tok in proc.stdout.split()]


def _link_exists(name: str) -> bool:
    # if_nametoindex asks the kernel for our own netns (no /sys involved).
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


def _list_links() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


# --------------------------------------------------------------------------
# DNS


@dataclasses.dataclass(frozen=True)
class QueryLogEntry:
    name: str  # normalised: lowercase, no trailing dot
    qtype: str  # "A", "AAAA", ...
    result: str  # rcode name ("NOERROR", "NXDOMAIN", ...) or "DROPPED"
    answers: tuple[str, ...]
    time: float  # time.monotonic()
    client: tuple[str, int]
    protocol: str  # "udp" | "tcp"


class _DropReply(DNSError):
    # dnslib's handler swallows DNSError without replying: exactly a timeout.
    pass


class _QuietLogger:
    """dnslib logger that prints nothing (pytest output stays readable)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def _noop(self, *_args: Any) -> None:
        pass

    log_recv = log_send = log_request = log_reply = log_truncated = log_data = _noop

    def log_error(self, handler: Any, exc: Any) -> None:
        if not isinstance(exc, _DropReply):
            self.errors.append(f"{handler.client_address}: {exc}")


def _norm(name: str) -> str:
    return str(name).rstrip(".").lower()


class DnsServer:
    """Authoritative DNS server for one zone, running in background threads.

    Serves A records (one or several per name) from a mutable map with TTL 1. Unknown names
    inside the
    zone get NXDOMAIN, names outside it REFUSED. ``mode`` switches failure
    injection at runtime: "normal", "servfail" or "timeout" (no reply).
    """

    MODES = ("normal", "servfail", "timeout")

    def __init__(
        self, address: str = "127.0.0.1", port: int = 0, zone: str = RUNPOD_ZONE, tcp: bool = True
    ):
        self.address = address
        self._requested_port = port
        self.zone = _norm(zone)
        self.tcp = tcp
        self._lock = threading.Lock()
        self._records: dict[str, tuple[str, ...]] = {}
        self._mode = "normal"
        self._log: list[QueryLogEntry] = []
        self._servers: list[DNSServer] = []
        self._threads: list[threading.Thread] = []
        self._port: int | None = None
        self.logger = _QuietLogger()

    # -- records and modes --------------------------------------------------

    def set_record(self, name: str, ip: str) -> None:
        self.set_records(name, [ip])

    def set_records(self, name: str, ips: Sequence[str]) -> None:
        """Several A records for one name, answered in this order (a stale record left
        beside a new one, as a DNS service that lags behind may do)."""
        for ip in ips:
            ipaddress.IPv4Address(ip)  # validate early, not inside the server thread
        with self._lock:
            self._records[_norm(name)] = tuple(ips)

    def remove_record(self, name: str) -> None:
        with self._lock:
            self._records.pop(_norm(name), None)

    @property
    def records(self) -> dict[str, tuple[str, ...]]:
        with self._lock:
            return dict(self._records)

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, not {value!r}")
        with self._lock:
            self._mode = value

    @property
    def queries(self) -> list[QueryLogEntry]:
        with self._lock:
            return list(self._log)

    def queries_for(self, name: str) -> list[QueryLogEntry]:
        n = _norm(name)
        return [q for q in self.queries if q.name == n]

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("DnsServer not started")
        return self._port

    # -- dnslib resolver interface -----------------------------------------

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        qname = str(request.q.qname)
        name = _norm(qname)
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        with self._lock:
            mode = self._mode
            ips = self._records.get(name)
        reply = request.reply()
        answers: tuple[str, ...] = ()
        in_zone = name == self.zone or name.endswith("." + self.zone)
        if mode == "timeout":
            self._record(name, qtype, "DROPPED", (), handler)
            raise _DropReply("dropped on purpose (mode=timeout)")
        if mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
        elif not in_zone:
            reply.header.rcode = RCODE.REFUSED
        elif ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            reply.add_auth(self._soa())
        elif request.q.qtype == QTYPE.A:
            for ip in ips:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(ip), ttl=1))
            answers = ips
        else:
            reply.add_auth(self._soa())  # NODATA: name exists, no such type
        self._record(
            name, qtype, RCODE.get(reply.header.rcode, str(reply.header.rcode)), answers, handler
        )
        return reply

    def _soa(self) -> RR:
        # SOA minimum = 1 s so negative answers are not cached long either.
        soa = SOA(f"ns.{self.zone}", f"hostmaster.{self.zone}", (1, 60, 60, 60, 1))
        return RR(self.zone + ".", QTYPE.SOA, rdata=soa, ttl=1)

    def _record(
        self, name: str, qtype: str, result: str, answers: tuple[str, ...], handler: DNSHandler
    ) -> None:
        entry = QueryLogEntry(
            name=name,
            qtype=qtype,
            result=result,
            answers=answers,
            time=time.monotonic(),
            client=tuple(handler.client_address[:2]),
            protocol=getattr(handler, "protocol", "?"),
        )
        with self._lock:
            self._log.append(entry)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> DnsServer:
        if self._servers:
            return self
        attempts = 20 if self._requested_port == 0 else 1
        for attempt in range(attempts):
            udp = DNSServer(
                self, address=self.address, port=self._requested_port, logger=self.logger
            )
            port = udp.server.server_address[1]
            if not self.tcp:
                self._servers = [udp]
                break
            try:
                tcp = DNSServer(self, address=self.address, port=port, tcp=True, logger=self.logger)
            except OSError as exc:
                udp.server.server_close()
                # The free UDP port may be taken for TCP; pick another one.
                if exc.errno != errno.EADDRINUSE or attempt == attempts - 1:
                    raise
                continue
            self._servers = [udp, tcp]
            break
        self._port = port
        for srv in self._servers:
            # Short poll interval keeps stop() fast.
            t = threading.Thread(
                target=srv.server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"dns-{self.address}:{port}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        servers, self._servers = self._servers, []
        threads, self._threads = self._threads, []
        for srv in servers:
            srv.server.shutdown()
            srv.server.server_close()
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"DnsServer({self.address}:{self._port}, zone={self.zone!r}, mode={self._mode!r})"


# --------------------------------------------------------------------------
# pods

# Runs argv inside a network namespace. We setns() ourselves instead of using
# `ip netns exec`, because that also unshares the mount namespace and remounts
# /sys, hiding /sys/fs/cgroup (Ray reads cgroup limits from there). Only the
# network namespace differs from the host, as in a container. Caveat:
# /sys/class/net still shows the host's interfaces; use netlink-based APIs
# (ip, psutil, socket.if_nameindex) inside a pod. os.setns is 3.12+, so fall
# back to libc via ctypes. -I -S: the caller's PYTHON* env must not affect us.
# After setns it writes one byte to the sync fd, so popen() returns only once
# the child is inside the pod (else a quick close() could miss it).
_LAUNCHER = r"""
import os, sys
ns_path, sync_fd, exe, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
if hasattr(os, "setns"):
    os.setns(fd, os.CLONE_NEWNET)
else:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), ns_path)
os.close(fd)
os.write(sync_fd, b"1")
os.close(sync_fd)
os.execve(exe, argv, os.environ)
"""


class Pod:
    """One fake pod: a network namespace with one interface on the bridge."""

    def __init__(
        self,
        network: PodNetwork,
        name: str,
        netns: str,
        ip: str,
        ifname: str,
        host_veth: str,
        pod_id: str,
    ):
        self.network = network
        self.name = name
        self.netns = netns
        self.ip = ip
        self.ifname = ifname
        self.host_veth = host_veth
        self.pod_id = pod_id
        self._procs: list[subprocess.Popen[Any]] = []

    @property
    def dns_name(self) -> str:
        """``<pod_id>.runpod.internal`` (follows later changes to pod_id)."""
        return f"{self.pod_id}.{RUNPOD_ZONE}"

    @property
    def netns_path(self) -> str:
        return os.path.join(NETNS_DIR, self.netns)

    def _resolve_exe(self, argv: list[str], env: Mapping[str, str], cwd: Any) -> str:
        exe = argv[0]
        if "/" not in exe:
            # Resolve here so a missing program raises FileNotFoundError in the
            # caller, like Popen does, instead of a traceback in the launcher.
            found = shutil.which(exe, path=env.get("PATH", os.defpath))
            if found is None:
                raise FileNotFoundError(errno.ENOENT, f"{exe!r} not on the env's PATH", exe)
            return found
        if cwd is not None and not os.path.isabs(exe):
            return os.path.join(os.fspath(cwd), exe)
        return exe

    def popen(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start argv inside the pod; env is passed exactly (default: copy of os.environ).

        Returns once the child is inside the namespace. The child gets its own
        session (signal it with os.killpg(p.pid, ...)); stdin defaults to
        /dev/null, stdout/stderr to inherited.
        """
        argv = [os.fspath(a) for a in argv]
        if not argv:
            raise ValueError("empty argv")
        env = dict(os.environ) if env is None else dict(env)
        exe = self._resolve_exe(argv, env, kw.get("cwd"))
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        rfd, wfd = os.pipe()
        kw["pass_fds"] = (*kw.get("pass_fds", ()), wfd)
        launch = [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            self.netns_path,
            str(wfd),
            exe,
            *argv,
        ]
        try:
            try:
                proc = subprocess.Popen(launch, env=env, stdout=stdout, stderr=stderr, **kw)
            finally:
                os.close(wfd)
            entered = os.read(rfd, 1) == b"1"  # EOF: launcher died before setns
        finally:
            os.close(rfd)
        if not entered:
            rc = proc.wait()
            raise OSError(f"could not enter netns {self.netns} (launcher exit code {rc})")
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        check: bool = False,
        input: str | bytes | None = None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run argv inside the pod to completion, capturing output (text by default)."""
        kw.setdefault("text", True)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        proc = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and proc.returncode != 0:
            text = err if isinstance(err, str) else err.decode(errors="replace")
            raise CommandError(argv, proc.returncode, text)
        return result

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    def tcp_listening(self, port: int) -> bool:
        """Whether any socket in this pod listens on TCP ``port`` (IPv4 or IPv6)."""
        # /proc/<pid>/net/* shows the namespace of <pid>; any pid in the pod will do.
        for pid in self.pids():
            try:
                tables = [Path(f"/proc/{pid}/net/{t}").read_text() for t in ("tcp", "tcp6")]
            except OSError:
                continue  # process exited meanwhile
            for table in tables:
                for line in table.splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
            return False
        return False

    def _reap(self, timeout: float) -> None:
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)

    def __repr__(self) -> str:
        return (
            f"Pod({self.name!r}, netns={self.netns!r}, ip={self.ip}, "
            f"ifname={self.ifname!r}, pod_id={self.pod_id!r})"
        )


# --------------------------------------------------------------------------
# network


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on a file (made if missing), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address or a (non-default) route in."""
    nets: list[ipaddress.IPv4Network] = []
    for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def _kill_netns_processes(netns: str, timeout: float) -> None:
    def all_gone() -> bool:
        pids = netns_pids(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    wait_for(all_gone, timeout=timeout, interval=0.02, what=f"processes in netns {netns} to die")


def _teardown(netns: Sequence[str], links: Sequence[str], kill_timeout: float) -> list[str]:
    """Kill processes, delete links then namespaces; return error strings."""
    errors: list[str] = []
    for ns in netns:
        try:
            _kill_netns_processes(ns, kill_timeout)
        except (TimeoutError, CommandError) as exc:
            errors.append(str(exc))
    # Deleting the host end removes the pair synchronously; netns deletion
    # alone frees its veths asynchronously in the kernel.
    for link in links:
        if _link_exists(link):
            try:
                _ip("link", "del", link)
            except CommandError as exc:
                if _link_exists(link):
                    errors.append(str(exc))
    for ns in netns:
        if os.path.exists(os.path.join(NETNS_DIR, ns)):
            try:
                _ip("netns", "del", ns)
            except CommandError as exc:
                errors.append(str(exc))
    return errors


class PodNetwork:
    """A private L2 network (Linux bridge) of pods (network namespaces).

    The host gets the last usable address of the subnet on the bridge (.254
    for a /24); pods get .1, .2, ... in creation order and a default route via
    the host address. Nothing pre-existing on the host is modified.
    """

    def __init__(
        self,
        subnet: str | ipaddress.IPv4Network | None = None,
        prefix: str = DEFAULT_PREFIX,
        kill_timeout: float = 10.0,
    ):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", prefix):
            raise ValueError("prefix must be 1-4 lowercase alphanumerics starting with a letter")
        self.prefix = prefix
        self.kill_timeout = kill_timeout
        self.pods: list[Pod] = []
        self.closed = False
        self._netns: list[str] = []  # everything created, for teardown
        self._links: list[str] = []
        self._next_index = 1
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None
        self.token = ""
        self.bridge = ""
        try:
            with file_lock(_LOCK_DIR / _ALLOC_LOCK):
                self._take_token_lock()
                self.subnet = self._choose_subnet(subnet)
                hosts = list(self.subnet.hosts())
                self.host_ip = str(hosts[-1])
                self._free_ips = [str(h) for h in hosts[:-1]]
                self.bridge = f"{prefix}br{self.token}"
                _ip("link", "add", self.bridge, "type", "bridge")
                self._links.append(self.bridge)
                # An address of its own: a bridge left to choose takes its lowest port's, and
                # changes it when that pod is removed. Every other pod then holds a stale ARP
                # entry for the host (the DNS server, a fake API) and cannot reach it for
                # half a minute, until the entry is probed again.
                _ip("link", "set", self.bridge, "address", _local_mac())
                _ip("addr", "add", f"{self.host_ip}/{self.subnet.prefixlen}", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
        except BaseException:
            with contextlib.suppress(Exception):  # keep the original error
                self.close()
            raise

    def _take_token_lock(self) -> None:
        for _ in range(100):
            token = secrets.token_hex(3)
            path = _LOCK_DIR / f"{self.prefix}{token}.lock"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.token, self._lock_fd, self._lock_path = token, fd, path
            return
        raise RuntimeError(f"could not allocate a unique token in {_LOCK_DIR}")

    @staticmethod
    def _choose_subnet(subnet: str | ipaddress.IPv4Network | None) -> ipaddress.IPv4Network:
        used = _used_networks()
        if subnet is not None:
            net = ipaddress.IPv4Network(subnet)
            if net.prefixlen > 29:
                raise ValueError(f"subnet {net} too small")
            clash = [u for u in used if u.overlaps(net)]
            if clash:
                raise ValueError(f"subnet {net} overlaps host networks {clash}")
            return net
        for net in _DEFAULT_SUPERNET.subnets(new_prefix=24):
            if not any(u.overlaps(net) for u in used):
                return net
        raise RuntimeError(f"no free /24 left in {_DEFAULT_SUPERNET}")

    def add_pod(self, name: str, ifname: str = "podnet1", pod_id: str | None = None) -> Pod:
        """Create a pod: namespace, veth named ``ifname`` inside it, address, default route."""
        if self.closed:
            raise RuntimeError("network is closed")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad pod name {name!r}")
        netns = f"{self.prefix}{self.token}-{name}"
        if netns in self._netns:
            raise ValueError(f"pod {name!r} already exists")
        if not self._free_ips:
            raise RuntimeError(f"subnet {self.subnet} is full")
        index = self._next_index
        self._next_index += 1
        host_veth = f"{self.prefix}{self.token}v{index}"
        ip = self._free_ips.pop(0)
        # Register each resource right after creating it so close() can undo
        # a half-built pod.
        _ip("netns", "add", netns)
        self._netns.append(netns)
        # Create the peer directly inside the namespace under its final name,
        # so names like eth0 cannot clash with host interfaces.
        _ip("link", "add", host_veth, "type", "veth", "peer", "name", ifname, "netns", netns)
        self._links.append(host_veth)
        _ip("-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", ifname)
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "link", "set", ifname, "up")
        _ip("link", "set", host_veth, "master", self.bridge)
        _ip("link", "set", host_veth, "up")
        _ip("-n", netns, "route", "add", "default", "via", self.host_ip)
        pod = Pod(self, name, netns, ip, ifname, host_veth, pod_id or random_pod_id())
        self.pods.append(pod)
        return pod

    def pod(self, name: str) -> Pod:
        for p in self.pods:
            if p.name == name:
                return p
        raise KeyError(name)

    def remove_pod(self, pod: Pod) -> None:
        """Kill a pod's processes and delete its namespace and veth, as a pod that is gone.

        Its address goes to the back of the free list, so a pod made right after does not
        inherit it (peers may still hold the old pod's ARP entry). On a failure what is left
        stays registered for close() to retry.
        """
        if pod not in self.pods:
            raise ValueError(f"{pod!r} is not a pod of this network")
        errors = _teardown([pod.netns], [pod.host_veth], self.kill_timeout)
        pod._reap(timeout=1.0)
        if errors:
            raise RuntimeError(f"removing pod {pod.name!r} incomplete:\n  " + "\n  ".join(errors))
        self.pods.remove(pod)
        self._netns.remove(pod.netns)
        self._links.remove(pod.host_veth)
        self._free_ips.append(pod.ip)

    def close(self) -> None:
        """Kill every process in every pod and delete all we created. Idempotent."""
        if self.closed:
            return
        self.closed = True
        errors = _teardown(self._netns, self._links, self.kill_timeout)
        for pod in self.pods:
            pod._reap(timeout=1.0)  # our own children are zombies until waited
        if self._lock_fd is not None:
            if not errors and self._lock_path is not None:
                # Keep the lock file on failure so cleanup_stale retries later.
                with contextlib.suppress(FileNotFoundError):
                    self._lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None
        if errors:
            raise RuntimeError("PodNetwork.close() incomplete:\n  " + "\n  ".join(errors))

    def __enter__(self) -> PodNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        subnet = getattr(self, "subnet", None)
        return f"PodNetwork(bridge={self.bridge!r}, subnet={subnet}, pods={len(self.pods)})"


def cleanup_stale(prefix: str = DEFAULT_PREFIX, kill_timeout: float = 10.0) -> list[str]:
    """Remove namespaces/links left by crashed runs using ``prefix``.

    Only resources whose token lock file exists and is not held by a live
    process are touched. Returns the names removed.
    """
    removed: list[str] = []
    errors: list[str] = []
    lock_re = re.compile(rf"{re.escape(prefix)}([0-9a-f]{{6}})\.lock")
    with file_lock(_LOCK_DIR / _ALLOC_LOCK):
        for entry in sorted(os.listdir(_LOCK_DIR)):
            m = lock_re.fullmatch(entry)
            if not m:
                continue
            token = m.group(1)
            path = _LOCK_DIR / entry
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # its network was closed meanwhile (close() takes no allocation lock)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live PodNetwork owns it
                ns_re = re.compile(rf"{re.escape(prefix)}{token}-.+")
                link_re = re.compile(rf"{re.escape(prefix)}(br{token}|{token}v\d+)")
                netns = [n for n in list_netns() if ns_re.fullmatch(n)]
                links = [n for n in _list_links() if link_re.fullmatch(n)]
                errs = _teardown(netns, links, kill_timeout)
                errors.extend(errs)
                removed.extend(netns + links)
                if not errs:
                    path.unlink(missing_ok=True)  # its owner may have closed it meanwhile
            finally:
                os.close(fd)
    if errors:
        raise RuntimeError("cleanup_stale incomplete:\n  " + "\n  ".join(errors))
    return removed

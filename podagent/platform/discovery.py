"""Where the head is: the address or DNS name that head_location picks (an explicit address,
DNS for <HEAD_POD_ID>.<suffix>, or the Instant Cluster's PRIMARY_ADDR), resolved; then wait
until the head's Ray GCS answers its health RPC."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import dns.exception
import dns.resolver

from podagent.config import Settings
from podagent.errors import AuthRefused, HeadUnreachable
from podagent.platform import pod
from podagent.platform.head_location import require_head_location
from podagent.platform.roles import Role
from podagent.ray_access import ray_compat
from podagent.ray_access.gcs import GcsAuthRefused, GcsClient, GcsUnavailable
from podagent.report import Progress, Reporter
from podagent.waiting import Backoff, Deadline, NotYet, Signals, retry

# Retry spacing caps: DNS is a shared service, so at most one lookup a second; a refused
# connection to the GCS costs nothing, and every second saved here is saved on the join.
DNS_MAX_WAIT = 1.0
GCS_MAX_WAIT = 0.25
GCS_PROBE_TIMEOUT = 2.0  # one address's health RPC (an address that drops packets costs this)

T = TypeVar("T")


class DnsOutcome(str, enum.Enum):
    ANSWER = "answer"
    NXDOMAIN = "NXDOMAIN"  # the name does not exist (yet), or the pod id is wrong
    NO_ANSWER = "no A record"
    SERVFAIL = "SERVFAIL"  # SERVFAIL or REFUSED: DNS trouble, not a wrong name
    TIMEOUT = "timeout"
    ERROR = "error"


_MEANING = {
    DnsOutcome.NXDOMAIN: "the name does not exist yet (head not started?) or HEAD_POD_ID is wrong",
    DnsOutcome.NO_ANSWER: "the name exists but has no IPv4 address yet",
    DnsOutcome.SERVFAIL: "the DNS server failed or refused to answer (DNS trouble, "
                         "not a wrong name)",
    DnsOutcome.TIMEOUT: "no DNS server answered in time",
    DnsOutcome.ERROR: "the lookup failed",
}


@dataclass(frozen=True)
class DnsResult:
    name: str
    outcome: DnsOutcome
    addresses: tuple[str, ...] = ()
    detail: str = ""

    def describe(self) -> str:
        if self.outcome is DnsOutcome.ANSWER:
            return f"{self.name} -> {', '.join(self.addresses)}"
        return f"{self.name}: {self.outcome.value} ({_MEANING[self.outcome]})"


def make_resolver(server: tuple[str, int] | None, lifetime: float = 2.0) -> dns.resolver.Resolver:
    if server is None:
        resolver = dns.resolver.Resolver()
    else:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [server[0]]
        resolver.port = server[1]
    resolver.lifetime = lifetime
    resolver.timeout = min(lifetime, 1.0)
    resolver.cache = None  # the head's record appears while we wait: never cache a miss
    return resolver


def resolve(name: str, resolver: dns.resolver.Resolver) -> DnsResult:
    """One lookup, classified. Never raises for DNS outcomes."""
    try:
        answer = resolver.resolve(name, "A", search=False)
        addresses = sorted({r.address for r in answer}, key=ipaddress.ip_address)
        return DnsResult(name, DnsOutcome.ANSWER, tuple(addresses))
    except dns.resolver.NXDOMAIN:
        return DnsResult(name, DnsOutcome.NXDOMAIN)
    except dns.resolver.NoAnswer:
        return DnsResult(name, DnsOutcome.NO_ANSWER)
    except dns.resolver.NoNameservers as exc:
        return DnsResult(name, DnsOutcome.SERVFAIL, detail=str(exc))
    except dns.exception.Timeout as exc:
        return DnsResult(name, DnsOutcome.TIMEOUT, detail=str(exc))
    except dns.exception.DNSException as exc:
        return DnsResult(name, DnsOutcome.ERROR, detail=str(exc))


@dataclass(frozen=True)
class HeadLocation:
    ip: str  # the head's address: the first found, then the one whose GCS answered
    how: str  # which setting or lookup gave it
    # Every address found: a DNS name can have several (a stale record beside the new one).
    addresses: tuple[str, ...] = ()
    name: str | None = None  # the DNS name, looked up again while the head is awaited

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.addresses or (self.ip,)


class HeadFinder:
    """Resolves the head and waits for its GCS, all within the head-wait timeout."""

    def __init__(self, settings: Settings, reporter: Reporter, signals: Signals,
                 on_silence: Callable[[str], None] = lambda ip: None,
                 closing: Callable[[GcsClient], bool] = lambda client: False):
        self.settings, self.reporter, self.signals = settings, reporter, signals
        # Called with an address whose GCS did not answer (it may raise to end the wait: a
        # head whose run is over says so on another port).
        self.on_silence = on_silence
        # Whether a head whose GCS answers is closing this start of its run (the Ray engine
        # asks its own store: cluster/runstate.py): joining it now would end in a moment.
        self.closing = closing
        self.deadline = time.monotonic() + settings.head_timeout
        self.last_dns: DnsResult | None = None
        self.last_probe = "not tried yet"
        self.head_ray_version = ""  # what the head's GCS says it runs, once it answered
        self._resolver: dns.resolver.Resolver | None = None
        self._looked_up_at = float("-inf")

    def _retry(self, probe: Callable[[], T], awaited: Callable[[], str], max_wait: float) -> T:
        """`probe` until it answers, within the head-wait timeout; a signal ends the pauses."""
        return retry(probe, awaited=awaited(), backoff=Backoff(0.1, max_wait),
                     deadline=Deadline(lambda: self.deadline), sleep=self.signals.sleep,
                     expired=lambda _: self._timeout(awaited()))

    def _timeout(self, awaited: str) -> HeadUnreachable:
        dns_part = self.last_dns.describe() if self.last_dns else "no DNS lookup was needed"
        return HeadUnreachable(
            f"gave up after {self.settings.head_timeout:g} s waiting for {awaited}; "
            f"last DNS answer: {dns_part}; last GCS probe: {self.last_probe}"
        )

    def locate(self) -> HeadLocation:
        """Resolve where head_location points (NoHeadLocation when nowhere)."""
        target = require_head_location(self.settings)
        if target.is_address:
            return HeadLocation(str(ipaddress.ip_address(target.target)), target.how)
        return self._by_name(target.target, target.how)

    def _by_name(self, name: str, how: str) -> HeadLocation:
        progress = Progress(self.reporter)
        started = time.monotonic()

        def attempt() -> tuple[str, ...]:
            result = self._look_up(name)
            if result.outcome is not DnsOutcome.ANSWER:
                progress(f"waiting for the head's DNS name: {result.describe()} "
                         f"({time.monotonic() - started:.0f} s)")
                raise NotYet(result.describe())
            return result.addresses

        addresses = self._retry(attempt, lambda: f"DNS name {name}", DNS_MAX_WAIT)
        return HeadLocation(addresses[0], f"{how} ({name})", addresses, name)

    def _look_up(self, name: str) -> DnsResult:
        self._resolver = self._resolver or make_resolver(self.settings.dns_server)
        self.last_dns = resolve(name, self._resolver)
        self._looked_up_at = time.monotonic()
        return self.last_dns

    def wait_for_gcs(self, where: HeadLocation) -> tuple[HeadLocation, GcsClient]:
        """Until the head's GCS answers its health RPC (an open port is not enough), at any
        address the head's name has: a stale DNS record may stand beside (or before) the new
        head's, so each is asked, and the name is looked up again (at most once a second) in
        case its records change meanwhile. Returns the location that answered.

        On a head whose Ray gives its dashboard a fixed start-up deadline (before 2.52), also
        until the head's own node is alive in the node table: that node registers only once
        `ray start --head` got past the dashboard, and a head that missed the deadline starts
        Ray again, taking away a GCS that workers joined too early.
        """
        clients: dict[str, GcsClient] = {}
        addresses = {"now": where.candidates}
        probes: dict[str, str] = {}
        progress = Progress(self.reporter)
        started = time.monotonic()

        def ask(ip: str) -> bool:
            client = clients.get(ip)
            if client is None:
                client = clients[ip] = GcsClient(f"{ip}:{self.settings.ray_port}",
                                                 metadata=self.settings.grpc_metadata())
            try:
                self.head_ray_version = client.check_alive(timeout=GCS_PROBE_TIMEOUT)
                if not self._head_start_is_final() and not client.head_node_alive(
                        timeout=GCS_PROBE_TIMEOUT):
                    raise GcsUnavailable("its GCS answers, but the head's own node has not "
                                         "registered yet (Ray is still starting there)")
                if self.closing(client):  # wait for its next start
                    raise GcsUnavailable("its head is closing this start of the run")
            except GcsAuthRefused as exc:
                which = ("a different cluster token" if self.settings.auth_token
                         else "no cluster token")
                raise AuthRefused(
                    f"the head's Ray at {ip}:{self.settings.ray_port} refused this pod: it has "
                    f"{which} ({exc}); set the same PODAGENT_TOKEN (or RAY_AUTH_TOKEN) on every pod"
                ) from None
            except GcsUnavailable as exc:
                probes[ip] = str(exc)
                self.on_silence(ip)
                return False
            return True

        def attempt() -> str:
            if where.name and time.monotonic() - self._looked_up_at >= DNS_MAX_WAIT:
                found = self._look_up(where.name)
                if found.outcome is DnsOutcome.ANSWER:
                    addresses["now"] = found.addresses
            for ip in addresses["now"]:
                if ask(ip):
                    return ip
            self.last_probe = "; ".join(f"{ip}: {probes.get(ip, 'not asked')}"
                                        for ip in addresses["now"])
            progress(f"waiting for the head's Ray at {self._ports(addresses['now'])}: "
                     f"{self.last_probe} ({time.monotonic() - started:.0f} s)")
            raise NotYet(self.last_probe)

        def close_all_but(keep: str | None) -> None:
            for other, client in clients.items():
                if other != keep:
                    client.close()

        try:
            ip = self._retry(attempt, lambda: f"the head's Ray GCS at "
                                              f"{self._ports(addresses['now'])}", GCS_MAX_WAIT)
        except BaseException:  # the time ran out, a signal, a refused token
            close_all_but(None)
            raise
        close_all_but(ip)
        self.last_probe = "answered"
        if len(addresses["now"]) > 1:
            self.reporter.say(f"the head's name has {len(addresses['now'])} addresses "
                              f"({', '.join(addresses['now'])}): {ip} answers")
        return HeadLocation(ip, where.how, addresses["now"], where.name), clients[ip]

    def _ports(self, addresses: tuple[str, ...]) -> str:
        return " or ".join(f"{ip}:{self.settings.ray_port}" for ip in addresses)

    def _head_start_is_final(self) -> bool:
        """Once its GCS answers, does the head's `ray start` always go on to succeed? Not on a
        Ray without a settable dashboard deadline (ray_compat.FEATURES)."""
        try:
            head = ray_compat.RayVersion(self.head_ray_version)
            return head.has("dashboard_startup_timeout")
        except ValueError:  # a GCS that names no version: assume the worst
            return False


# The asking commands and the cluster check are interactive: find the head quickly or say so.
LOOKUP_TIMEOUT = 10.0


def head_ip_now(settings: Settings, role: Role, reporter: Reporter) -> str:
    """The head's address for a question asked now (`status`, `stop`, `logs`, the cluster
    check): this pod's own on the head; else found within LOOKUP_TIMEOUT at most."""
    if role is Role.HEAD:
        return pod.choose_node_ip(settings, None)[0]
    quick = dataclasses.replace(settings, head_timeout=min(settings.head_timeout,
                                                           LOOKUP_TIMEOUT))
    where = HeadFinder(quick, reporter, Signals()).locate()
    if len(where.candidates) == 1:
        return where.ip
    # Several DNS records (a stale one beside the head's): the one whose GCS answers now.
    for ip in where.candidates:
        gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
        try:
            gcs.check_alive(timeout=GCS_PROBE_TIMEOUT)
            return ip
        except GcsUnavailable:
            continue
        finally:
            gcs.close()
    return where.ip

"""DNS outcomes against a real DNS server on 127.0.0.1, and HeadFinder.locate()."""

from __future__ import annotations

import io
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from dnslib import QTYPE, RCODE, RR, SOA

from podagent import config
from podagent.errors import HeadUnreachable, Interrupted
from podagent.platform import discovery
from podagent.platform.discovery import DnsOutcome, HeadFinder
from podagent.report import Reporter
from podagent.waiting import Signals
from tests.harness.pods import DnsServer


class NoDataDnsServer(DnsServer):
    """DnsServer that also answers NOERROR without an A record (NODATA) for the names in
    `nodata`, and calls `on_nxdomain(name)` after it first answered NXDOMAIN for a name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nodata: set[str] = set()
        self.on_nxdomain: Callable[[str], None] | None = None

    def resolve(self, request, handler):
        name = str(request.q.qname).rstrip(".").lower()
        if name in self.nodata:
            reply = request.reply()
            soa = SOA(f"ns.{self.zone}", f"hostmaster.{self.zone}", (1, 60, 60, 60, 1))
            reply.add_auth(RR(self.zone + ".", QTYPE.SOA, rdata=soa, ttl=1))
            return reply
        reply = super().resolve(request, handler)
        if reply.header.rcode == RCODE.NXDOMAIN and self.on_nxdomain:
            hook, self.on_nxdomain = self.on_nxdomain, None
            hook(name)
        return reply


@pytest.fixture
def dns() -> Iterator[NoDataDnsServer]:
    with NoDataDnsServer(address="127.0.0.1", port=0) as server:
        yield server


def resolver(server: DnsServer, lifetime: float = 2.0):
    return discovery.make_resolver(("127.0.0.1", server.port), lifetime=lifetime)


# --- one lookup, classified ---------------------------------------------------------------------

def test_answer(dns):
    dns.set_record("h1.runpod.internal", "10.9.8.7")
    result = discovery.resolve("h1.runpod.internal", resolver(dns))
    assert result.outcome is DnsOutcome.ANSWER
    assert result.addresses == ("10.9.8.7",)
    assert result.describe() == "h1.runpod.internal -> 10.9.8.7"


def test_several_records_are_all_given_in_address_order(dns):
    """As numbers, not strings: 10.65.0.9 before 10.65.0.10 (a string sort put a stale .10
    first, and the worker then asked only it)."""
    dns.set_records("h1.runpod.internal", ["10.65.0.10", "10.65.0.9"])
    result = discovery.resolve("h1.runpod.internal", resolver(dns))
    assert result.addresses == ("10.65.0.9", "10.65.0.10")


def test_nxdomain_for_an_unknown_name(dns):
    dns.set_record("h1.runpod.internal", "10.9.8.7")
    result = discovery.resolve("nobody.runpod.internal", resolver(dns))
    assert result.outcome is DnsOutcome.NXDOMAIN
    assert result.addresses == ()
    assert [q.result for q in dns.queries_for("nobody.runpod.internal")] == ["NXDOMAIN"]


def test_no_answer_when_the_name_has_no_a_record(dns):
    dns.nodata.add("h2.runpod.internal")
    result = discovery.resolve("h2.runpod.internal", resolver(dns))
    assert result.outcome is DnsOutcome.NO_ANSWER
    assert result.addresses == ()
    assert "no IPv4 address" in result.describe()


def test_servfail(dns):
    dns.set_record("h1.runpod.internal", "10.9.8.7")
    dns.mode = "servfail"
    result = discovery.resolve("h1.runpod.internal", resolver(dns))
    assert result.outcome is DnsOutcome.SERVFAIL
    assert result.addresses == ()
    assert "SERVFAIL" in result.detail


def test_timeout_is_bounded_by_the_lifetime(dns):
    dns.set_record("h1.runpod.internal", "10.9.8.7")
    dns.mode = "timeout"
    started = time.monotonic()
    result = discovery.resolve("h1.runpod.internal", resolver(dns, lifetime=0.3))
    assert time.monotonic() - started < 3.0
    assert result.outcome is DnsOutcome.TIMEOUT
    assert result.addresses == ()
    assert "DROPPED" in [q.result for q in dns.queries_for("h1.runpod.internal")]


def test_a_miss_is_not_cached(dns):
    r = resolver(dns)
    assert discovery.resolve("late.runpod.internal", r).outcome is DnsOutcome.NXDOMAIN
    dns.set_record("late.runpod.internal", "10.1.1.1")
    assert discovery.resolve("late.runpod.internal", r).addresses == ("10.1.1.1",)


def test_make_resolver_asks_the_given_server_only():
    r = discovery.make_resolver(("10.0.0.53", 5353), lifetime=3.0)
    assert r.nameservers == ["10.0.0.53"]
    assert r.port == 5353
    assert r.lifetime == 3.0
    assert r.timeout <= 1.0
    assert r.cache is None


def test_describe_tells_nxdomain_from_dns_trouble():
    name = "h1.runpod.internal"
    nxdomain = discovery.DnsResult(name, DnsOutcome.NXDOMAIN).describe()
    servfail = discovery.DnsResult(name, DnsOutcome.SERVFAIL).describe()
    assert nxdomain.startswith(f"{name}: NXDOMAIN")
    assert "does not exist" in nxdomain and "DNS trouble" not in nxdomain
    assert servfail.startswith(f"{name}: SERVFAIL")
    assert "DNS trouble" in servfail and "does not exist" not in servfail
    timeout = discovery.DnsResult(name, DnsOutcome.TIMEOUT).describe()
    assert len({nxdomain, servfail, timeout}) == 3


# --- HeadFinder ---------------------------------------------------------------------------------

def finder(server: DnsServer, head_timeout: str, signals: Signals | None = None, **env: str):
    s = config.build({}, {"PODAGENT_DNS_SERVER": f"127.0.0.1:{server.port}",
                          "PODAGENT_HEAD_TIMEOUT": head_timeout, **env})
    reporter = Reporter("worker", "w1", run_dir=None, stream=io.StringIO())
    return HeadFinder(s, reporter, signals or Signals())


def test_locate_waits_for_the_heads_record(dns):
    name = "late1.runpod.internal"
    timers: list[threading.Timer] = []

    def register_soon(_name: str) -> None:
        # The head's record appears a little after the first NXDOMAIN was served.
        timer = threading.Timer(0.2, dns.set_record, args=(name, "10.1.2.3"))
        timers.append(timer)
        timer.start()

    dns.on_nxdomain = register_soon
    try:
        location = finder(dns, "10", HEAD_POD_ID="late1").locate()
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
    assert location.ip == "10.1.2.3"
    assert "DNS" in location.how and name in location.how
    results = [q.result for q in dns.queries_for(name)]
    assert results[0] == "NXDOMAIN"  # it asked before the record existed ...
    assert results[-1] == "NOERROR"  # ... and again until it did


def test_locate_gives_up_naming_the_dns_name_and_nxdomain(dns):
    started = time.monotonic()
    with pytest.raises(HeadUnreachable) as info:
        finder(dns, "0.3", HEAD_POD_ID="never1").locate()
    assert time.monotonic() - started < 6.0
    message = str(info.value)
    assert "never1.runpod.internal" in message
    assert "NXDOMAIN" in message
    assert "does not exist" in message
    assert len(dns.queries_for("never1.runpod.internal")) >= 2  # it retried


def test_locate_reports_dns_trouble_as_such(dns):
    dns.mode = "servfail"
    with pytest.raises(HeadUnreachable) as info:
        finder(dns, "0.3", HEAD_POD_ID="h9").locate()
    assert "SERVFAIL" in str(info.value)
    assert "DNS trouble" in str(info.value)


def test_a_signal_cuts_the_wait_short(dns):
    signals = Signals()
    signals._handle(signal.SIGTERM, None)  # what the installed handler does on SIGTERM
    started = time.monotonic()
    with pytest.raises(Interrupted) as info:
        finder(dns, "30", signals, HEAD_POD_ID="never2").locate()
    assert info.value.signum == signal.SIGTERM
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(("env", "ip", "how"), [
    ({"PODAGENT_HEAD_ADDR": "10.0.0.9", "HEAD_POD_ID": "h1"}, "10.0.0.9", "PODAGENT_HEAD_ADDR"),
    ({"PRIMARY_ADDR": "10.0.0.1"}, "10.0.0.1", "PRIMARY_ADDR"),
])
def test_an_address_needs_no_dns(dns, env, ip, how):
    location = finder(dns, "1", **env).locate()
    assert (location.ip, location.how) == (ip, how)
    assert dns.queries == []


def test_head_addr_as_a_name_is_resolved(dns):
    dns.set_record("head.runpod.internal", "10.4.4.4")
    location = finder(dns, "5", PODAGENT_HEAD_ADDR="head.runpod.internal").locate()
    assert location.ip == "10.4.4.4"
    assert "PODAGENT_HEAD_ADDR" in location.how


def test_no_head_location_at_all(dns):
    with pytest.raises(HeadUnreachable) as info:
        finder(dns, "1").locate()
    assert "HEAD_POD_ID" in str(info.value)

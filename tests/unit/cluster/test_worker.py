"""The worker's verdict on a silent head: gone, or busy (cluster/worker.py::head_gone), against
real sockets: a port that takes connections and never answers (a loaded head's GCS), a port
nobody listens on (its process gone)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from podagent.cluster.worker import BUSY_HEAD_GRACE, head_gone
from podagent.ray_access.gcs import GcsAuthRefused, GcsClient, GcsUnavailable

LATE = GcsUnavailable("DEADLINE_EXCEEDED: Deadline Exceeded")


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listening socket that is never read: the kernel completes each connection, as it does
    for a GCS whose process gets no CPU."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_silent_gcs_that_takes_connections_is_busy_until_rays_own_bound(silent_port):
    gcs = GcsClient(f"127.0.0.1:{silent_port}")
    with pytest.raises(GcsUnavailable, match="DEADLINE_EXCEEDED"):
        gcs.kv_get("podagent", "run_state", timeout=0.5)  # what the watch sees of it
    assert gcs.accepts()
    assert head_gone(gcs, 7.9, 8.0, LATE) is None
    assert head_gone(gcs, 30.0, 8.0, LATE) is None  # past the grace: busy, not gone
    said = head_gone(gcs, BUSY_HEAD_GRACE + 0.5, 8.0, LATE)
    assert said == (f"taking connections but answering nothing for {BUSY_HEAD_GRACE + 0.5:.1f} s "
                    f"(a busy head is waited for {BUSY_HEAD_GRACE:g} s)")
    # A grace the user set above Ray's bound is never shortened.
    assert head_gone(gcs, BUSY_HEAD_GRACE + 5, BUSY_HEAD_GRACE + 10, LATE) is None
    gcs.close()


def test_a_gcs_whose_port_refuses_is_gone_at_the_grace():
    gcs = GcsClient(f"127.0.0.1:{_closed_port()}")
    assert not gcs.accepts()
    assert head_gone(gcs, 7.0, 8.0, LATE) is None
    assert head_gone(gcs, 8.5, 8.0, LATE) == "unreachable for 8.5 s (grace 8 s)"
    gcs.close()


def test_a_gcs_that_refuses_our_token_is_not_busy(silent_port):
    """It answered: a head that no longer takes this pod (another token) is not waited for."""
    gcs = GcsClient(f"127.0.0.1:{silent_port}")
    refused = GcsAuthRefused("UNAUTHENTICATED: invalid token")
    assert head_gone(gcs, 8.5, 8.0, refused) == "unreachable for 8.5 s (grace 8 s)"
    gcs.close()


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:notaport", "[::1]:1"])
def test_an_address_that_takes_no_connection_says_so(address):
    assert not GcsClient(address).accepts(timeout=0.5)

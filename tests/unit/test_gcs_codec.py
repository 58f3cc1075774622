"""The hand-written protobuf codec and GCS client, checked against the installed Ray's generated
classes (every tested Ray runs these: ray_matrix; tests/compat proves every release's)."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.core.generated import gcs_service_pb2

from podagent.ray_access import gcs
from podagent.ray_access.gcs import GcsClient, GcsUnavailable

pytestmark = pytest.mark.ray_matrix

# --- encode / decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**31 - 1, 2**32,
                                   2**63, 2**64 - 1])
def test_varint_round_trip(value):
    assert gcs.decode(gcs.encode([(1, value)])) == {1: [value]}


@pytest.mark.parametrize(("fields", "wire"), [
    ([(1, 0)], b"\x08\x00"),
    ([(1, 150)], b"\x08\x96\x01"),
    ([(2, b"testing")], b"\x12\x07testing"),
    ([(2, b"")], b"\x12\x00"),
    ([(16, 1)], b"\x80\x01\x01"),
    ([(1, b"k"), (3, 1)], b"\x0a\x01k\x18\x01"),
])
def test_encoding_matches_the_protobuf_wire_format(fields, wire):
    assert gcs.encode(fields) == wire
    assert gcs.decode(wire) == {n: [v] for n, v in fields}


def test_repeated_fields_keep_their_order():
    data = gcs.encode([(3, b"a"), (1, 7), (3, b"b"), (3, b"c")])
    assert gcs.decode(data) == {3: [b"a", b"b", b"c"], 1: [7]}


def test_nested_messages_stay_bytes():
    inner = gcs.encode([(1, 5), (2, b"msg")])
    outer = gcs.decode(gcs.encode([(1, inner), (2, b"v")]))
    assert outer == {1: [inner], 2: [b"v"]}
    assert gcs.decode(outer[1][0]) == {1: [5], 2: [b"msg"]}


def test_fixed_width_fields_are_skipped():
    fixed64 = bytes([1 << 3 | 1]) + struct.pack("<d", 2.5)
    fixed32 = bytes([2 << 3 | 5]) + struct.pack("<f", 1.0)
    data = fixed64 + fixed32 + gcs.encode([(3, 9)])
    assert gcs.decode(data) == {3: [9]}


def test_unsupported_wire_type_is_an_error():
    with pytest.raises(ValueError, match="wire type 3"):
        gcs.decode(bytes([1 << 3 | 3]))


_FIELD = st.tuples(
    st.integers(min_value=1, max_value=2**29 - 1),
    st.one_of(st.binary(max_size=300), st.integers(min_value=0, max_value=2**64 - 1)),
)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(_FIELD, max_size=20))
def test_round_trip_property(fields):
    expected: dict[int, list] = {}
    for number, value in fields:
        expected.setdefault(number, []).append(value)
    assert gcs.decode(gcs.encode(fields)) == expected


# --- against Ray's own classes ------------------------------------------------------------------


class Recorder(GcsClient):
    """A GcsClient whose RPCs return a canned reply and record the request."""

    def __init__(self, reply: bytes):
        super().__init__("127.0.0.1:1")
        self.reply, self.calls = reply, []

    def _call(self, method, request, timeout):
        self.calls.append((method, request))
        return self.reply


def _reply(cls, **kwargs) -> bytes:
    return cls(**kwargs).SerializeToString()


def test_encoded_kv_get_request_parses_with_rays_class():
    ours = gcs.encode([(1, b"the-key"), (2, b"the-ns")])
    theirs = gcs_service_pb2.InternalKVGetRequest.FromString(ours)
    assert (theirs.key, theirs.namespace) == (b"the-key", b"the-ns")


def test_encoded_kv_put_request_parses_with_rays_class():
    ours = gcs.encode([(1, b"k"), (2, b"\x00value\xff"), (3, 1), (4, b"ns")])
    theirs = gcs_service_pb2.InternalKVPutRequest.FromString(ours)
    assert (theirs.key, theirs.value, theirs.overwrite, theirs.namespace) == (
        b"k", b"\x00value\xff", True, b"ns")


def test_kv_get_request_and_reply_match_ray():
    reply = _reply(gcs_service_pb2.InternalKVGetReply,
                   status=gcs_service_pb2.GcsStatus(code=0), value=b"stored\x00bytes")
    client = Recorder(reply)
    try:
        assert client.kv_get("podagent", "run/state") == b"stored\x00bytes"
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.InternalKVGcsService/InternalKVGet"
    parsed = gcs_service_pb2.InternalKVGetRequest.FromString(request)
    assert (parsed.key, parsed.namespace) == (b"run/state", b"podagent")


def test_kv_get_not_found_is_none():
    reply = _reply(gcs_service_pb2.InternalKVGetReply,
                   status=gcs_service_pb2.GcsStatus(code=17, message="Failed to find the key"))
    client = Recorder(reply)
    try:
        assert client.kv_get("ns", "absent") is None
    finally:
        client.close()


def test_kv_put_request_matches_ray():
    reply = _reply(gcs_service_pb2.InternalKVPutReply,
                   status=gcs_service_pb2.GcsStatus(code=0), added=True)
    client = Recorder(reply)
    try:
        client.kv_put("podagent", "run/state", b'{"state": "done"}')
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.InternalKVGcsService/InternalKVPut"
    parsed = gcs_service_pb2.InternalKVPutRequest.FromString(request)
    assert (parsed.key, parsed.value, parsed.overwrite, parsed.namespace) == (
        b"run/state", b'{"state": "done"}', True, b"podagent")


def test_kv_put_failure_raises_with_the_status():
    reply = _reply(gcs_service_pb2.InternalKVPutReply,
                   status=gcs_service_pb2.GcsStatus(code=9, message="no space"))
    client = Recorder(reply)
    try:
        with pytest.raises(GcsUnavailable, match="status 9: no space"):
            client.kv_put("ns", "k", b"v")
    finally:
        client.close()


def test_rays_kv_get_reply_decodes_with_ours():
    raw = _reply(gcs_service_pb2.InternalKVGetReply,
                 status=gcs_service_pb2.GcsStatus(code=17, message="Not found: key"),
                 value=b"val")
    reply = gcs.decode(raw)
    assert gcs._status(reply) == (17, "Not found: key")
    assert reply[2] == [b"val"]


@pytest.mark.parametrize(("code", "message"), [(0, ""), (1, "out of memory"),
                                               (14, "unavailable \u2013 é")])
def test_rays_check_alive_reply_decodes_with_ours(code, message):
    fields = gcs_service_pb2.CheckAliveReply.DESCRIPTOR.fields_by_name
    extra = {"is_leader": True} if "is_leader" in fields else {}  # 2.60 added it
    raw = _reply(gcs_service_pb2.CheckAliveReply,
                 status=gcs_service_pb2.GcsStatus(code=code, message=message),
                 ray_version="2.60.0", raylet_alive=[True, False], **extra)
    assert gcs._status(gcs.decode(raw)) == (code, message)


def test_status_of_an_empty_reply_is_ok():
    assert gcs._status(gcs.decode(b"")) == (0, "")


def test_check_alive_sends_a_valid_request_and_reads_the_status():
    ok = _reply(gcs_service_pb2.CheckAliveReply, status=gcs_service_pb2.GcsStatus(code=0),
                ray_version="2.60.0")
    client = Recorder(ok)
    try:
        assert client.check_alive() == "2.60.0"  # the head's Ray version, from the reply
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.NodeInfoGcsService/CheckAlive"
    # An empty request: its only field is the node list (node_ids since 2.52, raylet_address
    # before), and empty asks about no node in particular.
    assert gcs_service_pb2.CheckAliveRequest.FromString(request).ListFields() == []

    bad = _reply(gcs_service_pb2.CheckAliveReply,
                 status=gcs_service_pb2.GcsStatus(code=5, message="not leader"))
    client = Recorder(bad)
    try:
        with pytest.raises(GcsUnavailable, match="status 5: not leader"):
            client.check_alive()
    finally:
        client.close()


def _nodes_reply(*nodes: tuple[bool, str], code: int = 0) -> bytes:
    from ray.core.generated import gcs_pb2

    state = gcs_pb2.GcsNodeInfo.GcsNodeState
    infos = [gcs_pb2.GcsNodeInfo(node_id=bytes([i]) * 28, node_manager_address=f"10.0.0.{i}",
                                 is_head_node=head, state=state.Value(alive),
                                 resources_total={"CPU": 2.0}, start_time_ms=1700000000000)
             for i, (head, alive) in enumerate(nodes, 1)]
    return _reply(gcs_service_pb2.GetAllNodeInfoReply, node_info_list=infos,
                  status=gcs_service_pb2.GcsStatus(code=code, message="busy" if code else ""))


@pytest.mark.parametrize(("nodes", "alive"), [
    ((), False),
    (((False, "ALIVE"),), False),  # a worker only
    (((True, "DEAD"),), False),  # an earlier head, gone
    (((True, "DEAD"), (False, "ALIVE"), (True, "ALIVE")), True),
])
def test_head_node_alive_reads_rays_node_table(nodes, alive):
    client = Recorder(_nodes_reply(*nodes))
    try:
        assert client.head_node_alive() is alive
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"
    assert gcs_service_pb2.GetAllNodeInfoRequest.FromString(request).ListFields() == []


def test_head_node_alive_raises_for_a_failed_status():
    client = Recorder(_nodes_reply((True, "ALIVE"), code=14))
    try:
        with pytest.raises(GcsUnavailable, match="status 14: busy"):
            client.head_node_alive()
    finally:
        client.close()


class Answering(GcsClient):
    """A GcsClient whose RPCs answer by method (each a canned reply, or a function of the
    request) and record the requests."""

    def __init__(self, **replies):
        super().__init__("127.0.0.1:1")
        self.replies, self.calls = replies, []

    def _call(self, method, request, timeout):
        self.calls.append((method.rsplit("/", 1)[1], request))
        reply = self.replies[method.rsplit("/", 1)[1]]
        return reply(request) if callable(reply) else reply


def _records(*ids: int) -> dict[int, object]:
    from ray.core.generated import gcs_pb2

    return {i: gcs_pb2.GcsNodeInfo(node_id=bytes([i]) * 28, node_manager_address=f"10.0.0.{i}",
                                   is_head_node=i == 1, resources_total={"GPU": 8.0},
                                   start_time_ms=1700000000000 + i) for i in ids}


def _liveness(**states: str) -> bytes:
    from ray.core.generated import gcs_pb2

    state = gcs_pb2.GcsNodeInfo.GcsNodeState
    return _reply(gcs_service_pb2.GetAllNodeAddressAndLivenessReply, node_info_list=[
        gcs_pb2.GcsNodeAddressAndLiveness(node_id=bytes([int(i[1:])]) * 28,
                                          node_manager_address=f"10.0.0.{i[1:]}",
                                          state=state.Value(alive))
        for i, alive in states.items()])


def _by_id(records: dict[int, object]):
    """GetAllNodeInfo answering the node ids it is asked for (from `records`)."""
    def answer(request: bytes) -> bytes:
        asked = gcs_service_pb2.GetAllNodeInfoRequest.FromString(request).node_selectors
        return _reply(gcs_service_pb2.GetAllNodeInfoReply, node_info_list=[
            records[s.node_id[0]] for s in asked if s.node_id[0] in records])
    return answer


def _asked_ids(request: bytes) -> list[int]:
    parsed = gcs_service_pb2.GetAllNodeInfoRequest.FromString(request)
    return [s.node_id[0] for s in parsed.node_selectors]


@pytest.mark.skipif(not hasattr(gcs_service_pb2, "GetAllNodeAddressAndLivenessRequest"),
                    reason="Ray before 2.51 has no liveness read: nodes() reads the table")
def test_nodes_asks_liveness_and_each_new_node_once():
    client = Answering(GetAllNodeAddressAndLiveness=_liveness(n1="ALIVE", n2="DEAD"),
                       GetAllNodeInfo=_by_id(_records(1, 2, 3)))
    try:
        first = client.nodes()
        assert [(n.ip, n.alive, n.is_head, n.gpus, n.start_time_ms) for n in first] == [
            ("10.0.0.1", True, True, 8.0, 1700000000001),
            ("10.0.0.2", False, False, 8.0, 1700000000002)]
        assert [m for m, _ in client.calls] == ["GetAllNodeAddressAndLiveness", "GetAllNodeInfo"]
        assert gcs_service_pb2.GetAllNodeAddressAndLivenessRequest.FromString(
            client.calls[0][1]).ListFields() == []  # every node, alive or dead
        assert _asked_ids(client.calls[1][1]) == [1, 2]

        # Known nodes: one liveness read, their state from it, the rest remembered.
        client.calls.clear()
        client.replies["GetAllNodeAddressAndLiveness"] = _liveness(n1="DEAD", n2="ALIVE")
        assert [(n.ip, n.alive) for n in client.nodes()] == [
            ("10.0.0.1", False), ("10.0.0.2", True)]
        assert [m for m, _ in client.calls] == ["GetAllNodeAddressAndLiveness"]

        # A new node: only its record is asked for.
        client.calls.clear()
        client.replies["GetAllNodeAddressAndLiveness"] = _liveness(n1="ALIVE", n2="ALIVE",
                                                                   n3="ALIVE")
        assert [n.node_id for n in client.nodes()] == [
            (bytes([i]) * 28).hex() for i in (1, 2, 3)]
        assert _asked_ids(client.calls[1][1]) == [3]
    finally:
        client.close()


@pytest.mark.skipif(not hasattr(gcs_service_pb2, "GetAllNodeAddressAndLivenessRequest"),
                    reason="Ray before 2.51 has no liveness read")
def test_nodes_leaves_out_a_node_whose_record_is_gone_and_asks_again():
    client = Answering(GetAllNodeAddressAndLiveness=_liveness(n1="ALIVE", n4="ALIVE"),
                       GetAllNodeInfo=_by_id(_records(1)))
    try:
        assert [n.ip for n in client.nodes()] == ["10.0.0.1"]
        client.replies["GetAllNodeInfo"] = _by_id(_records(1, 4))
        assert [n.ip for n in client.nodes()] == ["10.0.0.1", "10.0.0.4"]
        assert _asked_ids(client.calls[-1][1]) == [4]
    finally:
        client.close()


def test_nodes_before_ray_2_51_read_the_whole_table(monkeypatch):
    monkeypatch.delattr(gcs_service_pb2, "GetAllNodeAddressAndLivenessRequest", raising=False)
    client = Recorder(_nodes_reply((True, "ALIVE"), (False, "DEAD")))
    try:
        assert [(n.ip, n.alive, n.is_head) for n in client.nodes()] == [
            ("10.0.0.1", True, True), ("10.0.0.2", False, False)]
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo" and request == b""


def test_registered_asks_for_one_record_and_reads_the_tables_size():
    client = Recorder(_reply(gcs_service_pb2.GetAllNodeInfoReply, total=1000,
                             num_filtered=999))
    try:
        assert client.registered() == 1000
    finally:
        client.close()
    ((method, request),) = client.calls
    assert method == "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"
    assert gcs_service_pb2.GetAllNodeInfoRequest.FromString(request).limit == 1


# --- a real gRPC call to nowhere ----------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_check_alive_on_a_closed_port_is_unavailable():
    client = GcsClient(f"127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    try:
        with pytest.raises(GcsUnavailable) as info:
            client.check_alive(timeout=0.5)
    finally:
        client.close()
    assert time.monotonic() - started < 5.0
    assert "UNAVAILABLE" in str(info.value)

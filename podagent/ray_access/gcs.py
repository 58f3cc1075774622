"""A small client for the Ray GCS over plain gRPC.

Workers stay light: importing Ray costs ~70 MB and a second of start-up, while these probes
need only grpcio and a few messages (of the node table, only the two fields that say whether
the head's node is alive). The messages are encoded here by hand (field numbers
from gcs_service.proto, the same in every supported Ray; tests check them against the generated
classes of the installed Ray and of every supported release, tests/compat).
The node census, which needs Ray's large GcsNodeInfo message, imports Ray's classes lazily:
only the head calls it, and the head imports Ray for the Jobs API anyway.

The census reads are sized for a head that asks ten times a second with a thousand nodes in
the table (bench/scale.py measured them): `nodes()` asks for every node's liveness only and for
a node's full record once, when it first appears; `registered()` asks for one record and the
table's size, so a caller can tell that a node joined without reading the table at all.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass, replace

import grpc

_CHECK_ALIVE = "/ray.rpc.NodeInfoGcsService/CheckAlive"
_GET_ALL_NODES = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"
_GET_LIVENESS = "/ray.rpc.NodeInfoGcsService/GetAllNodeAddressAndLiveness"  # Ray 2.51 on
_KV_GET = "/ray.rpc.InternalKVGcsService/InternalKVGet"
_KV_PUT = "/ray.rpc.InternalKVGcsService/InternalKVPut"


# --- protobuf wire format: just varints and length-delimited bytes ------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError("negative varints are not used by these messages")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode(fields: list[tuple[int, bytes | int]]) -> bytes:
    """Encode (field number, bytes -> length-delimited | int -> varint) pairs."""
    out = bytearray()
    for number, value in fields:
        if isinstance(value, bytes):
            out += _varint(number << 3 | 2) + _varint(len(value)) + value
        else:
            out += _varint(number << 3 | 0) + _varint(int(value))
    return bytes(out)


def decode(data: bytes) -> dict[int, list[bytes | int]]:
    """Field number -> values; nested messages stay bytes. Fixed-width fields are skipped."""
    fields: dict[int, list[bytes | int]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            if i >= len(data):
                raise ValueError("truncated protobuf message")
            byte = data[i]
            i += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.setdefault(number, []).append(varint())
        elif wire == 2:
            length = varint()
            if i + length > len(data):
                raise ValueError("truncated protobuf message")
            fields.setdefault(number, []).append(data[i:i + length])
            i += length
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return fields


def _status(reply: dict[int, list[bytes | int]]) -> tuple[int, str]:
    raw = reply.get(1, [b""])[0]
    status = decode(raw) if isinstance(raw, bytes) else {}
    code = status.get(1, [0])[0]
    message = status.get(2, [b""])[0]
    return int(code), message.decode(errors="replace") if isinstance(message, bytes) else ""


# --- client -------------------------------------------------------------------------------------


class GcsUnavailable(Exception):
    """The GCS did not answer; the message says how (refused, timed out, ...)."""


class GcsAuthRefused(GcsUnavailable):
    """The GCS answered, and refused our token (or its absence)."""


class GcsLate(GcsUnavailable):
    """The call's deadline passed with no answer: the GCS may be there, and busy."""


class Reach(enum.Enum):
    """What a TCP connection to a port found (the kernel's answer, not the process's)."""
    ACCEPTS = "accepts"
    REFUSED = "refused"  # nothing listens: the process is gone
    SILENT = "silent"  # no answer at all: the pod gone, the network cut (or one lost SYN)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    alive: bool
    gpus: float
    cpus: float
    is_head: bool
    start_time_ms: int
    node_manager_port: int = 0  # the raylet's port: a probe of the pod behind the node
    # Ray's own and podagent's (runstate.LABEL_*), as sorted pairs: a node stays hashable.
    labels: tuple[tuple[str, str], ...] = ()

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


class GcsClient:
    """The few GCS calls podagent needs (liveness, the node table, the key-value store), over
    gRPC without importing Ray."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()):
        self.address = address
        self._metadata = metadata
        self._channel = grpc.insecure_channel(
            address,
            # Fail fast while the head is down instead of waiting out gRPC's reconnect backoff.
            options=[("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)],
        )
        # node id -> the node as first read, alive and dead: nothing else in a record changes
        self._known: dict[bytes, tuple[NodeInfo, NodeInfo]] = {}

    def close(self) -> None:
        self._channel.close()

    def reach(self, timeout: float = 1.0) -> Reach:
        """Whether the GCS's port takes a TCP connection now. A GCS that takes one but answers
        no call is there (busy, or frozen); one that refuses is gone; no answer at all is a pod
        gone or the network cut, or a SYN lost once (Linux sends it again after 1 s)."""
        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except ConnectionRefusedError:
            return Reach.REFUSED
        except (OSError, ValueError):
            return Reach.SILENT
        return Reach.ACCEPTS

    def _call(self, method: str, request: bytes, timeout: float) -> bytes:
        stub = self._channel.unary_unary(method)
        try:
            return stub(request, timeout=timeout, metadata=self._metadata or None)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            name = code.name if code else "ERROR"
            kind = {grpc.StatusCode.UNAUTHENTICATED: GcsAuthRefused,
                    grpc.StatusCode.DEADLINE_EXCEEDED: GcsLate}.get(code, GcsUnavailable)
            raise kind(f"{name}: {detail}".strip()) from None

    def check_alive(self, timeout: float = 2.0) -> str:
        """The GCS's Ray version, once it answers its own health RPC; raises GcsUnavailable.

        The reply carries the version the head runs (field 2 in every supported release), so a
        worker can refuse to join a head of another Ray before `ray start` fails obscurely.
        """
        reply = decode(self._call(_CHECK_ALIVE, b"", timeout))
        code, message = _status(reply)
        if code:
            raise GcsUnavailable(f"GCS answered status {code}: {message}")
        version = reply.get(2, [b""])[0]
        return version.decode(errors="replace") if isinstance(version, bytes) else ""

    def head_node_alive(self, timeout: float = 2.0) -> bool:
        """Is the head's own node ALIVE in the node table? It registers when the head's raylet
        starts, the last step of `ray start --head`. Decoded by hand like the probes above:
        GetAllNodeInfoReply.node_info_list is field 2, and in each GcsNodeInfo is_head_node is
        field 25 and state field 7 (ALIVE is 0, so absent on the wire)."""
        reply = decode(self._call(_GET_ALL_NODES, b"", timeout))
        code, message = _status(reply)
        if code:
            raise GcsUnavailable(f"GCS answered status {code}: {message}")
        for raw in reply.get(2, []):
            node = decode(raw) if isinstance(raw, bytes) else {}
            if node.get(25, [0])[0] == 1 and node.get(7, [0])[0] == 0:
                return True
        return False

    def kv_get(self, namespace: str, key: str, timeout: float = 2.0) -> bytes | None:
        request = encode([(1, key.encode()), (2, namespace.encode())])
        reply = decode(self._call(_KV_GET, request, timeout))
        code, _ = _status(reply)
        if code:  # NotFound
            return None
        value = reply.get(2, [b""])[0]
        return value if isinstance(value, bytes) else None

    def kv_put(self, namespace: str, key: str, value: bytes, timeout: float = 2.0) -> None:
        request = encode([(1, key.encode()), (2, value), (3, 1), (4, namespace.encode())])
        code, message = _status(decode(self._call(_KV_PUT, request, timeout)))
        if code:
            raise GcsUnavailable(f"KV put failed with status {code}: {message}")

    def nodes(self, timeout: float = 5.0) -> list[NodeInfo]:
        """Every node of the table, alive or dead. The whole table is ~520 bytes a node (at
        1,000 nodes a read took 2.9 ms of the GCS's CPU and 6.7 ms of ours); from Ray 2.51 the
        GCS is asked for each node's liveness only (~55 bytes a node, 0.7 ms and 1.4 ms) and,
        once per node it has not seen, for that node's full record. Before 2.51: the whole
        table."""
        from ray.core.generated import gcs_pb2, gcs_service_pb2

        if not hasattr(gcs_service_pb2, "GetAllNodeAddressAndLivenessRequest"):
            return self.node_table(timeout)
        raw = self._call(_GET_LIVENESS, b"", timeout)
        listed = gcs_service_pb2.GetAllNodeAddressAndLivenessReply.FromString(raw).node_info_list
        new = [n.node_id for n in listed if n.node_id not in self._known]
        if new:
            request = gcs_service_pb2.GetAllNodeInfoRequest(node_selectors=[
                gcs_service_pb2.GetAllNodeInfoRequest.NodeSelector(node_id=i) for i in new])
            for info in self._read_table(request.SerializeToString(), timeout):
                node = bytes.fromhex(info.node_id)
                self._known[node] = (replace(info, alive=True), replace(info, alive=False))
        alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
        # A node that died between the two reads is in the first only: it is read next time.
        return [self._known[n.node_id][0 if n.state == alive else 1]
                for n in listed if n.node_id in self._known]

    def node_table(self, timeout: float = 5.0) -> list[NodeInfo]:
        """The whole node table in one read, every record in full."""
        return self._read_table(b"", timeout)

    def registered(self, timeout: float = 2.0) -> int:
        """How many nodes the table holds, alive and dead. It grows when a node registers and
        stays when one dies; the GCS sends one record with it, so the read costs the same at
        any cluster size."""
        from ray.core.generated import gcs_service_pb2

        request = gcs_service_pb2.GetAllNodeInfoRequest(limit=1).SerializeToString()
        raw = self._call(_GET_ALL_NODES, request, timeout)
        return int(gcs_service_pb2.GetAllNodeInfoReply.FromString(raw).total)

    def _read_table(self, request: bytes, timeout: float) -> list[NodeInfo]:
        from ray.core.generated import gcs_pb2, gcs_service_pb2

        raw = self._call(_GET_ALL_NODES, request, timeout)
        reply = gcs_service_pb2.GetAllNodeInfoReply.FromString(raw)
        alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
        return [
            NodeInfo(
                node_id=n.node_id.hex(), ip=n.node_manager_address, alive=n.state == alive,
                gpus=float(n.resources_total.get("GPU", 0.0)),
                cpus=float(n.resources_total.get("CPU", 0.0)),
                is_head=bool(n.is_head_node), start_time_ms=int(n.start_time_ms),
                node_manager_port=int(n.node_manager_port),
                labels=tuple(sorted(n.labels.items())),
            )
            for n in reply.node_info_list
        ]

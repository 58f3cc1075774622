"""Every Ray release podagent supports, read from its own wheel on PyPI.

podagent runs the Ray its image has, so what it uses of Ray must exist in every release of the
supported range, not only in the one installed here. For each release this module downloads the
wheel once and keeps a small extract in a cache directory (a release never changes): the
protobuf descriptors of the GCS messages, the source files whose names podagent relies on, and
whether given strings occur in the gcs_server binary (the config names Ray reads from RAY_*).

Plain module (no pytest): `python -m tests.compat.ray_releases` fills the cache and prints it.
"""

from __future__ import annotations

import ast
import base64
import concurrent.futures
import hashlib
import json
import os
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import requests
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from podagent.ray_access import ray_compat

PYPI = "https://pypi.org/pypi/ray/json"
HTTP_TIMEOUT = 60.0
# Source files kept per release: `ray start`'s options, the Jobs SDK, the Jobs API's routes,
# the scheduling strategy the cluster check places its ranks with, Ray's settable constants,
# ray.init (how the cluster check's driver connects).
SOURCES = ("ray/scripts/scripts.py", "ray/dashboard/modules/job/sdk.py",
           "ray/dashboard/modules/dashboard_sdk.py", "ray/dashboard/modules/job/job_head.py",
           "ray/util/scheduling_strategies.py", "ray/util/__init__.py",
           "ray/_private/ray_constants.py", "ray/_private/worker.py")
GCS_SERVER = "ray/core/src/ray/gcs/gcs_server"
# Looked up in gcs_server: the health-check config names podagent sets (ray_node), and the
# names token authentication brought (to prove FEATURES["token_auth"].since).
BINARY_STRINGS = ("health_check_period_ms", "health_check_timeout_ms",
                  "health_check_failure_threshold", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
SCHEMA = hashlib.sha256(repr((SOURCES, BINARY_STRINGS, 1)).encode()).hexdigest()[:10]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "podagent" / "ray-releases"


def _in_range(version: str) -> bool:
    try:
        release = ray_compat.parse(version)
    except ValueError:
        return False
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):  # no rc, dev or post releases
        return False
    newest = ray_compat.parse(ray_compat.NEWEST_PROVEN)
    return ray_compat.parse(ray_compat.SUPPORTED_FROM) <= release and release[:2] <= newest[:2]


def _wheel(files: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A Linux x86_64 wheel of the release, this Python's build first (the parts read here are
    the same in every build of a release)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    linux = [f for f in files if f["filename"].endswith(".whl") and not f.get("yanked")
             and re.search(r"manylinux\w*_x86_64", f["filename"])]
    linux.sort(key=lambda f: f"-{tag}-" not in f["filename"])
    return linux[0] if linux else None


def supported_releases() -> dict[str, dict[str, Any]]:
    """version -> its wheel's PyPI entry, for every release in the supported range."""
    reply = requests.get(PYPI, timeout=HTTP_TIMEOUT)
    reply.raise_for_status()
    found = {}
    for version, files in reply.json()["releases"].items():
        wheel = _wheel(files) if _in_range(version) else None
        if wheel:
            # Mirrors of the index may give file addresses relative to the JSON's own.
            found[version] = {**wheel, "url": urljoin(reply.url, wheel["url"])}
    return dict(sorted(found.items(), key=lambda item: ray_compat.parse(item[0])))


# --- one release --------------------------------------------------------------------------------


def _serialized_descriptor(source: str) -> bytes | None:
    """The FileDescriptorProto a generated *_pb2.py registers, read without running it.

    Only ever called from one thread at a time (see all_facts): CPython 3.11 keeps ast.parse's
    recursion counter per interpreter, not per thread, so two threads parsing at once can fail
    with "SystemError: AST constructor recursion depth mismatch" whenever the collector runs
    Python code (a finalizer) in the middle of one of them and the other thread gets the GIL.
    """
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile"
                and node.args and isinstance(node.args[0], ast.Constant)):
            return node.args[0].value
    return None


def _cache_path(version: str) -> Path:
    return cache_dir() / f"{version}-{SCHEMA}.json"


def _cached(version: str) -> dict[str, Any] | None:
    path = _cache_path(version)
    return json.loads(path.read_text()) if path.exists() else None


def _read_wheel(version: str, wheel: dict[str, Any]) -> dict[str, Any]:
    """What one release's wheel holds for the extract, as text (downloaded, checked against
    PyPI's sha256, read, deleted). No parsing here: this runs on the download threads, where
    the network, the hash and the unzipping (all outside the GIL) overlap."""
    with tempfile.TemporaryDirectory(prefix="ray-wheel-") as tmp:
        wheel_path = Path(tmp) / wheel["filename"]
        digest = hashlib.sha256()
        with requests.get(wheel["url"], stream=True, timeout=HTTP_TIMEOUT) as reply:
            reply.raise_for_status()
            with open(wheel_path, "wb") as out:
                for chunk in reply.iter_content(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        expected = wheel.get("digests", {}).get("sha256")
        if expected and digest.hexdigest() != expected:
            raise RuntimeError(f"{wheel['filename']}: sha256 differs from PyPI's")
        with zipfile.ZipFile(wheel_path) as z:
            names = set(z.namelist())
            generated = {n: z.read(n).decode() for n in sorted(names)
                         if n.startswith("ray/core/generated/") and n.endswith("_pb2.py")}
            sources = {n: z.read(n).decode() for n in SOURCES if n in names}
            binary = z.read(GCS_SERVER)
    return {"version": version, "generated": generated, "sources": sources,
            "gcs_server_strings": {s: s.encode() in binary for s in BINARY_STRINGS}}


def _extract(read: dict[str, Any]) -> dict[str, Any]:
    """The cached extract of a read wheel: its descriptors parsed out of the generated files,
    on the calling thread (about 20 ms a release); written to the cache whole."""
    descriptors = {}
    for text in read["generated"].values():
        raw = _serialized_descriptor(text)
        if raw:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            descriptors[proto.name] = base64.b64encode(raw).decode()
    extract = {"version": read["version"], "schema": SCHEMA, "descriptors": descriptors,
               "sources": read["sources"], "gcs_server_strings": read["gcs_server_strings"]}
    path = _cache_path(read["version"])
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(extract))
    partial.replace(path)  # never a half-written cache entry
    return extract


def all_facts(workers: int = 4) -> dict[str, dict[str, Any]]:
    """Every supported release's extract. Wheels missing from the cache are downloaded and
    read on `workers` threads; each is parsed on this thread as it arrives, one at a time."""
    releases = supported_releases()
    found = {v: _cached(v) for v in releases}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        reading = {pool.submit(_read_wheel, v, w): v for v, w in releases.items()
                   if found[v] is None}
        for done in concurrent.futures.as_completed(reading):
            found[reading[done]] = _extract(done.result())
    return found


def _well_known(name: str) -> descriptor_pb2.FileDescriptorProto:
    """google/protobuf/timestamp.proto and its kind, from the installed protobuf."""
    module = "google.protobuf." + Path(name).stem + "_pb2"
    __import__(module)  # registers the file in protobuf's default pool
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor_pool.Default().FindFileByName(name).CopyToProto(proto)
    return proto


# --- reading an extract -------------------------------------------------------------------------


@dataclass
class Release:
    """One release's extract, with its GCS messages as real classes built from its descriptors."""
    version: str
    data: dict[str, Any]

    def __post_init__(self) -> None:
        self.files = {name: descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(raw))
                      for name, raw in self.data["descriptors"].items()}
        self._pool: descriptor_pool.DescriptorPool | None = None

    @property
    def pool(self) -> descriptor_pool.DescriptorPool:
        """A private pool holding this release's descriptors, each after its imports; imports
        from outside Ray (protobuf's well-known types) come from protobuf itself."""
        if self._pool is None:
            pool, added = descriptor_pool.DescriptorPool(), set()

            def add(name: str) -> None:
                if name in added:
                    return
                added.add(name)
                proto = self.files.get(name) or _well_known(name)
                for dependency in proto.dependency:
                    add(dependency)
                pool.Add(proto)

            # Only what the GCS messages need: some of Ray's other files import packages
            # (OpenTelemetry's protos) that have nothing to do with them.
            for name in self.files:
                if name.endswith(("/gcs_service.proto", "/gcs.proto")):
                    add(name)
            self._pool = pool
        return self._pool

    def message(self, full_name: str) -> type:
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full_name))

    def method(self, path: str) -> tuple[str, str] | None:
        """(input type, output type) of a gRPC method path such as /ray.rpc.X/Y, or None."""
        service, _, method = path.strip("/").partition("/")
        try:
            found = self.pool.FindServiceByName(service).FindMethodByName(method)
        except KeyError:
            return None
        if found is None:
            return None
        return found.input_type.full_name, found.output_type.full_name

    def source(self, name: str) -> str:
        return self.data["sources"].get(name, "")

    def in_gcs_server(self, text: str) -> bool:
        return self.data["gcs_server_strings"][text]


if __name__ == "__main__":
    for version, extract in all_facts().items():
        release = Release(version, extract)
        print(f"Ray {version}: {len(release.files)} proto files, "
              f"{sum(extract['gcs_server_strings'].values())}/{len(BINARY_STRINGS)} strings")

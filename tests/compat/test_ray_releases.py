"""What podagent uses of Ray, checked against every supported release's own wheel.

The release list comes from PyPI (every x.y.z from ray_compat.SUPPORTED_FROM through the newest
proven minor); each check runs on each release and the failures are reported together, by
release. The GCS codec is proven with each release's own generated messages, built as real
classes from the descriptors in its wheel.
"""

from __future__ import annotations

import ast
import gc
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from podagent import config
from podagent.cluster import ray_node
from podagent.platform.roles import Role
from podagent.ray_access import gcs, ray_compat
from tests.compat import ray_releases
from tests.compat.ray_releases import Release, all_facts
from tests.unit.test_gcs_codec import Recorder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def releases() -> list[Release]:
    found = [Release(v, data) for v, data in all_facts().items()]
    versions = {r.version for r in found}
    # The range really is covered: both ends and every tested release are among them.
    assert {ray_compat.SUPPORTED_FROM, *ray_compat.TESTED} <= versions, sorted(versions)
    assert any(v.startswith(ray_compat.NEWEST_PROVEN + ".") for v in versions), sorted(versions)
    return found


def each(releases: list[Release], check: Callable[[Release], list[str]]) -> None:
    """Run a check on every release; fail once, listing every release's problems."""
    problems = [f"Ray {r.version}: {p}" for r in releases for p in check(r)]
    assert not problems, "\n".join(problems)


# --- reading the wheels ------------------------------------------------------------------------


class _Cycle:
    def __del__(self) -> None:
        pass  # Python code the collector runs wherever it collects, on whichever thread


@contextmanager
def _busy_interpreter() -> Iterator[None]:
    """What a long test session is like, only more so: a thread litters garbage that needs
    finalizing, the collector runs often, and threads switch as often as they can. A
    collection in the middle of ast.parse then hands the GIL to another thread."""
    stop = threading.Event()

    def litter() -> None:
        while not stop.is_set():
            for _ in range(100):
                cycle = _Cycle()
                cycle.me = cycle
            time.sleep(1e-4)  # leaves the CPU to the test's own threads: seconds, not tens

    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50)
    thread = threading.Thread(target=litter, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)


COLD_RELEASES = 4  # enough for every download thread to have a wheel at once


def test_an_empty_cache_fills_the_same_way_every_time(tmp_path, monkeypatch):
    """The first run on a fresh machine reads every wheel: it must not depend on how the
    threads happen to interleave (CPython 3.11's ast.parse is not safe on two threads)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    some = dict(list(ray_releases.supported_releases().items())[:COLD_RELEASES])
    monkeypatch.setattr(ray_releases, "supported_releases", lambda: some)
    with _busy_interpreter():
        found = all_facts()
    assert list(found) == list(some)
    for version, extract in found.items():
        assert extract["version"] == version
        assert any(n.endswith("/gcs_service.proto") for n in extract["descriptors"]), version
        assert (ray_releases.cache_dir() / f"{version}-{ray_releases.SCHEMA}.json").exists()


# --- the GCS messages gcs.py encodes and decodes by hand ---------------------------------------


def _exchange(reply: bytes, call: Callable[[gcs.GcsClient], object]) -> tuple[object, str, bytes]:
    client = Recorder(reply)
    try:
        result = call(client)
    finally:
        client.close()
    ((method, request),) = client.calls
    return result, method, request


def codec_problems(r: Release) -> list[str]:
    problems = []
    status = r.message("ray.rpc.GcsStatus")
    for path, request, reply in (
            (gcs._CHECK_ALIVE, "ray.rpc.CheckAliveRequest", "ray.rpc.CheckAliveReply"),
            (gcs._KV_GET, "ray.rpc.InternalKVGetRequest", "ray.rpc.InternalKVGetReply"),
            (gcs._KV_PUT, "ray.rpc.InternalKVPutRequest", "ray.rpc.InternalKVPutReply"),
            (gcs._GET_ALL_NODES, "ray.rpc.GetAllNodeInfoRequest", "ray.rpc.GetAllNodeInfoReply")):
        if r.method(path) != (request, reply):
            problems.append(f"{path} is {r.method(path)}, not ({request}, {reply})")
    if problems:
        return problems

    # CheckAlive: our empty request is theirs, and their reply gives us status and version.
    alive = r.message("ray.rpc.CheckAliveReply")
    version, _, request = _exchange(
        alive(status=status(code=0), ray_version=r.version).SerializeToString(),
        lambda c: c.check_alive())
    if r.message("ray.rpc.CheckAliveRequest").FromString(request).ListFields():
        problems.append("CheckAlive request is not an empty CheckAliveRequest")
    if version != r.version:
        problems.append(f"CheckAlive reply read as version {version!r}")
    refused = alive(status=status(code=5, message="not leader")).SerializeToString()
    try:
        _exchange(refused, lambda c: c.check_alive())
        problems.append("a CheckAlive reply with status 5 was taken as alive")
    except gcs.GcsUnavailable as exc:
        if "status 5: not leader" not in str(exc):
            problems.append(f"CheckAlive status read as {exc}")

    # KV get: the request's key and namespace, the reply's value, NotFound as None.
    got = r.message("ray.rpc.InternalKVGetReply")
    value, _, request = _exchange(
        got(status=status(code=0), value=b"v\x00\xff").SerializeToString(),
        lambda c: c.kv_get("podagent", "run_state"))
    parsed = r.message("ray.rpc.InternalKVGetRequest").FromString(request)
    if (parsed.key, parsed.namespace) != (b"run_state", b"podagent"):
        problems.append(f"KV get request parsed as {parsed}")
    if value != b"v\x00\xff":
        problems.append(f"KV get reply read as {value!r}")
    missing, _, _ = _exchange(
        got(status=status(code=17, message="not found")).SerializeToString(),
        lambda c: c.kv_get("ns", "absent"))
    if missing is not None:
        problems.append(f"KV get NotFound read as {missing!r}")

    # KV put: every field of the request, and a failed status raised.
    put_reply = r.message("ray.rpc.InternalKVPutReply")
    _, _, request = _exchange(put_reply(status=status(code=0)).SerializeToString(),
                              lambda c: c.kv_put("podagent", "stop_request", b'{"by": "w"}'))
    parsed = r.message("ray.rpc.InternalKVPutRequest").FromString(request)
    if (parsed.key, parsed.value, parsed.overwrite, parsed.namespace) != (
            b"stop_request", b'{"by": "w"}', True, b"podagent"):
        problems.append(f"KV put request parsed as {parsed}")
    try:
        _exchange(put_reply(status=status(code=9, message="full")).SerializeToString(),
                  lambda c: c.kv_put("ns", "k", b"v"))
        problems.append("a failed KV put was taken as done")
    except gcs.GcsUnavailable:
        pass

    # The node table: is the head's own node alive? (A worker asks before it joins.)
    node, nodes = r.message("ray.rpc.GcsNodeInfo"), r.message("ray.rpc.GetAllNodeInfoReply")
    state = r.pool.FindEnumTypeByName("ray.rpc.GcsNodeInfo.GcsNodeState")
    for listed, expected in (
            ([(False, "ALIVE"), (True, "DEAD")], False),
            ([(True, "DEAD"), (False, "ALIVE"), (True, "ALIVE")], True)):
        reply = nodes(status=status(code=0), node_info_list=[
            node(node_id=bytes([i]) * 28, node_manager_address=f"10.0.0.{i}",
                 is_head_node=head, state=state.values_by_name[alive].number,
                 resources_total={"CPU": 1.0}) for i, (head, alive) in enumerate(listed)])
        seen, _, request = _exchange(reply.SerializeToString(), lambda c: c.head_node_alive())
        if seen is not expected:
            problems.append(f"head node alive read as {seen} for {listed}")
        if r.message("ray.rpc.GetAllNodeInfoRequest").FromString(request).ListFields():
            problems.append("GetAllNodeInfo request is not an empty request")
    return problems


def test_gcs_codec_matches_every_releases_own_messages(releases):
    each(releases, codec_problems)


def test_node_table_fields_podagent_reads_exist_in_every_release(releases):
    """gcs.nodes() parses with the installed Ray's classes; these fields must be in each."""
    wanted = {"node_id", "node_manager_address", "state", "resources_total", "is_head_node",
              "start_time_ms"}

    def check(r: Release) -> list[str]:
        node = r.pool.FindMessageTypeByName("ray.rpc.GcsNodeInfo")
        missing = wanted - set(node.fields_by_name)
        alive = node.enum_types_by_name["GcsNodeState"].values_by_name.get("ALIVE")
        return ([f"GcsNodeInfo lacks {sorted(missing)}"] if missing else []) + (
            [] if alive else ["GcsNodeState has no ALIVE"])

    each(releases, check)


def test_census_reads_exist_in_every_release_that_has_them(releases):
    """registered() asks every release for one record and reads the table's size; nodes() uses
    the liveness read where the Ray it runs on has it (2.51 on), then asks for new nodes by id."""

    def check(r: Release) -> list[str]:
        problems = []
        request = r.pool.FindMessageTypeByName("ray.rpc.GetAllNodeInfoRequest")
        reply = r.pool.FindMessageTypeByName("ray.rpc.GetAllNodeInfoReply")
        if "limit" not in request.fields_by_name or "total" not in reply.fields_by_name:
            problems.append("GetAllNodeInfo has no limit or no total")
        method = r.method(gcs._GET_LIVENESS)
        if method is None:
            return problems
        listed = r.pool.FindMessageTypeByName(method[1]).fields_by_name["node_info_list"]
        missing = {"node_id", "node_manager_address", "state"} - set(
            listed.message_type.fields_by_name)
        if missing:
            problems.append(f"the liveness read's nodes lack {sorted(missing)}")
        selector = request.fields_by_name.get("node_selectors")
        if selector is None or "node_id" not in selector.message_type.fields_by_name:
            problems.append("GetAllNodeInfoRequest has the liveness read but no node_id selector")
        return problems

    each(releases, check)


# --- `ray start`, the health checks, token auth --------------------------------------------------


def _every_start_option() -> set[str]:
    """The options podagent ever passes to `ray start` (head and worker, every option on)."""
    env = {"DEBUG_RAY": "1", "PODAGENT_RAY_TEMP_DIR": "/tmp/r", "PODAGENT_LISTEN": "all"}
    settings = config.build({}, env)
    options = set()
    for role in Role:
        plan = ray_node.plan(settings, role, "10.0.0.2", 1, {}, head_ip="10.0.0.1")
        options |= {a for a in plan.argv if a.startswith("--")}
    return options


def test_every_ray_start_option_podagent_passes_exists_in_every_release(releases):
    options = _every_start_option()
    assert {"--head", "--address", "--dashboard-host", "--ray-debugger-external"} <= options

    def check(r: Release) -> list[str]:
        declared = set(re.findall(r'"(--[a-z0-9-]+)"', r.source("ray/scripts/scripts.py")))
        return [f"`ray start` has no {o}" for o in sorted(options - declared)]

    each(releases, check)


def test_health_check_variables_are_read_by_every_releases_gcs(releases):
    names = [k.removeprefix("RAY_") for k in ray_node.HEALTH_CHECK_ENV]

    def check(r: Release) -> list[str]:
        return [f"gcs_server does not know {n}" for n in names if not r.in_gcs_server(n)]

    each(releases, check)


# How each feature of ray_compat.FEATURES shows in a release's own files.
FEATURE_EVIDENCE: dict[str, Callable[[Release], bool]] = {
    "token_auth": lambda r: all(r.in_gcs_server(s)
                                for s in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")),
    "dashboard_startup_timeout": lambda r: ray_node.DASHBOARD_STARTUP_ENV in r.source(
        "ray/_private/ray_constants.py"),
}


def test_every_feature_of_the_table_has_its_evidence():
    assert set(FEATURE_EVIDENCE) == set(ray_compat.FEATURES)


@pytest.mark.parametrize("feature", sorted(ray_compat.FEATURES))
def test_features_appear_exactly_where_the_table_says(releases, feature):
    """FEATURES is what podagent gates on: proven release by release, both ways."""
    since = ray_compat.parse(ray_compat.FEATURES[feature].since)

    def check(r: Release) -> list[str]:
        has = FEATURE_EVIDENCE[feature](r)
        expected = ray_compat.parse(r.version) >= since
        return [] if has == expected else [f"{feature} present={has}, table says {expected}"]

    each(releases, check)


# --- the Jobs API and the cluster check's Ray calls ---------------------------------------------

# Every Jobs API route podagent calls itself (jobs.py, control.py, head.py).
ROUTES = {("get", "/api/version"), ("get", "/api/jobs/"),
          ("get", "/api/jobs/{job_or_submission_id}"),
          ("get", "/api/jobs/{job_or_submission_id}/logs"),
          ("post", "/api/jobs/{job_or_submission_id}/stop")}


def test_the_route_list_covers_every_route_podagent_calls():
    used = set()
    for path in (ROOT / "podagent").rglob("*.py"):
        used |= set(re.findall(r"/api/[a-z_/]*", path.read_text()))
    declared = {re.sub(r"\{[^}]+\}.*", "", route) for _, route in ROUTES}
    assert used <= declared | {"/api/jobs/"}, used - declared


def test_jobs_api_routes_exist_in_every_release(releases):
    def check(r: Release) -> list[str]:
        routes = set(re.findall(r'@routes\.(get|post)\(\s*"([^"]+)"',
                                r.source("ray/dashboard/modules/job/job_head.py")))
        return [f"the Jobs API has no {m.upper()} {p}" for m, p in sorted(ROUTES - routes)]

    each(releases, check)


def _parameters(source: str, cls: str, method: str) -> set[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        item.name == method:
                    args = item.args
                    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    return set()


def test_job_sdk_calls_podagent_makes_exist_in_every_release(releases):
    """jobs.JobRunner: JobSubmissionClient(url, headers=...), submit_job(entrypoint=...,
    submission_id=..., runtime_env=..., metadata=...), tail_job_logs(job_id)."""
    wanted = {"__init__": {"address", "headers"},
              "submit_job": {"entrypoint", "submission_id", "runtime_env", "metadata"},
              "tail_job_logs": {"job_id"}}

    def check(r: Release) -> list[str]:
        sdk = r.source("ray/dashboard/modules/job/sdk.py")
        missing = {m: p - _parameters(sdk, "JobSubmissionClient", m) for m, p in wanted.items()}
        return [f"JobSubmissionClient.{m} lacks {sorted(p)}" for m, p in missing.items() if p]

    each(releases, check)


def _forwards_kwargs_to_requests(source: str, cls: str, method: str) -> bool:
    """`cls.method` takes **kwargs and hands them to a requests.request(...) call."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == method and item.args.kwarg:
                name = item.args.kwarg.arg
                return any(isinstance(call, ast.Call) and ast.unparse(call.func) ==
                           "requests.request" and any(k.arg is None and ast.unparse(k.value) ==
                                                      name for k in call.keywords)
                           for call in ast.walk(item))
    return False


def test_the_job_clients_requests_take_podagents_timeout_in_every_release(releases):
    """jobs._client: Ray's job client sends its requests with no timeout; podagent's subclass
    sets one through SubmissionClient._do_request, whose keyword arguments go to requests."""
    def check(r: Release) -> list[str]:
        sdk = r.source("ray/dashboard/modules/dashboard_sdk.py")
        if _forwards_kwargs_to_requests(sdk, "SubmissionClient", "_do_request"):
            return []
        return ["SubmissionClient._do_request does not hand **kwargs to requests.request"]

    each(releases, check)


def test_cluster_check_placement_exists_in_every_release(releases):
    """clustercheck pins each rank to its node with NodeAffinitySchedulingStrategy."""
    def check(r: Release) -> list[str]:
        params = _parameters(r.source("ray/util/scheduling_strategies.py"),
                             "NodeAffinitySchedulingStrategy", "__init__")
        missing = {"node_id", "soft"} - params
        util = r.source("ray/util/__init__.py")
        return ([f"NodeAffinitySchedulingStrategy lacks {sorted(missing)}"] if missing else []) + (
            [] if "get_node_ip_address" in util else ["ray.util has no get_node_ip_address"])

    each(releases, check)


def test_cluster_check_driver_can_name_its_node_in_every_release(releases):
    """clustercheck.main: ray.init(address="auto", _node_ip_address=...)."""
    def check(r: Release) -> list[str]:
        init = r.source("ray/_private/worker.py")
        return [] if re.search(r'kwargs\.pop\(\s*"_node_ip_address"', init) else [
            "ray.init takes no _node_ip_address"]

    each(releases, check)


# Before this release `ray start --temp-dir` is the head's alone: a worker writes its session
# files under the head's temp dir path (see clustercheck.own_node_address).
WORKER_TEMP_DIR_SINCE = "2.55.0"


def test_workers_keep_their_own_temp_dir_exactly_from_2_55(releases):
    since = ray_compat.parse(WORKER_TEMP_DIR_SINCE)

    def check(r: Release) -> list[str]:
        ignored = "temp_dir is only configurable from a head node" in r.source(
            "ray/scripts/scripts.py")
        expected = ray_compat.parse(r.version) < since
        return [] if ignored == expected else [
            f"a worker's --temp-dir ignored={ignored}, expected {expected}"]

    each(releases, check)

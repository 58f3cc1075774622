"""Scale benchmark: 4 to 16+ pods on one host, podagent vs the floor vs `ray symmetric-run`.

The same three methods at each cluster size N, and what the head's census costs Ray's GCS up to
1,000 nodes.

The pods and the three methods are bench/bringup.py's (network namespaces on one bridge, a real
DNS server for `<id>.runpod.internal`, each pod a real Ray node with its own temp dir), here
with N counted in pods (N - 1 workers), every node given 2 CPUs and a 200 MB object store, and a
job that runs a few seconds, so the head's load while it runs can be read. Needs root and
iproute2, or pyroute2 where `ip` is missing. Run from the repository root:

    python bench/scale.py --quick          # 3 pods, one run of each method, the census to 64
    python bench/scale.py                  # 4, 8, 16 pods, 3 runs each; the census to 1,000
    python bench/scale.py --plot DIR       # DIR/results.json as a figure (needs matplotlib)

See bench/README.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import secrets
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench import bringup
from bench.bringup import Run, Setup
from podagent.cluster.census import NODE_POLL, WorkerCensus
from podagent.cluster.head_ray import WATCH_INTERVAL
from podagent.ray_access.gcs import GcsClient
from podagent.report import Reporter
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.benchkit import RunFailed, fmt, median, table, verdict
from tests.harness.pods import wait_for

METHODS = bringup.METHODS  # podagent, floor, symmetric
NET_PREFIX = "sc"  # this bench's namespaces; the tests use "pa", the other benches "pb"
SUBNET = "10.219.0.0/24"  # room for 253 pods
NODE_CPUS, OBJECT_STORE = 2, 200 * 2**20
POD_ENV = {
    # Ray's own per-node override (its autoscaler sets it too): without it every node of a
    # 16-pod host claims all its cores and 30 % of its memory for its object store.
    "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": NODE_CPUS, "object_store_memory": OBJECT_STORE}),
    "PODAGENT_NUM_GPUS": "0",  # like the floor's and symmetric-run's --num-gpus 0
    # Never NVLink multicast on a shared GPU host, in any process (nothing here uses the GPUs).
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
}
# The synthetic table's records are never health-checked: no raylet answers for them.
UNCHECKED = {"RAY_health_check_initial_delay_ms": "86400000",
             "RAY_health_check_period_ms": "86400000"}
SAMPLE_EVERY = 0.2
MODEL_SIZES = (64, 256, 1000)
TARGET_OVERHEAD_S, TARGET_JOIN_S = bringup.TARGET_OVERHEAD_S, bringup.TARGET_JOIN_S
TARGET_GCS_PCT = 1.0  # the census's cost to the GCS at 1,000 nodes, % of a core


# --- the head's processes while a run goes on ---------------------------------------------------


def head_process(c: harness.Cluster, name: str) -> int | None:
    for pid in c.head.pids():
        try:
            if psutil.Process(pid).name() == name:
                return pid
        except psutil.NoSuchProcess:
            continue
    return None


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far (user + system, all its threads; in clock ticks)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def gcs_seconds(pid: int) -> float:
    """The GCS's CPU time so far, to the nanosecond: a read costs it a fraction of a clock
    tick. From the scheduler's count of each of its threads (they live as long as it does);
    clock ticks where the kernel keeps no such count."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        return cpu_seconds(pid)


class HeadLoad:
    """bringup's Observer here: the head pod's podagent (when it runs there), GCS and raylet,
    sampled every SAMPLE_EVERY s (CPU time, RSS, open files) until the run's figures are taken;
    then what the run cost per window (while the head waits for its cluster, while the job
    runs), the DNS queries the pods made, their logs' size, and (one run per N) what each kind
    of node-table read costs the GCS on this live cluster."""

    def __init__(self, c: harness.Cluster, agent: int | None, census_window: float | None):
        self.c, self.census_window = c, census_window
        self.pids: dict[str, int | None] = {"agent": agent, "gcs_server": None, "raylet": None}
        self.samples: dict[str, list[tuple[float, float, int, int]]] = {k: [] for k in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                if pid is None and name != "agent":
                    pid = self.pids[name] = head_process(self.c, name)
                if pid is None:
                    continue
                try:
                    proc = psutil.Process(pid)
                    self.samples[name].append((time.time(), cpu_seconds(pid),
                                               proc.memory_info().rss, proc.num_fds()))
                except psutil.Error:
                    continue
            self._stop.wait(SAMPLE_EVERY)

    def finish(self, marks: dict[str, float | None]) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        windows = {"wait": (marks.get("up") or marks["t0"], marks.get("submitted")),
                   "job": (marks.get("submitted"), marks.get("finished"))}
        out: dict[str, Any] = {}
        for name, samples in self.samples.items():
            if samples:
                out[name] = {w: load(samples, *span) for w, span in windows.items()}
                out[name]["fds_max"] = max(s[3] for s in samples)
        out["dns_queries"] = len(self.c.dns.queries)
        out["log_mb"] = round(sum(tree_bytes(Path(p)) for p in self.c.tmp.values()) / 2**20, 1)
        gcs_pid = self.pids["gcs_server"]
        if self.census_window and gcs_pid:
            out["reads"] = read_costs(f"{self.c.head.ip}:{harness.RAY_PORT}", gcs_pid,
                                      self.census_window)
        return out


def load(samples: list[tuple[float, float, int, int]], start: float | None,
         end: float | None) -> dict[str, float] | None:
    """CPU (% of a core) and the largest RSS between two moments; None for too few samples."""
    if start is None or end is None:
        return None
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.1:
        return None
    first, last = inside[0], inside[-1]
    return {"cpu_pct": round(100.0 * (last[1] - first[1]) / (last[0] - first[0]), 2),
            "rss_mb": round(max(s[2] for s in inside) / 2**20, 1),
            "window_s": round(last[0] - first[0], 2)}


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


# --- what one read of the node table costs ------------------------------------------------------


class Metered(GcsClient):
    """A GcsClient that counts its calls by method and keeps its last reply's size."""

    def __init__(self, address: str):
        super().__init__(address)
        self.calls: Counter[str] = Counter()
        self.last_bytes = 0

    def _call(self, method: str, request: bytes, timeout: float) -> bytes:
        reply = super()._call(method, request, timeout)
        self.calls[method.rsplit("/", 1)[1]] += 1
        self.last_bytes = len(reply)
        return reply


# The head's reads: the whole table (what the census read every poll before), the liveness
# read that nodes() makes once it knows every node, and the table's size (registered()).
# What each census's RPCs are, for the reads per second it was seen making.
RPC_READS = {"census_before": {"GetAllNodeInfo": "table"},
             "census_now": {"GetAllNodeInfo": "size", "GetAllNodeAddressAndLiveness": "liveness"}}
READS: dict[str, Callable[[GcsClient], object]] = {
    "table": lambda g: g.node_table(),
    "liveness": lambda g: g.nodes(),
    "size": lambda g: g.registered(),
}


def gcs_rate(pid: int, seconds: float) -> float:
    """The GCS's CPU seconds per second while nobody asks it anything (subtracted below)."""
    before, started = gcs_seconds(pid), time.perf_counter()
    time.sleep(seconds)  # the idle window itself
    return (gcs_seconds(pid) - before) / (time.perf_counter() - started)


def read_costs(address: str, gcs_pid: int, window: float) -> dict[str, Any]:
    """Each read back to back for `window` seconds: per read, the reply's bytes, the GCS's CPU
    (minus its idle rate), this process's CPU (decoding it) and the wall time."""
    client = Metered(address)
    try:
        client.nodes()  # every node's record, once: from here nodes() reads liveness only
        idle = gcs_rate(gcs_pid, window)
        out: dict[str, Any] = {"idle_gcs_pct": round(100 * idle, 3)}
        for name, read in READS.items():
            count, gcs0, own0 = 0, gcs_seconds(gcs_pid), time.process_time()
            started = time.perf_counter()
            while time.perf_counter() - started < window:
                read(client)
                count += 1
            wall = time.perf_counter() - started
            gcs = gcs_seconds(gcs_pid) - gcs0 - idle * wall
            out[name] = {"reads": count, "bytes": client.last_bytes,
                         "gcs_ms": round(1000 * max(gcs, 0.0) / count, 4),
                         "head_ms": round(1000 * (time.process_time() - own0) / count, 4),
                         "wall_ms": round(1000 * wall / count, 4)}
        return out
    finally:
        client.close()


def census_rates(address: str, seconds: float, expected: int, new: bool) -> dict[str, Any]:
    """The census as the head runs it while it waits (a poll every NODE_POLL, never all
    expected in) for `seconds`: the reads it makes per second, by RPC. new=False is the census
    before: the whole table every poll. (Its cost to the GCS is the model's: at 1,000 records the
    GCS's own background work varies by more than the census costs.)"""
    client = Metered(address)
    census = WorkerCensus(client.nodes if new else client.node_table,
                          Reporter("head", "bench", None, stream=io.StringIO()),
                          client.registered if new else None)
    try:
        census.poll_joins(expected)  # the first read (every record) is not the steady state
        client.calls.clear()
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            census.poll_joins(expected)
            time.sleep(NODE_POLL)  # the head's own pace
        wall = time.perf_counter() - started
        return {"calls_per_s": {k: round(v / wall, 2) for k, v in client.calls.items()}}
    finally:
        client.close()


# --- the census on a synthetic table ------------------------------------------------------------


def register(address: str, count: int, first: int) -> None:
    """`count` more records in the node table, each a copy of the head's with its own id and
    address (10.<a>.<b>.<c> from `first` on): the GCS serves them like any node's."""
    from ray.core.generated import gcs_pb2, gcs_service_pb2

    client = GcsClient(address)
    raw = client._call("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", b"", 5.0)
    template = next(n for n in gcs_service_pb2.GetAllNodeInfoReply.FromString(raw).node_info_list
                    if n.is_head_node)

    def one(i: int) -> None:
        node = gcs_pb2.GcsNodeInfo()
        node.CopyFrom(template)
        ip = f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}"
        node.node_id, node.is_head_node = secrets.token_bytes(28), False
        node.node_manager_address = node.node_name = ip
        node.resources_total.pop("node:__internal_head__", None)
        request = gcs_service_pb2.RegisterNodeRequest(node_info=node).SerializeToString()
        client._call("/ray.rpc.NodeInfoGcsService/RegisterNode", request, 10.0)

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(first, first + count)))
    finally:
        client.close()


def run_census(run: Run, logdir: Path, sizes: list[int], window: float, timeout: float) -> None:
    """One head (no dashboard, no health checks) whose node table is grown to each size by
    registrations; at each size the reads' costs and the census's load, before and now."""
    with harness.cluster(0, NET_PREFIX, SUBNET) as c:
        env = harness.pod_env(**POD_ENV, **UNCHECKED)
        argv = c.ray_start(c.head, "--include-dashboard", "false")
        rc = harness.run_in_pod(c.head, argv, env, logdir / "head.out", timeout)
        if rc != 0:
            text = harness.read_text(logdir / "head.out")
            raise RunFailed(f"`ray start --head` exit {rc}: {benchkit.reason_line(text)}",
                            benchkit.last_lines(text))
        gcs_pid = wait_for(lambda: head_process(c, "gcs_server"), timeout=30,
                           what="the head's gcs_server")
        address = f"{c.head.ip}:{harness.RAY_PORT}"
        table, size = {}, 1
        for target in sorted(sizes):
            started = time.monotonic()
            register(address, target - size, size)
            size = target
            took = round(time.monotonic() - started, 2)
            table[str(size)] = {
                "registered_in_s": took, "reads": read_costs(address, gcs_pid, window),
                "census_before": census_rates(address, 2 * window, size + 1, new=False),
                "census_now": census_rates(address, 2 * window, size + 1, new=True)}
            print(f"    census: {size} nodes: one read of the whole table "
                  f"{table[str(size)]['reads']['table']}", flush=True)
        run.extra["sizes"] = table
        run.seconds = 0.0
        run.ok = True


# --- the model ----------------------------------------------------------------------------------


def real_reads(runs: list[Run]) -> dict[int, dict[str, Any]]:
    """pods -> read costs measured on a live cluster of that many Ray nodes."""
    found = {}
    for r in runs:
        reads = r.extra.get("observed", {}).get("reads")
        if r.ok and reads:
            found[r.n + 1] = reads
    return dict(sorted(found.items()))


def synthetic(runs: list[Run]) -> dict[int, dict[str, Any]]:
    for r in runs:
        if r.method == "census" and r.ok:
            return {int(k): v for k, v in r.extra["sizes"].items()}
    return {}


def fit(points: dict[int, dict[str, Any]], read: str, key: str) -> tuple[float, float] | None:
    """Least squares: value = a + b * nodes, over the measured sizes. The size read sends one
    record whatever the table holds: a constant (its mean), not a slope of noise."""
    xs = [n for n in points if read in points[n]]
    ys = [points[n][read][key] for n in xs]
    if read == "size" and ys:
        return statistics.mean(ys), 0.0
    if len(xs) < 2:
        return None
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


# Reads per second, by kind, of each census while the head waits and while the job runs.
# Before: the whole table every poll; now: the size every poll, the liveness read when it
# changed and at least every RECOUNT_EVERY (1 s); while the job runs, one liveness read a second
# (the head's watch) where there was a whole table.
POLICIES = {
    "before": {"wait": {"table": 1 / NODE_POLL}, "job": {"table": 1 / WATCH_INTERVAL}},
    "now": {"wait": {"size": 1 / NODE_POLL, "liveness": 1.0},
            "job": {"liveness": 1 / WATCH_INTERVAL}},
}


def modelled(cost: Callable[[str, str], float | None], policy: str, phase: str,
             key: str) -> float | None:
    """A census's load: sum over its reads of reads per second x the cost of one (ms) ->
    % of a core (key gcs_ms or head_ms) or bytes per second (key bytes)."""
    total = 0.0
    for read, rate in POLICIES[policy][phase].items():
        value = cost(read, key)
        if value is None:
            return None
        total += rate * (value if key == "bytes" else value / 10.0)
    return total


# --- tables -------------------------------------------------------------------------------------


def pods_of(run: Run) -> int:
    return run.n + 1


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    bring = [r for r in runs if r.method in METHODS]
    out = [f"### Scale benchmark ({meta['started']})", "",
           f"{meta['machine']}; Ray {meta['ray']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); {args.runs} run(s) per method and N; each node "
           f"{NODE_CPUS} CPUs and a {OBJECT_STORE >> 20} MB object store; a "
           f"{args.job_seconds:g} s job; load average {meta['load_min']:.1f}-"
           f"{meta['load_max']:.1f}.", ""]

    def values(method: str, pods: int, key: str) -> list[float]:
        mine = [r for r in bring if r.method == method and pods_of(r) == pods and r.ok]
        got = [r.seconds if key == "seconds" else r.extra.get(key) for r in mine]
        return [v for v in got if v is not None]

    def formed(method: str, pods: int) -> str:
        mine = [r for r in bring if r.method == method and pods_of(r) == pods]
        return f"{sum(r.ok for r in mine)}/{len(mine)}" if mine else "-"

    rows = []
    for pods in args.pods:
        sub = {m: median(values(m, pods, "seconds")) for m in METHODS}
        fin = {m: median(values(m, pods, "finished_s")) for m in METHODS}
        over = None if sub["podagent"] is None or sub["floor"] is None else (
            sub["podagent"] - sub["floor"])
        over_fin = None if fin["podagent"] is None or fin["floor"] is None else (
            fin["podagent"] - fin["floor"])
        rows.append([str(pods), *(fmt(sub[m]) for m in METHODS), fmt(over),
                     verdict(None if over is None else over <= TARGET_OVERHEAD_S),
                     *(fmt(fin[m]) for m in METHODS), fmt(over_fin),
                     " / ".join(formed(m, pods) for m in METHODS)])
    out += ["#### Start → job submitted and start → job finished (medians, seconds)", "",
            "symmetric-run has no job submission: its 'submitted' is its entrypoint starting, "
            "its 'finished' the entrypoint's end. podagent learns that a job ended from the "
            "Jobs API every 0.5 s; the floor is asked every 0.1 s.", "",
            table(["pods", "podagent submitted", "floor", "symmetric-run",
                   "overhead (podagent - floor)", f"≤ {TARGET_OVERHEAD_S:g} s",
                   "podagent finished", "floor", "symmetric-run", "overhead",
                   "formed (podagent / floor / symmetric-run)"], rows), ""]

    rows = []
    for pods in args.pods:
        late = {m: median([r.extra["finished_s"] - r.extra["job_end_s"] for r in bring
                           if r.method == m and pods_of(r) == pods and r.ok
                           and "job_end_s" in r.extra and "finished_s" in r.extra])
                for m in ("podagent", "floor")}
        ends = {m: median(values(m, pods, "job_end_s")) for m in METHODS}
        if any(v is not None for v in (*late.values(), *ends.values())):
            rows.append([str(pods), *(fmt(ends[m]) for m in METHODS),
                         *(fmt(late[m], 2) for m in ("podagent", "floor"))])
    if rows:
        out += ["#### The job's own end (its last line's time) and how late the launcher "
                "knew (medians, seconds)", "",
                table(["pods", "job ended: podagent", "floor", "symmetric-run",
                       "podagent knew after", "floor knew after"], rows), ""]

    rows = []
    for pods in args.pods:
        mine = [r for r in bring if r.method == "podagent" and pods_of(r) == pods]
        lat = [x for r in mine for x in r.extra.get("join_latency_s", [])]
        if lat:
            rows.append([str(pods), str(len(lat)), fmt(statistics.median(lat), 3),
                         fmt(max(lat), 3), verdict(max(lat) <= TARGET_JOIN_S)])
    if rows:
        out += ["#### Join detection (worker registered in Ray → the head prints it)", "",
                table(["pods", "joins", "median s", "max s", f"≤ {TARGET_JOIN_S:g} s"], rows),
                ""]

    rows = []
    for pods in args.pods:
        obs = {m: [r.extra["observed"] for r in bring if r.method == m and pods_of(r) == pods
                   and r.ok and "observed" in r.extra] for m in ("podagent", "floor")}
        agent, floor = obs["podagent"], obs["floor"]
        if not agent:
            continue
        rows.append([str(pods),
                     fmt(window_median(agent, "agent", "wait", "cpu_pct"), 1),
                     fmt(window_median(agent, "agent", "wait", "rss_mb"), 0),
                     fmt(window_median(agent, "agent", "job", "cpu_pct"), 1),
                     fmt(window_median(agent, "agent", "job", "rss_mb"), 0),
                     fmt(window_median(agent, "gcs_server", "wait", "cpu_pct"), 1),
                     fmt(window_median(floor, "gcs_server", "wait", "cpu_pct"), 1),
                     fmt(window_median(agent, "gcs_server", "job", "cpu_pct"), 1),
                     " / ".join(largest(agent, "fds_max", p)
                                for p in ("agent", "gcs_server", "raylet")),
                     largest(agent, "dns_queries"), largest(agent, "log_mb")])
    if rows:
        out += ["#### The head's load (medians over podagent's runs; the floor's GCS for "
                "comparison)", "",
                "'wait' is from the head's Ray up (podagent's ray_head event; the floor: start) "
                "to the job submitted, 'job' from then to the job finished; CPU in % of one core. "
                "Open files, DNS queries (all pods) and the pods' Ray logs: the largest run.", "",
                table(["pods", "podagent CPU % wait", "RSS MB", "CPU % job", "RSS MB",
                       "GCS CPU % wait", "floor's GCS % wait", "GCS CPU % job",
                       "open files: podagent / GCS / raylet", "DNS queries", "Ray logs MB"],
                      rows), ""]
    out += census_tables(runs)

    failed = [r for r in runs if not r.ok]
    if failed:
        rows = [[r.method, str(pods_of(r)), str(r.index), r.reason.replace("|", "/")[:400]]
                for r in failed]
        out += ["#### Failed runs", "", table(["method", "pods", "run", "reason"], rows), ""]
    return "\n".join(out)


def window_median(observed: list[dict[str, Any]], proc: str, window: str,
                  key: str) -> float | None:
    got = [(o.get(proc) or {}).get(window) for o in observed]
    return median([g[key] for g in got if g])


def largest(observed: list[dict[str, Any]], key: str, proc: str | None = None) -> str:
    got = [(o.get(proc) or {}).get(key) if proc else o.get(key) for o in observed]
    got = [g for g in got if g is not None]
    return str(max(got)) if got else "-"


def census_tables(runs: list[Run]) -> list[str]:
    real, synth = real_reads(runs), synthetic(runs)
    points = {**real, **{n: s["reads"] for n, s in synth.items()}}
    if not points:
        return []
    out = []
    rows = []
    for nodes, reads in sorted(points.items()):
        source = "synthetic" if nodes in synth and nodes not in real else "real nodes"
        for read in READS:
            r = reads[read]
            rows.append([str(nodes), source, read, str(r["bytes"]), fmt(r["gcs_ms"], 3),
                         fmt(r["head_ms"], 3), fmt(r["wall_ms"], 3), str(r["reads"])])
    out += ["#### One read of the node table (per read: reply bytes, the GCS's CPU ms, the "
            "reader's CPU ms, wall ms)", "",
            "'table' is the whole table (the census's read before); 'liveness' what nodes() "
            "reads once it knows every node; 'size' what the census asks before each read. "
            "Synthetic: records registered in a head's GCS (copies of its own).", "",
            table(["nodes", "source", "read", "bytes", "GCS ms", "reader ms", "wall ms",
                   "reads"], rows), ""]

    fits = {(read, key): fit(points, read, key) for read in READS
            for key in ("bytes", "gcs_ms", "head_ms")}
    rows = [[read, key, fmt(f[0], 4), fmt(f[1], 6)] for (read, key), f in fits.items() if f]
    if rows:
        out += ["#### Fit over every measured size (value = a + b × nodes)", "",
                table(["read", "value", "a", "b per node"], rows), ""]

    def measured(nodes: int) -> Callable[[str, str], float | None]:
        return lambda read, key: points[nodes][read][key]

    def fitted(nodes: int) -> Callable[[str, str], float | None]:
        def cost(read: str, key: str) -> float | None:
            f = fits.get((read, key))
            return None if f is None else f[0] + f[1] * nodes
        return cost

    costs = [(n, "real nodes" if n in real else "synthetic", measured(n)) for n in points]
    costs += [(n, "fit", fitted(n)) for n in MODEL_SIZES if fits[("table", "gcs_ms")]]
    rows = []
    for nodes, source, cost in sorted(costs, key=lambda c: (c[0], c[1] == "fit")):
        cells = [fmt(modelled(cost, p, phase, key), digits)
                 for phase, key, digits in (("wait", "gcs_ms", 2), ("job", "gcs_ms", 3),
                                            ("wait", "head_ms", 2))
                 for p in POLICIES]
        kb = [fmt((modelled(cost, p, "wait", "bytes") or 0) / 1000, 1) for p in POLICIES]
        idle = points[nodes].get("idle_gcs_pct") if source != "fit" else None
        rates = synth.get(nodes) if source == "synthetic" else None
        ran = " → ".join(" + ".join(f"{v:g} {RPC_READS[which].get(k, k)}" for k, v in
                                    rates[which]["calls_per_s"].items())
                         for which in RPC_READS) if rates else "-"
        rows.append([str(nodes), source, *cells, *kb, fmt(idle, 1), ran])
    out += ["#### The census's load: reads per second × the cost of one read", "",
            "Before: the whole table every 0.1 s while the head waits, every 1 s while the job "
            "runs. Now: the table's size every 0.1 s, the liveness read when the size changed "
            "or a second passed, and one liveness read a second while the job runs. In % of "
            "one core: the GCS's, and the head's own (decoding). The GCS's own background "
            "work with nothing asking ('GCS idle') is there for scale. The last column is the "
            "census run for real against the synthetic table: its reads per second.", "",
            table(["nodes", "costs", "GCS % wait, before", "now", "GCS % job, before", "now",
                   "head % wait, before", "now", "kB/s wait, before", "now", "GCS idle %",
                   "reads/s, before → now"], rows), ""]
    for source, at in (("measured", measured(1000) if 1000 in points else None),
                       ("fit", fitted(1000))):
        before = modelled(at, "before", "wait", "gcs_ms") if at else None
        now = modelled(at, "now", "wait", "gcs_ms") if at else None
        if before is not None and now is not None:
            out += [f"At 1,000 nodes ({source}) the census costs the GCS {before:.2f} % of a core "
                    f"while the head waits before ({verdict(before <= TARGET_GCS_PCT)} against "
                    f"≤ {TARGET_GCS_PCT:g} %), {now:.2f} % now "
                    f"({verdict(now <= TARGET_GCS_PCT)}).", ""]
    return out


# --- the figure ---------------------------------------------------------------------------------


def plot(directory: Path, png: Path, host: str | None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = benchkit.saved_results(directory)
    runs = [Run(**r) for r in saved["runs"]]
    host = host or saved["meta"]["machine"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    labels = {"podagent": "podagent", "floor": "floor (ray start + job submit)",
              "symmetric": "ray symmetric-run"}
    for ax, key, title in ((axes[0], "seconds", "start → job submitted"),
                           (axes[1], "finished_s", "start → job finished")):
        for method in METHODS:
            xs, mids, lows, highs = [], [], [], []
            for pods in saved["args"]["pods"]:
                got = [r.seconds if key == "seconds" else r.extra.get(key) for r in runs
                       if r.method == method and pods_of(r) == pods and r.ok]
                got = [g for g in got if g is not None]
                if got:
                    mid = statistics.median(got)
                    xs.append(pods)
                    mids.append(mid)
                    lows.append(mid - min(got))
                    highs.append(max(got) - mid)
            if xs:
                ax.errorbar(xs, mids, yerr=[lows, highs], marker="o", capsize=3,
                            label=labels[method])
        if key == "finished_s":  # podagent's job itself ended earlier than podagent knew
            ends = [(pods, statistics.median(got)) for pods in saved["args"]["pods"]
                    if (got := [r.extra["job_end_s"] for r in runs if r.method == "podagent"
                                and pods_of(r) == pods and r.ok and "job_end_s" in r.extra])]
            if ends:
                ax.plot(*zip(*ends, strict=True), linestyle="--", marker=".", color="C0",
                        label="podagent's job: its own end")
                ax.legend()
        ax.set_title(title)
        ax.set_xlabel("pods (Ray nodes)")
        ax.set_xticks(saved["args"]["pods"])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds (median; bars: min-max)")
    axes[0].legend()
    figure.suptitle(f"Bring-up vs cluster size: {host}", fontsize=10)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    print(f"bench: wrote {png}")
    return 0


# --- main ---------------------------------------------------------------------------------------


def rerender(directory: Path) -> int:
    saved = benchkit.saved_results(directory)
    runs = [Run(**r) for r in saved["runs"]]
    return benchkit.rerender(directory, runs, saved, render)


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, per="method and N", methods=(*METHODS, "census"),
                                   run_timeout="each run", timeout=240.0)
    parser.add_argument("--pods", type=benchkit.parse_ints, default=[4, 8, 16],
                        help="cluster sizes N in pods, head included (default 4,8,16)")
    parser.add_argument("--job-seconds", type=float, default=2.0,
                        help="how long the job runs (default 2)")
    parser.add_argument("--census-sizes", type=benchkit.parse_ints, default=list(MODEL_SIZES),
                        help="node-table sizes of the synthetic census (default 64,256,1000)")
    parser.add_argument("--census-window", type=float, default=1.0,
                        help="seconds each kind of read is repeated for (default 1)")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="start no run after this many seconds (0: none); what was "
                             "measured is written")
    parser.add_argument("--quick", action="store_true",
                        help="3 pods, one run of each method, the census to 64 nodes")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="print and rewrite DIR/results.md from DIR/results.json")
    parser.add_argument("--plot", type=Path, metavar="DIR",
                        help="draw DIR/results.json (matplotlib) into --png; run nothing")
    parser.add_argument("--png", type=Path, default=Path("docs/scale.png"),
                        help="where --plot writes (default docs/scale.png)")
    parser.add_argument("--host", help="the machine, as the figure's title names it "
                                       "(default: as the results describe it)")
    args = parser.parse_args(argv)
    if args.plot:
        return plot(args.plot, args.png, args.host)
    if args.report:
        return rerender(args.report)
    if args.quick:
        args.pods, args.runs, args.census_sizes = [3], 1, [64]
    benchkit.require_root(parser)

    from ray.core.generated import gcs_pb2, gcs_service_pb2  # noqa: F401 - warm: no import in t

    outdir, meta = benchkit.begin(args.out, "scale-", net_prefix=NET_PREFIX)
    began = time.monotonic()
    census_per_n: set[int] = set()

    def observer(n: int, method: str) -> Callable[[harness.Cluster, int | None], HeadLoad]:
        def make(c: harness.Cluster, agent: int | None) -> HeadLoad:
            # The reads' costs on the live cluster: the first floor run of each N (its job
            # is over and nothing else asks the GCS).
            measure = method == "floor" and "census" in args.methods and n not in census_per_n
            if measure:
                census_per_n.add(n)
            return HeadLoad(c, agent, args.census_window if measure else None)
        return make

    def setup(n: int, method: str) -> Setup:
        return Setup(prefix=NET_PREFIX, subnet=SUBNET, env=POD_ENV,
                     job_seconds=args.job_seconds, until_finished=True,
                     observe=observer(n, method))

    bodies: dict[str, Callable[[Run, Path, Setup], None]] = {
        "podagent": lambda r, d, s: bringup.run_podagent(r, d, args.run_timeout, s),
        "floor": lambda r, d, s: bringup.run_floor(r, d, args.run_timeout, s),
        "symmetric": lambda r, d, s: bringup.run_symmetric(r, d, args.run_timeout, s),
    }

    def plan() -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
        if "census" in args.methods:
            run = Run("census", max(args.census_sizes) - 1, 1)
            yield run, "census", bringup.observed(lambda r, d: run_census(
                r, d, args.census_sizes, args.census_window, args.run_timeout))
        # Every N in each round, largest first: --deadline cuts the last round short, and
        # the largest N is the one that matters most.
        for i in range(1, args.runs + 1):
            for pods in sorted(args.pods, reverse=True):
                for method in (m for m in args.methods if m in METHODS):
                    if args.deadline and time.monotonic() - began > args.deadline:
                        print("bench: --deadline reached; no more runs", flush=True)
                        return
                    run = Run(method, pods - 1, i)
                    yield run, f"{method}-p{pods}-r{i}", bringup.observed(
                        lambda r, d, m=method: bodies[m](r, d, setup(r.n, m)))

    def line(run: Run) -> str:
        figure = (f"{run.seconds:.2f} s" if run.seconds is not None else "-") + (
            f" / {run.extra['finished_s']:.2f} s" if run.extra.get("finished_s") else "")
        return benchkit.status_line(run, f"{run.method:<9} pods={pods_of(run)} run {run.index}",
                                    figure=figure)

    runs = benchkit.execute_all(plan(), outdir, line)
    return benchkit.finish(runs, outdir, meta, args, render)


if __name__ == "__main__":
    sys.exit(main())

"""The cluster check: the default job when no entrypoint is given.

Ray places one rank on every GPU (one per node with gloo when a node has no GPU), each under its
own pod's NCCL environment (inherited from the pod's Ray node, never overridden by the job).
They form one torch.distributed group and check, naming the rank and node of any failure:
all_reduce, gather to rank 0, all_gather, a large payload with algbw/busbw, many sequential
gathers, one DDP training step (equal averaged gradients on every rank), the reward endpoint
from every node, DistributedSampler shards and steps per epoch, and which transport NCCL itself
reports having used.

Prints a per-node table, then `ALL CHECKS PASSED` (exit 0) or `CHECK FAILED: ...` (exit 1),
then one `podagent-check-json: {...}` line for machines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from podagent.checks import collectives
from podagent.cluster.runstate import CHECK_JSON_PREFIX
from podagent.config.fields import FIELD_BY_ATTR
from podagent.platform import nccl

# A loaded pod can take minutes to start a Python worker that imports torch; a collective
# that does not finish in this time is stuck (a rank that cannot reach another).
START_TIMEOUT = float(os.environ.get("PODAGENT_CHECK_START_TIMEOUT", "300"))
RUN_TIMEOUT = float(os.environ.get("PODAGENT_CHECK_RUN_TIMEOUT", "300"))
GPU_MAX_BYTES = 256 * collectives.MB
CPU_MAX_BYTES = 16 * collectives.MB  # gloo on CPU pods: enough to see the link, not minutes
DATASET_SIZE, BATCH = 1000, 8
# NCCL's own words for the path a channel took ("... via NET/Socket/0", "via P2P/CUMEM/read").
_VIA = re.compile(r"\bvia (\S+)")
_NETWORK = re.compile(r"Using network (\S+)")


@dataclass(frozen=True)
class Rank:
    rank: int
    node_id: str
    node_ip: str
    gpu: bool


def plan_ranks(nodes: Sequence[Mapping[str, Any]], backend: str | None = None
               ) -> tuple[str, list[Rank]]:
    """(backend, ranks): one rank per GPU when every node has GPUs (NCCL), else one per node
    (gloo). The head's node first, then the rest by address, so rank 0 is on the head."""
    alive = [n for n in nodes if n.get("Alive")]

    def order(n: Mapping[str, Any]) -> tuple[bool, tuple[int, ...]]:
        is_head = any(k.startswith("node:__internal_head__") for k in n.get("Resources", {}))
        ip = n["NodeManagerAddress"]
        return (not is_head, tuple(int(p) for p in ip.split(".")) if ip[0].isdigit() else (0,))

    alive.sort(key=order)
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    chosen = backend or ("nccl" if alive and all(gpus) else "gloo")
    ranks: list[Rank] = []
    for n, count in zip(alive, gpus, strict=True):
        for _ in range(count if chosen == "nccl" else 1):
            ranks.append(Rank(len(ranks), n["NodeID"], n["NodeManagerAddress"], chosen == "nccl"))
    return chosen, ranks


def transports(nccl_log: str) -> list[str]:
    """The transports NCCL reports in its debug output, e.g. ['NET/Socket'] or ['P2P/CUMEM']."""
    seen = {"/".join(via.split("/")[:2]) for via in _VIA.findall(nccl_log)}
    return sorted(seen or {f"NET/{name}" for name in _NETWORK.findall(nccl_log)})


def sampler_report(shards: Mapping[int, Sequence[int]], dataset_size: int) -> str | None:
    """None when the shards cover the dataset and overlap only by the sampler's padding."""
    world = len(shards)
    counts = Counter(i for shard in shards.values() for i in shard)
    missing = set(range(dataset_size)) - set(counts)
    if missing:
        return f"{len(missing)} samples in no shard (e.g. {sorted(missing)[:5]})"
    # DistributedSampler (drop_last=False) pads to a multiple of the world by repeating samples.
    padding = (-dataset_size) % world
    repeated = sum(c - 1 for c in counts.values())
    if repeated != padding:
        return f"{repeated} samples appear in more than one shard; padding explains {padding}"
    return None


class CheckRank:
    """One rank, in its own Ray worker process on its node (the class is made remote in main)."""

    def where(self) -> dict[str, Any]:
        """Before any collective: this rank's node, device and interface, checked locally."""
        import ray

        from podagent.platform import nccl

        info: dict[str, Any] = {"host": socket.gethostname(),
                                "ip": ray.util.get_node_ip_address(), "error": None}
        env = {k: os.environ[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                                         "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE")
               if k in os.environ}
        info["env"] = env
        names = sorted(nccl.interfaces())
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            spec = env.get(var)
            if not spec:
                continue
            # gloo takes exact names; NCCL matches prefixes.
            found = (nccl.match_ifname(spec, names) if var.startswith("NCCL")
                     else [n for n in spec.split(",") if n in names])
            if found == []:
                info["error"] = (f"{var}={spec} names no interface on this node; it has "
                                 f"{', '.join(names)}")
                return info
        try:
            import torch

            info["torch"] = torch.__version__
            if ray.get_gpu_ids():
                info["device"] = torch.cuda.get_device_name(0)
            else:
                info["device"] = "cpu"
        except Exception as exc:  # torch missing or the GPU unusable: name it, per node
            info["error"] = f"torch is not usable here: {type(exc).__name__}: {exc}"
        return info

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, rank: int, world: int, backend: str, master: str, port: int,
            max_bytes: int, reward_url: str | None, hang: bool = False) -> dict[str, Any]:
        import datetime
        import tempfile

        import torch.distributed as dist

        import podagent.job

        podagent.job.enable_stack_dumps()  # a hang's stacks where py-spy may not read them
        result: dict[str, Any] = {"rank": rank, "checks": {}, "failed": None}
        checks = result["checks"]
        log_file = None
        if backend == "nccl":
            # NCCL's report of the path each channel took, read back after the traffic.
            log_file = tempfile.NamedTemporaryFile(prefix="podagent-nccl-", suffix=".log",
                                                   delete=False).name
            os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET,P2P,SHM",
                              NCCL_DEBUG_FILE=log_file)
            import torch

            torch.cuda.set_device(0)

        def record(name: str, error: str | None, **figures: Any) -> bool:
            checks[name] = {"ok": error is None, "error": error, **figures}
            if error and not result["failed"]:
                result["failed"] = name
            return error is None

        try:
            started = time.perf_counter()
            dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank,
                                    world_size=world,
                                    timeout=datetime.timedelta(seconds=RUN_TIMEOUT))
            record("init", None, seconds=round(time.perf_counter() - started, 3))
            if (record("all_reduce", collectives.check_all_reduce(rank, world, backend))
                    and record("gather", collectives.check_gather(rank, world, backend))
                    and record("all_gather", collectives.check_all_gather(rank, world,
                                                                          backend))):
                error, per_op = collectives.check_sequential_gathers(rank, world, backend)
                record("sequential_gathers", error, count=200, ms_per_op=round(per_op, 3))
                sweep = [collectives.measure_all_reduce(size, world, backend)
                         for size in collectives.payload_sizes(max_bytes)]
                record("payload", None, sweep=[b.as_dict() for b in sweep])
                if hang:
                    # The line marks when the hang began (the watch counts from the last line).
                    print(f"check: rank {rank}: hang drill: this rank never enters the DDP step",
                          flush=True)
                    while True:
                        time.sleep(3600)
                error, figures = collectives.ddp_step(rank, world, backend)
                record("ddp_step", error, **figures)
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:  # a collective that failed or timed out: this rank says so
            record("collectives" if checks else "init", f"{type(exc).__name__}: {exc}")
        record("reward", *_probe_reward(reward_url))
        shard = collectives.sampler_shard(DATASET_SIZE, world, rank, BATCH)
        expected = collectives.expected_steps(DATASET_SIZE, world, BATCH)
        result["shard"] = shard["indices"]
        record("sampler_steps", None if shard["steps"] == expected else
               f"{shard['steps']} steps per epoch, expected ceil(ceil({DATASET_SIZE}/{world})"
               f"/{BATCH}) = {expected}", steps=shard["steps"])
        if log_file:
            with open(log_file, errors="replace") as f:
                text = f.read()
            os.unlink(log_file)
            result["transport"] = transports(text)
        else:
            gloo_if = os.environ.get("GLOO_SOCKET_IFNAME")
            result["transport"] = [f"gloo/TCP via {gloo_if}" if gloo_if
                                   else "gloo/TCP (default interface)"]
        return result


def _probe_reward(url: str | None) -> tuple[str | None, ...]:
    if not url:
        return (None,)
    import requests

    body = {"query": ["The answer is \\boxed{4}"], "prompts": ["What is 2+2?"],
            "labels": ["4"]}
    try:
        reply = requests.post(url, json=body, timeout=30)
        rewards = reply.json().get("rewards") if reply.ok else None
    except (requests.RequestException, ValueError) as exc:
        return (f"{url}: {type(exc).__name__}: {exc}",)
    if reply.status_code != 200 or not isinstance(rewards, list) or len(rewards) != 1:
        return (f"{url} answered {reply.status_code} {reply.text[:120]!r}",)
    return (None,)


# --- the driver ----------------------------------------------------------------------------------


@dataclass
class Report:
    backend: str
    ranks: list[Rank]
    where: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    results: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)

    def fail(self, check: str, rank: Rank | None, message: str) -> None:
        where = f" on node {rank.node_ip} (rank {rank.rank})" if rank else ""
        self.failures.append(f"{check}{where}: {message}")


def hang_drill() -> int | None:
    """The rank PODAGENT_CHECK_HANG_RANK names, on the job's first attempt only: a drill that
    shows the hang watch at work on a real cluster (its stacks dumped, the rank named, the
    check run again and passing)."""
    raw = os.environ.get("PODAGENT_CHECK_HANG_RANK", "")
    if not raw.isdigit() or os.environ.get("PODAGENT_ATTEMPT", "1") != "1":
        return None
    return int(raw)


def _ray_wait(refs: list[Any], timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Results by rank, and an error by rank for those that raised or did not finish."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = set(ready)
    results, errors = {}, {}
    for i, ref in enumerate(refs):
        if ref not in done:
            errors[i] = f"no answer within {timeout:g} s"
            continue
        try:
            results[i] = ray.get(ref)
        except Exception as exc:  # the actor died or raised: its own message, one line
            errors[i] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return results, errors


def run_check(max_bytes: int | None = None) -> Report:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    backend, ranks = plan_ranks(ray.nodes(), os.environ.get("PODAGENT_CHECK_BACKEND") or None)
    report = Report(backend, ranks)
    if not ranks:
        report.fail("nodes", None, "Ray reports no alive node")
        return report
    limit = max_bytes or (GPU_MAX_BYTES if backend == "nccl" else CPU_MAX_BYTES)
    remote = ray.remote(CheckRank)
    actors = [remote.options(
        num_cpus=0, num_gpus=1 if r.gpu else 0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(r.node_id, soft=False),
    ).remote() for r in ranks]
    where, errors = _ray_wait([a.where.remote() for a in actors], START_TIMEOUT)
    report.where = where
    for i, info in where.items():
        if info.get("error"):
            errors[i] = info["error"]
    for i, error in sorted(errors.items()):
        report.fail("node setup", ranks[i], error)
    if report.failures:
        return report
    master = ranks[0].node_ip
    port = ray.get(actors[0].free_port.remote(), timeout=60)
    url = os.environ.get("REMOTE_RM_URL") or None
    drill = hang_drill()  # read here: the driver has the head's environment
    if drill is not None:  # the ranks' own output is not the driver's (log_to_driver=False)
        print(f"check: hang drill: rank {drill} never enters its DDP step", flush=True)
    refs = [a.run.remote(r.rank, len(ranks), backend, master, port, limit, url,
                         r.rank == drill)
            for a, r in zip(actors, ranks, strict=True)]
    results, errors = _ray_wait(refs, RUN_TIMEOUT + 60)
    report.results = results
    for i, error in sorted(errors.items()):
        report.fail("collectives", ranks[i], error)
    for i, result in sorted(results.items()):
        for name, check in result["checks"].items():
            if not check["ok"]:
                report.fail(name, ranks[i], check["error"])
    if len(results) == len(ranks):
        problem = sampler_report({i: r["shard"] for i, r in results.items()}, DATASET_SIZE)
        if problem:
            report.fail("sampler_shards", None, problem)
    return report


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("✓" if ok else "✗")


def node_rows(report: Report) -> list[dict[str, Any]]:
    rows = []
    by_node: dict[str, list[Rank]] = {}
    for r in report.ranks:
        by_node.setdefault(r.node_ip, []).append(r)
    for ip, node_ranks in by_node.items():
        info = report.where.get(node_ranks[0].rank, {})
        results = [report.results.get(r.rank) for r in node_ranks]

        def ok(name: str, results: list[Any] = results) -> bool | None:
            values = [res["checks"][name]["ok"] for res in results
                      if res and name in res["checks"]]
            return all(values) if values else None

        payload = [res["checks"]["payload"]["sweep"][-1] for res in results
                   if res and "payload" in res["checks"]]
        seq = [res["checks"]["sequential_gathers"].get("ms_per_op") for res in results
               if res and "sequential_gathers" in res["checks"]]
        rows.append({
            "node": ip, "host": info.get("host", "?"), "ranks": [r.rank for r in node_ranks],
            "device": info.get("device", "?"),
            "transport": sorted({t for res in results if res for t in res["transport"]}),
            "all_reduce": ok("all_reduce"), "gather": ok("gather"),
            "all_gather": ok("all_gather"), "sequential_gathers": ok("sequential_gathers"),
            "gather_ms": max(seq) if seq else None,
            "busbw": _slowest_bus(payload),
            "ddp_step": ok("ddp_step"),
            "reward": ok("reward"), "sampler": ok("sampler_steps"),
            "steps": next((res["checks"]["sampler_steps"]["steps"] for res in results
                           if res and "sampler_steps" in res["checks"]), None),
        })
    return rows


def render(report: Report, reward: bool) -> list[str]:
    rows = node_rows(report)
    header = ["node", "ranks", "device", "transport", "all_reduce", "gather", "all_gather",
              "200 gathers", "busbw GB/s", "ddp step", "reward", "sampler"]
    table = [header]
    for row in rows:
        table.append([
            row["node"], ",".join(map(str, row["ranks"])), str(row["device"])[:28],
            ",".join(row["transport"]) or "?", _mark(row["all_reduce"]), _mark(row["gather"]),
            _mark(row["all_gather"]),
            f"{_mark(row['sequential_gathers'])} {row['gather_ms']:.2f} ms/op"
            if row["gather_ms"] is not None else _mark(row["sequential_gathers"]),
            f"{row['busbw']:.3f}" if row["busbw"] is not None else "-",
            _mark(row["ddp_step"]),
            _mark(row["reward"]) if reward else "-", _mark(row["sampler"]),
        ])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in table]
    return lines


def data_lines(report: Report) -> list[str]:
    """Steps per epoch as nodes are added: the figure that must shrink with the cluster."""
    nodes = list(dict.fromkeys(r.node_ip for r in report.ranks))
    per_node = Counter(r.node_ip for r in report.ranks)
    parts = []
    world = 0
    for k, ip in enumerate(nodes, start=1):
        world += per_node[ip]
        steps = collectives.expected_steps(DATASET_SIZE, world, BATCH)
        parts.append(f"{steps} on {k} node{'s' if k > 1 else ''} (world {world})")
    return [f"data: {DATASET_SIZE} samples, batch {BATCH} per rank: steps per epoch "
            + ", ".join(parts)]


def bandwidth_lines(report: Report) -> list[str]:
    if not report.results:
        return []
    sweeps = [r["checks"]["payload"]["sweep"] for r in report.results.values()
              if "payload" in r["checks"]]
    if not sweeps:
        return []
    lines = []
    for i, point in enumerate(sweeps[0]):
        # The slowest rank's time is the collective's time.
        slowest = min((s[i] for s in sweeps), key=lambda b: b["algbw"])
        bus = (f"busbw {slowest['busbw']:.3f} GB/s" if slowest["busbw"] is not None
               else "busbw - (one rank: nothing crosses a link)")
        lines.append(f"all_reduce {point['size_bytes'] / collectives.MB:g} MiB: "
                     f"algbw {slowest['algbw']:.3f} GB/s, {bus}")
    return lines


def ddp_steps(report: Report) -> list[dict[str, Any]]:
    return [r["checks"]["ddp_step"] for r in report.results.values()
            if "ddp_step" in r["checks"]]


def ddp_lines(report: Report) -> list[str]:
    steps = ddp_steps(report)
    if not steps or not all(s["ok"] for s in steps):
        return []  # a failed step is named among the failures
    return [f"ddp step: {steps[0]['params']} parameters on {len(steps)} ranks, each its own "
            f"batch: averaged gradients equal on every rank, "
            f"{max(s['max_diff'] for s in steps):.1e} from the mean of the ranks' own; weights "
            f"equal after the step ({max(s['seconds'] for s in steps):.2f} s, after "
            f"{max(s['import_s'] for s in steps):.2f} s importing torch._dynamo for DDP)"]


def _slowest_bus(points: list[dict[str, Any]]) -> float | None:
    """The lowest bus bandwidth of the points; None when none has one (a single rank)."""
    return min((p["busbw"] for p in points if p["busbw"] is not None), default=None)


def summary(report: Report, seconds: float | None = None) -> dict[str, Any]:
    sweeps = [r["checks"]["payload"]["sweep"][-1] for r in report.results.values()
              if "payload" in r["checks"]]
    steps = ddp_steps(report)
    return {
        "passed": not report.failures, "backend": report.backend, "world": len(report.ranks),
        "nodes": node_rows(report), "failures": report.failures,
        "busbw": _slowest_bus(sweeps),
        "algbw": min((s["algbw"] for s in sweeps), default=None),
        "payload_bytes": sweeps[0]["size_bytes"] if sweeps else None,
        "transport": sorted({t for r in report.results.values() for t in r["transport"]}),
        "ddp_step": {"ok": all(s["ok"] for s in steps),
                     "max_diff": max(s["max_diff"] for s in steps),
                     "seconds": max(s["seconds"] for s in steps),
                     "import_s": max(s["import_s"] for s in steps)} if steps else None,
        "seconds": seconds,
    }


# The head's address, as the head gives it to the job (job_spec.env): the setting a worker
# takes it from too.
HEAD_ADDR_ENV = FIELD_BY_ATTR["head_addr"].env


def own_node_address(environ: Mapping[str, str] = os.environ,
                     ifaces: Mapping[str, list[str]] | None = None) -> str | None:
    """The address of this pod's Ray node, for the driver to connect as; None: let Ray find it.

    Ray runs a job's driver on the head, whose node address the head gives the job. Said
    outright because Ray 2.48 reads it from node_ip_address.json in its session dir, and
    before Ray 2.55 a worker ignores its own --temp-dir and writes its session under the
    head's path: on pods that share that directory (one filesystem, as namespaced pods; a
    shared volume) the file names the node that started last. A driver that takes a worker's
    address for its own connects to that worker's raylet and gives that address as the owner
    of its actors; the GCS cannot reach an owner there and cancels every actor at once
    ("SchedulingCancelled: Actor creation cancelled", ActorDiedError on every rank).
    """
    head = environ.get(HEAD_ADDR_ENV)
    ifaces = nccl.interfaces() if ifaces is None else ifaces
    return head if head and any(head in addrs for addrs in ifaces.values()) else None


def main(argv: Iterable[str] = ()) -> int:
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False,
             _node_ip_address=own_node_address())
    started = time.monotonic()
    report = run_check()
    reward = bool(os.environ.get("REMOTE_RM_URL"))
    nodes = len({r.node_ip for r in report.ranks})
    print(f"check: {len(report.ranks)} ranks on {nodes} nodes, backend {report.backend}",
          flush=True)
    for line in (render(report, reward) + bandwidth_lines(report) + ddp_lines(report)
                 + data_lines(report)):
        print(f"check: {line}", flush=True)
    transport = sorted({t for r in report.results.values() for t in r["transport"]})
    if transport:
        print(f"check: transport: {', '.join(transport)}", flush=True)
    expected = os.environ.get("PODAGENT_NUM_NODES")
    if expected and expected.isdigit() and nodes != int(expected):
        report.fail("nodes", None, f"the check reached {nodes} nodes, the cluster has {expected}")
    for failure in report.failures:
        print(f"check: CHECK FAILED: {failure}", flush=True)
    seconds = round(time.monotonic() - started, 1)
    if not report.failures:
        print(f"check: ALL CHECKS PASSED ({seconds:.1f} s)", flush=True)
    print(CHECK_JSON_PREFIX + json.dumps(summary(report, seconds), default=str), flush=True)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

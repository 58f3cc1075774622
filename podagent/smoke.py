"""The built-in smoke job: one task pinned to each alive node prints its host, IP and GPUs.

Run by the head when no entrypoint is given (`python -m podagent.smoke`).
"""

from __future__ import annotations

import os
import socket
import sys


def main() -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, str, int]:
        # The task holds every GPU of its node, so this counts the node's GPUs as Ray sees them.
        return socket.gethostname(), ray.util.get_node_ip_address(), len(ray.get_gpu_ids())

    refs = [
        where.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            num_gpus=n["Resources"].get("GPU", 0),
        ).remote()
        for n in nodes
    ]
    results = ray.get(refs, timeout=120)
    for host, ip, gpus in sorted(results, key=lambda r: r[1]):
        print(f"smoke: node {ip} host {host} gpus {gpus}", flush=True)
    ips = {ip for _, ip, _ in results}
    total_gpus = sum(g for _, _, g in results)
    print(f"smoke: {len(results)} tasks ran on {len(ips)} nodes, {total_gpus} GPUs "
          f"(PODAGENT_NUM_NODES={os.environ.get('PODAGENT_NUM_NODES', '?')})", flush=True)
    expected = os.environ.get("PODAGENT_NUM_NODES")
    if expected and expected.isdigit() and len(ips) != int(expected):
        print(f"smoke: FAILED: expected {expected} nodes, reached {len(ips)}", flush=True)
        return 1
    print("smoke: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

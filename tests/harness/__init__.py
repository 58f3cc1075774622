"""Fake RunPod pods on one machine, shared by the end-to-end tests (tests/e2e) and the
benchmarks (bench/). Plain modules (no pytest import); they need root and iproute2's `ip` (or
pyroute2 where `ip` is missing).

- pods.py: pods as Linux network namespaces on a private bridge, and a real DNS server answering
  `<pod_id>.runpod.internal`;
- netlink.py: the `ip` command lines of pods.py done through pyroute2, for a host without
  iproute2;
- agents.py: the real podagent entrypoint in a pod, configured by environment variables, its
  output captured to a file;
- cluster.py: a head and N workers on a fresh network, podagent or Ray started in them, every
  process of a pod killed at the end;
- benchkit.py: what a benchmark does around its scenario (options, the run loop, the results
  folder, markdown tables).
"""

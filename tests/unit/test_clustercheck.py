"""The cluster check's pure parts: who gets a rank, what NCCL's report says, shard coverage."""

from __future__ import annotations

from podagent.checks import clustercheck, collectives


def _node(ip, gpus, head=False, alive=True):
    resources = {"CPU": 2.0, **({"GPU": float(gpus)} if gpus else {})}
    if head:
        resources["node:__internal_head__"] = 1.0
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": alive,
            "Resources": resources}


def test_ranks_per_gpu_with_nccl_head_first_then_by_address():
    backend, ranks = clustercheck.plan_ranks(
        [_node("10.0.0.10", 2), _node("10.0.0.9", 1), _node("10.0.0.20", 1, head=True),
         _node("10.0.0.5", 8, alive=False)])
    assert backend == "nccl"
    assert [(r.rank, r.node_ip) for r in ranks] == [
        (0, "10.0.0.20"), (1, "10.0.0.9"), (2, "10.0.0.10"), (3, "10.0.0.10")]


def test_a_node_without_gpus_makes_it_gloo_one_rank_per_node():
    backend, ranks = clustercheck.plan_ranks([_node("10.0.0.1", 0, head=True),
                                              _node("10.0.0.2", 4)])
    assert backend == "gloo" and [r.node_ip for r in ranks] == ["10.0.0.1", "10.0.0.2"]
    assert not any(r.gpu for r in ranks)


def test_transport_from_nccl_channel_lines():
    log = ("host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0\n"
           "host:1:2 [0] NCCL INFO Channel 01/0 : 1[1] -> 0[0] [receive] via NET/Socket/0\n"
           "host:1:2 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/CUMEM/read\n")
    assert clustercheck.transports(log) == ["NET/Socket", "P2P/CUMEM"]
    assert clustercheck.transports("NCCL INFO Using network IB\n") == ["NET/IB"]
    assert clustercheck.transports("") == []


def test_sampler_shards_cover_the_dataset_and_overlap_only_by_padding():
    shards = {r: collectives.sampler_shard(10, 3, r, 2)["indices"] for r in range(3)}
    assert clustercheck.sampler_report(shards, 10) is None  # 2 padded repeats, expected
    shards[2] = shards[1]  # a rank that got another rank's shard
    assert "in no shard" in clustercheck.sampler_report(shards, 10)


def test_steps_per_epoch_halve_from_one_node_to_two():
    assert [collectives.expected_steps(1000, w, 8) for w in (1, 2, 3)] == [125, 63, 42]


def _measured_alone(tmp_path) -> collectives.Bandwidth:
    """A real gloo all_reduce with one rank (a one-machine cluster without GPUs)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        return collectives.measure_all_reduce(collectives.MB, 1, "gloo", warmup=1,
                                              iterations=2)
    finally:
        dist.destroy_process_group()


def test_one_rank_has_no_bus_bandwidth_and_shows_a_dash(tmp_path):
    point = _measured_alone(tmp_path)
    assert point.algbw > 0 and point.busbw is None
    rank = clustercheck.Rank(0, "id-1", "10.0.0.1", gpu=False)
    report = clustercheck.Report("gloo", [rank], results={0: {
        "transport": [], "checks": {"payload": {"ok": True, "sweep": [point.as_dict()]}}}})
    header, row = clustercheck.render(report, reward=False)
    column = header.index("busbw GB/s")
    assert row[column:column + 2] == "- " and "busbw GB/s" in header
    assert clustercheck.bandwidth_lines(report) == [
        f"all_reduce 1 MiB: algbw {point.algbw:.3f} GB/s, busbw - (one rank: nothing "
        f"crosses a link)"]
    assert clustercheck.summary(report)["busbw"] is None


def test_two_ranks_report_the_slower_ones_bus_bandwidth():
    assert collectives.bus_factor(1) is None and collectives.bus_factor(2) == 1.0
    points = [{"size_bytes": collectives.MB, "seconds": 0.01, "algbw": a, "busbw": a}
              for a in (2.0, 1.5)]
    ranks = [clustercheck.Rank(r, f"id-{r}", f"10.0.0.{r + 1}", gpu=False) for r in (0, 1)]
    report = clustercheck.Report("gloo", ranks, results={r: {
        "transport": [], "checks": {"payload": {"ok": True, "sweep": [points[r]]}}}
        for r in (0, 1)})
    assert clustercheck.summary(report)["busbw"] == 1.5
    assert clustercheck.bandwidth_lines(report)[0].endswith("busbw 1.500 GB/s")


def _ddp_rank(rank: int, world: int, store: str, results) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results.put(collectives.ddp_step(rank, world, "gloo"))
    finally:
        dist.destroy_process_group()


def test_a_ddp_step_across_two_gloo_ranks_averages_their_gradients(tmp_path):
    import multiprocessing

    # Rank 1 in a child (spawned: no fork of a process that holds torch), rank 0 here.
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_ddp_rank, args=(1, 2, str(tmp_path / "store"), results))
    child.start()
    try:
        _ddp_rank(0, 2, str(tmp_path / "store"), results)
        got = [results.get(timeout=120) for _ in range(2)]
    finally:
        child.join(timeout=30)
    for error, figures in got:
        assert error is None
        assert figures["params"] == 32 * 64 + 64 + 64 + 1 and 0 <= figures["max_diff"] < 1e-5


def _flat(*values):
    import torch

    return torch.tensor(values, dtype=torch.float32)


def test_ddp_verdict_names_the_ranks_that_differ_and_a_wrong_mean():
    own = [_flat(1.0, 2.0), _flat(3.0, 4.0)]
    mean = _flat(2.0, 3.0)
    weights = [_flat(0.5, 0.5)] * 2
    assert collectives.ddp_verdict(0, own, [mean, mean], weights) == (None, 0.0)
    error, _ = collectives.ddp_verdict(0, own, [mean, _flat(2.0, 3.5)], weights)
    assert error == "averaged gradients differ from those of rank(s) [1] (by up to 0.5)"
    # Equal on every rank, but not the mean: a reduction that summed without dividing.
    error, off = collectives.ddp_verdict(1, own, [mean * 2] * 2, weights)
    assert off == 3.0 and error.startswith("averaged gradients are not the mean")
    error, _ = collectives.ddp_verdict(0, own, [mean, mean], [weights[0], _flat(0.5, 0.4)])
    assert error == "weights after the step differ from those of rank(s) [1]"


def test_the_ddp_step_has_a_column_and_a_line():
    step = {"ok": True, "error": None, "params": 2177, "max_diff": 2e-9, "seconds": 0.04,
            "import_s": 1.5}
    ranks = [clustercheck.Rank(r, f"id-{r}", f"10.0.0.{r + 1}", gpu=False) for r in (0, 1)]
    report = clustercheck.Report("gloo", ranks, results={r: {
        "transport": [], "checks": {"ddp_step": step}} for r in (0, 1)})
    header, row = clustercheck.render(report, reward=False)[:2]
    column = header.index("ddp step")
    assert row[column] == "✓"
    assert clustercheck.ddp_lines(report) == [
        "ddp step: 2177 parameters on 2 ranks, each its own batch: averaged gradients equal on "
        "every rank, 2.0e-09 from the mean of the ranks' own; weights equal after the step "
        "(0.04 s, after 1.50 s importing torch._dynamo for DDP)"]
    assert clustercheck.summary(report, 1.5)["ddp_step"] == {
        "ok": True, "max_diff": 2e-9, "seconds": 0.04, "import_s": 1.5}


def test_the_driver_connects_as_the_heads_node_only_when_that_address_is_its_own():
    """Ray 2.48 on pods that share Ray's temp dir would otherwise take a worker's address
    for the driver's own (and cancel every actor of the check)."""
    ifaces = {"lo": ["127.0.0.1"], "podnet1": ["10.65.0.2"]}
    here = {clustercheck.HEAD_ADDR_ENV: "10.65.0.2"}
    assert clustercheck.own_node_address(here, ifaces) == "10.65.0.2"
    elsewhere = {clustercheck.HEAD_ADDR_ENV: "10.65.0.3"}
    assert clustercheck.own_node_address(elsewhere, ifaces) is None  # Ray decides
    assert clustercheck.own_node_address({}, ifaces) is None

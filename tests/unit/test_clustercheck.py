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

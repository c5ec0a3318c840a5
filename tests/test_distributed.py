"""CPU tests of kquant_cute.distributed: the rank plan, the sharding and the combine.

Single-process tests check the plan (Kimi-K3 TP8 = 384 channels per rank, expert maps) and
that the shards' reference outputs sum to the unsharded fp64 reference (no collective).
Multi-process tests run the real combine on the gloo backend (world sizes 2 and 4, tiny
geometries, the torch reference as every rank's compute): TP, EP and EP+TP, replicated and
sharded tokens, against the unsharded fp64 reference and against each other.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kquant_cute import qsrt
from kquant_cute.distributed import (DistributedMoE, ParallelPlan, launch, layouts, shard_experts,
                                     shard_weights)

from kquant_cute.reference import reference_moe
from kquant_cute.weights import MoEWeights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dist_check import CheckConfig, assemble, check_worker, reference_outputs  # noqa: E402

F64_TOL = 1e-12


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# -- the plan ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,width", [(1, 3072), (2, 1536), (4, 768), (8, 384)])
def test_kimi_k3_tensor_parallel_widths(tp, width):
    ranges = [ParallelPlan(896, 3072, tp, 1, r).channel_range() for r in range(tp)]
    assert [n for _, n in ranges] == [width] * tp
    assert [f for f, _ in ranges] == [r * width for r in range(tp)]
    assert ParallelPlan(896, 3072, tp, 1, tp - 1).local_intermediate == width


def test_uneven_split_is_whole_blocks_padded_to_widest():
    # 5 Hadamard blocks over 2 ranks: 3 + 2 blocks, both built at 384; 7 experts over 2: 4 + 3.
    plans = [ParallelPlan(7, 640, 2, 2, r) for r in range(4)]
    assert [p.channel_range() for p in plans] == [(0, 384), (384, 256), (0, 384), (384, 256)]
    assert {p.local_intermediate for p in plans} == {384}
    assert [p.expert_range() for p in plans] == [(0, 4), (0, 4), (4, 3), (4, 3)]
    assert {p.local_experts for p in plans} == {4}
    unpadded = ParallelPlan(7, 640, 2, 2, 3, pad=False)
    assert (unpadded.local_intermediate, unpadded.local_experts) == (256, 3)


def test_rank_grid_and_expert_map():
    world_maps = []
    for r in range(8):
        p = ParallelPlan(10, 1024, 2, 4, r)
        assert (p.ep_rank, p.tp_rank) == divmod(r, 2)
        emap = p.expert_map()
        assert emap.dtype == torch.int32 and emap.shape == (10,)
        first, count = p.expert_range()
        assert emap[first:first + count].tolist() == list(range(count))
        assert int((emap >= 0).sum()) == count and bool((emap[emap < 0] == -1).all())
        world_maps.append(emap)
    # every expert lives on exactly one expert group (tp_size ranks)
    here = torch.stack([(m >= 0).int() for m in world_maps]).sum(0)
    assert here.tolist() == [2] * 10
    assert ParallelPlan(10, 1024, 8, 1, 0).expert_map() is None
    assert layouts(4) == [(4, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=8, intermediate=320), "multiple of 128"),
    (dict(num_experts=8, intermediate=256, tp_size=4), "Hadamard blocks"),
    (dict(num_experts=2, intermediate=256, ep_size=4), "no experts"),
    (dict(num_experts=8, intermediate=256, tp_size=2, rank=2), "out of range"),
    (dict(num_experts=0, intermediate=256), "num_experts"),
])
def test_plan_rejects_bad_grids(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelPlan(**kwargs)


def test_shard_rejects_mismatched_weights():
    w = MoEWeights.random(4, 256, 256, 2, shared_hidden_vectors=True)
    with pytest.raises(ValueError, match="intermediate 256, the plan 512"):
        shard_weights(w, ParallelPlan(4, 512, 2, 1, 0))
    with pytest.raises(ValueError, match="4 experts, the plan 8"):
        shard_weights(w, ParallelPlan(8, 256, 1, 2, 0))


def test_distributed_layer_needs_a_process_group():
    w = MoEWeights.random(4, 256, 256, 2, shared_hidden_vectors=True)
    with pytest.raises(RuntimeError, match="not initialized"):
        DistributedMoE(w, ParallelPlan(4, 256), topk=2, capacity=4, backend="reference",
                       comm_dtype=torch.float64)


# -- sharding is exact (sum of the shards' references, no collective) -----------------------


def _sum_of_shards(full: MoEWeights, tp: int, ep: int, x, ids, w, activation="situ"):
    total = None
    for r in range(tp * ep):
        plan = ParallelPlan(full.num_experts, full.intermediate, tp, ep, r)
        shard = shard_weights(full, plan)
        assert shard.intermediate == plan.local_intermediate
        assert shard.num_experts == plan.local_experts
        part = reference_moe(x, ids, w, shard, activation=activation, dtype=torch.float64,
                             expert_map=plan.expert_map())
        total = part if total is None else total + part
    return total


@pytest.mark.parametrize("shared,coupled,geom,grid", [
    (True, False, (8, 256, 512), (4, 1)),
    (False, False, (8, 256, 512), (2, 2)),
    (True, True, (8, 512, 512), (2, 2)),     # a coupled rank cut further on 128 blocks
    (True, False, (7, 256, 640), (2, 4)),    # uneven: 3 + 2 blocks, 2 + 2 + 2 + 1 experts
])
def test_shards_sum_to_the_unsharded_reference(shared, coupled, geom, grid):
    e, h, i = geom
    full = MoEWeights.random(e, h, i, 3 if not coupled else 2,
                             "sqg_e4m3" if coupled else "mcg",
                             shared_hidden_vectors=shared, coupled=coupled, seed=3)
    cfg = CheckConfig(num_experts=e, hidden=h, intermediate=i, topk=3)
    x, ids, w = cfg.inputs(9)
    ref = reference_moe(x, ids, w, full, activation="situ", dtype=torch.float64)
    got = _sum_of_shards(full, *grid, x, ids, w)
    assert _rel(got, ref) < F64_TOL
    # a shard alone is a genuinely partial output
    plan = ParallelPlan(e, i, *grid, 0)
    part = reference_moe(x, ids, w, shard_weights(full, plan), activation="situ",
                         dtype=torch.float64, expert_map=plan.expert_map())
    assert _rel(part, ref) > 0.1


def test_qsrt_layer_ranks_shard_exactly():
    # A whole QSRT layer has two input vectors (its halves), so qsrt owns its TP extents:
    # TP4's ranks 0+1 are exactly TP2's rank 0 (one half), and EP cuts any rank further.
    layer = qsrt.random_layer(1, qsrt.Geometry(8, 512, 512), seed=5)
    cfg = CheckConfig(num_experts=8, hidden=512, intermediate=512, topk=2)
    x, ids, w = cfg.inputs(6)

    def ref(weights, emap=None):
        return reference_moe(x, ids, w, weights, activation="situ", dtype=torch.float64,
                             expert_map=emap)

    half0 = ref(layer.rank(2, 0))
    whole = half0 + ref(layer.rank(2, 1))
    tp4 = [ref(layer.rank(4, r)) for r in range(4)]
    assert _rel(tp4[0] + tp4[1], half0) < F64_TOL
    assert _rel(sum(tp4), whole) < F64_TOL
    ep_tp = 0
    for r in range(4):  # tp 2 x ep 2
        plan = ParallelPlan(8, 512, 2, 2, r)
        ep_tp = ep_tp + ref(shard_experts(layer.rank(2, plan.tp_rank), plan), plan.expert_map())
    assert _rel(ep_tp, whole) < F64_TOL


# -- the combine on gloo, several processes -------------------------------------------------

CONFIGS = {
    # world 4: TP4, EP4, TP2 x EP2; shared hidden-side vectors (Kimi-K3 / b12x)
    "shared-w4": (4, CheckConfig(num_experts=8, hidden=256, intermediate=512, topk=2,
                                 tokens=(4, 8), seed=1)),
    # world 2: per-expert vectors (EXL3), uneven split padded (5 blocks, 7 experts)
    "perexpert-uneven-w2": (2, CheckConfig(num_experts=7, hidden=256, intermediate=640,
                                           topk=3, shared_hidden_vectors=False, tokens=(6,),
                                           seed=2)),
    # world 2: QSRT coupled transforms (a coupled rank cut on 128-channel blocks)
    "coupled-w2": (2, CheckConfig(num_experts=8, hidden=512, intermediate=512, topk=2, bits=2,
                                  codebook="sqg_e4m3", coupled=True, tokens=(4,), seed=3)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gloo_run(request):
    world, cfg = CONFIGS[request.param]
    results = launch(check_worker, world, backend="gloo", args=(cfg,), timeout_s=120)
    return world, cfg, results, reference_outputs(cfg)


def test_gloo_outputs_match_the_unsharded_reference(gloo_run):
    world, cfg, results, ref = gloo_run
    keys = [k for k in results[0] if isinstance(k, tuple)]
    expected = {(tp, ep, tl, m) for tp, ep in layouts(world) for tl in cfg.token_layouts
                for m in cfg.tokens}
    assert set(keys) == expected
    for key in keys:
        out = assemble(results, key)
        r = ref[("eager", key[3])][: out.shape[0]]
        assert out.shape == r.shape, key
        assert _rel(out, r) < F64_TOL, key
    # replicated tokens: every rank holds the whole combined output
    for key in keys:
        if key[2] == "replicated":
            for rank_result in results[1:]:
                assert torch.equal(rank_result[key], results[0][key]), key


def test_gloo_tp_and_ep_agree(gloo_run):
    world, cfg, results, _ = gloo_run
    for m in cfg.tokens:
        tp = assemble(results, (world, 1, "replicated", m))
        ep = assemble(results, (1, world, "replicated", m))
        assert _rel(tp, ep) < F64_TOL
        sharded = assemble(results, (1, world, "sharded", m))
        assert _rel(sharded, ep[: sharded.shape[0]]) < F64_TOL


def _unequal_tokens_worker(rank, world):
    cfg = CheckConfig(num_experts=8, hidden=256, intermediate=512, topk=2)
    plan = ParallelPlan(8, 512, world, 1, rank)
    layer = DistributedMoE(shard_weights(cfg.weights(), plan), plan, topk=2, capacity=8,
                           comm_dtype=torch.float64, act_dtype=torch.float32, tokens="sharded",
                           backend="reference")
    x, ids, w = cfg.inputs(8)
    m = 2 + rank
    try:
        layer(x[:m], ids[:m], w[:m])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_sharded_tokens_need_equal_counts_on_every_rank():
    msgs = launch(_unequal_tokens_worker, 2, backend="gloo", timeout_s=60)
    assert all("same token count" in m and "[2, 3]" in m for m in msgs), msgs


def _hang_worker(rank, world):
    import time

    if rank == 1:
        time.sleep(60)
    return rank


def test_launch_times_out_and_stops_its_ranks():
    with pytest.raises(TimeoutError, match="did not finish within 3"):
        launch(_hang_worker, 2, backend="gloo", timeout_s=3)


def test_bench_dist_table_takes_the_slowest_rank():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import bench_dist

    row = {"tp": 2, "ep": 1, "comm_dtype": "float32", "tokens": 1536, "block_m": 32}
    results = [[{**row, "kernel": 2.0, "comm": 0.3, "step": 2.4, "alone": 1.9}],
               [{**row, "kernel": 2.2, "comm": 0.2, "step": 2.5}]]
    cells = bench_dist.summarize(results)
    assert cells[0]["kernel"] == 2.2 and cells[0]["kernel_min"] == 2.0
    assert cells[0]["step"] == 2.5 and cells[0]["alone"] == 1.9
    assert abs(cells[0]["exposed_comm"] - 0.3) < 1e-12
    lines = bench_dist.format_table(cells, 2)
    assert len({line.count("|") for line in lines}) == 1
    assert [c.strip() for c in lines[2].strip("|").split("|")] == [
        "2", "tp2 x ep1", "float32", "1,536", "32", "2.200", "1.900", "0.300", "2.500", "+0.300"]

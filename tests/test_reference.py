"""Tests for kquant_cute.reference: activations, reference_moe vs naive_moe, the route pack."""

from __future__ import annotations

import random

import pytest
import torch

from kquant_cute import reference as ref
from kquant_cute.planners import ROUTE_BLOCK_SIZES, padded_route_slots
from kquant_cute.reference import (
    ACTIVATIONS,
    SITU_BETA,
    SITU_LBETA,
    RoutePack,
    activation_fn,
    naive_moe,
    reference_moe,
    route_pack_reference,
)

HIDDEN, INTER, BITS = 256, 128, 2


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny matmuls: one intra-op thread is faster and immune to OpenMP oversubscription
    (on a loaded host with few cores, several intra-op threads make a strided fp64 matmul
    orders of magnitude slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------


def test_activation_formulas_and_saturation():
    g = torch.linspace(-30, 30, 101, dtype=torch.float64)
    u = torch.linspace(40, -40, 101, dtype=torch.float64)
    silu = activation_fn("silu")(g, u)
    torch.testing.assert_close(silu, g / (1 + torch.exp(-g)) * u, rtol=1e-12, atol=1e-12)
    situ = activation_fn("situ")(g, u)
    b, lb = SITU_BETA, SITU_LBETA
    want = b * torch.tanh(g / b) / (1 + torch.exp(-g)) * lb * torch.tanh(u / lb)
    torch.testing.assert_close(situ, want, rtol=1e-12, atol=1e-12)
    # SiTU saturates: |gate part| < beta and |up part| < lbeta, both reached at large inputs.
    assert situ.abs().max() < b * lb
    big = torch.tensor([1e4], dtype=torch.float64)
    torch.testing.assert_close(activation_fn("situ")(big, big), big.new_tensor([b * lb]))
    torch.testing.assert_close(activation_fn("situ")(big, -big), big.new_tensor([-b * lb]))
    # Near zero tanh(x / c) * c = x: SiTU is SiLU there.
    small = torch.linspace(-1e-3, 1e-3, 11, dtype=torch.float64)
    torch.testing.assert_close(activation_fn("situ")(small, small),
                               activation_fn("silu")(small, small), rtol=1e-6, atol=0)


def test_activations_agree_with_the_kernels_and_the_format_doc():
    """The torch reference and the rotation kernel hold the activation set and SiTU's
    saturation constants each (the kernels import nothing from the API package): they agree,
    and docs/formats.md states the same values."""
    from pathlib import Path

    from kquant_cute.kernels import rotate

    assert ACTIVATIONS == rotate.ACTIVATIONS
    assert (SITU_BETA, SITU_LBETA) == (rotate.SITU_BETA, rotate.SITU_LBETA)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text()
    assert f"beta = {SITU_BETA:g} and lbeta = {SITU_LBETA:g}" in doc
    for name in ACTIVATIONS:
        assert callable(activation_fn(name))


@pytest.mark.parametrize("bad", ["gelu", "SILU", "", None])
def test_unknown_activation(bad):
    with pytest.raises(ValueError, match="silu, situ"):
        activation_fn(bad)


# ---------------------------------------------------------------------------------------
# reference_moe vs naive_moe
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights_mod():
    return pytest.importorskip("kquant_cute.weights")


def _make_weights(weights_mod, num_experts, shared, seed=0):
    return weights_mod.MoEWeights.random(
        num_experts, HIDDEN, INTER, BITS, codebook="mcg", shared_hidden_vectors=shared, seed=seed
    )


def _inputs(m, topk, num_ids, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=gen, dtype=dtype)
    ids = torch.stack([torch.randperm(num_ids, generator=gen)[:topk] for _ in range(m)])
    w = torch.rand(m, topk, generator=gen, dtype=torch.float32) + 0.1
    return x, ids.to(torch.int32), w / w.sum(-1, keepdim=True)


def _assert_close(a, b):
    scale = b.abs().max().clamp_min(1e-30)
    assert (a - b).abs().max() <= 1e-10 * scale, float((a - b).abs().max() / scale)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_naive(weights_mod, shared, activation):
    wts = _make_weights(weights_mod, 5, shared, seed=1)
    assert wts.shared_hidden_vectors == shared
    x, ids, w = _inputs(5, 2, 5, seed=2)
    got = reference_moe(x, ids, w, wts, activation=activation, dtype=torch.float64)
    want = naive_moe(x, ids, w, wts, activation=activation, dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == (5, HIDDEN)
    assert got.abs().max() > 0
    _assert_close(got, want)


def test_reference_matches_dense_per_route_formula(weights_mod):
    # Independent of naive_moe: trellis.dense_weight on the raw MoEWeights fields.
    from kquant_cute import trellis

    wts = _make_weights(weights_mod, 4, True, seed=3)
    x, ids, w = _inputs(3, 2, 4, seed=4)
    out = torch.zeros(3, HIDDEN, dtype=torch.float64)
    vec = lambda v, e: v if v.dim() == 1 else v[e]  # noqa: E731
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            dw = lambda name, suh, svh: trellis.dense_weight(  # noqa: E731
                getattr(wts, f"{name}_trellis")[e], suh, svh, wts.codebook, dtype=torch.float64)
            g = x[t] @ dw("gate", vec(wts.gate_suh, e), wts.gate_svh[e])
            u = x[t] @ dw("up", vec(wts.up_suh, e), wts.up_svh[e])
            h = torch.nn.functional.silu(g) * u
            out[t] += float(w[t, k]) * (h @ dw("down", wts.down_suh[e], vec(wts.down_svh, e)))
    _assert_close(reference_moe(x, ids, w, wts, dtype=torch.float64), out)


@pytest.mark.parametrize("shared", [False, True])
def test_expert_map_drops_off_rank_routes(weights_mod, shared):
    e_global, e_local = 10, 4
    wts = _make_weights(weights_mod, e_local, shared, seed=5)
    # Globals 2, 5, 7, 9 live here as locals 3, 0, 2, 1; everything else is on another rank.
    emap = torch.full((e_global,), -1, dtype=torch.int64)
    emap[torch.tensor([2, 5, 7, 9])] = torch.tensor([3, 0, 2, 1])
    x, ids, w = _inputs(6, 3, e_global, seed=6)
    ids[0] = torch.tensor([0, 1, 3], dtype=torch.int32)  # a token with no local route
    for activation in ACTIVATIONS:
        got = reference_moe(x, ids, w, wts, activation=activation, dtype=torch.float64, expert_map=emap)
        want = naive_moe(x, ids, w, wts, activation=activation, dtype=torch.float64, expert_map=emap)
        _assert_close(got, want)
        assert torch.all(got[0] == 0)
        # Same as routing with local ids and zero weight on the dropped routes.
        local = emap[ids.long()]
        w_local = torch.where(local >= 0, w, torch.zeros_like(w))
        direct = reference_moe(x, local.clamp_min(0), w_local, wts, activation=activation,
                               dtype=torch.float64)
        _assert_close(got, direct)


def test_reference_float32_and_input_dtypes(weights_mod):
    wts = _make_weights(weights_mod, 4, True, seed=7)
    x, ids, w = _inputs(4, 2, 4, seed=8)
    want = reference_moe(x, ids, w, wts, dtype=torch.float64)
    got32 = reference_moe(x.float(), ids.long(), w.double(), wts)
    assert got32.dtype == torch.float32
    assert (got32.double() - want).abs().max() <= 1e-4 * want.abs().max()
    got_bf16 = reference_moe(x.to(torch.bfloat16), ids, w, wts, dtype=torch.float64)
    assert got_bf16.dtype == torch.float64
    _assert_close(got_bf16, reference_moe(x.to(torch.bfloat16).double(), ids, w, wts, dtype=torch.float64))


def test_reference_decodes_only_routed_experts(weights_mod, monkeypatch):
    from kquant_cute import trellis

    wts = _make_weights(weights_mod, 6, False, seed=9)
    x, _, w = _inputs(5, 2, 6, seed=10)
    ids = torch.tensor([[1, 4]] * 5, dtype=torch.int32)
    calls = []
    real = trellis.decode
    monkeypatch.setattr(trellis, "decode", lambda t, cb: calls.append(t.shape) or real(t, cb))
    reference_moe(x, ids, w, wts, dtype=torch.float64)
    assert len(calls) == 2 * 3  # two routed experts x (gate, up, down), each once per call


def test_reference_empty_batch(weights_mod):
    wts = _make_weights(weights_mod, 4, True, seed=11)
    x = torch.zeros(0, HIDDEN, dtype=torch.float64)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    w = torch.zeros(0, 2)
    assert reference_moe(x, ids, w, wts, dtype=torch.float64).shape == (0, HIDDEN)
    assert naive_moe(x, ids, w, wts, dtype=torch.float64).shape == (0, HIDDEN)


def test_reference_bad_inputs(weights_mod):
    wts = _make_weights(weights_mod, 4, False, seed=12)
    x, ids, w = _inputs(3, 2, 4, seed=13)
    emap = torch.tensor([0, -1, 1, 2, 3, -1])
    cases = [
        dict(x=x[:, :128]),                                  # hidden mismatch
        dict(x=x[0]),                                        # 1-D x
        dict(x=x.to(torch.int32)),                           # integer x
        dict(ids=ids.float()),                               # float ids
        dict(ids=ids[:2]),                                   # row mismatch
        dict(ids=ids[:, :1]),                                # weights shape mismatch
        dict(ids=ids.reshape(-1)),                           # 1-D ids
        dict(ids=torch.full_like(ids, 4)),                   # local id out of range
        dict(ids=torch.full_like(ids, -2)),                  # negative id (-1 = no route)
        dict(w=w.to(torch.int64)),                           # integer router weights
        dict(w=w[:, :1]),                                    # weights shape
        dict(kw=dict(dtype=torch.float16)),                  # unsupported compute dtype
        dict(kw=dict(activation="relu")),                    # unknown activation
        dict(kw=dict(expert_map=torch.tensor([0, 1, 2, 4]))),            # map value >= E_local
        dict(kw=dict(expert_map=torch.tensor([0, 1, -2, 3]))),           # map value < -1
        dict(kw=dict(expert_map=emap.float())),                          # float map
        dict(kw=dict(expert_map=emap.reshape(2, 3))),                    # 2-D map
        dict(ids=torch.full_like(ids, 6), kw=dict(expert_map=emap)),     # global id >= E_global
    ]
    for case in cases:
        args = (case.get("x", x), case.get("ids", ids), case.get("w", w), wts)
        for fn in (reference_moe, naive_moe):
            with pytest.raises(ValueError):
                fn(*args, **case.get("kw", {}))


# ---------------------------------------------------------------------------------------
# Route pack
# ---------------------------------------------------------------------------------------


def _brute_force_pack(ids, num_experts, block_m, emap=None):
    """Per-expert route lists by a plain loop: {local expert: [route ids ascending]}."""
    m, topk = ids.shape
    lists = {e: [] for e in range(num_experts)}
    for t in range(m):
        for k in range(topk):
            e = int(ids[t, k])
            if emap is not None:
                e = int(emap[e])
            if e >= 0:
                lists[e].append(t * topk + k)
    return lists


def _check_pack(pack: RoutePack, ids, num_experts, block_m, emap=None):
    m, topk = ids.shape
    n = m * topk
    lists = _brute_force_pack(ids, num_experts, block_m, emap)
    cap = padded_route_slots(n, num_experts, block_m)
    assert pack.sorted_route_ids.dtype == torch.int32 and pack.sorted_route_ids.shape == (cap,)
    assert pack.block_expert.dtype == torch.int32 and pack.block_expert.shape == (cap // block_m,)
    assert pack.expert_offsets.dtype == torch.int32 and pack.expert_offsets.shape == (num_experts + 1,)
    assert pack.expert_counts.dtype == torch.int32 and pack.expert_counts.shape == (num_experts,)
    assert pack.sentinel == n == pack.num_routes and pack.block_m == block_m
    assert pack.num_experts == num_experts

    counts = [len(lists[e]) for e in range(num_experts)]
    assert pack.expert_counts.tolist() == counts
    offsets = pack.expert_offsets.tolist()
    assert offsets[0] == 0
    for e in range(num_experts):
        assert offsets[e + 1] - offsets[e] == -(-counts[e] // block_m) * block_m
    assert pack.num_routes_padded == offsets[-1] <= cap
    assert pack.num_routes_padded % block_m == 0
    assert pack.num_blocks_used == pack.num_routes_padded // block_m

    sorted_ids = pack.sorted_route_ids.tolist()
    blocks = pack.block_expert.tolist()
    for e in range(num_experts):
        lo = offsets[e]
        seg = sorted_ids[lo:offsets[e + 1]]
        assert seg[:counts[e]] == lists[e]            # increasing route id order
        assert all(r == n for r in seg[counts[e]:])   # padding is the sentinel
        # Every block of this expert's range belongs to e.
        assert all(blocks[b] == e for b in range(lo // block_m, offsets[e + 1] // block_m))
    assert all(r == n for r in sorted_ids[pack.num_routes_padded:])
    assert all(b == -1 for b in blocks[pack.num_blocks_used:])
    # Every kept route appears exactly once; dropped routes never.
    real = [r for r in sorted_ids if r != n]
    kept = sorted(r for e in lists for r in lists[e])
    assert sorted(real) == kept and len(set(real)) == len(real)
    # Every block holds routes of one expert only.
    for b in range(pack.num_blocks_used):
        for r in sorted_ids[b * block_m:(b + 1) * block_m]:
            if r != n:
                e = int(ids.reshape(-1)[r])
                assert (int(emap[e]) if emap is not None else e) == blocks[b]


def test_route_pack_small_example():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    pack = route_pack_reference(ids, 4, 4)
    s = 6
    assert pack.expert_counts.tolist() == [2, 0, 3, 1]
    assert pack.expert_offsets.tolist() == [0, 4, 4, 8, 12]
    assert pack.num_routes_padded == 12
    assert pack.sorted_route_ids.tolist()[:12] == [1, 4, s, s, 0, 2, 5, s, 3, s, s, s]
    assert len(pack.sorted_route_ids) == padded_route_slots(6, 4, 4) == 6 + 4 * 3
    assert pack.block_expert.tolist() == [0, 2, 3, -1]
    _check_pack(pack, ids, 4, 4)


@pytest.mark.parametrize("block_m", ROUTE_BLOCK_SIZES)
def test_route_pack_random(block_m):
    gen = torch.Generator().manual_seed(block_m)
    for m, topk, experts in ((1, 1, 1), (5, 2, 6), (37, 4, 16), (64, 8, 128), (200, 16, 896)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)])
        _check_pack(route_pack_reference(ids, experts, block_m), ids, experts, block_m)


@pytest.mark.parametrize("block_m", ROUTE_BLOCK_SIZES)
def test_route_pack_adversarial_routings_fit_padded_slots(block_m):
    # All routes on one expert (duplicates within a token are allowed for the pack).
    ids = torch.full((50, 4), 3, dtype=torch.int64)
    pack = route_pack_reference(ids, 8, block_m)
    _check_pack(pack, ids, 8, block_m)
    assert pack.expert_counts.tolist() == [0, 0, 0, 200, 0, 0, 0, 0]
    # Every expert exactly one route (n == E): worst case n + E*(b-1) = n*b is attained.
    experts = 64
    ids = torch.randperm(experts).reshape(16, 4)
    pack = route_pack_reference(ids, experts, block_m)
    _check_pack(pack, ids, experts, block_m)
    assert pack.num_routes_padded == padded_route_slots(experts, experts, block_m) == experts * block_m
    # Fewer routes than experts, each on its own expert: n*b attained (the n < E cap).
    ids = torch.arange(0, 40, 4).reshape(5, 2)
    pack = route_pack_reference(ids, 896, block_m)
    _check_pack(pack, ids, 896, block_m)
    assert pack.num_routes_padded == padded_route_slots(10, 896, block_m) == 10 * block_m
    # Every expert at 1 (mod b) with n >= E: the n + E*(b-1) bound attained.
    experts = 8
    per_expert = block_m + 1
    ids = torch.arange(experts).repeat_interleave(per_expert).reshape(-1, 1)
    pack = route_pack_reference(ids, experts, block_m)
    _check_pack(pack, ids, experts, block_m)
    n = experts * per_expert
    assert pack.num_routes_padded == padded_route_slots(n, experts, block_m) == n + experts * (block_m - 1)


def test_route_pack_random_skewed_never_exceeds_bound():
    rng = random.Random(7)
    for _ in range(200):
        experts = rng.randint(1, 48)
        block_m = rng.choice(ROUTE_BLOCK_SIZES)
        m, topk = rng.randint(1, 40), rng.randint(1, 6)
        hot = rng.sample(range(experts), rng.randint(1, experts))
        ids = torch.tensor([[rng.choice(hot) for _ in range(topk)] for _ in range(m)])
        pack = route_pack_reference(ids, experts, block_m)
        assert pack.num_routes_padded <= padded_route_slots(m * topk, experts, block_m)
        assert pack.num_blocks_used <= len(pack.block_expert)
    _check_pack(pack, ids, experts, block_m)


def test_route_pack_zero_route_experts_and_empty_batch():
    ids = torch.tensor([[1, 1], [1, 1]], dtype=torch.int32)
    pack = route_pack_reference(ids, 5, 8)
    _check_pack(pack, ids, 5, 8)
    assert pack.expert_offsets.tolist() == [0, 0, 8, 8, 8, 8]
    assert pack.block_expert.tolist()[:1] == [1]
    empty = route_pack_reference(torch.zeros(0, 4, dtype=torch.int64), 5, 16)
    assert empty.num_routes_padded == 0 and empty.sorted_route_ids.numel() == 0
    assert empty.expert_counts.tolist() == [0] * 5 and empty.expert_offsets.tolist() == [0] * 6


def test_route_pack_with_expert_map():
    e_global, e_local = 12, 3
    emap = torch.full((e_global,), -1, dtype=torch.int32)
    emap[torch.tensor([11, 0, 6])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e_global, generator=gen)[:4] for _ in range(30)])
    for block_m in (8, 16):
        pack = route_pack_reference(ids, e_local, block_m, expert_map=emap)
        _check_pack(pack, ids, e_local, block_m, emap)
        dropped = int((emap[ids.long()] < 0).sum())
        assert int(pack.expert_counts.sum()) == ids.numel() - dropped
    # Nothing on this rank: all padding.
    none_here = torch.full((e_global,), -1)
    pack = route_pack_reference(ids, e_local, 8, expert_map=none_here)
    assert pack.num_routes_padded == 0 and torch.all(pack.sorted_route_ids == ids.numel())
    assert torch.all(pack.block_expert == -1)


def test_route_pack_bad_inputs():
    ids = torch.tensor([[0, 1], [2, 3]])
    bad = [
        dict(ids=ids.float()),
        dict(ids=ids.bool()),
        dict(ids=ids.reshape(-1)),
        dict(ids=ids.reshape(1, 2, 2)),
        dict(ids=torch.zeros(2, 0, dtype=torch.int64)),
        dict(ids=[[0, 1]]),
        dict(ids=ids + 4),                 # id >= num_experts
        dict(ids=ids - 2),                 # negative id below -1 (-1 = no route)
        dict(num_experts=0),
        dict(num_experts=4.0),
        dict(block_m=0),
        dict(block_m=True),
        dict(emap=torch.tensor([0, 1, 2])),          # global id 3 out of range of the map
        dict(emap=torch.tensor([0, 1, 2, 4])),       # local id >= num_experts
        dict(emap=torch.tensor([0.0, 1.0, 2.0, 3.0])),
    ]
    for case in bad:
        with pytest.raises(ValueError):
            route_pack_reference(case.get("ids", ids), case.get("num_experts", 4),
                                 case.get("block_m", 8), expert_map=case.get("emap"))


def test_module_exports():
    """`from kquant_cute.reference import *` binds exactly __all__, every function and class
    of it defined here (not re-exported from elsewhere)."""
    scope: dict = {}
    exec("from kquant_cute.reference import *", scope)
    assert set(scope) - {"__builtins__"} == set(ref.__all__)
    for name in ref.__all__:
        obj = scope[name]
        if callable(obj):
            assert obj.__module__ == "kquant_cute.reference", name
        else:
            assert name.isupper(), name  # the module's constants


# ---------------------------------------------------------------------------------------
# Defined input semantics (the kernels are tested against these in tests/test_gpu_inputs.py)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_zero_tokens_give_an_empty_output(weights_mod, shared):
    wts = _make_weights(weights_mod, 3, shared, seed=30)
    x = torch.zeros(0, HIDDEN, dtype=torch.float64)
    ids = torch.zeros(0, 2, dtype=torch.int32)
    w = torch.zeros(0, 2)
    for fn in (reference_moe, naive_moe):
        out = fn(x, ids, w, wts, dtype=torch.float64)
        assert out.shape == (0, HIDDEN) and out.dtype == torch.float64
    assert route_pack_reference(ids, 3, 8).num_routes_padded == 0


@pytest.mark.parametrize("with_map", [False, True])
def test_id_minus_one_is_no_route(weights_mod, with_map):
    """-1 drops the route with and without a map: the result equals the same routing with
    that route's weight set to 0, and the route pack drops it like an off-rank expert."""
    wts = _make_weights(weights_mod, 4, False, seed=31)
    emap = torch.tensor([3, -1, 0, 1, 2, 0]) if with_map else None
    x, ids, w = _inputs(5, 3, 6 if with_map else 4, seed=32)
    dropped = ids.clone()
    dropped[0, 1] = dropped[2, 0] = dropped[4] = -1
    zero_w = w.clone()
    zero_w[0, 1] = zero_w[2, 0] = 0
    zero_w[4] = 0
    got = reference_moe(x, dropped, w, wts, dtype=torch.float64, expert_map=emap)
    _assert_close(got, naive_moe(x, dropped, w, wts, dtype=torch.float64, expert_map=emap))
    _assert_close(got, reference_moe(x, ids, zero_w, wts, dtype=torch.float64, expert_map=emap))
    assert torch.equal(got[4], torch.zeros(HIDDEN, dtype=torch.float64))
    pack = route_pack_reference(dropped, 4, 8, expert_map=emap)
    live = (dropped >= 0) if emap is None else (dropped >= 0) & (emap[dropped.clamp(min=0).long()] >= 0)
    assert int(pack.expert_counts.sum()) == int(live.sum())
    assert 1 not in pack.sorted_route_ids.tolist() and 6 not in pack.sorted_route_ids.tolist()


def test_duplicate_ids_in_a_row_each_count(weights_mod):
    wts = _make_weights(weights_mod, 3, True, seed=33)
    x, _, w = _inputs(4, 3, 3, seed=34)
    ids = torch.tensor([[1, 1, 2], [0, 0, 0], [2, 1, 2], [1, 2, 0]], dtype=torch.int32)
    got = reference_moe(x, ids, w, wts, dtype=torch.float64)
    _assert_close(got, naive_moe(x, ids, w, wts, dtype=torch.float64))
    # Token 1 routes three times to expert 0: once with the summed weight.
    once = reference_moe(x[1:2], ids[1:2, :1], w[1:2].double().sum(1, keepdim=True), wts,
                         dtype=torch.float64)
    _assert_close(got[1:2], once)


def test_several_global_ids_on_one_local_expert(weights_mod):
    wts = _make_weights(weights_mod, 2, False, seed=35)
    emap = torch.tensor([1, 1, -1, 0, 1, 0])
    x, ids, w = _inputs(6, 3, 6, seed=36)
    got = reference_moe(x, ids, w, wts, dtype=torch.float64, expert_map=emap)
    _assert_close(got, naive_moe(x, ids, w, wts, dtype=torch.float64, expert_map=emap))
    local = reference_moe(x, torch.where(emap[ids.long()] >= 0, emap[ids.long()], -1).to(torch.int32),
                          w, wts, dtype=torch.float64)
    _assert_close(got, local)


def test_every_route_on_one_expert_fits_the_padded_bound():
    for block_m in ROUTE_BLOCK_SIZES:
        ids = torch.full((37, 4), 2, dtype=torch.int32)
        pack = route_pack_reference(ids, 5, block_m)
        assert int(pack.expert_counts[2]) == 148
        assert pack.num_routes_padded == -(-148 // block_m) * block_m
        assert pack.sorted_route_ids.numel() == padded_route_slots(148, 5, block_m)


@pytest.mark.parametrize("shared", [False, True])
def test_nan_and_inf_reach_only_their_tokens(weights_mod, shared):
    wts = _make_weights(weights_mod, 4, shared, seed=37)
    x, ids, w = _inputs(6, 2, 4, seed=38)
    clean = reference_moe(x, ids, w, wts, dtype=torch.float64)
    bad = x.clone()
    bad[1, 5] = float("nan")
    bad[4, 0] = float("inf")
    bad[5, 200] = float("-inf")
    got = reference_moe(bad, ids, w, wts, dtype=torch.float64)
    hit = torch.tensor([False, True, False, False, True, True])
    assert torch.equal(got[~hit], clean[~hit])  # bit for bit: rows do not mix
    assert not torch.isfinite(got[hit]).any()

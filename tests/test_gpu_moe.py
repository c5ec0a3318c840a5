"""GPU tests of the fused trellis MoE forward (marker `gpu`; skipped without a CUDA GPU).

Checks against the torch reference in fp64 on fresh random weights/inputs with NaN-poisoned
outputs, bit-exact decode through the real GEMM, bitwise equality across route block
sizes, edge-case routings, expert maps, bad inputs (raise before launch, output
untouched) and CUDA-graph capture / replay of the decode plan.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import check_graph_replay

pytestmark = pytest.mark.gpu

E_SMALL, H_SMALL, I_SMALL, TOPK_SMALL = 12, 256, 256, 4


def _layer(weights, *, topk, capacity, act_dtype=torch.bfloat16, activation="silu", pin=None,
           num_global_experts=None, **knobs):
    from kquant_cute.layer import MoELayer

    env = {}
    if pin is not None:
        env = {"KQUANT_W4A16_PREFILL_BLOCK_M": str(pin), "KQUANT_W4A16_PREFILL_MIN_M": "8"}
    return MoELayer(weights, topk=topk, capacity=capacity, act_dtype=act_dtype,
                    activation=activation, num_global_experts=num_global_experts, environ=env,
                    **knobs)


def _inputs(m, hidden, topk, num_experts, dtype, seed, *, ids=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, hidden, generator=g, device="cuda").to(dtype)
    if ids is None:
        scores = torch.rand(m, num_experts, generator=g, device="cuda")
        ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    w = torch.rand(m, topk, generator=g, device="cuda")
    w = (w / w.sum(1, keepdim=True)).float()
    return x, ids.contiguous(), w


def _run(layer, x, ids, w, **kw):
    layer.output.fill_(float("nan"))
    out = layer(x, ids, w, **kw)
    torch.cuda.synchronize()
    return out


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _needs_sm90(mma):
    if mma.startswith("wgmma") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 GPU")


def _table(codebook, bits):
    """The state table the kernels read (sqg_e4m3), else a placeholder they never read."""
    from kquant_cute import trellis

    if codebook == "sqg_e4m3":
        return trellis.sqg_state_table(bits, "cuda")
    return torch.zeros(16, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
@pytest.mark.parametrize("codebook", ["mcg", "3inst", "mul1", "sqg_e4m3"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_decode_bit_exact_through_gemm(codebook, bits, mma):
    """Identity activations make the GEMM output the decoded weights exactly (sqg_e4m3:
    the persistent grid with fewer CTAs than work items, so CTAs loop)."""
    _needs_sm90(mma)
    if codebook == "sqg_e4m3" and bits > 4:
        pytest.skip("sqg_e4m3 is defined for K = 2..4")
    _gemm_decodes_exactly(codebook, bits, mma, 128, 256, _table(codebook, bits))


def test_pair_table_decode_bit_exact_through_gemm():
    """The sm_90a K=2 pair-table decode (two workers sharing the 128 KiB table, each
    looping over every second work item) gives the codec's value of every weight of
    512 x 1,024 random states (524,288 weights: all but a few dozen of the 65,536 states;
    tests/test_pair_table.py proves the arithmetic for every window on the CPU), the pairs
    it computes instead of reading (1 in 8, `decode.PAIR_ARITH_PERIOD`) included."""
    _needs_sm90("wgmma")
    from kquant_cute import trellis

    _gemm_decodes_exactly("sqg_e4m3", 2, "wgmma", 512, 1024, trellis.sqg_pair_table(2, "cuda"),
                          pair_table=True, workers=2)


@pytest.mark.gpu
def test_arithmetic_t12_instructions_give_every_byte():
    """`ptx.e4m3_poly_pair` (the computed T12 the pair-table decode uses for 1 of 8 pairs)
    on this GPU: all 4,096 indices, in both halves of the half2, give T12's value bit for
    bit, +0 where T12 holds 0x00 (tests/test_sqg_t12.py proves the fp32 model)."""
    from cutlass.cute.runtime import from_dlpack
    from poly_kernel import poly_pairs

    from kquant_cute import trellis

    qa = torch.arange(4096, dtype=torch.int32, device="cuda")
    qb = qa.flip(0).contiguous()
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    poly_pairs(from_dlpack(qa), from_dlpack(qb), from_dlpack(out))
    torch.cuda.synchronize()
    halves = out.cpu().view(torch.int16).view(4096, 2)
    want = trellis.t12_table().view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
    assert torch.equal(halves[:, 0], want), torch.nonzero(halves[:, 0] != want)[:8].tolist()
    assert torch.equal(halves[:, 1], want.flip(0)), torch.nonzero(halves[:, 1] != want.flip(0))[:8].tolist()


def _gemm_decodes_exactly(codebook, bits, mma, k_dim, n_dim, table, **gemm_args):
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    from kquant_cute import trellis
    from kquant_cute.kernels.gemms import GEMMS

    block_m = 16
    g = torch.Generator().manual_seed(bits * 7 + len(codebook))
    # Two operands in one launch (FC1's gate and up): each decoded exactly into its output.
    codes = [trellis.random_trellis(k_dim, n_dim, bits, generator=g).cuda() for _ in range(2)]
    a = torch.zeros(k_dim + 1, k_dim, dtype=torch.float16, device="cuda")
    a[:k_dim] = torch.eye(k_dim, dtype=torch.float16, device="cuda")
    routes = torch.arange(k_dim, dtype=torch.int32, device="cuda")
    blocks = torch.zeros(k_dim // block_m, dtype=torch.int32, device="cuda")
    num = torch.tensor([k_dim], dtype=torch.int32, device="cuda")
    out = [torch.full((k_dim, n_dim), float("nan"), device="cuda") for _ in range(2)]
    Gemm = GEMMS[mma]
    gemm = Gemm(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                topk=1, a_rows_per_token=False, stages=4, **gemm_args)

    def P(t, dt):
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    # Per-expert padded offsets and counts (every GEMM takes them; spans read them).
    offsets = torch.tensor([0, k_dim], dtype=torch.int32, device="cuda")
    groups = [P(blocks, cutlass.Int32), P(num, cutlass.Int32), P(offsets, cutlass.Int32),
              P(num, cutlass.Int32)]
    # sm_count 1: a table codebook's grid is 1 x ctas_per_sm (1) CTA for the work items.
    args = [P(a, cutlass.Float16), P(codes[0], cutlass.Int16), P(routes, cutlass.Int32),
            *groups, P(out[0], cutlass.Float32),
            P(a, cutlass.Float16), P(codes[1], cutlass.Int16), P(out[1], cutlass.Float32),
            cutlass.Int32(2),
            cutlass.Int32(k_dim), cutlass.Int32(k_dim), cutlass.Int32(k_dim // block_m),
            P(table, cutlass.Uint8), cutlass.Int32(1),
            P(num, cutlass.Uint8), P(num, cutlass.Int32), cutlass.Int32(0),  # no rate maps
            cuda.CUstream(torch.cuda.current_stream().cuda_stream)]
    fn = cute.compile(gemm, *args)
    fn(*args)
    torch.cuda.synchronize()
    for op in range(2):
        ref = trellis.decode(codes[op].cpu(), codebook)
        assert torch.equal(out[op].cpu(), ref), (op, (out[op].cpu() - ref).abs().max())


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_matches_reference_small(shared, act_dtype, activation):
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", shared_hidden_vectors=shared,
                            seed=3, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=160, act_dtype=act_dtype, activation=activation)
    tol = 1e-2 if act_dtype == torch.bfloat16 else 2e-3
    for m in (1, 7, 16, 128, 160):
        x, ids, w = _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, act_dtype, seed=m)
        out = _run(layer, x, ids, w)
        assert not torch.isnan(out).any(), f"m={m}: unwritten output elements"
        ref = reference_moe(x, ids, w, wts, activation=activation, dtype=torch.float64)
        err = _rel_err(out, ref)
        assert err < tol, f"m={m}: rel err {err:.3e} >= {tol}"


@pytest.mark.parametrize("codebook,bits", [("3inst", 2), ("mul1", 3), ("mcg", 5), ("mcg", 6)])
def test_codebooks_and_bits(codebook, bits):
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, bits, codebook, seed=bits, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=64)
    x, ids, w = _inputs(64, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=11)
    out = _run(layer, x, ids, w)
    ref = reference_moe(x, ids, w, wts, dtype=torch.float64)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("mma", ["auto", "sync", "wgmma", "wgmma-span"])
def test_edge_routings_and_bitwise_equal_across_block_sizes(mma):
    """Zero-route experts, all routes on one expert, counts not multiple of M; every M
    gives the bitwise-identical output of M = 8. auto: the plans' default (wgmma with spans
    of 2 blocks at M=32 on sm_90); wgmma: no spans; wgmma-span: every M with the widest
    span (up to 128 rows per work item), against plain wgmma at M = 8."""
    _needs_sm90(mma)
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", shared_hidden_vectors=True,
                            seed=5, device="cuda")
    m = 93
    cases = {
        "random": None,
        "one_expert": torch.full((m, TOPK_SMALL), 3, dtype=torch.int32, device="cuda"),
        "two_experts": (torch.arange(m * TOPK_SMALL, device="cuda") % 2 * 7).view(m, TOPK_SMALL).to(torch.int32),
    }
    if mma == "wgmma-span":
        layers = {(8, 1): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=8, mma="wgmma")}
        layers.update({(M, min(4, 128 // M)): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=M,
                                                     mma="wgmma", span=min(4, 128 // M))
                       for M in (8, 16, 32, 48, 64)})
    elif mma == "auto":
        layers = {(M, 0): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=M)
                  for M in (8, 16, 32, 48, 64)}
    else:
        layers = {(M, 1): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=M, mma=mma, span=1)
                  for M in (8, 16, 32, 48, 64)}
    for name, ids in cases.items():
        x, ids, w = _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=17, ids=ids)
        ref = reference_moe(x, ids, w, wts, dtype=torch.float64)
        base = None
        for (M, span), layer in layers.items():
            bound = layer.bind(x, ids, w)
            assert bound.block_m == M
            layer.output.fill_(float("nan"))
            out = bound.run().clone()
            torch.cuda.synchronize()
            assert _rel_err(out, ref) < 1e-2, f"{name} M={M} span={span}"
            if base is None:
                base = out
            else:
                assert torch.equal(out, base), f"{name}: M={M} span={span} differs from M=8"


def test_expert_map_skips_remote_experts():
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", seed=9, device="cuda")
    n_global = 2 * E_SMALL
    emap = torch.full((n_global,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(E_SMALL, dtype=torch.int32, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=50, num_global_experts=n_global)
    x, ids, w = _inputs(50, H_SMALL, TOPK_SMALL, n_global, torch.bfloat16, seed=23)
    out = _run(layer, x, ids, w, expert_map=emap)
    ref = reference_moe(x, ids, w, wts, dtype=torch.float64, expert_map=emap)
    assert not torch.isnan(out).any()
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("routing", ["random", "skewed", "mapped"])
def test_route_pack_across_ctas_matches_reference(routing):
    """The pack's buffers after a forward whose routes span several pack CTAs (2,048 routes
    each; 300 tokens x top-16 = 4,800 routes: three, the last one partial): per-expert
    counts, offsets, block list and packed count equal the reference's, and each expert's
    slots hold its routes (any order within an expert) then sentinels."""
    from kquant_cute.kernels.launch import pack_ctas
    from kquant_cute.reference import route_pack_reference
    from kquant_cute.weights import MoEWeights

    m, topk, experts = 300, 16, 40
    assert pack_ctas(m * topk) == 3
    wts = MoEWeights.random(experts, 256, 128, 4, "mcg", seed=3, device="cuda")
    emap, n_ids = None, experts
    g = torch.Generator(device="cuda").manual_seed(41)
    if routing == "mapped":  # half the global experts live elsewhere
        n_ids = 2 * experts
        emap = torch.full((n_ids,), -1, dtype=torch.int32, device="cuda")
        emap[::2] = torch.randperm(experts, generator=g, device="cuda").to(torch.int32)
    ids = None
    if routing == "skewed":  # most routes on 3 experts, some -1 (no route)
        ids = torch.randint(0, 3, (m, topk), generator=g, device="cuda").to(torch.int32)
        ids[:, -2:] = torch.randint(0, experts, (m, 2), generator=g, device="cuda").to(torch.int32)
        ids[::7, 0] = -1
    layer = _layer(wts, topk=topk, capacity=m, pin=16,
                   num_global_experts=None if emap is None else n_ids)
    x, ids, w = _inputs(m, 256, topk, n_ids, torch.bfloat16, seed=43, ids=ids)
    _run(layer, x, ids, w, expert_map=emap)
    ref = route_pack_reference(ids, experts, 16, expert_map=emap)
    got = layer._views
    total = ref.num_routes_padded
    assert int(got["num_padded"][0]) == total
    assert torch.equal(got["expert_counts"], ref.expert_counts)
    assert torch.equal(got["expert_offsets"], ref.expert_offsets)
    blocks = ref.block_expert.numel()
    assert torch.equal(got["block_expert"][:blocks], ref.block_expert)
    sorted_got = got["sorted_routes"][:total].cpu()
    offsets, counts = ref.expert_offsets.tolist(), ref.expert_counts.tolist()
    want = ref.sorted_route_ids[:total].cpu()
    for e in range(experts):
        lo, n = offsets[e], counts[e]
        assert sorted(sorted_got[lo:lo + n].tolist()) == want[lo:lo + n].tolist(), e
        assert (sorted_got[lo + n:offsets[e + 1]] == m * topk).all(), e


def test_bad_inputs_raise_before_launch():
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", seed=1, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=32)
    x, ids, w = _inputs(16, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=2)
    layer.output.fill_(float("nan"))
    bad = {
        "dtype": (x.half(), ids, w),
        "device": (x.cpu(), ids, w),
        "shape": (x[:, :128].contiguous(), ids, w),
        "noncontig": (x.t().contiguous().t(), ids, w),
        "ids_dtype": (x, ids.long(), w),
        "ids_range": (x, ids + E_SMALL, w),
        "ids_negative": (x, ids - 100, w),
        "weights_shape": (x, ids, w[:, :2].contiguous()),
        "too_many_tokens": (torch.cat([x] * 3), torch.cat([ids] * 3), torch.cat([w] * 3)),
    }
    for name, args in bad.items():
        with pytest.raises((ValueError, TypeError)):
            layer(*args)
        torch.cuda.synchronize()
        assert torch.isnan(layer.output).all(), f"{name}: output was written"


def test_cuda_graph_decode_replay_bitwise_equal_to_eager():
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", shared_hidden_vectors=True,
                            seed=4, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=512)
    for m in (1, 2, 4, 8):
        graph, eager, bound_inputs = check_graph_replay(
            layer, _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=100 + m),
            [_inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=200 + 10 * m + trial)
             for trial in range(3)], f"m={m}")
        # Switching to the prefill plan on the same scratch, then back, stays correct.
        xl, idsl, wl = _inputs(300, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=7)
        _run(layer, xl, idsl, wl)
        layer.output.fill_(float("nan"))
        graph.replay()  # reads bound_inputs, kept alive until here
        torch.cuda.synchronize()
        assert torch.equal(layer.output[:m], eager)
        del bound_inputs


@pytest.mark.parametrize("mma", ["auto", "sync", "wgmma", "wgmma-span"])
def test_reference_geometry_1536_tokens(mma):
    """Kimi-K3 TP8 shard: E=896, H=3584, I=384, top-16, K=4, mcg, bf16, SiTU, shared vectors."""
    _needs_sm90(mma)
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(896, 3584, 384, 4, "mcg", shared_hidden_vectors=True, seed=0,
                            device="cuda")
    knobs = {"auto": {}, "sync": {"mma": "sync"}, "wgmma": {"mma": "wgmma", "span": 1},
             "wgmma-span": {"mma": "wgmma", "span": 2}}[mma]
    layer = _layer(wts, topk=16, capacity=1536, activation="situ", **knobs)
    x, ids, w = _inputs(1536, 3584, 16, 896, torch.bfloat16, seed=1)
    out = _run(layer, x, ids, w)
    assert not torch.isnan(out).any()
    ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
    assert _rel_err(out, ref) < 1e-2


def test_cpu_prewarmed_cache_frozen_matches_jit(tmp_path):
    """Objects compiled by `kquant-compile` (default geometry) in a process that sees no GPU
    load frozen here with zero compiles and give bitwise the outputs of a JIT compile.
    KQUANT_PREWARMED_CACHE_DIR may name a cache filled on another (CPU-only) machine;
    otherwise this test fills one itself, in a subprocess with CUDA_VISIBLE_DEVICES=""."""
    import os
    import subprocess
    import sys

    from kquant_cute.compile_cache import CompileCache
    from kquant_cute.layer import MoELayer
    from kquant_cute.prewarm import DEFAULT_CAPACITY, DEFAULT_GEOMETRY
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    prewarmed = os.environ.get("KQUANT_PREWARMED_CACHE_DIR")
    if not prewarmed:
        prewarmed = str(tmp_path / "cpu_prewarmed")
        sm = "%d%d" % torch.cuda.get_device_capability()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        env.pop("KQUANT_COMPILE_CACHE_DIR", None)
        subprocess.run([sys.executable, "-m", "kquant_cute.cli", "--sm", sm, "--cache-dir",
                        prewarmed, "-q"], env=env, check=True, timeout=900)
    g = DEFAULT_GEOMETRY
    wts = MoEWeights.random(g.num_experts, g.hidden, g.intermediate, g.bits, g.codebook,
                            shared_hidden_vectors=g.shared_hidden_vectors, seed=12, device="cuda")
    frozen = CompileCache(prewarmed, frozen=True)
    jit = CompileCache(disk=False)
    kw = dict(topk=g.topk, capacity=DEFAULT_CAPACITY, activation=g.activation, environ={})
    layer_aot = MoELayer(wts, cache=frozen, **kw)
    assert frozen.cache_info().compiles == 0 and frozen.cache_info().disk_loads >= 1
    layer_jit = MoELayer(wts, cache=jit, **kw)
    assert jit.cache_info().compiles >= 1
    for m in (16, 1536):
        x, ids, w = _inputs(m, g.hidden, g.topk, g.num_experts, torch.bfloat16, seed=m)
        out_aot = _run(layer_aot, x, ids, w).clone()
        out_jit = _run(layer_jit, x, ids, w).clone()
        assert torch.equal(out_aot, out_jit), f"m={m}: AOT and JIT outputs differ"
        ref = reference_moe(x, ids, w, wts, activation=g.activation, dtype=torch.float64)
        assert _rel_err(out_aot, ref) < 1e-2


def test_banded_plan_is_bitwise_equal_to_the_pair():
    """Above the threshold the banded plan binds the policy's M at each call's own m (the
    pair binds the capacity's M=64), from 512 tokens (64 routed rows per expert) the wide
    rule's work items of two blocks (600 tokens: M=48 x 2; 700, 1,024: M=64 x 2), and its
    outputs equal the pair's bit for bit."""
    from kquant_cute.layer import MoELayer
    from kquant_cute.planners import select_route_block_size_m, wide_block, wide_from_m
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(64, H_SMALL, I_SMALL, 4, "mcg", shared_hidden_vectors=True, seed=8,
                            device="cuda")
    pair = MoELayer(wts, topk=8, capacity=1024, environ={}, banded=False)
    banded = MoELayer(wts, topk=8, capacity=1024, environ={})  # the default
    assert wide_from_m(8, 64) == 512
    picked = {}
    for m in (300, 511, 600, 700, 1024):
        x, ids, w = _inputs(m, H_SMALL, 8, 64, torch.bfloat16, seed=m)
        b1, b2 = pair.bind(x, ids, w), banded.bind(x, ids, w)
        assert b1.block_m == 64 and b1.plan.spec.span == 1
        wide = m >= 512
        want = wide_block(m, 8, 64) if wide else select_route_block_size_m(m, 8, 64)
        assert b2.block_m == want and (b2.plan.spec.span == 2) == wide, m
        picked[m] = (b2.block_m, b2.plan.spec.span)
        out1 = _run(pair, x, ids, w).clone()
        out2 = _run(banded, x, ids, w).clone()
        assert torch.equal(out1, out2), f"m={m}: banded {picked[m]} vs pair M={b1.block_m}"
    assert picked[300][0] < 64 and picked[600] == (48, 2)  # banding and the wide rule bound


@pytest.mark.parametrize("act_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float16)])
def test_output_in_activation_dtype(act_dtype, out_dtype):
    """The engine may ask for the output in the activation dtype instead of fp32."""
    from kquant_cute.layer import MoELayer
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, 4, "mcg", seed=21, device="cuda")
    layer = MoELayer(wts, topk=TOPK_SMALL, capacity=64, act_dtype=act_dtype,
                     out_dtype=out_dtype, environ={})
    x, ids, w = _inputs(64, H_SMALL, TOPK_SMALL, E_SMALL, act_dtype, seed=5)
    layer.output.fill_(float("nan"))
    out = layer(x, ids, w)
    torch.cuda.synchronize()
    assert out.dtype == out_dtype and not torch.isnan(out).any()
    ref = reference_moe(x, ids, w, wts, dtype=torch.float64)
    assert _rel_err(out, ref) < (1e-2 if act_dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sqg_e4m3_layer(bits, mma):
    """QSRT sqg_e4m3 weights through the fused forward (persistent table GEMMs): the fp64
    reference on fresh random weights / inputs with NaN-poisoned outputs at several m,
    bitwise-equal outputs for every route block M (edge routings included; wgmma also with
    work items of two blocks at M=48 and 64), and CUDA-graph
    replay of the decode plan bitwise equal to eager."""
    _needs_sm90(mma)
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(E_SMALL, H_SMALL, I_SMALL, bits, "sqg_e4m3",
                            shared_hidden_vectors=True, seed=40 + bits, device="cuda")
    layer = _layer(wts, topk=TOPK_SMALL, capacity=160, activation="situ", mma=mma)
    for m in (1, 7, 16, 160):
        x, ids, w = _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=300 + m)
        out = _run(layer, x, ids, w)
        assert not torch.isnan(out).any(), f"m={m}: unwritten output elements"
        ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
        err = _rel_err(out, ref)
        assert err < 1e-2, f"K={bits} {mma} m={m}: rel err {err:.3e}"
    m = 93
    layers = {(M, 0): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=M, activation="situ", mma=mma)
              for M in (8, 16, 32, 48, 64)}
    if mma == "wgmma":  # wide items: 96 rows (K=2: three one-warpgroup workers) and 128 rows
        layers.update({(M, 2): _layer(wts, topk=TOPK_SMALL, capacity=m, pin=M, span=2,
                                      activation="situ", mma=mma) for M in (48, 64)})
    if (bits, mma) == (2, "wgmma"):
        assert layers[48, 2].plan.plan_for(m).spec.gemm_workers() == 3
    # skewed: 1 / 2 / 3 / 0 / 4 / 1 / 1 blocks of 48 rows per expert, so groups of two
    # blocks hold one leader, or two where an expert has an odd count.
    counts = torch.tensor([1, 49, 97, 0, 145, 48, 32] + [0] * (E_SMALL - 7))
    skewed = torch.repeat_interleave(torch.arange(E_SMALL), counts)
    skewed = skewed[torch.randperm(skewed.numel(), generator=torch.Generator().manual_seed(5))]
    for name, ids in {"random": None,
                      "one_expert": torch.full((m, TOPK_SMALL), 3, dtype=torch.int32,
                                               device="cuda"),
                      "skewed": skewed.view(m, TOPK_SMALL).to(torch.int32).cuda()}.items():
        x, ids, w = _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=17, ids=ids)
        ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
        base = None
        for (M, span), lay in layers.items():
            bound = lay.bind(x, ids, w)
            assert bound.block_m == M and (span == 0 or bound.plan.spec.span == span)
            lay.output.fill_(float("nan"))
            out = bound.run().clone()
            torch.cuda.synchronize()
            assert _rel_err(out, ref) < 1e-2, f"{name} M={M} span={span}"
            base = out if base is None else base
            assert torch.equal(out, base), f"{name}: M={M} span={span} differs from M=8"
    for m in (1, 8):
        check_graph_replay(
            layer, _inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=500 + m),
            [_inputs(m, H_SMALL, TOPK_SMALL, E_SMALL, torch.bfloat16, seed=600 + m)], f"m={m}")


def test_sqg_e4m3_reference_geometry_1536_tokens():
    """The production QSRT rate (uniform K=2 sqg_e4m3) at the reference geometry, 1,536 tokens,
    plan's M (the uncoupled layer: transforms are the QSRT loader's)."""
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(896, 3584, 384, 2, "sqg_e4m3", shared_hidden_vectors=True, seed=0,
                            device="cuda")
    layer = _layer(wts, topk=16, capacity=1536, activation="situ")
    x, ids, w = _inputs(1536, 3584, 16, 896, torch.bfloat16, seed=1)
    out = _run(layer, x, ids, w)
    assert not torch.isnan(out).any()
    ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
    assert _rel_err(out, ref) < 1e-2

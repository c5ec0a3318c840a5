"""GPU tests of mixed-rate layers (QSRT k3x22_k4x2: per-record K) in the fused forward
(marker `gpu`; skipped without a CUDA GPU).

The mixed GEMMs against the reference codec bit-exactly (identity activations, K changing
along either rate axis, three resident tables), mixed layers against the fp64 reference MoE
on fresh random weights / inputs with NaN-poisoned outputs, bitwise equality across route
block sizes M, an expert with every record at K=4 next to one with every record at K=2,
layers as the QSRT loader builds them (uncoupled TP4 and coupled TP12 ranks), a one-K
mixed container on the uniform kernels, and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import check_graph_replay
from test_gpu_moe import _inputs, _layer, _needs_sm90, _rel_err, _run

pytestmark = pytest.mark.gpu

E, H, I, TOPK = 12, 256, 256, 4


def _rate_maps(e, i, rates, seed, *, fc2_run=4):
    """uint8 fc1 / fc2 maps [e, i/16]: a random K of `rates` per 128-channel FC1 run and per
    `fc2_run` x 16-channel FC2 run (the kernel's granularities), every rate present."""
    g = torch.Generator().manual_seed(seed)
    r = torch.tensor(rates, dtype=torch.uint8)
    fc1 = r[torch.randint(len(rates), (e, i // 128), generator=g)]
    fc2 = r[torch.randint(len(rates), (e, i // (16 * fc2_run)), generator=g)]
    fc1.view(-1)[: len(rates)] = r
    fc2.view(-1)[: len(rates)] = r
    return fc1.repeat_interleave(8, dim=1), fc2.repeat_interleave(fc2_run, dim=1)


def _mixed(rates, seed, *, e=E, h=H, i=I, coupled=False, maps=None):
    from kquant_cute.mixed import MixedMoEWeights

    fc1, fc2 = maps if maps is not None else _rate_maps(e, i, rates, seed)
    w = MixedMoEWeights.random(fc1, fc2, h, coupled=coupled, seed=seed)
    assert w.rate_set == tuple(rates)
    return w.to("cuda")


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
@pytest.mark.parametrize("axis", ["n", "k"])
def test_mixed_decode_bit_exact_through_gemm(axis, mma):
    """Identity activations make the GEMM output the decoded weights exactly: gate (K per
    128-column N tile) or down (K per 64-row stage) of two experts with different maps over
    K = 2, 3, 4 (three resident state tables), one persistent CTA looping over every work
    item."""
    _needs_sm90(mma)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from kquant_cute import trellis
    from kquant_cute.kernels.gemms import GEMMS
    from kquant_cute.mixed import MixedMoEWeights

    rates, block_m, e, dim = (2, 3, 4), 16, 2, 256
    runs = torch.tensor([[2, 4, 3, 3], [4, 3, 2, 4]], dtype=torch.uint8)  # [expert, 64 channels]
    fc = runs.repeat_interleave(4, dim=1)
    fc1 = fc[:, ::8].repeat_interleave(8, dim=1)  # FC1: one K per 128 channels
    cpu = MixedMoEWeights.random(fc1, fc, dim, seed=5 + len(axis))
    w = cpu.to("cuda")
    maps, row_words = w.rate_args()
    proj, codes = ("gate", w.gate_trellis) if axis == "n" else ("down", w.down_trellis)
    bits, words = (maps["fc1_bits"], maps["fc1_words"]) if axis == "n" else \
        (maps["fc2_bits"], maps["fc2_words"])
    rows = e * dim
    a = torch.zeros(rows + 1, dim, dtype=torch.float16, device="cuda")
    a[:rows] = torch.eye(dim, dtype=torch.float16, device="cuda").repeat(e, 1)
    routes = torch.arange(rows, dtype=torch.int32, device="cuda")
    blocks = torch.arange(e, dtype=torch.int32, device="cuda").repeat_interleave(dim // block_m)
    num = torch.tensor([rows], dtype=torch.int32, device="cuda")
    out = torch.full((rows, dim), float("nan"), device="cuda")
    Gemm = GEMMS[mma]
    gemm = Gemm(block_m=block_m, k_dim=dim, n_dim=dim, bits=4, codebook="sqg_e4m3", topk=1,
                a_rows_per_token=False, stages=4, bits_set=rates, rate_axis=axis)
    table = torch.cat([trellis.sqg_state_table(k, "cuda") for k in rates])

    def P(t, dt):
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    offsets = torch.tensor([0, dim, rows], dtype=torch.int32, device="cuda")
    counts = torch.full((e,), dim, dtype=torch.int32, device="cuda")
    groups = [P(blocks, cutlass.Int32), P(num, cutlass.Int32), P(offsets, cutlass.Int32),
              P(counts, cutlass.Int32)]
    pa, pb, pout = P(a, cutlass.Float16), P(codes, cutlass.Int16), P(out, cutlass.Float32)
    args = [pa, pb, P(routes, cutlass.Int32), *groups, pout, pa, pb, pout, cutlass.Int32(1),
            cutlass.Int32(rows), cutlass.Int32(rows),
            cutlass.Int32(rows // block_m), P(table, cutlass.Uint8), cutlass.Int32(1),
            P(bits, cutlass.Uint8), P(words, cutlass.Int32), cutlass.Int32(row_words),
            cuda.CUstream(torch.cuda.current_stream().cuda_stream)]
    fn = cute.compile(gemm, *args)
    fn(*args)
    torch.cuda.synchronize()
    ref = torch.cat([cpu.w_hat(proj, x) for x in range(e)])
    assert torch.equal(out.cpu(), ref), (out.cpu() - ref).abs().max()


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
def test_t12_decode_every_state_through_gemm(mma):
    """The T12 path (`table_decode="t12"`, forced on this GPU: T12 in shared memory, the
    state bijection of kernels/sqg_t12.py on the ALU) against the reference codec on all
    65,536 states of each K: one expert's gate at K = 2, 3, 4 (8 N tiles each, about a
    million weights per K, every state present: asserted), identity activations, the
    GEMM output equal to the decoded weights bit for bit. The table argument is the
    layer's (direct tables, then T12), so the T12 offset is exercised too."""
    _needs_sm90(mma)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from kquant_cute import trellis
    from kquant_cute.kernels.gemms import GEMMS
    from kquant_cute.mixed import MixedMoEWeights

    rates, block_m, h = (2, 3, 4), 16, 1024
    fc1 = torch.tensor(rates, dtype=torch.uint8).repeat_interleave(8 * 8).view(1, -1)
    i = fc1.shape[1] * 16  # 3,072 channels: 8 N tiles of 128 per K
    cpu = MixedMoEWeights.random(fc1, fc1[:, : i // 16], h, seed=29)
    off = cpu.fc1_offsets()[0].tolist()
    seen = {k: torch.zeros(1 << 16, dtype=torch.bool) for k in rates}
    for j, k in enumerate(fc1[0].tolist()):
        seen[k][trellis.tile_states(cpu.gate_trellis[0, :, off[j]: off[j] + 16 * k])
                .reshape(-1)] = True
    assert all(bool(v.all()) for v in seen.values()), "the seed leaves a state out"
    w = cpu.to("cuda")
    maps, row_words = w.rate_args()
    a = torch.zeros(h + 1, h, dtype=torch.float16, device="cuda")
    a[:h] = torch.eye(h, dtype=torch.float16, device="cuda")
    routes = torch.arange(h, dtype=torch.int32, device="cuda")
    blocks = torch.zeros(h // block_m, dtype=torch.int32, device="cuda")
    num = torch.tensor([h], dtype=torch.int32, device="cuda")
    out = torch.full((h, i), float("nan"), device="cuda")
    Gemm = GEMMS[mma]
    gemm = Gemm(block_m=block_m, k_dim=h, n_dim=i, bits=4, codebook="sqg_e4m3", topk=1,
                a_rows_per_token=False, stages=4, bits_set=rates, rate_axis="n",
                table_decode="t12", ctas_per_sm=2)
    assert gemm.smem_bytes < 101_376  # what sm_120 offers per block
    table = trellis.sqg_kernel_tables(rates, "cuda")

    def P(t, dt):
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    # Per-expert padded offsets and counts: every GEMM of the registry takes them.
    offsets = torch.tensor([0, h], dtype=torch.int32, device="cuda")
    groups = [P(blocks, cutlass.Int32), P(num, cutlass.Int32), P(offsets, cutlass.Int32),
              P(num, cutlass.Int32)]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    pa, pb, pout = (P(a, cutlass.Float16), P(w.gate_trellis, cutlass.Int16),
                    P(out, cutlass.Float32))
    args = [pa, pb, P(routes, cutlass.Int32), *groups, pout, pa, pb, pout, cutlass.Int32(1),
            cutlass.Int32(h), cutlass.Int32(h),
            cutlass.Int32(h // block_m), P(table, cutlass.Uint8), cutlass.Int32(sm_count),
            P(maps["fc1_bits"], cutlass.Uint8), P(maps["fc1_words"], cutlass.Int32),
            cutlass.Int32(row_words), cuda.CUstream(torch.cuda.current_stream().cuda_stream)]
    fn = cute.compile(gemm, *args)
    fn(*args)
    torch.cuda.synchronize()
    ref = cpu.w_hat("gate", 0)
    bad = (out.cpu() != ref).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} weights differ, first (row, col) {bad[:4].tolist()}"


def _check_layer(wts, *, mma=None, ms=(1, 7, 16, 160), blocks=(8, 16, 32, 48, 64), graphs=True,
                 act="situ", table_decode=None, wide=()):
    """fp64 reference at several m (NaN-poisoned outputs), bitwise equality across M (and
    the `wide` (M, span) work items) on random and skewed routings, and graph replay of the
    decode plan equal to eager."""
    from kquant_cute.reference import reference_moe

    e, h = wts.num_experts, wts.hidden
    knobs = {} if mma is None else {"mma": mma}
    if table_decode is not None:
        knobs["table_decode"] = table_decode
    layer = _layer(wts, topk=TOPK, capacity=max(ms), activation=act, **knobs)
    for m in ms:
        x, ids, w = _inputs(m, h, TOPK, e, torch.bfloat16, seed=300 + m)
        out = _run(layer, x, ids, w)
        assert not torch.isnan(out).any(), f"m={m}: unwritten output elements"
        ref = reference_moe(x, ids, w, wts, activation=act, dtype=torch.float64)
        err = _rel_err(out, ref)
        assert err < 1e-2, f"m={m}: rel err {err:.3e}"
    m = 93
    layers = {(M, 1): _layer(wts, topk=TOPK, capacity=m, pin=M, activation=act, **knobs)
              for M in blocks}
    layers.update({(M, span): _layer(wts, topk=TOPK, capacity=m, pin=M, span=span,
                                     activation=act, **knobs) for M, span in wide})
    routings = {"random": None,
                "one_expert": torch.full((m, TOPK), 1, dtype=torch.int32, device="cuda"),
                "two_experts": (torch.arange(m * TOPK, device="cuda") % 2).view(m, TOPK).to(torch.int32)}
    for name, ids in routings.items():
        x, ids, w = _inputs(m, h, TOPK, e, torch.bfloat16, seed=17, ids=ids)
        ref = reference_moe(x, ids, w, wts, activation=act, dtype=torch.float64)
        base = None
        for (M, span), lay in layers.items():
            bound = lay.bind(x, ids, w)
            assert bound.block_m == M and (span == 1 or bound.plan.spec.span == span)
            lay.output.fill_(float("nan"))
            out = bound.run().clone()
            torch.cuda.synchronize()
            assert _rel_err(out, ref) < 1e-2, f"{name} M={M} span={span}"
            base = out if base is None else base
            assert torch.equal(out, base), f"{name}: M={M} span={span} differs from M={blocks[0]}"
    if not graphs:
        return
    for m in (1, 8):
        check_graph_replay(layer, _inputs(m, h, TOPK, e, torch.bfloat16, seed=500 + m),
                           [_inputs(m, h, TOPK, e, torch.bfloat16, seed=600 + m)], f"m={m}")


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
def test_mixed_layer(mma):
    """Random K3 / K4 records (FC2 switching every 64 channels) on both GEMM paths."""
    _needs_sm90(mma)
    # wgmma: also 48 x 2 items, two workers on 3-stage rings (`default_stages`)
    _check_layer(_mixed((3, 4), seed=61), mma=mma, wide=((48, 2),) if mma == "wgmma" else ())


def test_mixed_layer_t12():
    """The whole layer on the T12 path as sm_120 runs it (mma.sync; forced here): fp64
    reference, bitwise equality across M (8 and 48, sm_120's plan pair), and equal, bit
    for bit, to the same layer on the direct tables (both decodes give every weight the
    same value)."""
    wts = _mixed((3, 4), seed=65)
    _check_layer(wts, mma="sync", ms=(5, 64), blocks=(8, 48), graphs=False, table_decode="t12")
    x, ids, w = _inputs(40, H, TOPK, E, torch.bfloat16, seed=66)
    t12 = _layer(wts, topk=TOPK, capacity=40, activation="situ", mma="sync", table_decode="t12")
    direct = _layer(wts, topk=TOPK, capacity=40, activation="situ", mma="sync",
                    table_decode="direct")
    assert t12.plan.decode.spec.table_decode == "t12"
    assert direct.plan.decode.spec.table_decode == "direct"
    assert torch.equal(_run(t12, x, ids, w).clone(), _run(direct, x, ids, w))


def test_three_rate_layer():
    """K = 2 / 3 / 4 records (three resident state tables) through the wgmma layer. At M=8
    the plan gives up a ring stage for a second worker (two one-warpgroup workers on
    3-stage rings instead of one worker on two warpgroups); fp64 reference at two m and
    bitwise equality with M=16, where one worker runs each item on two warpgroups."""
    _needs_sm90("wgmma")
    wts = _mixed((2, 3, 4), seed=67)
    spec = _layer(wts, topk=TOPK, capacity=64, activation="situ", mma="wgmma").plan.decode.spec
    assert (spec.block_m, spec.stages, spec.gemm_workers()) == (8, 3, 2)
    assert spec.replace(block_m=16).gemm_workers() == 1
    _check_layer(wts, mma="wgmma", ms=(5, 64), blocks=(8, 16), graphs=False)


def test_k4_expert_next_to_k2_expert():
    """Expert 0 with every record at K=4, expert 1 with every record at K=2 (the skewed
    routings put all routes on them), the others random over {2, 4}."""
    fc1, fc2 = _rate_maps(E, I, (2, 4), seed=62)
    for fc in (fc1, fc2):
        fc[0], fc[1] = 4, 2
    one = _mixed((2, 4), seed=62, maps=(fc1, fc2))
    _check_layer(one, ms=(16, 93), graphs=False)


def test_mixed_coupled_layer():
    """The coupled transforms (k3x22_k4x2_coupled_h512_h128's) on mixed K3 / K4 weights."""
    _check_layer(_mixed((3, 4), seed=63, h=512, coupled=True), ms=(5, 64), blocks=(8, 64),
                 graphs=False)


@pytest.mark.parametrize("profile,tp,rank", [("k3x22_k4x2", 4, 1),
                                             ("k3x22_k4x2_coupled_h512_h128", 12, 7)])
def test_loaded_qsrt_mixed_rank(profile, tp, rank):
    """A rank as the QSRT loader builds it (placement-rule rates, atoms-v2 bundles): TP4
    rank 1 holds expert 0's P43 pair 5; coupled TP12 rank 7 serves pair 11 (FC1 P43, FC2
    P44) at layer 5."""
    from kquant_cute import qsrt
    from kquant_cute.reference import reference_moe

    layer = qsrt.random_layer(5, qsrt.Geometry(4, 512, 3072), seed=11, profile=profile,
                              **({"draws": [0, 3, 6, 1]} if "coupled" in profile else {}))
    wts = layer.rank(tp, rank).to("cuda")
    assert wts.rate_set == (3, 4)
    lay = _layer(wts, topk=2, capacity=64, activation="situ")
    for m in (3, 64):
        x, ids, w = _inputs(m, wts.hidden, 2, wts.num_experts, torch.bfloat16, seed=m)
        out = _run(lay, x, ids, w)
        assert not torch.isnan(out).any()
        ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
        assert _rel_err(out, ref) < 1e-2, f"m={m}"


def test_one_rate_mixed_container_runs_the_uniform_kernels():
    """MixedMoEWeights at one K binds the uniform specialization and gives the MoEWeights
    layer's output bitwise."""
    from kquant_cute.mixed import MixedMoEWeights
    from kquant_cute.weights import MoEWeights

    uni = MoEWeights.random(E, H, I, 3, "sqg_e4m3", shared_hidden_vectors=True, seed=64,
                            device="cuda")
    mixed = MixedMoEWeights.from_uniform(uni)
    a, b = _layer(uni, topk=TOPK, capacity=64), _layer(mixed, topk=TOPK, capacity=64)
    assert a.plan.decode.spec == b.plan.decode.spec and not b.plan.decode.spec.mixed
    x, ids, w = _inputs(64, H, TOPK, E, torch.bfloat16, seed=9)
    assert torch.equal(_run(a, x, ids, w).clone(), _run(b, x, ids, w))

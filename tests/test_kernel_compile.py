"""Compile-only tests of the fused forward for sm_90a / sm_100a / sm_120a (no GPU needed).

Every route block size of the default geometry (the Kimi-K3 TP8 shard of docs/formats.md) is
cross-compiled for each arch and either accepted with measured resources inside the arch's
limits, or rejected with a reason. Resources are read from the compiled cubin
(`cuobjdump --dump-resource-usage`), never from a table. Also shows the planner's fallback
on the real kernel: with an 8-stage pipeline M=64 needs more shared memory than sm_120
allows, so the sm_120 plan falls back to M=48 while sm_90 keeps M=64.
"""

from __future__ import annotations

import pytest

from kquant_cute.compile_cache import CompileCache
from kquant_cute.compiler import geometry_check, plan_forward
from kquant_cute.kernels.build import find_cuobjdump
from kquant_cute.planners import arch_limits, resolve_env
from kquant_cute.prewarm import DEFAULT_GEOMETRY

needs_cuobjdump = pytest.mark.skipif(
    find_cuobjdump() is None,
    reason="cuobjdump not found (the nvidia-cuda-cuobjdump dependency): resources unmeasurable")

ARCHS = ("sm_90a", "sm_100a", "sm_120a")
BLOCKS = (8, 16, 32, 48, 64)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return CompileCache(tmp_path_factory.mktemp("kq_compile"))


@needs_cuobjdump
@pytest.mark.parametrize("arch", ARCHS)
def test_default_geometry_compiles_for_every_block(arch, cache):
    limits = arch_limits(arch)
    gemm_regs = {}
    for m in BLOCKS:
        spec = DEFAULT_GEOMETRY.replace(block_m=m, arch=arch)
        verdict = geometry_check(spec, cache)
        if not verdict.ok:  # a rejection must say why, with numbers
            assert verdict.reason and ("shared memory" in verdict.reason or "register" in verdict.reason)
            continue
        assert verdict.reason is None
        assert 0 < verdict.registers <= limits.regs_per_thread_max
        assert verdict.spills == 0
        assert verdict.smem_bytes <= limits.smem_per_block_optin
        kernels = {k["kernel"]: k for k in _resources(spec, cache)["kernels"]}
        # sm_90a builds the wgmma GEMM (spans of 2 blocks at M=32), other archs mma.sync.
        name = "TrellisWgmma" if arch == "sm_90a" else "TrellisGemm"
        assert set(kernels) == {name, "RouteCount", "RoutePack", "RotateInput",
                                "MidActivation", "CombineOutput"}
        gemm = kernels[name]
        # The GEMM's shared memory is its cp.async ring: measured static + dynamic bytes.
        assert gemm["shared"] >= spec.dynamic_smem()[name]
        gemm_regs[m] = gemm["registers"]
    assert 8 in gemm_regs, f"{arch}: the decode block M=8 must compile"
    # Wider blocks hold more accumulators: the register count grows with M.
    assert gemm_regs[max(gemm_regs)] > gemm_regs[8]


def _resources(spec, cache):
    from kquant_cute.compiler import get_specialization

    return get_specialization(spec, cache).value.resources


@needs_cuobjdump
def test_sm120_rejects_wide_block_that_sm90_accepts(cache):
    """An 8-stage pipeline at M=64 needs 106,496 B of dynamic shared memory: over sm_120's
    101,376 B per-block limit (100,352 B dynamic beside the DSL's 1,024 B static), inside
    sm_90's 232,448 B. The planner falls back to 48."""
    base = DEFAULT_GEOMETRY.replace(stages=8)
    v90 = geometry_check(base.replace(block_m=64, arch="sm_90a"), cache)
    v120 = geometry_check(base.replace(block_m=64, arch="sm_120a"), cache)
    assert v90.ok
    assert not v120.ok and "shared memory" in v120.reason and "100,352" in v120.reason
    env = resolve_env({})
    # The decode/prefill pair plan (banded=False): the fallback walk alone, no band candidates.
    p90 = plan_forward(base, capacity=4096, arch="sm_90", env=env, cache=cache, banded=False)
    p120 = plan_forward(base, capacity=4096, arch="sm_120", env=env, cache=cache, banded=False)
    assert p90.prefill.spec.block_m == 64
    assert p120.prefill.spec.block_m == 48
    walk = [(c.block_m, c.ok) for c in p120.route.candidates]
    assert walk == [(64, False), (48, True), (8, True)]
    text = p120.describe()
    assert "M=64: rejected" in text and "shared memory" in text


def test_static_rejections_name_the_reason():
    from kquant_cute.kernels.launch import ROUTE_BLOCK_SIZES

    spec = DEFAULT_GEOMETRY.replace(block_m=8, arch="sm_90a")
    reasons = {
        "hidden 3500 is not a positive multiple of 128 (the Hadamard block)": dict(hidden=3500),
        f"block_m 12 not in {ROUTE_BLOCK_SIZES}": dict(block_m=12),
        "bits 7 outside 2..6 for codebook 'mcg'": dict(bits=7),
        "bits 5 outside 2..4 for codebook 'sqg_e4m3'": dict(codebook="sqg_e4m3", bits=5),
        "codebook 'sqg_e4m3' needs cvt.rn.f16x2.e4m3x2 (sm_89 or later), not sm_86":
            dict(codebook="sqg_e4m3", arch="sm_86", mma="sync"),
        "stages 1 outside 2..8": dict(stages=1),
        "span must be an int >= 0, got -1": dict(mma="wgmma", span=-1),
        "span 3 not in (1, 2, 4)": dict(mma="wgmma", span=3),
        "mma 'wgmma' needs sm_90a, not sm_120a": dict(arch="sm_120a", mma="wgmma"),
    }
    for reason, change in reasons.items():
        assert spec.replace(**change).check() == reason, change
    assert spec.replace(codebook="bogus").check().startswith(
        "codebook 'bogus' has no mma decode path (supported: ")
    assert spec.replace(mma="mfma").check().startswith("mma 'mfma' not in (")
    assert spec.replace(codebook="sqg_e4m3", bits=4).check() is None
    # "auto" resolves by arch when the spec is made; the resolved spec names and keys the
    # object, and replace() resolves the request again (M=32 gets its own span).
    assert (spec.mma, spec.span) == ("wgmma", 1) and spec.requested == ("auto", 0, "auto", 0)
    assert spec.replace(arch="sm_120a").mma == "sync"
    assert spec.replace(block_m=32).kernel_name().endswith("_wgmma_x2_sm_90a")
    pinned = spec.replace(mma="wgmma", span=1)
    assert pinned == spec and pinned.key_fields() == spec.key_fields()  # one object
    assert pinned.replace(block_m=32).span == 1  # a pin stays pinned
    assert spec.check() is None


@needs_cuobjdump
def test_banded_plan_binds_the_policy_choice_per_call(cache):
    """The default (banded) plan: above the threshold a call binds the policy's M at its own
    m (the pair plan, banded=False, binds the capacity's M=64 for every m > 256), and from
    3,584 tokens the wide rule's M=48 x 2. The policy reads m, topk and E only, so the
    default geometry's specializations (built by test_default_geometry_compiles_for_every_block
    in this module's cache) serve; the wide one is compiled here, resources measured."""
    base = DEFAULT_GEOMETRY.replace(arch="sm_90a")
    env = resolve_env({})
    pair = plan_forward(base, capacity=4096, arch="sm_90", env=env, cache=cache, banded=False)
    banded = plan_forward(base, capacity=4096, arch="sm_90", env=env, cache=cache)
    assert banded.route.block_sizes == (8, 16, 32, 48, 64) and list(banded.entries) == [8, 16, 32, 48, 64]
    picks = {m: banded.plan_for(m).spec.block_m for m in (1, 256, 257, 512, 1536, 2048, 4096)}
    assert picks == {1: 8, 256: 8, 257: 8, 512: 16, 1536: 32, 2048: 48, 4096: 48}
    assert all(banded.plan_for(m).spec.block_m == b.block_m
               for b in banded.route.bands for m in (b.lo, b.hi))
    assert banded.route.wide_keys == ((48, 2),) and banded.route.band_for(3583).key == (64, 0)
    wide = banded.plan_for(4096)
    assert wide is banded.wide[48, 2] and wide.spec.span == 2 and wide.spec.mma == "wgmma"
    verdict = banded.route.verdict(48, 2)
    assert verdict.ok and verdict.measured and verdict.spills == 0
    assert {m: pair.plan_for(m).spec.block_m for m in (256, 257, 512)} == {256: 8, 257: 64, 512: 64}
    assert "banded" in banded.describe()


@needs_cuobjdump
def test_mma_kind_resolves_per_arch_and_wgmma_compiles_at_every_span(cache):
    """"auto" is wgmma (spans of 2 blocks at M=32) on sm_90a and mma.sync elsewhere; an
    explicit wgmma elsewhere is rejected. The wgmma GEMM compiles with no spills at every
    span (1, 2, 4; test_default_geometry_compiles_for_every_block covers every block size
    at its default span), with one warpgroup up to 64 rows per work item and two above
    (M=32 x 4: the widest item a span allows), and at M=64 without spans it needs fewer
    registers than mma.sync (no 16-row padding of the accumulators, which live on the
    weight side)."""
    from kquant_cute.kernels.trellis_wgmma import smem_bytes as wgmma_smem

    spec90 = DEFAULT_GEOMETRY.replace(arch="sm_90a")
    assert [(spec90.replace(block_m=m).mma, spec90.replace(block_m=m).span)
            for m in BLOCKS] == [("wgmma", 1), ("wgmma", 1), ("wgmma", 2), ("wgmma", 1), ("wgmma", 1)]
    spec120 = DEFAULT_GEOMETRY.replace(arch="sm_120a", block_m=64)
    assert (spec120.mma, spec120.span) == ("sync", 1)
    assert "needs sm_90a" in DEFAULT_GEOMETRY.replace(arch="sm_120a", mma="wgmma").check()
    assert "mma 'sync' runs one route block per work item" in spec90.replace(mma="sync", span=2).check()
    assert "rows > 128" in spec90.replace(mma="wgmma", block_m=64, span=4).check()
    regs = {}
    # Every (M, span) below is checked statically (threads, shared memory); the compiled
    # ones are the default spans (8, 1), (32, 2), (64, 1) (shared with the default-geometry
    # test) and span 4 with one warpgroup (8, 4) and with two at the widest item (32, 4).
    compiled = {(8, 1), (8, 4), (32, 2), (32, 4), (64, 1)}
    for m, span in [(8, 1), (8, 4), (16, 4), (32, 1), (32, 2), (32, 4), (48, 2), (64, 1),
                    (64, 2)]:
        spec = spec90.replace(block_m=m, mma="wgmma", span=span)
        assert spec.check() is None, (m, span)
        threads, smem = spec.kernel_launches()["TrellisWgmma"]
        assert threads == (256 if m * span > 64 else 128) and smem == wgmma_smem(m, 4, 4, span)
        if (m, span) not in compiled:
            continue
        verdict = geometry_check(spec, cache)
        assert verdict.ok, (m, span, verdict.reason)
        gemm = {k["kernel"]: k for k in _resources(spec, cache)["kernels"]}["TrellisWgmma"]
        assert gemm["local"] == 0 and gemm["stack"] == 0
        assert gemm["shared"] >= wgmma_smem(m, spec.bits, spec.stages, span)
        regs[m, span] = gemm["registers"]
    sync64 = {k["kernel"]: k for k in _resources(spec90.replace(block_m=64, mma="sync"),
                                                  cache)["kernels"]}["TrellisGemm"]["registers"]
    assert regs[64, 1] < sync64
    assert regs[8, 1] < regs[64, 1]


@needs_cuobjdump
@pytest.mark.parametrize("arch", ARCHS)
def test_sqg_e4m3_compiles_with_its_state_table(arch, cache):
    """sqg_e4m3 at K = 2, 3, 4: the GEMM (wgmma on sm_90a, mma.sync elsewhere) holds the
    64 KiB state table in front of its rings (measured shared memory), spills nothing, and
    its persistent grid's CTAs per SM are what shared memory allows. On sm_120 (99 KB per
    block) M=64 is rejected before compiling, naming the table."""
    from kquant_cute.kernels.decode import TABLE_BYTES

    limits = arch_limits(arch)
    name = "TrellisWgmma" if arch == "sm_90a" else "TrellisGemm"
    per_sm = limits.smem_per_block_optin + 1024
    for bits, m in ((2, 8), (3, 16), (4, 32)):
        spec = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=bits, block_m=m, arch=arch)
        verdict = geometry_check(spec, cache)
        assert verdict.ok, (bits, m, verdict.reason)
        assert verdict.spills == 0 and 0 < verdict.registers <= limits.regs_per_thread_max
        gemm = {k["kernel"]: k for k in _resources(spec, cache)["kernels"]}[name]
        dynamic = spec.dynamic_smem()[name]
        assert gemm["shared"] >= dynamic > TABLE_BYTES
        # Per CTA: the measured static + dynamic bytes and the driver's 1,024 B reservation.
        ctas = spec.gemm_resident_ctas()
        assert ctas * (gemm["shared"] + 1024) <= per_sm < (ctas + 1) * (gemm["shared"] + 1024)
        assert spec.table_decode == "direct"
    if arch == "sm_120a":
        reason = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=4, block_m=64,
                                          arch=arch).check()
        assert "64 KiB sqg_e4m3 state table" in reason and "100,352" in reason


@needs_cuobjdump
def test_sqg_e4m3_k2_pair_table_compiles_on_sm90(cache):
    """Uniform K=2 sqg_e4m3 on sm_90a (the production QSRT layer): the wgmma GEMM holds the
    128 KiB pair table and as many one-warpgroup workers' rings as fit in the 101,376 B
    left of 227 KB (one CTA per SM) and as the register cap allows: a worker holds 4 stages x
    2,048 B of K=2 words and its activation ring (4 stages x rows x 128 B; the epilogue
    stores from registers), 12,288 B at 8 rows (6 workers, 768 threads), 16,384 B at 16 rows
    (6); from 32 rows a 3-stage ring buys a worker: 18,432 B at 32 rows (M=32 runs span 1
    here; 5 workers), 24,576 B at 48 rows (4), 30,720 B at 64 rows (3), with one k step's
    wgmma in flight instead of two (`wgmma_steps_in_flight`), and 48 x 2 runs three 96-row
    workers on 2-stage rings (28,672 B each), also with one step in flight. At the plans'
    block sizes it spills nothing and fits 227 KB; the mma.sync GEMM keeps the 64 KiB
    direct table."""
    from kquant_cute.kernels.decode import PAIR_TABLE_BYTES, TABLE_BYTES

    limits = arch_limits("sm_90a")
    for m, span, workers, stages in ((8, 1, 6, 4), (16, 1, 6, 4), (32, 1, 5, 3), (48, 1, 4, 3),
                                     (64, 1, 3, 3), (48, 2, 3, 2)):
        spec = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=2, block_m=m, arch="sm_90a",
                                        **({"span": span} if span > 1 else {}))
        assert (spec.span, spec.stages) == (span, stages) and spec.table_layout() == "pair"
        verdict = geometry_check(spec, cache)
        assert verdict.ok, (m, verdict.reason)
        assert verdict.spills == 0 and verdict.registers <= limits.regs_per_thread_max
        threads, dynamic = spec.kernel_launches()["TrellisWgmma"]
        assert spec.gemm_workers() == workers and threads == 128 * workers
        assert spec.gemm_resident_ctas() == 1
        gemms = [k for k in _resources(spec, cache)["kernels"] if k["kernel"] == "TrellisWgmma"]
        assert all(dynamic <= g["shared"] <= limits.smem_per_block_optin for g in gemms)
        assert dynamic > PAIR_TABLE_BYTES
    sync = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=2, block_m=32, arch="sm_90a",
                                    mma="sync")
    assert sync.table_layout() == "direct"
    assert TABLE_BYTES < sync.dynamic_smem()["TrellisGemm"] < PAIR_TABLE_BYTES


@needs_cuobjdump
def test_the_register_cap_is_where_ptxas_spills(tmp_path, monkeypatch):
    """`PAIR_ROWS_MAX_WORKERS` is measured, not a guess: its workers past two k steps in
    flight need one. With two steps in flight at every width, the pair table's M=48 and
    M=64 on 3-stage rings run 4 and 3 workers (4 x 24,576 B and 3 x 30,720 B fit the
    100,352 B beside the table) and ptxas spills both at the 128 / 168 registers a thread
    that many workers leave; with one step in flight they run without spills (the
    pair-table test above). Up to 16 rows: 8 workers on 3-stage rings fit M=16's shared
    memory (8 x 12,288 B) and spill at 64 registers; 6 run without."""
    from kquant_cute.kernels import trellis_wgmma

    monkeypatch.setattr(trellis_wgmma, "PAIR_ROWS_MAX_WORKERS",
                        ((16, 8, 8), (trellis_wgmma.WORKER_ROWS, 4, 4)))
    monkeypatch.setattr(trellis_wgmma, "WORKERS", tuple(range(1, 9)))
    fresh = CompileCache(tmp_path / "c")  # the cap is no part of a cache key
    for m, workers in ((48, 4), (64, 3), (16, 8)):
        spec = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=2, block_m=m, arch="sm_90a",
                                        stages=3)
        assert spec.gemm_workers() == workers
        verdict = geometry_check(spec, fresh)
        assert verdict.spills > 0, (m, verdict)
        assert verdict.registers <= 65_536 // (128 * workers)


@needs_cuobjdump
def test_sqg_e4m3_sm120_plan_falls_back_to_a_block_that_fits(cache):
    """The 64 KiB table leaves sm_120 room for M <= 32 at K=4: the prefill plan for 4,096
    tokens (policy M=64) falls back to 32 with both rejections recorded; sm_90 keeps 64."""
    base = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=4)
    env = resolve_env({})
    p120 = plan_forward(base, capacity=4096, arch="sm_120", env=env, cache=cache, banded=False)
    walk = [(c.block_m, c.ok) for c in p120.route.candidates]
    assert walk == [(64, False), (48, False), (32, True), (8, True)]
    assert all("state table" in c.verdict.reason for c in p120.route.candidates if not c.ok)
    assert p120.prefill.spec.block_m == 32 and p120.decode.spec.block_m == 8
    assert "M=48: rejected" in p120.describe()
    assert geometry_check(base.replace(block_m=64, arch="sm_90a"), cache).ok


MIXED = dict(codebook="sqg_e4m3", bits=4, bits_set=(3, 4))  # QSRT k3x22_k4x2's rates


@needs_cuobjdump
def test_mixed_rates_compile_on_sm90_with_a_table_per_rate(cache):
    """k3x22_k4x2 (bits_set (3, 4)) on sm_90a: both GEMM paths compile at the plans' block
    sizes with no spills; shared memory holds both 64 KiB state tables in front of B rings
    sized for K=4, which leaves one CTA per SM. mma.sync: the uniform K=4 layer's bytes plus
    one table. wgmma: one-warpgroup workers with a ring each, as many as fit and as the
    register cap allows, on one stage less where that adds a worker: 4 at M=8 (512 threads;
    20,480 B each beside the 131,072 B of tables), 4 at M=32 (span 1, 3 stages: 24,576 B
    each), 2 at M=64 (49,152 B each, 256 threads); M=32 and M=64 fill the 227 KB alike; 48 x
    2 items run two 96-row workers on 3-stage rings (49,152 B each). Three rates at M=8 run
    two workers on 3-stage rings (4 stages would leave room for one, on two warpgroups). The
    plan pair for 4,096 tokens keeps M=8 / M=64. Every case's launch shape is checked; the
    compiled (measured) ones are every wgmma case, mma.sync at M=64 and three rates at M=8
    (mma.sync M=8 has less shared memory than mma.sync M=64)."""
    from kquant_cute.kernels.bring import b_stage_bytes
    from kquant_cute.kernels.decode import TABLE_BYTES

    limits = arch_limits("sm_90a")
    # (mma, GEMM, M, rates, workers, compiled)
    cases = [("wgmma", "TrellisWgmma", m, (3, 4), w, True) for m, w in ((8, 4), (32, 4), (64, 2))]
    cases += [("sync", "TrellisGemm", m, (3, 4), 1, m == 64) for m in (8, 64)]
    cases += [("wgmma", "TrellisWgmma", 8, (2, 3, 4), 2, True)]
    dynamic_at = {}
    for mma, name, m, rates, workers, compiled in cases:
        spec = DEFAULT_GEOMETRY.replace(block_m=m, arch="sm_90a", mma=mma,
                                        **dict(MIXED, bits_set=rates))
        assert spec.check() is None, (mma, m)
        assert spec.gemm_workers() == workers
        threads, dynamic = spec.kernel_launches()[name]
        dynamic_at[mma, m, rates] = dynamic
        assert threads == (128 * max(workers, 2) if mma == "wgmma" else 128)
        assert dynamic >= len(rates) * TABLE_BYTES + workers * spec.stages * b_stage_bytes(4)
        if mma == "sync":  # the uniform K=4 layer's bytes plus one table
            assert dynamic == spec.replace(bits_set=()).dynamic_smem()[name] + TABLE_BYTES
        assert spec.gemm_resident_ctas() == 1
        if not compiled:
            continue
        verdict = geometry_check(spec, cache)
        assert verdict.ok, (mma, m, verdict.reason)
        assert verdict.spills == 0 and verdict.registers <= limits.regs_per_thread_max
        gemms = [k for k in _resources(spec, cache)["kernels"] if k["kernel"] == name]
        assert len(gemms) == 2  # FC1 (gate and up: one launch) and FC2
        assert all(dynamic <= g["shared"] <= limits.smem_per_block_optin for g in gemms)
    assert dynamic_at["wgmma", 32, (3, 4)] == dynamic_at["wgmma", 64, (3, 4)]
    wide = DEFAULT_GEOMETRY.replace(block_m=48, span=2, arch="sm_90a", mma="wgmma",
                                    **dict(MIXED, bits_set=(3, 4)))
    assert (wide.stages, wide.gemm_workers()) == (3, 2)
    assert wide.kernel_launches()["TrellisWgmma"] == (256, 2 * TABLE_BYTES + 2 * 49_152)
    verdict = geometry_check(wide, cache)
    assert verdict.ok and verdict.spills == 0, verdict.reason
    assert verdict.registers <= limits.regs_per_thread_max
    assert dynamic_at["sync", 8, (3, 4)] < dynamic_at["sync", 64, (3, 4)]
    base = DEFAULT_GEOMETRY.replace(**MIXED)
    plan = plan_forward(base, capacity=4096, arch="sm_90", env=resolve_env({}), cache=cache)
    assert (plan.decode.spec.block_m, plan.prefill.spec.block_m) == (8, 64)
    assert plan.prefill.spec.bits_set == (3, 4) and "_r34_" in plan.prefill.spec.kernel_name()


@needs_cuobjdump
def test_mixed_rates_compile_on_sm120_through_t12(cache):
    """k3x22_k4x2 on sm_120 (101,376 B per block): its two 64 KiB direct tables do not fit,
    so the spec resolves to the T12 decode (4 KiB for every K, the bijection on the ALU).
    The plan's specializations compile with measured resources: no spills, shared memory
    under the limit and holding T12 plus the K=4 rings; M=64 (if the walk built it) is
    rejected only for its registers."""
    from kquant_cute.kernels.bring import b_stage_bytes
    from kquant_cute.kernels.sqg_t12 import T12_TABLE_BYTES

    limits = arch_limits("sm_120a")
    base = DEFAULT_GEOMETRY.replace(arch="sm_120a", **MIXED)
    assert base.table_decode == "t12" and "_r34_t12_" in base.kernel_name()
    assert base.replace(arch="sm_90a").table_decode == "direct"
    plan = plan_forward(base, capacity=4096, arch="sm_120", env=resolve_env({}), cache=cache,
                        banded=False)
    assert plan.decode.spec.block_m == 8 and plan.prefill is not None
    for entry in plan.entries.values():
        spec = entry.spec
        assert spec.table_decode == "t12" and spec.mma == "sync"
        verdict = geometry_check(spec, cache)
        assert verdict.ok and verdict.spills == 0, (spec.block_m, verdict.reason)
        assert 0 < verdict.registers <= limits.regs_per_thread_max
        dynamic = spec.dynamic_smem()["TrellisGemm"]
        assert dynamic >= T12_TABLE_BYTES + spec.stages * b_stage_bytes(4)
        assert dynamic == spec.replace(table_decode="direct").dynamic_smem()["TrellisGemm"] \
            - 2 * 65536 + T12_TABLE_BYTES
        gemms = [k for k in _resources(spec, cache)["kernels"] if k["kernel"] == "TrellisGemm"]
        assert len(gemms) == 2  # FC1 (gate and up: one launch) and FC2
        assert all(dynamic <= g["shared"] < limits.smem_per_block_optin for g in gemms)
    for c in plan.route.candidates:
        if not c.ok:
            assert "register spills" in c.verdict.reason, (c.block_m, c.verdict.reason)


def test_table_decode_resolution_and_rejections():
    """`table_decode` "auto" resolves per layer: direct where the layer's direct tables fit
    beside the smallest GEMM, else T12; forced values are checked. The production QSRT
    profile (uniform K=2, coupled) keeps the direct table on sm_120 for M <= 32."""
    prod = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=2, coupled=True,
                                    shared_hidden_vectors=True, arch="sm_120a")
    for m in (8, 16, 32):
        spec = prod.replace(block_m=m)
        assert spec.table_decode == "direct" and spec.check() is None
    assert "64 KiB sqg_e4m3 state table" in prod.replace(block_m=64).check()
    assert prod.replace(table_decode="t12", block_m=64).check() is None
    mixed = DEFAULT_GEOMETRY.replace(block_m=8, arch="sm_120a", **MIXED)
    assert mixed.table_decode == "t12" and mixed.replace(block_m=64).table_decode == "t12"
    assert mixed.replace(arch="sm_90a").table_decode == "direct"
    assert mixed.replace(arch="sm_90a").replace(arch="sm_120a").table_decode == "t12"
    assert DEFAULT_GEOMETRY.table_decode == "direct"  # arithmetic codebooks read no table
    assert "needs a table codebook" in DEFAULT_GEOMETRY.replace(table_decode="t12").check()
    assert "not in" in mixed.replace(table_decode="t13").check()
    subs = {s.role: s.args for s in mixed.sub_kernels()}
    assert subs["gemm1"]["table_decode"] == subs["gemm2"]["table_decode"] == "t12"


def test_mixed_rate_rejections_name_the_reason():
    """Where the direct tables do not fit (sm_120's 99 KB when forced; three rates at wide
    blocks on sm_90) the geometry is rejected before compiling, naming them; bad rate sets
    say why."""
    base = DEFAULT_GEOMETRY.replace(block_m=8, **MIXED)
    reason = base.replace(arch="sm_120a", table_decode="direct").check()
    assert "128 KiB of sqg_e4m3 state tables for K 3, 4" in reason and "100,352" in reason
    with pytest.raises(ValueError, match="decode specialization is not implementable: "
                                         "shared memory .* state tables"):
        plan_forward(base.replace(table_decode="direct"), capacity=64, arch="sm_120",
                     env=resolve_env({}))
    three = base.replace(bits_set=(2, 3, 4), arch="sm_90a")
    assert three.replace(block_m=16).check() is None
    assert "192 KiB of sqg_e4m3 state tables" in three.replace(block_m=64).check()
    assert "need a table codebook" in base.replace(codebook="mcg").check()
    assert "must be the widest K" in base.replace(bits=3).check()
    assert "ascending" in base.replace(bits_set=(4, 3)).check()
    assert "ascending" in base.replace(bits_set=(4,)).check()
    assert "outside 2..4" in base.replace(bits_set=(3, 5), bits=5).check()
    assert base.check() is None and base.mixed and not base.replace(bits_set=()).mixed
    assert "_r34_" in base.kernel_name() and "_r34_" not in base.replace(bits_set=()).kernel_name()
    assert base.key_fields()["bits_set"] == (3, 4)
    # Only the GEMMs see the rates: FC1 along its N (output) axis, FC2 along its K.
    subs = {s.role: s.args for s in base.sub_kernels()}
    assert (subs["gemm1"]["rate_axis"], subs["gemm2"]["rate_axis"]) == ("n", "k")
    assert subs["gemm1"]["workers"] == 4 and base.replace(bits_set=()).gemm_workers() == 1
    assert base.replace(block_m=64, span=2).gemm_workers() == 1  # 128 rows: two warpgroups
    from kquant_cute.kernels.trellis_wgmma import TrellisWgmma
    assert "workers 2 need work items of <= 96 rows" in TrellisWgmma.can_implement(
        block_m=64, k_dim=256, n_dim=256, bits=4, codebook="sqg_e4m3", stages=4, span=2,
        bits_set=(3, 4), workers=2)
    assert all("bits_set" not in a for r, a in subs.items() if not r.startswith("gemm"))


def test_sub_kernels_answer_the_same_questions():
    """Every device kernel of the forward: can_implement (a reason or None), threads and
    dynamic shared memory, here against hand-computed values for the reference geometry
    (E=896, K=4, 4 stages); the geometry check and the resource reading use this list.

    RouteCount / RoutePack: CTAs of 1,024 threads; the count holds a histogram (896 int32),
    the pack per-expert totals and cursors (2 x 896 int32) and two scan buffers (2 x 1,024
    int32); each 64 bytes of slack. The rotation stages: 4 warps,
    registers and shuffles only. Both GEMMs: 4 warps (one warpgroup: at most 64 rows) and a
    B ring of 4 stages x 8 tile columns x 4 k-tiles x 32 x K bytes = 16,384 B, after an A
    region: mma.sync, 4 stages x rows padded to 16 x 72 halves (64 + 8 padding) x 2 B but at
    least the epilogue's 4 warps x 16 x 40 fp32 = 10,240 B; wgmma, 4 stages x rows x 128 B
    (its epilogue stores from registers; rows = span x M: M=32 runs span 2)."""
    b_ring = 4 * 8 * 4 * 32 * 4
    gemm_smem = {
        ("sm_120a", 8): 10_240 + b_ring,                 # 4 x 16 x 72 x 2 = 9,216 < 10,240
        ("sm_120a", 32): 4 * 32 * 72 * 2 + b_ring,
        ("sm_120a", 64): 4 * 64 * 72 * 2 + b_ring,
        ("sm_90a", 8): 4 * 8 * 128 + b_ring,
        ("sm_90a", 32): 4 * 64 * 128 + b_ring,           # 2 blocks of 32: 64 rows
        ("sm_90a", 64): 4 * 64 * 128 + b_ring,
    }
    for (arch, m), smem in gemm_smem.items():
        gemm = "TrellisWgmma" if arch == "sm_90a" else "TrellisGemm"
        spec = DEFAULT_GEOMETRY.replace(block_m=m, arch=arch)
        subs = spec.sub_kernels()
        assert [s.role for s in subs] == ["count", "pack", "rotate_in", "gemm1", "mid", "gemm2",
                                          "combine"]
        assert spec.kernel_launches() == {
            "RouteCount": (1024, 4 * 896 + 64),
            "RoutePack": (1024, 4 * (2 * 896 + 2 * 1024) + 64), "RotateInput": (128, 0),
            gemm: (128, smem), "MidActivation": (128, 0), "CombineOutput": (128, 0)}, (arch, m)
        for sub in subs:  # each built kernel says the same as the launch table
            assert sub.check() is None
            k = sub.build()
            assert (k.threads, k.smem_bytes) == spec.kernel_launches()[sub.name]
        assert spec.dynamic_smem()[gemm] == smem
    # A sub-kernel's own reason surfaces through the spec, with its numbers, against its own
    # arch's dynamic limit (the per-block limit less the DSL's 1,024 B of static shared
    # memory; sm_120: 101,376 - 1,024 B; sm_90: 232,448 - 1,024 B): 40,000 experts need
    # 4 x 40,000 + 64 B to count (the first kernel; 4 x (80,000 + 2,048) + 64 to pack); a wgmma work item of 2 x 64 rows with 8 stages
    # needs 8 x 128 x 128 B of A ring and 8 x 4,096 B of B ring, after two 64 KiB tables.
    assert DEFAULT_GEOMETRY.replace(num_experts=40000, arch="sm_120a").check() == (
        "route count needs 160,064 B shared memory > 100,352 B per-block limit")
    assert DEFAULT_GEOMETRY.replace(activation="gelu").check() == (
        "activation 'gelu' not in ('silu', 'situ')")
    wg = DEFAULT_GEOMETRY.replace(block_m=64, mma="wgmma", span=2, stages=8, arch="sm_90a",
                                  codebook="sqg_e4m3", bits_set=(3, 4))
    assert wg.check() == ("shared memory 294,912 B (incl. the 128 KiB of sqg_e4m3 state tables "
                          "for K 3, 4) > 231,424 B per-block limit")


def test_unmeasured_resources_are_reported_not_passed(tmp_path, monkeypatch, capsys):
    """Without cuobjdump the object still compiles, but the verdict says "unmeasured"
    (measured=False) and kquant-compile shows it in its table and on stderr."""
    from kquant_cute import cli
    from kquant_cute.kernels import build

    monkeypatch.setattr(build, "find_cuobjdump", lambda: None)
    small = DEFAULT_GEOMETRY.replace(num_experts=8, hidden=256, intermediate=256, topk=2,
                                     block_m=8, arch="sm_120a")
    cache = CompileCache(tmp_path / "c")
    verdict = geometry_check(small, cache)
    assert verdict.ok and verdict.measured is False and verdict.registers is None
    assert "unmeasured" in verdict.summary()
    status = cli.main(["--sm", "120", "--experts", "8", "--hidden", "256", "--intermediate",
                       "256", "--topk", "2", "--capacity", "64", "--cache-dir",
                       str(tmp_path / "c"), "-q"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "unmeasured" in out
    assert "not measured" in err and "cuobjdump" in err

"""CPU proofs of the sqg_e4m3 pair-table decode: the table the host builds
(`kquant_cute.trellis.sqg_pair_table`) holds every state's byte where the decode looks, and
the decode's offset / selector arithmetic (`kernels/decode.py`'s `pair_table_fields`, run here on
numpy uint32 with a model of `prmt.b32`) returns the direct table's bytes for every K=2
window at every pair position. The GPU test `test_gpu_moe.py::test_decode_bit_exact_through_gemm`
runs the same arithmetic in the kernel."""

import numpy as np
import pytest
import torch

from kquant_cute import trellis as tc
from kquant_cute.kernels.moe import MoESpec
from kquant_cute.kernels.decode import (PAIR_TABLE_BYTES, check_pair_table, pair_table_fields,
                                        table_bytes)
from kquant_cute.kernels.trellis_gemm import TrellisGemm
from kquant_cute.kernels.trellis_wgmma import TrellisWgmma


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pair_table_holds_every_state_for_both_neighbours(bits):
    """Every one of the 65,536 states sits in entry x mod 2^(16-K) at byte x >> (16-K)
    (as the earlier state of a pair) and in entry x >> K at byte 2^K + (x mod 2^K) (as
    the later one), with the direct table's byte."""
    direct = tc.sqg_state_table(bits).long()
    pairs = tc.sqg_pair_table(bits).long()
    w, ent = 16 - bits, 1 << (bits + 1)
    assert pairs.shape == (PAIR_TABLE_BYTES,) and pairs.numel() == (1 << w) * ent
    x = torch.arange(1 << 16)
    earlier = pairs[(x & ((1 << w) - 1)) * ent + (x >> w)]
    later = pairs[(x >> bits) * ent + (1 << bits) + (x & ((1 << bits) - 1))]
    assert torch.equal(earlier, direct)
    assert torch.equal(later, direct)


def _prmt(lo, hi, sel):
    """prmt.b32 (default mode) result bytes 0 and 1 of registers lo (bytes 0-3) and hi
    (bytes 4-7): nibble n of `sel` picks byte n & 7; with bit 3 set it replicates that
    byte's sign bit instead."""
    entry = np.concatenate([lo[:, None] >> (8 * np.arange(4, dtype=np.uint32)),
                            hi[:, None] >> (8 * np.arange(4, dtype=np.uint32))], axis=1) & 0xFF
    out = []
    for n in range(2):
        nib = (sel >> np.uint32(4 * n)) & np.uint32(0xF)
        byte = entry[np.arange(len(sel)), nib & 7]
        out.append(np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0x00), byte))
    return out


def test_pair_fields_decode_every_k2_window_at_every_position():
    """Exhaustive over the 2^18 (a, s, b) windows of each of a lane's 4 pairs, the rest of
    the 32-bit window random: entry offset and selector give the bytes of both states."""
    direct = tc.sqg_state_table(2).numpy().astype(np.uint32)
    table = tc.sqg_pair_table(2).numpy()
    words = table.view("<u4").astype(np.uint32)  # entry e: words 2e (bytes 0-3), 2e + 1
    rng = np.random.default_rng(5)
    win = np.arange(1 << 18, dtype=np.uint32)
    for p in range(4):
        shift = 14 - 4 * p  # pair p: view bits [4p, 4p + 18) = register bits 31-4p .. 14-4p
        keep = np.uint32(((1 << 18) - 1) << shift)
        noise = rng.integers(0, 1 << 32, size=win.size, dtype=np.uint64).astype(np.uint32)
        w = (noise & ~keep) | (win << np.uint32(shift))
        offsets, sels = pair_table_fields(w, np.uint32)
        off = offsets[p]
        assert np.all(off % 8 == 0) and np.all(off < PAIR_TABLE_BYTES)
        e = off // 8
        b0, b1 = _prmt(words[2 * e], words[2 * e + 1], sels[p])
        x0 = (w << np.uint32(4 * p)) >> np.uint32(16)  # view bits [4p, 4p + 16)
        x1 = (w << np.uint32(4 * p + 2)) >> np.uint32(16)
        assert np.array_equal(b0, direct[x0]), p
        assert np.array_equal(b1, direct[x1]), p


def test_pair_table_is_a_per_arch_choice():
    """sm_90a's wgmma GEMMs of a uniform K=2 sqg_e4m3 layer use the pair table with several
    workers per CTA (5 at M=32, on a 3-stage ring); every other layer, and sm_120 (mma.sync,
    101,376 B per block), keeps the direct table."""
    def spec(**kw):
        base = dict(num_experts=64, hidden=3584, intermediate=384, topk=16, bits=2,
                    codebook="sqg_e4m3", block_m=32, shared_hidden_vectors=True,
                    coupled=True, arch="sm_90a")
        base.update(kw)
        return MoESpec(**base)

    s = spec()
    assert s.pair_table() and s.table_layout() == "pair" and s.gemm_workers() == 5
    assert s.gemm_resident_ctas() == 1 and s.check() is None
    gemm = {sub.role: sub for sub in s.sub_kernels()}["gemm1"].build()
    assert gemm.pair_table and gemm.threads == 640 and gemm.smem_bytes > PAIR_TABLE_BYTES
    assert gemm.steps_in_flight == 1
    for m in (8, 16, 48, 64):
        assert spec(block_m=m).pair_table() and spec(block_m=m).check() is None
    for other in (spec(bits=3), spec(mma="sync"), spec(arch="sm_120a", block_m=32),
                  spec(codebook="mcg", bits=2, coupled=False, shared_hidden_vectors=False)):
        assert not other.pair_table()
    assert spec(bits=3).table_layout() == "direct"
    sm120 = spec(arch="sm_120a", block_m=32)
    assert sm120.mma == "sync" and sm120.check() is None


def test_pair_table_rejections():
    assert check_pair_table(2, (), "sqg_e4m3") is None
    assert "uniform" in check_pair_table(3, (), "sqg_e4m3")
    assert "uniform" in check_pair_table(4, (3, 4), "sqg_e4m3")
    assert "uniform" in check_pair_table(2, (), "mcg")
    assert table_bytes("sqg_e4m3", (), True) == PAIR_TABLE_BYTES
    args = dict(block_m=16, k_dim=128, n_dim=256, codebook="sqg_e4m3", stages=4)
    assert "pair table" in TrellisGemm.can_implement(bits=3, pair_table=True, **args)
    assert TrellisGemm.can_implement(bits=2, pair_table=True, **args) is None
    reason = TrellisWgmma.can_implement(bits=2, pair_table=True, workers=2,
                                        smem_limit=101_376, **args)
    assert "128 KiB sqg_e4m3 pair table" in reason


def test_workers_fill_the_shared_memory_the_tables_leave():
    """With one CTA per SM (the pair table, mixed rates), the wgmma GEMM runs as many
    one-warpgroup workers as fit in the 232,448 B sm_90a block beside the tables, less the
    1,024 B of static shared memory every DSL kernel carries, and as the register cap allows
    (`max_workers`: 4 up to 32 rows, 3 at 48, 2 at 64 and 96; the pair table 6 up to 16
    rows, then 5 / 4 / 3 / 3 at 32 / 48 / 64 / 96 rows with one k step's wgmma in flight).
    By hand: a worker holds its activation ring (stages x rows x 128 B) and its B ring
    (2,048 B a stage at K=2, 4,096 B at K<=4); the epilogue stores from registers. A plan
    drops to 3 stages where that adds a worker (the pair table down to 2). Pair table
    (131,072 B; 100,352 B left), 4 stages: 8 rows 4,096 + 8,192 = 12,288 B -> 6 (the cap);
    16 rows 16,384 B, x 6 = 98,304 -> 6; 32 rows takes 3 stages, 12,288 + 6,144 = 18,432 B,
    x 5 = 92,160 -> 5 (4 stages: 24,576 B -> 4); 48 rows takes 3 stages, 24,576 B -> 4 (4
    stages: 32,768 B -> 3); 64 rows takes 3 stages, 30,720 B -> 3 (4 stages: 40,960 B -> 2);
    48 x 2 (96 rows) takes 2 stages, 24,576 + 4,096 = 28,672 B -> 3 (3 stages: 43,008 B ->
    2; 4 stages: 57,344 B -> 1). Mixed rates go no lower than 3 stages. Rates {3, 4} (two 64
    KiB tables, 16,384 B of B ring at 4 stages, 12,288 B at 3; 4 workers at most up to 32
    rows): 8 rows 20,480 B -> 4; 16 rows 24,576 B -> 4; 32 rows takes 3 stages, 12,288 +
    12,288 = 24,576 B -> 4 (4 stages: 32,768 B -> 3); 48 rows takes 3 stages, 18,432 +
    12,288 = 30,720 B -> 3 (4 stages: 40,960 B -> 2); 64 rows 49,152 B -> 2 (3 stages:
    36,864 B, still 2); 48 x 2 takes 3 stages, 36,864 + 12,288 = 49,152 B -> 2 (4 stages:
    65,536 B -> 1). T12 stays at 2 (registers)."""
    def spec(**kw):
        base = dict(num_experts=64, hidden=3584, intermediate=384, topk=16, bits=2,
                    codebook="sqg_e4m3", block_m=8, span=1, shared_hidden_vectors=True,
                    coupled=True, arch="sm_90a")
        base.update(kw)
        return MoESpec(**base)

    pair = {m: (spec(block_m=m).stages, spec(block_m=m).gemm_workers())
            for m in (8, 16, 32, 48, 64)}
    assert pair == {8: (4, 6), 16: (4, 6), 32: (3, 5), 48: (3, 4), 64: (3, 3)}
    assert spec(block_m=32, stages=5).gemm_workers() == 3  # a pinned ring depth is kept
    assert spec(block_m=32, stages=6).gemm_workers() == 2
    assert spec(block_m=32).replace(stages=4).gemm_workers() == 4  # the worker the stage bought
    assert spec(block_m=8).replace(block_m=32).stages == 3  # replace resolves again
    assert spec(block_m=64, span=2).gemm_workers() == 1  # 128 rows: two warpgroups
    wide = spec(block_m=48, span=2)
    assert (wide.stages, wide.gemm_workers()) == (2, 3)
    assert wide.kernel_launches()["TrellisWgmma"] == (384, PAIR_TABLE_BYTES + 3 * 28_672)
    assert wide.replace(stages=3).gemm_workers() == 2  # the worker the second stage bought
    mixed = {m: spec(block_m=m, bits=4, bits_set=(3, 4), coupled=False)
             for m in (8, 16, 32, 48, 64)}
    assert {m: (s.stages, s.gemm_workers()) for m, s in mixed.items()} == {
        8: (4, 4), 16: (4, 4), 32: (3, 4), 48: (3, 3), 64: (4, 2)}
    assert mixed[32].replace(stages=4).gemm_workers() == 3  # the worker the stage bought
    assert mixed[48].replace(stages=4).gemm_workers() == 2
    mixed_wide = spec(block_m=48, span=2, bits=4, bits_set=(3, 4), coupled=False)
    assert (mixed_wide.stages, mixed_wide.gemm_workers()) == (3, 2)
    assert mixed_wide.kernel_launches()["TrellisWgmma"] == (256, 2 * 65_536 + 2 * 49_152)
    for m in (8, 32):
        s = spec(block_m=m, bits=4, bits_set=(3, 4), coupled=False, table_decode="t12")
        assert s.gemm_workers() == 2 and s.check() is None
    for m, (stages, w) in pair.items():
        threads, smem = spec(block_m=m).kernel_launches()["TrellisWgmma"]
        per_worker = stages * (m * 128 + 2_048)
        assert threads == 128 * w and smem == PAIR_TABLE_BYTES + w * per_worker <= 232_448 - 1_024
    assert spec(mma="sync").gemm_workers() == 1


def test_one_k_step_in_flight_only_where_it_buys_a_worker():
    """The k loop keeps two steps' wgmmas in flight, one only where the pair table's worker
    cap needs the registers that frees (`PAIR_ROWS_MAX_WORKERS`): measured slower where it
    adds no worker (docs/benchmarks.md)."""
    from kquant_cute.kernels.trellis_wgmma import max_workers, wgmma_steps_in_flight

    pair = {rows: (max_workers(rows, pair_table=True),
                   wgmma_steps_in_flight(rows, max_workers(rows, pair_table=True), True))
            for rows in (8, 16, 32, 48, 64, 96)}
    assert pair == {8: (6, 2), 16: (6, 2), 32: (5, 1), 48: (4, 1), 64: (3, 1), 96: (3, 1)}
    assert [wgmma_steps_in_flight(r, w, True)
            for r, w in ((32, 4), (48, 3), (64, 2), (96, 2))] == [2] * 4
    assert [max_workers(r) for r in (32, 48, 64, 96)] == [4, 3, 2, 2]  # mixed rates
    assert all(wgmma_steps_in_flight(r, max_workers(r)) == 2 for r in (8, 32, 48, 64, 96))
    assert wgmma_steps_in_flight(128, 1) == 2  # two warpgroups, one worker
    with pytest.raises(ValueError, match="at most 96 rows"):
        max_workers(128, pair_table=True)


def test_default_span_at_m32_follows_the_workers():
    """M=32's default span is 2 (an expert's 64 rows decoded once), except where 32-row
    work items fit more workers beside the tables than 64-row ones (above): the pair table's
    5 against 3, mixed rates' 4 (on 3-stage rings) against 2 (64 rows: the register cap's
    2); mma.sync has no spans."""
    base = dict(num_experts=64, hidden=3584, intermediate=384, topk=16, codebook="sqg_e4m3",
                block_m=32, shared_hidden_vectors=True, arch="sm_90a")
    assert MoESpec(bits=2, coupled=True, **base).span == 1
    mixed = MoESpec(bits=4, bits_set=(3, 4), **base)
    assert mixed.span == 1 and (mixed.stages, mixed.gemm_workers()) == (3, 4)
    assert mixed.replace(span=2).gemm_workers() == 2
    assert MoESpec(**dict(base, codebook="mcg"), bits=4).span == 2
    assert MoESpec(bits=3, **base).span == 2  # direct table: one worker either way
    assert MoESpec(bits=2, mma="sync", **base).span == 1
    assert MoESpec(bits=2, block_m=64, **{k: v for k, v in base.items() if k != "block_m"}).span == 1

"""CPU tests of kernels/trellis_gemm.py's host-side plan (no GPU needed).

* The compile-time state-extraction plan (`lane_window`, `state_windows`) is replayed on
  Python integers for every lane of random tiles and must reproduce every 16-bit state of
  the reference codec, for K = 2..6, zero-extended and (arithmetic codebooks) with byte-
  aligned states replicated in both halves: this is the part of the decode that differs
  per K. The replicated states' adjusted multipliers give every 32-bit product of the
  codec exactly, over all 65,536 states.
* The GEMM's occupancy target follows shared memory.
"""

from __future__ import annotations

import pytest
import torch

from kquant_cute import trellis as tc
from kquant_cute.kernels.moe import MoESpec
from kquant_cute.kernels import format as kfmt
from kquant_cute.kernels.decode import (REPLICATE, REPLICATE_CODEBOOKS, _plan_cost, lane_window,
                                        replicated, state_windows)
from kquant_cute.kernels.trellis_gemm import TrellisGemm, smem_bytes
from kquant_cute.kernels.trellis_wgmma import TrellisWgmma

MASK32 = 0xFFFFFFFF


def _funnel_hi(hi: int, lo: int, shift: int) -> int:
    return ((((hi << 32) | lo) << min(shift, 32)) >> 32) & MASK32


def _tile_words(codes: torch.Tensor) -> list[int]:
    """A tile's int16 [16K] as the format's little-endian uint32 words."""
    h = [int(v) & 0xFFFF for v in codes.tolist()]
    return [h[2 * m] | (h[2 * m + 1] << 16) for m in range(len(h) // 2)]


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode) on integers: byte i of the result is byte sel[i] of (b:a)."""
    both = a | (b << 32)
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _lane_states(words: list[int], lane: int, bits: int, replicate: bool = False) -> list[int]:
    """The GEMM's extraction of lane `lane`'s 8 states, replayed on integers (a replicated
    state is returned as the 32-bit register, s * 0x10001)."""
    tile_words, ring = 8 * bits, 256 * bits
    p0 = ((8 * lane + 1) * bits - 16) % ring
    static_q0, n_words = lane_window(bits)
    idx = [(p0 // 32 + i) % tile_words for i in range(n_words)]
    u = [words[i] for i in idx]
    if static_q0 is None:
        w_hi, w_lo = _funnel_hi(u[0], u[1], p0 % 32), _funnel_hi(u[1], u[2], p0 % 32)
    else:
        assert p0 % 32 == static_q0  # the same offset for every lane
        w_hi, w_lo = u

    def window(d):
        return {0: w_hi, 32: w_lo}.get(d, _funnel_hi(w_hi, w_lo, d))

    states = []
    for e in state_windows(bits, replicate):
        if len(e) == 3:
            states.append(_prmt(window(e[0]), window(e[1]), e[2]))
            continue
        d, r = e
        w = window(d)
        if r == 0:
            states.append(w >> 16)
        elif r == 8:
            states.append((w >> 8) & 0xFFFF)  # prmt selector 0x4421
        elif r == 16:
            states.append(w & 0xFFFF)
        else:
            states.append((w >> (16 - r)) & 0xFFFF)
    return states


@pytest.mark.parametrize("replicate", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_extraction_plan_reproduces_every_state(bits, replicate):
    codes = tc.random_trellis(32, 32, bits, torch.Generator().manual_seed(bits))
    flat = codes.reshape(-1, 16 * bits)
    want = tc.tile_states(flat)
    reps = [len(e) == 3 for e in state_windows(bits, replicate)]
    for tile in range(flat.shape[0]):
        words = _tile_words(flat[tile])
        got = [s for lane in range(32) for s in _lane_states(words, lane, bits, replicate)]
        exp = [s * REPLICATE if reps[i % 8] else s for i, s in enumerate(want[tile].tolist())]
        assert got == exp, f"K={bits} replicate={replicate} tile {tile}"


def test_replicated_multipliers_give_the_codec_products_for_every_state():
    s = torch.arange(1 << 16, dtype=torch.int64)
    for mul, add in ((kfmt.MCG_MUL, 0), (kfmt.INST3_MUL, kfmt.INST3_ADD), (kfmt.MUL1_MUL, 0)):
        want = (s * mul + add) & MASK32
        got = ((s * REPLICATE) * replicated(mul) + add) & MASK32
        assert torch.equal(got, want), hex(mul)
    # ... hence the same fp16 value as the reference codec, e.g. for mcg / 3inst:
    for cb, mul, add in (("mcg", kfmt.MCG_MUL, 0), ("3inst", kfmt.INST3_MUL, kfmt.INST3_ADD)):
        x = ((s * REPLICATE) * replicated(mul) + add) & MASK32
        assert torch.equal(tc._lop3_value(x), tc.state_to_value(s, cb, 4)), cb
    assert "sqg_e4m3" not in REPLICATE_CODEBOOKS  # the table is indexed by the state itself


def test_replicated_plans_cost_no_more_ops():
    """Ops per lane tile (extraction incl. funnel shifts): the replicated plan is never
    dearer; K=4 drops window 16 (the state at bit 24 of the view is the low byte of hi and
    the high byte of lo: one byte permute), 11 -> 10; K=3 / 5: a better first window."""
    cost = {b: (_plan_cost(state_windows(b)), _plan_cost(state_windows(b, True))) for b in range(2, 7)}
    assert all(rep <= plain for plain, rep in cost.values())
    assert cost[4] == (11, 10)
    assert cost[2] == (11, 11) and cost[3] == (16, 15) and cost[5] == (16, 15) and cost[6] == (15, 14)


def test_static_window_only_where_every_lane_shares_the_offset():
    # K=4: 8 states x 4 bits = one word per lane, so p0 mod 32 is lane-independent and
    # two words (not three) cover the 44 bits a lane needs.
    assert lane_window(4) == (20, 2)
    for bits in (2, 3, 5, 6):
        assert lane_window(bits) == (None, 3)
    # every planned window costs at most 3 extra funnel shifts
    for bits in range(2, 7):
        for rep in (False, True):
            plan = state_windows(bits, rep)
            windows = {d for e in plan for d in (e[:2] if len(e) == 3 else e[:1])}
            assert len(windows - {0, 32}) <= 3


def test_occupancy_target_follows_shared_memory():
    sm90 = 232448 + 1024
    assert [TrellisGemm.resident_ctas(sm90, block_m=m, bits=4, stages=4)
            for m in (8, 16, 32, 48, 64)] == [8, 8, 6, 5, 4]
    for m in (8, 32, 64):
        ctas = TrellisGemm.resident_ctas(sm90, block_m=m, bits=4, stages=4)
        assert ctas * (smem_bytes(m, 4, 4) + 1024) <= sm90
    spec = MoESpec(num_experts=8, hidden=256, intermediate=128, topk=2, bits=4, codebook="mcg",
                   block_m=32, arch="sm_120a")
    assert spec.gemm_ctas_per_sm() == 1  # default: no register target
    assert spec.replace(occupancy=0).gemm_ctas_per_sm() == 2  # 100 KB per SM
    assert spec.replace(occupancy=0, arch="sm_90a", mma="sync").gemm_ctas_per_sm() == 6
    # wgmma (the sm_90a default; span 2 at M=32): its own, larger shared memory per CTA.
    wg = spec.replace(occupancy=0, arch="sm_90a")
    assert wg.mma == "wgmma" and wg.gemm_ctas_per_sm() == sm90 // (
        TrellisWgmma.smem_bytes_for(block_m=32, bits=4, stages=4, span=2) + 1024)
    assert "occupancy" in spec.replace(occupancy=9).check()

"""CPU tests of the GEMM's decode plan and of the decode-only kernel (no GPU needed).

* The compile-time state-extraction plan (`lane_window`, `state_windows`) is replayed on
  Python integers for every lane of random tiles and must reproduce every 16-bit state of
  the reference codec, for K = 2..6: this is the part of the decode that differs per K.
* `reference_checksum` (the host model of the decode-only kernel's output) against a
  scalar loop.
* The decode-only kernel cross-compiles for sm_90a and sm_120a with no spills, and the
  GEMM's occupancy target follows shared memory.
"""

from __future__ import annotations

import pytest
import torch

from kquant_cute import trellis as tc
from kquant_cute.kernels.build import find_cuobjdump
from kquant_cute.kernels.decode_ceiling import TrellisDecode, reference_checksum
from kquant_cute.kernels.moe import MoESpec
from kquant_cute.kernels.trellis_gemm import (TrellisGemm, lane_window, smem_bytes,
                                              state_windows)

MASK32 = 0xFFFFFFFF


def _funnel_hi(hi: int, lo: int, shift: int) -> int:
    return ((((hi << 32) | lo) << min(shift, 32)) >> 32) & MASK32


def _tile_words(codes: torch.Tensor) -> list[int]:
    """A tile's int16 [16K] as the format's little-endian uint32 words."""
    h = [int(v) & 0xFFFF for v in codes.tolist()]
    return [h[2 * m] | (h[2 * m + 1] << 16) for m in range(len(h) // 2)]


def _lane_states(words: list[int], lane: int, bits: int) -> list[int]:
    """The GEMM's extraction of lane `lane`'s 8 states, replayed on integers."""
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
    states = []
    for d, r in state_windows(bits):
        w = {0: w_hi, 32: w_lo}.get(d)
        if w is None:
            w = _funnel_hi(w_hi, w_lo, d)
        if r == 0:
            states.append(w >> 16)
        elif r == 8:
            states.append((w >> 8) & 0xFFFF)  # prmt selector 0x4421
        elif r == 16:
            states.append(w & 0xFFFF)
        else:
            states.append((w >> (16 - r)) & 0xFFFF)
    return states


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_extraction_plan_reproduces_every_state(bits):
    codes = tc.random_trellis(32, 32, bits, torch.Generator().manual_seed(bits))
    flat = codes.reshape(-1, 16 * bits)
    want = tc.tile_states(flat)
    for tile in range(flat.shape[0]):
        words = _tile_words(flat[tile])
        got = [s for lane in range(32) for s in _lane_states(words, lane, bits)]
        assert got == want[tile].tolist(), f"K={bits} tile {tile}"


def test_static_window_only_where_every_lane_shares_the_offset():
    # K=4: 8 states x 4 bits = one word per lane, so p0 mod 32 is lane-independent and
    # two words (not three) cover the 44 bits a lane needs.
    assert lane_window(4) == (20, 2)
    for bits in (2, 3, 5, 6):
        assert lane_window(bits) == (None, 3)
    # every planned window costs at most 3 extra funnel shifts
    for bits in range(2, 7):
        assert len({d for d, _ in state_windows(bits)} - {0, 32}) <= 3


def test_reference_checksum_matches_a_scalar_loop():
    bits, codebook = 3, "mcg"
    k, n, experts = 32, 128, 3
    codes = torch.stack([tc.random_trellis(k, n, bits, torch.Generator().manual_seed(e))
                         for e in range(experts)])
    pick = torch.tensor([2, 0])
    got = reference_checksum(codes, pick, codebook)
    lut = tc.codebook_lut(codebook, bits).half()
    vals = lut[tc.tile_states(codes)]  # [E, k/16, n/16, 256]
    want = []
    for e in pick.tolist():
        for warp in range(4):
            for lane in range(32):
                word = 0
                for pair in range(4):
                    sums = []
                    for half in range(2):
                        s = torch.zeros((), dtype=torch.float16)
                        for kt in range(k // 16):
                            for jj in range(2):
                                v = vals[e, kt, 2 * warp + jj, 8 * lane + 2 * pair + half]
                                s = (s.double() + v.double()).half()
                        sums.append(int(s.view(torch.int16)) & 0xFFFF)
                    word ^= sums[0] | (sums[1] << 16)
                want.append(word)
    assert got.tolist() == want


def test_occupancy_target_follows_shared_memory():
    sm90 = 232448 + 1024
    assert [TrellisGemm.occupancy_target(m, 4, 4, sm90) for m in (8, 16, 32, 48, 64)] == [8, 8, 6, 5, 4]
    for m in (8, 32, 64):
        ctas = TrellisGemm.occupancy_target(m, 4, 4, sm90)
        assert ctas * (smem_bytes(m, 4, 4) + 1024) <= sm90
    spec = MoESpec(num_experts=8, hidden=256, intermediate=128, topk=2, bits=4, codebook="mcg",
                   block_m=32, arch="sm_120a")
    assert spec.gemm_ctas_per_sm() == 1  # default: no register target
    assert spec.replace(occupancy=0).gemm_ctas_per_sm() == 2  # 100 KB per SM
    assert spec.replace(occupancy=0, arch="sm_90a").gemm_ctas_per_sm() == 6
    assert "occupancy" in spec.replace(occupancy=9).check()


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_decode_kernel_compiles_without_spills(arch):
    from kquant_cute.kernels.build import compile_decode

    _, res = compile_decode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", arch=arch,
                            min_ctas_per_sm=8)
    (decode,) = [r for r in res if r.kernel == "TrellisDecode"]
    assert decode.stack == 0 and decode.local == 0
    assert 0 < decode.registers <= 64  # 8 CTAs of 128 threads per SM
    assert decode.shared >= TrellisDecode.smem(4, 4)


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("decode", [True, False])
def test_overlap_probe_variants_keep_their_mmas(decode, tmp_path):
    """The overlap probe's decode + MMA and MMA-only variants really issue the GEMM's
    mma.sync count (4 k steps x 2 tiles x 2 m tiles x 2 n8 halves per stage at 32 rows):
    dead MMAs would make the probe measure the decode alone."""
    import subprocess

    from kquant_cute.kernels.build import compile_decode

    _, res = compile_decode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", arch="sm_90a",
                            mma_rows=32, decode=decode, cubin_dir=str(tmp_path))
    (probe,) = [r for r in res if r.kernel == "TrellisDecode"]
    assert probe.local == 0
    (cubin,) = tmp_path.glob("*.cubin")
    sass = subprocess.run([find_cuobjdump(), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    assert sass.count("HMMA.16816.F32") >= 32
    with pytest.raises(ValueError, match="multiple of 16"):
        TrellisDecode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", mma_rows=24)

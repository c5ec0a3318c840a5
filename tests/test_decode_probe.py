"""Tests of the decode-only probe of the benchmarks (benchmarks/decode_probe.py).

* `reference_checksum` (the host model of the probe's output) against a scalar loop.
* The probe cross-compiles for sm_90a and sm_120a with no spills, and its decode + MMA /
  MMA-only variants really issue the GEMM's MMAs (SASS; needs nvdisasm from `[test]`).
* On a GPU, its per-thread checksums equal the host model bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kquant_cute import trellis as tc
from kquant_cute.kernels.build import dump_sass
from kernel_compile_helpers import needs_cuobjdump, needs_sass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from decode_probe import TrellisDecode, compile_decode, reference_checksum  # noqa: E402


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


@needs_cuobjdump
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("operands", [1, 2])
def test_decode_kernel_compiles_without_spills(arch, operands):
    _, res = compile_decode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", arch=arch,
                            min_ctas_per_sm=8, operands=operands)
    (decode,) = [r for r in res if r.kernel == "TrellisDecode"]
    assert decode.stack == 0 and decode.local == 0
    assert 0 < decode.registers <= 64  # 8 CTAs of 128 threads per SM
    assert decode.shared >= TrellisDecode.smem(4, 4)


@needs_sass
@pytest.mark.parametrize("decode", [True, False])
def test_overlap_probe_variants_keep_their_mmas(decode, tmp_path):
    """The overlap probe's decode + MMA and MMA-only variants really issue the GEMM's
    mma.sync count (4 k steps x 2 tiles x 2 m tiles x 2 n8 halves per stage at 32 rows):
    dead MMAs would make the probe measure the decode alone."""
    _, res = compile_decode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", arch="sm_90a",
                            mma_rows=32, decode=decode, cubin_dir=str(tmp_path))
    (probe,) = [r for r in res if r.kernel == "TrellisDecode"]
    assert probe.local == 0
    (cubin,) = tmp_path.glob("*.cubin")
    sass = dump_sass(str(cubin))
    assert sass.count("HMMA.16816.F32") >= 32
    with pytest.raises(ValueError, match="multiple of 16"):
        TrellisDecode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", mma_rows=24)


def test_decode_kernel_takes_one_or_two_operands():
    """`operands` is how many projections one launch decodes (1, or FC1's 2); other counts
    are refused before any compile."""
    assert TrellisDecode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", operands=2).operands == 2
    for bad in (0, 3):
        with pytest.raises(ValueError, match="operands"):
            TrellisDecode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", operands=bad)


def _table(codebook, bits):
    """The state table the kernels read (sqg_e4m3), else a placeholder they never read."""
    if codebook == "sqg_e4m3":
        return tc.sqg_state_table(bits, "cuda")
    return torch.zeros(16, dtype=torch.uint8, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("codebook,bits,pair,operands", [
    ("mcg", 4, False, 1), ("mcg", 3, False, 1), ("mul1", 2, False, 1), ("3inst", 6, False, 1),
    ("sqg_e4m3", 2, False, 1), ("sqg_e4m3", 3, False, 1), ("sqg_e4m3", 2, True, 1),
    ("mcg", 4, False, 2), ("sqg_e4m3", 2, True, 2)])
def test_decode_only_kernel_checksum(codebook, bits, pair, operands):
    """The decode-only ceiling kernel decodes every weight of the listed experts: its
    per-thread checksum equals the host model bit for bit (poisoned output first); `pair`:
    through the K=2 pair table with four workers per CTA (one CTA: workers 0 and 1 take
    two items each); `operands` 2: two projections in one launch, their items interleaved
    (each its own codes, so a swapped operand changes the words)."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    from kquant_cute import trellis
    k_dim, n_dim, n_exp = 384, 256, 5
    g = torch.Generator().manual_seed(bits)
    codes = [torch.stack([trellis.random_trellis(k_dim, n_dim, bits, generator=g)
                          for _ in range(n_exp)]).cuda() for _ in range(operands)]
    experts = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    n_tiles = n_dim // 128
    out = torch.full((3 * n_tiles * operands * 128,), -1, dtype=torch.int32, device="cuda")
    fn, _ = compile_decode(k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                           arch="sm_%d%da" % torch.cuda.get_device_capability(), pair_table=pair,
                           operands=operands)
    table = tc.sqg_pair_table(bits, "cuda") if pair else _table(codebook, bits)

    def P(t, dt):
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    fn(P(codes[0], cutlass.Int16), P(codes[-1], cutlass.Int16), P(experts, cutlass.Int32),
       P(out, cutlass.Uint32), P(table, cutlass.Uint8), cutlass.Int32(3), cutlass.Int32(1),
       cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    # Item (expert x N tile) * operands + operand: the operands' words interleave by item.
    want = torch.stack([reference_checksum(c.cpu(), experts.cpu(), codebook).reshape(-1, 128)
                        for c in codes], dim=1).reshape(-1)
    assert torch.equal(out.cpu().to(torch.int64) & 0xFFFFFFFF, want)

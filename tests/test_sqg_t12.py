"""The T12 + bijection decode of sqg_e4m3 (kernels/sqg_t12.py), proved on the CPU.

`run_program` executes the very instruction list the kernels emit as PTX (`ptx_lines`
renders the same `Op`s), so decoding all 65,536 states through it and comparing with the
reference codec proves the instruction sequence bit-exact for every K. The GPU half
(the same program through the GEMM) is tests/test_gpu_moe.py.
"""

import re

import numpy as np
import pytest

from kquant_cute import trellis
from kquant_cute.kernels import sqg_t12

STATES = np.arange(1 << 16, dtype=np.uint64)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_program_is_bit_exact_on_every_state(bits):
    idx = sqg_t12.run_program(sqg_t12.t12_program(bits), STATES)
    assert idx.dtype == np.uint64
    assert int(idx.max()) < sqg_t12.T12_TABLE_BYTES  # nothing above the 12-bit index
    t12 = trellis.t12_table().numpy()
    got = t12[idx.astype(np.int64)]
    want = trellis.sqg_state_table(bits).numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"K={bits}: {bad.size} states differ, first {bad[:8].tolist()}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_program_index_is_rank_over_16(bits):
    """Stronger than the byte check (T12 repeats bytes): the index is rank(x) >> 4 itself,
    with rank written out from the law independently of the program."""
    x = STATES.astype(np.int64)
    w = 16 - bits
    mask = (1 << w) - 1
    h, b = x >> bits, x & ((1 << bits) - 1)
    m = h ^ (h >> 11)
    m ^= (m << 11) & mask
    p = (m * 0x3FA7D929 + 0xC928FD8E) & 0xFFFFFFFF
    rev = sum(((b >> k) & 1) << (bits - 1 - k) for k in range(bits))
    rank = ((rev ^ (p >> (32 - bits))) << w) | (p & mask)
    idx = sqg_t12.run_program(sqg_t12.t12_program(bits), STATES).astype(np.int64)
    np.testing.assert_array_equal(idx, rank >> 4)


def test_known_states():
    """The law's check values: state 0 -> 0x46 (K=2), 0x3D (K=3), 0x3A (K=4); the
    Python-int path of the mirror agrees with the array path."""
    t12 = trellis.t12_table().numpy()
    for bits, byte in ((2, 0x46), (3, 0x3D), (4, 0x3A)):
        prog = sqg_t12.t12_program(bits)
        assert t12[sqg_t12.run_program(prog, 0)] == byte
        sample = [1, 0x1234, 0x8000, 0xFFFF]
        arr = sqg_t12.run_program(prog, np.array(sample, dtype=np.uint64))
        assert [sqg_t12.run_program(prog, s) for s in sample] == arr.tolist()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_ptx_is_the_program(bits):
    """The PTX the kernels inline is the program, op for op, constants included: 11 integer
    instructions per state (2 of them multiply-adds), nothing else."""
    prog = sqg_t12.t12_program(bits)
    lines = sqg_t12.ptx_lines(prog, "_a", "%st")
    assert len(lines) == len(prog) == 11
    mnemonics = [line.split()[0] for line in lines]
    assert mnemonics.count("mad.lo.u32") == 2
    for op, line in zip(prog, lines):
        consts = [int(t, 16) for t in re.findall(r"0x[0-9a-f]+", line)]
        assert consts == [s for s in op.srcs if isinstance(s, int)], line
        assert line.startswith(f"{sqg_t12._PTX[op.op]} {op.dst}_a, ")
    assert all("%st" in line for line, op in zip(lines, prog) if "x" in op.srcs)


def test_lop3_truth_table_convention():
    """LOP3's immediate is F(0xF0, 0xCC, 0xAA) (PTX ISA); the mirror evaluates it by
    minterms, so a table built from a function must give that function back."""
    a, b, c = 0x12345678, 0x0F0F0F0F, 0xFFFF0000
    for lut in (0xF0, 0xCC, 0xAA, 0x96, sqg_t12.LUT_SELECT):
        prog = (sqg_t12.Op("lop3", "idx", ("x", b, c, lut)),)
        fn = {0xF0: a, 0xCC: b, 0xAA: c, 0x96: a ^ b ^ c,
              sqg_t12.LUT_SELECT: (b & c) | (a & ~c & 0xFFFFFFFF)}[lut]
        assert sqg_t12.run_program(prog, a) == fn


def test_bits_outside_range_rejected():
    with pytest.raises(ValueError, match="bits 5 outside 2..4"):
        sqg_t12.t12_program(5)


@pytest.mark.parametrize("rates", [(2,), (4,), (3, 4), (2, 3, 4)])
def test_kernel_tables_hold_each_direct_table_then_t12_where_the_gemms_stage_them(rates):
    """The table argument of direct / T12 layers: every K's direct table from offset 0 (what
    a direct GEMM stages), then T12 at `decode.table_offset(..., "t12")` (what a T12 GEMM
    stages, 4 KiB)."""
    from kquant_cute.kernels import decode

    table = trellis.sqg_kernel_tables(rates).numpy()
    bits_set = rates if len(rates) > 1 else ()
    off = decode.table_offset("sqg_e4m3", bits_set, "t12")
    assert decode.table_offset("sqg_e4m3", bits_set, "direct") == 0
    assert decode.table_bytes("sqg_e4m3", bits_set) == off == 65536 * len(rates)
    assert decode.table_bytes("sqg_e4m3", bits_set, table_decode="t12") == 4096
    assert table.shape == (off + 4096,)
    np.testing.assert_array_equal(table[off:], trellis.t12_table().numpy())
    for i, k in enumerate(rates):
        np.testing.assert_array_equal(table[65536 * i: 65536 * (i + 1)],
                                      trellis.sqg_state_table(k).numpy())
    with pytest.raises(ValueError, match="at least one K"):
        trellis.sqg_kernel_tables(())


# -- the arithmetic T12 (pair-table decode's computed share) --------------------------------

def _brev32(w):
    out = np.zeros_like(w)
    for i in range(32):
        out |= ((w >> np.uint32(i)) & np.uint32(1)) << np.uint32(31 - i)
    return out


@pytest.mark.parametrize("o", range(0, 17))
def test_window_index_is_the_program_on_every_state(o):
    """`window_t12_index` reads the K=2 state in place at bit offset `o` of a 32-bit window;
    with every 16-bit state there and random bits around it, its index is `t12_program(2)`'s
    (which the tests above prove against the codec)."""
    rng = np.random.default_rng(o)
    x = np.arange(1 << 16, dtype=np.uint32)
    around = rng.integers(0, 1 << 32, x.size, dtype=np.uint64).astype(np.uint32)
    keep = np.uint32(((1 << 16) - 1) << o)
    w = (around & ~keep) | (x << np.uint32(o))
    got = sqg_t12.window_t12_index(w, o, _brev32(w), np.uint32)
    assert got.dtype == np.uint32
    want = sqg_t12.run_program(sqg_t12.t12_program(2), x.astype(np.uint64))
    bad = np.flatnonzero(got.astype(np.uint64) != want)
    assert bad.size == 0, f"offset {o}: {bad.size} states differ, first {bad[:8].tolist()}"


def test_window_index_rejects_offsets_outside_the_window():
    with pytest.raises(ValueError, match="offset 17"):
        sqg_t12.window_t12_index(np.zeros(1, np.uint32), 17, np.zeros(1, np.uint32), np.uint32)


def test_arithmetic_t12_model_gives_every_byte():
    """The fp32 model of the computed T12 (`t12_poly_model`, the instructions of
    `ptx.e4m3_poly_pair` with a correctly rounded log2) gives T12's byte for all 4,096
    indices, and still does with log2 off by 4 x 2^-22 either way (lg2.approx's error is
    below that); tests/test_gpu_moe.py runs the instructions themselves."""
    q = np.arange(sqg_t12.T12_TABLE_BYTES)
    t12 = trellis.t12_table().numpy()
    got = sqg_t12.t12_poly_model(q)
    assert np.array_equal(got, t12), np.flatnonzero(got != t12)[:8]
    for off in (-4 * 2.0**-22, 4 * 2.0**-22):
        assert np.array_equal(sqg_t12.t12_poly_model(q, lg2_offset=off), t12)


def test_e4m3_rounding_model_matches_torch():
    """`e4m3fn_bytes` (the model's rounding) is torch's float8_e4m3fn rounding, -0 read as +0."""
    import torch

    v = np.concatenate([np.linspace(-6, 6, 20001), [0.0, -1e-9, 2.0**-10, 3 * 2.0**-10]])
    want = torch.tensor(v, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    want = np.where(want == 0x80, 0, want)
    assert np.array_equal(sqg_t12.e4m3fn_bytes(v.astype(np.float32)), want)

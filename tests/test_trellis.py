"""Tests for kquant_cute.trellis: every check value of docs/formats.md, plus an independent decoder.

The independent reference below is written from docs/formats.md's wording with plain Python
ints and numpy scalars (no kquant_cute internals): stream bits from little-endian uint32
words, 16-bit states on the tail-biting ring, the four codebooks, and the lane-fragment
tile positions.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import statistics

import numpy as np
import pytest
import torch

from kquant_cute import trellis as tc

# --------------------------------------------------------------------------------------
# Independent reference implementation (plain Python / numpy, scalar per weight)
# --------------------------------------------------------------------------------------


def ref_fp16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def ref_fp16_bits(value: float) -> int:
    # numpy's double -> half conversion rounds to nearest even.
    return int(np.array([value], dtype=np.float64).astype(np.float16).view(np.uint16)[0])


def ref_lop3(x: int) -> int:
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return ref_fp16_bits(ref_fp16(x & 0xFFFF) + ref_fp16(x >> 16))  # exact in double


def ref_3inst(state: int) -> int:
    return ref_lop3((state * 89226354 + 64248484) % 2**32)


def ref_mcg(state: int) -> int:
    return ref_lop3((state * 0xCBAC1FED) % 2**32)


def ref_mul1(state: int) -> int:
    x = (state * 0x83DCD12D) % 2**32
    s = sum((x >> (8 * i)) & 0xFF for i in range(4))
    h = ref_fp16(0x6400 + s)
    return ref_fp16_bits(h * ref_fp16(0x1EEE) + ref_fp16(0xC931))  # one rounding


def ref_e4m3_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8.0 * 2.0**-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


_E4M3_POS = [(ref_e4m3_value(b), b) for b in range(0x7F)]  # finite non-negative codes
_E4M3_VALUES = [v for v, _ in _E4M3_POS]


def ref_e4m3_rne(value: float) -> int:
    """Round to the nearest E4M3FN code, ties to even mantissa (no saturation needed)."""
    mag = abs(value)
    i = bisect.bisect_left(_E4M3_VALUES, mag)
    if i == 0:
        code = 0
    elif i == len(_E4M3_VALUES):
        code = 0x7E
    else:
        lo_v, lo_c = _E4M3_POS[i - 1]
        hi_v, hi_c = _E4M3_POS[i]
        if mag - lo_v < hi_v - mag:
            code = lo_c
        elif mag - lo_v > hi_v - mag:
            code = hi_c
        else:
            code = lo_c if lo_c % 2 == 0 else hi_c
    if value < 0 and code != 0:
        code |= 0x80
    return code  # -0 -> 0x00


_REF_T12: list[int] = []


def ref_t12() -> list[int]:
    if not _REF_T12:
        nd = statistics.NormalDist()
        y = [ref_e4m3_rne(1.5 * nd.inv_cdf((r + 0.5) / 65536)) for r in range(65536)]
        for q in range(4096):
            group = y[16 * q : 16 * q + 16]
            counts = {b: group.count(b) for b in set(group)}
            best = max(counts.values())
            _REF_T12.append(min(b for b, c in counts.items() if c == best))
    return _REF_T12


def ref_sqg(state: int, k: int) -> float:
    w = 16 - k
    m_mask = (1 << w) - 1
    h, b = state >> k, state & ((1 << k) - 1)
    m = h ^ (h >> 11)
    m ^= (m << 11) & m_mask
    p = (0x3FA7D929 * m + 0xC928FD8E) % 2**32
    phase = p & m_mask
    rev = int(format(b, f"0{k}b")[::-1], 2)
    j = rev ^ (p >> (32 - k))
    rank = (j << w) | phase
    return ref_e4m3_value(ref_t12()[rank >> 4])


def ref_value(state: int, codebook: str, k: int) -> float:
    if codebook == "3inst":
        return ref_fp16(ref_3inst(state))
    if codebook == "mcg":
        return ref_fp16(ref_mcg(state))
    if codebook == "mul1":
        return ref_fp16(ref_mul1(state))
    return ref_sqg(state, k)


def ref_stream_bit(tile16: list[int], n: int) -> int:
    """Bit n of the tile stream: bit (31 - n mod 32) of little-endian uint32 word n div 32."""
    m = n // 32
    word = (tile16[2 * m] & 0xFFFF) | ((tile16[2 * m + 1] & 0xFFFF) << 16)
    return (word >> (31 - n % 32)) & 1


def ref_state(tile16: list[int], t: int, k: int) -> int:
    ring = 256 * k
    x = 0
    for n in range((t + 1) * k - 16, (t + 1) * k):
        x = (x << 1) | ref_stream_bit(tile16, n % ring)
    return x


def ref_position(t: int) -> tuple[int, int]:
    lane, i = t >> 3, t & 7
    return 2 * (lane % 4) + (i & 1) + 8 * ((i >> 1) & 1), (lane >> 2) + 8 * (i >> 2)


def ref_decode(trellis: np.ndarray, codebook: str) -> np.ndarray:
    n_i, n_j, words = trellis.shape
    k = words // 16
    out = np.zeros((16 * n_i, 16 * n_j), dtype=np.float64)
    for i in range(n_i):
        for j in range(n_j):
            tile = [int(v) for v in trellis[i, j]]
            for t in range(256):
                r, c = ref_position(t)
                out[16 * i + r, 16 * j + c] = ref_value(ref_state(tile, t, k), codebook, k)
    return out


def ref_lut_numpy(codebook: str) -> np.ndarray:
    """Whole-table reference for 3inst/mcg/mul1 with numpy uint64 arithmetic."""
    x = np.arange(65536, dtype=np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    if codebook == "mul1":
        x = (x * np.uint64(0x83DCD12D)) & mask32
        s = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
        h = (np.uint64(0x6400) + s).astype(np.uint16).view(np.float16).astype(np.float64)
        v = h * ref_fp16(0x1EEE) + ref_fp16(0xC931)
        return v.astype(np.float16).astype(np.float64)
    if codebook == "3inst":
        x = (x * np.uint64(89226354) + np.uint64(64248484)) & mask32
    else:
        x = (x * np.uint64(0xCBAC1FED)) & mask32
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    return (lo + hi).astype(np.float16).astype(np.float64)


def all_codebook_bits():
    for cb in tc.CODEBOOKS:
        lo, hi = tc.BITS_RANGE[cb]
        for k in range(lo, hi + 1):
            yield cb, k


def fp16_bits(values: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFF for v in values.half().view(torch.int16)]


# --------------------------------------------------------------------------------------
# Constants and the check values of docs/formats.md
# --------------------------------------------------------------------------------------


def test_constants():
    assert tc.TILE == 16 and tc.HADAMARD_BLOCK == 128
    assert tc.CODEBOOKS == ("3inst", "mcg", "mul1", "sqg_e4m3")
    assert tc.BITS_RANGE == {"3inst": (2, 6), "mcg": (2, 6), "mul1": (2, 6),
                             "sqg_e4m3": (2, 4)}
    assert (tc.INST3_MUL, tc.INST3_ADD) == (89226354, 64248484)
    assert (tc.MCG_MUL, tc.MUL1_MUL) == (0xCBAC1FED, 0x83DCD12D)
    assert (tc.LOP3_MASK, tc.LOP3_XOR) == (0x8FFF8FFF, 0x3B603B60)
    assert (tc.MUL1_KINV_BITS, tc.MUL1_KBIAS_BITS) == (0x1EEE, 0xC931)
    assert (tc.SQG_MUL, tc.SQG_ADD) == (0x3FA7D929, 0xC928FD8E)
    assert tc.T12_SHA256 == "cca11fe5744c9c93a34f4217f342fbc0f74ecc8a007c076582424a505fc9da5e"


SELF_CHECK = {  # state -> (3INST, MCG, MUL1) fp16 bits, docs/formats.md "EXL3 codebooks"
    0x0000: (0x3A25, 0x3F60, 0xC2E8),
    0x0001: (0xBB5B, 0x304E, 0x3921),
    0x1234: (0xC066, 0x3E0F, 0xB89E),
    0xFFFF: (0xB110, 0x3ACD, 0xB936),
}


@pytest.mark.parametrize("col,codebook", [(0, "3inst"), (1, "mcg"), (2, "mul1")])
@pytest.mark.parametrize("bits", [2, 4, 6])
def test_codebook_self_check(col, codebook, bits):
    states = torch.tensor(list(SELF_CHECK))
    want = [v[col] for v in SELF_CHECK.values()]
    assert fp16_bits(tc.state_to_value(states, codebook, bits)) == want
    assert fp16_bits(tc.codebook_lut(codebook, bits)[states]) == want
    as_int16 = states.to(torch.int32).where(states < 0x8000, states - 0x10000).to(torch.int16)
    assert fp16_bits(tc.state_to_value(as_int16, codebook, bits)) == want
    ref = {"3inst": ref_3inst, "mcg": ref_mcg, "mul1": ref_mul1}[codebook]
    assert [ref(int(s)) for s in states] == want  # the reference agrees with the docs


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_lut_matches_numpy_reference_for_all_states(codebook):
    lut = tc.codebook_lut(codebook, 3).double().numpy()
    np.testing.assert_array_equal(lut, ref_lut_numpy(codebook))


def test_mul1_single_rounding_is_what_the_checks_need():
    # fp16(fp16(h * k_inv) + k_bias) (two roundings) would give 3920 at state 1, not 3921.
    x = (1 * 0x83DCD12D) % 2**32
    h = ref_fp16(0x6400 + sum((x >> (8 * i)) & 0xFF for i in range(4)))
    twice = ref_fp16_bits(float(np.float16(h * ref_fp16(0x1EEE))) + ref_fp16(0xC931))
    assert twice != 0x3921
    assert fp16_bits(tc.state_to_value(torch.tensor([1]), "mul1", 4)) == [0x3921]


def test_tile_check_k3():
    symbols = torch.arange(256) % 8
    tile = tc.pack(symbols, 3)
    assert tile.dtype == torch.int16 and tile.shape == (48,)
    assert [int(v) & 0xFFFF for v in tile[:6]] == [0x7705, 0x0539, 0x0539, 0x3977, 0x3977,
                                                   0x7705]
    assert [int(v) for v in tc.tile_states(tile)[:4]] == [0xCBB8, 0x5DC1, 0xEE0A, 0x7053]
    ref = [int(v) for v in tile]
    assert [ref_state(ref, t, 3) for t in range(4)] == [0xCBB8, 0x5DC1, 0xEE0A, 0x7053]
    assert torch.equal(tc.unpack(tile), symbols)


def test_t12_table():
    t12 = tc.t12_table()
    assert t12.dtype == torch.uint8 and t12.shape == (4096,)
    assert hashlib.sha256(t12.numpy().tobytes()).hexdigest() == tc.T12_SHA256
    assert t12[:4].tolist() == [0xCB, 0xCA, 0xCA, 0xC9]
    assert t12[2048:2052].tolist() == [0x00, 0x01, 0x01, 0x02]
    assert int(t12[4095]) == 0x4B
    assert tc.t12_table() is t12  # cached


def test_t12_independent_generation():
    ref = ref_t12()
    assert hashlib.sha256(bytes(ref)).hexdigest() == tc.T12_SHA256
    assert tc.t12_table().tolist() == ref


@pytest.mark.parametrize("bits,byte", [(2, 0x46), (3, 0x3D), (4, 0x3A)])
def test_sqg_state_zero(bits, byte):
    value = tc.state_to_value(torch.tensor([0]), "sqg_e4m3", bits)
    assert int(value.to(torch.float8_e4m3fn).view(torch.uint8)) == byte
    assert float(value) == ref_e4m3_value(byte) == ref_sqg(0, bits)
    assert float(value) == {2: 3.5, 3: 1.625, 4: 1.25}[bits]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sqg_lut_matches_reference_on_sampled_states(bits):
    lut = tc.codebook_lut("sqg_e4m3", bits)
    states = list(range(0, 65536, 97)) + [65535]
    assert [float(lut[s]) for s in states] == [ref_sqg(s, bits) for s in states]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sqg_state_table_is_the_byte_of_every_state(bits):
    """The kernels' direct table: byte x = E4M3FN of state x (the docs' check at state 0, the
    independent reference on sampled states, the LUT everywhere)."""
    table = tc.sqg_state_table(bits)
    assert table.dtype == torch.uint8 and table.shape == (65536,)
    assert int(table[0]) == {2: 0x46, 3: 0x3D, 4: 0x3A}[bits]
    states = list(range(0, 65536, 89)) + [65535]
    assert [ref_e4m3_value(int(table[s])) for s in states] == [ref_sqg(s, bits) for s in states]
    assert torch.equal(table.view(torch.float8_e4m3fn).float(), tc.codebook_lut("sqg_e4m3", bits))
    with pytest.raises(ValueError, match="2..4"):
        tc.sqg_state_table(5)


# --------------------------------------------------------------------------------------
# Tile layout and bitstream
# --------------------------------------------------------------------------------------


def test_position_map():
    rows, cols = tc.tile_position_map()
    assert rows.dtype == torch.int64 and rows.shape == (256,) and cols.shape == (256,)
    checks = {0: (0, 0), 1: (1, 0), 2: (8, 0), 4: (0, 8), 8: (2, 0), 32: (0, 1),
              255: (15, 15)}
    for t, rc in checks.items():
        assert (int(rows[t]), int(cols[t])) == rc
    assert len({(int(r), int(c)) for r, c in zip(rows, cols)}) == 256  # bijection
    assert [(int(r), int(c)) for r, c in zip(rows, cols)] == [ref_position(t)
                                                              for t in range(256)]
    inv = tc.tile_inverse_position_map()
    assert torch.equal(inv[rows * 16 + cols], torch.arange(256))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_pack_unpack_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    symbols = torch.randint(0, 1 << bits, (3, 2, 256), generator=gen)
    packed = tc.pack(symbols, bits)
    assert packed.dtype == torch.int16 and packed.shape == (3, 2, 16 * bits)
    assert torch.equal(tc.unpack(packed), symbols)
    codes = tc.random_trellis(16, 32, bits, gen)
    assert torch.equal(tc.pack(tc.unpack(codes), bits), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_states_and_symbols_match_reference(bits):
    codes = tc.random_trellis(16, 16, bits, torch.Generator().manual_seed(10 + bits))[0, 0]
    ref = [int(v) for v in codes]
    states = tc.tile_states(codes).tolist()
    assert states == [ref_state(ref, t, bits) for t in range(256)]
    symbols = tc.unpack(codes).tolist()
    for t in (0, 1, 5, 100, 255):  # symbol t = stream bits [tK, (t+1)K)
        want = 0
        for n in range(t * bits, (t + 1) * bits):
            want = (want << 1) | ref_stream_bit(ref, n)
        assert symbols[t] == want


@pytest.mark.parametrize("codebook,bits", list(all_codebook_bits()))
def test_decode_matches_independent_reference(codebook, bits):
    gen = torch.Generator().manual_seed(1000 + 10 * tc.CODEBOOKS.index(codebook) + bits)
    codes = tc.random_trellis(32, 16, bits, gen)  # 2 x 1 tiles: placement across tiles
    got = tc.decode(codes, codebook)
    assert got.dtype == torch.float32 and got.shape == (32, 16)
    np.testing.assert_array_equal(got.double().numpy(), ref_decode(codes.numpy(), codebook))


def test_decode_batched_matches_per_tile():
    codes = tc.random_trellis(64, 48, 4, torch.Generator().manual_seed(3))
    full = tc.decode(codes, "mcg")
    tile = tc.decode(codes[2:3, 1:2], "mcg")
    assert torch.equal(full[32:48, 16:32], tile)


def test_random_trellis_seeded():
    a = tc.random_trellis(128, 256, 3, torch.Generator().manual_seed(7))
    b = tc.random_trellis(128, 256, 3, torch.Generator().manual_seed(7))
    assert a.dtype == torch.int16 and a.shape == (8, 16, 48)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Rotations, dense weight, forward
# --------------------------------------------------------------------------------------


def test_hadamard_orthonormal():
    h = tc.hadamard_128(torch.float64)
    assert h.shape == (128, 128)
    torch.testing.assert_close(h @ h.T, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, h.T)
    for i, j in [(0, 0), (1, 1), (3, 5), (127, 127), (64, 65)]:
        assert float(h[i, j]) == (-1) ** bin(i & j).count("1") / math.sqrt(128)


def test_rotate_blocks_is_block_diagonal_product():
    x = torch.randn(3, 256, 5, dtype=torch.float64)
    h = tc.hadamard_128(torch.float64)
    blk = torch.block_diag(h, h)
    torch.testing.assert_close(tc.rotate_blocks(x, dim=1),
                               torch.einsum("aic,ij->ajc", x, blk))
    torch.testing.assert_close(tc.rotate_blocks(tc.rotate_blocks(x, 1), 1), x)


def _layer(bits: int, codebook: str, n_in: int = 256, n_out: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = tc.random_trellis(n_in, n_out, bits, gen)
    suh = (torch.randn(n_in, generator=gen)).half()
    svh = (torch.randn(n_out, generator=gen) * 0.05).half()
    return codes, suh, svh


@pytest.mark.parametrize("codebook,bits", [("mcg", 4), ("3inst", 2), ("mul1", 6),
                                           ("sqg_e4m3", 3)])
def test_dense_weight_matches_four_step_forward(codebook, bits):
    codes, suh, svh = _layer(bits, codebook)
    bias = torch.randn(128).half()
    w = tc.dense_weight(codes, suh, svh, codebook, dtype=torch.float64)
    assert w.dtype == torch.float64 and w.shape == (256, 128)
    x = torch.randn(7, 256, dtype=torch.float64)
    y = tc.linear_forward(x, codes, suh, svh, codebook, bias=bias)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ w + bias.double(), rtol=1e-10, atol=1e-10)
    # explicit formula with full matrices
    h = tc.hadamard_128(torch.float64)
    hb_in, hb_out = torch.block_diag(h, h), h
    explicit = (torch.diag(suh.double()) @ hb_in @ tc.decode(codes, codebook).double()
                @ hb_out @ torch.diag(svh.double()))
    torch.testing.assert_close(w, explicit, rtol=1e-10, atol=1e-12)
    w32 = tc.dense_weight(codes, suh, svh, codebook)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32.double(), w, rtol=1e-4, atol=1e-5)
    y32 = tc.linear_forward(x.float(), codes, suh, svh, codebook)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_decode_cuda_matches_cpu():
    for codebook, bits in all_codebook_bits():
        codes = tc.random_trellis(128, 256, bits, torch.Generator().manual_seed(bits))
        assert torch.equal(tc.decode(codes.cuda(), codebook).cpu(), tc.decode(codes, codebook))
    codes, suh, svh = _layer(4, "mcg")
    w = tc.dense_weight(codes, suh, svh, "mcg")
    torch.testing.assert_close(
        tc.dense_weight(codes.cuda(), suh.cuda(), svh.cuda(), "mcg").cpu(), w,
        rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def test_check_codebook_errors():
    with pytest.raises(ValueError, match="unknown codebook"):
        tc.check_codebook("e8p", 2)
    with pytest.raises(ValueError, match="2..4 bits"):
        tc.check_codebook("sqg_e4m3", 5)
    with pytest.raises(ValueError, match="2..6 bits"):
        tc.check_codebook("mcg", 7)
    with pytest.raises(ValueError, match="2..6 bits"):
        tc.check_codebook("mcg", 1)
    with pytest.raises(ValueError, match="int"):
        tc.check_codebook("mcg", 2.0)
    with pytest.raises(ValueError):
        tc.codebook_lut("nope", 2)
    with pytest.raises(ValueError):
        tc.state_to_value(torch.tensor([0]), "mcg", 9)


def test_bad_inputs():
    codes = tc.random_trellis(128, 128, 4)
    with pytest.raises(ValueError, match="int16"):
        tc.decode(codes.int(), "mcg")
    with pytest.raises(ValueError, match="16\\*K"):
        tc.decode(codes[..., :63], "mcg")
    with pytest.raises(ValueError, match="3-D"):
        tc.decode(codes[0], "mcg")
    with pytest.raises(ValueError, match="2..4 bits"):
        tc.decode(tc.random_trellis(16, 16, 5), "sqg_e4m3")
    with pytest.raises(ValueError, match="unknown codebook"):
        tc.decode(codes, "qtip")
    with pytest.raises(ValueError, match="last dimension 256"):
        tc.pack(torch.zeros(255, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="symbols must lie"):
        tc.pack(torch.full((256,), 4), 2)
    with pytest.raises(ValueError, match="integer"):
        tc.pack(torch.zeros(256), 2)
    with pytest.raises(ValueError, match="\\[0, 65536\\)"):
        tc.state_to_value(torch.tensor([65536]), "mcg", 2)
    with pytest.raises(ValueError, match="integer"):
        tc.state_to_value(torch.tensor([0.5]), "mcg", 2)
    small = tc.random_trellis(16, 128, 4)  # 16 input features: not a multiple of 128
    with pytest.raises(ValueError, match="multiples of 128"):
        tc.dense_weight(small, torch.ones(16).half(), torch.ones(128).half(), "mcg")
    with pytest.raises(ValueError, match="suh must have shape"):
        tc.dense_weight(codes, torch.ones(64).half(), torch.ones(128).half(), "mcg")
    with pytest.raises(ValueError, match="svh must have shape"):
        tc.linear_forward(torch.ones(1, 128), codes, torch.ones(128).half(),
                          torch.ones(256).half(), "mcg")
    with pytest.raises(ValueError, match="x last dimension"):
        tc.linear_forward(torch.ones(1, 64), codes, torch.ones(128).half(),
                          torch.ones(128).half(), "mcg")
    with pytest.raises(ValueError, match="multiple of 128"):
        tc.rotate_blocks(torch.ones(3, 100))
    with pytest.raises(ValueError, match="multiples of 16"):
        tc.random_trellis(20, 16, 2)

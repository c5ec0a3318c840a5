"""The sqg_e4m3 decode through T12 and the state bijection on the integer ALU (no torch, no cutlass).

Owns the T12 path of the QSRT decode, and the arithmetic T12 the K=2 pair-table decode
computes a share of its weights with (`window_t12_index`, `T12_POLY`, `t12_poly_model`;
section at the end). The T12 path: the one 4 KiB table T12 (`format.T12_SIZE` E4M3FN
bytes, the same for every K) in shared memory, and per 16-bit state x the integer program
that computes its T12 index, `rank(x) >> 4` (the law of `kquant_cute.trellis`, the reference codec):

    h = x >> K;  b = x & (2^K - 1);  w = 16 - K;  M = 2^w - 1
    m = h ^ (h >> 11);  m ^= (m << 11) & M
    p = SQG_MUL * m + SQG_ADD (mod 2^32);  phase = p & M
    j = rev_K(b) ^ (p >> (32 - K));  rank = (j << w) | phase

The program (`t12_program(K)`) is data: the kernels emit exactly its instructions as
inline PTX (`ptx_lines`, `kernels.ptx.e4m3_t12_pair`), and `run_program` executes the
same instructions on Python ints or numpy integer arrays, so the CPU proof over all 65,536
states (tests/test_sqg_t12.py) is a proof of the instruction sequence the GEMM runs. The
direct path (a 64 KiB table per K, `kquant_cute.trellis.sqg_state_table`) stays the
default where it fits (`choose_table_decode`).

How the program is short (11 integer ops per state, 2 of them multiply-adds):
- the two xorshifts as 3 + 2 ops: m = (x >> K) ^ (x >> (K + 11)), then bits 11..w-1 of
  m are replaced (one LOP3 select) by bits 0..w-12 of h, which `x << (11 - K)` holds at
  11..w-1 (m ^ ((m << 11) & M) has exactly those bits there: h's low bits, because
  m's low bits are h's low bits ^ h's bits 11.. and m's bits 11.. are h's bits 11..);
- `brev(x)` holds rev_K(b) in its top K bits (x is zero-extended), where p holds its
  syndrome, so one XOR makes j in place;
- rank >> 4 = [j (K bits)][phase bits 4..w-1]: j sits at bits 32-K..31 of p ^ brev(x),
  and phase bits 4..w-1 at bits 20..31-K of p << 16, which a second multiply-add makes
  directly (SQG_MUL << 16, SQG_ADD << 16, mod 2^32); one LOP3 select and one shift by 20
  leave the 12-bit index with nothing above it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import format as fmt

MASK32 = 0xFFFFFFFF
#: Shared memory of the T12 path: one T12 per CTA, read by every K.
T12_TABLE_BYTES = fmt.T12_SIZE
#: Bits of a T12 index (rank >> 4).
T12_INDEX_BITS = (fmt.T12_SIZE - 1).bit_length()
#: Table decodes of the table codebooks: a 64 KiB direct table per K, or T12 + bijection.
TABLE_DECODES = ("direct", "t12")


def _lut(fn) -> int:
    """LOP3 truth table of `fn(a, b, c)` (a = 0xF0, b = 0xCC, c = 0xAA, PTX convention)."""
    return fn(0xF0, 0xCC, 0xAA) & 0xFF


#: LOP3 functions the program uses.
LUT_SELECT = _lut(lambda a, b, c: (b & c) | (a & ~c))  # c ? b : a, bitwise


@dataclass(frozen=True)
class Op:
    """One 32-bit integer instruction: `dst = op(srcs)`; a source is a register name or an
    int immediate. Ops: shr, shl (shift by an immediate), xor, brev, mad (a * b + c mod
    2^32), lop3 (srcs a, b, c, then the truth table)."""

    op: str
    dst: str
    srcs: tuple


@functools.lru_cache(maxsize=None)
def t12_program(bits: int) -> tuple[Op, ...]:
    """The integer program from state register "x" (zero-extended 16 bits) to "idx" =
    rank(x) >> 4 (0..4095) at `bits` per weight (2..4)."""
    lo, hi = fmt.BITS_RANGE["sqg_e4m3"]
    if not lo <= bits <= hi:
        raise ValueError(f"bits {bits} outside {lo}..{hi} for sqg_e4m3")
    w = fmt.STATE_BITS - bits
    s = fmt.SQG_XORSHIFT
    m_hi = ((1 << w) - 1) & ~((1 << s) - 1)  # bits 11..w-1
    top = MASK32 & ~((1 << (32 - bits)) - 1)  # bits 32-K..31
    return (
        Op("shr", "h", ("x", bits)),
        Op("shr", "hh", ("x", bits + s)),
        Op("xor", "m", ("h", "hh")),
        Op("shl", "v", ("x", s - bits)),
        Op("lop3", "n", ("m", "v", m_hi, LUT_SELECT)),
        Op("mad", "p", ("n", fmt.SQG_MUL, fmt.SQG_ADD)),
        Op("mad", "q", ("n", (fmt.SQG_MUL << 16) & MASK32, (fmt.SQG_ADD << 16) & MASK32)),
        Op("brev", "r", ("x",)),
        Op("xor", "y", ("p", "r")),
        Op("lop3", "z", ("q", "y", top, LUT_SELECT)),
        Op("shr", "idx", ("z", 32 - T12_INDEX_BITS)),
    )


def _brev(v):
    out = v & 0
    for i in range(32):
        out = out | (((v >> i) & 1) << (31 - i))
    return out


def run_program(program, x):
    """Execute `program` on `x` (a Python int or a numpy unsigned / int64 array of states)
    with 32-bit semantics; returns the value of "idx". The CPU mirror of the kernel."""
    regs = {"x": x}

    def val(s):
        return regs[s] if isinstance(s, str) else s

    for o in program:
        a = [val(s) for s in o.srcs]
        if o.op == "shr":
            r = (a[0] & MASK32) >> a[1]
        elif o.op == "shl":
            r = (a[0] << a[1]) & MASK32
        elif o.op == "xor":
            r = a[0] ^ a[1]
        elif o.op == "brev":
            r = _brev(a[0] & MASK32)
        elif o.op == "mad":
            r = (a[0] * a[1] + a[2]) & MASK32
        elif o.op == "lop3":
            src, lut = a[:3], a[3]
            r = a[0] & 0
            for i in range(8):  # minterm i: bit 2 of i selects a, bit 1 b, bit 0 c
                if lut >> i & 1:
                    t = MASK32
                    for k, v in enumerate(src):
                        t = t & (v if i >> (2 - k) & 1 else v ^ MASK32)
                    r = r | t
            r = r & MASK32
        else:
            raise ValueError(f"unknown op {o.op!r}")
        regs[o.dst] = r
    return regs["idx"]


_PTX = {"shr": "shr.b32", "shl": "shl.b32", "xor": "xor.b32", "brev": "brev.b32",
        "mad": "mad.lo.u32", "lop3": "lop3.b32"}


def ptx_lines(program, suffix: str, x: str) -> list[str]:
    """PTX of `program` with registers named `<name><suffix>` (declared by the caller as
    .b32; `registers(program)`), the state read from operand `x`."""
    def reg(s):
        if isinstance(s, str):
            return x if s == "x" else f"{s}{suffix}"
        return f"{s:#x}"

    return [f"{_PTX[o.op]} {reg(o.dst)}, {', '.join(reg(s) for s in o.srcs)};" for o in program]


def registers(program) -> list[str]:
    """Names of the registers `program` writes (the caller declares them per state)."""
    return [o.dst for o in program]


def choose_table_decode(direct_fits: bool) -> str:
    """The decode a table codebook's GEMM uses: the direct tables where they fit beside the
    rings in the target's shared memory (one byte load per weight, the faster decode on
    the H200, docs/benchmarks.md), else T12 + bijection (4 KiB for every K: sm_120's
    101,376 B, three rates at wide blocks on sm_90)."""
    return "direct" if direct_fits else "t12"


# -- the arithmetic T12: no table at all ---------------------------------------------------
#
# The K=2 pair-table decode (kernels/decode.py) waits on shared-memory banks while the ALU
# and FMA pipes idle; `ARITH_PAIRS` of a lane's 4 pairs per tile skip shared memory: the
# integer program below gives each state's T12 index q, then T12[q] is computed, not read:
#     u = (2q + 1) / 4096 - 1                      (exact in fp32)
#     v = u * P(log2(1 - u*u)),  P of degree 4     (`T12_POLY`, `lg2.approx`)
#     T12[q] = E4M3FN(v) rounded to nearest even, -0 read as +0
# P is not a series for 1.5 * Phi^-1: it was fitted (a linear program over the 2,048 q >= 2048,
# maximising the smallest distance to the edge of each q's E4M3 rounding interval) so that
# v lands inside the rounding interval of the byte T12 holds, for every q (T12 is odd:
# T12[4095 - q] = T12[q] ^ 0x80, and so is v, since u(4095 - q) = -u(q)). The smallest
# slack is 1.05e-4 of the value, far above fp32 rounding and `lg2.approx`'s error;
# tests/test_sqg_t12.py checks the model on all 4,096 q, the GPU tests the instructions.

#: fp32 bit patterns of P's coefficients, constant term first.
T12_POLY = (0x380069BE, 0x3AD8FF8D, 0x3C396E6F, 0xBEAEEAB8, 0x3FF09A1F)[::-1]
#: u = q * U_SCALE + U_BIAS: 2^-11 and 1/4096 - 1 (both exact in fp32).
U_SCALE_BITS = 0x3A000000
U_BIAS_BITS = 0xBF7FF000


def window_t12_index(w, o: int, rev, const=int):
    """T12 index (rank >> 4) of the K=2 state at bits [o, o + 16) of the 32-bit register `w`
    (o in 0..16), `rev` = brev(w), computed once per window. The law of `t12_program(2)`,
    reading the state in place: h = x >> 2 is w >> (o + 2), masked unless o = 16; the
    xorshift's bits 11..13 (h's bits 0..2) come from w shifted by o - 9; rev_2(b), x's low two
    bits reversed, sits at bits 30..31 of rev << o. `const` wraps constants in `w`'s integer
    type (the kernel's Uint32, numpy's uint32 in the CPU proof), so this one function is the
    decode and its model."""
    if not 0 <= o <= 16:
        raise ValueError(f"state offset {o} outside 0..16")
    s = fmt.SQG_XORSHIFT
    h = w >> (o + 2)
    if o + 2 + 14 < 32:
        h = h & const(0x3FFF)
    m = h ^ (h >> s)  # bits 0..13; bits 11..13 replaced next
    v = w >> (o - 9) if o >= 9 else w << (9 - o)  # h's bits 0..2 at 11..13
    n = (m & const(0x07FF)) | (v & const(0x3800))  # one LOP3 select
    p = n * const(fmt.SQG_MUL) + const(fmt.SQG_ADD)
    q = n * const((fmt.SQG_MUL << 16) & MASK32) + const((fmt.SQG_ADD << 16) & MASK32)
    y = p ^ (rev << o)
    z = (q & const(0x3FFFFFFF)) | (y & const(0xC0000000))  # one LOP3 select
    return z >> (32 - T12_INDEX_BITS)


def t12_poly_model(q, lg2_offset: float = 0.0):
    """The arithmetic T12 on the CPU (numpy float32; `lg2.approx` modelled by a correctly
    rounded log2, plus `lg2_offset` to model its error): E4M3FN bytes for indices `q` (an
    int array), -0 read as +0."""
    import numpy as np

    f32 = np.float32
    c = np.array(T12_POLY, dtype=np.uint32).view(np.float32)
    sc, bias = (np.array([b], dtype=np.uint32).view(np.float32)[0] for b in (U_SCALE_BITS, U_BIAS_BITS))
    u = (np.asarray(q).astype(np.float64) * sc + bias).astype(f32)
    t = (1.0 - u.astype(np.float64) ** 2).astype(f32)
    lg = (np.log2(t.astype(np.float64)) + lg2_offset).astype(f32)
    a = c[4]
    for k in (3, 2, 1, 0):
        a = (a.astype(np.float64) * lg + c[k]).astype(f32)
    v = (a.astype(np.float64) * u).astype(f32)
    return e4m3fn_bytes(v)


def e4m3fn_bytes(v):
    """Round-to-nearest-even E4M3FN bytes of float values (finite, |v| < 448), -0 -> 0x00."""
    import numpy as np

    grid = np.array([(b & 7) / 8 * 2.0**-6 if b < 8 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7)
                     for b in range(0x7F)])
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    i = np.clip(np.searchsorted(grid, a), 1, 0x7E)
    lo, hi = grid[i - 1], grid[i]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))
    b = np.where(up, i, i - 1)
    return np.where((v < 0) & (b != 0), b | 0x80, b).astype(np.uint8)

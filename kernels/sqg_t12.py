"""The sqg_e4m3 decode through T12 and the state bijection on the integer ALU (no torch, no cutlass).

Owns the T12 path of the QSRT decode: the one 4 KiB table T12 (`format.T12_SIZE` E4M3FN
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

"""Inline-PTX building blocks shared by the kquant-cute kernels.

Owns the few instructions the CuTe DSL does not expose in the exact register form we
need: the m16n8k16 fp16 `mma.sync` on raw fragment registers, half2 packing/arithmetic
used by the trellis codebooks, integer helpers (byte sums, 64-bit funnel reads), and the
rotation stages' fp32 fma and vector fp16 loads / stores.
Every function here is a `dsl_user_op`, callable from `@cute.kernel` code on DSL
scalars (Int32 / Uint32 / Float32) and returning DSL scalars. Also the two trace-time
helpers every kernel module uses to view raw pointers and map expert ids.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def flat_tensor(ptr):
    """A 1-D view of a raw device pointer (indices are checked by the callers' sizes)."""
    import cutlass.cute as cute

    return cute.make_tensor(ptr, cute.make_layout(1 << 30))


def local_expert(mIds, mMap, r, has_map: bool):
    """Local expert id of route r: topk_ids[r], through the expert map when there is one;
    -1 = no expert here (the expert lives on another rank, or the id itself is -1, which
    means "no route" with or without a map: the map is then read at 0, never at -1)."""
    import cutlass

    e = mIds[r]
    if has_map:
        mapped = mMap[Int32(cutlass.select_(e >= 0, e, 0))]
        e = Int32(cutlass.select_(e >= 0, mapped, -1))
    return e


def _u32(x, loc=None, ip=None):
    return Uint32(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc=None, ip=None):
    return Float32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def mma_f16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """D = A(16x16 fp16, row) * B(16x8 fp16, col) + C (fp32), one warp, raw fragments.

    A fragment (lane L, g = L >> 2, c = L & 3): a0 = rows g, cols 2c..2c+1; a1 = row g+8;
    a2 = row g, cols 2c+8..; a3 = row g+8, cols 2c+8... B fragment: b0 = rows 2c..2c+1 of
    column g, b1 = rows 2c+8..2c+9. C/D: c0,c1 = row g cols 2c..2c+1; c2,c3 = row g+8.
    """
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [_u32(a0, loc, ip), _u32(a1, loc, ip), _u32(a2, loc, ip), _u32(a3, loc, ip),
         _u32(b0, loc, ip), _u32(b1, loc, ip),
         _f32(c0, loc, ip), _f32(c1, loc, ip), _f32(c2, loc, ip), _f32(c3, loc, ip)],
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        loc=loc, ip=ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def lop3_pair_scalar_add(x0, x1, mask: int, xor: int, *, loc=None, ip=None):
    """Same values as `lop3_half2_sum`, balanced across pipes: the two lo+hi sums are
    scalar fp16 adds (FMA pipe) and only the final pack is a byte permute (ALU pipe),
    instead of two permutes and one packed add."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(x0, loc, ip), _u32(x1, loc, ip)],
        "{\n\t.reg .b32 p, q;\n\t.reg .f16 pl, ph, ql, qh, a, b;\n\t"
        f"lop3.b32 p, $1, {mask:#010x}, {xor:#010x}, 0x6A;\n\t"
        f"lop3.b32 q, $2, {mask:#010x}, {xor:#010x}, 0x6A;\n\t"
        "mov.b32 {pl, ph}, p;\n\tmov.b32 {ql, qh}, q;\n\t"
        "add.rn.f16 a, pl, ph;\n\tadd.rn.f16 b, ql, qh;\n\t"
        "mov.b32 $0, {a, b};\n\t}",
        "=r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def mul1_half2(x0, x1, kinv_bits, kbias_bits, *, loc=None, ip=None):
    """Two MUL1 values packed as half2: s = byte sum of x, h = fp16 bits 0x6400 + s,
    value = fp16(h * k_inv + k_bias) with one rounding (fma)."""
    return Uint32(llvm.inline_asm(
        T.i32(),
        [_u32(x0, loc, ip), _u32(x1, loc, ip), _u32(kinv_bits, loc, ip), _u32(kbias_bits, loc, ip)],
        "{\n\t.reg .b32 s0, s1, h, k, b;\n\t"
        "dp4a.u32.u32 s0, $1, 0x01010101, 0x6400;\n\t"
        "dp4a.u32.u32 s1, $2, 0x01010101, 0x6400;\n\t"
        "prmt.b32 h, s0, s1, 0x5410;\n\t"
        "prmt.b32 k, $3, $3, 0x1010;\n\t"
        "prmt.b32 b, $4, $4, 0x1010;\n\t"
        "fma.rn.f16x2 $0, h, k, b;\n\t}",
        "=r,r,r,r,r",
        loc=loc, ip=ip,
    ))


@dsl_user_op
def e4m3_table_pair(s0, s1, table, *, loc=None, ip=None):
    """Two 16-bit states -> one half2 of their E4M3FN table bytes: two byte loads from the
    shared-memory table at `table` (one byte per state), one byte permute packs them as an
    e4m3x2, `cvt.rn.f16x2.e4m3x2` widens both (exact: every E4M3FN value is an fp16;
    low half = s0). sm_89+."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(s0, loc, ip), _u32(s1, loc, ip), _u32(table, loc, ip)],
        "{\n\t.reg .b32 a0, a1, b0, b1, p;\n\t.reg .b16 lo, hi;\n\t"
        "add.u32 a0, $3, $1;\n\tadd.u32 a1, $3, $2;\n\t"
        "ld.shared.u8 b0, [a0];\n\tld.shared.u8 b1, [a1];\n\t"
        "prmt.b32 p, b0, b1, 0x0040;\n\tmov.b32 {lo, hi}, p;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t}",
        "=r,r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def e4m3_pair_entry(offset, sel, table, *, loc=None, ip=None):
    """One half2 from an 8-byte pair-table entry: an 8-byte load from shared memory at
    `table` + `offset`, one byte permute of its two words with the run-time selector `sel`
    (its low byte picks the low e4m3 of the pair, bits 4-7 the high one; bits 8+ are
    ignored), `cvt.rn.f16x2.e4m3x2` widens both (low half = byte 0). sm_89+."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(offset, loc, ip), _u32(sel, loc, ip), _u32(table, loc, ip)],
        "{\n\t.reg .b32 a, e0, e1, p;\n\t.reg .b16 lo, hi;\n\t"
        "add.u32 a, $3, $1;\n\t"
        "ld.shared.v2.u32 {e0, e1}, [a];\n\t"
        "prmt.b32 p, e0, e1, $2;\n\tmov.b32 {lo, hi}, p;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t}",
        "=r,r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def e4m3_t12_pair(s0, s1, table, bits: int, *, loc=None, ip=None):
    """Two 16-bit sqg_e4m3 states (zero-extended) -> one half2 of their E4M3FN values through
    T12 (4 KiB, shared memory at `table`): per state the integer program of
    `kernels/sqg_t12.py` at K = `bits` computes its T12 index (rank >> 4), one byte load
    each, then as `e4m3_table_pair`. sm_89+."""
    from .sqg_t12 import ptx_lines, registers, t12_program

    prog = t12_program(bits)
    regs = ", ".join(f"{r}_{i}" for i in (0, 1) for r in registers(prog))
    body = ptx_lines(prog, "_0", "$1") + ptx_lines(prog, "_1", "$2")
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(s0, loc, ip), _u32(s1, loc, ip), _u32(table, loc, ip)],
        "{\n\t.reg .b32 " + regs + ", a0, a1, b0, b1, p;\n\t.reg .b16 lo, hi;\n\t"
        + "\n\t".join(body) + "\n\t"
        "add.u32 a0, $3, idx_0;\n\tadd.u32 a1, $3, idx_1;\n\t"
        "ld.shared.u8 b0, [a0];\n\tld.shared.u8 b1, [a1];\n\t"
        "prmt.b32 p, b0, b1, 0x0040;\n\tmov.b32 {lo, hi}, p;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t}",
        "=r,r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def e4m3_poly_pair(q0, q1, *, loc=None, ip=None):
    """Two T12 indices -> one half2 of their E4M3FN values, computed (`kernels/sqg_t12.py`,
    "the arithmetic T12"): per index u = q * 2^-11 + (1/4096 - 1), v = u * P(lg2(1 - u*u))
    (fp32, `lg2.approx.ftz`, degree-4 Horner), then `cvt.rn.satfinite.e4m3x2.f32` rounds
    both to E4M3FN, `cvt.rn.f16x2.e4m3x2` widens them (low half = q0) and adding +0 turns
    -0 into +0 (T12 holds 0x00 there). No shared memory: ALU, FMA and MUFU pipes. sm_89+."""
    from .sqg_t12 import T12_POLY, U_BIAS_BITS, U_SCALE_BITS

    def state(i: int, q: str) -> list[str]:
        body = [f"cvt.rn.f32.u32 f{i}, {q};",
                f"fma.rn.f32 u{i}, f{i}, 0f{U_SCALE_BITS:08X}, 0f{U_BIAS_BITS:08X};",
                f"neg.f32 n{i}, u{i};",
                f"fma.rn.f32 t{i}, n{i}, u{i}, 0f3F800000;",
                f"lg2.approx.ftz.f32 l{i}, t{i};",
                f"mov.b32 a{i}, 0f{T12_POLY[4]:08X};"]
        body += [f"fma.rn.f32 a{i}, a{i}, l{i}, 0f{T12_POLY[k]:08X};" for k in (3, 2, 1, 0)]
        return body + [f"mul.rn.f32 v{i}, a{i}, u{i};"]

    regs = ", ".join(f"{r}{i}" for i in (0, 1) for r in "funtlav")
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(q0, loc, ip), _u32(q1, loc, ip)],
        "{\n\t.reg .f32 " + regs + ";\n\t.reg .b16 e;\n\t.reg .b32 h, z;\n\t"
        + "\n\t".join(state(0, "$1") + state(1, "$2")) + "\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 e, v1, v0;\n\t"
        "cvt.rn.f16x2.e4m3x2 h, e;\n\t"
        "mov.b32 z, 0;\n\tadd.rn.f16x2 $0, h, z;\n\t}",
        "=r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def brev_u32(a, *, loc=None, ip=None):
    """Bit reversal of a 32-bit register."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(a, loc, ip)], "brev.b32 $0, $1;", "=r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def hadd2(a, b, *, loc=None, ip=None):
    """Packed fp16x2 add (round to nearest even) of two half2 registers (FMA pipe)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], "add.rn.f16x2 $0, $1, $2;", "=r,r,r",
        loc=loc, ip=ip,
    ))


@dsl_user_op
def st_shared_v2_f32(smem_addr, a, b, *, loc=None, ip=None):
    """One 8-byte shared-memory store of two fp32 values."""
    llvm.inline_asm(
        None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip)],
        "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", has_side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def st_global_f32(gmem_addr, v, *, loc=None, ip=None):
    """One fp32 store to global memory."""
    llvm.inline_asm(
        None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), _f32(v, loc, ip)],
        "st.global.f32 [$0], $1;", "l,f", has_side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_global_v4_f32(gmem_addr, *, loc=None, ip=None):
    """Four consecutive fp32 values from global memory in one 16-byte load (the address
    16-byte aligned)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", loc=loc, ip=ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def fma_f32(a, b, c, *, loc=None, ip=None):
    """a * b + c in fp32, rounded once (so a * (+-1) + c equals c +- a bit for bit)."""
    return Float32(llvm.inline_asm(
        T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip)],
        "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", loc=loc, ip=ip,
    ))


@dsl_user_op
def ld_global_f16_f32(gmem_addr, n: int, *, loc=None, ip=None):
    """`n` (2 or 4) consecutive fp16 values from global memory in one 2n-byte load (the
    address 2n-byte aligned), widened to fp32 (exact)."""
    regs = ", ".join(f"h{i}" for i in range(n))
    cvts = "".join(f"cvt.f32.f16 ${i}, h{i};\n\t" for i in range(n))
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        f"{{\n\t.reg .b16 {regs};\n\tld.global.v{n}.b16 {{{regs}}}, [${n}];\n\t{cvts}}}",
        ",".join(["=f"] * n + ["l"]), loc=loc, ip=ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def st_global_f16x2(gmem_addr, a, b, *, loc=None, ip=None):
    """Two fp32 values rounded to fp16 (nearest even) and stored as one 4-byte word (the
    address 4-byte aligned; `a` at the lower address)."""
    llvm.inline_asm(
        None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip)],
        "{\n\t.reg .b16 h0, h1;\n\t"
        "cvt.rn.f16.f32 h0, $1;\n\tcvt.rn.f16.f32 h1, $2;\n\t"
        "st.global.v2.b16 [$0], {h0, h1};\n\t}",
        "l,f,f", has_side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def copy_shared_to_global_16(gmem_addr, smem_addr, *, loc=None, ip=None):
    """16 bytes from shared to global memory through registers (ld.shared.v4 +
    st.global.v4), both addresses 16-byte aligned."""
    llvm.inline_asm(
        None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 a, b, c, d;\n\t"
        "ld.shared.v4.b32 {a, b, c, d}, [$1];\n\t"
        "st.global.v4.b32 [$0], {a, b, c, d};\n\t}",
        "l,r", has_side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def funnel_hi(hi, lo, shift, *, loc=None, ip=None):
    """Upper 32 bits of the 64-bit value (hi:lo) shifted left by `shift` (0..32, clamped)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(lo, loc, ip), _u32(hi, loc, ip), _u32(shift, loc, ip)],
        "shf.l.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def cp_async_16(smem_addr, gmem_addr, src_bytes=None, *, loc=None, ip=None):
    """16-byte global -> shared asynchronous copy (L2 only: .cg). With `src_bytes` (0 or
    16, run-time) it reads only that many bytes and zero-fills the rest: a padding row
    costs no memory traffic."""
    operands = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    if src_bytes is None:
        asm, constraints = "cp.async.cg.shared.global [$0], [$1], 16;", "r,l"
    else:
        operands.append(Int32(src_bytes).ir_value(loc=loc, ip=ip))
        asm, constraints = "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r"
    llvm.inline_asm(None, operands, asm, constraints, has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16_if(pred, smem_addr, gmem_addr, src_bytes=None, *, loc=None, ip=None):
    """`cp_async_16` only where `pred` (an Int32, run-time) is nonzero: no write at all
    otherwise (zero-filling with src_bytes = 0 would still write the 16 bytes)."""
    operands = [Int32(pred).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
                Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
    size, constraints = "", "r,r,l"
    if src_bytes is not None:
        operands.append(Int32(src_bytes).ir_value(loc=loc, ip=ip))
        size, constraints = ", $3", "r,r,l,r"
    asm = ("{ .reg .pred p; setp.ne.b32 p, $0, 0; "
           f"@p cp.async.cg.shared.global [$1], [$2], 16{size}; }}")
    llvm.inline_asm(None, operands, asm, constraints, has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ldmatrix_x4(smem_addr, *, loc=None, ip=None):
    """Four 8x8 b16 matrices from shared memory (lane i addresses row i % 8 of matrix i // 8);
    returns this lane's four registers in matrix order."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, loc=loc, ip=ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def prmt_u32(a, sel: int, *, loc=None, ip=None):
    """Byte permute of `a` with zero bytes from a second zero operand (selector nibbles
    4..7 read zeros): one ALU op for a byte-aligned 16-bit field extract."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(a, loc, ip)], f"prmt.b32 $0, $1, 0, {sel:#06x};", "=r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def prmt2_u32(a, b, sel: int, *, loc=None, ip=None):
    """Byte permute of the 8 bytes of (b:a) (selector nibbles 0-3: bytes of a, 4-7: of b)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {sel:#06x};",
        "=r,r,r", loc=loc, ip=ip,
    ))


@dsl_user_op
def shfl_xor_f32(x, offset: int, *, loc=None, ip=None):
    """Butterfly shuffle of an fp32 value across the full warp."""
    return Float32(llvm.inline_asm(
        T.f32(), [_f32(x, loc, ip)],
        f"shfl.sync.bfly.b32 $0, $1, {int(offset)}, 0x1f, 0xffffffff;", "=f,f",
        loc=loc, ip=ip,
    ))


# --- sm_90a warpgroup MMA (wgmma) with the A operand from registers ---------------------

@dsl_user_op
def wgmma_fence(*, loc=None, ip=None):
    """Orders this warpgroup's earlier register writes (A fragments, accumulators) before
    the next wgmma.mma_async reads them."""
    llvm.inline_asm(None, [], "wgmma.fence.sync.aligned;", "", has_side_effects=True,
                    loc=loc, ip=ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None):
    """Closes the group of wgmma.mma_async issued since the last commit."""
    llvm.inline_asm(None, [], "wgmma.commit_group.sync.aligned;", "", has_side_effects=True,
                    loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait(pending: int, acc, *, loc=None, ip=None):
    """Waits until at most `pending` wgmma groups are in flight; `acc` (fp32 values) pass
    through the same instruction so nothing reads them before it."""
    n = len(acc)
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n),
        [_f32(v, loc, ip) for v in acc],
        f"wgmma.wait_group.sync.aligned {int(pending)};",
        ",".join(["=f"] * n + [str(i) for i in range(n)]),
        has_side_effects=True, loc=loc, ip=ip,
    )
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def fence_proxy_async_smem(*, loc=None, ip=None):
    """Makes this thread's generic-proxy shared-memory writes (cp.async data) visible to
    the async proxy that wgmma reads shared memory through."""
    llvm.inline_asm(None, [], "fence.proxy.async.shared::cta;", "", has_side_effects=True,
                    loc=loc, ip=ip)


@dsl_user_op
def wgmma_m64k16_f16_rs(acc, a0, a1, a2, a3, b_desc, *, loc=None, ip=None):
    """acc (m64 x n fp32, n = 2 * len(acc)) += A (m64 x k16 fp16, this warp's rows
    16w..16w+15 in the m16n8k16 A-fragment registers a0..a3) x B (k16 x n fp16, K-major in
    shared memory, matrix descriptor `b_desc`). Asynchronous: the result is defined after
    `wgmma_commit` + `wgmma_wait`. Accumulator j*4 + e: row 16w + g + 8 (e >> 1), column
    8j + 2c + (e & 1) (lane = 4g + c)."""
    n = len(acc)
    regs = ", ".join(f"${i}" for i in range(n))
    a = ", ".join(f"${2 * n + i}" for i in range(4))
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n),
        [_f32(v, loc, ip) for v in acc]
        + [_u32(a0, loc, ip), _u32(a1, loc, ip), _u32(a2, loc, ip), _u32(a3, loc, ip),
           Int64(b_desc).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
        f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.f16.f16 "
        f"{{{regs}}}, {{{a}}}, ${2 * n + 4}, p, 1, 1, 0;\n\t}}",
        ",".join(["=f"] * n + [str(i) for i in range(n)] + ["r"] * 4 + ["l"]),
        has_side_effects=True, loc=loc, ip=ip,
    )
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


__all__ = [
    "mma_f16_m16n8k16", "lop3_pair_scalar_add", "mul1_half2", "e4m3_table_pair", "e4m3_pair_entry", "e4m3_t12_pair", "hadd2", "st_shared_v2_f32",
    "copy_shared_to_global_16", "funnel_hi", "prmt_u32", "prmt2_u32",
    "cp_async_16", "ldmatrix_x4", "wgmma_fence", "wgmma_commit", "st_global_f32",
    "ld_global_v4_f32",
    "wgmma_wait", "fence_proxy_async_smem", "wgmma_m64k16_f16_rs", "shfl_xor_f32", "flat_tensor", "local_expert",
]

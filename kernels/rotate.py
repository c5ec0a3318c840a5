"""Hadamard-rotation kernels around the trellis GEMMs of the MoE forward.

Owns the three element-wise-plus-butterfly stages (one warp per 128-wide chunk of a row;
lane l holds elements 4l..4l+3, the 128-point Walsh-Hadamard transform runs in registers
and shuffles, fp32, in a fixed order so results do not depend on anything but the row):
- `RotateInput`: x (bf16/fp16) -> H_blk(x * suh_gate), H_blk(x * suh_up) as fp16 MMA
  operands; rows are tokens (shared hidden-side vectors) or routes (per-expert vectors).
- `MidActivation`: per route, gate/up GEMM outputs -> H_blk then * svh (FC1 output
  rotation), act(gate) * up, then * suh_down and H_blk (FC2 input rotation) -> fp16.
- `CombineOutput`: per token, the router-weighted sum over top-k of the FC2 outputs with
  FC2's output rotation (H_blk then * svh) either per route (per-expert svh) or once per
  token after the sum (shared svh), stored as fp32 / bf16 / fp16.
A lane's four fp32 GEMM outputs of a row are consecutive and 16-byte aligned (rows and
chunks are multiples of 128 elements, buffers 16-byte aligned): one vector load each.

With `coupled` (QSRT profile k2_coupled_h512_h128, shared vectors only) the same three
stages also apply the coupled transforms (math: kquant_cute.reference._coupled_moe):
RotateInput runs H512 = H4 (x) H128 on the latent axis first (one warp per 512-block), and
writes one operand (both FC1 slots read the same rotated input); MidActivation reads the
slot outputs interleaved per 32-channel atom, runs H128 . svh . H128 . pre_signs, takes
gate / up as even / odd coordinates, * post_signs, then H128 . down_suh . H128 (one warp
per 128-block of the activation = two pre-activation blocks); CombineOutput applies H512
after the top-k sum and svh.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import ptx

WARPS = 4
THREADS = 32 * WARPS
CHUNK = 128
INV_SQRT_CHUNK = 1.0 / math.sqrt(CHUNK)
ACTIVATIONS = ("silu", "situ")
SITU_BETA = 4.0
SITU_LBETA = 25.0


def fwht128(v, lane):
    """In-place 128-point Walsh-Hadamard transform of a warp's chunk (v: 4 fp32 per lane),
    normalised by 1/sqrt(128) (the Sylvester H of docs/formats.md, "Hadamard rotations")."""
    a0, a1, a2, a3 = v[0], v[1], v[2], v[3]
    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
    a0, a1, a2, a3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
    vals = [a0, a1, a2, a3]
    for s in range(5):
        off = 1 << s
        # Lower lane: v + p; upper lane: p - v. One fma with the lane's sign, v * (+-1) + p,
        # rounds the same exact sum once, so it gives the same bits as the add / subtract.
        sign = Float32(cutlass.select_((lane & off) != 0, -1.0, 1.0))
        for j in range(4):
            p = ptx.shfl_xor_f32(vals[j], off)
            vals[j] = ptx.fma_f32(vals[j], sign, p)
    for j in range(4):
        v[j] = vals[j] * INV_SQRT_CHUNK


def h4_mix(c0, c1, c2, c3):
    """The normalised 4-point Hadamard across four 128-chunks (the H4 of H512 = H4 (x) H128):
    chunk h of the result = 0.5 * sum_g (-1)^popcount(g & h) chunk g, per lane element."""
    for j in range(4):
        a, b, c, d = c0[j], c1[j], c2[j], c3[j]
        s, t, p, q = a + b, a - b, c + d, c - d
        c0[j] = (s + p) * 0.5
        c1[j] = (t + q) * 0.5
        c2[j] = (s - p) * 0.5
        c3[j] = (t - q) * 0.5


def apply_activation(g, u, activation: str):
    if activation == "silu":
        return g / (1.0 + cute.math.exp(-g)) * u
    # SiTU: beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)
    sig = 1.0 / (1.0 + cute.math.exp(-g))
    return (SITU_BETA * cute.math.tanh(g * (1.0 / SITU_BETA)) * sig) * (
        SITU_LBETA * cute.math.tanh(u * (1.0 / SITU_LBETA)))


def warp_item():
    """(lane, item) of this thread: its lane and its warp's work item (WARPS warps, one item
    each, per CTA of the one-dimensional grid every stage launches)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return tidx % 32, bidx * WARPS + tidx // 32


def block512(item, blocks512: int, lane):
    """(row, base, regs) of a coupled stage's work item, one (row, 512-block) per warp: the
    row, the lane's first element of the block in the row (chunk c adds c * CHUNK) and four
    fresh fp32 [4] register tensors, one per 128-chunk of the block."""
    row = item // blocks512
    base = (item - row * blocks512) * (4 * CHUNK) + 4 * lane
    regs = tuple(cute.make_rmem_tensor((4,), Float32) for _ in range(4))
    return row, base, regs


def _check_chunks(name: str, dim: int) -> str | None:
    if dim % CHUNK:
        return f"{name} {dim} is not a multiple of {CHUNK} (one warp per {CHUNK}-wide chunk)"
    return None


class RotateInput:
    """x [m, H] -> Xg, Xu fp16 [rows, H] with rows = m (shared suh) or m*topk (per expert).

    coupled: Xg = H_blk(H512(x) * suh) only (Xu is not written; suh_gate == suh_up)."""

    threads = THREADS
    smem_bytes = 0

    @staticmethod
    def can_implement(*, hidden: int, topk: int, per_route: bool, has_map: bool,
                      coupled: bool = False, smem_limit: int | None = None) -> str | None:
        if coupled and (per_route or hidden % (4 * CHUNK)):
            return "coupled RotateInput needs shared vectors and hidden % 512 == 0"
        return _check_chunks("hidden", hidden)

    def __init__(self, *, hidden: int, topk: int, per_route: bool, has_map: bool,
                 coupled: bool = False):
        if coupled and (per_route or hidden % (4 * CHUNK)):
            raise ValueError("coupled RotateInput needs shared vectors and hidden % 512 == 0")
        self.hidden = hidden
        self.topk = topk
        self.per_route = per_route
        self.has_map = has_map
        self.coupled = coupled
        self.chunks = hidden // CHUNK
        self.blocks512 = hidden // (4 * CHUNK)

    @cute.jit
    def __call__(self, pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows: Int32, stream):
        items = num_rows * self.chunks
        if cutlass.const_expr(self.coupled):
            items = num_rows * self.blocks512
            self.coupled_kernel(pX, pSuhG, pXg, num_rows).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)
        else:
            self.kernel(pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def coupled_kernel(self, pX, pSuhG, pXg, num_rows: Int32):
        """One warp per (row, 512-block): H128 of each 128-chunk, the H4 mix across the four,
        * suh, H128 again; only Xg is written."""
        mX, mSuhG, mXg = ptx.flat_tensor(pX), ptx.flat_tensor(pSuhG), ptx.flat_tensor(pXg)
        lane, item = warp_item()
        if item < num_rows * self.blocks512:
            row, base, vs = block512(item, self.blocks512, lane)
            v0, v1, v2, v3 = vs
            for c in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    vs[c][j] = mX[row * self.hidden + base + c * CHUNK + j].to(Float32)
                fwht128(vs[c], lane)
            h4_mix(v0, v1, v2, v3)
            for c in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    vs[c][j] = vs[c][j] * mSuhG[base + c * CHUNK + j].to(Float32)
                fwht128(vs[c], lane)
                for j in cutlass.range_constexpr(4):
                    mXg[row * self.hidden + base + c * CHUNK + j] = vs[c][j].to(cutlass.Float16)

    @cute.kernel
    def kernel(self, pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows: Int32):
        mX, mSuhG, mSuhU = ptx.flat_tensor(pX), ptx.flat_tensor(pSuhG), ptx.flat_tensor(pSuhU)
        mIds, mMap, mXg, mXu = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap), ptx.flat_tensor(pXg), ptx.flat_tensor(pXu)
        lane, item = warp_item()
        if item < num_rows * self.chunks:
            row = item // self.chunks
            col = (item - row * self.chunks) * CHUNK + 4 * lane
            token = row
            vec_base = Int32(0)
            ok = True
            if self.per_route:
                token = row // self.topk
                e = ptx.local_expert(mIds, mMap, row, self.has_map)
                ok = e >= 0
                vec_base = e * self.hidden
            if ok:
                vg = cute.make_rmem_tensor((4,), Float32)
                vu = cute.make_rmem_tensor((4,), Float32)
                for j in cutlass.range_constexpr(4):
                    x = mX[token * self.hidden + col + j].to(Float32)
                    vg[j] = x * mSuhG[vec_base + col + j].to(Float32)
                    vu[j] = x * mSuhU[vec_base + col + j].to(Float32)
                fwht128(vg, lane)
                fwht128(vu, lane)
                for j in cutlass.range_constexpr(4):
                    mXg[row * self.hidden + col + j] = vg[j].to(cutlass.Float16)
                    mXu[row * self.hidden + col + j] = vu[j].to(cutlass.Float16)


class MidActivation:
    """G, U fp32 [routes, I] -> A2 fp16 [routes, I] (FC1 output rotation, act, FC2 input).

    coupled: G / U are the two FC1 slots; see `coupled_kernel`."""

    threads = THREADS
    smem_bytes = 0

    @staticmethod
    def can_implement(*, intermediate: int, activation: str, has_map: bool,
                      coupled: bool = False, smem_limit: int | None = None) -> str | None:
        if activation not in ACTIVATIONS:
            return f"activation {activation!r} not in {ACTIVATIONS}"
        return _check_chunks("intermediate", intermediate)

    def __init__(self, *, intermediate: int, activation: str, has_map: bool,
                 coupled: bool = False):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not in {ACTIVATIONS}")
        self.inter = intermediate
        self.activation = activation
        self.has_map = has_map
        self.coupled = coupled
        self.chunks = intermediate // CHUNK

    @cute.jit
    def __call__(self, pG, pU, pSvhG, pSvhU, pSuhD, pPre, pPost, pIds, pMap, pA2,
                 n_routes: Int32, stream):
        items = n_routes * self.chunks
        if cutlass.const_expr(self.coupled):
            self.coupled_kernel(pG, pU, pSvhG, pSvhU, pSuhD, pPre, pPost, pIds, pMap, pA2,
                                n_routes).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)
        else:
            self.kernel(pG, pU, pSvhG, pSvhU, pSuhD, pIds, pMap, pA2, n_routes).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def coupled_kernel(self, pG, pU, pSvhG, pSvhU, pSuhD, pPre, pPost, pIds, pMap, pA2,
                       n_routes: Int32):
        """One warp per (route, 128-block c of the activation).

        The pre-activation axis interleaves the slots per atom, so its block b = 2c + t
        holds G[64b : 64b+32], U[64b : 64b+32], G[64b+32 : 64b+64], U[64b+32 : 64b+64];
        lane l takes coordinates 4l..4l+3 of it (segment l // 8). After H128 . svh . H128 .
        pre_signs, gate / up are its even / odd coordinates: lane l yields activation
        channels 128c + 64t + 2l + {0, 1}. Those four values per lane (bit 0 in register
        bit 0, t in register bit 1, lane in bits 1..5) are again a complete 128-point
        layout, and the Hadamard is a product over index bits, so fwht128 applies as is.
        """
        mIds, mMap = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap)
        lane, item = warp_item()
        if item < n_routes * self.chunks:
            r = item // self.chunks
            c = item - r * self.chunks
            e = ptx.local_expert(mIds, mMap, r, self.has_map)
            if e >= 0:
                seg = lane // 8
                from_up = (seg % 2) == 1
                off = 32 * (seg // 2) + 4 * (lane % 8)
                h = cute.make_rmem_tensor((4,), Float32)
                slot = Int64(cutlass.select_(from_up, pU.toint(), pG.toint()))  # one read
                svh = Int64(cutlass.select_(from_up, pSvhU.toint(), pSvhG.toint()))
                for t in cutlass.range_constexpr(2):
                    b = 2 * c + t
                    src = r * self.inter + 64 * b + off
                    vsrc = e * self.inter + 64 * b + off
                    v = cute.make_rmem_tensor((4,), Float32)
                    vals = ptx.ld_global_v4_f32(slot + Int64(src) * 4)
                    for j in cutlass.range_constexpr(4):
                        v[j] = vals[j]
                    fwht128(v, lane)
                    sv = ptx.ld_global_f16_f32(svh + Int64(vsrc) * 2, 4)
                    for j in cutlass.range_constexpr(4):
                        v[j] = v[j] * sv[j]
                    fwht128(v, lane)
                    pre = ptx.ld_global_f16_f32(
                        pPre.toint() + Int64(e * (2 * self.inter) + 128 * b + 4 * lane) * 2, 4)
                    for j in cutlass.range_constexpr(4):
                        v[j] = v[j] * pre[j]
                    post_at = e * self.inter + CHUNK * c + 64 * t + 2 * lane
                    post = ptx.ld_global_f16_f32(pPost.toint() + Int64(post_at) * 2, 2)
                    for q in cutlass.range_constexpr(2):
                        h[2 * t + q] = (apply_activation(v[2 * q], v[2 * q + 1], self.activation)
                                        * post[q])
                fwht128(h, lane)
                col = CHUNK * c + 2 * lane  # channels col, col + 1, col + 64, col + 65
                for half in cutlass.range_constexpr(2):
                    sd = ptx.ld_global_f16_f32(
                        pSuhD.toint() + Int64(e * self.inter + col + 64 * half) * 2, 2)
                    for q in cutlass.range_constexpr(2):
                        h[2 * half + q] = h[2 * half + q] * sd[q]
                fwht128(h, lane)
                for half in cutlass.range_constexpr(2):
                    ptx.st_global_f16x2(pA2.toint() + Int64(r * self.inter + col + 64 * half) * 2,
                                        h[2 * half], h[2 * half + 1])

    @cute.kernel
    def kernel(self, pG, pU, pSvhG, pSvhU, pSuhD, pIds, pMap, pA2, n_routes: Int32):
        mA2 = ptx.flat_tensor(pA2)
        mSvhG, mSvhU, mSuhD = ptx.flat_tensor(pSvhG), ptx.flat_tensor(pSvhU), ptx.flat_tensor(pSuhD)
        mIds, mMap = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap)
        lane, item = warp_item()
        if item < n_routes * self.chunks:
            r = item // self.chunks
            col = (item - r * self.chunks) * CHUNK + 4 * lane
            e = ptx.local_expert(mIds, mMap, r, self.has_map)
            if e >= 0:
                vg = cute.make_rmem_tensor((4,), Float32)
                vu = cute.make_rmem_tensor((4,), Float32)
                src = Int64(r * self.inter + col) * 4
                g4 = ptx.ld_global_v4_f32(pG.toint() + src)
                u4 = ptx.ld_global_v4_f32(pU.toint() + src)
                for j in cutlass.range_constexpr(4):
                    vg[j] = g4[j]
                    vu[j] = u4[j]
                fwht128(vg, lane)
                fwht128(vu, lane)
                va = cute.make_rmem_tensor((4,), Float32)
                vbase = e * self.inter + col
                for j in cutlass.range_constexpr(4):
                    g = vg[j] * mSvhG[vbase + j].to(Float32)
                    u = vu[j] * mSvhU[vbase + j].to(Float32)
                    va[j] = apply_activation(g, u, self.activation) * mSuhD[vbase + j].to(Float32)
                fwht128(va, lane)
                for j in cutlass.range_constexpr(4):
                    mA2[r * self.inter + col + j] = va[j].to(cutlass.Float16)


class CombineOutput:
    """Y fp32 [routes, H] -> out [m, H]: sum_k w_k * (H_blk(Y) * svh_down) per token.

    coupled (shared svh only): then H512 of the sum, one warp per 512-block."""

    threads = THREADS
    smem_bytes = 0

    @staticmethod
    def can_implement(*, hidden: int, topk: int, shared_svh: bool, has_map: bool, out_dtype,
                      coupled: bool = False, smem_limit: int | None = None) -> str | None:
        if coupled and (not shared_svh or hidden % (4 * CHUNK)):
            return "coupled CombineOutput needs shared svh and hidden % 512 == 0"
        return _check_chunks("hidden", hidden)

    def __init__(self, *, hidden: int, topk: int, shared_svh: bool, has_map: bool, out_dtype,
                 coupled: bool = False):
        if coupled and (not shared_svh or hidden % (4 * CHUNK)):
            raise ValueError("coupled CombineOutput needs shared svh and hidden % 512 == 0")
        self.hidden = hidden
        self.topk = topk
        self.shared_svh = shared_svh
        self.has_map = has_map
        self.out_dtype = out_dtype
        self.coupled = coupled
        self.chunks = hidden // CHUNK
        self.blocks512 = hidden // (4 * CHUNK)

    @cute.jit
    def __call__(self, pY, pSvhD, pIds, pMap, pW, pOut, m: Int32, stream):
        items = m * self.chunks
        if cutlass.const_expr(self.coupled):
            items = m * self.blocks512
            self.coupled_kernel(pY, pSvhD, pIds, pMap, pW, pOut, m).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)
        else:
            self.kernel(pY, pSvhD, pIds, pMap, pW, pOut, m).launch(
                grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def coupled_kernel(self, pY, pSvhD, pIds, pMap, pW, pOut, m: Int32):
        """One warp per (token, 512-block): the top-k sum of each 128-chunk, H128, * svh
        (FC2's output rotation), then H512 = H4 (x) H128: H128 of each chunk again and the
        H4 mix across the four."""
        mSvh, mIds, mMap = ptx.flat_tensor(pSvhD), ptx.flat_tensor(pIds), ptx.flat_tensor(pMap)
        mW, mOut = ptx.flat_tensor(pW), ptx.flat_tensor(pOut)
        lane, item = warp_item()
        if item < m * self.blocks512:
            t, base, accs = block512(item, self.blocks512, lane)
            a0, a1, a2, a3 = accs
            for c in cutlass.range_constexpr(4):
                accs[c].fill(0.0)
            for k in cutlass.range_constexpr(self.topk):
                r = t * self.topk + k
                e = ptx.local_expert(mIds, mMap, r, self.has_map)
                if e >= 0:
                    w = mW[r]
                    row = pY.toint() + Int64(r * self.hidden + base) * 4
                    for c in cutlass.range_constexpr(4):
                        y4 = ptx.ld_global_v4_f32(row + c * CHUNK * 4)
                        for j in cutlass.range_constexpr(4):
                            accs[c][j] = accs[c][j] + w * y4[j]
            for c in cutlass.range_constexpr(4):
                fwht128(accs[c], lane)
                for j in cutlass.range_constexpr(4):
                    accs[c][j] = accs[c][j] * mSvh[base + c * CHUNK + j].to(Float32)
                fwht128(accs[c], lane)      # H512 = H4 (x) H128: its own H128 first
            h4_mix(a0, a1, a2, a3)
            for c in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    mOut[t * self.hidden + base + c * CHUNK + j] = accs[c][j].to(self.out_dtype)

    @cute.kernel
    def kernel(self, pY, pSvhD, pIds, pMap, pW, pOut, m: Int32):
        mSvh, mIds, mMap = ptx.flat_tensor(pSvhD), ptx.flat_tensor(pIds), ptx.flat_tensor(pMap)
        mW, mOut = ptx.flat_tensor(pW), ptx.flat_tensor(pOut)
        lane, item = warp_item()
        if item < m * self.chunks:
            t = item // self.chunks
            col = (item - t * self.chunks) * CHUNK + 4 * lane
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for k in cutlass.range_constexpr(self.topk):
                r = t * self.topk + k
                e = ptx.local_expert(mIds, mMap, r, self.has_map)
                if e >= 0:
                    v = cute.make_rmem_tensor((4,), Float32)
                    y4 = ptx.ld_global_v4_f32(pY.toint() + Int64(r * self.hidden + col) * 4)
                    for j in cutlass.range_constexpr(4):
                        v[j] = y4[j]
                    if not self.shared_svh:
                        fwht128(v, lane)
                        for j in cutlass.range_constexpr(4):
                            v[j] = v[j] * mSvh[e * self.hidden + col + j].to(Float32)
                    w = mW[r]
                    for j in cutlass.range_constexpr(4):
                        acc[j] = acc[j] + w * v[j]
            if self.shared_svh:
                fwht128(acc, lane)
                for j in cutlass.range_constexpr(4):
                    acc[j] = acc[j] * mSvh[col + j].to(Float32)
            for j in cutlass.range_constexpr(4):
                mOut[t * self.hidden + col + j] = acc[j].to(self.out_dtype)

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
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

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
    normalised by 1/sqrt(128) (the Sylvester H of BRIEF section 2)."""
    a0, a1, a2, a3 = v[0], v[1], v[2], v[3]
    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
    a0, a1, a2, a3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
    vals = [a0, a1, a2, a3]
    for s in range(5):
        off = 1 << s
        upper = (lane & off) != 0
        for j in range(4):
            p = ptx.shfl_xor_f32(vals[j], off)
            vals[j] = Float32(cutlass.select_(upper, p - vals[j], vals[j] + p))
    for j in range(4):
        v[j] = vals[j] * INV_SQRT_CHUNK


def apply_activation(g, u, activation: str):
    if activation == "silu":
        return g / (1.0 + cute.math.exp(-g)) * u
    # SiTU: beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)
    sig = 1.0 / (1.0 + cute.math.exp(-g))
    return (SITU_BETA * cute.math.tanh(g * (1.0 / SITU_BETA)) * sig) * (
        SITU_LBETA * cute.math.tanh(u * (1.0 / SITU_LBETA)))


class RotateInput:
    """x [m, H] -> Xg, Xu fp16 [rows, H] with rows = m (shared suh) or m*topk (per expert)."""

    def __init__(self, *, hidden: int, topk: int, per_route: bool, has_map: bool):
        self.hidden = hidden
        self.topk = topk
        self.per_route = per_route
        self.has_map = has_map
        self.chunks = hidden // CHUNK

    @cute.jit
    def __call__(self, pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows: Int32, stream):
        items = num_rows * self.chunks
        self.kernel(pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows).launch(
            grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, pX, pSuhG, pSuhU, pIds, pMap, pXg, pXu, num_rows: Int32):
        mX, mSuhG, mSuhU = ptx.flat_tensor(pX), ptx.flat_tensor(pSuhG), ptx.flat_tensor(pSuhU)
        mIds, mMap, mXg, mXu = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap), ptx.flat_tensor(pXg), ptx.flat_tensor(pXu)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        item = bidx * WARPS + tidx // 32
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
    """G, U fp32 [routes, I] -> A2 fp16 [routes, I] (FC1 output rotation, act, FC2 input)."""

    def __init__(self, *, intermediate: int, activation: str, has_map: bool):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not in {ACTIVATIONS}")
        self.inter = intermediate
        self.activation = activation
        self.has_map = has_map
        self.chunks = intermediate // CHUNK

    @cute.jit
    def __call__(self, pG, pU, pSvhG, pSvhU, pSuhD, pIds, pMap, pA2, n_routes: Int32, stream):
        items = n_routes * self.chunks
        self.kernel(pG, pU, pSvhG, pSvhU, pSuhD, pIds, pMap, pA2, n_routes).launch(
            grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, pG, pU, pSvhG, pSvhU, pSuhD, pIds, pMap, pA2, n_routes: Int32):
        mG, mU, mA2 = ptx.flat_tensor(pG), ptx.flat_tensor(pU), ptx.flat_tensor(pA2)
        mSvhG, mSvhU, mSuhD = ptx.flat_tensor(pSvhG), ptx.flat_tensor(pSvhU), ptx.flat_tensor(pSuhD)
        mIds, mMap = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        item = bidx * WARPS + tidx // 32
        if item < n_routes * self.chunks:
            r = item // self.chunks
            col = (item - r * self.chunks) * CHUNK + 4 * lane
            e = ptx.local_expert(mIds, mMap, r, self.has_map)
            if e >= 0:
                vg = cute.make_rmem_tensor((4,), Float32)
                vu = cute.make_rmem_tensor((4,), Float32)
                for j in cutlass.range_constexpr(4):
                    vg[j] = mG[r * self.inter + col + j]
                    vu[j] = mU[r * self.inter + col + j]
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
    """Y fp32 [routes, H] -> out [m, H]: sum_k w_k * (H_blk(Y) * svh_down) per token."""

    def __init__(self, *, hidden: int, topk: int, shared_svh: bool, has_map: bool, out_dtype):
        self.hidden = hidden
        self.topk = topk
        self.shared_svh = shared_svh
        self.has_map = has_map
        self.out_dtype = out_dtype
        self.chunks = hidden // CHUNK

    @cute.jit
    def __call__(self, pY, pSvhD, pIds, pMap, pW, pOut, m: Int32, stream):
        items = m * self.chunks
        self.kernel(pY, pSvhD, pIds, pMap, pW, pOut, m).launch(
            grid=[(items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, pY, pSvhD, pIds, pMap, pW, pOut, m: Int32):
        mY, mSvh, mIds, mMap, mW, mOut = (ptx.flat_tensor(pY), ptx.flat_tensor(pSvhD), ptx.flat_tensor(pIds), ptx.flat_tensor(pMap),
                                          ptx.flat_tensor(pW), ptx.flat_tensor(pOut))
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        item = bidx * WARPS + tidx // 32
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
                    for j in cutlass.range_constexpr(4):
                        v[j] = mY[r * self.hidden + col + j]
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

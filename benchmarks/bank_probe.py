"""How busy can random table loads keep an SM's shared memory? (benchmark probe)

    python3 benchmarks/bank_probe.py [--modes pair byte ...] [--threads 512 1024]

The decode's table loads alone, for ncu: one CTA per SM holds a table of the decode's
size; each thread issues `--iters` x 8 independent loads at random entries. Modes (table,
load): byte 64 KiB, 1 B (the direct table); word 64 KiB, 4 B; pair / quad 128 KiB, 8 / 16
B (8: the K=2 pair table); private 4 B from lane l's copy in bank l; seq 8 B at entry
32 i + l (no conflicts). `--sync-every s`: warpgroup barriers every s iterations (as a
wgmma's per k step). Printed: ms (graph replay), loads / bytes per SM-clock.
"""

from __future__ import annotations

import argparse
import sys

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

MODES = {"byte": (1 << 16, 1), "word": (1 << 16, 4), "pair": (1 << 17, 8),
         "quad": (1 << 17, 16), "private": (1 << 17, 4), "seq": (1 << 17, 8)}  # table, load B
UNROLL = 8  # independent loads per iteration and thread, each its own generator
_LCG_MUL, _LCG_ADD = 1664525, 1013904223


_LOADS = {1: "ld.shared.u8 $0, [$1];", 4: "ld.shared.u32 $0, [$1];",
          8: "{.reg .b32 x, y; ld.shared.v2.u32 {x, y}, [$1]; xor.b32 $0, x, y;}",
          16: "{.reg .b32 x, y, z, w; ld.shared.v4.u32 {x, y, z, w}, [$1]; "
              "lop3.b32 x, x, y, z, 0x96; xor.b32 $0, x, w;}"}  # a load, folded into one word


def load_offset(mode: str, mask: int, r, lane, step, const=int):
    """Byte offset of a load (kernel and host model; `const`: the operands' int type)."""
    if mode == "seq":
        return (step * const(256) + lane * const(8)) & const(mask)
    if mode == "private":  # copy l in bank l: word 32 r + l
        return (((r >> const(15)) & const(mask)) << const(7)) + lane * const(4)
    return (r >> const(13)) & const(mask)


@dsl_user_op
def _load_fold(addr, width: int, *, loc=None, ip=None):
    a = [Uint32(addr).ir_value(loc=loc, ip=ip)]
    return Uint32(llvm.inline_asm(T.i32(), a, _LOADS[width], "=r,r", loc=loc, ip=ip))


class BankProbe:
    """`mode` (module docstring) at `threads` per CTA."""

    def __init__(self, mode: str, threads: int, sync_every: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {sorted(MODES)}")
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads {threads} not a multiple of 32 in 32..1024")
        if sync_every < 0 or (sync_every and threads % 128):
            raise ValueError(f"sync_every {sync_every} needs warpgroups of 128, not {threads}")
        self.mode, self.threads, self.sync_every = mode, threads, sync_every
        self.table_bytes, self.width = MODES[mode]
        self.mask = self.table_bytes - self.width if mode != "private" else (1 << 10) - 1

    @cute.jit
    def __call__(self, pOut: cute.Pointer, iters: Int32, sm_count: Int32, stream):
        self.kernel(pOut, iters).launch(grid=[sm_count, 1, 1], block=[self.threads, 1, 1],
                                        smem=self.table_bytes, stream=stream)

    @cute.kernel
    def kernel(self, pOut: cute.Pointer, iters: Int32):
        mOut = cute.make_tensor(pOut, cute.make_layout(1 << 30))
        smem = cutlass.memory.SmemAllocator()
        sT = smem.allocate_tensor(Uint32, cute.make_layout(self.table_bytes // 4), 128)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        for i in range(tidx, self.table_bytes // 4, self.threads):
            sT[i] = Uint32(i) * Uint32(2654435761)
        cute.arch.sync_threads()
        base = Uint32(sT.iterator.toint())
        lane = Uint32(tidx % 32)
        gid = Uint32(bidx * self.threads + tidx)
        rR = cute.make_rmem_tensor((UNROLL,), Uint32)
        for u in cutlass.range_constexpr(UNROLL):
            rR[u] = gid * Uint32(0x9E3779B9) + Uint32((0x7F4A7C15 * (u + 1)) & 0xFFFFFFFF)
        acc = Uint32(0)
        for it in range(iters):
            for u in cutlass.range_constexpr(UNROLL):
                r = rR[u]
                if cutlass.const_expr(self.mode != "seq"):
                    r = r * Uint32(_LCG_MUL) + Uint32(_LCG_ADD)
                    rR[u] = r
                off = load_offset(self.mode, self.mask, r, lane, Uint32(it * UNROLL + u), Uint32)
                acc = acc ^ _load_fold(base + off, self.width)
            if cutlass.const_expr(self.sync_every > 0):
                if it % self.sync_every == self.sync_every - 1:
                    cute.arch.barrier(barrier_id=1 + tidx // 128, number_of_threads=128)
        mOut[Int32(gid)] = acc


def reference_output(mode: str, threads: int, iters: int, ctas: int):
    """Host model of the output words (numpy uint32 [ctas * threads])."""
    import numpy as np

    table_bytes, width = MODES[mode]
    mask = BankProbe(mode, threads).mask
    words = (np.arange(table_bytes // 4, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    gid = np.arange(ctas * threads, dtype=np.uint64)
    lane = gid % 32
    m32 = 0xFFFFFFFF
    r = [(gid * 0x9E3779B9 + 0x7F4A7C15 * (u + 1)) & m32 for u in range(UNROLL)]
    acc = np.zeros(gid.shape, dtype=np.uint64)
    for it in range(iters):
        for u in range(UNROLL):
            if mode != "seq":
                r[u] = (r[u] * _LCG_MUL + _LCG_ADD) & m32
            addr = load_offset(mode, mask, r[u], lane, np.uint64(it * UNROLL + u),
                               np.uint64).astype(np.int64)
            if width == 1:
                acc ^= words.view(np.uint8)[addr]
            for w in range(width // 4):
                acc ^= words[addr // 4 + w]
    return acc.astype(np.uint32)


def compile_probe(mode: str, threads: int, arch: str, cubin_dir: str | None = None,
                  sync_every: int = 0):
    """Cross-compile for `arch`: (callable(out, iters, SMs, stream), resources)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    from kquant_cute.kernels.build import compile_measured

    probe = BankProbe(mode, threads, sync_every)
    ptr = make_ptr(cutlass.Uint32, 256, cute.AddressSpace.gmem, assumed_align=16)
    fn, res, _ = compile_measured(probe, [ptr, Int32(1), Int32(1), cuda.CUstream(0)], arch,
                                  {"BankProbe": probe.table_bytes}, cubin_dir)
    return fn, res


def main(argv=None) -> int:
    import itertools

    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import make_ptr
    from peers import capture, graph_median_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--threads", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--iters", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sync-every", type=int, nargs="+", default=[0])
    a = p.parse_args(argv)
    arch = "sm_%d%da" % torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, khz = cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 0)
    out = torch.empty(sms * max(a.threads), dtype=torch.int32, device="cuda")
    ptr = make_ptr(cutlass.Uint32, out.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
    print(f"| mode | threads | sync every | ms | loads / bytes per SM-clock ({khz / 1e3:.0f} MHz) |")
    print("|---|---|---|---|---|")
    for mode, sync, threads in itertools.product(a.modes, a.sync_every, a.threads):
        fn, _ = compile_probe(mode, threads, arch, sync_every=sync)
        ms = graph_median_ms([capture(lambda: fn(ptr, Int32(a.iters), Int32(sms), cuda.CUstream(
            torch.cuda.current_stream().cuda_stream)))], a.reps)
        per_clk = threads * a.iters * UNROLL / (ms * khz)
        print(f"| {mode} | {threads} | {sync} | {ms:.3f} | {per_clk:.2f} / "
              f"{per_clk * MODES[mode][1]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast can an SM's shared memory serve random table lookups? (benchmark probe)

    python3 benchmarks/bank_probe.py [--modes pair byte ...] [--threads 512 1024]

The sqg_e4m3 decode reads one table entry per weight (or per pair of weights) at a
random 16-bit state, so a warp's addresses land in random banks and one load instruction
takes several shared-memory wavefronts. This probe measures that access pattern alone:
one CTA per SM holds a table of the decode's size and every thread issues `--iters` x 8
independent loads at pseudo-random entries (a multiply-add per load, a shift and mask for
the address, an XOR to keep the value), with nothing else in the loop. Under ncu it gives
the ceiling of the shared-memory data pipe for each access width, i.e. how busy a kernel
whose only bound is these lookups can keep it (`l1tex__data_pipe_lsu_wavefronts_mem_shared`
against its peak of one wavefront per SM-clock), and the wavefronts per instruction the
bank conflicts cost; the GEMMs' own figures are in docs/benchmarks.md.

Modes (table bytes; entry width; what in the decode it stands for):
  byte    64 KiB; 1 B random          the direct state table (one byte per weight)
  word    64 KiB; 4 B random          a 4-byte entry per 14-bit index
  pair   128 KiB; 8 B random          the K=2 pair table (one entry per two weights)
  quad   128 KiB; 16 B random         16-byte entries (a K=3 pair table's width)
  private 128 KiB; 4 B, lane's bank   32 bank-private copies of a 4 KiB table
  seq    128 KiB; 8 B, no conflicts   lane l reads entry 32 i + l: two wavefronts per load

Printed: ms (median of `--reps` launches, CUDA events), loads and bytes per SM-clock at
the clock the GPU reports as its maximum (take cycles from ncu for the exact figure).
"""

from __future__ import annotations

import argparse
import sys

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: mode -> (table bytes, load bytes)
MODES = {"byte": (1 << 16, 1), "word": (1 << 16, 4), "pair": (1 << 17, 8),
         "quad": (1 << 17, 16), "private": (1 << 17, 4), "seq": (1 << 17, 8)}
#: Independent loads per loop iteration and thread (each its own generator).
UNROLL = 8
_LCG_MUL, _LCG_ADD = 1664525, 1013904223


@dsl_user_op
def _load_fold(addr, width: int, *, loc=None, ip=None):
    """Load `width` bytes of shared memory at `addr` and fold them into one 32-bit word."""
    a = Uint32(addr).ir_value(loc=loc, ip=ip)
    if width == 1:
        body = "ld.shared.u8 $0, [$1];"
    elif width == 4:
        body = "ld.shared.u32 $0, [$1];"
    elif width == 8:
        body = "{\n\t.reg .b32 x, y;\n\tld.shared.v2.u32 {x, y}, [$1];\n\txor.b32 $0, x, y;\n\t}"
    else:
        body = ("{\n\t.reg .b32 x, y, z, w;\n\tld.shared.v4.u32 {x, y, z, w}, [$1];\n\t"
                "lop3.b32 x, x, y, z, 0x96;\n\txor.b32 $0, x, w;\n\t}")
    return Uint32(llvm.inline_asm(T.i32(), [a], body, "=r,r", loc=loc, ip=ip))


class BankProbe:
    """One specialization: `mode` (see module docstring) at `threads` per CTA."""

    def __init__(self, mode: str, threads: int, sync_every: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {sorted(MODES)}")
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads {threads} must be a multiple of 32 in 32..1024")
        if sync_every < 0 or (sync_every and threads % 128):
            raise ValueError(f"sync_every {sync_every} must be >= 0, and 0 unless threads "
                             f"({threads}) are whole warpgroups of 128")
        self.mode, self.threads = mode, threads
        # With sync_every = s > 0 each warpgroup (4 warps, its own named barrier) meets every
        # s iterations, as the four warps of a wgmma's warpgroup meet at each k step.
        self.sync_every = sync_every
        self.table_bytes, self.width = MODES[mode]
        # Address = base + (random bits & mask): entries of `width` bytes over the table;
        # private: word r of the lane's copy, copy l in bank l (word 32 r + l).
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
                if cutlass.const_expr(self.mode == "seq"):
                    addr = base + ((Uint32(it * UNROLL + u) * Uint32(256) + lane * Uint32(8))
                                   & Uint32(self.mask))
                else:
                    r = rR[u] * Uint32(_LCG_MUL) + Uint32(_LCG_ADD)
                    rR[u] = r
                    if cutlass.const_expr(self.mode == "private"):
                        addr = base + (((r >> 15) & Uint32(self.mask)) << 7) + lane * Uint32(4)
                    else:
                        addr = base + ((r >> 13) & Uint32(self.mask))
                acc = acc ^ _load_fold(addr, self.width)
            if cutlass.const_expr(self.sync_every > 0):
                if it % self.sync_every == self.sync_every - 1:
                    cute.arch.barrier(barrier_id=1 + tidx // 128, number_of_threads=128)
        mOut[Int32(gid)] = acc


def reference_output(mode: str, threads: int, iters: int, ctas: int):
    """Host model of the kernel's output words (numpy uint32 [ctas * threads]): the same
    table, generators, addresses and folds."""
    import numpy as np

    table_bytes, width = MODES[mode]
    mask = BankProbe(mode, threads).mask
    words = (np.arange(table_bytes // 4, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    raw = words.view(np.uint8)
    gid = np.arange(ctas * threads, dtype=np.uint64)
    lane = gid % threads % 32
    m32 = (1 << 32) - 1
    r = [(gid * 0x9E3779B9 + (0x7F4A7C15 * (u + 1) & m32)) & m32 for u in range(UNROLL)]
    acc = np.zeros(gid.shape, dtype=np.uint64)
    for it in range(iters):
        for u in range(UNROLL):
            if mode == "seq":
                addr = ((it * UNROLL + u) * 256 + lane * 8) & mask
            else:
                r[u] = (r[u] * _LCG_MUL + _LCG_ADD) & m32
                addr = ((((r[u] >> 15) & mask) << 7) + lane * 4 if mode == "private"
                        else (r[u] >> 13) & mask)
            addr = addr.astype(np.int64)
            if width == 1:
                v = raw[addr].astype(np.uint64)
            else:
                v = np.zeros(gid.shape, dtype=np.uint64)
                for w in range(width // 4):
                    v ^= words[addr // 4 + w].astype(np.uint64)
            acc ^= v
    return acc.astype(np.uint32)


def compile_probe(mode: str, threads: int, arch: str, cubin_dir: str | None = None,
                  sync_every: int = 0):
    """Cross-compile one specialization for `arch` (no GPU needed); returns (callable,
    measured resources). The callable takes (out pointer, iters, SM count, stream)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    from kquant_cute.kernels.build import compile_measured

    probe = BankProbe(mode, threads, sync_every)
    ptr = make_ptr(cutlass.Uint32, 256, cute.AddressSpace.gmem, assumed_align=16)
    fn, res, _ = compile_measured(probe, [ptr, Int32(1), Int32(1), cuda.CUstream(0)], arch,
                                  {"BankProbe": probe.table_bytes}, cubin_dir)
    return fn, res


def run(mode: str, threads: int, iters: int, reps: int, sync_every: int = 0) -> dict:
    """Compile and time one mode on the current GPU; returns its figures."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import make_ptr

    arch = "sm_%d%da" % torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * threads, dtype=torch.int32, device="cuda")
    ptr = make_ptr(cutlass.Uint32, out.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn, _ = compile_probe(mode, threads, arch, sync_every=sync_every)
    fn(ptr, Int32(iters), Int32(sms), stream)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(ptr, Int32(iters), Int32(sms), stream)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    err, khz = cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 0)
    clock_hz = khz * 1e3
    loads = threads * iters * UNROLL  # per SM
    per_clk = loads / (ms * 1e-3 * clock_hz)
    return {"mode": mode, "threads": threads, "ms": ms, "loads_per_sm_clock": per_clk,
            "bytes_per_sm_clock": per_clk * MODES[mode][1], "clock_mhz": clock_hz / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--threads", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--iters", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sync-every", type=int, nargs="+", default=[0],
                   help="iterations (8 loads each) between warpgroup barriers; 0: none")
    a = p.parse_args(argv)
    print("| mode | threads | sync every | ms | loads per SM-clock | bytes per SM-clock | clock MHz |")
    print("|---|---|---|---|---|---|---|")
    for mode in a.modes:
        for sync in a.sync_every:
            for threads in a.threads:
                f = run(mode, threads, a.iters, a.reps, sync)
                print(f"| {mode} | {threads} | {sync} | {f['ms']:.3f} | {f['loads_per_sm_clock']:.2f} | "
                      f"{f['bytes_per_sm_clock']:.1f} | {f['clock_mhz']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

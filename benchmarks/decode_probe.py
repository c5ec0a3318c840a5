"""Decode-only trellis kernel: the measured decode ceiling of the fused GEMM (benchmark probe).

Owns `TrellisDecode`, its cross-compile `compile_decode` and its host model
`reference_checksum`; used by `peers.DecodeCeiling`, `overlap_probe.py` and
`decode_sass.py`, never by the shipped forward. For every listed expert and 128-column N
tile of one projection, a CTA streams the expert's trellis words through the same cp.async
ring as `TrellisGemm` (`BRing.issue_b`) and decodes every weight with the same
`decode_lane_tile` into the same half2 B registers. Instead of feeding mma.sync it folds
them with packed fp16 adds (FMA pipe) into 4 registers per lane and writes their XOR, so no
decode is dead code. No A operand, no MMA, no output tile: its time is what the GEMM would
take if decoding the touched experts once were all it did. With `operands` = 2 one launch
decodes two projections of one shape (gate and up, as FC1's GEMM runs them: the operand is
the innermost index of the work items, so both projections' items of one expert and N tile
are neighbours). With `mma_rows` > 0 (a benchmark knob) every decoded tile also feeds the
GEMM's mma.sync count for that many rows from register-only A fragments: the decode + MMA
time without activations, shared-memory A or epilogue.

Layouts (raw pointers): B trellis int16 [E, k_dim/16, n_dim/16, 16*bits] (B1: the second
operand's, read only with `operands` = 2); experts int32 [n_experts] (the experts to
decode); out uint32 [n_experts * n_dim/128 * operands * THREADS], one word per thread of
each item (item = (expert x N tile) * operands + operand; the checksum `reference_checksum`
recomputes on the host); table: the codebook's state table (sqg_e4m3: uint8 [65536],
staged into shared memory by every CTA as in the GEMM, whose persistent CTAs stage it once;
ignored by the other codebooks).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from kquant_cute.kernels import ptx
from kquant_cute.kernels.bring import (DEFAULT_STAGES, K_STEPS_PER_STAGE, b_stage_bytes,
                                       operand_bases, operand_item)
from kquant_cute.kernels.decode import lane_words, persistent_grid, stage_table, table_bytes
from kquant_cute.kernels.trellis_gemm import THREADS, TrellisGemm
from kquant_cute.kernels.trellis_wgmma import max_workers


class TrellisDecode:
    """One specialization of the decode-only kernel (see module docstring)."""

    def __init__(self, *, k_dim: int, n_dim: int, bits: int, codebook: str,
                 stages: int = DEFAULT_STAGES, min_ctas_per_sm: int = 1, mma_rows: int = 0,
                 decode: bool = True, ctas_per_sm: int = 1, pair_table: bool = False,
                 workers: int = 1, table_decode: str = "direct", operands: int = 1):
        if operands not in (1, 2):
            raise ValueError(f"operands {operands!r} must be 1 or 2")
        reason = self.can_implement(k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                                    stages=stages)
        if reason is not None:
            raise ValueError(reason)
        # The GEMM of the same geometry owns the B ring layout, the decode and the sizes
        # (bits, stages, k_stages, n_tiles, min_ctas_per_sm) this kernel reads from it.
        self.gemm = TrellisGemm(block_m=8, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                codebook=codebook, topk=1, a_rows_per_token=False,
                                stages=stages, min_ctas_per_sm=min_ctas_per_sm,
                                ctas_per_sm=ctas_per_sm, pair_table=pair_table,
                                table_decode=table_decode)
        # Workers: independent 128-thread work-item loops per CTA sharing the table (as the
        # wgmma GEMM runs them beside the 128 KiB pair table), each with its own B ring.
        self.workers = workers
        self.operands = operands
        self.threads = THREADS * workers
        self.smem_bytes = self.smem(bits, stages, codebook, pair_table, workers, table_decode)
        # Benchmark knob: also run the GEMM's mma.sync count for `mma_rows` rows on every
        # decoded tile, with register-only A fragments (no shared memory, no barrier): the
        # decode + MMA ceiling. 0 = decode only (the checksum's host model holds).
        if mma_rows % 16:
            raise ValueError(f"mma_rows {mma_rows} is not a multiple of 16")
        self.m_tiles = mma_rows // 16
        # decode=False (with mma_rows): the raw trellis words stand in for the decoded
        # fragments, which times the MMAs alone with the same ring and loop.
        self.decode = decode

    @staticmethod
    def smem(bits: int, stages: int, codebook: str | None = None, pair_table: bool = False,
             workers: int = 1, table_decode: str = "direct") -> int:
        """Dynamic shared memory: the codebook's state table (or T12), then each worker's B
        ring."""
        return (table_bytes(codebook, (), pair_table, table_decode)
                + workers * stages * b_stage_bytes(bits))

    @staticmethod
    def can_implement(*, k_dim: int, n_dim: int, bits: int, codebook: str,
                      stages: int = DEFAULT_STAGES) -> str | None:
        """None when the GEMM of this geometry can be built (same decode), else the reason."""
        return TrellisGemm.can_implement(block_m=8, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                         codebook=codebook, stages=stages)

    @cute.jit
    def __call__(self, pB: cute.Pointer, pB1: cute.Pointer, pExperts: cute.Pointer,
                 pOut: cute.Pointer, pTable: cute.Pointer, n_experts: Int32, sm_count: Int32,
                 stream):
        # Table codebooks: persistent CTAs, as in the GEMM (the table is staged per CTA).
        n_items = n_experts * self.operands * self.gemm.n_tiles
        grid = n_items
        if cutlass.const_expr(self.gemm.table):
            grid = persistent_grid(n_experts * self.operands, self.gemm.n_tiles, sm_count,
                                   self.gemm.ctas_per_sm)
        self.kernel(pB, pB1, pExperts, pOut, pTable, n_items).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes,
            stream=stream, min_blocks_per_mp=self.gemm.min_ctas_per_sm, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, pB: cute.Pointer, pB1: cute.Pointer, pExperts: cute.Pointer,
               pOut: cute.Pointer, pTable: cute.Pointer, n_items: Int32):
        mExperts = ptx.flat_tensor(pExperts)
        mOut = ptx.flat_tensor(pOut)
        smem = cutlass.memory.SmemAllocator()
        tab = None
        if cutlass.const_expr(self.gemm.table):
            sT = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.gemm.table_bytes), 128)
            tab = sT.iterator.toint()
        ring_words = self.gemm.stages * self.gemm.ring.b_stage_words
        sB = smem.allocate_tensor(Uint32, cute.make_layout(self.workers * ring_words), 128)
        # The GEMMs' operand addresses (B only here: A and the output slots repeat B's and
        # are not read).
        bases = operand_bases(pB, pB, pB, pB1, pB1, pB1)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.gemm.table):
            gdim, _, _ = cute.arch.grid_dim()
            stage_table(pTable, tab, tidx, self.threads, self.gemm.table_bytes,
                        self.gemm.table_offset)
            first, stride = bidx, gdim
            if cutlass.const_expr(self.workers > 1):  # worker wk: its ring, its share of items
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                wk = tidx // THREADS
                tidx = tidx - wk * THREADS
                sB = cute.make_tensor(sB.iterator + wk * ring_words, cute.make_layout(ring_words))
                # As the GEMM deals them: consecutive items to consecutive CTAs first, so a
                # short launch reaches every SM before any SM's second worker starts.
                first, stride = bidx + wk * gdim, gdim * self.workers
            for work in range(first, n_items, stride):
                self.item(work, bases, mExperts, mOut, sB, tab, tidx)
                self.sync()  # the next item refills the ring
        else:
            self.item(bidx, bases, mExperts, mOut, sB, tab, tidx)

    def sync(self):
        """The barrier of this thread's worker (named barrier 1 + worker with workers)."""
        if cutlass.const_expr(self.workers > 1):
            t, _, _ = cute.arch.thread_idx()
            cute.arch.barrier(barrier_id=1 + t // THREADS, number_of_threads=THREADS)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def item(self, work, bases, mExperts, mOut, sB, tab, tidx):
        """Decode work item `work` ((listed expert x N tile) x operand) and write its
        checksum words."""
        b_saddr = sB.iterator.toint()
        warp = tidx // 32
        widx, q0 = lane_words(tidx % 32, self.gemm.bits)
        bidx = work
        tile, _, b_base, _ = operand_item(work, self.operands, bases)  # the GEMMs' dealing
        expert = mExperts[tile // self.gemm.n_tiles]
        nt = tile % self.gemm.n_tiles
        b_gbase = b_base + self.gemm.ring.b_tile_base(expert, nt)
        rSum = cute.make_rmem_tensor((4,), Uint32)
        rSum.fill(0)
        acc = cute.make_rmem_tensor((max(self.m_tiles, 1), 2, 4), Float32)
        acc.fill(0.0)
        rA = Uint32(tidx) * Uint32(0x00010001) ^ Uint32(0x3C003C00)  # not a constant
        # The GEMM's ring with B only (TrellisGemm.kernel issues A in the same slots).
        for s in cutlass.range_constexpr(self.gemm.stages - 1):
            if s < self.gemm.k_stages:
                self.gemm.ring.issue_b(s, s, b_gbase, b_saddr, tidx, THREADS)
            cute.arch.cp_async_commit_group()
        for ks in range(self.gemm.k_stages):
            cute.arch.cp_async_wait_group(self.gemm.stages - 2)
            self.sync()
            nxt = ks + self.gemm.stages - 1
            if nxt < self.gemm.k_stages:
                self.gemm.ring.issue_b(nxt, nxt % self.gemm.stages, b_gbase, b_saddr, tidx, THREADS)
            cute.arch.cp_async_commit_group()
            buf = ks % self.gemm.stages
            for kk in cutlass.range_constexpr(K_STEPS_PER_STAGE):
                for jj in cutlass.range_constexpr(2):
                    if cutlass.const_expr(self.decode):
                        halves = self.gemm.decode_stage(sB, buf, kk, warp, widx, q0, jj, tab)
                    else:
                        words = self.gemm.stage_words(sB, buf, kk, warp, widx, jj)
                        halves = [words[0], words[1], words[0] ^ words[1], words[-1]]
                    for pair in cutlass.range_constexpr(4):
                        rSum[pair] = ptx.hadd2(rSum[pair], halves[pair])
                    for mt in cutlass.range_constexpr(self.m_tiles):
                        for nn in cutlass.range_constexpr(2):
                            d = ptx.mma_f16_m16n8k16(rA, rA, rA, rA, halves[2 * nn],
                                                     halves[2 * nn + 1], acc[mt, nn, 0],
                                                     acc[mt, nn, 1], acc[mt, nn, 2], acc[mt, nn, 3])
                            for i in cutlass.range_constexpr(4):
                                acc[mt, nn, i] = d[i]
        cute.arch.cp_async_wait_group(0)
        word = (rSum[0] ^ rSum[1]) ^ (rSum[2] ^ rSum[3])
        if cutlass.const_expr(self.m_tiles > 0):
            total = Float32(0.0)
            for mt in cutlass.range_constexpr(self.m_tiles):
                for nn in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(4):
                        total = total + acc[mt, nn, i]
            word = word ^ Uint32(Int32(total))
        mOut[bidx * THREADS + tidx] = word


def reference_checksum(trellis, experts, codebook: str):
    """Host recomputation of the kernel's output words (torch, any device).

    `trellis` int16 [E, k/16, n/16, 16*bits], `experts` int64/int32 [X]. Per thread (warp
    w, lane L) of CTA (expert x, N tile nt), pair p accumulates the fp16 pair (weights
    8L+2p, 8L+2p+1) of tile (kt, 8*nt + 2w + jj) over kt, then jj, with one RNE rounding per
    add (exact in fp64, then rounded once); the word is the XOR of the 4 pair sums.
    Returns int64 [X * n/128 * 128] holding the uint32 words in the kernel's order."""
    import torch

    from kquant_cute import trellis as fmt

    codes = trellis[experts.long()]  # [X, KT, NT16, 16K]
    x, kt, nt16 = codes.shape[:3]
    lut = fmt.codebook_lut(codebook, codes.shape[-1] // 16, codes.device).half()
    vals = lut[fmt.tile_states(codes.reshape(-1, codes.shape[-1]))].reshape(
        x, kt, nt16 // 8, 4, 2, 32, 4, 2)  # [X, KT, nt, warp, jj, lane, pair, half]
    acc = torch.zeros(x, nt16 // 8, 4, 32, 4, 2, dtype=torch.float16, device=codes.device)
    for k in range(kt):
        for jj in range(2):
            acc = (acc.double() + vals[:, k, :, :, jj].double()).half()
    bits16 = acc.view(torch.int16).to(torch.int64) & 0xFFFF
    words = bits16[..., 0] | (bits16[..., 1] << 16)  # [X, nt, warp, lane, pair]
    out = words[..., 0] ^ words[..., 1] ^ words[..., 2] ^ words[..., 3]
    return out.reshape(-1)  # int64 holding the uint32 words


def compile_decode(*, k_dim: int, n_dim: int, bits: int, codebook: str, arch: str = "sm_90a",
                   stages: int = DEFAULT_STAGES, min_ctas_per_sm: int = 1, mma_rows: int = 0,
                   decode: bool = True, cubin_dir: str | None = None, pair_table: bool = False,
                   table_decode: str = "direct", workers: int | None = None,
                   operands: int = 1):
    """Cross-compile the decode-only kernel (`TrellisDecode`) for one projection
    shape (`operands` 2: two projections of that shape in one launch); returns (the
    JIT-compiled callable, its measured resources). The callable takes (trellis, second
    operand's trellis (any pointer with `operands` 1), experts, out, table) pointers, the expert count, the device's SM count and a
    stream; it runs only where `arch` matches the GPU. `cubin_dir` keeps the cubin there
    (for SASS reading). Table codebooks run SMs x (CTAs that fit by shared memory, at most
    `min_ctas_per_sm`) persistent CTAs, each staging the table once; `pair_table`: the K=2
    pair table (128 KiB) with `workers` 128-thread workers per CTA (default 4, as the wgmma
    GEMM runs it up to 32 rows);
    `table_decode` "t12": T12 + bijection (the table argument is then
    `kquant_cute.trellis.sqg_kernel_tables((bits,))`)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from kquant_cute.kernels.build import compile_measured
    from kquant_cute.kernels.bring import SMEM_RESERVED_PER_CTA

    ctas = 1
    if workers is None:  # the pair table: as many workers as its GEMMs run up to 32 rows
        workers = max_workers(32) if pair_table else 1
    if table_bytes(codebook):
        per_sm = cutlass.memory.get_smem_capacity_in_bytes(arch.removesuffix("a")) + SMEM_RESERVED_PER_CTA
        need = (TrellisDecode.smem(bits, stages, codebook, pair_table, workers, table_decode)
                + SMEM_RESERVED_PER_CTA)
        ctas = min_ctas_per_sm = max(1, min(min_ctas_per_sm, per_sm // need))
        if table_decode == "t12":  # as MoESpec.gemm_resident_ctas: no register cap below 255
            from kquant_cute.kernels.arch import arch_limits

            lim = arch_limits(arch)
            ctas = min_ctas_per_sm = max(1, min(ctas, lim.regs_per_sm
                                                // (THREADS * workers * lim.regs_per_thread_max)))
    probe = TrellisDecode(k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                          stages=stages, min_ctas_per_sm=min_ctas_per_sm, mma_rows=mma_rows,
                          decode=decode, ctas_per_sm=ctas, pair_table=pair_table,
                          workers=workers, table_decode=table_decode, operands=operands)
    args = [make_ptr(dt, 256, cute.AddressSpace.gmem, assumed_align=16)
            for dt in (cutlass.Int16, cutlass.Int16, cutlass.Int32, cutlass.Uint32, cutlass.Uint8)]
    compiled, resources, _ = compile_measured(
        probe, [*args, cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0)], arch,
        {"TrellisDecode": probe.smem_bytes}, cubin_dir)
    return compiled, resources

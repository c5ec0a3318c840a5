"""Grouped GEMM over route blocks with trellis-coded expert weights decoded into mma.sync.

Owns `TrellisGemm`: out[r, :] = A[row(r), :] @ W_hat[expert(r)] for every packed route r,
where W_hat is decoded from EXL3-style trellis codes (16x16 tiles, K bits per weight)
straight into m16n8k16 B fragments in registers. Work item = (route block of `block_m`
rows of one expert, 128-column N tile); each work item decodes the expert's weights for
its N tile once and reuses them for the block's rows. Only the 16-row m tiles that hold
real rows run their MMAs (the real rows are a prefix of the block; one main-loop copy per
m-tile count, picked by a CTA-uniform ballot), so a padding-heavy block, typically an
expert's last, costs MMAs for its real rows only. Accumulation is fp32 and the
per-element reduction order over K is the same for every block size, so outputs are
bitwise equal across block sizes.

Layouts (row-major, raw pointers; sizes that are run-time are Int32 arguments):
- A: fp16 [rows, k_dim]; row(r) = r // topk when `a_rows_per_token` else r. A padding
  slot's copies read nothing (cp.async zero-fill); `zero_row` is only their nominal address.
  (Reading a real zero row would send every padding copy of the GPU to the same few L2
  lines, and a wide block of a lightly routed expert is mostly padding.)
- B: trellis int16 [E, k_dim/16, n_dim/16, 16*bits], read as uint32 words.
- sorted_routes: int32 [slots] packed route ids (sentinel >= n_routes for padding);
  block_expert: int32 [blocks] (-1 = empty); num_padded: int32 [1] packed slot count.
- out: fp32 [n_routes, n_dim], row r written for every real packed route r.
- table (sqg_e4m3 only): uint8 [65536], the E4M3FN byte of every 16-bit state
  (`kquant_cute.trellis.sqg_state_table`). Each CTA stages it into shared memory once and
  then loops over work items (grid = SMs x resident CTAs, `ctas_per_sm`), so the 64 KiB
  copy is paid per resident CTA, not per work item (`kernels/decode.py`). With
  `pair_table` the table is the 128 KiB K=2 pair table (`kquant_cute.trellis.sqg_pair_table`,
  `decode.decode_lane_tile_pair`) instead; the wgmma GEMM runs it on sm_90a.

The B ring (trellis words per stage, mixed-rate bookkeeping) is `kernels/bring.py`'s
`BRing`; the decode of its words into B fragments is `kernels/decode.py`'s, shared with
`TrellisWgmma`.

Mixed rates (`bits_set`, QSRT `k3x22_k4x2`; docs/mixed_rates.md): K changes along the
intermediate axis, which is this GEMM's `rate_axis` ("n" for FC1, "k" for FC2). Run-time
rate maps give K and the trellis word index of each 16-wide tile of that axis per expert
(`rate_bits` uint8 [E, tiles], `rate_words` int32 [E, tiles]; FC1: index of tile (0, j),
consecutive k tiles `k_tile_words` apart; FC2: index of row tile i, its 16-column tiles
8 K words apart). K is one value per pipeline stage: an FC1 work item's N tile (128
columns) and an FC2 stage's 4 k tiles (64 rows) each lie in one K (QSRT records are 128
channels; the layer checks it). Per stage a branch uniform over the work item's threads
picks the K-specialized copy and decode; the B ring is sized for the widest K (`bits` = max(bits_set)) and every
rate's 64 KiB state table is resident, in `bits_set` order. A uniform layer (`bits_set`
empty) compiles none of this.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import ptx
from .bring import (DEFAULT_STAGES, K_STEPS_PER_STAGE, TILE_N, BRing, GemmClass,
                    b_stage_bytes, check_geometry, operand_bases, operand_item)
from .decode import (check_pair_table, decode_tile, lane_words, persistent_grid, stage_table,
                     table_bytes, table_note, table_offset)

NUM_WARPS = 4
THREADS = 32 * NUM_WARPS
A_ROW_HALVES = 16 * K_STEPS_PER_STAGE + 8  # padded smem row: conflict-free ldmatrix


STAGE_ROW_FLOATS = 32 + 8  # padded fp32 row of a warp's 16 x 32 epilogue chunk (conflict-free v2 stores)
WARP_STAGE_FLOATS = 16 * STAGE_ROW_FLOATS


def a_smem_halves(block_m: int, stages: int) -> int:
    """fp16 elements of the A region: the A ring ([stages, m_pad, A_ROW_HALVES]), which the
    epilogue reuses for its per-warp staging chunks (whichever is larger)."""
    m_pad = (block_m + 15) // 16 * 16
    return max(stages * m_pad * A_ROW_HALVES, NUM_WARPS * WARP_STAGE_FLOATS * 2)


def smem_bytes(block_m: int, bits: int, stages: int, codebook: str | None = None,
               bits_set: tuple = (), pair_table: bool = False,
               table_decode: str = "direct") -> int:
    """Dynamic shared memory of one CTA: the codebook's state tables, the A region (ring /
    epilogue staging) and the B ring (sized for `bits`, the widest K)."""
    return (table_bytes(codebook, bits_set, pair_table, table_decode)
            + a_smem_halves(block_m, stages) * 2
            + stages * b_stage_bytes(bits))


class TrellisGemm(GemmClass):
    """One specialization of the trellis grouped GEMM (see module docstring)."""

    kind = "sync"
    instruction = "mma.sync"
    kernel_tag = ""

    def __init__(self, *, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                 topk: int, a_rows_per_token: bool, stages: int = DEFAULT_STAGES,
                 min_ctas_per_sm: int = 1, ctas_per_sm: int = 1, bits_set: tuple = (),
                 rate_axis: str = "n", span: int = 1, workers: int = 1,
                 pair_table: bool = False, table_decode: str = "direct"):
        reason = self.can_implement(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                    codebook=codebook, stages=stages, bits_set=bits_set,
                                    rate_axis=rate_axis, span=span, workers=workers,
                                    pair_table=pair_table, table_decode=table_decode)
        if reason is not None:
            raise ValueError(reason)
        self.block_m = block_m
        self.k_dim = k_dim
        self.n_dim = n_dim
        self.bits = bits
        self.codebook = codebook
        self.topk = topk
        self.a_rows_per_token = a_rows_per_token
        self.stages = stages
        # Register-allocation target (nvvm.minctasm): CTAs that must fit on one SM.
        self.min_ctas_per_sm = min_ctas_per_sm
        # Table codebooks: resident CTAs per SM of the persistent grid (SMs x this).
        self.ctas_per_sm = ctas_per_sm
        # The trellis words' ring (and, for mixed rates, each stage's K: module docstring).
        self.ring = BRing(k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                          stages=stages, bits_set=bits_set, rate_axis=rate_axis,
                          table_decode=table_decode)
        self.table = self.ring.table
        self.mixed = self.ring.mixed
        self.bits_set = self.ring.bits_set
        self.rates = self.ring.rates
        # K=2 pair table (128 KiB, `decode.decode_lane_tile_pair`) instead of the direct table.
        self.pair_table = pair_table
        self.table_bytes = table_bytes(codebook, self.bits_set, pair_table, table_decode)
        # Direct tables or T12 + bijection (`MoESpec.table_decode`), and where the staged
        # bytes start in the table argument.
        self.table_decode = table_decode
        self.table_offset = table_offset(codebook, self.bits_set, table_decode)
        # Derived once.
        self.m_tiles = (block_m + 15) // 16
        self.m_pad = 16 * self.m_tiles
        self.k_stages = self.ring.k_stages
        self.n_tiles = self.ring.n_tiles
        self.a_chunks = block_m * (K_STEPS_PER_STAGE * 16 * 2 // 16)  # 16-byte copies per stage
        self.a_iters = (self.a_chunks + THREADS - 1) // THREADS
        self.threads = THREADS
        self.smem_bytes = smem_bytes(block_m, bits, stages, codebook, self.bits_set, pair_table,
                                     table_decode)

    @staticmethod
    def threads_for(**args) -> int:
        """Threads per CTA: one warpgroup, whatever the geometry."""
        return THREADS

    @staticmethod
    def smem_bytes_for(*, block_m: int, bits: int, stages: int = DEFAULT_STAGES,
                       codebook: str | None = None, bits_set: tuple = (),
                       pair_table: bool = False, table_decode: str = "direct", **args) -> int:
        """Dynamic shared memory of one CTA (`smem_bytes`)."""
        return smem_bytes(block_m, bits, stages, codebook, bits_set, pair_table, table_decode)

    @staticmethod
    def can_implement(*, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                      stages: int = DEFAULT_STAGES, smem_limit: int | None = None,
                      topk: int = 1, a_rows_per_token: bool = False,
                      min_ctas_per_sm: int = 1, ctas_per_sm: int = 1, bits_set: tuple = (),
                      rate_axis: str = "n", span: int = 1, workers: int = 1,
                      pair_table: bool = False, table_decode: str = "direct") -> str | None:
        """None when this geometry compiles to a valid kernel, else the reason (takes the
        constructor's arguments; `smem_limit`: the target's per-block shared memory)."""
        if span != 1:
            return f"span {span!r}: mma 'sync' runs one route block per work item (span 1)"
        if workers != 1:
            return f"workers {workers!r}: mma 'sync' runs one work-item loop per CTA"
        reason = check_geometry(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                codebook=codebook, stages=stages, bits_set=bits_set,
                                rate_axis=rate_axis, table_decode=table_decode)
        if reason is None and pair_table:
            reason = check_pair_table(bits, bits_set, codebook, table_decode)
        if reason is not None:
            return reason
        need = smem_bytes(block_m, bits, stages, codebook, bits_set, pair_table, table_decode)
        if smem_limit is not None and need > smem_limit:
            return (f"shared memory {need:,} B"
                    f"{table_note(codebook, bits_set, pair_table, table_decode)} > "
                    f"{smem_limit:,} B per-block limit")
        return None

    @cute.jit
    def __call__(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
                 pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOffsets: cute.Pointer,
                 pCounts: cute.Pointer, pOut: cute.Pointer, pA1: cute.Pointer,
                 pB1: cute.Pointer, pOut1: cute.Pointer, operands: Int32, n_routes: Int32,
                 zero_row: Int32, max_blocks: Int32, pTable: cute.Pointer, sm_count: Int32,
                 pRateBits: cute.Pointer, pRateWords: cute.Pointer, k_tile_words: Int32, stream):
        # The call every GEMM of the registry takes; this one does not read the per-expert
        # offsets and counts (`pOffsets`, `pCounts`: one route block per work item).
        # One CTA per possible work item (the plan's block bound x N tiles); CTAs past the
        # packed block count exit at once, and the hardware scheduler balances the rest.
        # Table codebooks: one persistent CTA per resident slot instead (see module doc).
        # `operands` (1 or 2) GEMMs of one shape in one launch (FC1's two slots): operand 1
        # reads pA1 / pB1 and writes pOut1; its work items interleave with operand 0's.
        grid = max_blocks * operands * self.n_tiles
        if cutlass.const_expr(self.table):
            grid = persistent_grid(max_blocks * operands, self.n_tiles, sm_count,
                                   self.ctas_per_sm)
        self.kernel(pA, pB, pSorted, pBlockExpert, pNumPadded, pOut, pA1, pB1, pOut1, operands,
                    n_routes, zero_row, pTable, pRateBits, pRateWords, k_tile_words).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes,
            stream=stream, min_blocks_per_mp=self.min_ctas_per_sm, preferred_smem_carveout=100)

    def issue_a(self, ks, buf, a_gaddr, a_saddr, rAsrc, rAbytes, tidx):
        """cp.async the A rows of pipeline stage `ks` into buffer `buf` (padding rows: zeros)."""
        for i in range(self.a_iters):
            q = (tidx + THREADS * i) % self.a_chunks
            row = q // 8
            col = q % 8
            src = a_gaddr + (rAsrc[i] * self.k_dim + ks * (16 * K_STEPS_PER_STAGE) + col * 8) * 2
            dst = a_saddr + ((buf * self.m_pad + row) * A_ROW_HALVES + col * 8) * 2
            if THREADS * (i + 1) > self.a_chunks:
                # Threads past the last chunk (M = 8: 64 chunks, 128 threads) would repeat an
                # earlier chunk: same bytes, same place, but two unordered writes of one
                # address (racecheck: a write-write hazard), so they copy nothing.
                ptx.cp_async_16_if(Int32(cutlass.select_(tidx + THREADS * i < self.a_chunks, 1, 0)),
                                   dst, src, rAbytes[i])
                continue
            ptx.cp_async_16(dst, src, rAbytes[i])

    @cute.jit
    def store_tile(self, out_addr, s_addr, acc, rRoute0, rRoute1, nt, warp, lane, n_routes):
        """Epilogue, per warp, 16 rows at a time: the warp's fp32 accumulators (its 32
        columns) go through its own 16 x 32 chunk of the drained A ring, then each group of 8
        lanes writes one route row's 128 contiguous bytes (16 per lane). Route ids come from
        registers loaded before the main loop (lane l: rows l and 32 + l); reading them here
        put one dependent L2 round trip before every row's store."""
        g = lane // 4
        c = lane % 4
        w_addr = s_addr + warp * (WARP_STAGE_FLOATS * 4)
        for mt in cutlass.range_constexpr(self.m_tiles):
            for hf in cutlass.range_constexpr(2):
                for nn in cutlass.range_constexpr(4):
                    ptx.st_shared_v2_f32(w_addr + ((hf * 8 + g) * STAGE_ROW_FLOATS + nn * 8 + 2 * c) * 4,
                                         acc[mt, nn, 2 * hf], acc[mt, nn, 2 * hf + 1])
            cute.arch.sync_warp()
            for i in cutlass.range_constexpr(4):
                row0 = mt * 16 + 4 * i  # rows row0 .. row0 + 3, one per 8 lanes
                if cutlass.const_expr(row0 < self.block_m):
                    local = 4 * i + lane // 8
                    if cutlass.const_expr(row0 < 32):
                        r = cute.arch.shuffle_sync(rRoute0, row0 + lane // 8)
                    else:
                        r = cute.arch.shuffle_sync(rRoute1, row0 - 32 + lane // 8)
                    if r < n_routes:
                        ptx.copy_shared_to_global_16(
                            out_addr + (Int64(r) * self.n_dim + nt * TILE_N + warp * 32 + (lane % 8) * 4) * 4,
                            w_addr + (local * STAGE_ROW_FLOATS + (lane % 8) * 4) * 4)
            cute.arch.sync_warp()  # the chunk is rewritten by the next 16 rows

    @cute.jit
    def dispatch(self, n_mt: cutlass.Constexpr, n_used, sB, a_gaddr, a_saddr, rAsrc, rAbytes,
                 b_gbase, b_saddr, acc, tidx, warp, widx, q0, tab, lm_row, lm_col):
        """`main_loop` specialized for the run-time count `n_used` of m tiles with real rows
        (one copy per count from `n_mt` up to all of them)."""
        if cutlass.const_expr(n_mt == self.m_tiles):
            self.main_loop(n_mt, sB, a_gaddr, a_saddr, rAsrc, rAbytes, b_gbase, b_saddr, acc,
                           tidx, warp, widx, q0, tab, lm_row, lm_col)
        else:
            if n_used <= n_mt:
                self.main_loop(n_mt, sB, a_gaddr, a_saddr, rAsrc, rAbytes, b_gbase, b_saddr,
                               acc, tidx, warp, widx, q0, tab, lm_row, lm_col)
            else:
                self.dispatch(n_mt + 1, n_used, sB, a_gaddr, a_saddr, rAsrc, rAbytes, b_gbase,
                              b_saddr, acc, tidx, warp, widx, q0, tab, lm_row, lm_col)

    @cute.jit
    def main_loop(self, n_mt: cutlass.Constexpr, sB, a_gaddr, a_saddr, rAsrc, rAbytes, b_gbase,
                  b_saddr, acc, tidx, warp, widx, q0, tab, lm_row, lm_col):
        """The cp.async ring over the K stages, accumulating the first `n_mt` m tiles."""
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < self.k_stages:
                self.issue_a(s, s, a_gaddr, a_saddr, rAsrc, rAbytes, tidx)
                self.ring.copy_b(s, s, b_gbase, b_saddr, tidx, THREADS)
            cute.arch.cp_async_commit_group()
        for ks in range(self.k_stages):
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.sync_threads()
            nxt = ks + self.stages - 1
            if nxt < self.k_stages:
                self.issue_a(nxt, nxt % self.stages, a_gaddr, a_saddr, rAsrc, rAbytes, tidx)
                self.ring.copy_b(nxt, nxt % self.stages, b_gbase, b_saddr, tidx, THREADS)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.mixed):
                K, _ = self.ring.stage_rate(ks, b_gbase)
                self.ring.for_rate(0, K, self.mma_stage_at_rate,
                              (n_mt, sB, ks % self.stages, a_saddr, acc, warp, widx, tab,
                               lm_row, lm_col))
            else:
                self.mma_stage(n_mt, sB, ks % self.stages, a_saddr, acc, warp, widx, q0, tab,
                               lm_row, lm_col)

    @cute.jit
    def mma_stage(self, n_mt: cutlass.Constexpr, sB, buf, a_saddr, acc, warp, widx, q0, tab,
                  lm_row, lm_col, bits=None):
        """Decode this warp's B fragments of stage buffer `buf` and accumulate the rows of the
        first `n_mt` m tiles (`bits`: the stage's K, mixed rates only)."""
        for kk in cutlass.range_constexpr(K_STEPS_PER_STAGE):
            rBf = cute.make_rmem_tensor((2, 4), Uint32)
            for jj in cutlass.range_constexpr(2):
                halves = self.decode_stage(sB, buf, kk, warp, widx, q0, jj, tab, bits)
                for pair in cutlass.range_constexpr(4):
                    rBf[jj, pair] = halves[pair]
            for mt in cutlass.range_constexpr(n_mt):
                a_addr = a_saddr + ((buf * self.m_pad + mt * 16 + lm_row) * A_ROW_HALVES
                                    + kk * 16 + lm_col) * 2
                a0, a1, a2, a3 = ptx.ldmatrix_x4(a_addr)
                for nn in cutlass.range_constexpr(4):
                    jj = nn // 2
                    hh = nn % 2
                    d0, d1, d2, d3 = ptx.mma_f16_m16n8k16(
                        a0, a1, a2, a3, rBf[jj, 2 * hh], rBf[jj, 2 * hh + 1],
                        acc[mt, nn, 0], acc[mt, nn, 1], acc[mt, nn, 2], acc[mt, nn, 3])
                    acc[mt, nn, 0] = d0
                    acc[mt, nn, 1] = d1
                    acc[mt, nn, 2] = d2
                    acc[mt, nn, 3] = d3

    def stage_words(self, sB, buf, kk, warp, widx, jj, bits=None):
        """This lane's trellis words of tile (k step kk, 16-column tile 2*warp + jj) in
        stage buffer `buf`."""
        return self.ring.tile_words_at(sB, buf, kk, warp * 2 + jj, widx, bits)

    def decode_stage(self, sB, buf, kk, warp, widx, q0, jj, tab=None, bits=None):
        """This lane's 4 half2 B registers of tile (k step kk, 16-column tile 2*warp + jj)
        (`tab`: the state table's shared-memory address, table codebooks only)."""
        bits = self.bits if bits is None else bits
        return decode_tile(self.stage_words(sB, buf, kk, warp, widx, jj, bits), q0, bits,
                           self.codebook, tab, self.pair_table, self.table_decode, kk)

    # -- mixed rates (module docstring) -------------------------------------------------

    @cute.jit
    def mma_stage_at_rate(self, bits: cutlass.Constexpr, n_mt: cutlass.Constexpr, sB, buf,
                          a_saddr, acc, warp, lanes, tab, lm_row, lm_col):
        """`mma_stage` of a stage of `bits` K (its lane windows and state table)."""
        widx, q0 = lanes[bits]
        self.mma_stage(n_mt, sB, buf, a_saddr, acc, warp, widx, q0, self.ring.rate_table(tab, bits),
                       lm_row, lm_col, bits)

    @cute.kernel
    def kernel(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
               pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOut: cute.Pointer,
               pA1: cute.Pointer, pB1: cute.Pointer, pOut1: cute.Pointer, operands: Int32,
               n_routes: Int32, zero_row: Int32, pTable: cute.Pointer, pRateBits: cute.Pointer,
               pRateWords: cute.Pointer, k_tile_words: Int32):
        big = 1 << 30
        mSorted = cute.make_tensor(pSorted, cute.make_layout(big))
        mBlockExpert = cute.make_tensor(pBlockExpert, cute.make_layout(big))
        mNumPadded = cute.make_tensor(pNumPadded, cute.make_layout(1))
        gaddrs = operand_bases(pA, pB, pOut, pA1, pB1, pOut1)

        smem = cutlass.memory.SmemAllocator()
        tab = None
        if cutlass.const_expr(self.table):
            sT = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.table_bytes), 128)
            tab = sT.iterator.toint()
        sA = smem.allocate_tensor(cutlass.Float16, cute.make_layout(a_smem_halves(self.block_m, self.stages)), 128)
        sB = smem.allocate_tensor(Uint32, cute.make_layout(self.stages * self.ring.b_stage_words), 128)
        a_saddr = sA.iterator.toint()
        b_saddr = sB.iterator.toint()

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        # Lane-constant part of the trellis bit window: weights 8*lane .. 8*lane+7 (mixed
        # rates: one window per rate, widx = {K: (words, q0)}).
        rates = None
        if cutlass.const_expr(self.mixed):
            widx, q0 = {k: lane_words(lane, k) for k in self.rates}, None
            rates = (cute.make_tensor(pRateBits, cute.make_layout(big)),
                     cute.make_tensor(pRateWords, cute.make_layout(big)), k_tile_words)
        else:
            widx, q0 = lane_words(lane, self.bits)
        # ldmatrix row address of this lane inside one 16-row m tile.
        lm_row = ((lane // 8) % 2) * 8 + lane % 8
        lm_col = (lane // 16) * 8

        num_blocks = mNumPadded[0] // self.block_m
        total = num_blocks * operands * self.n_tiles
        rAsrc = cute.make_rmem_tensor((self.a_iters,), Int32)
        rAbytes = cute.make_rmem_tensor((self.a_iters,), Int32)
        acc = cute.make_rmem_tensor((self.m_tiles, 4, 4), Float32)
        lane_ctx = (tidx, warp, lane, widx, q0, tab, lm_row, lm_col)
        if cutlass.const_expr(self.table):
            # Persistent CTA: stage the state table once, then every grid-th work item.
            gdim, _, _ = cute.arch.grid_dim()
            if bidx < total:
                stage_table(pTable, tab, tidx, THREADS, self.table_bytes, self.table_offset)
            for work in range(bidx, total, gdim):
                self.work_item(work, operands, mSorted, mBlockExpert, gaddrs, n_routes,
                               zero_row, a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx,
                               rates)
                cute.arch.sync_threads()  # the next item's copies overwrite the epilogue chunks
            cute.arch.cp_async_wait_group(0)  # a CTA whose items were all empty: the table
        else:
            work = bidx
            if work < total:
                self.work_item(work, operands, mSorted, mBlockExpert, gaddrs, n_routes,
                               zero_row, a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx,
                               rates)

    @cute.jit
    def work_item(self, work, operands, mSorted, mBlockExpert, gaddrs, n_routes, zero_row,
                  a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx, rates=None):
        """Work item `work` (route block x N tile x operand): A sources, MMAs, epilogue
        (`rates`: the rate-map tensors and FC1 k-tile stride, mixed rates only)."""
        tidx, warp, lane, widx, q0, tab, lm_row, lm_col = lane_ctx
        item, a_gaddr, b_gaddr, out_gaddr = operand_item(work, operands, gaddrs)
        blk = item // self.n_tiles
        nt = item - blk * self.n_tiles
        # Route ids are read before the expert so the loads overlap.
        # Source rows of this thread's A copies (padding slots: zero-filled, nothing read).
        for i in cutlass.range_constexpr(self.a_iters):
            row = ((tidx + THREADS * i) % self.a_chunks) // 8
            r = mSorted[blk * self.block_m + row]
            a_row = r
            if self.a_rows_per_token:
                a_row = r // self.topk
            rAsrc[i] = Int32(cutlass.select_(r < n_routes, a_row, zero_row))
            rAbytes[i] = Int32(cutlass.select_(r < n_routes, 16, 0))
        # The epilogue's route ids: lane l holds rows l and 32 + l (clamped to the block).
        rRoute0 = Int32(mSorted[blk * self.block_m + cutlass.min(lane, self.block_m - 1)])
        rRoute1 = rRoute0
        if cutlass.const_expr(self.block_m > 32):
            rRoute1 = Int32(mSorted[blk * self.block_m + 32 + cutlass.min(lane, self.block_m - 33)])
        expert = mBlockExpert[blk]
        if expert >= 0:
            acc.fill(0.0)
            if cutlass.const_expr(self.mixed):
                b_gbase = self.ring.rate_context(b_gaddr, *rates, expert, nt)
            else:
                b_gbase = b_gaddr + self.ring.b_tile_base(expert, nt)
            # Only the m tiles holding real rows (a prefix of the block) run their MMAs:
            # typically the last block of an expert. Every
            # warp computes the same ballots, so the branch is uniform across the CTA
            # (the loop has barriers).
            n_used = Int32(1)
            if cutlass.const_expr(self.m_tiles > 1):
                n_real = cute.arch.popc(cute.arch.vote_ballot_sync(
                    (lane < cutlass.min(self.block_m, 32)) & (rRoute0 < n_routes)))
                if cutlass.const_expr(self.block_m > 32):
                    n_real = n_real + cute.arch.popc(cute.arch.vote_ballot_sync(
                        (lane < self.block_m - 32) & (rRoute1 < n_routes)))
                n_used = (n_real + 15) // 16
            self.dispatch(1, n_used, sB, a_gaddr, a_saddr, rAsrc, rAbytes, b_gbase, b_saddr,
                          acc, tidx, warp, widx, q0, tab, lm_row, lm_col)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # every warp is done with the A ring it stages through
            self.store_tile(out_gaddr, a_saddr, acc, rRoute0, rRoute1, nt, warp, lane, n_routes)

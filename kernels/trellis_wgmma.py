"""sm_90a trellis grouped GEMM: decoded weights as the register A operand of async wgmma
(the default GEMM on sm_90a, `MoESpec.mma`; other archs use `TrellisGemm`'s mma.sync).

Owns `TrellisWgmma`. Same contract, layouts and work items as `TrellisGemm` (route block
of `block_m` rows x 128-column N tile), computed transposed: out^T = W_hat^T A^T.
- A operand (m64 x k16, registers): 64 output columns of W_hat^T. A decoded 16x16 trellis
  tile is this lane's m16n8k16 B fragment of W_hat, which is the A fragment of W_hat^T
  with the middle two registers swapped (h0, h2, h1, h3).
- B operand (k16 x n, shared memory, K-major, 128-byte swizzle): the work item's
  activation rows, n = its rows (no padding to 16). Row r of a 64-k stage is 128 bytes at
  r * 128, its 16-byte chunk c stored at chunk c ^ (r % 8), so the 8 threads of a quarter
  warp that copy one row's 128 global bytes hit 8 distinct bank groups. (Unswizzled
  8 x 16-byte core matrices would put all 8 in the same 4 banks.)
- Accumulators: two m64 x n fp32 tiles (output columns 0..63 and 64..127), n registers
  per thread (n = the work item's rows; above 64 rows two warpgroups of 64 columns each,
  except a worker's item of up to `WORKER_ROWS` rows, below).
- Epilogue: each lane stores its accumulators straight from registers to the fp32 output
  rows (`store_tile`; 8 lanes fill one 32-byte sector), so a worker's shared memory is its
  two rings: no transposing tile (16.5 KiB at 32 rows), which would cost a worker or a
  ring stage beside the tables.
Spans (`span` > 1): one work item covers `span` consecutive route blocks of one expert
(rows = span x block_m, the wgmma n), so an expert with up to that many routed rows is
decoded once per N tile instead of once per block. The leader CTA of a span (the block
whose index within its expert's blocks is a multiple of `span`) does the work; the others
exit. A persistent grid deals groups of `span` consecutive blocks (each holds a leader), so
the empty items do not take a worker's turn. With rows > 64 the CTA has two warpgroups,
each owning 64 of the 128 columns (one m64 wgmma per k step), so accumulators stay at
rows / 2 per thread.
Real rows are a prefix of the work item (per-expert counts from the route pack): rows past
them are neither copied nor stored, and the wgmma n is the smallest of `n_variants`
(multiples of 16) that covers them, one main-loop copy per variant.
Each k step: wait until the group `steps_in_flight` steps back has finished (its A
registers are free; two steps, or one where that makes room for one more worker:
`wgmma_steps_in_flight`), decode the warp's tiles, fence, async wgmma, commit. Stage
buffers are refilled only after every wgmma of the previous stage has finished (a drain
at each stage top; refilling mid-stage instead made ptxas serialize the wgmmas, C7513).
Bitwise equality across block sizes and spans holds within this kernel (same k order,
same wgmma shape per k step); it does not hold between this kernel and mma.sync, so the
plans of one layer always share the MMA kind.
Table codebooks (sqg_e4m3): as in `TrellisGemm`, the 64 KiB state table sits in front of
the rings, each CTA stages it once and loops over work items (persistent grid). The B
ring is `kernels/bring.py`'s `BRing` and the decode `kernels/decode.py`'s, both shared
with `TrellisGemm`. With `pair_table` (uniform K=2, `MoESpec.pair_table`) the table is
the 128 KiB pair table (`decode.decode_lane_tile_pair`: one 8-byte load per two weights
instead of two byte loads), which also leaves one CTA per SM: the CTA runs workers as
below.
Mixed rates (`bits_set`, see `TrellisGemm`): per stage a branch on the stage's K (uniform
over the work item) picks the K-specialized copy and k steps; each branch waits for its own
wgmmas before the branches merge (a wgmma in flight across a branch would make ptxas
serialize the pipeline), which is where the uniform loop waits anyway (the drain at the
next stage's top). One state table per rate (128 KiB for {3, 4}) leaves shared memory for
one CTA per SM.
Workers: where the tables leave one CTA per SM (the pair table, mixed rates), the CTA runs
`workers` = 2..6 independent one-warpgroup workers that share the tables, as many as fit
(`workers_for`) and as the register cap allows (`max_workers`: a worker's thread
holds one fp32 accumulator per row of its item): each has its own rings, its own named barrier,
and its own share of the CTA's work items, which is what several uniform CTAs on the SM
would do (one's prologue, epilogue and stage-top drain overlap the others' decode, and
more warpgroups keep more table loads queued on the banks). A plan gives up a ring stage
where that adds a worker (`default_stages`; the pair table down to 2 stages). A worker's
item may hold up to `WORKER_ROWS` (96) rows on its one warpgroup (48 x 2 with the pair
table: three workers on 2-stage rings, one k step in flight). Where two workers'
rings do not fit beside the tables (three rates from M=16, items over 96 rows) one worker
runs each work item on two warpgroups (64 columns each).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import ptx
from .bring import (DEFAULT_STAGES, K_STEPS_PER_STAGE, TILE_N, BRing, GemmClass,
                    b_stage_bytes, check_geometry, operand_bases, operand_item)
from .decode import (TABLE_CODEBOOKS, check_pair_table, decode_tile, lane_words,
                     persistent_grid, stage_table, table_bytes, table_note, table_offset)
from .trellis_gemm import NUM_WARPS, THREADS

CORE_ROWS = 8  # rows of a wgmma core matrix (the swizzle period)
K_STEP_BYTES = 16 * 2  # one 16-wide k step of an fp16 activation row
STAGE_ROW_BYTES = K_STEPS_PER_STAGE * K_STEP_BYTES  # one activation row of a stage
ROW_GROUP_BYTES = CORE_ROWS * STAGE_ROW_BYTES  # 8 rows of a stage: one swizzle atom
assert STAGE_ROW_BYTES == 128, "the 128-byte swizzle needs 64-k stages (one row = 128 B)"


SPANS = (1, 2, 4)
MAX_SPAN_ROWS = 128  # wgmma n of one work item (accumulators: rows / 2 per thread)


def a_stage_bytes(rows: int) -> int:
    return rows * STAGE_ROW_BYTES


#: Rows of the widest one-warpgroup work item of a worker (`rows` accumulators per thread).
WORKER_ROWS = 96


def warpgroups(rows: int, mixed: bool = False, workers: int = 1) -> int:
    """Warpgroups per work item: two (64 columns each) once one would hold > 32
    accumulators, and for mixed rates with one worker per CTA (module docstring); one for a
    worker's item of up to `WORKER_ROWS` rows."""
    if workers > 1:
        return 1
    return 2 if rows > 64 or mixed else 1


def a_region_bytes(rows: int, stages: int) -> int:
    """A worker's activation ring. Work items are whole 8-row groups, so the ring is whole
    1024-byte swizzle atoms and a second worker's ring starts on one. (The epilogue stores
    from registers: no tile of its own.)"""
    assert rows % CORE_ROWS == 0, f"work items are whole {CORE_ROWS}-row groups, not {rows}"
    return stages * a_stage_bytes(rows)


def smem_bytes(block_m: int, bits: int, stages: int, span: int = 1,
               codebook: str | None = None, bits_set: tuple = (), workers: int = 1,
               pair_table: bool = False, table_decode: str = "direct") -> int:
    """The codebook's state tables, then per worker the activation ring and the B ring
    (sized for `bits`, the widest K)."""
    return (table_bytes(codebook, bits_set, pair_table, table_decode)
            + workers * (a_region_bytes(span * block_m, stages) + stages * b_stage_bytes(bits)))


#: T12 layers keep two workers: the register cap of more threads per CTA makes ptxas
#: spill in the bijection.
T12_MAX_WORKERS = 2
#: Most workers by work-item rows, as `(rows, with two k steps' wgmmas in flight, with one)`
#: (a one-warpgroup item holds `rows` fp32 accumulators per thread; w workers cap a thread
#: at 65,536 / (128 w) registers). ptxas, sm_90a, the pair table's GEMM with two steps in
#: flight spills with 32 rows at 96 registers (5 workers), 48 at 128 (4) and 64 at 168 (3).
#: Mixed rates: two steps in flight only.
ROWS_MAX_WORKERS = ((32, 4, 4), (48, 3, 3), (64, 2, 2), (WORKER_ROWS, 2, 2))
#: The pair table's GEMM: 6 workers up to 16 rows (6 x 16,384 B of rings fit beside the 128
#: KiB table; ptxas fits 79 registers of the 80 a thread of 768 may use; 8 workers spill).
#: From 17 to 96 rows one more worker than two steps in flight allow, with one: the k loop
#: then waits for the previous step's wgmma before it decodes (one step's A registers live
#: instead of two), 95 / 123 / 156 / 154 registers at 5 / 4 / 3 / 3 workers (32 / 48 / 64 /
#: 48 x 2 rows; the last on 2-stage rings), no spills. One step in
#: flight is faster only where it adds a worker (docs/benchmarks.md, "Workers and wgmmas in
#: flight"), so a kernel runs it only there (`wgmma_steps_in_flight`).
PAIR_ROWS_MAX_WORKERS = ((16, 6, 6), (32, 4, 5), (48, 3, 4), (64, 2, 3), (WORKER_ROWS, 2, 3))
#: The worker counts a CTA may run (`check_workers`).
WORKERS = tuple(range(1, max(w for _, _, w in PAIR_ROWS_MAX_WORKERS) + 1))


def _worker_caps(rows: int, pair_table: bool) -> tuple[int, int]:
    """(most workers with two k steps in flight, with one) for a work item of `rows` rows."""
    caps = PAIR_ROWS_MAX_WORKERS if pair_table else ROWS_MAX_WORKERS
    for r, two, one in caps:
        if rows <= r:
            return two, one
    raise ValueError(f"a worker's item holds at most {WORKER_ROWS} rows, not {rows}")


def max_workers(rows: int, table_decode: str = "direct", pair_table: bool = False) -> int:
    """The most workers whose register cap holds a work item of `rows` rows (T12: 2)."""
    top = _worker_caps(rows, pair_table)[1]
    return min(top, T12_MAX_WORKERS) if table_decode == "t12" else top


def wgmma_steps_in_flight(rows: int, workers: int, pair_table: bool = False) -> int:
    """k steps whose wgmmas the k loop keeps in flight: 2, or 1 where `workers` is more
    than two steps' A registers leave room for (`PAIR_ROWS_MAX_WORKERS`). One worker
    (items of any rows, up to two warpgroups) keeps two."""
    return 2 if workers == 1 or workers <= _worker_caps(rows, pair_table)[0] else 1


def min_default_stages(pair_table: bool) -> int:
    """The shallowest ring a plan picks to add a worker (`TrellisWgmma.default_stages`):
    2 for the pair table (measured there: 48 x 2 items, three workers), 3 elsewhere (two
    stages were not measured for mixed rates)."""
    return 2 if pair_table else DEFAULT_STAGES - 1


def check_workers(block_m: int, span: int, codebook: str, workers: int) -> str | None:
    """None when `workers` one-warpgroup workers per CTA can run this work item."""
    if workers not in WORKERS:
        return f"workers {workers!r} not in {WORKERS}"
    if workers > 1 and (span * block_m > WORKER_ROWS or codebook not in TABLE_CODEBOOKS):
        return (f"workers {workers} need work items of <= {WORKER_ROWS} rows (one warpgroup) and a table "
                f"codebook's persistent grid, not {span * block_m} rows of {codebook!r}")
    return None


def check_span(block_m: int, span: int) -> str | None:
    """None when `span` route blocks of `block_m` rows make a valid work item."""
    if span not in SPANS:
        return f"span {span} not in {SPANS}"
    if span * block_m > MAX_SPAN_ROWS:
        return f"span {span} x block_m {block_m} = {span * block_m} rows > {MAX_SPAN_ROWS}"
    return None


def smem_descriptor_sw128(saddr) -> Int64:
    """wgmma matrix descriptor of a K-major k16 x n operand in the 128-byte swizzle layout:
    row n of a 64-k stage is 128 contiguous bytes (row-group atoms of 8 rows, 1024 bytes
    apart, 1024-aligned), its 16-byte chunk c stored at chunk c ^ (n % 8). A k step kk
    starts 32 * kk bytes into the atom; the hardware applies the XOR on address bits."""
    return (Int64((saddr >> 4) & 0x3FFF) | Int64(1 << 16)
            | Int64((ROW_GROUP_BYTES >> 4) << 32) | Int64(1 << 62))


class TrellisWgmma(GemmClass):
    """One specialization of the wgmma trellis grouped GEMM (see module docstring)."""

    kind = "wgmma"
    instruction = "async wgmma"
    spans = SPANS
    kernel_tag = "_wgmma"

    @classmethod
    def default_span(cls, block_m: int, smem_limit: int | None = None, **args) -> int:
        """The span a plan uses when none is pinned: 2 at M=32 (one warpgroup, 64 rows), else
        1. Two blocks per work item at M=32 decode each expert's weights half as often,
        unless 32-row items let more workers share the tables (the pair table: 4 workers
        against 2, mixed rates: 3 against 2; needs `smem_limit` and the geometry `args`),
        which pays more. Work items
        of more than 64 rows (two warpgroups, fewer CTAs per SM) pay off only where nearly
        every row is real, so wider blocks keep span 1 unless a plan asks for more
        (measurements: docs/benchmarks.md)."""
        if block_m != 32:
            return 1
        if smem_limit is not None and args and (
                cls.workers_for(smem_limit, block_m=32, span=1, **args)
                > cls.workers_for(smem_limit, block_m=32, span=2, **args)):
            return 1
        return 2

    @classmethod
    def default_stages(cls, smem_limit: int | None = None, **args) -> int:
        """The ring depth a plan uses when none is pinned: `DEFAULT_STAGES`, or the
        deepest shallower ring, down to `min_default_stages`, that lets more workers share
        the tables (the pair table: 3 stages at M=32 to 64, 2 at 48 x 2; mixed rates: 3 at
        M=32, M=48 and 48 x 2, three rates at M=8). A worker keeps more decode loads queued
        on the banks than a deeper ring hides copy latency: every such trade measured paid
        (docs/benchmarks.md, docs/mixed_rates.md); needs `smem_limit` and the geometry."""
        if smem_limit is None:
            return DEFAULT_STAGES
        # Shallower rings never fit fewer workers, so the floor's count is the most.
        floor = min_default_stages(args.get("pair_table", False))
        most = cls.workers_for(smem_limit, stages=floor, **args)
        return next((stages for stages in range(DEFAULT_STAGES, floor, -1)
                     if cls.workers_for(smem_limit, stages=stages, **args) == most), floor)

    @staticmethod
    def threads_for(*, block_m: int, span: int = 1, bits_set: tuple = (), workers: int = 1,
                    **args) -> int:
        """Threads per CTA: the warpgroups of one work item, times the workers."""
        return THREADS * warpgroups(span * block_m, bool(bits_set), workers) * workers

    @staticmethod
    def smem_bytes_for(*, block_m: int, bits: int, stages: int = DEFAULT_STAGES, span: int = 1,
                       codebook: str | None = None, bits_set: tuple = (), workers: int = 1,
                       pair_table: bool = False, table_decode: str = "direct", **args) -> int:
        """Dynamic shared memory of one CTA (`smem_bytes`)."""
        return smem_bytes(block_m, bits, stages, span, codebook, bits_set, workers, pair_table,
                          table_decode)

    @staticmethod
    def pair_table_for(*, bits: int, codebook: str, bits_set: tuple = (),
                       table_decode: str = "direct", **args) -> bool:
        """The K=2 pair table for a uniform sqg_e4m3 layer of K in `PAIR_TABLE_BITS` with
        direct tables: on sm_90a the 227 KB per block hold it beside two workers' rings
        (module docstring)."""
        return check_pair_table(bits, bits_set, codebook, table_decode) is None

    @classmethod
    def workers_for(cls, smem_limit: int, *, block_m: int, span: int = 1, bits_set: tuple = (),
                    pair_table: bool = False, **args) -> int:
        """Where the state tables leave room for one CTA per SM (mixed rates, the pair
        table): the most one-warpgroup workers (up to 6; T12 up to `T12_MAX_WORKERS`) whose
        rings fit beside the tables (module docstring), else 1. More warpgroups in flight
        keep more decode loads queued on the banks while others wait on their wgmma."""
        if not (bits_set or pair_table) or span * block_m > WORKER_ROWS:
            return 1
        top = max_workers(span * block_m, args.get("table_decode", "direct"), pair_table)
        for workers in range(top, 1, -1):
            need = cls.smem_bytes_for(block_m=block_m, span=span, bits_set=bits_set,
                                      pair_table=pair_table, **dict(args, workers=workers))
            if need <= smem_limit:
                return workers
        return 1

    @staticmethod
    def can_implement(*, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                      stages: int, span: int = 1, smem_limit: int | None = None,
                      bits_set: tuple = (), workers: int = 1, pair_table: bool = False,
                      table_decode: str = "direct", **gemm_args) -> str | None:
        """None when this geometry compiles to a valid kernel, else the reason: the span,
        the geometry rules every trellis GEMM shares (`bring.check_geometry`), this
        kernel's smem."""
        reason = check_span(block_m, span) or check_workers(block_m, span, codebook, workers)
        if reason is None:
            reason = check_geometry(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                    codebook=codebook, stages=stages, bits_set=bits_set,
                                    rate_axis=gemm_args.get("rate_axis", "n"),
                                    table_decode=table_decode)
        if reason is None and pair_table:
            reason = check_pair_table(bits, bits_set, codebook, table_decode)
        if reason is None and smem_limit is not None:
            need = smem_bytes(block_m, bits, stages, span, codebook, bits_set, workers, pair_table,
                              table_decode)
            if need > smem_limit:
                reason = (f"shared memory {need:,} B"
                          f"{table_note(codebook, bits_set, pair_table, table_decode)} > "
                          f"{smem_limit:,} B per-block limit")
        return reason

    def __init__(self, *, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                 topk: int, a_rows_per_token: bool, stages: int, min_ctas_per_sm: int = 1,
                 span: int = 1, ctas_per_sm: int = 1, bits_set: tuple = (),
                 rate_axis: str = "n", workers: int = 1, pair_table: bool = False,
                 table_decode: str = "direct"):
        reason = self.can_implement(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                    codebook=codebook, stages=stages, span=span,
                                    bits_set=bits_set, workers=workers, rate_axis=rate_axis,
                                    pair_table=pair_table, table_decode=table_decode)
        if reason is not None:
            raise ValueError(reason)
        # The trellis words' ring (and, for mixed rates, each stage's K), as in TrellisGemm.
        self.ring = BRing(k_dim=k_dim, n_dim=n_dim, bits=bits, codebook=codebook,
                          stages=stages, bits_set=bits_set, rate_axis=rate_axis,
                          table_decode=table_decode)
        self.topk = topk
        self.a_rows_per_token = a_rows_per_token
        # K=2 pair table (128 KiB, `decode.decode_lane_tile_pair`) instead of the direct table.
        self.pair_table = pair_table
        self.table_bytes = table_bytes(codebook, self.ring.bits_set, pair_table, table_decode)
        # Direct tables or T12 + bijection (`MoESpec.table_decode`; the ring's rate_table
        # follows it too), and where the staged bytes start in the table argument.
        self.table_offset = table_offset(codebook, self.ring.bits_set, table_decode)
        # Register-allocation target (nvvm.minctasm) and, for table codebooks, resident
        # CTAs per SM of the persistent grid.
        self.min_ctas_per_sm = min_ctas_per_sm
        self.ctas_per_sm = ctas_per_sm
        self.block_m = block_m
        self.span = span
        self.rows = span * block_m  # wgmma n: activation rows of one work item
        # Workers: independent work-item loops per CTA (module docstring); `item_threads`
        # run one work item, `threads` is the CTA.
        self.workers = workers
        self.steps_in_flight = wgmma_steps_in_flight(self.rows, workers, pair_table)
        self.warpgroups = warpgroups(self.rows, self.ring.mixed, workers)
        self.item_threads = THREADS * self.warpgroups
        self.threads = self.item_threads * workers
        self.num_warps = NUM_WARPS * self.warpgroups
        self.m64_per_wg = 2 // self.warpgroups  # m64 x n accumulator tiles per warpgroup
        self.n_acc = self.rows // 2  # fp32 accumulators per thread per m64 tile
        self.a_stage = a_stage_bytes(self.rows)
        self.a_chunks = self.rows * (STAGE_ROW_BYTES // 16)  # 16-B copies per stage
        self.a_iters = (self.a_chunks + self.item_threads - 1) // self.item_threads
        self.route_regs = (self.rows + 31) // 32  # route ids per lane (lane l: rows l, 32 + l..)
        # wgmma n per work item: the smallest of these >= its real rows (one main-loop copy
        # each), so padding rows past the last 16-row group cost no MMA.
        self.n_variants = tuple(sorted({min(16 * i, self.rows)
                                        for i in range(1, (self.rows + 15) // 16 + 1)}))
        self.a_region = a_region_bytes(self.rows, stages)
        self.smem_bytes = smem_bytes(block_m, bits, stages, span, codebook, self.ring.bits_set,
                                     workers, pair_table, table_decode)

    @cute.jit
    def __call__(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
                 pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOffsets: cute.Pointer,
                 pCounts: cute.Pointer, pOut: cute.Pointer, pA1: cute.Pointer,
                 pB1: cute.Pointer, pOut1: cute.Pointer, operands: Int32, n_routes: Int32,
                 zero_row: Int32, max_blocks: Int32, pTable: cute.Pointer, sm_count: Int32,
                 pRateBits: cute.Pointer, pRateWords: cute.Pointer, k_tile_words: Int32, stream):
        # `operands` (1 or 2) GEMMs of one shape in one launch (FC1's two slots): operand 1
        # reads pA1 / pB1 and writes pOut1; its work items interleave with operand 0's.
        grid = max_blocks * operands * self.ring.n_tiles
        if cutlass.const_expr(self.ring.table):
            grid = persistent_grid(max_blocks * operands, self.ring.n_tiles, sm_count,
                                   self.ctas_per_sm)
        self.kernel(pA, pB, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts, pOut,
                    pA1, pB1, pOut1, operands, n_routes, zero_row, pTable, pRateBits,
                    pRateWords, k_tile_words).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes,
            stream=stream, min_blocks_per_mp=self.min_ctas_per_sm, preferred_smem_carveout=100)

    @cute.jit
    def issue_a(self, ks, buf, a_gaddr, a_saddr, rAsrc, tidx):
        """cp.async the work item's real activation rows of stage `ks` into swizzled buffer
        `buf`."""
        ring = self.ring
        for i in cutlass.range_constexpr(self.a_iters):
            q = (tidx + self.item_threads * i) % self.a_chunks
            row = q // 8
            kc = q % 8
            src = a_gaddr + (rAsrc[i] * ring.k_dim + ks * (16 * K_STEPS_PER_STAGE) + kc * 8) * 2
            # 128-byte swizzle: the 8 threads of a quarter warp copy one row's 8 chunks
            # (128 contiguous global bytes) to 8 distinct bank groups. (The unswizzled
            # core-matrix order put all 8 in the same 4 banks.)
            dst = (a_saddr + buf * self.a_stage + row * STAGE_ROW_BYTES
                   + ((kc ^ (row % CORE_ROWS)) * 16))
            if rAsrc[i] >= 0:  # rows past the real ones are not copied (their outputs are
                ptx.cp_async_16(dst, src)  # discarded; a wgmma column only feeds its own row)

    def decode_a(self, sB, buf, kk, n16, widx, q0, tab, bits=None):
        """A registers (W_hat^T fragment) of 16x16 tile (k step kk, output tile n16)
        (`bits`: the stage's K, mixed rates only)."""
        ring = self.ring
        words = ring.tile_words_at(sB, buf, kk, n16, widx, bits)
        h = decode_tile(words, q0, ring.bits if bits is None else bits, ring.codebook, tab,
                        self.pair_table, ring.table_decode, kk)
        return h[0], h[2], h[1], h[3]

    @cute.kernel
    def kernel(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
               pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOffsets: cute.Pointer,
               pCounts: cute.Pointer, pOut: cute.Pointer, pA1: cute.Pointer, pB1: cute.Pointer,
               pOut1: cute.Pointer, operands: Int32, n_routes: Int32, zero_row: Int32,
               pTable: cute.Pointer, pRateBits: cute.Pointer, pRateWords: cute.Pointer,
               k_tile_words: Int32):
        big = 1 << 30
        mSorted = cute.make_tensor(pSorted, cute.make_layout(big))
        mBlockExpert = cute.make_tensor(pBlockExpert, cute.make_layout(big))
        mNumPadded = cute.make_tensor(pNumPadded, cute.make_layout(1))
        mOffsets = cute.make_tensor(pOffsets, cute.make_layout(big))
        mCounts = cute.make_tensor(pCounts, cute.make_layout(big))
        gaddrs = operand_bases(pA, pB, pOut, pA1, pB1, pOut1)

        smem = cutlass.memory.SmemAllocator()
        tab = None
        if cutlass.const_expr(self.ring.table):
            sT = smem.allocate_tensor(
                cutlass.Uint8, cute.make_layout(self.table_bytes), 1024)
            tab = sT.iterator.toint()
        ring_words = self.ring.stages * self.ring.b_stage_words
        sA = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.workers * self.a_region), 1024)
        sB = smem.allocate_tensor(Uint32, cute.make_layout(self.workers * ring_words), 128)
        a_saddr = sA.iterator.toint()
        b_saddr = sB.iterator.toint()

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        cta_tidx, wk = tidx, 0
        if cutlass.const_expr(self.workers > 1):  # this thread's worker: its own rings
            wk = tidx // self.item_threads
            tidx = tidx - wk * self.item_threads
            a_saddr = a_saddr + wk * self.a_region
            sB = cute.make_tensor(sB.iterator + wk * ring_words, cute.make_layout(ring_words))
            b_saddr = sB.iterator.toint()
        warp = tidx // 32
        lane = tidx % 32
        rates = None
        if cutlass.const_expr(self.ring.mixed):  # one lane window per rate: {K: (words, q0)}
            widx, q0 = {k: lane_words(lane, k) for k in self.ring.rates}, None
            rates = (cute.make_tensor(pRateBits, cute.make_layout(big)),
                     cute.make_tensor(pRateWords, cute.make_layout(big)), k_tile_words)
        else:
            widx, q0 = lane_words(lane, self.ring.bits)

        num_blocks = mNumPadded[0] // self.block_m
        per_block = operands * self.ring.n_tiles  # works of one route block
        total = num_blocks * per_block
        rAsrc = cute.make_rmem_tensor((self.a_iters,), Int32)
        rRoute = cute.make_rmem_tensor((self.route_regs,), Int32)
        acc = cute.make_rmem_tensor((self.m64_per_wg, self.n_acc), Float32)
        groups = (mSorted, mBlockExpert, mOffsets, mCounts)
        lane_ctx = (tidx, warp, lane, widx, q0, tab)
        if cutlass.const_expr(self.ring.table):
            # Persistent CTA: stage the state table once, then every grid-th work item.
            gdim, _, _ = cute.arch.grid_dim()
            # Worker wk of CTA b takes items b + gdim * (wk + workers * i): consecutive items
            # go to consecutive CTAs first, so every SM gets its share of a short launch
            # (item counts per CTA differ by at most one) before any SM gets a second.
            first, stride = bidx, gdim
            if cutlass.const_expr(self.workers > 1):
                first, stride = bidx + wk * gdim, gdim * self.workers
            if bidx < total:
                stage_table(pTable, tab, cta_tidx, self.threads, self.table_bytes,
                            self.table_offset)
                if cutlass.const_expr(self.workers > 1):
                    # The tables are copied by every worker and read by each: complete and
                    # visible before the workers part (their barriers are their own).
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.sync_threads()
            if cutlass.const_expr(self.span > 1):
                # Deal groups of `span` consecutive blocks, not blocks: a span's other
                # blocks are empty items, and with the grid stride a multiple of the
                # period of leaders (span x n_tiles x operands works) dealing blocks gave
                # some SMs only leaders and others only empty items. Every group holds a
                # leader (no expert has `span` non-leaders in a row); more than one where
                # experts end inside it. (Span 1 keeps the plain loop below.)
                for gwork in range(first, (num_blocks + self.span - 1) // self.span * per_block,
                                   stride):
                    grp = gwork // per_block
                    rest = gwork - grp * per_block
                    for blk in range(grp * self.span,
                                     cutlass.min(grp * self.span + self.span, num_blocks)):
                        self.work_item(blk * per_block + rest, operands, groups, gaddrs,
                                       n_routes, a_saddr, b_saddr, sB, rAsrc, rRoute, acc,
                                       lane_ctx, rates)
                        self.sync()  # the next item's copies refill buffers a slower warp reads
            else:
                for work in range(first, total, stride):
                    self.work_item(work, operands, groups, gaddrs, n_routes, a_saddr, b_saddr,
                                   sB, rAsrc, rRoute, acc, lane_ctx, rates)
                    self.sync()  # the next item's copies refill buffers a slower warp may read
            cute.arch.cp_async_wait_group(0)  # a CTA whose items were all empty: the table
        else:
            work = bidx
            if work < total:
                self.work_item(work, operands, groups, gaddrs, n_routes, a_saddr, b_saddr, sB,
                               rAsrc, rRoute, acc, lane_ctx, rates)

    @cute.jit
    def work_item(self, work, operands, groups, gaddrs, n_routes, a_saddr, b_saddr, sB,
                  rAsrc, rRoute, acc, lane_ctx, rates=None):
        """Work item `work` (route block x N tile x operand; a span's leader takes `span`
        blocks; `rates`: the rate-map tensors and FC1 k-tile stride, mixed rates only)."""
        mSorted, mBlockExpert, mOffsets, mCounts = groups
        tidx, warp, lane, widx, q0, tab = lane_ctx
        item, a_gaddr, b_gaddr, out_gaddr = operand_item(work, operands, gaddrs)
        blk = item // self.ring.n_tiles
        nt = item - blk * self.ring.n_tiles
        expert = mBlockExpert[blk]
        # A span's leader (block j of its expert, j a multiple of `span`) takes the
        # expert's next `span` blocks; other blocks of the span exit. n_real: the
        # work item's rows that hold real routes (a prefix), from the expert's count.
        lead = expert >= 0
        e_safe = cutlass.max(expert, 0)
        j = blk - mOffsets[e_safe] // self.block_m
        if cutlass.const_expr(self.span > 1):
            lead = lead & (j % self.span == 0)
        n_real = cutlass.max(cutlass.min(mCounts[e_safe] - j * self.block_m, self.rows), 1)
        base = blk * self.block_m
        for i in cutlass.range_constexpr(self.a_iters):
            row = ((tidx + self.item_threads * i) % self.a_chunks) // 8
            r = mSorted[base + cutlass.min(row, n_real - 1)]
            a_row = r
            if self.a_rows_per_token:
                a_row = r // self.topk
            copy = row < n_real
            if cutlass.const_expr(self.item_threads * (i + 1) > self.a_chunks):
                # 8 rows = 64 chunks for 128 threads: the wrapping threads would repeat
                # a chunk (two unordered writes of one address), so they copy nothing.
                copy = copy & (tidx + self.item_threads * i < self.a_chunks)
            rAsrc[i] = Int32(cutlass.select_(copy, a_row, -1))
        for i in cutlass.range_constexpr(self.route_regs):
            row = 32 * i + lane
            r = mSorted[base + cutlass.min(row, n_real - 1)]
            rRoute[i] = Int32(cutlass.select_(row < n_real, r, n_routes))
        if lead:
            acc.fill(0.0)
            if cutlass.const_expr(self.ring.mixed):
                b_gbase = self.ring.rate_context(b_gaddr, *rates, expert, nt)
            else:
                b_gbase = b_gaddr + self.ring.b_tile_base(expert, nt)
            self.dispatch(0, n_real, sB, a_gaddr, a_saddr, rAsrc, b_gbase, b_saddr, acc,
                          tidx, warp, widx, q0, tab)
            cute.arch.cp_async_wait_group(0)
            self.store_tile(out_gaddr, acc, rRoute, nt, warp, lane, n_routes)

    @cute.jit
    def dispatch(self, vi: cutlass.Constexpr, n_real, sB, a_gaddr, a_saddr, rAsrc, b_gbase,
                 b_saddr, acc, tidx, warp, widx, q0, tab):
        """`main_loop` for the smallest wgmma n of `n_variants` (from index vi) that covers
        the run-time real row count `n_real`."""
        n = self.n_variants[vi]
        if cutlass.const_expr(vi == len(self.n_variants) - 1):
            self.main_loop(n // 2, sB, a_gaddr, a_saddr, rAsrc, b_gbase, b_saddr, acc, tidx,
                           warp, widx, q0, tab)
        else:
            if n_real <= n:
                self.main_loop(n // 2, sB, a_gaddr, a_saddr, rAsrc, b_gbase, b_saddr, acc,
                               tidx, warp, widx, q0, tab)
            else:
                self.dispatch(vi + 1, n_real, sB, a_gaddr, a_saddr, rAsrc, b_gbase, b_saddr,
                              acc, tidx, warp, widx, q0, tab)

    @cute.jit
    def main_loop(self, n_acc: cutlass.Constexpr, sB, a_gaddr, a_saddr, rAsrc, b_gbase,
                  b_saddr, acc, tidx, warp, widx, q0, tab):
        """The cp.async ring over the K stages with wgmma n = 2 * n_acc (the first n_acc
        accumulators per m64 tile: a prefix of the columns)."""
        for s in cutlass.range_constexpr(self.ring.stages - 1):
            if s < self.ring.k_stages:
                self.issue_a(s, s, a_gaddr, a_saddr, rAsrc, tidx)
                self.ring.copy_b(s, s, b_gbase, b_saddr, tidx, self.item_threads)
            cute.arch.cp_async_commit_group()
        for ks in range(self.ring.k_stages):
            self.wait_acc(acc, 0, n_acc)  # the previous stage's buffer is about to be refilled
            cute.arch.cp_async_wait_group(self.ring.stages - 2)
            ptx.fence_proxy_async_smem()
            self.sync()
            nxt = ks + self.ring.stages - 1
            if nxt < self.ring.k_stages:
                self.issue_a(nxt, nxt % self.ring.stages, a_gaddr, a_saddr, rAsrc, tidx)
                self.ring.copy_b(nxt, nxt % self.ring.stages, b_gbase, b_saddr, tidx, self.item_threads)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.ring.mixed):
                K, _ = self.ring.stage_rate(ks, b_gbase)
                self.ring.for_rate(0, K, self.mma_steps_at_rate,
                                (sB, ks % self.ring.stages, a_saddr, acc, warp, widx, tab, n_acc))
            else:
                self.mma_steps(sB, ks % self.ring.stages, a_saddr, acc, warp, widx, q0, tab, n_acc)
        self.wait_acc(acc, 0, n_acc)

    def sync(self):
        """The barrier of this thread's work item: the CTA's, or with workers its worker's
        named barrier (ids 1 .. workers, at most 6 of the 16; 0 is the CTA's)."""
        if cutlass.const_expr(self.workers > 1):
            tidx, _, _ = cute.arch.thread_idx()
            cute.arch.barrier(barrier_id=1 + tidx // self.item_threads,
                              number_of_threads=self.item_threads)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def wait_acc(self, acc, pending: cutlass.Constexpr, n_acc: cutlass.Constexpr):
        """wgmma.wait_group(pending), with the first n_acc accumulators of each m64 tile
        passed through it."""
        vals = ptx.wgmma_wait(pending, [acc[t, j] for t in range(self.m64_per_wg)
                                        for j in range(n_acc)])
        for t in cutlass.range_constexpr(self.m64_per_wg):
            for j in cutlass.range_constexpr(n_acc):
                acc[t, j] = vals[t * n_acc + j]

    @cute.jit
    def mma_steps_at_rate(self, bits: cutlass.Constexpr, sB, buf, a_saddr, acc, warp, lanes, tab,
                          n_acc: cutlass.Constexpr):
        """`mma_steps` of a stage of `bits` K, then wait for its wgmmas (module docstring)."""
        widx, q0 = lanes[bits]
        self.mma_steps(sB, buf, a_saddr, acc, warp, widx, q0, self.ring.rate_table(tab, bits), n_acc,
                       bits)
        self.wait_acc(acc, 0, n_acc)

    @cute.jit
    def mma_steps(self, sB, buf, a_saddr, acc, warp, widx, q0, tab, n_acc: cutlass.Constexpr,
                  bits=None):
        """The k steps of stage buffer `buf`. Per k step: this warpgroup's m64 tiles t cover
        output columns 64 * (wg * m64_per_wg + t) .. + 63; warp w of the group decodes their
        16-column tile w; wgmma n = 2 * n_acc."""
        wg = warp // NUM_WARPS
        wq = warp % NUM_WARPS
        for kk in cutlass.range_constexpr(K_STEPS_PER_STAGE):
            if cutlass.const_expr(kk >= self.steps_in_flight):
                # step kk - steps_in_flight read the A registers reused here
                self.wait_acc(acc, self.steps_in_flight - 1, n_acc)
            frags = [self.decode_a(sB, buf, kk, (wg * self.m64_per_wg + t) * NUM_WARPS + wq,
                                   widx, q0, tab, bits) for t in range(self.m64_per_wg)]
            desc = smem_descriptor_sw128(a_saddr + buf * self.a_stage + kk * K_STEP_BYTES)
            ptx.wgmma_fence()
            for t in cutlass.range_constexpr(self.m64_per_wg):
                a0, a1, a2, a3 = frags[t]
                vals = ptx.wgmma_m64k16_f16_rs([acc[t, j] for j in range(n_acc)],
                                               a0, a1, a2, a3, desc)
                for j in cutlass.range_constexpr(n_acc):
                    acc[t, j] = vals[j]
            ptx.wgmma_commit()

    @cute.jit
    def store_tile(self, out_addr, acc, rRoute, nt, warp, lane, n_routes):
        """Store the m64 x rows accumulator tiles from registers as [route, 128 columns] fp32
        rows. Accumulator (t, 4j + e) of lane (gq, c) = (lane / 4, lane % 4) is column
        64 (wg m64_per_wg + t) + 16 wq + gq + 8 (e / 2) of work-item row 8j + 2c + e % 2; its
        route id comes from the lane holding that row (rRoute: lane l holds rows l, 32 + l,
        ...; padding rows carry n_routes and are skipped). The 8 lanes of one c write one
        row's 8 consecutive columns: a full 32-byte sector. No shared memory, no barrier."""
        gq = lane // 4
        c = lane % 4
        wg = warp // NUM_WARPS
        wq = warp % NUM_WARPS
        col = nt * TILE_N + wg * self.m64_per_wg * 64 + wq * 16 + gq
        for j in cutlass.range_constexpr(self.n_acc // 4):
            reg = (8 * j) // 32  # rows 8j .. 8j + 7 sit in one register's 32 rows
            for e2 in cutlass.range_constexpr(2):
                r = cute.arch.shuffle_sync(rRoute[reg], 8 * j - 32 * reg + 2 * c + e2)
                if r < n_routes:
                    row_addr = out_addr + (Int64(r) * self.ring.n_dim + col) * 4
                    for t in cutlass.range_constexpr(self.m64_per_wg):
                        for h in cutlass.range_constexpr(2):
                            ptx.st_global_f32(row_addr + (64 * t + 8 * h) * 4,
                                              acc[t, 4 * j + 2 * h + e2])

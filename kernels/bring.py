"""What every trellis GEMM shares: its static questions, its geometry rules, the B ring.

Owns `GemmClass`, the base of every GEMM class of the registry (`kernels/gemms.py`): the
static questions each answers with one call signature (`can_implement`, `threads_for`,
`smem_bytes_for`, `resident_ctas`, `default_span`, `workers_for`, `pair_table_for`, all
taking the constructor's keyword arguments); the geometry rules they share (`check_geometry`,
`check_rates`); how a launch of two operands (FC1's gate and up) numbers its work items
(`operand_bases`, `operand_item`); and `BRing`, one GEMM specialization's ring of trellis
words in shared memory: where a work item's words start (`b_tile_base`), the cp.async
copies of one stage (`issue_b`, `copy_b`), where a tile's words sit in a stage buffer
(`tile_words_at`) and, for mixed rates, each stage's K and word index from the run-time
rate maps (`rate_context`, `stage_rate`, `for_rate`, `rate_table`). `TrellisGemm` and
`TrellisWgmma` each hold one; what they decode from it is `kernels/decode.py`'s.

Layout: B trellis int16 [E, k_dim/16, n_dim/16, 16*bits], read as uint32 words. A stage
buffer holds the N tile's 8 16-column tiles of 4 consecutive k tiles, one k tile's 8
tiles contiguous (8 K words each). Mixed rates (`bits_set`, docs/mixed_rates.md): K is
one value per stage, the buffer is sized for the widest K and a stage of narrower K is
packed from the buffer's start.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import format as fmt
from . import ptx
from .decode import MMA_CODEBOOKS, TABLE_BYTES, TABLE_CODEBOOKS, check_table_decode
from .launch import ROUTE_BLOCK_SIZES

TILE_N = 128
K_STEPS_PER_STAGE = 4  # 16-wide reduction steps per pipeline stage (64 elements)
DEFAULT_STAGES = 4
MAX_STAGES = 8
BLOCK_SIZES = ROUTE_BLOCK_SIZES  # defined once, in the launch contract
#: Mixed rates: the intermediate axis is the GEMM's N (FC1) or K (FC2) axis.
RATE_AXES = ("n", "k")
MAX_CTAS_PER_SM = 8  # occupancy target cap (64 regs/thread at 8 x 128 threads)
SMEM_RESERVED_PER_CTA = 1024  # the driver's per-CTA shared-memory reservation
#: Static shared memory every kernel the DSL compiles carries beside its dynamic bytes (each
#: kernel of the forward reports 1,024 B static in its cubin): what a kernel may allocate
#: dynamically is the per-block limit less this.
DSL_STATIC_SMEM = 1024


def b_stage_bytes(bits: int) -> int:
    """Trellis words of one pipeline stage: the N tile's 8 tile columns x 4 k-tiles."""
    return (TILE_N // 16) * K_STEPS_PER_STAGE * 32 * bits


def operand_bases(pA, pB, pOut, pA1, pB1, pOut1):
    """Global addresses of a GEMM launch's operand 0 (A, B, output) and their offsets to
    operand 1's: the launch runs `operands` (1 or 2) GEMMs of one shape, FC1's two slots."""
    return (pA.toint(), pB.toint(), pOut.toint(), pA1.toint() - pA.toint(),
            pB1.toint() - pB.toint(), pOut1.toint() - pOut.toint())


def operand_item(work, operands, bases):
    """(item, A, B, output addresses) of launch work item `work`: the operand is the
    innermost index, so both operands' items of one route block and N tile are neighbours
    (dealt to neighbouring CTAs, they read the same activation rows at about the same time);
    `item` is the route block x N tile index within the operand."""
    a, b, out, a_step, b_step, out_step = bases
    item = work // operands
    op = Int64(work - item * operands)
    return item, a + op * a_step, b + op * b_step, out + op * out_step


def check_rates(bits: int, bits_set: tuple, codebook: str, rate_axis: str) -> str | None:
    """None when `bits_set` (empty: uniform K = `bits`) is a rate set the GEMMs decode."""
    if not bits_set:
        return None
    if (not isinstance(bits_set, tuple) or len(bits_set) < 2
            or any(isinstance(k, bool) or not isinstance(k, int) for k in bits_set)
            or list(bits_set) != sorted(set(bits_set))):
        return f"bits_set {bits_set!r} must be a tuple of >= 2 distinct ints, ascending"
    if codebook not in TABLE_CODEBOOKS:
        return f"mixed rates (bits_set {bits_set}) need a table codebook {TABLE_CODEBOOKS}, not {codebook!r}"
    lo, hi = fmt.BITS_RANGE[codebook]
    if not lo <= bits_set[0] <= bits_set[-1] <= hi:
        return f"bits_set {bits_set} outside {lo}..{hi} for codebook {codebook!r}"
    if bits != bits_set[-1]:
        return f"bits {bits} must be the widest K of bits_set {bits_set} (the B ring's size)"
    if rate_axis not in RATE_AXES:
        return f"rate_axis {rate_axis!r} not in {RATE_AXES}"
    return None


def check_geometry(*, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                   stages: int = DEFAULT_STAGES, bits_set: tuple = (),
                   rate_axis: str = "n", table_decode: str = "direct") -> str | None:
    """None when a trellis GEMM of this work item and ring geometry can be built, else the
    reason (the rules every GEMM class shares; each adds its own and its shared memory)."""
    if block_m not in BLOCK_SIZES:
        return f"block_m {block_m} not in {BLOCK_SIZES}"
    if codebook not in MMA_CODEBOOKS:
        return f"codebook {codebook!r} has no mma decode path (supported: {MMA_CODEBOOKS})"
    lo, hi = fmt.BITS_RANGE[codebook]
    if not lo <= bits <= hi:
        return f"bits {bits} outside {lo}..{hi} for codebook {codebook!r}"
    for name, dim in (("k_dim", k_dim), ("n_dim", n_dim)):
        if dim <= 0 or dim % fmt.HADAMARD_BLOCK:
            return f"{name} {dim} is not a positive multiple of {fmt.HADAMARD_BLOCK}"
    if not 2 <= stages <= MAX_STAGES:
        return f"stages {stages} outside 2..{MAX_STAGES}"
    return check_rates(bits, bits_set, codebook, rate_axis) or check_table_decode(codebook, table_decode)


class GemmClass:
    """The static questions every trellis GEMM class answers, with one call signature.

    `args` below are the constructor's keyword arguments (`block_m`, `k_dim`, `n_dim`,
    `bits`, `codebook`, `topk`, `a_rows_per_token`, `stages`, `min_ctas_per_sm`,
    `ctas_per_sm`, `bits_set`, `rate_axis`, `span`, `workers`, `pair_table`); each method
    reads the ones
    it needs. A subclass sets `kind` (its key in `kernels/gemms.py`'s registry, the
    spelling of `MoESpec.mma` and of the arch table's `mma_kinds`), `instruction` (how a
    plan's description names it) and `kernel_tag` (its mark in `MoESpec.kernel_name`), and
    defines `can_implement(**args, smem_limit=None)`, `threads_for(**args)` and
    `smem_bytes_for(**args)`; the defaults below fit a GEMM of one route block per work
    item and one work-item loop per CTA. Instances carry `threads` and `smem_bytes`, and
    are called as `TrellisGemm.__call__` is (every GEMM takes the same arguments)."""

    kind: str = ""
    instruction: str = ""
    kernel_tag: str = ""
    #: Route blocks of one expert a work item may take (`MoESpec.span`).
    spans: tuple = (1,)

    @classmethod
    def default_span(cls, block_m: int, smem_limit: int | None = None, **args) -> int:
        """Route blocks of one expert per work item when a spec does not pin `span`
        (`args`: the spec's GEMM geometry without block_m and span)."""
        return 1

    @classmethod
    def default_stages(cls, smem_limit: int | None = None, **args) -> int:
        """B-ring stages when a spec does not pin `stages` (`args`: the spec's GEMM geometry
        without stages)."""
        return DEFAULT_STAGES

    @staticmethod
    def pair_table_for(**args) -> bool:
        """Decode a table codebook through the K=2 pair table (`decode.PAIR_TABLE_BITS`)
        instead of the direct state tables."""
        return False

    @classmethod
    def workers_for(cls, smem_limit: int, **args) -> int:
        """Work-item loops per CTA for this geometry (`smem_limit`: per-block shared memory)."""
        return 1

    @classmethod
    def resident_ctas(cls, smem_per_sm: int, **args) -> int:
        """CTAs per SM that shared memory allows (1..MAX_CTAS_PER_SM): the persistent grid
        of a table codebook is SMs x this, and it is the register target that keeps
        registers from being the tighter limit."""
        per_cta = cls.smem_bytes_for(**args) + DSL_STATIC_SMEM + SMEM_RESERVED_PER_CTA
        return max(1, min(MAX_CTAS_PER_SM, smem_per_sm // per_cta))


class BRing:
    """The trellis-word ring of one GEMM specialization (see module docstring)."""

    def __init__(self, *, k_dim: int, n_dim: int, bits: int, codebook: str, stages: int,
                 bits_set: tuple = (), rate_axis: str = "n", table_decode: str = "direct"):
        self.k_dim = k_dim
        self.n_dim = n_dim
        self.bits = bits
        self.codebook = codebook
        self.stages = stages
        # Table codebooks: the GEMM stages the state tables and runs a persistent grid.
        self.table = codebook in TABLE_CODEBOOKS
        # How the tables decode: a direct table per K, or T12 + bijection for every K.
        self.table_decode = table_decode
        # Mixed rates (module docstring): the K of each stage comes from the rate maps.
        self.mixed = bool(bits_set)
        self.bits_set = tuple(bits_set)
        self.rates = self.bits_set or (bits,)
        self.rate_axis = rate_axis
        self.k_tiles = k_dim // fmt.TILE
        self.k_stages = self.k_tiles // K_STEPS_PER_STAGE
        self.n_tiles16 = n_dim // fmt.TILE
        self.n_tiles = n_dim // TILE_N
        self.tile_words = 8 * bits  # uint32 words per 16x16 trellis tile
        self.b_stage_words = b_stage_bytes(bits) // 4
        self.b_chunks = K_STEPS_PER_STAGE * (TILE_N // 16) * self.tile_words * 4 // 16
        self.rate_tiles = (n_dim if rate_axis == "n" else k_dim) // fmt.TILE

    def issue_b(self, ks, buf, b_gbase, b_saddr, tidx, threads: int):
        """cp.async the trellis words of pipeline stage `ks` (4 k-tiles x the N tile's 8
        16-column tiles) into buffer `buf`, spread over the work item's `threads` threads."""
        run_chunks = (TILE_N // 16) * self.tile_words * 4 // 16  # 16-B chunks of one k-tile's 8 tiles
        for i in range((self.b_chunks + threads - 1) // threads):
            q = (tidx + threads * i) % self.b_chunks
            kl = q // run_chunks
            within = q % run_chunks
            kt = ks * K_STEPS_PER_STAGE + kl
            src = b_gbase + Int64(kt * self.n_tiles16 * self.tile_words * 4 + within * 16)
            dst = b_saddr + (buf * self.b_stage_words + kl * (TILE_N // 16) * self.tile_words) * 4 + within * 16
            if threads * (i + 1) > self.b_chunks:  # the wrapping slots (as in the GEMMs' issue_a)
                ptx.cp_async_16_if(Int32(cutlass.select_(tidx + threads * i < self.b_chunks, 1, 0)),
                                   dst, src)
                continue
            ptx.cp_async_16(dst, src)

    def b_tile_base(self, expert, nt):
        """Byte offset of (k-tile 0, first 16-column tile of N tile `nt`) of `expert`."""
        return Int64(expert * (self.k_tiles * self.n_tiles16) + nt * (TILE_N // 16)) * (self.tile_words * 4)

    def tile_words_at(self, sB, buf, kk, n16, widx, bits=None):
        """This lane's trellis words of tile (k step kk, 16-column tile n16 of the N tile)
        in stage buffer `buf` (tiles of `bits` K, default the uniform K, packed from the
        buffer's start)."""
        tile_words = self.tile_words if bits is None else 8 * bits
        tb = buf * self.b_stage_words + (kk * (TILE_N // 16) + n16) * tile_words
        return [sB[tb + w] for w in widx]

    def copy_b(self, ks, buf, b_src, b_saddr, tidx, threads: int):
        """cp.async stage `ks`'s trellis words into buffer `buf`: `b_src` is the work item's
        B base address (uniform K) or its rate context (mixed rates)."""
        if cutlass.const_expr(self.mixed):
            K, w = self.stage_rate(ks, b_src)
            self.for_rate(0, K, self.issue_b_at_rate, (buf, w, b_src, b_saddr, tidx, threads))
        else:
            self.issue_b(ks, buf, b_src, b_saddr, tidx, threads)

    def rate_context(self, b_gaddr, mRateBits, mRateWords, k_tile_words, expert, nt):
        """What a mixed work item needs to find each stage's K and trellis words. FC1 (rate
        axis n): the N tile's K and the word index of its tile (0, first column), read
        once. FC2 (rate axis k): the expert's row of the rate maps, read per stage."""
        row = expert * self.rate_tiles
        if cutlass.const_expr(self.rate_axis == "n"):
            j = row + nt * (TILE_N // 16)
            return (b_gaddr, Int32(mRateBits[j]), Int32(mRateWords[j]), k_tile_words, nt)
        return (b_gaddr, mRateBits, mRateWords, row, nt)

    def stage_rate(self, ks, rctx):
        """(K, word index of the stage's first k tile) of stage `ks` (run-time, uniform over
        the work item's threads).
        FC2: the row tile's index; its N tile's columns start 8 K words per tile later."""
        if cutlass.const_expr(self.rate_axis == "n"):
            _, K, w, k_tile_words, _ = rctx
            return K, w + ks * K_STEPS_PER_STAGE * k_tile_words
        _, mRateBits, mRateWords, row, _ = rctx
        t = row + ks * K_STEPS_PER_STAGE
        return Int32(mRateBits[t]), Int32(mRateWords[t])

    @cute.jit
    def for_rate(self, i: cutlass.Constexpr, K, fn, args):
        """`fn(k, *args)` for the rate k of `rates[i:]` equal to the run-time K (uniform: every
        thread of the work item reads the same map entry); the widest rate takes whatever
        is left."""
        if cutlass.const_expr(i == len(self.rates) - 1):
            fn(self.rates[i], *args)
        else:
            if K == self.rates[i]:
                fn(self.rates[i], *args)
            else:
                self.for_rate(i + 1, K, fn, args)

    def issue_b_at_rate(self, bits: int, buf, w, rctx, b_saddr, tidx, threads: int):
        """`issue_b` for a stage of `bits` K whose first k tile starts at word `w`: 4 runs of
        the N tile's 8 tiles (8 K words each), packed from the buffer's start (the ring is
        sized for the widest K)."""
        b_gaddr, nt = rctx[0], rctx[-1]
        tile_words = 8 * bits
        if cutlass.const_expr(self.rate_axis == "n"):
            base, kt_stride = w, rctx[3]
        else:
            base, kt_stride = w + nt * (TILE_N // 16) * tile_words, self.n_tiles16 * tile_words
        run_chunks = (TILE_N // 16) * tile_words * 4 // 16
        b_chunks = K_STEPS_PER_STAGE * run_chunks
        for i in range((b_chunks + threads - 1) // threads):
            q = (tidx + threads * i) % b_chunks
            kl = q // run_chunks
            within = q % run_chunks
            src = b_gaddr + Int64(base + kl * kt_stride) * 4 + within * 16
            dst = b_saddr + (buf * self.b_stage_words + kl * (TILE_N // 16) * tile_words) * 4 + within * 16
            if threads * (i + 1) > b_chunks:  # the wrapping slots (as in the GEMMs' issue_a)
                ptx.cp_async_16_if(Int32(cutlass.select_(tidx + threads * i < b_chunks, 1, 0)),
                                   dst, src)
                continue
            ptx.cp_async_16(dst, src)

    def rate_table(self, tab, bits: int):
        """Shared-memory address of `bits`'s state table (direct tables in `rates` order; the
        one T12 serves every K)."""
        if self.table_decode == "t12":
            return tab
        return tab + self.rates.index(bits) * TABLE_BYTES

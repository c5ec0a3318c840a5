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
  (Reading a real zero row sent every padding copy of the GPU to the same few L2 lines:
  FC2's 384-wide rows span 6 of them, and at 4,096 tokens and M=64, ~38 % of its A copies
  were padding.)
- B: trellis int16 [E, k_dim/16, n_dim/16, 16*bits], read as uint32 words.
- sorted_routes: int32 [slots] packed route ids (sentinel >= n_routes for padding);
  block_expert: int32 [blocks] (-1 = empty); num_padded: int32 [1] packed slot count.
- out: fp32 [n_routes, n_dim], row r written for every real packed route r.
- table (sqg_e4m3 only): uint8 [65536], the E4M3FN byte of every 16-bit state
  (`kquant_cute.trellis.sqg_state_table`). Each CTA stages it into shared memory once and
  then loops over work items (grid = SMs x resident CTAs, `ctas_per_sm`), so the 64 KiB
  copy is paid per resident CTA, not per work item. A pair of weights costs two byte
  loads from that table, one byte permute and one `cvt.rn.f16x2.e4m3x2`.

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

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import format as fmt
from .launch import ROUTE_BLOCK_SIZES

from . import ptx

TILE_N = 128
NUM_WARPS = 4
THREADS = 32 * NUM_WARPS
BLOCK_SIZES = ROUTE_BLOCK_SIZES  # defined once, in the launch contract
MMA_CODEBOOKS = ("mcg", "3inst", "mul1", "sqg_e4m3")
#: Codebooks decoded through a state -> byte table in shared memory (persistent CTAs).
TABLE_CODEBOOKS = ("sqg_e4m3",)
TABLE_BYTES = 1 << 16  # one E4M3FN byte per 16-bit state
#: Mixed rates: the intermediate axis is the GEMM's N (FC1) or K (FC2) axis.
RATE_AXES = ("n", "k")
K_STEPS_PER_STAGE = 4  # 16-wide reduction steps per pipeline stage (64 elements)
A_ROW_HALVES = 16 * K_STEPS_PER_STAGE + 8  # padded smem row: conflict-free ldmatrix
DEFAULT_STAGES = 4
MAX_STAGES = 8
MAX_CTAS_PER_SM = 8  # occupancy target cap (64 regs/thread at 8 x 128 threads)
SMEM_RESERVED_PER_CTA = 1024  # the driver's per-CTA shared-memory reservation


STAGE_ROW_FLOATS = 32 + 8  # padded fp32 row of a warp's 16 x 32 epilogue chunk (conflict-free v2 stores)
WARP_STAGE_FLOATS = 16 * STAGE_ROW_FLOATS


def a_smem_halves(block_m: int, stages: int) -> int:
    """fp16 elements of the A region: the A ring ([stages, m_pad, A_ROW_HALVES]), which the
    epilogue reuses for its per-warp staging chunks (whichever is larger)."""
    m_pad = (block_m + 15) // 16 * 16
    return max(stages * m_pad * A_ROW_HALVES, NUM_WARPS * WARP_STAGE_FLOATS * 2)


def b_stage_bytes(bits: int) -> int:
    """Trellis words of one pipeline stage: the N tile's 8 tile columns x 4 k-tiles."""
    return (TILE_N // 16) * K_STEPS_PER_STAGE * 32 * bits


def table_bytes(codebook: str | None, bits_set: tuple = ()) -> int:
    """Shared memory of the codebook's state tables, one per rate of `bits_set` (one for a
    uniform K; 0 for the arithmetic codebooks)."""
    return TABLE_BYTES * max(1, len(bits_set)) if codebook in TABLE_CODEBOOKS else 0


def table_note(codebook: str | None, bits_set: tuple = ()) -> str:
    """What the state tables add to a shared-memory rejection ("" without tables)."""
    if not table_bytes(codebook):
        return ""
    if bits_set:
        return (f" (incl. the {table_bytes(codebook, bits_set) // 1024} KiB of {codebook} state "
                f"tables for K {', '.join(map(str, bits_set))})")
    return f" (incl. the {TABLE_BYTES // 1024} KiB {codebook} state table)"


def smem_bytes(block_m: int, bits: int, stages: int, codebook: str | None = None,
               bits_set: tuple = ()) -> int:
    """Dynamic shared memory of one CTA: the codebook's state tables, the A region (ring /
    epilogue staging) and the B ring (sized for `bits`, the widest K)."""
    return (table_bytes(codebook, bits_set) + a_smem_halves(block_m, stages) * 2
            + stages * b_stage_bytes(bits))


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


def stage_table(pTable, t_saddr, tidx, threads: int, nbytes: int = TABLE_BYTES):
    """cp.async `nbytes` of state tables (64 KiB each) from global memory into shared memory
    at `t_saddr` (one commit group; the main loop's first wait covers it, groups retire in
    order)."""
    chunks = nbytes // 16
    for i in range(chunks // threads):  # unrolled at trace time
        q = tidx + threads * i
        ptx.cp_async_16(t_saddr + q * 16, pTable.toint() + Int64(q * 16))
    cute.arch.cp_async_commit_group()


def persistent_grid(max_blocks, n_tiles: int, sm_count, ctas_per_sm: int):
    """Grid of a table codebook's GEMM: every resident CTA slot, never more than the work
    items (each CTA loops over work items with the grid as its stride)."""
    return cutlass.min(max_blocks * n_tiles, sm_count * ctas_per_sm)


#: (s * REPLICATE) * replicated(C) == s * C (mod 2^32) for every 16-bit state s, because
#: 0x10001 is odd and 0xFFFF0001 is its inverse mod 2^32: a state extracted as (s : s) in
#: both 16-bit halves (one byte permute, also across two registers) multiplies exactly like
#: the zero-extended state with the multiplier adjusted at trace time.
REPLICATE = 0x10001
REPLICATE_INV = 0xFFFF0001
#: Codebooks whose first step is one multiplication of the state (so a replicated state
#: works); the table codebooks index shared memory with the state itself.
REPLICATE_CODEBOOKS = ("mcg", "3inst", "mul1")


def replicated(mul: int) -> int:
    """The multiplier that maps the replicated state (s : s) to s * `mul` (mod 2^32)."""
    return (mul * REPLICATE_INV) & 0xFFFFFFFF


def decode_pair(s0, s1, codebook: str, table=None, rep=(False, False)):
    """Two 16-bit trellis states -> one half2 register of their codebook values (`table`:
    the shared-memory address of the state table, table codebooks only). `rep[i]`: state i
    arrives replicated in both halves (see `REPLICATE`), never for table codebooks."""
    if codebook == "sqg_e4m3":
        assert not any(rep), "table codebooks read the zero-extended state"
        return ptx.e4m3_table_pair(s0, s1, table)

    def mul(c: int, i: int) -> Uint32:
        return Uint32(replicated(c) if rep[i] else c)

    if codebook == "mcg":
        x0 = s0 * mul(fmt.MCG_MUL, 0)
        x1 = s1 * mul(fmt.MCG_MUL, 1)
        return ptx.lop3_pair_scalar_add(x0, x1, fmt.LOP3_MASK, fmt.LOP3_XOR)
    if codebook == "3inst":
        x0 = s0 * mul(fmt.INST3_MUL, 0) + Uint32(fmt.INST3_ADD)
        x1 = s1 * mul(fmt.INST3_MUL, 1) + Uint32(fmt.INST3_ADD)
        return ptx.lop3_pair_scalar_add(x0, x1, fmt.LOP3_MASK, fmt.LOP3_XOR)
    if codebook == "mul1":
        x0 = s0 * mul(fmt.MUL1_MUL, 0)
        x1 = s1 * mul(fmt.MUL1_MUL, 1)
        return ptx.mul1_half2(x0, x1, Uint32(fmt.MUL1_KINV_BITS), Uint32(fmt.MUL1_KBIAS_BITS))
    raise ValueError(f"codebook {codebook!r} has no mma decode path (supported: {MMA_CODEBOOKS})")


@functools.lru_cache(maxsize=None)
def lane_window(bits: int) -> tuple[int | None, int]:
    """Where a lane's 8 states start in its 32-bit words: (compile-time bit offset q0 or
    None, words to load). Lane L's first state starts at stream bit p0 = (8L+1)K - 16 (mod
    the ring); when 8K is a multiple of 32 (K = 4) p0 mod 32 is the same for every lane, so
    the states sit at fixed offsets of 2 words and no run-time funnel shift is needed."""
    if (8 * bits) % 32 == 0:
        q0 = (bits - 16) % 32
        return q0, (q0 + 16 + 7 * bits + 31) // 32
    return None, 3


@functools.lru_cache(maxsize=None)
def state_windows(bits: int, replicate: bool = False) -> tuple[tuple[int, ...], ...]:
    """For each of a lane's 8 states, how to extract it: (d, r) = from the 32-bit window
    at shift d, offset r, zero-extended; or (d_a, d_b, sel) = one byte permute of windows
    d_a and d_b with selector `sel`, the state replicated in both halves (only with
    `replicate`, see `REPLICATE`). Offsets are counted MSB-first in the 64-bit view
    (hi:lo) of the lane's words; windows 0 (hi) and 32 (lo) exist anyway, each other window
    costs one funnel shift. A state at r in {0, 8, 16} costs one op (shift, byte permute or
    mask), else two; with `replicate`, a byte-aligned state whose two bytes lie at byte
    offsets of two windows (e.g. K=4: the low byte of hi and the high byte of lo) costs one
    byte permute. Windows are added greedily while they save ops; the replicated plan is
    used only where it is strictly cheaper than the zero-extended one."""
    plain = _greedy_windows(bits, False)
    if replicate:
        rep = _greedy_windows(bits, True)
        if _plan_cost(rep) < _plan_cost(plain):
            return rep
    return plain


def _plan_cost(plan) -> int:
    windows = {d for e in plan for d in (e[:2] if len(e) == 3 else e[:1])} - {0, 32}
    return len(windows) + sum(1 if len(e) == 3 or e[1] in (0, 8, 16) else 2 for e in plan)


def _byte_in(o: int, ws) -> int | None:
    """A window of `ws` holding view bits [o, o + 8) as one of its bytes (None: none)."""
    for d in sorted(ws):
        if 0 <= o - d <= 24 and (o - d) % 8 == 0:
            return d
    return None


def _greedy_windows(bits: int, replicate: bool) -> tuple[tuple[int, ...], ...]:
    q0, _ = lane_window(bits)
    offsets = [(q0 or 0) + i * bits for i in range(8)]
    cheap = (0, 8, 16)

    def straddle(o, ws):
        if not replicate:
            return None
        a, b = _byte_in(o, ws), _byte_in(o + 8, ws)
        return None if a is None or b is None else (a, b)

    def cost(ws):
        total = len([d for d in ws if d not in (0, 32)])
        for o in offsets:
            if any(0 <= o - d <= 16 and (o - d) in cheap for d in ws) or straddle(o, ws):
                total += 1
            elif any(0 <= o - d <= 16 for d in ws):
                total += 2
            else:
                return 1 << 20  # some state lies in no window
        return total

    chosen = {0, 32}
    if cost(chosen) >= 1 << 20:
        # Some state lies in neither word: the zero-extended plan starts from window 16
        # (view bits 16..47, every offset in [16, 32] fits), the replicated one from the
        # cheapest window that makes every state reachable.
        chosen.add(min(range(1, 32), key=lambda d: cost(chosen | {d})) if replicate else 16)
    while True:
        best = min(range(1, 32), key=lambda d: cost(chosen | {d}))
        if cost(chosen | {best}) >= cost(chosen):
            break
        chosen.add(best)
    plan = []
    for o in offsets:
        good = [d for d in sorted(chosen) if 0 <= o - d <= 16 and (o - d) in cheap]
        pair = straddle(o, chosen)
        if good:
            plan.append((good[0], o - good[0]))
        elif pair:
            d_a, d_b = pair
            # prmt.b32 d, a, b, sel: bytes 0-3 of a, 4-7 of b; the state's low byte is
            # view bits [o + 8, o + 16), its high byte [o, o + 8); both halves alike.
            lo = 4 + 3 - (o + 8 - d_b) // 8
            hi = 3 - (o - d_a) // 8
            plan.append((d_a, d_b, lo | hi << 4 | lo << 8 | hi << 12))
        else:
            fits = [(o - d) for d in sorted(chosen) if 0 <= o - d <= 16]
            d = o - fits[-1]
            plan.append((d, o - d))
    return tuple(plan)


def decode_lane_tile(words, q0, bits: int, codebook: str, table=None) -> list:
    """This lane's 8 weights of one 16x16 tile -> 4 half2 B registers (pairs in t order).

    `words` are the lane's `lane_window(bits)[1]` consecutive ring words (from word
    p0 // 32) and `q0` = p0 mod 32 (run-time; unused when it is a compile-time constant).
    With a run-time q0, two funnel shifts align a 64-bit window first. A few more windows
    (chosen at compile time by `state_windows`) put every state at a byte offset 0, 8 or 16
    of some 32-bit word, where one ALU op (shift, byte permute or mask) extracts it; for the
    arithmetic codebooks a byte-aligned state straddling two windows is one byte permute
    too, replicated in both halves (`REPLICATE`)."""
    static_q0, _ = lane_window(bits)
    if static_q0 is None:
        u0, u1, u2 = words
        w_hi = ptx.funnel_hi(u0, u1, q0)
        w_lo = ptx.funnel_hi(u1, u2, q0)
    else:
        w_hi, w_lo = words
    windows = {0: w_hi, 32: w_lo}
    plan = state_windows(bits, codebook in REPLICATE_CODEBOOKS)
    for d in sorted({d for e in plan for d in (e[:2] if len(e) == 3 else e[:1])}):
        if d not in windows:
            windows[d] = ptx.funnel_hi(w_hi, w_lo, Uint32(d))
    states = []
    for e in plan:
        if len(e) == 3:  # replicated: one byte permute of two windows
            states.append(ptx.prmt2_u32(windows[e[0]], windows[e[1]], e[2]))
            continue
        d, r = e
        w = windows[d]
        if r == 0:
            st = w >> 16
        elif r == 8:
            st = ptx.prmt_u32(w, 0x4421)
        elif r == 16:
            st = w & Uint32(0xFFFF)
        else:
            st = (w >> (16 - r)) & Uint32(0xFFFF)
        states.append(st)
    rep = [len(e) == 3 for e in plan]
    return [decode_pair(states[2 * p], states[2 * p + 1], codebook, table,
                        (rep[2 * p], rep[2 * p + 1])) for p in range(4)]


def lane_words(lane, bits: int):
    """Run-time (word indices, q0) of a lane's trellis window inside one tile's ring."""
    tile_words = 8 * bits
    ring_bits = 256 * bits
    p0 = (8 * lane + 1) * bits - 16 + ring_bits
    p0 = cutlass.select_(p0 >= ring_bits, p0 - ring_bits, p0)
    w = Int32(p0) // 32
    q0 = Int32(p0) % 32
    idx = [w]
    for _ in range(lane_window(bits)[1] - 1):
        nxt = idx[-1] + 1
        idx.append(Int32(cutlass.select_(nxt >= tile_words, nxt - tile_words, nxt)))
    return idx, q0


class TrellisGemm:
    """One specialization of the trellis grouped GEMM (see module docstring)."""

    def __init__(self, *, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                 topk: int, a_rows_per_token: bool, stages: int = DEFAULT_STAGES,
                 min_ctas_per_sm: int = 1, ctas_per_sm: int = 1, bits_set: tuple = (),
                 rate_axis: str = "n"):
        reason = self.can_implement(block_m=block_m, k_dim=k_dim, n_dim=n_dim, bits=bits,
                                    codebook=codebook, stages=stages, bits_set=bits_set,
                                    rate_axis=rate_axis)
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
        self.table = codebook in TABLE_CODEBOOKS
        self.ctas_per_sm = ctas_per_sm
        # Mixed rates (module docstring): the K of each stage comes from the rate maps.
        self.mixed = bool(bits_set)
        self.bits_set = tuple(bits_set)
        self.rates = self.bits_set or (bits,)
        self.rate_axis = rate_axis
        # Derived once.
        self.m_tiles = (block_m + 15) // 16
        self.m_pad = 16 * self.m_tiles
        self.k_tiles = k_dim // fmt.TILE
        self.k_stages = self.k_tiles // K_STEPS_PER_STAGE
        self.n_tiles16 = n_dim // fmt.TILE
        self.n_tiles = n_dim // TILE_N
        self.tile_words = 8 * bits  # uint32 words per 16x16 trellis tile
        self.b_stage_words = b_stage_bytes(bits) // 4
        self.a_chunks = block_m * (K_STEPS_PER_STAGE * 16 * 2 // 16)  # 16-byte copies per stage
        self.b_chunks = K_STEPS_PER_STAGE * (TILE_N // 16) * self.tile_words * 4 // 16
        self.a_iters = (self.a_chunks + THREADS - 1) // THREADS
        self.rate_tiles = (n_dim if rate_axis == "n" else k_dim) // fmt.TILE
        self.threads = THREADS
        self.smem_bytes = smem_bytes(block_m, bits, stages, codebook, self.bits_set)

    @staticmethod
    def occupancy_target(block_m: int, bits: int, stages: int, smem_per_sm: int,
                         codebook: str | None = None) -> int:
        """CTAs per SM that shared memory allows (1..MAX_CTAS_PER_SM): the register target
        that keeps registers from being the tighter limit. On sm_90 (228 KB per SM) and the
        default 4 stages: M=8/16 -> 8 (64 regs), 32 -> 6 (80), 48 -> 5 (96), 64 -> 4 (128)."""
        per_cta = smem_bytes(block_m, bits, stages, codebook) + SMEM_RESERVED_PER_CTA
        return max(1, min(MAX_CTAS_PER_SM, smem_per_sm // per_cta))

    @staticmethod
    def can_implement(*, block_m: int, k_dim: int, n_dim: int, bits: int, codebook: str,
                      stages: int = DEFAULT_STAGES, smem_limit: int | None = None,
                      topk: int = 1, a_rows_per_token: bool = False,
                      min_ctas_per_sm: int = 1, ctas_per_sm: int = 1, bits_set: tuple = (),
                      rate_axis: str = "n") -> str | None:
        """None when this geometry compiles to a valid kernel, else the reason (takes the
        constructor's arguments; `smem_limit`: the target's per-block shared memory)."""
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
        reason = check_rates(bits, bits_set, codebook, rate_axis)
        if reason is not None:
            return reason
        need = smem_bytes(block_m, bits, stages, codebook, bits_set)
        if smem_limit is not None and need > smem_limit:
            return (f"shared memory {need:,} B{table_note(codebook, bits_set)} > "
                    f"{smem_limit:,} B per-block limit")
        return None

    @cute.jit
    def __call__(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
                 pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOut: cute.Pointer,
                 n_routes: Int32, zero_row: Int32, max_blocks: Int32, pTable: cute.Pointer,
                 sm_count: Int32, pRateBits: cute.Pointer, pRateWords: cute.Pointer,
                 k_tile_words: Int32, stream):
        # One CTA per possible work item (the plan's block bound x N tiles); CTAs past the
        # packed block count exit at once, and the hardware scheduler balances the rest.
        # Table codebooks: one persistent CTA per resident slot instead (see module doc).
        grid = max_blocks * self.n_tiles
        if cutlass.const_expr(self.table):
            grid = persistent_grid(max_blocks, self.n_tiles, sm_count, self.ctas_per_sm)
        self.kernel(pA, pB, pSorted, pBlockExpert, pNumPadded, pOut, n_routes, zero_row,
                    pTable, pRateBits, pRateWords, k_tile_words).launch(
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

    def issue_b(self, ks, buf, b_gbase, b_saddr, tidx, threads: int = THREADS):
        """cp.async the trellis words of pipeline stage `ks` (4 k-tiles x the N tile's 8
        16-column tiles) into buffer `buf`, spread over the CTA's `threads` threads."""
        run_chunks = (TILE_N // 16) * self.tile_words * 4 // 16  # 16-B chunks of one k-tile's 8 tiles
        for i in range((self.b_chunks + threads - 1) // threads):
            q = (tidx + threads * i) % self.b_chunks
            kl = q // run_chunks
            within = q % run_chunks
            kt = ks * K_STEPS_PER_STAGE + kl
            src = b_gbase + Int64(kt * self.n_tiles16 * self.tile_words * 4 + within * 16)
            dst = b_saddr + (buf * self.b_stage_words + kl * (TILE_N // 16) * self.tile_words) * 4 + within * 16
            if threads * (i + 1) > self.b_chunks:  # the wrapping slots (as in issue_a)
                ptx.cp_async_16_if(Int32(cutlass.select_(tidx + threads * i < self.b_chunks, 1, 0)),
                                   dst, src)
                continue
            ptx.cp_async_16(dst, src)

    def b_tile_base(self, expert, nt):
        """Byte offset of (k-tile 0, first 16-column tile of N tile `nt`) of `expert`."""
        return Int64(expert * (self.k_tiles * self.n_tiles16) + nt * (TILE_N // 16)) * (self.tile_words * 4)

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
                self.copy_b(s, s, b_gbase, b_saddr, tidx)
            cute.arch.cp_async_commit_group()
        for ks in range(self.k_stages):
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.sync_threads()
            nxt = ks + self.stages - 1
            if nxt < self.k_stages:
                self.issue_a(nxt, nxt % self.stages, a_gaddr, a_saddr, rAsrc, rAbytes, tidx)
                self.copy_b(nxt, nxt % self.stages, b_gbase, b_saddr, tidx)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.mixed):
                K, _ = self.stage_rate(ks, b_gbase)
                self.for_rate(0, K, self.mma_stage_at_rate,
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
        return self.tile_words_at(sB, buf, kk, warp * 2 + jj, widx, bits)

    def tile_words_at(self, sB, buf, kk, n16, widx, bits=None):
        """This lane's trellis words of tile (k step kk, 16-column tile n16 of the N tile)
        in stage buffer `buf` (tiles of `bits` K, default the uniform K, packed from the
        buffer's start)."""
        tile_words = self.tile_words if bits is None else 8 * bits
        tb = buf * self.b_stage_words + (kk * (TILE_N // 16) + n16) * tile_words
        return [sB[tb + w] for w in widx]

    def decode_stage(self, sB, buf, kk, warp, widx, q0, jj, tab=None, bits=None):
        """This lane's 4 half2 B registers of tile (k step kk, 16-column tile 2*warp + jj)
        (`tab`: the state table's shared-memory address, table codebooks only)."""
        bits = self.bits if bits is None else bits
        return decode_lane_tile(self.stage_words(sB, buf, kk, warp, widx, jj, bits), q0, bits,
                                self.codebook, tab)

    # -- mixed rates (module docstring) -------------------------------------------------

    def copy_b(self, ks, buf, b_src, b_saddr, tidx, threads: int = THREADS):
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
            if threads * (i + 1) > b_chunks:  # the wrapping slots (as in issue_a)
                ptx.cp_async_16_if(Int32(cutlass.select_(tidx + threads * i < b_chunks, 1, 0)),
                                   dst, src)
                continue
            ptx.cp_async_16(dst, src)

    def rate_table(self, tab, bits: int):
        """Shared-memory address of `bits`'s state table (tables in `rates` order)."""
        return tab + self.rates.index(bits) * TABLE_BYTES

    @cute.jit
    def mma_stage_at_rate(self, bits: cutlass.Constexpr, n_mt: cutlass.Constexpr, sB, buf,
                          a_saddr, acc, warp, lanes, tab, lm_row, lm_col):
        """`mma_stage` of a stage of `bits` K (its lane windows and state table)."""
        widx, q0 = lanes[bits]
        self.mma_stage(n_mt, sB, buf, a_saddr, acc, warp, widx, q0, self.rate_table(tab, bits),
                       lm_row, lm_col, bits)

    @cute.kernel
    def kernel(self, pA: cute.Pointer, pB: cute.Pointer, pSorted: cute.Pointer,
               pBlockExpert: cute.Pointer, pNumPadded: cute.Pointer, pOut: cute.Pointer,
               n_routes: Int32, zero_row: Int32, pTable: cute.Pointer, pRateBits: cute.Pointer,
               pRateWords: cute.Pointer, k_tile_words: Int32):
        big = 1 << 30
        mSorted = cute.make_tensor(pSorted, cute.make_layout(big))
        mBlockExpert = cute.make_tensor(pBlockExpert, cute.make_layout(big))
        mNumPadded = cute.make_tensor(pNumPadded, cute.make_layout(1))
        a_gaddr = pA.toint()
        b_gaddr = pB.toint()

        smem = cutlass.memory.SmemAllocator()
        tab = None
        if cutlass.const_expr(self.table):
            sT = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(table_bytes(self.codebook, self.bits_set)), 128)
            tab = sT.iterator.toint()
        sA = smem.allocate_tensor(cutlass.Float16, cute.make_layout(a_smem_halves(self.block_m, self.stages)), 128)
        sB = smem.allocate_tensor(Uint32, cute.make_layout(self.stages * self.b_stage_words), 128)
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
        total = num_blocks * self.n_tiles
        rAsrc = cute.make_rmem_tensor((self.a_iters,), Int32)
        rAbytes = cute.make_rmem_tensor((self.a_iters,), Int32)
        acc = cute.make_rmem_tensor((self.m_tiles, 4, 4), Float32)
        lane_ctx = (tidx, warp, lane, widx, q0, tab, lm_row, lm_col)
        if cutlass.const_expr(self.table):
            # Persistent CTA: stage the state table once, then every grid-th work item.
            gdim, _, _ = cute.arch.grid_dim()
            if bidx < total:
                stage_table(pTable, tab, tidx, THREADS, table_bytes(self.codebook, self.bits_set))
            for work in range(bidx, total, gdim):
                self.work_item(work, mSorted, mBlockExpert, pOut, n_routes, zero_row, a_gaddr,
                               b_gaddr, a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx,
                               rates)
                cute.arch.sync_threads()  # the next item's copies overwrite the epilogue chunks
            cute.arch.cp_async_wait_group(0)  # a CTA whose items were all empty: the table
        else:
            work = bidx
            if work < total:
                self.work_item(work, mSorted, mBlockExpert, pOut, n_routes, zero_row, a_gaddr,
                               b_gaddr, a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx,
                               rates)

    @cute.jit
    def work_item(self, work, mSorted, mBlockExpert, pOut, n_routes, zero_row, a_gaddr, b_gaddr,
                  a_saddr, b_saddr, sB, rAsrc, rAbytes, acc, lane_ctx, rates=None):
        """Work item `work` (route block x N tile): A sources, MMAs, epilogue (`rates`: the
        rate-map tensors and FC1 k-tile stride, mixed rates only)."""
        tidx, warp, lane, widx, q0, tab, lm_row, lm_col = lane_ctx
        blk = work // self.n_tiles
        nt = work - blk * self.n_tiles
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
                b_gbase = self.rate_context(b_gaddr, *rates, expert, nt)
            else:
                b_gbase = b_gaddr + self.b_tile_base(expert, nt)
            # Only the m tiles holding real rows (a prefix of the block) run their MMAs:
            # e.g. the last block of an expert, 9 real rows of 64 at 4,096 tokens. Every
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
            self.store_tile(pOut.toint(), a_saddr, acc, rRoute0, rRoute1, nt, warp, lane, n_routes)

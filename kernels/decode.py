"""The trellis decode both GEMMs share: ring words -> 16-bit states -> half2 registers.

Owns how a lane turns its trellis words of one 16x16 tile into the four half2 registers
of its m16n8k16 B fragment (`decode_lane_tile`, with `lane_words` / `lane_window` /
`state_windows` for where its states sit and `decode_pair` for the codebook step; for
uniform K=2 sqg_e4m3 on sm_90a the pair-table decode `decode_lane_tile_pair`, which
computes 1 pair in 8 instead of reading it, `PAIR_ARITH_PERIOD`), and the
state tables of the table codebooks (sqg_e4m3): direct tables, the pair table or T12
(`table_decode`, `check_table_decode`; the T12 program is `kernels/sqg_t12.py`'s), their
size in shared memory (`table_bytes`, `table_note`), where they sit in the table argument
(`table_offset`), how a CTA stages them (`stage_table`) and the persistent
grid their GEMMs run (`persistent_grid`). `TrellisGemm` (mma.sync) and `TrellisWgmma`
(wgmma) decode through this module alone; the decode-only benchmark probe does too.
Codebook constants come from `kernels/format.py`.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from . import format as fmt
from . import ptx
from .sqg_t12 import T12_TABLE_BYTES, TABLE_DECODES, window_t12_index

#: Codebooks `decode_pair` decodes (each one's facts: `format.CODEBOOK`).
MMA_CODEBOOKS = ("mcg", "3inst", "mul1", "sqg_e4m3")
#: Codebooks decoded through a state -> byte table in shared memory (persistent CTAs).
TABLE_CODEBOOKS = fmt.TABLE_CODEBOOKS
#: Shared memory of one direct state table (one K): a byte per 16-bit state
#: (`format.Codebook.table_bytes_per_k` of every table codebook).
TABLE_BYTES = 1 << fmt.STATE_BITS
#: The K=2 pair table (`kquant_cute.trellis.sqg_pair_table`): 2^14 entries of 8 bytes.
PAIR_TABLE_BYTES = 1 << 17
#: K of the uniform layers the pair table decodes (`decode_lane_tile_pair`).
PAIR_TABLE_BITS = (2,)
#: The pair-table decode computes pair 0 of every `PAIR_ARITH_PERIOD`-th tile (k step) of a
#: lane instead of reading it (`decode_lane_tile_pair`): 1 of 8 pairs, so the ALU and FMA
#: pipes take 1/8 of the weights off the shared-memory banks. A quarter was slower: a
#: computed weight issues about four times the instructions of a table weight
#: (docs/benchmarks.md).
PAIR_ARITH_PERIOD = 2


def check_table_decode(codebook: str | None, table_decode: str) -> str | None:
    """None when `table_decode` is a decode of `codebook`'s tables: "direct" (a 64 KiB state
    table per K, or the K=2 pair table where the GEMM has `pair_table`; the only value of
    the arithmetic codebooks, which read none) or "t12" (table codebooks: T12 + the state
    bijection, `kernels/sqg_t12.py`)."""
    if table_decode not in TABLE_DECODES:
        return f"table_decode {table_decode!r} not in {TABLE_DECODES}"
    if table_decode == "t12" and codebook not in TABLE_CODEBOOKS:
        return f"table_decode 't12' needs a table codebook {TABLE_CODEBOOKS}, not {codebook!r}"
    return None


def table_bytes(codebook: str | None, bits_set: tuple = (), pair_table: bool = False,
                table_decode: str = "direct") -> int:
    """Shared memory of the codebook's state tables, one per rate of `bits_set` (one for a
    uniform K; 0 for the arithmetic codebooks); `pair_table`: the K=2 pair table instead;
    `table_decode` "t12": the one T12 every K reads."""
    if pair_table:
        return PAIR_TABLE_BYTES
    if codebook not in TABLE_CODEBOOKS:
        return 0
    if table_decode == "t12":
        return T12_TABLE_BYTES
    return fmt.CODEBOOK[codebook].table_bytes(max(1, len(bits_set)))


def table_offset(codebook: str | None, bits_set: tuple = (), table_decode: str = "direct") -> int:
    """Byte offset, in the `codebook_table` argument of a direct / T12 layer (the direct
    tables in `bits_set` order, then T12: `kquant_cute.trellis.sqg_kernel_tables`), of the
    bytes a GEMM stages."""
    if codebook in TABLE_CODEBOOKS and table_decode == "t12":
        return TABLE_BYTES * max(1, len(bits_set))
    return 0


def check_pair_table(bits: int, bits_set: tuple, codebook: str,
                     table_decode: str = "direct") -> str | None:
    """None when the pair table can decode this layer (uniform sqg_e4m3 K in
    `PAIR_TABLE_BITS`, with the tables of `table_decode` "direct")."""
    if codebook not in TABLE_CODEBOOKS or bits_set or bits not in PAIR_TABLE_BITS:
        return (f"the pair table decodes uniform {TABLE_CODEBOOKS} layers of K in "
                f"{PAIR_TABLE_BITS}, not {codebook!r} K={bits} bits_set={bits_set}")
    if table_decode != "direct":
        return f"the pair table is a direct-table decode, not table_decode {table_decode!r}"
    return None


def table_note(codebook: str | None, bits_set: tuple = (), pair_table: bool = False,
               table_decode: str = "direct") -> str:
    """What the state tables add to a shared-memory rejection ("" without tables)."""
    if not table_bytes(codebook):
        return ""
    if pair_table:
        return f" (incl. the {PAIR_TABLE_BYTES // 1024} KiB {codebook} pair table)"
    if table_decode == "t12":
        return f" (incl. the {T12_TABLE_BYTES // 1024} KiB {codebook} T12 table)"
    if bits_set:
        return (f" (incl. the {table_bytes(codebook, bits_set) // 1024} KiB of {codebook} state "
                f"tables for K {', '.join(map(str, bits_set))})")
    return f" (incl. the {TABLE_BYTES // 1024} KiB {codebook} state table)"


def stage_table(pTable, t_saddr, tidx, threads: int, nbytes: int = TABLE_BYTES, offset: int = 0):
    """cp.async `nbytes` of state tables (64 KiB each, the 128 KiB pair table or the 4 KiB
    T12) from global memory (`offset` bytes into `pTable`) into shared memory at `t_saddr`
    (one commit group; the main loop's first wait covers it, groups retire in order)."""
    chunks = nbytes // 16
    for i in range((chunks + threads - 1) // threads):  # unrolled at trace time
        q = tidx + threads * i
        src = pTable.toint() + Int64(q * 16)
        if offset:
            src = src + Int64(offset)
        if threads * (i + 1) > chunks:  # more threads than chunks left (T12: 256 chunks)
            ptx.cp_async_16_if(Int32(cutlass.select_(q < chunks, 1, 0)), t_saddr + q * 16, src)
            continue
        ptx.cp_async_16(t_saddr + q * 16, src)
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
REPLICATE_CODEBOOKS = tuple(c for c in MMA_CODEBOOKS if fmt.CODEBOOK[c].replicates)


def replicated(mul: int) -> int:
    """The multiplier that maps the replicated state (s : s) to s * `mul` (mod 2^32)."""
    return (mul * REPLICATE_INV) & 0xFFFFFFFF


def decode_pair(s0, s1, codebook: str, table=None, rep=(False, False), bits: int = 0,
                table_decode: str = "direct"):
    """Two 16-bit trellis states -> one half2 register of their codebook values (`table`:
    the shared-memory address of the state table, table codebooks only; with
    `table_decode` "t12" the address of T12, indexed through the K = `bits` bijection).
    `rep[i]`: state i arrives replicated in both halves (see `REPLICATE`), never for
    table codebooks."""
    if codebook == "sqg_e4m3":
        assert not any(rep), "table codebooks read the zero-extended state"
        if table_decode == "t12":
            return ptx.e4m3_t12_pair(s0, s1, table, bits)
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


def decode_lane_tile(words, q0, bits: int, codebook: str, table=None,
                     table_decode: str = "direct") -> list:
    """This lane's 8 weights of one 16x16 tile -> 4 half2 B registers (pairs in t order).

    `words` are the lane's `lane_window(bits)[1]` consecutive ring words (from word
    p0 // 32) and `q0` = p0 mod 32 (run-time; unused when it is a compile-time constant).
    With a run-time q0, two funnel shifts align a 64-bit window first. A few more windows
    (chosen at compile time by `state_windows`) put every state at a byte offset 0, 8 or 16
    of some 32-bit word, where one ALU op (shift, byte permute or mask) extracts it; for the
    arithmetic codebooks a byte-aligned state straddling two windows is one byte permute
    too, replicated in both halves (`REPLICATE`). `table_decode`: see `decode_pair`."""
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
                        (rep[2 * p], rep[2 * p + 1]), bits, table_decode) for p in range(4)]


def decode_tile(words, q0, bits: int, codebook: str, table=None,
                pair_table: bool = False, table_decode: str = "direct", tile: int = 0) -> list:
    """A lane's 4 half2 registers of one tile: `decode_lane_tile_pair` through the pair
    table where the GEMM stages one (`pair_table`; `tile`, the tile's k step within its
    stage, a compile-time int, picks the tiles with an arithmetic pair:
    `PAIR_ARITH_PERIOD`), else `decode_lane_tile` (through the direct tables or T12:
    `table_decode`)."""
    if pair_table:
        arith = 1 if tile % PAIR_ARITH_PERIOD == PAIR_ARITH_PERIOD - 1 else 0
        return decode_lane_tile_pair(words, q0, table, arith)
    return decode_lane_tile(words, q0, bits, codebook, table, table_decode)


# -- the K=2 pair table ------------------------------------------------------------------

#: Byte offset of a pair's entry: 8 x its 14 shared bits.
PAIR_OFFSET_MASK = 0x1FFF8


def pair_table_fields(w, const=int):
    """Entry offsets and byte-permute selectors of a lane's 4 K=2 pairs (one half2 each).

    `w` is the lane's aligned 32-bit window (MSB first: state i = bits [2i, 2i + 16) of the
    view, register bits 31-2i .. 16-2i); `const` wraps constants in `w`'s integer type (the
    kernel's Uint32, numpy's uint32 in the CPU proof), so this one function is both the
    decode and its model. Pair p = states (2p, 2p + 1) spans view bits [4p, 4p + 18): the
    earlier state's top 2 bits a_p, the 14 shared bits s_p (register bits 29-4p .. 16-4p),
    the later state's new 2 bits b_p. Entry offset = 8 * s_p: one shift and one mask. The
    byte permute needs selector nibble 0 = a_p (bytes 0-3 hold the earlier state's
    candidates) and nibble 1 = 4 + b_p (bytes 4-7); bit 3 of a nibble must stay 0 (it
    would replicate the sign). In the register b_p sits at bit 14 - 4p and a_p 16 bits
    higher, so `(w >> 2) & 0x33333333` puts every field in the low 2 bits of its own
    nibble (a_p: nibble 7 - p, b_p: nibble 3 - p, the +4 set on the b nibbles); moving the
    a nibbles of pairs 0 and 2 down 20 bits (pairs 1 and 3: the b nibbles up 20) makes
    a_p and b_p adjacent nibbles, and one shift per pair brings them to nibbles 0 and 1
    (higher nibbles pick result bytes 2-3, which the cvt ignores)."""
    a = ((w >> 2) & const(0x33333333)) | const(0x4444)
    even = ((a >> 20) & const(0x0F0F)) | (a & const(0xF0F0))  # pair 0: nibbles 2-3, pair 2: 0-1
    odd = ((a << 20) & const(0xF0F00000)) | (a & const(0x0F0F0000))  # pair 1: 6-7, pair 3: 4-5
    m = const(PAIR_OFFSET_MASK)
    offsets = ((w >> 13) & m, (w >> 9) & m, (w >> 5) & m, (w >> 1) & m)
    return offsets, (even >> 8, odd >> 24, even, odd >> 16)


def decode_lane_tile_pair(words, q0, table, arith_pairs: int = 0) -> list:
    """`decode_lane_tile` of a K=2 sqg_e4m3 tile through the pair table at `table` (shared
    memory): one funnel shift aligns the lane's 30 stream bits (its 8 states), then per
    pair one 8-byte load, one byte permute and one cvt (`pair_table_fields`). The first
    `arith_pairs` pairs skip the table: their states' T12 indices come from the integer
    program (`sqg_t12.window_t12_index`) and their values from the arithmetic T12
    (`ptx.e4m3_poly_pair`), so the ALU and FMA pipes take that share of the decode off
    the shared-memory banks."""
    w = ptx.funnel_hi(words[0], words[1], q0)
    offsets, sels = pair_table_fields(w, Uint32)
    out = []
    rev = ptx.brev_u32(w) if arith_pairs else None
    for p in range(4):
        if p < arith_pairs:
            o = 16 - 4 * p  # state 2p at register bits [o, o + 16), state 2p + 1 two lower
            out.append(ptx.e4m3_poly_pair(window_t12_index(w, o, rev, Uint32),
                                          window_t12_index(w, o - 2, rev, Uint32)))
        else:
            out.append(ptx.e4m3_pair_entry(offsets[p], sels[p], table))
    return out


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

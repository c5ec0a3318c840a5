"""Route pack on the GPU: group the routed (token, k) pairs by local expert into blocks.

Owns the two kernels of the pack, each a grid of `launch.pack_ctas(n_routes)` CTAs of
1,024 threads, CTA g owning routes [g * PACK_ROUTES_PER_CTA, (g + 1) * PACK_ROUTES_PER_CTA):
- `RouteCount`: CTA g's per-expert histogram (shared-memory atomics) -> row g of the
  `route_hist` scratch [CTAs, E];
- `RoutePack`: every CTA sums the histogram rows (all of them: the expert totals; those
  before it: where its routes start inside each expert), pads each total up to a multiple
  of the route block M and takes an exclusive prefix sum over experts (Hillis-Steele over
  per-thread expert chunks); then CTA 0 writes the per-expert offsets and counts and the
  packed count, the CTAs between them each expert's padding slots (sentinel = n_routes)
  and the local expert id per block (-1 past the packed count, CTA 0), and every CTA
  places its own routes' ids.
The per-route work (an atomic and a scattered store) is bound by one SM's L1 throughput,
so it is spread over CTAs; the price is the histogram round trip through L2 and a second
launch. An optional expert_map (global id -> local id, -1 = not on this rank) drops routes
of experts that live elsewhere. Order within an expert follows the atomics and is not
deterministic; consumers key their results by route id, so outputs do not depend on it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from . import ptx
from .launch import PACK_ROUTES_PER_CTA, pack_ctas  # noqa: F401 - pack_ctas: the grid's owner

THREADS = 1024
#: Route ids a thread loads before the first shared-memory atomic on them (coalesced: route
#: r0 + u * THREADS + tid for u < this), so that many loads are in flight per thread.
ROUTES_PER_THREAD = PACK_ROUTES_PER_CTA // THREADS
assert ROUTES_PER_THREAD * THREADS == PACK_ROUTES_PER_CTA


def smem_bytes(num_experts: int) -> int:
    """RoutePack's dynamic shared memory: per-expert totals and cursors, the two scan
    buffers, slack."""
    return 4 * (2 * num_experts + 2 * THREADS) + 64


def count_smem_bytes(num_experts: int) -> int:
    """RouteCount's dynamic shared memory: per-expert counts, slack."""
    return 4 * num_experts + 64


def _smem_reason(what: str, need: int, smem_limit: int | None) -> str | None:
    if smem_limit is not None and need > smem_limit:
        return f"{what} needs {need:,} B shared memory > {smem_limit:,} B per-block limit"
    return None


def _grid(n_routes: Int32):
    """`launch.pack_ctas` on the run-time route count: at least one CTA (CTA 0 writes the
    offsets and the block list even for no routes)."""
    return cutlass.max((n_routes + PACK_ROUTES_PER_CTA - 1) // PACK_ROUTES_PER_CTA, 1)


@cute.jit
def own_experts(mIds, mMap, g, tidx, n_routes: Int32, has_map: cutlass.Constexpr):
    """Local experts of CTA g's routes r0 + tidx + u * THREADS, u < ROUTES_PER_THREAD, with
    r0 = g * PACK_ROUTES_PER_CTA (-1 past n_routes, whose loads read route n_routes - 1
    instead: no branch, every load issued at once; none at all for a CTA past the routes)."""
    es = cute.make_rmem_tensor((ROUTES_PER_THREAD,), Int32)
    es.fill(-1)
    r = g * PACK_ROUTES_PER_CTA + tidx
    if g * PACK_ROUTES_PER_CTA < n_routes:
        for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
            ru = r + u * THREADS
            ri = Int32(cutlass.select_(ru < n_routes, ru, n_routes - 1))
            e = ptx.local_expert(mIds, mMap, ri, has_map)
            es[u] = Int32(cutlass.select_(ru < n_routes, e, -1))
    return es


class RouteCount:
    threads = THREADS

    def __init__(self, *, num_experts: int, has_map: bool):
        self.num_experts = num_experts
        self.has_map = has_map
        self.smem_bytes = count_smem_bytes(num_experts)

    @staticmethod
    def can_implement(*, num_experts: int, has_map: bool,
                      smem_limit: int | None = None) -> str | None:
        """None when one CTA holds the histogram of `num_experts` experts, else the reason."""
        return _smem_reason("route count", count_smem_bytes(num_experts), smem_limit)

    @cute.jit
    def __call__(self, pIds, pMap, pHist, n_routes: Int32, stream):
        self.kernel(pIds, pMap, pHist, n_routes).launch(
            grid=[_grid(n_routes), 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, pIds, pMap, pHist, n_routes: Int32):
        E = self.num_experts
        mIds, mMap, mHist = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap), ptx.flat_tensor(pHist)
        smem = cutlass.memory.SmemAllocator()
        sCount = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        tidx, _, _ = cute.arch.thread_idx()
        g, _, _ = cute.arch.block_idx()
        for e in range(tidx, E, THREADS):
            sCount[e] = 0
        cute.arch.sync_threads()
        es = own_experts(mIds, mMap, g, tidx, n_routes, self.has_map)
        for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
            if es[u] >= 0:
                cute.arch.atomic_add((sCount.iterator + es[u]).llvm_ptr, Int32(1))
        cute.arch.sync_threads()
        for e in range(tidx, E, THREADS):
            mHist[g * E + e] = sCount[e]


class RoutePack:
    threads = THREADS

    def __init__(self, *, num_experts: int, block_m: int, has_map: bool):
        self.num_experts = num_experts
        self.block_m = block_m
        self.has_map = has_map
        self.chunk = (num_experts + THREADS - 1) // THREADS  # experts per thread
        self.smem_bytes = smem_bytes(num_experts)

    @staticmethod
    def can_implement(*, num_experts: int, block_m: int, has_map: bool,
                      smem_limit: int | None = None) -> str | None:
        """None when one CTA can pack `num_experts` experts, else the reason."""
        return _smem_reason("route pack", smem_bytes(num_experts), smem_limit)

    @cute.jit
    def __call__(self, pIds, pMap, pHist, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
                 n_routes: Int32, max_blocks: Int32, stream):
        self.kernel(pIds, pMap, pHist, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
                    n_routes, max_blocks).launch(grid=[_grid(n_routes), 1, 1],
                                                 block=[THREADS, 1, 1], smem=self.smem_bytes,
                                                 stream=stream)

    @cute.kernel
    def kernel(self, pIds, pMap, pHist, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
               n_routes: Int32, max_blocks: Int32):
        E = self.num_experts
        M = self.block_m
        mIds, mMap, mHist = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap), ptx.flat_tensor(pHist)
        mSorted = ptx.flat_tensor(pSorted)
        mBlockExpert, mNumPadded = ptx.flat_tensor(pBlockExpert), ptx.flat_tensor(pNumPadded)
        mOffsets, mCounts = ptx.flat_tensor(pOffsets), ptx.flat_tensor(pCounts)
        smem = cutlass.memory.SmemAllocator()
        sCount = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        sCursor = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(2 * THREADS), 16)
        tidx, _, _ = cute.arch.thread_idx()
        g, _, _ = cute.arch.block_idx()
        n_ctas = _grid(n_routes)

        # Totals of this thread's expert chunk over every CTA's histogram row, the routes
        # of the CTAs before this one (sCursor, for now), and the padded sum.
        first = tidx * self.chunk
        own = Int32(0)
        for i in cutlass.range_constexpr(self.chunk):
            e = first + i
            if e < E:
                total = Int32(0)
                before = Int32(0)
                for c in cutlass.range(n_ctas, unroll=4):
                    h = mHist[c * E + e]
                    total = total + h
                    before = before + Int32(cutlass.select_(c < g, h, 0))
                sCount[e] = total
                sCursor[e] = before
                own = own + (total + M - 1) // M * M
        sScan[tidx] = own
        cute.arch.sync_threads()
        src = 0
        for s in cutlass.range_constexpr(10):  # log2(THREADS)
            off = 1 << s
            v = sScan[src * THREADS + tidx]
            if tidx >= off:
                v = v + sScan[src * THREADS + tidx - off]
            sScan[(1 - src) * THREADS + tidx] = v
            cute.arch.sync_threads()
            src = 1 - src
        total = sScan[src * THREADS + THREADS - 1]
        base = sScan[src * THREADS + tidx] - own
        for i in cutlass.range_constexpr(self.chunk):
            e = first + i
            if e < E:
                cnt = sCount[e]
                padded = (cnt + M - 1) // M * M
                sCursor[e] = base + sCursor[e]
                if g == 0:
                    mOffsets[e] = base
                    mCounts[e] = cnt
                # Each expert's padding slots and blocks by one CTA, experts dealt round
                # robin: one thread's stores scatter over the block list and the slots, and
                # one SM's L1 takes each store of a warp as a separate access.
                if e % n_ctas == g:
                    for slot in range(base + cnt, base + padded):
                        mSorted[slot] = n_routes
                    for b in range(base // M, (base + padded) // M):
                        mBlockExpert[b] = e
                base = base + padded
        if g == 0:
            if tidx == 0:
                mNumPadded[0] = total
                mOffsets[E] = total
            for b in range(total // M + tidx, max_blocks, THREADS):
                mBlockExpert[b] = -1
        cute.arch.sync_threads()
        es = own_experts(mIds, mMap, g, tidx, n_routes, self.has_map)
        for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
            if es[u] >= 0:
                slot = cute.arch.atomic_add((sCursor.iterator + es[u]).llvm_ptr, Int32(1))
                mSorted[slot] = g * PACK_ROUTES_PER_CTA + tidx + u * THREADS

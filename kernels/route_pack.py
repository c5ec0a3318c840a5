"""Route pack on the GPU: group the routed (token, k) pairs by local expert into blocks.

Owns `RoutePack`, one CTA of 1024 threads, no host synchronisation:
per-expert histogram (shared-memory atomics), each count padded up to a multiple of the
route block M, an exclusive prefix sum (Hillis-Steele over per-thread expert chunks),
then the packed route ids (sentinel = n_routes for padding slots), the local expert id
per block (-1 past the packed count), the packed count, per-expert offsets and counts.
An optional expert_map (global id -> local id, -1 = not on this rank) drops routes of
experts that live elsewhere. Order within an expert follows the atomics and is not
deterministic; consumers key their results by route id, so outputs do not depend on it.
Both passes over the routes load `ROUTES_PER_THREAD` ids per thread before using any, so
that many global loads are in flight per thread instead of one load, then its atomic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from . import ptx

THREADS = 1024
#: Route ids a thread loads before the first shared-memory atomic on them (coalesced: route
#: r0 + u * THREADS + tid for u < this).
ROUTES_PER_THREAD = 8


def smem_bytes(num_experts: int) -> int:
    """Dynamic shared memory: per-expert counts and cursors, the two scan buffers, slack."""
    return 4 * (2 * num_experts + 2 * THREADS) + 64


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
        need = smem_bytes(num_experts)
        if smem_limit is not None and need > smem_limit:
            return f"route pack needs {need:,} B shared memory > {smem_limit:,} B per-block limit"
        return None

    @cute.jit
    def __call__(self, pIds, pMap, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
                 n_routes: Int32, max_blocks: Int32, stream):
        self.kernel(pIds, pMap, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
                    n_routes, max_blocks).launch(grid=[1, 1, 1], block=[THREADS, 1, 1],
                                                 smem=self.smem_bytes,
                                                 stream=stream)

    @cute.kernel
    def kernel(self, pIds, pMap, pSorted, pBlockExpert, pNumPadded, pOffsets, pCounts,
               n_routes: Int32, max_blocks: Int32):
        E = self.num_experts
        M = self.block_m
        mIds, mMap, mSorted = ptx.flat_tensor(pIds), ptx.flat_tensor(pMap), ptx.flat_tensor(pSorted)
        mBlockExpert, mNumPadded = ptx.flat_tensor(pBlockExpert), ptx.flat_tensor(pNumPadded)
        mOffsets, mCounts = ptx.flat_tensor(pOffsets), ptx.flat_tensor(pCounts)
        smem = cutlass.memory.SmemAllocator()
        sCount = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        sCursor = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(2 * THREADS), 16)
        tidx, _, _ = cute.arch.thread_idx()

        for e in range(tidx, E, THREADS):
            sCount[e] = 0
        cute.arch.sync_threads()
        for r0 in range(0, n_routes, THREADS * ROUTES_PER_THREAD):
            es = self.load_experts(mIds, mMap, r0 + tidx, n_routes)
            for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
                if es[u] >= 0:
                    cute.arch.atomic_add((sCount.iterator + es[u]).llvm_ptr, Int32(1))
        cute.arch.sync_threads()

        # Padded counts of this thread's expert chunk, then an inclusive scan over threads.
        first = tidx * self.chunk
        own = Int32(0)
        for i in cutlass.range_constexpr(self.chunk):
            e = first + i
            if e < E:
                own = own + (sCount[e] + M - 1) // M * M
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
                sCursor[e] = base
                mOffsets[e] = base
                mCounts[e] = cnt
                for slot in range(base + cnt, base + padded):
                    mSorted[slot] = n_routes
                for b in range(base // M, (base + padded) // M):
                    mBlockExpert[b] = e
                base = base + padded
        if tidx == 0:
            mNumPadded[0] = total
            mOffsets[E] = total
        for b in range(total // M + tidx, max_blocks, THREADS):
            mBlockExpert[b] = -1
        cute.arch.sync_threads()
        for r0 in range(0, n_routes, THREADS * ROUTES_PER_THREAD):
            es = self.load_experts(mIds, mMap, r0 + tidx, n_routes)
            for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
                if es[u] >= 0:
                    slot = cute.arch.atomic_add((sCursor.iterator + es[u]).llvm_ptr, Int32(1))
                    mSorted[slot] = r0 + tidx + u * THREADS

    @cute.jit
    def load_experts(self, mIds, mMap, r, n_routes: Int32):
        """Local experts of routes r + u * THREADS, u < ROUTES_PER_THREAD (-1 past n_routes,
        whose loads read route n_routes - 1 instead: no branch, every load issued at once)."""
        es = cute.make_rmem_tensor((ROUTES_PER_THREAD,), Int32)
        for u in cutlass.range_constexpr(ROUTES_PER_THREAD):
            ru = r + u * THREADS
            e = ptx.local_expert(mIds, mMap, Int32(cutlass.select_(ru < n_routes, ru, n_routes - 1)),
                                 self.has_map)
            es[u] = Int32(cutlass.select_(ru < n_routes, e, -1))
        return es

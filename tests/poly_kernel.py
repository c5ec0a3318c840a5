"""A one-instruction-group kernel for tests/test_gpu_moe.py: `ptx.e4m3_poly_pair` on two
index vectors (imported by the GPU test only; the DSL resolves names in module globals)."""

import cutlass
import cutlass.cute as cute

from kquant_cute.kernels import ptx

THREADS = 128


@cute.kernel
def _poly_kernel(qa: cute.Tensor, qb: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    out[i] = cutlass.Int32(ptx.e4m3_poly_pair(cutlass.Uint32(qa[i]), cutlass.Uint32(qb[i])))


@cute.jit
def poly_pairs(qa: cute.Tensor, qb: cute.Tensor, out: cute.Tensor):
    """out[i] = the half2 of the computed T12 values of qa[i] (low) and qb[i] (high); the
    length is a multiple of `THREADS`."""
    _poly_kernel(qa, qb, out).launch(grid=(cute.size(qa) // THREADS, 1, 1), block=(THREADS, 1, 1))

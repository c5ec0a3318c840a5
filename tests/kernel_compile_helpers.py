"""Compile one kernel class alone for an arch with fake pointers (CPU only), and read its
resources: the compile-only tests of single kernel modules (test_route_pack, test_rotate);
and the skip markers of tests that read resources or SASS."""

from __future__ import annotations

import pytest

from kquant_cute.kernels import build

needs_cuobjdump = pytest.mark.skipif(
    build.find_cuobjdump() is None,
    reason="cuobjdump not found (the nvidia-cuda-cuobjdump dependency): resources unmeasurable")
needs_sass = pytest.mark.skipif(
    build.find_cuobjdump() is None or build.find_nvdisasm() is None,
    reason="cuobjdump -sass needs cuobjdump and nvdisasm (pip install -e \".[test]\")")


def compile_alone(kernel, pointee_dtypes, n_ints: int, arch: str, name: str) -> dict:
    """Cross-compile `kernel` (a launcher whose __call__ takes one pointer per entry of
    `pointee_dtypes` (cutlass dtypes), then `n_ints` Int32, then the stream) for `arch`;
    returns the measured resources of its one device kernel (shared: static + dynamic)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    args = [make_ptr(dt, 256, cute.AddressSpace.gmem, assumed_align=16) for dt in pointee_dtypes]
    args += [Int32(1)] * n_ints + [cuda.CUstream(0)]
    _, resources, _ = build.compile_measured(kernel, args, arch, {name: kernel.smem_bytes})
    (res,) = resources
    assert res.kernel == name
    return {"registers": res.registers, "spills": res.stack + res.local, "shared": res.shared}

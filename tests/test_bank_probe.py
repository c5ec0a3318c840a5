"""Tests of the shared-memory gather probe of the benchmarks (benchmarks/bank_probe.py).

* Each mode cross-compiles for sm_90a without spills, one CTA per SM by its table, and
  its loop issues the shared load width the mode names (SASS; needs nvdisasm).
* On a GPU, every thread's output word equals the host model bit for bit (the addresses
  and folds the timings stand for).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys

import pytest

from kquant_cute.kernels.build import dump_sass
from kernel_compile_helpers import needs_sass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import bank_probe  # noqa: E402

LOAD = {1: "LDS.U8", 4: "LDS", 8: "LDS.64", 16: "LDS.128"}


def test_rejects_unknown_mode_and_thread_counts():
    with pytest.raises(ValueError, match="mode 'octet'"):
        bank_probe.BankProbe("octet", 512)
    with pytest.raises(ValueError, match="threads 100"):
        bank_probe.BankProbe("pair", 100)
    with pytest.raises(ValueError, match="sync_every 1"):
        bank_probe.BankProbe("pair", 96, sync_every=1)


@needs_sass
@pytest.mark.parametrize("mode", sorted(bank_probe.MODES))
def test_compiles_with_the_modes_load_width(mode, tmp_path):
    _, res = bank_probe.compile_probe(mode, 1024, "sm_90a", str(tmp_path))
    (r,) = res
    table, width = bank_probe.MODES[mode]
    assert r.local == 0 and r.stack == 0  # no spills
    assert r.shared >= table and r.shared <= 227 * 1024  # one CTA per SM, as the GEMMs
    assert 1024 * r.registers <= 65536
    sass = dump_sass(glob.glob(str(tmp_path / "*.cubin"))[0])
    ops = collections.Counter(re.findall(r"\b(LDS(?:\.[A-Z0-9]+)?)\b", sass))
    assert ops[LOAD[width]] >= bank_probe.UNROLL, ops
    assert set(ops) == {LOAD[width]}, ops


@pytest.mark.gpu
@pytest.mark.parametrize("mode,sync", [(m, 0) for m in sorted(bank_probe.MODES)] + [("pair", 2)])
def test_outputs_equal_the_host_model(mode, sync):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import numpy as np
    import torch
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90+ GPU")
    threads, iters, ctas = 256, 5, 3
    arch = "sm_%d%da" % torch.cuda.get_device_capability()
    fn, _ = bank_probe.compile_probe(mode, threads, arch, sync_every=sync)
    out = torch.full((ctas * threads,), -1, dtype=torch.int32, device="cuda")
    ptr = make_ptr(cutlass.Uint32, out.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
    fn(ptr, Int32(iters), Int32(ctas), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    got = out.cpu().numpy().view(np.uint32)
    want = bank_probe.reference_output(mode, threads, iters, ctas)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:8]

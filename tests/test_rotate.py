"""Tests for kernels/rotate.py: the three rotation stages' can_implement reasons, their
launch geometry (one warp per 128-chunk or, coupled, per 512-block; no shared memory) and
a compile of each variant (CPU only; their numbers are checked on the GPU against the
torch reference in tests/test_gpu_moe.py and tests/test_coupled_kernels.py)."""

from __future__ import annotations

import pytest

from kquant_cute.kernels.arch import arch_limits
from kquant_cute.kernels.rotate import CombineOutput, MidActivation, RotateInput

from kernel_compile_helpers import compile_alone, needs_cuobjdump

ROT = dict(topk=4, has_map=False)
MID = dict(activation="silu", has_map=False)
COMB = dict(topk=4, has_map=False, out_dtype=None)


# ---------------------------------------------------------------------------------------
# can_implement: the reasons, and the constructors agree with them
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [100, 200, 384 + 64])
def test_dimensions_must_be_whole_chunks(hidden):
    want = f"hidden {hidden} is not a multiple of 128 (one warp per 128-wide chunk)"
    assert RotateInput.can_implement(hidden=hidden, per_route=False, **ROT) == want
    assert CombineOutput.can_implement(hidden=hidden, shared_svh=True, **COMB) == want
    assert MidActivation.can_implement(intermediate=hidden, **MID) == (
        f"intermediate {hidden} is not a multiple of 128 (one warp per 128-wide chunk)")
    assert RotateInput.can_implement(hidden=hidden + 128 - hidden % 128, per_route=False,
                                     **ROT) is None


def test_coupled_needs_shared_vectors_and_512_blocks():
    bad_in = "coupled RotateInput needs shared vectors and hidden % 512 == 0"
    bad_out = "coupled CombineOutput needs shared svh and hidden % 512 == 0"
    for hidden, shared, ok in ((512, True, True), (1536, True, True), (640, True, False),
                               (512, False, False)):
        r_in = RotateInput.can_implement(hidden=hidden, per_route=not shared, coupled=True, **ROT)
        r_out = CombineOutput.can_implement(hidden=hidden, shared_svh=shared, coupled=True,
                                            **COMB)
        assert (r_in, r_out) == ((None, None) if ok else (bad_in, bad_out)), (hidden, shared)
        if not ok:  # the constructor refuses what can_implement rejects, with the same reason
            with pytest.raises(ValueError, match=bad_in):
                RotateInput(hidden=hidden, per_route=not shared, coupled=True, **ROT)
            with pytest.raises(ValueError, match=bad_out):
                CombineOutput(hidden=hidden, shared_svh=shared, coupled=True, **COMB)
    # 640 = 5 chunks of 128: fine uncoupled.
    assert RotateInput.can_implement(hidden=640, per_route=False, **ROT) is None


def test_activation_must_be_known():
    want = "activation 'gelu' not in ('silu', 'situ')"
    assert MidActivation.can_implement(intermediate=256, activation="gelu", has_map=False) == want
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        MidActivation(intermediate=256, activation="gelu", has_map=False)
    for act in ("silu", "situ"):
        assert MidActivation.can_implement(intermediate=256, activation=act, has_map=True) is None


# ---------------------------------------------------------------------------------------
# Launch geometry
# ---------------------------------------------------------------------------------------


def test_four_warps_per_cta_one_work_item_each_and_no_shared_memory():
    """128 threads = 4 warps; a row of H has H / 128 chunk items (coupled: H / 512 block
    items, each four chunks); the stages keep everything in registers and shuffles."""
    stages = [RotateInput(hidden=1536, per_route=False, coupled=True, **ROT),
              MidActivation(intermediate=384, coupled=True, **MID),
              CombineOutput(hidden=1536, shared_svh=True, coupled=True, **COMB)]
    for k in stages:
        assert (k.threads, k.smem_bytes) == (4 * 32, 0)
    rot, mid, comb = stages
    assert (rot.chunks, rot.blocks512) == (12, 3) == (comb.chunks, comb.blocks512)
    assert mid.chunks == 3


# ---------------------------------------------------------------------------------------
# Compiles
# ---------------------------------------------------------------------------------------


def _variants():
    from cutlass import BFloat16, Float16, Float32, Int32

    f16, f32, i32 = Float16, Float32, Int32
    rot_ptrs = [BFloat16, f16, f16, i32, i32, f16, f16]
    mid_ptrs = [f32, f32, f16, f16, f16, f16, f16, i32, i32, f16]
    comb_ptrs = [f32, f16, i32, i32, f32, BFloat16]
    return [
        ("RotateInput", RotateInput(hidden=512, per_route=True, topk=4, has_map=True), rot_ptrs),
        ("RotateInput", RotateInput(hidden=512, per_route=False, coupled=True, **ROT), rot_ptrs),
        ("MidActivation", MidActivation(intermediate=256, activation="situ", has_map=True), mid_ptrs),
        ("MidActivation", MidActivation(intermediate=256, coupled=True, **MID), mid_ptrs),
        ("CombineOutput", CombineOutput(hidden=512, topk=4, shared_svh=False, has_map=True,
                                        out_dtype=BFloat16), comb_ptrs),
        ("CombineOutput", CombineOutput(hidden=512, topk=4, shared_svh=True, has_map=False,
                                        out_dtype=BFloat16, coupled=True), comb_ptrs),
    ]


@needs_cuobjdump
@pytest.mark.slow
def test_every_variant_compiles_without_spills_or_shared_memory():
    arch = "sm_90a"
    cap = arch_limits(arch).max_registers_per_thread(128)
    for name, kernel, ptrs in _variants():
        res = compile_alone(kernel, ptrs, 1, arch, name)
        what = (name, kernel.coupled)
        assert res["spills"] == 0, what
        assert 0 < res["registers"] <= cap, what
        assert res["shared"] == 0, what  # none: not even the per-CTA reservation

"""Tests for kernels/route_pack.py: shared memory, can_implement and the CTA geometry of its
two kernels (CPU: the numbers and a compile per arch; the packing itself runs on the GPU
against kquant_cute.reference.route_pack_reference in tests/test_gpu_moe.py)."""

from __future__ import annotations

import pytest

from kquant_cute.kernels.arch import arch_limits
from kquant_cute.kernels.launch import PACK_ROUTES_PER_CTA
from kquant_cute.kernels.route_pack import (ROUTES_PER_THREAD, THREADS, RouteCount, RoutePack,
                                            count_smem_bytes, smem_bytes)

from kernel_compile_helpers import compile_alone, needs_cuobjdump


def test_shared_memory_hand_computed():
    # 896 experts: counts + cursors (2 x 896 int32), two scan buffers (2 x 1,024 int32), 64 slack.
    assert smem_bytes(896) == 4 * 1792 + 4 * 2048 + 64 == 15_424
    assert smem_bytes(1) == 8 + 8192 + 64
    # Linear: 8 bytes per expert on top of the scan buffers.
    assert all(smem_bytes(e + 1) - smem_bytes(e) == 8 for e in (1, 7, 896, 5000))
    # The histogram kernel: one count per expert and 64 slack.
    count = RouteCount(num_experts=896, has_map=True)
    assert count_smem_bytes(896) == 4 * 896 + 64 == count.smem_bytes


def test_can_implement_is_the_shared_memory_bound():
    for limit in (arch_limits(a).smem_per_block_optin for a in ("sm_80", "sm_90", "sm_120")):
        largest = (limit - 64 - 8 * THREADS) // 8  # the most experts one CTA holds
        ok = dict(block_m=8, has_map=False, smem_limit=limit)
        assert RoutePack.can_implement(num_experts=largest, **ok) is None
        reason = RoutePack.can_implement(num_experts=largest + 1, **ok)
        assert reason == (f"route pack needs {smem_bytes(largest + 1):,} B shared memory > "
                          f"{limit:,} B per-block limit")
    # No limit given: nothing to check against.
    assert RoutePack.can_implement(num_experts=10**6, block_m=64, has_map=True) is None


@pytest.mark.parametrize("experts, chunk", [(1, 1), (1024, 1), (1025, 2), (4096, 4), (4097, 5)])
def test_one_cta_of_1024_threads_each_owning_a_chunk_of_experts(experts, chunk):
    pack = RoutePack(num_experts=experts, block_m=16, has_map=False)
    assert pack.threads == THREADS == 1024
    assert pack.chunk == chunk and (chunk - 1) * THREADS < experts <= chunk * THREADS
    assert pack.smem_bytes == smem_bytes(experts)


def test_a_cta_owns_two_routes_per_thread():
    assert ROUTES_PER_THREAD * THREADS == PACK_ROUTES_PER_CTA == 2048
    assert RouteCount.threads == RoutePack.threads == THREADS
    limit = arch_limits("sm_120").smem_per_block_optin
    largest = (limit - 64) // 4
    assert RouteCount.can_implement(num_experts=largest, has_map=False, smem_limit=limit) is None
    assert RouteCount.can_implement(num_experts=largest + 1, has_map=False, smem_limit=limit) == (
        f"route count needs {count_smem_bytes(largest + 1):,} B shared memory > {limit:,} B "
        "per-block limit")


@needs_cuobjdump
@pytest.mark.parametrize("arch, reserved", [("sm_80", 0), ("sm_90a", 1024), ("sm_120a", 1024)])
def test_compiles_with_its_shared_memory_and_no_spills(arch, reserved):
    """Each kernel allocates only its dynamic shared memory; from sm_90 on, the cubin of a
    kernel that uses shared memory also reports the 1 KiB per-CTA system reservation."""
    from cutlass import Int32

    experts = 896
    cap = arch_limits(arch).max_registers_per_thread(THREADS)
    assert cap == 64  # 1,024 threads: at most 64 registers each
    pack = RoutePack(num_experts=experts, block_m=32, has_map=True)
    res = compile_alone(pack, [Int32] * 8, 2, arch, "RoutePack")
    assert res["spills"] == 0 and 0 < res["registers"] <= cap
    assert res["shared"] == smem_bytes(experts) + reserved
    count = RouteCount(num_experts=experts, has_map=True)
    res = compile_alone(count, [Int32] * 3, 1, arch, "RouteCount")
    assert res["spills"] == 0 and 0 < res["registers"] <= cap
    assert res["shared"] == count_smem_bytes(experts) + reserved

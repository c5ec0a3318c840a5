"""Tests for planners.policy (route-size policy, reachable sizes, padded route slots) and
planners.geometry (check_resources, verdicts)."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from kquant_cute.planners import (
    DECODE_BLOCK_M,
    FILL_TARGET,
    ROUTE_BLOCK_SIZES,
    GeometryVerdict,
    arch_limits,
    check_resources,
    max_route_blocks,
    padded_route_slots,
    route_block_sizes_for_capacity,
    select_route_block_size_m,
)
from kquant_cute.planners.geometry import geometry_verdict
from kquant_cute.planners.policy import check_fill_targets


# ---------------------------------------------------------------------------------------
# select_route_block_size_m
# ---------------------------------------------------------------------------------------


def _brute_force_policy(m: int, topk: int, num_experts: int) -> int:
    """The policy of docs/formats.md ("Route policy") in exact rational arithmetic: the
    narrowest size s with avg < FILL_TARGET * s (avg = routes per expert), else the widest."""
    avg = Fraction(m * topk, num_experts)
    fill = Fraction(FILL_TARGET).limit_denominator(1000)
    candidates = [s for s in ROUTE_BLOCK_SIZES if avg < fill * s]
    return min(candidates) if candidates else max(ROUTE_BLOCK_SIZES)


def test_block_sizes_and_fill_target_shape_the_choice():
    """The sizes ascend from the decode M; the policy picks the narrowest size whose blocks
    the average expert fills below FILL_TARGET, so at avg = FILL_TARGET * s (just reached)
    it moves past s, and one route below that it keeps s."""
    assert list(ROUTE_BLOCK_SIZES) == sorted(set(ROUTE_BLOCK_SIZES))
    assert ROUTE_BLOCK_SIZES[0] == DECODE_BLOCK_M and 0 < FILL_TARGET < 1
    experts, topk = 1000, 1
    for i, s in enumerate(ROUTE_BLOCK_SIZES[:-1]):
        at = round(FILL_TARGET * s * experts)  # routes with avg == FILL_TARGET * s
        assert at == FILL_TARGET * s * experts
        assert select_route_block_size_m(at, topk, experts) == ROUTE_BLOCK_SIZES[i + 1]
        assert select_route_block_size_m(at - 1, topk, experts) == s
    assert select_route_block_size_m(10**6, topk, experts) == ROUTE_BLOCK_SIZES[-1]


@pytest.mark.parametrize(
    "m, topk, experts, expected",
    [(1536, 16, 896, 32), (16, 16, 896, 8), (2048, 16, 896, 48), (4096, 16, 896, 64)],
)
def test_policy_examples(m, topk, experts, expected):
    assert select_route_block_size_m(m, topk, experts) == expected


def test_policy_matches_brute_force_sweep():
    ms = list(range(1, 300)) + [400, 403, 404, 512, 806, 807, 1024, 1536, 1612, 1613, 2048, 2419,
                                2420, 4096, 8192, 65536]
    for m, topk, experts in itertools.product(ms, (1, 2, 6, 8, 16), (1, 7, 8, 64, 128, 384, 896)):
        assert select_route_block_size_m(m, topk, experts) == _brute_force_policy(m, topk, experts), (
            m, topk, experts)


def test_policy_exact_boundaries():
    # Exactly at avg == 0.9 * s the block is *not* chosen (strict <), for every size.
    for s in ROUTE_BLOCK_SIZES:
        for experts in (10, 20, 30, 100, 890, 1000):
            routes = 9 * s * experts // 10  # avg == 0.9 * s exactly
            for topk in (1, 2, 5, 10):
                if routes % topk:
                    continue
                m = routes // topk
                got = select_route_block_size_m(m, topk, experts)
                assert got == _brute_force_policy(m, topk, experts)
                assert got > s or s == ROUTE_BLOCK_SIZES[-1]
                if m > 1:
                    assert select_route_block_size_m(m - 1, topk, experts) <= s


def test_policy_monotone_in_m():
    for topk, experts in ((16, 896), (8, 64), (2, 8)):
        prev = 0
        for m in range(1, 5000, 7):
            cur = select_route_block_size_m(m, topk, experts)
            assert cur >= prev
            prev = cur


@pytest.mark.parametrize(
    "args",
    [(0, 16, 896), (-1, 16, 896), (16, 0, 896), (16, 16, 0), (1.0, 16, 896), ("16", 16, 896),
     (True, 16, 896), (16, None, 896)],
)
def test_policy_rejects_bad_inputs(args):
    with pytest.raises(ValueError):
        select_route_block_size_m(*args)


# ---------------------------------------------------------------------------------------
# route_block_sizes_for_capacity
# ---------------------------------------------------------------------------------------


def test_sizes_for_capacity_examples():
    assert route_block_sizes_for_capacity(1, 16, 896) == (8,)
    assert route_block_sizes_for_capacity(256, 16, 896) == (8,)
    assert route_block_sizes_for_capacity(1536, 16, 896) == (8, 16, 32)
    assert route_block_sizes_for_capacity(2048, 16, 896) == (8, 16, 32, 48)
    assert route_block_sizes_for_capacity(8192, 16, 896) == ROUTE_BLOCK_SIZES
    # A tiny expert count starts above 8 already at m = 1.
    assert route_block_sizes_for_capacity(1, 16, 1) == (32,)
    assert route_block_sizes_for_capacity(100, 16, 1) == (32, 48, 64)


def test_sizes_for_capacity_equals_every_reachable_choice():
    for cap, topk, experts in itertools.product((1, 5, 50, 300, 1000, 3000), (1, 4, 16), (1, 8, 64, 896)):
        reachable = {select_route_block_size_m(m, topk, experts) for m in range(1, cap + 1)}
        got = route_block_sizes_for_capacity(cap, topk, experts)
        assert got == tuple(sorted(reachable))
        # Contiguous slice of the size table.
        i = ROUTE_BLOCK_SIZES.index(got[0])
        assert got == ROUTE_BLOCK_SIZES[i:i + len(got)]


def test_sizes_for_capacity_rejects_bad_inputs():
    for args in ((0, 16, 896), (16, 0, 896), (16, 16, -3), (2.5, 16, 896)):
        with pytest.raises(ValueError):
            route_block_sizes_for_capacity(*args)


# ---------------------------------------------------------------------------------------
# padded_route_slots
# ---------------------------------------------------------------------------------------


def _packed_count(counts, block_m):
    return sum(-(-c // block_m) * block_m for c in counts)


def test_padded_slots_formula():
    assert padded_route_slots(1536 * 16, 896, 32) == 1536 * 16 + 896 * 31
    assert padded_route_slots(10, 896, 8) == 80  # n < E: capped at n * b
    assert padded_route_slots(896, 896, 8) == 896 + 896 * 7
    assert padded_route_slots(0, 896, 8) == 0
    assert padded_route_slots(7, 1, 64) == 7 + 63
    assert max_route_blocks(10, 896, 8) == 10
    assert max_route_blocks(1536 * 16, 896, 32) == (1536 * 16 + 896 * 31) // 32


def test_padded_slots_is_min_of_both_bounds():
    for n, e, b in itertools.product(range(0, 70), (1, 3, 8, 64), ROUTE_BLOCK_SIZES):
        assert padded_route_slots(n, e, b) == min(n + e * (b - 1), n * b) == n + min(n, e) * (b - 1)


def test_padded_slots_bounds_worst_case_histograms():
    # The packed count is maximised by putting as many experts as possible at 1 (mod b).
    for n, e, b in itertools.product(range(0, 60), (1, 2, 5, 16), (8, 16, 48)):
        bound = padded_route_slots(n, e, b)
        nonzero = min(n, e)
        counts = [1] * nonzero
        if nonzero:
            counts[0] += n - nonzero  # remaining routes on one expert
        assert _packed_count(counts, b) <= bound
        # Attained when every non-empty expert's count is 1 (mod b).
        if (n - nonzero) % b == 0:
            assert _packed_count(counts, b) == bound


def test_padded_slots_bounds_random_histograms():
    rng = random.Random(1234)
    for _ in range(2000):
        e = rng.randint(1, 40)
        b = rng.choice(ROUTE_BLOCK_SIZES)
        n = rng.randint(0, 400)
        counts = [0] * e
        hot = rng.sample(range(e), rng.randint(1, e))
        for _ in range(n):
            counts[rng.choice(hot)] += 1
        packed = _packed_count(counts, b)
        assert packed <= padded_route_slots(n, e, b)
        assert packed // b <= max_route_blocks(n, e, b)


@pytest.mark.parametrize("args", [(-1, 8, 8), (10, 0, 8), (10, 8, 0), (10.0, 8, 8), (True, 8, 8)])
def test_padded_slots_rejects_bad_inputs(args):
    with pytest.raises(ValueError):
        padded_route_slots(*args)


# ---------------------------------------------------------------------------------------
# geometry: check_resources (the table and its lookups: tests/test_arch.py)
# ---------------------------------------------------------------------------------------


def test_check_resources_accepts_b12x_sm120_estimates():
    sm120 = arch_limits("sm_120")
    # b12x sm_120 estimates, 128x128 tile, 256 threads: M=8 and M=32 fit.
    assert check_resources(sm120, smem_bytes=53_500, registers=118, spills=0, threads=256) is None
    assert check_resources(sm120, smem_bytes=70_100, registers=175, spills=0, threads=256) is None
    assert check_resources(sm120, smem_bytes=101_376, registers=255, spills=0, threads=256) is None


def test_check_resources_smem_reason_names_numbers():
    reason = check_resources(arch_limits("sm_120"), smem_bytes=103_424, registers=200, spills=0,
                             threads=256)
    assert reason == "shared memory 103,424 B > 101,376 B limit of sm_120"
    # The same geometry fits an H200.
    assert check_resources(arch_limits("sm_90a"), smem_bytes=103_424, registers=200, spills=0,
                           threads=256) is None


def test_check_resources_register_limits():
    sm90 = arch_limits("sm_90")
    reason = check_resources(sm90, smem_bytes=0, registers=256, spills=0, threads=128)
    assert reason is not None and "256 registers per thread > 255" in reason
    # 512 threads leave 128 registers per thread.
    assert check_resources(sm90, smem_bytes=0, registers=128, spills=0, threads=512) is None
    reason = check_resources(sm90, smem_bytes=0, registers=129, spills=0, threads=512)
    assert reason is not None and "65,536-register file" in reason and "at most 128" in reason
    # 384 threads: 65,536 / 384 = 170.7, but allocation is per warp in 256-register units -> 168.
    assert sm90.max_registers_per_thread(384) == 168
    assert check_resources(sm90, smem_bytes=0, registers=168, spills=0, threads=384) is None
    assert check_resources(sm90, smem_bytes=0, registers=170, spills=0, threads=384) is not None
    assert sm90.max_registers_per_thread(256) == 255
    assert sm90.max_registers_per_thread(1024) == 64


def test_check_resources_spills_and_threads_and_multiple_reasons():
    sm80 = arch_limits(80)
    reason = check_resources(sm80, smem_bytes=0, registers=64, spills=8, threads=128)
    assert reason == "register spills (8 B)"
    reason = check_resources(sm80, smem_bytes=0, registers=32, spills=0, threads=2048)
    assert reason is not None and "2,048 threads per block > 1,024" in reason
    reason = check_resources(sm80, smem_bytes=200_000, registers=300, spills=16, threads=256)
    assert reason is not None and reason.count("; ") == 2
    assert "166,912 B limit of sm_80" in reason and "300 registers" in reason and "spills" in reason


@pytest.mark.parametrize(
    "kwargs",
    [dict(smem_bytes=-1, registers=1, spills=0, threads=1),
     dict(smem_bytes=0, registers=1.5, spills=0, threads=1),
     dict(smem_bytes=0, registers=1, spills=-2, threads=1),
     dict(smem_bytes=0, registers=1, spills=0, threads=0)],
)
def test_check_resources_rejects_bad_measurements(kwargs):
    with pytest.raises(ValueError):
        check_resources(arch_limits(90), **kwargs)


def test_geometry_verdict():
    v = geometry_verdict(arch_limits(120), 64, smem_bytes=103_424, registers=200, spills=0, threads=256)
    assert isinstance(v, GeometryVerdict)
    assert (v.block_m, v.ok, v.registers, v.spills, v.smem_bytes) == (64, False, 200, 0, 103_424)
    assert "103,424 B" in v.reason and v.summary().startswith("M=64: rejected: shared memory")
    ok = geometry_verdict(arch_limits(120), 32, smem_bytes=70_100, registers=175, spills=0, threads=256)
    assert ok.ok and ok.reason is None and ok.summary().startswith("M=32: ok (175 regs")
    with pytest.raises(ValueError):
        GeometryVerdict(block_m=8, ok=True, reason="contradiction")
    with pytest.raises(ValueError):
        GeometryVerdict(block_m=8, ok=False)


def test_planners_import_without_torch():
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'cutlass', 'numpy'):\n"
        "        raise ImportError('planners must not import ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import kquant_cute.planners as p\n"
        "assert p.select_route_block_size_m(1536, 16, 896) == 32\n"
        "assert p.arch_limits('sm_90a').smem_per_block_optin == 232448\n"
        "assert not {'torch', 'cutlass', 'numpy'} & {m.split('.')[0] for m in sys.modules}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fill_targets_move_their_boundaries():
    """Per-size fill targets (the fill rule) replace 0.9 at their sizes' boundaries only:
    with ((16, 0.7), (32, 0.8)), M=32 from avg >= 11.2 rows and M=48 from 25.6, M=16 and
    M=64 where the policy moves; () is the reference's policy. Targets outside (0, 1],
    unknown or repeated sizes, and targets that would make the policy non-monotone in m
    are refused."""
    rule = ((16, 0.7), (32, 0.8))
    assert select_route_block_size_m(1536, 16, 896) == 32
    assert select_route_block_size_m(1536, 16, 896, rule) == 48
    assert select_route_block_size_m(1536, 16, 896, ()) == 32
    for s, t in ((8, 0.9), (16, 0.7), (32, 0.8), (48, 0.9)):
        m = -(-int(round(t * 10)) * s * 896 // (10 * 16))  # the fewest tokens with avg >= t s
        assert select_route_block_size_m(m, 16, 896, rule) > s
        assert select_route_block_size_m(m - 1, 16, 896, rule) <= s
    assert check_fill_targets([(32, 0.8), (16, 1)]) == ((16, 1.0), (32, 0.8))
    for bad in ((8, 0.5), ((8, 0),), ((8, 1.5),), ((12, 0.8),), ((8, True),), ((8, 0.5), (8, 0.6)),
                ((16, 0.3),), ((8, 1.0), (16, 0.45)), "0.8"):
        with pytest.raises(ValueError, match="fill_targets"):
            select_route_block_size_m(16, 16, 896, bad)

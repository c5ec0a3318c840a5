"""Tests for kernels/arch.py: the per-SM table's facts, its lookups by any spelling, errors."""

from __future__ import annotations

import pytest

from kquant_cute.kernels.arch import (
    ARCH_TABLE,
    ArchLimits,
    arch_limits,
    known_archs,
    mma_archs,
    normalize_arch,
)

KB = 1024


# ---------------------------------------------------------------------------------------
# Table facts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kib", [
    # "Maximum amount of shared memory per thread block" (after opt-in), CUDA C++
    # Programming Guide, compute capabilities table: 8.0 163 KB, 8.6 / 8.9 99 KB,
    # 9.0 / 10.0 227 KB, 12.0 99 KB.
    ("sm_80", 163), ("sm_86", 99), ("sm_89", 99), ("sm_90", 227), ("sm_100", 227), ("sm_120", 99),
])
def test_opt_in_shared_memory_per_block(name, kib):
    assert arch_limits(name).smem_per_block_optin == kib * KB


def test_every_entry_is_keyed_by_its_own_name_and_has_the_common_limits():
    for key, lim in ARCH_TABLE.items():
        assert isinstance(lim, ArchLimits) and lim.name == key
        assert lim.sm == int(key.removeprefix("sm_"))
        # 64 K 32-bit registers per SM, 255 per thread, 1,024 threads per block on every
        # supported SM (CUDA C++ Programming Guide, compute capabilities table).
        assert (lim.regs_per_sm, lim.regs_per_thread_max, lim.max_threads_per_block) == (
            64 * KB, 255, 1024)


def test_dsl_target_needs_the_a_suffix_exactly_where_arch_specific_mma_exists():
    """wgmma (sm_90) and tcgen05 (sm_100) exist only on the arch-specific targets; sm_120's
    block-scaled mma is arch-specific too; Ampere / Ada targets have no suffix."""
    for lim in ARCH_TABLE.values():
        assert lim.dsl_target.removesuffix("a") == lim.name
        assert lim.dsl_target.endswith("a") == (lim.sm >= 90)


def test_mma_families():
    assert mma_archs("wgmma") == ("sm_90a",)
    assert mma_archs("tcgen05") == ("sm_100a",)
    assert mma_archs("mfma") == ()
    # One warp-level MMA family is common to every supported SM (the portable GEMM's).
    common = set.intersection(*(set(lim.mma_kinds) for lim in ARCH_TABLE.values()))
    assert len(common) == 1
    (kind,) = common
    assert mma_archs(kind) == tuple(arch_limits(n).dsl_target for n in known_archs())


def test_cvt_e4m3_from_sm_89_on():
    """cvt.rn.f16x2.e4m3x2 needs sm_89 or later (PTX ISA, cvt: "requires sm_89")."""
    for lim in ARCH_TABLE.values():
        assert lim.cvt_e4m3 == (lim.sm >= 89), lim.name


def test_known_archs_ascending():
    names = known_archs()
    assert set(names) == set(ARCH_TABLE)
    sms = [arch_limits(n).sm for n in names]
    assert sms == sorted(sms) and len(set(sms)) == len(sms)


# ---------------------------------------------------------------------------------------
# max_registers_per_thread
# ---------------------------------------------------------------------------------------


def _largest_fitting_registers(lim: ArchLimits, threads: int) -> int:
    """Brute force: the largest r <= the per-thread cap whose per-warp allocation (32 * r
    rounded up to the allocation unit) times the block's warps fits the register file."""
    warps = -(-threads // 32)
    best = 0
    for r in range(1, lim.regs_per_thread_max + 1):
        per_warp = -(-32 * r // lim.reg_alloc_unit) * lim.reg_alloc_unit
        if warps * per_warp <= lim.regs_per_sm:
            best = r
    return best


def test_max_registers_per_thread_hand_computed():
    sm90 = arch_limits("sm_90")
    # 12 warps: 65,536 / 12 = 5,461 per warp -> 21 units of 256 -> 5,376 / 32 = 168.
    assert sm90.max_registers_per_thread(384) == 168
    assert sm90.max_registers_per_thread(1024) == 64  # 32 warps: 2,048 per warp
    assert sm90.max_registers_per_thread(512) == 128
    assert sm90.max_registers_per_thread(256) == 255  # 256 would fit; the ISA caps at 255
    assert sm90.max_registers_per_thread(33) == 255  # 2 warps: a partial warp counts whole


def test_max_registers_per_thread_is_the_largest_that_fits():
    for lim in ARCH_TABLE.values():
        for threads in range(1, lim.max_threads_per_block + 1, 7):
            assert lim.max_registers_per_thread(threads) == _largest_fitting_registers(lim, threads)


@pytest.mark.parametrize("bad", [0, -32, 1.5, True, "128", None])
def test_max_registers_per_thread_rejects_bad_thread_counts(bad):
    with pytest.raises(ValueError, match="threads must be a positive int"):
        arch_limits("sm_90").max_registers_per_thread(bad)


# ---------------------------------------------------------------------------------------
# Lookups
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, name",
    [("sm_90", "sm_90"), ("sm_90a", "sm_90"), (90, "sm_90"), ("90", "sm_90"), ("sm90", "sm_90"),
     ((9, 0), "sm_90"), ("120", "sm_120"), ("sm_120a", "sm_120"), (" SM_100A ", "sm_100"),
     ("sm_100f", "sm_100"), (80, "sm_80"), ((8, 6), "sm_86"), ("sm_89", "sm_89")],
)
def test_lookup_spellings(spelling, name):
    assert arch_limits(spelling) is ARCH_TABLE[name]


def test_every_spelling_of_every_arch_finds_the_same_entry():
    for name in known_archs():
        lim = ARCH_TABLE[name]
        major, minor = divmod(lim.sm, 10)
        for spelling in (name, lim.dsl_target, lim.sm, str(lim.sm), f"sm{lim.sm}",
                         (major, minor), name.upper(), f" {lim.dsl_target} "):
            assert arch_limits(spelling) is lim, spelling
            assert normalize_arch(spelling) == lim.dsl_target, spelling
        # The DSL target is itself a spelling: normalising is idempotent.
        assert normalize_arch(normalize_arch(name)) == lim.dsl_target


@pytest.mark.parametrize(
    "arch, target",
    [("sm_90", "sm_90a"), (90, "sm_90a"), ("sm_90a", "sm_90a"), ("sm_100", "sm_100a"),
     ("120", "sm_120a"), ("sm_80", "sm_80"), ("sm_86", "sm_86"), (89, "sm_89")],
)
def test_normalize_arch(arch, target):
    assert normalize_arch(arch) == target


@pytest.mark.parametrize("bad", ["sm_75", 75, "sm_", "hopper", "", None, 9.0, True, (9,), (9, 0, 1),
                                 (9, True), ("9", "0"), "sm_90b", "sm_9O", 900])
def test_unknown_arch_names_the_input_and_lists_known(bad):
    for lookup in (arch_limits, normalize_arch):
        with pytest.raises(ValueError) as info:
            lookup(bad)
        msg = str(info.value)
        assert msg.startswith(f"unknown GPU architecture {bad!r}; known: ")
        assert msg.count("sm_") >= len(known_archs())
        for name in known_archs():
            assert name in msg


def test_limits_are_frozen():
    with pytest.raises(AttributeError):
        arch_limits("sm_90").smem_per_block_optin = 0  # type: ignore[misc]

"""Tests for kquant_cute/compiler.py: what keys the cache (source_files), the geometry check
on measured resources, and compile_plan / plan_forward's entries and cache outcomes.

The compile step is replaced by tests/fake_build.py (made-up objects and resources), so
these run in milliseconds; real cross-compiles of the same paths are in
tests/test_kernel_compile.py and tests/test_cli.py."""

from __future__ import annotations

import inspect
import os
import shutil

import pytest
from fake_build import FakeBuild

from kquant_cute import compiler
from kquant_cute.compile_cache import CompileCache, CompileCacheMiss
from kquant_cute.compiler import compile_plan, geometry_check, get_specialization, plan_forward
from kquant_cute.kernels import launch
from kquant_cute.kernels.moe import MoESpec
from kquant_cute.planners import PlanEnv

SMALL = MoESpec(num_experts=8, hidden=256, intermediate=256, topk=2, bits=4, codebook="mcg",
                block_m=8, act_dtype="bfloat16", out_dtype="float32", activation="situ",
                shared_hidden_vectors=True, arch="sm_90a")


@pytest.fixture
def fake(monkeypatch):
    return FakeBuild().install(monkeypatch)


# ---------------------------------------------------------------------------------------
# source_files: the kernel package keys the cache, the planners do not
# ---------------------------------------------------------------------------------------


def test_source_files_are_the_kernel_package_only():
    import kquant_cute.kernels as kernels_pkg
    import kquant_cute.planners.plans as plans

    files = compiler.source_files()
    kdir = os.path.dirname(kernels_pkg.__file__)
    assert files == sorted(files)
    assert {os.path.basename(f) for f in files} == {n for n in os.listdir(kdir) if n.endswith(".py")}
    assert all(os.path.dirname(f) == kdir for f in files)
    for module in (MoESpec, launch):  # the kernels and their launch contract
        assert inspect.getsourcefile(module) in files
    for module in (compiler, plans):  # choosing specializations changes no object
        assert inspect.getsourcefile(module) not in files


def test_key_follows_the_kernel_sources_bytes(fake, tmp_path, monkeypatch):
    cache = CompileCache(tmp_path / "c")
    key = get_specialization(SMALL, cache).key
    assert get_specialization(SMALL, cache).key == key
    assert get_specialization(SMALL.replace(block_m=16), cache).key != key
    # The same kernel sources elsewhere: the same key; one byte more in one file: another.
    copies = []
    for f in compiler.source_files():
        copies.append(str(tmp_path / os.path.basename(f)))
        shutil.copy(f, copies[-1])
    monkeypatch.setattr(compiler, "source_files", lambda: copies)
    assert get_specialization(SMALL, CompileCache(tmp_path / "c2")).key == key
    with open(copies[0], "a") as f:
        f.write("\n")
    assert get_specialization(SMALL, CompileCache(tmp_path / "c3")).key != key


def test_an_auto_request_keys_as_what_it_resolved_to(fake, tmp_path):
    cache = CompileCache(tmp_path / "c")
    auto = get_specialization(SMALL, cache)
    pinned = get_specialization(SMALL.replace(mma="wgmma", span=1), cache)
    assert pinned.key == auto.key and pinned.status == "memory"
    assert fake.built == [("sm_90a", 8)]


# ---------------------------------------------------------------------------------------
# geometry_check
# ---------------------------------------------------------------------------------------


def test_accepted_geometry_carries_its_measurements(fake, tmp_path):
    v = geometry_check(SMALL, CompileCache(tmp_path))
    assert v.ok and v.measured and v.reason is None
    want_smem = max(SMALL.dynamic_smem().values())
    assert (v.block_m, v.registers, v.spills, v.smem_bytes) == (8, 40, 0, want_smem)


def test_static_rejection_never_compiles(fake, tmp_path):
    bad = SMALL.replace(hidden=200)
    v = geometry_check(bad, CompileCache(tmp_path))
    assert not v.ok and v.reason == bad.check() and "hidden 200" in v.reason
    assert fake.built == []


def test_measured_rejections_name_the_kernel_and_use_its_threads(monkeypatch, tmp_path):
    """100 registers per thread fit the 128-thread stages and the GEMM but not the route
    pack's two kernels of 1,024 threads (64 each); over 255 every kernel is named, one line
    per kernel and reason; a kernel the spec does not list is refused (its threads are
    unknown)."""
    fake = FakeBuild(overrides={8: {"registers": 100}}).install(monkeypatch)
    v = geometry_check(SMALL, CompileCache(tmp_path))
    assert not v.ok and v.measured and fake.built == [("sm_90a", 8)]
    assert v.reason == "; ".join(
        f"{name}: 100 registers x 1,024 threads exceed the 65,536-register file of sm_90 "
        "(at most 64 per thread at 1,024 threads)" for name in ("RouteCount", "RoutePack"))

    FakeBuild(overrides={8: {"registers": 300}}).install(monkeypatch)
    v = geometry_check(SMALL, CompileCache(tmp_path / "b"))
    assert v.reason.split("; ") == [f"{name}: 300 registers per thread > 255 limit of sm_90"
                                    for name in SMALL.kernel_launches()]

    FakeBuild(overrides={8: {"kernel": "Mystery"}}).install(monkeypatch)
    v = geometry_check(SMALL, CompileCache(tmp_path / "c"))
    assert v.reason == ("Mystery: a kernel of the object that MoESpec.sub_kernels() does not "
                        "list (its threads are unknown)")


def test_unmeasured_objects_are_accepted_as_unmeasured(monkeypatch, tmp_path):
    FakeBuild(measured=False).install(monkeypatch)
    v = geometry_check(SMALL, CompileCache(tmp_path))
    assert v.ok and v.measured is False and v.registers is None


def test_a_failed_build_rejects_with_its_error_and_a_frozen_miss_raises(monkeypatch, tmp_path):
    FakeBuild(fail=(8,)).install(monkeypatch)
    v = geometry_check(SMALL, CompileCache(tmp_path / "c"))
    assert not v.ok and v.reason == "compile failed: RuntimeError: ptxas died at M=8"
    with pytest.raises(CompileCacheMiss):
        geometry_check(SMALL, CompileCache(tmp_path / "frozen", frozen=True))


# ---------------------------------------------------------------------------------------
# compile_plan / plan_forward
# ---------------------------------------------------------------------------------------


def test_compile_plan_attaches_accepted_entries_and_every_outcome(monkeypatch, tmp_path):
    """512 tokens, top-2, 8 experts: the policy's M at capacity is 64. M=48 measures too
    many registers: the banded plan asks 64, 8, 16, 32, 48, then the wide rule (from 257
    tokens, 64 rows per expert) 48 x 2 (to 345 tokens) and 64 x 2; compiles all; binds 8 /
    16 / 32 / 64 and 64 x 2, and keeps the cache's answer for each of the seven."""
    fake = FakeBuild(overrides={48: {"registers": 300}}).install(monkeypatch)
    seen = []
    plan = compile_plan(SMALL, capacity=512, arch="sm_90", env=PlanEnv(),
                        cache=CompileCache(tmp_path), banded=True,
                        observe=lambda s, o: seen.append((s.block_m, s.span, o is None)))
    assert [m for _, m in fake.built] == [64, 8, 16, 32, 48, 48, 64]
    asked = [(64, 1), (8, 1), (16, 1), (32, 2), (48, 1), (48, 2), (64, 2)]
    assert seen == [(m, n, first) for m, n in asked for first in (True, False)]
    assert list(plan.entries) == [8, 16, 32, 64] and plan.error is None
    assert list(plan.wide) == [(64, 2)] and plan.route.wide_keys == ((64, 2),)
    assert {m: o.result.status for m, o in plan.outcomes.items()} == dict.fromkeys(
        (64, 8, 16, 32, 48), "compiled")
    assert {k: o.result.status for k, o in plan.wide_outcomes.items()} == dict.fromkeys(
        ((48, 2), (64, 2)), "compiled")
    assert plan.decode.spec.block_m == 8 and plan.prefill.spec.block_m == 64
    assert all(p.spec.arch == "sm_90a" and p.spec.mma == "wgmma" for p in plan.entries.values())
    for m in (1, 256, 300, 345):
        assert plan.plan_for(m) is plan.entries[plan.route.band_for(m).block_m]
    assert plan.plan_for(300).spec.span == 1  # 48 x 2 rejected: the band's own M=64
    assert plan.plan_for(346) is plan.plan_for(512) is plan.wide[64, 2]
    assert plan.wide[64, 2].spec.span == 2 and plan.wide[64, 2].spec in plan.specs()
    plan.load()
    assert plan.decode.fn == ("loaded", f"object {plan.decode.spec.kernel_name()}")
    assert "M=48: rejected: " in plan.describe() and "M=48 x 2: rejected: " in plan.describe()


def test_compile_plan_again_is_served_by_the_cache(fake, tmp_path):
    cache = CompileCache(tmp_path)
    compile_plan(SMALL, capacity=512, arch="sm_120", env=PlanEnv(), cache=cache, banded=False)
    again = compile_plan(SMALL, capacity=512, arch="sm_120a", env=PlanEnv(), cache=cache,
                         banded=False)
    assert {m: o.result.status for m, o in again.outcomes.items()} == {64: "memory", 8: "memory"}
    fresh = compile_plan(SMALL, capacity=512, arch=120, env=PlanEnv(),
                         cache=CompileCache(tmp_path), banded=False)
    assert {m: o.result.status for m, o in fresh.outcomes.items()} == {64: "disk", 8: "disk"}
    assert fake.built == [("sm_120a", 64), ("sm_120a", 8)]
    assert all(p.spec.mma == "sync" for p in fresh.entries.values())


def test_plan_forward_raises_when_the_decode_is_rejected(monkeypatch, tmp_path):
    FakeBuild(overrides={m: {"registers": 300} for m in (8, 16, 32, 48, 64)}).install(monkeypatch)
    plan = compile_plan(SMALL, capacity=64, arch="sm_90", env=PlanEnv(), cache=CompileCache(tmp_path))
    assert plan.entries == {} and plan.error.startswith(
        "the decode specialization is not implementable: ")
    with pytest.raises(ValueError, match="decode specialization is not implementable: .*300 registers"):
        plan_forward(SMALL, capacity=64, arch="sm_90", env=PlanEnv(), cache=CompileCache(tmp_path))


def test_describe_names_each_plans_gemm(fake, tmp_path):
    plan = compile_plan(SMALL, capacity=512, arch="sm_90", env=PlanEnv(),
                        cache=CompileCache(tmp_path), banded=True)
    gemm = plan.describe().splitlines()[-1].strip()
    assert gemm.startswith("GEMM: ")
    parts = gemm.removeprefix("GEMM: ").split(", ")
    assert [p.split()[0] for p in parts] == [f"M={m}" for m in plan.route.block_sizes] + [
        f"M={m}" for m, _ in plan.route.wide_keys]
    assert plan.route.wide_keys == ((48, 2), (64, 2))  # the wide rule from 257 tokens
    # Only the span-2 plans (M=32 under wgmma, the wide rule's) say they run several route
    # blocks per item.
    spans = [SMALL.replace(block_m=m).span for m in plan.route.block_sizes] + [2, 2]
    assert [p.endswith("x 2 route blocks per work item") for p in parts] == [n == 2 for n in spans]


def test_shared_table_layers_plan_with_the_fill_rule(fake, tmp_path):
    """plan_fill_targets: the fill rule's targets where the wgmma GEMM's workers share
    tables that leave one CTA per SM (the K=2 pair table: sqg_e4m3 K=2 on sm_90a; mixed
    rates through their direct tables), the policy's own (()) for arithmetic codebooks,
    uniform direct tables, mma.sync and mixed rates through T12; compile_plan plans with
    them."""
    from kquant_cute.planners import TABLE_FILL_TARGETS

    qsrt = SMALL.replace(codebook="sqg_e4m3", bits=2, arch="sm_90a")
    assert qsrt.table_layout() == "pair"
    assert compiler.plan_fill_targets(qsrt) == TABLE_FILL_TARGETS
    assert compiler.plan_fill_targets(qsrt.replace(bits=3)) == ()  # direct table
    assert compiler.plan_fill_targets(qsrt.replace(mma="sync")) == ()
    assert compiler.plan_fill_targets(SMALL.replace(arch="sm_90a")) == ()  # mcg
    mixed = qsrt.replace(bits=4, bits_set=(3, 4))
    assert mixed.table_layout() == "direct" and mixed.mma == "wgmma"
    assert compiler.plan_fill_targets(mixed) == TABLE_FILL_TARGETS
    assert compiler.plan_fill_targets(mixed.replace(mma="sync")) == ()
    assert compiler.plan_fill_targets(mixed.replace(table_decode="t12")) == ()
    cache = CompileCache(tmp_path)
    plan = compile_plan(qsrt, capacity=512, arch="sm_90", env=PlanEnv(), cache=cache)
    assert plan.route.fill_targets == TABLE_FILL_TARGETS
    assert compile_plan(SMALL, capacity=512, arch="sm_90", env=PlanEnv(),
                        cache=cache).route.fill_targets == ()

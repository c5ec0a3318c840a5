"""Tests for kquant_cute/prewarm.py: the records it reports (roles, statuses, the cache's
answers), progress events, arch handling, failures and frozen caches.

The compile step is tests/fake_build.py's (CPU, milliseconds); kquant-compile's real
cross-compiles of the same paths are in tests/test_cli.py."""

from __future__ import annotations

import pytest
from fake_build import FakeBuild

from kquant_cute.compile_cache import CompileCache, CompileCacheMiss
from kquant_cute.planners import PlanEnv, candidate_bound
from kquant_cute.prewarm import (
    DEFAULT_GEOMETRY,
    PrewarmEvent,
    error_text,
    needed_failures,
    prewarm,
    prewarm_plans,
)

SMALL = DEFAULT_GEOMETRY.replace(num_experts=8, hidden=256, intermediate=256, topk=2)


def _rows(records):
    return [(r.arch, r.block_m, r.role, r.status) for r in records]


def test_records_follow_the_plan_decode_first(monkeypatch, tmp_path):
    """512 tokens, 8 experts, top-2: the walk starts at the policy's M=64; M=48 is rejected
    on measured registers (and so is the wide rule's 48 x 2), M=16's build fails; the decode
    is reported first, then the candidates in the order the planner asked (the walk, the
    bands, then the wide rule's items from 257 tokens: 48 x 2, 64 x 2)."""
    FakeBuild(overrides={48: {"registers": 300}}, fail=(16,)).install(monkeypatch)
    records = prewarm(SMALL, archs=["sm_90"], capacity=512, env=PlanEnv(),
                      cache=CompileCache(tmp_path), banded=True)
    assert _rows(records) == [
        ("sm_90a", 8, "decode", "compiled"), ("sm_90a", 64, "prefill", "compiled"),
        ("sm_90a", 16, "band-rejected", "failed"), ("sm_90a", 32, "band", "compiled"),
        ("sm_90a", 48, "band-rejected", "rejected"), ("sm_90a", 48, "wide-rejected", "rejected"),
        ("sm_90a", 64, "wide", "compiled")]
    assert [r.span for r in records[-2:]] == [2, 2]
    by_m = {r.block_m: r for r in records if not r.role.startswith("wide")}
    assert by_m[16].reason == "compile failed: RuntimeError: ptxas died at M=16"
    assert by_m[16].cache is None and by_m[16].registers is None
    assert "TrellisWgmma: 300 registers per thread > 255 limit of sm_90" in by_m[48].reason.split("; ")
    assert by_m[48].cache == "compiled" and by_m[48].registers == 300  # measured, then refused
    assert by_m[8].reason is None and by_m[8].measured and by_m[8].key
    assert by_m[32].mma == "wgmma" and by_m[32].span == SMALL.replace(block_m=32).span
    assert all(r.kernel == SMALL.replace(block_m=r.block_m, arch="sm_90a").kernel_name()
               for r in records[:-2])
    assert records[-1].kernel == SMALL.replace(block_m=64, span=2, arch="sm_90a").kernel_name()
    assert needed_failures(records) == []  # the failures are band candidates, not bound
    assert set(records[0].as_dict()) >= {"arch", "block_m", "role", "status", "reason", "cache"}


def test_needed_failures_are_the_bound_specializations_that_failed(monkeypatch, tmp_path):
    FakeBuild(fail=(64,)).install(monkeypatch)
    records = prewarm(SMALL, archs=["sm_120"], capacity=512, env=PlanEnv(pinned_block_m=64),
                      cache=CompileCache(tmp_path))
    # The pinned prefill M fails; the walk falls to 48, which the plan binds.
    assert _rows(records)[:3] == [("sm_120a", 8, "decode", "compiled"),
                                  ("sm_120a", 64, "fallback-rejected", "failed"),
                                  ("sm_120a", 48, "prefill", "compiled")]
    assert needed_failures(records) == []
    FakeBuild(fail=(8,)).install(monkeypatch)
    (arch,) = prewarm_plans(SMALL, archs=["sm_120"], capacity=64, env=PlanEnv(),
                            cache=CompileCache(tmp_path / "d"))
    assert [(r.block_m, r.role, r.status) for r in needed_failures(arch.records)] == [
        (8, "decode", "failed")]
    assert arch.error.startswith("the decode specialization is not implementable: compile failed")
    assert "error: the decode specialization" in arch.describe()


def test_second_run_is_cached_and_progress_counts_each_cache_call(monkeypatch, tmp_path):
    fake = FakeBuild().install(monkeypatch)
    cache = CompileCache(tmp_path)
    events: list[PrewarmEvent] = []
    first = prewarm(SMALL, archs=("sm_90", 120), capacity=512, env=PlanEnv(), cache=cache,
                    progress=events.append, banded=False)
    assert {r.status for r in first} == {"compiled"} and len(fake.built) == 4
    # A start and a done per cache call, numbered 1.., against the planner's bound.
    assert [(e.kind, e.index) for e in events] == [(k, i) for i in (1, 2, 3, 4)
                                                   for k in ("start", "done")]
    assert all(e.bound == 2 * candidate_bound(512, 2, 8, PlanEnv()) for e in events)
    assert [e.answer for e in events if e.kind == "done"] == ["compiled"] * 4
    assert [(e.arch, e.block_m) for e in events[::2]] == [
        ("sm_90a", 64), ("sm_90a", 8), ("sm_120a", 64), ("sm_120a", 8)]
    again = prewarm(SMALL, archs=["sm_90"], capacity=512, env=PlanEnv(), cache=cache, banded=False)
    assert {(r.status, r.cache) for r in again} == {("cached", "memory")}
    disk = prewarm(SMALL, archs=["sm_90"], capacity=512, env=PlanEnv(),
                   cache=CompileCache(tmp_path, frozen=True), banded=False)
    assert {(r.status, r.cache) for r in disk} == {("cached", "disk")}
    assert len(fake.built) == 4


def test_a_frozen_miss_is_reported_not_replaced_by_a_narrower_block(fake_free_cache):
    (arch,) = prewarm_plans(SMALL, archs=["sm_90"], capacity=512, env=PlanEnv(),
                            cache=fake_free_cache, banded=False)
    assert arch.plan is None
    # Every planned size is reported missing (the decode and the policy's prefill M), none
    # replaced by a narrower block that the walk would have fallen back to.
    assert [(r.block_m, r.role, r.status) for r in arch.records] == [
        (8, "decode", "failed"), (64, "prefill", "failed")]
    for rec in arch.records:
        assert rec.reason == f"not in the cache (key {rec.key[:16]})"
    assert arch.error == ("2 planned specializations (M=8, 64) are missing from the frozen "
                          "cache or corrupt")
    assert arch.describe() == f"[sm_90a] no plan: {arch.error}"


@pytest.fixture
def fake_free_cache(monkeypatch, tmp_path):
    FakeBuild().install(monkeypatch)
    return CompileCache(tmp_path, frozen=True)


def test_archs_are_normalised_and_deduplicated(monkeypatch, tmp_path):
    FakeBuild().install(monkeypatch)
    results = prewarm_plans(SMALL, archs=("sm_90", 90, "sm_90a", (12, 0)), capacity=64,
                            env=PlanEnv(), cache=CompileCache(tmp_path))
    assert [a.arch for a in results] == ["sm_90a", "sm_120a"]
    assert results[1].describe().startswith("[sm_120a] ")
    with pytest.raises(ValueError, match="at least one arch"):
        prewarm(SMALL, archs=[], capacity=64, env=PlanEnv(), cache=CompileCache(tmp_path))
    with pytest.raises(ValueError, match="unknown GPU architecture 'sm_75'"):
        prewarm(SMALL, archs=["sm_75"], capacity=64, env=PlanEnv(), cache=CompileCache(tmp_path))


def test_error_text():
    assert error_text(RuntimeError("first line\nsecond line")) == "RuntimeError: first line"
    assert error_text(ValueError()) == "ValueError"
    long = error_text(RuntimeError("x" * 500), limit=40)
    assert len(long) == 40 and long == "RuntimeError: " + "x" * 23 + "..."
    miss = CompileCacheMiss("long text", name="k", spec={}, arch="sm_90a", key="ab" * 32,
                            reason="frozen")
    assert error_text(miss) == ("CompileCacheMiss: not in the cache and compiling is off "
                                f"(frozen; key {'ab' * 8})")

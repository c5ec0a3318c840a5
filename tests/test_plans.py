"""Tests for planners.plans: env knobs, prefill block fallback, the route plan and describe()."""

from __future__ import annotations

import dataclasses

import pytest

from kquant_cute.planners import (
    ENV_PREFILL_BLOCK_M,
    ENV_PREFILL_MIN_M,
    ROUTE_BLOCK_SIZES,
    Candidate,
    GeometryVerdict,
    PlanEnv,
    RoutePlan,
    WIDE_SPAN,
    TokenBand,
    arch_limits,
    candidate_bound,
    choose_prefill_block,
    default_banded,
    max_route_blocks,
    padded_route_slots,
    plan_routes,
    policy_runs,
    resolve_env,
    select_route_block_size_m,
    wide_block,
    wide_from_m,
)
from kquant_cute.planners.geometry import geometry_verdict

SMEM_64 = "shared memory 103,424 B > 101,376 B limit of sm_120"
REGS_48 = "no register table entry for M=48"


def accept_all(block_m: int) -> None:
    return None


class RecordingCheck:
    """A fake kernel geometry check: rejects the given sizes with reasons, records calls."""

    def __init__(self, rejections: dict[int, str]):
        self.rejections = rejections
        self.calls: list[int] = []

    def __call__(self, block_m: int):
        self.calls.append(block_m)
        return self.rejections.get(block_m)


# ---------------------------------------------------------------------------------------
# resolve_env
# ---------------------------------------------------------------------------------------


def test_env_names_are_the_documented_and_checked_ones():
    """The variables resolve_env reads are the ones the README documents and the
    environment check validates at startup."""
    from pathlib import Path

    from kquant_cute.environment import check_environment

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for var in (ENV_PREFILL_BLOCK_M, ENV_PREFILL_MIN_M):
        assert var.startswith("KQUANT_") and f"`{var}`" in readme
        with pytest.raises(ValueError, match=var):
            check_environment({var: "abc"}, cache=False)


def test_env_defaults():
    env = resolve_env({})
    assert env == PlanEnv(pinned_block_m=None, prefill_disabled=False, prefill_min_m=256)
    assert resolve_env({ENV_PREFILL_BLOCK_M: "", ENV_PREFILL_MIN_M: "  "}) == env


def test_env_reads_process_environment(monkeypatch):
    monkeypatch.setenv(ENV_PREFILL_BLOCK_M, "16")
    monkeypatch.setenv(ENV_PREFILL_MIN_M, "512")
    assert resolve_env() == PlanEnv(pinned_block_m=16, prefill_disabled=False, prefill_min_m=512)


@pytest.mark.parametrize("size", ROUTE_BLOCK_SIZES)
def test_env_pins_block(size):
    env = resolve_env({ENV_PREFILL_BLOCK_M: f" {size} "})
    assert env.pinned_block_m == size and not env.prefill_disabled


def test_env_zero_disables_prefill():
    env = resolve_env({ENV_PREFILL_BLOCK_M: "0"})
    assert env.prefill_disabled and env.pinned_block_m is None


@pytest.mark.parametrize("raw", ["12", "128", "-8", "7", "1"])
def test_env_bad_pin_names_variable_and_allowed(raw):
    with pytest.raises(ValueError) as info:
        resolve_env({ENV_PREFILL_BLOCK_M: raw})
    msg = str(info.value)
    assert ENV_PREFILL_BLOCK_M in msg
    assert "0, 8, 16, 32, 48, 64" in msg


@pytest.mark.parametrize("var", [ENV_PREFILL_BLOCK_M, ENV_PREFILL_MIN_M])
@pytest.mark.parametrize("raw", ["abc", "32.0", "0x20", "1e3", "32 48"])
def test_env_garbage(var, raw):
    with pytest.raises(ValueError) as info:
        resolve_env({var: raw})
    assert var in str(info.value)


def test_env_min_m():
    assert resolve_env({ENV_PREFILL_MIN_M: "8"}).prefill_min_m == 8
    assert resolve_env({ENV_PREFILL_MIN_M: "1024"}).prefill_min_m == 1024
    for raw in ("7", "0", "-256"):
        with pytest.raises(ValueError) as info:
            resolve_env({ENV_PREFILL_MIN_M: raw})
        assert ENV_PREFILL_MIN_M in str(info.value)


def test_plan_env_validates_direct_construction():
    with pytest.raises(ValueError):
        PlanEnv(pinned_block_m=12)
    with pytest.raises(ValueError):
        PlanEnv(pinned_block_m=32, prefill_disabled=True)
    with pytest.raises(ValueError):
        PlanEnv(prefill_min_m=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanEnv().prefill_min_m = 8  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# choose_prefill_block
# ---------------------------------------------------------------------------------------


def test_choice_is_policy_at_capacity_when_accepted():
    for cap in (16, 1536, 2048, 4096, 8192):
        check = RecordingCheck({})
        block, decisions = choose_prefill_block(cap, 16, 896, PlanEnv(), check)
        assert block == select_route_block_size_m(cap, 16, 896)
        assert check.calls == [block]
        assert decisions == [GeometryVerdict(block_m=block, ok=True)]


def test_fallback_walks_to_next_narrower_with_reasons():
    check = RecordingCheck({64: SMEM_64, 48: REGS_48})
    block, decisions = choose_prefill_block(8192, 16, 896, PlanEnv(), check)
    assert block == 32
    assert check.calls == [64, 48, 32]
    assert [(d.block_m, d.ok, d.reason) for d in decisions] == [
        (64, False, SMEM_64), (48, False, REGS_48), (32, True, None)]


def test_fallback_reaches_8_or_none():
    check = RecordingCheck({s: f"rejected {s}" for s in (16, 32, 48, 64)})
    block, decisions = choose_prefill_block(8192, 16, 896, PlanEnv(), check)
    assert block == 8 and check.calls == [64, 48, 32, 16, 8]
    check = RecordingCheck({s: f"rejected {s}" for s in ROUTE_BLOCK_SIZES})
    block, decisions = choose_prefill_block(8192, 16, 896, PlanEnv(), check)
    assert block is None
    assert [d.block_m for d in decisions] == [64, 48, 32, 16, 8]
    assert all(not d.ok and d.reason == f"rejected {d.block_m}" for d in decisions)


def test_pinned_block_overrides_policy_and_falls_back_when_rejected():
    block, decisions = choose_prefill_block(8192, 16, 896, PlanEnv(pinned_block_m=16), accept_all)
    assert block == 16 and [d.block_m for d in decisions] == [16]
    # Pinned wider than the policy's choice: the pin wins.
    block, _ = choose_prefill_block(1536, 16, 896, PlanEnv(pinned_block_m=64), accept_all)
    assert block == 64
    # A rejected pin falls back (recorded), it does not raise.
    check = RecordingCheck({48: REGS_48})
    block, decisions = choose_prefill_block(1536, 16, 896, PlanEnv(pinned_block_m=48), check)
    assert block == 32
    assert (decisions[0].block_m, decisions[0].reason) == (48, REGS_48)


def test_disabled_prefill_never_calls_check():
    check = RecordingCheck({})
    assert choose_prefill_block(8192, 16, 896, PlanEnv(prefill_disabled=True), check) == (None, [])
    assert check.calls == []


def test_check_may_return_full_verdicts():
    sm120 = arch_limits("sm_120")
    table = {64: (103_424, 200), 48: (90_000, 256), 32: (70_100, 175)}

    def measured(block_m):
        smem, regs = table[block_m]
        return geometry_verdict(sm120, block_m, smem_bytes=smem, registers=regs, spills=0, threads=256)

    block, decisions = choose_prefill_block(8192, 16, 896, PlanEnv(), measured)
    assert block == 32
    assert decisions[0].smem_bytes == 103_424 and "101,376 B limit of sm_120" in decisions[0].reason
    assert decisions[1].registers == 256 and "255" in decisions[1].reason
    assert decisions[2].ok and decisions[2].registers == 175


def test_check_contract_errors():
    with pytest.raises(ValueError):
        choose_prefill_block(8192, 16, 896, PlanEnv(), lambda m: GeometryVerdict(block_m=8, ok=True))
    with pytest.raises(ValueError):
        choose_prefill_block(8192, 16, 896, PlanEnv(), lambda m: "")
    with pytest.raises(TypeError):
        choose_prefill_block(8192, 16, 896, PlanEnv(), lambda m: False)
    for args in ((0, 16, 896), (8192, 0, 896), (8192, 16, 0)):
        with pytest.raises(ValueError):
            choose_prefill_block(*args, PlanEnv(), accept_all)
        with pytest.raises(ValueError):
            choose_prefill_block(*args, PlanEnv(prefill_disabled=True), accept_all)


# ---------------------------------------------------------------------------------------
# plan_routes / RoutePlan / TokenBand
# ---------------------------------------------------------------------------------------


def test_token_band_sizing():
    band = TokenBand.build(257, 8192, 32, "prefill", 16, 896)
    assert band.route_slots == padded_route_slots(8192 * 16, 896, 32) == 8192 * 16 + 896 * 31
    assert band.max_blocks == band.route_slots // 32
    with pytest.raises(ValueError):
        TokenBand(lo=1, hi=8192, block_m=32, role="prefill", route_slots=100, max_blocks=1)
    with pytest.raises(ValueError):  # the decode role is M=8 and only M=8
        TokenBand.build(1, 256, 16, "decode", 16, 896)
    with pytest.raises(ValueError):
        TokenBand.build(300, 256, 8, "decode", 16, 896)
    with pytest.raises(dataclasses.FrozenInstanceError):
        band.block_m = 8  # type: ignore[misc]


def test_plan_with_fallback():
    check = RecordingCheck({64: SMEM_64, 48: REGS_48})
    plan = plan_routes(8192, 16, 896, PlanEnv(), check, banded=False)  # the pair plan
    assert check.calls == [64, 48, 32, 8]  # the walk, then the decode M=8
    assert [(b.lo, b.hi, b.block_m, b.role) for b in plan.bands] == [
        (1, 256, 8, "decode"), (257, 8192, 32, "prefill")]
    assert plan.bands[0].route_slots == padded_route_slots(256 * 16, 896, 8)
    assert plan.route_slots == padded_route_slots(8192 * 16, 896, 32)
    assert plan.prefill_m == 32 and plan.block_sizes == (8, 32) and plan.error is None
    assert [(c.block_m, c.ok, c.purpose) for c in plan.candidates] == [
        (64, False, "prefill"), (48, False, "prefill"), (32, True, "prefill"), (8, True, "decode")]
    assert [plan.role(m) for m in (64, 48, 32, 8)] == [
        "fallback-rejected", "fallback-rejected", "prefill", "decode"]
    assert plan.verdict(48).reason == REGS_48 and plan.verdict(16) is None
    assert [plan.band_for(m).block_m for m in (1, 256, 257, 8192)] == [8, 8, 32, 32]
    assert plan.max_blocks(100) == max_route_blocks(1600, 896, 8)
    assert plan.max_blocks(4000) == max_route_blocks(64000, 896, 32)
    for bad in (0, 8193, True, 2.0):
        with pytest.raises(ValueError):
            plan.band_for(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("min_m", [8, 9, 16, 256, 1000])
def test_prefill_binds_only_above_threshold(min_m):
    plan = plan_routes(8192, 16, 896, PlanEnv(prefill_min_m=min_m), accept_all, banded=False)
    assert plan.prefill_m == 64
    for m in range(1, 2000):
        assert plan.band_for(m).block_m == (64 if m > min_m else 8)


def test_no_prefill_cases_serve_everything_with_decode():
    # Disabled by env: only M=8 is asked about.
    check = RecordingCheck({})
    plan = plan_routes(8192, 16, 896, PlanEnv(prefill_disabled=True), check)
    assert plan.prefill_m is None and check.calls == [8]
    assert [(b.lo, b.hi, b.block_m) for b in plan.bands] == [(1, 8192, 8)]
    assert "disabled" in plan.describe()
    # Capacity never exceeds the threshold: the walk does not run.
    check = RecordingCheck({})
    plan = plan_routes(256, 16, 896, PlanEnv(), check)
    assert plan.prefill_m is None and check.calls == [8] and plan.bands[0].hi == 256
    # Every geometry rejected: the walk's answer for M=8 is the decode's (asked once).
    check = RecordingCheck({s: "no" for s in ROUTE_BLOCK_SIZES})
    plan = plan_routes(8192, 16, 896, PlanEnv(), check)
    assert plan.prefill_m is None and check.calls == [64, 48, 32, 16, 8]
    assert plan.error == "the decode specialization is not implementable: no"
    assert plan.role(8) == "decode" and plan.bands[0].hi == 8192
    # Policy picks M=8 at capacity: a prefill plan would be the decode plan again.
    plan = plan_routes(300, 16, 896, PlanEnv(), accept_all)
    assert select_route_block_size_m(300, 16, 896) == 8
    assert plan.prefill_m is None and plan.bands[0].hi == 300
    assert "equals the decode plan" in plan.describe()


def test_banded_plan_bands_by_the_policy_at_each_m():
    """Banded: above the threshold a call binds the policy's M at its own m; a rejected size
    falls to the next narrower accepted one; the bands are maximal runs of one M."""
    check = RecordingCheck({48: REGS_48})
    plan = plan_routes(8192, 16, 896, PlanEnv(), check)  # banded: the default
    assert plan.banded
    assert check.calls == [64, 8, 16, 32, 48]  # the walk, the decode, then the bands
    assert plan.block_sizes == (8, 16, 32, 64)
    assert [(b.lo, b.hi, b.block_m, b.role) for b in plan.bands] == [
        (1, 403, 8, "decode"), (404, 806, 16, "band"), (807, 2419, 32, "band"),
        (2420, 8192, 64, "prefill")]
    assert plan.role(48) == "band-rejected" and plan.role(16) == "band"
    assert all(plan.band_for(m).block_m == 8 for m in (1, 256, 257, 403))
    assert plan.route_slots == padded_route_slots(8192 * 16, 896, 64)
    text = plan.describe()
    assert "m in [807, 2,419]: band M=32" in text and "banded:" in text
    assert f"M=48: rejected: {REGS_48}" in text
    # Nothing accepted between M=8 and the prefill M: the pair's binding, said so.
    check = RecordingCheck({16: "no", 32: "no", 48: "no"})
    plan = plan_routes(8192, 16, 896, PlanEnv(), check)
    assert [(b.lo, b.block_m) for b in plan.bands] == [(1, 8), (257, 64)]
    assert "no accepted size between M=8 and M=64" in plan.describe()
    # A pinned prefill M binds every call above the threshold: no bands, said so.
    check = RecordingCheck({})
    plan = plan_routes(8192, 16, 896, PlanEnv(pinned_block_m=32), check)
    assert not plan.banded and check.calls == [32, 8]
    assert [(b.lo, b.block_m) for b in plan.bands] == [(1, 8), (257, 32)]
    assert "not banded" in plan.describe() and ENV_PREFILL_BLOCK_M in plan.describe()


def test_route_plan_validation():
    decode = TokenBand.build(1, 256, 8, "decode", 16, 896)
    prefill = TokenBand.build(257, 8192, 32, "prefill", 16, 896)
    kw = dict(capacity=8192, topk=16, num_experts=896, prefill_min_m=256)
    RoutePlan(**kw, prefill_m=32, bands=(decode, prefill))
    with pytest.raises(ValueError):  # a gap between the bands
        RoutePlan(**kw, prefill_m=32, bands=(TokenBand.build(1, 100, 8, "decode", 16, 896), prefill))
    with pytest.raises(ValueError):  # the bands stop short of the capacity
        RoutePlan(**{**kw, "capacity": 9000}, prefill_m=32, bands=(decode, prefill))
    with pytest.raises(ValueError):  # a band whose M is no specialization of the plan
        RoutePlan(**kw, prefill_m=64, bands=(decode, prefill))
    with pytest.raises(ValueError):  # bounds computed for another top-k
        RoutePlan(**kw, prefill_m=32, bands=(decode, TokenBand.build(257, 8192, 32, "prefill", 8, 896)))
    with pytest.raises(ValueError):  # the prefill plan could never bind
        RoutePlan(**{**kw, "capacity": 256}, prefill_m=32, bands=(decode,))
    with pytest.raises(ValueError):
        RoutePlan(**{**kw, "prefill_min_m": 7}, prefill_m=32, bands=(decode, prefill))
    v = GeometryVerdict(block_m=32, ok=True)
    with pytest.raises(ValueError):  # one candidate per size
        RoutePlan(**kw, prefill_m=32, bands=(decode, prefill),
                  candidates=(Candidate(v, "prefill"), Candidate(v, "band")))


def test_describe_text():
    plan = plan_routes(8192, 16, 896, PlanEnv(), RecordingCheck({64: SMEM_64, 48: REGS_48}),
                       banded=False)
    text = plan.describe(scratch_bytes={"arena": 1_000, "output": 123_456})
    assert "m in [1, 256]: decode M=8 (10,368 route slots, 1,296 blocks)" in text
    assert "m in [257, 8,192]: prefill M=32 (158,848 route slots, 4,964 blocks)" in text
    # The policy's own choices over the prefill band, for information.
    assert "M=16 for m in [404, 806]" in text and "M=64 for m in [2,420, 8,192]" in text
    assert f"M=64: rejected: {SMEM_64}" in text and f"M=48: rejected: {REGS_48}" in text
    # Every accepted candidate, the decode's too (an unmeasured one says so).
    assert "accepted geometry: M=32: ok" in text and "accepted geometry: M=8: ok" in text
    assert "scratch: one shared arena of 123,456 B" in text
    pinned = plan_routes(8192, 16, 896, PlanEnv(pinned_block_m=16), accept_all).describe()
    assert "prefill M=16" in pinned and ENV_PREFILL_BLOCK_M in pinned
    unmeasured = plan_routes(64, 2, 8, PlanEnv(), lambda m: GeometryVerdict(m, True, measured=False))
    assert "M=8: ok (unmeasured: no cuobjdump" in unmeasured.describe()


def test_policy_runs_partition_the_band():
    plan = plan_routes(8192, 8, 64, PlanEnv(), accept_all)
    for band in plan.bands:
        runs = policy_runs(band.lo, band.hi, 8, 64)
        assert runs[0][0] == band.lo and runs[-1][1] == band.hi
        for (a, b, size), nxt in zip(runs, runs[1:] + [None]):
            assert all(select_route_block_size_m(m, 8, 64) == size for m in (a, b, (a + b) // 2))
            if nxt is not None:
                assert nxt[0] == b + 1 and nxt[2] > size
                assert select_route_block_size_m(b + 1, 8, 64) != size


GEOMETRIES = ((8192, 16, 896), (1536, 16, 896), (512, 2, 8), (3000, 8, 64), (300, 4, 128),
              (256, 16, 896))
REJECTIONS = ((), (64,), (64, 48), (48,), (32,), (16, 32, 48, 64), (16, 32, 48))


def test_banded_plan_hand_computed():
    """3,000 tokens, top-8, 64 experts: avg = m / 8 routes per expert, so the policy picks
    M=8 up to m=57, 16 up to 115, 32 up to 230, 48 up to 345, then 64 (0.9 * s * 8 bounds).
    Above the threshold (256) the calls bind 48 to m=345 and 64 beyond."""
    check = RecordingCheck({})
    plan = plan_routes(3000, 8, 64, PlanEnv(), check)
    assert check.calls == [64, 8, 16, 32, 48]
    assert [(b.lo, b.hi, b.block_m, b.role) for b in plan.bands] == [
        (1, 256, 8, "decode"), (257, 345, 48, "band"), (346, 3000, 64, "prefill")]
    assert plan.route_slots == 3000 * 8 + 64 * 63 == 28032
    assert plan.max_blocks(3000) == 28032 // 64 == 438
    assert plan.max_blocks(300) == (300 * 8 + 64 * 47) // 48 == 112
    assert plan.max_blocks(10) == (80 + 64 * 7) // 8 == 66  # 80 routes, <= 64 partial blocks
    # M=48 rejected: its band falls to the next narrower accepted size, 32.
    plan = plan_routes(3000, 8, 64, PlanEnv(), RecordingCheck({48: REGS_48}))
    assert [(b.lo, b.hi, b.block_m) for b in plan.bands] == [(1, 256, 8), (257, 345, 32),
                                                             (346, 3000, 64)]
    # The decode/prefill pair plan: 64 from the threshold up.
    plan = plan_routes(3000, 8, 64, PlanEnv(), accept_all, banded=False)
    assert [(b.lo, b.hi, b.block_m) for b in plan.bands] == [(1, 256, 8), (257, 3000, 64)]
    assert plan.block_sizes == (8, 64)


@pytest.mark.parametrize("banded", [False, True])
@pytest.mark.parametrize("environ", [
    {}, {ENV_PREFILL_BLOCK_M: "0"}, {ENV_PREFILL_MIN_M: "8"}, {ENV_PREFILL_MIN_M: "1000"},
    {ENV_PREFILL_BLOCK_M: "16"}, {ENV_PREFILL_BLOCK_M: "32"}, {ENV_PREFILL_BLOCK_M: "48"},
    {ENV_PREFILL_BLOCK_M: "64"}, {ENV_PREFILL_BLOCK_M: "8"},
    {ENV_PREFILL_BLOCK_M: "64", ENV_PREFILL_MIN_M: "16"},
], ids=lambda e: ",".join(f"{k[13:]}={v}" for k, v in e.items()) or "default")
def test_plan_properties(environ, banded):
    """For several geometries, plan knobs and rejections, what any correct plan satisfies:
    each size is asked about once and within the bound; only accepted sizes are compiled and
    bound; the bands cover 1..capacity in order with M growing; the decode M binds up to the
    threshold; the prefill M is the widest accepted size the policy (or pin) allows at
    capacity; a call binds the widest accepted size its own policy choice allows (banded)
    or the prefill M (pair, pin); its grid and the arena's route list bound its packing."""
    env = resolve_env(environ)
    for capacity, topk, experts in GEOMETRIES:
        for rejected in REJECTIONS:
            what = (capacity, topk, experts, rejected)
            check = RecordingCheck({m: "no" for m in rejected})
            plan = plan_routes(capacity, topk, experts, env, check, banded=banded)
            # The questions.
            assert len(check.calls) == len(set(check.calls)), what
            assert set(check.calls) <= set(ROUTE_BLOCK_SIZES) and 8 in check.calls, what
            assert len(check.calls) <= candidate_bound(capacity, topk, experts, env), what
            assert {c.block_m for c in plan.candidates} == set(check.calls), what
            # Accepted, compiled, bound.
            accepted = {m for m in check.calls if m not in rejected}
            assert set(plan.block_sizes) <= accepted | {8}, what
            bound = {b.block_m for b in plan.bands}
            assert bound <= set(plan.block_sizes), what
            assert plan.error is None or (8 in rejected and plan.error.endswith("no")), what
            # The prefill M.
            wants_prefill = not env.prefill_disabled and capacity > env.prefill_min_m
            top = env.pinned_block_m or select_route_block_size_m(capacity, topk, experts)
            allowed = [s for s in accepted if s <= top]
            expect = max(allowed) if wants_prefill and allowed else None
            assert plan.prefill_m == (None if expect == 8 else expect), what
            # The bands.
            assert plan.bands[0].lo == 1 and plan.bands[-1].hi == capacity, what
            for a, b in zip(plan.bands, plan.bands[1:]):
                assert b.lo == a.hi + 1 and b.block_m > a.block_m, what
            if not banded or env.pinned_block_m is not None:
                assert len(plan.bands) <= 2, what
            for m in sorted({1, 8, 9, capacity, env.prefill_min_m, env.prefill_min_m + 1,
                             *range(1, capacity + 1, 97)}):
                if m > capacity:
                    continue
                got = plan.band_for(m).block_m
                if plan.prefill_m is None or m <= env.prefill_min_m:
                    assert got == 8, (what, m)
                elif len(plan.bands) <= 2:
                    assert got == plan.prefill_m, (what, m)
                else:
                    policy = select_route_block_size_m(m, topk, experts)
                    assert got == max([s for s in plan.block_sizes if s <= policy] or [8]), (what, m)
                assert plan.max_blocks(m) == max_route_blocks(m * topk, experts, got), (what, m)
                assert plan.route_slots >= padded_route_slots(m * topk, experts, got), (what, m)
            assert plan.route_slots == max(b.route_slots for b in plan.bands), what


def test_candidate_bound():
    assert candidate_bound(8192, 16, 896, PlanEnv()) == 5
    assert candidate_bound(8192, 16, 896, PlanEnv(), wide=True) == 7  # and 48 x 2, 64 x 2
    assert candidate_bound(4096, 16, 896, PlanEnv(), wide=True) == 6  # and 48 x 2
    assert candidate_bound(3583, 16, 896, PlanEnv(), wide=True) == 5  # below 64 rows / expert
    assert candidate_bound(8192, 16, 896, PlanEnv(pinned_block_m=16), wide=True) == 2
    assert candidate_bound(1536, 16, 896, PlanEnv()) == 3  # policy M=32: 32, 16, 8
    assert candidate_bound(8192, 16, 896, PlanEnv(pinned_block_m=16)) == 2
    assert candidate_bound(8192, 16, 896, PlanEnv(prefill_disabled=True)) == 1
    assert candidate_bound(256, 16, 896, PlanEnv()) == 1


def test_default_plan_follows_the_pair_plan_decodes(monkeypatch) -> None:
    """`banded=None` (MoELayer's, plan_forward's and prewarm's default) is the spec's
    default plan: banded, except for a codebook whose decode is in `PAIR_PLAN_DECODES`
    (none today; set to the table decode here, sqg_e4m3 gets the pair plan); an explicit
    True / False wins."""
    from kquant_cute import compiler
    from kquant_cute.planners import plans
    from kquant_cute.prewarm import DEFAULT_GEOMETRY

    asked = []

    class Stop(Exception):
        pass

    def fake_plan_routes(*args, banded, **kwargs):
        asked.append(banded)
        raise Stop

    monkeypatch.setattr(compiler, "plan_routes", fake_plan_routes)
    monkeypatch.setattr(plans, "PAIR_PLAN_DECODES", ("table",))  # the pair for table decodes
    mcg = DEFAULT_GEOMETRY.replace(codebook="mcg", bits=4)
    sqg = DEFAULT_GEOMETRY.replace(codebook="sqg_e4m3", bits=2)
    assert default_banded(mcg.codebook) and not default_banded(sqg.codebook)
    for spec, banded in ((mcg, None), (sqg, None), (sqg, True), (mcg, False)):
        with pytest.raises(Stop):
            compiler.plan_forward(spec, capacity=4096, arch="sm_90", env=PlanEnv(), banded=banded)
    assert asked == [True, False, True, False]


def test_wide_rule_binds_two_block_items_from_64_rows_per_expert():
    """The reference geometry (E=896, top-16): from 3,584 tokens (64 routed rows per expert
    on average, the widest block full) a banded plan binds work items of two route blocks at
    the policy's M for half the rows: M=48 x 2 up to 4,838 tokens, then M=64 x 2. Below
    3,584 tokens every call binds what it binds without the rule."""
    asked = []

    def span_check(block_m, span):
        asked.append((block_m, span))
        return None

    plan = plan_routes(8192, 16, 896, PlanEnv(), lambda m: None, span_check=span_check)
    plain = plan_routes(8192, 16, 896, PlanEnv(), lambda m: None)
    assert wide_from_m(16, 896) == 3584 and WIDE_SPAN == 2
    assert asked == [(48, 2), (64, 2)]
    assert plan.wide_keys == ((48, 2), (64, 2)) and plan.block_sizes == plain.block_sizes
    assert [(b.lo, b.hi, b.key, b.role) for b in plan.bands if b.span] == [
        (3584, 4838, (48, 2), "wide"), (4839, 8192, (64, 2), "wide")]
    assert plan.band_for(3583).key == plain.band_for(3583).key == (64, 0)
    for m in range(1, 3584, 61):
        assert plan.band_for(m).key == plain.band_for(m).key, m
    for m in (3584, 4096, 4838, 4839, 8192):
        band = plan.band_for(m)
        assert band.key == (wide_block(m, 16, 896), 2), m
        assert plan.max_blocks(m) == max_route_blocks(m * 16, 896, band.block_m)
    assert plan.route_slots == max(b.route_slots for b in plan.bands)
    assert plan.role(48, 2) == "wide" and plan.role(48) == "band" and plan.verdict(48, 2).ok
    text = plan.describe()
    assert "m in [3,584, 4,838]: wide M=48 x 2 route blocks per work item" in text
    assert "accepted geometry: M=48 x 2: ok" in text and "note: wide: from m = 3,584" in text


def test_wide_rule_falls_back_where_rejected_and_stays_off_where_not_asked():
    """A rejected wide item leaves those calls on their band's own M (the role says
    "wide-rejected"); the rule is off without a span check, for the decode / prefill pair,
    with a pinned prefill M, below 3,584 tokens and with the prefill plan disabled."""
    plain = plan_routes(8192, 16, 896, PlanEnv(), lambda m: None)
    plan = plan_routes(8192, 16, 896, PlanEnv(), lambda m: None,
                       span_check=lambda m, n: "too many registers" if m == 48 else None)
    for m in (3584, 4096, 4838):
        assert plan.band_for(m).key == plain.band_for(m).key == (64, 0), m
    assert plan.band_for(4839).key == (64, 2) and plan.wide_keys == ((64, 2),)
    assert plan.role(48, 2) == "wide-rejected" and plan.verdict(48, 2).reason == "too many registers"
    assert "M=48 x 2: rejected: too many registers" in plan.describe()

    def never(block_m, span):
        raise AssertionError(f"asked about M={block_m} x {span}")

    for p in (plan_routes(8192, 16, 896, PlanEnv(), lambda m: None, banded=False, span_check=never),
              plan_routes(8192, 16, 896, PlanEnv(pinned_block_m=64), lambda m: None,
                          span_check=never),
              plan_routes(3583, 16, 896, PlanEnv(), lambda m: None, span_check=never),
              plan_routes(8192, 16, 896, PlanEnv(prefill_disabled=True), lambda m: None,
                          span_check=never)):
        assert p.wide_keys == () and not any(b.span for b in p.bands)
    with pytest.raises(ValueError, match="wide band binds an accepted wide candidate"):
        dataclasses.replace(plan, candidates=tuple(c for c in plan.candidates if c.span == 0))


def test_fill_rule_moves_the_bands_and_the_prefill_block():
    """The fill rule (the plan of a layer whose GEMM workers share its tables): the bands
    and the prefill M follow the policy at TABLE_FILL_TARGETS, so at E=896, top-16 M=16
    binds from 269 tokens, 32 from 628, 48 from 1,434 (1,536 tokens, 27.4 rows per expert,
    bind 48 where the policy's own targets bind 32) and 64 where the policy moves (2,420);
    the wide rule keeps the policy's targets (4,096 tokens: M=48 x 2); the plan records its
    targets and says so."""
    from kquant_cute.planners import TABLE_FILL_TARGETS as FILL

    args = (4096, 16, 896, PlanEnv(), lambda m: None)
    plain = plan_routes(*args, span_check=lambda m, n: None)
    ruled = plan_routes(*args, span_check=lambda m, n: None, fill_targets=FILL)
    assert plain.band_for(1536).key == (32, 0) and ruled.band_for(1536).key == (48, 0)
    assert [(b.lo, b.key) for b in ruled.bands] == [
        (1, (8, 0)), (269, (16, 0)), (628, (32, 0)), (1434, (48, 0)), (2420, (64, 0)),
        (3584, (48, 2))]
    assert ruled.fill_targets == FILL and plain.fill_targets == ()
    assert any("fill rule" in n for n in ruled.notes) and "fill rule" not in plain.describe()
    assert "policy alone would pick: M=48 for m in [1,434, 2,419]" in ruled.describe()
    assert candidate_bound(4096, 16, 896, PlanEnv(), wide=True, fill_targets=FILL) == len(
        ruled.candidates)
    small = plan_routes(1500, 16, 896, PlanEnv(), lambda m: None, fill_targets=FILL)
    assert small.prefill_m == 48 and plan_routes(1500, 16, 896, PlanEnv(),
                                                 lambda m: None).prefill_m == 32
    with pytest.raises(ValueError, match="fill_targets"):
        plan_routes(*args, fill_targets=((32, 1.2),))
    with pytest.raises(ValueError, match="fill_targets"):
        dataclasses.replace(ruled, fill_targets=((16, 0.1),))

"""Tests for planners.plans: env knobs, prefill block fallback, plan-pair layout and describe()."""

from __future__ import annotations

import dataclasses

import pytest

from kquant_cute.planners import (
    ENV_PREFILL_BLOCK_M,
    ENV_PREFILL_MIN_M,
    ROUTE_BLOCK_SIZES,
    GeometryVerdict,
    PlanEnv,
    PlanLayout,
    PlanPairLayout,
    arch_limits,
    choose_prefill_block,
    padded_route_slots,
    plan_pair_layout,
    resolve_env,
    select_route_block_size_m,
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


def test_env_names():
    assert ENV_PREFILL_BLOCK_M == "KQUANT_W4A16_PREFILL_BLOCK_M"
    assert ENV_PREFILL_MIN_M == "KQUANT_W4A16_PREFILL_MIN_M"


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
# PlanLayout / PlanPairLayout
# ---------------------------------------------------------------------------------------


def test_plan_layout_sizing():
    plan = PlanLayout.build(32, 8192, 16, 896)
    assert plan.route_slots == padded_route_slots(8192 * 16, 896, 32) == 8192 * 16 + 896 * 31
    assert plan.num_blocks == plan.route_slots // 32
    with pytest.raises(ValueError):
        PlanLayout(block_m=32, capacity=8192, topk=16, num_experts=896, route_slots=1, num_blocks=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.block_m = 8  # type: ignore[misc]


def test_pair_with_fallback():
    pair = plan_pair_layout(8192, 16, 896, PlanEnv(), RecordingCheck({64: SMEM_64, 48: REGS_48}))
    assert pair.decode.block_m == 8 and pair.decode.capacity == 256
    assert pair.prefill is not None and pair.prefill.block_m == 32 and pair.prefill.capacity == 8192
    assert (pair.capacity, pair.topk, pair.num_experts) == (8192, 16, 896)
    assert [d.block_m for d in pair.decisions] == [64, 48, 32]
    assert pair.plan_for(1) is pair.decode
    assert pair.plan_for(256) is pair.decode
    assert pair.plan_for(257) is pair.prefill
    assert pair.plan_for(8192) is pair.prefill
    with pytest.raises(ValueError):
        pair.plan_for(8193)
    with pytest.raises(ValueError):
        pair.plan_for(0)


@pytest.mark.parametrize("min_m", [8, 9, 16, 256, 1000])
def test_binds_prefill_never_at_or_below_threshold_or_8(min_m):
    pair = plan_pair_layout(8192, 16, 896, PlanEnv(prefill_min_m=min_m), accept_all)
    assert pair.prefill is not None
    for m in range(1, 2000):
        assert pair.binds_prefill(m) == (m > min_m and m > 8)
    assert not any(pair.binds_prefill(m) for m in range(1, 9))


def test_no_prefill_cases_serve_everything_with_decode():
    # Disabled by env.
    pair = plan_pair_layout(8192, 16, 896, PlanEnv(prefill_disabled=True), accept_all)
    assert pair.prefill is None and pair.decode.capacity == 8192
    assert not any(pair.binds_prefill(m) for m in (1, 257, 8192))
    assert "disabled" in pair.describe()
    # Capacity never exceeds the threshold: the check is not even consulted.
    check = RecordingCheck({})
    pair = plan_pair_layout(256, 16, 896, PlanEnv(), check)
    assert pair.prefill is None and check.calls == [] and pair.decode.capacity == 256
    # Every geometry rejected.
    pair = plan_pair_layout(8192, 16, 896, PlanEnv(), RecordingCheck({s: "no" for s in ROUTE_BLOCK_SIZES}))
    assert pair.prefill is None and len(pair.decisions) == 5 and pair.decode.capacity == 8192
    # Policy picks M=8 at capacity: a prefill plan would be the decode plan again.
    pair = plan_pair_layout(300, 16, 896, PlanEnv(), accept_all)
    assert select_route_block_size_m(300, 16, 896) == 8
    assert pair.prefill is None and pair.decode.capacity == 300
    assert "equals the decode plan" in pair.describe()


def test_pair_layout_validation():
    decode = PlanLayout.build(8, 256, 16, 896)
    prefill = PlanLayout.build(32, 8192, 16, 896)
    PlanPairLayout(decode=decode, prefill=prefill, prefill_min_m=256)
    with pytest.raises(ValueError):  # decode must be M=8
        PlanPairLayout(decode=prefill, prefill=None, prefill_min_m=256)
    with pytest.raises(ValueError):  # gap between decode capacity and threshold
        PlanPairLayout(decode=PlanLayout.build(8, 100, 16, 896), prefill=prefill, prefill_min_m=256)
    with pytest.raises(ValueError):  # prefill could never bind
        PlanPairLayout(decode=decode, prefill=PlanLayout.build(32, 256, 16, 896), prefill_min_m=256)
    with pytest.raises(ValueError):  # topk mismatch
        PlanPairLayout(decode=decode, prefill=PlanLayout.build(32, 8192, 8, 896), prefill_min_m=256)
    with pytest.raises(ValueError):
        PlanPairLayout(decode=decode, prefill=prefill, prefill_min_m=7)


def test_describe_text():
    pair = plan_pair_layout(8192, 16, 896, PlanEnv(), RecordingCheck({64: SMEM_64, 48: REGS_48}))
    text = pair.describe(scratch_bytes={"decode": 1_000, "prefill": 123_456})
    assert "m in [1, 256]: decode M=8" in text
    assert "m in [257, 8,192]: prefill M=32" in text
    # The policy's own choices over the prefill band, for information.
    assert "M=16 for m in [404, 806]" in text and "M=64 for m in [2,420, 8,192]" in text
    assert f"M=64: rejected: {SMEM_64}" in text and f"M=48: rejected: {REGS_48}" in text
    assert "scratch: one shared arena of 123,456 B" in text
    assert len(text.splitlines()) >= 7
    pinned = plan_pair_layout(8192, 16, 896, PlanEnv(pinned_block_m=16), accept_all).describe()
    assert "prefill M=16" in pinned and ENV_PREFILL_BLOCK_M in pinned


def test_policy_bands_partition_the_band():
    pair = plan_pair_layout(8192, 8, 64, PlanEnv(), accept_all)
    for lo, hi, _ in pair.bands():
        bands = pair._policy_bands(lo, hi)
        assert bands[0][0] == lo and bands[-1][1] == hi
        for (a, b, size), nxt in zip(bands, bands[1:] + [None]):
            assert all(select_route_block_size_m(m, 8, 64) == size for m in (a, b, (a + b) // 2))
            if nxt is not None:
                assert nxt[0] == b + 1 and nxt[2] > size


def test_layer_scratch_is_the_max_of_both_plans(tmp_path) -> None:
    """The plan owns the route bounds the layer allocates and launches with: the scratch
    route list is the max over its plans' M at the capacity, a call's grid is the bound at
    its own m and the M it binds; the arena holds every scratch argument, aligned."""
    from kquant_cute.compile_cache import CompileCache
    from kquant_cute.compiler import plan_forward
    from kquant_cute.kernels.launch import ARGS, scratch_layout
    from kquant_cute.planners.policy import max_route_blocks, padded_route_slots
    from kquant_cute.prewarm import DEFAULT_GEOMETRY

    base = DEFAULT_GEOMETRY.replace(hidden=256, intermediate=256)
    cap = 8192
    n = cap * base.topk
    plan = plan_forward(base, capacity=cap, arch="sm_120", env=resolve_env({}),
                        cache=CompileCache(tmp_path))
    assert sorted(s.block_m for s in plan.specs()) == [8, 64]
    assert plan.route_slots() == max(padded_route_slots(n, base.num_experts, m) for m in (8, 64))
    assert plan.max_blocks(100) == max_route_blocks(100 * 16, 896, 8)
    assert plan.max_blocks(4000) == max_route_blocks(4000 * 16, 896, 64)
    both = scratch_layout(base, capacity=cap, max_slots=plan.route_slots())
    decode_only = scratch_layout(base, capacity=cap, max_slots=padded_route_slots(n, base.num_experts, 8))
    wide_only = scratch_layout(base, capacity=cap, max_slots=padded_route_slots(n, base.num_experts, 64))
    assert both.nbytes == max(decode_only.nbytes, wide_only.nbytes)
    # Block ids: enough for the narrowest plan's block count.
    assert both["block_expert"].shape[0] * 8 >= both["sorted_routes"].shape[0]
    # Buffers never overlap, and each is 256-byte aligned.
    spans = sorted((b.offset, b.offset + b.nbytes) for b in both.buffers)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(b.offset % 256 == 0 for b in both.buffers)
    # Every scratch argument of the entry point is a buffer of the layout, and only those.
    assert {a.name for a in ARGS if a.kind == "scratch"} == set(both.names)


def test_int_args_cover_every_int_argument_of_the_entry_point():
    """int_args gives exactly the entry point's Int32 arguments (a missing or stale one fails
    only at launch on a GPU otherwise)."""
    from kquant_cute.kernels.launch import ARGS, int_args
    from kquant_cute.kernels.moe import MoESpec

    spec = MoESpec(num_experts=8, hidden=256, intermediate=256, topk=2, bits=4, codebook="mcg",
                   block_m=8, shared_hidden_vectors=True)
    got = int_args(spec, m=5, capacity=64, max_blocks=12, sm_count=132)
    assert list(got) == [a.name for a in ARGS if a.kind == "int"]
    assert got == {"m": 5, "max_blocks": 12, "rows_cap": 64, "routes_cap": 128, "sm_count": 132}

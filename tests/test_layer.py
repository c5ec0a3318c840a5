"""Tests for kquant_cute/layer.py on the CPU: the spec a layer plans from (layer_spec), the
errors MoELayer raises before it plans or launches anything, and the plan binding it does
(the M and grid a call binds, the arena it allocates, its describe()) on a plan built with
tests/fake_build.py's compile step. Binding tensors and launching need a GPU: see
tests/test_gpu_inputs.py and tests/test_gpu_moe.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fake_build import FakeBuild

from kquant_cute.compile_cache import CompileCache
from kquant_cute.compiler import plan_forward
from kquant_cute.environment import ConfigurationError
from kquant_cute.kernels.launch import int_args, scratch_layout
from kquant_cute.layer import MoELayer, layer_spec
from kquant_cute.planners import ENV_PREFILL_BLOCK_M, PlanEnv, max_route_blocks, padded_route_slots
from kquant_cute.weights import MoEWeights


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(8, 256, 256, 3, "3inst", shared_hidden_vectors=True, seed=0)


# ---------------------------------------------------------------------------------------
# layer_spec
# ---------------------------------------------------------------------------------------


def test_layer_spec_takes_the_weights_shape_and_the_call_arguments(weights):
    spec = layer_spec(weights, topk=2, act_dtype=torch.float16, out_dtype=torch.bfloat16,
                      activation="situ")
    got = (spec.num_experts, spec.hidden, spec.intermediate, spec.topk, spec.bits, spec.codebook,
           spec.block_m, spec.act_dtype, spec.out_dtype, spec.activation,
           spec.shared_hidden_vectors, spec.has_expert_map, spec.coupled, spec.bits_set)
    assert got == (8, 256, 256, 2, 3, "3inst", 8, "float16", "bfloat16", "situ", True, False,
                   False, ())
    # An expert map is planned for exactly when the global expert count is given.
    assert layer_spec(weights, topk=2, num_global_experts=64).has_expert_map


def test_layer_spec_passes_only_the_knobs_given(weights):
    default = layer_spec(weights, topk=2)
    assert layer_spec(weights, topk=2, stages=None, occupancy=None, mma=None, span=None) == default
    tuned = layer_spec(weights, topk=2, stages=6, occupancy=2, mma="sync", span=1)
    assert (tuned.stages, tuned.occupancy, tuned.mma, tuned.span) == (6, 2, "sync", 1)
    assert tuned.replace(stages=default.stages, occupancy=default.occupancy, mma="auto",
                         span=0) == default


def test_layer_spec_accepts_any_object_with_the_weights_shape():
    """CPU weights or a plain description: enough to plan and prewarm for a GPU run."""
    shape = SimpleNamespace(num_experts=896, hidden=3584, intermediate=384, bits=2,
                            codebook="sqg_e4m3", shared_hidden_vectors=True, coupled=True)
    spec = layer_spec(shape, topk=16)
    assert (spec.num_experts, spec.bits, spec.codebook, spec.coupled) == (896, 2, "sqg_e4m3", True)
    assert spec.check() is None


def test_layer_spec_rejects_dtypes_the_kernels_do_not_take(weights):
    with pytest.raises(ValueError, match=r"unsupported activation dtype torch.float64"):
        layer_spec(weights, topk=2, act_dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# MoELayer: errors before planning or launching
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True, None])
def test_capacity_must_be_a_positive_int(weights, capacity, tmp_path):
    with pytest.raises(ValueError, match=f"capacity must be a positive int, got {capacity!r}"):
        MoELayer(weights, topk=2, capacity=capacity, cache=CompileCache(tmp_path))


def test_topk_is_bounded_by_the_ids_a_route_may_name(weights, tmp_path):
    cache = CompileCache(tmp_path)
    with pytest.raises(ValueError, match=r"topk must be an int in 1\.\.8 \(the weights' 8 "
                                         r"experts\), got 9"):
        MoELayer(weights, topk=9, capacity=64, cache=cache)
    with pytest.raises(ValueError, match=r"topk must be an int in 1\.\.64 \(num_global_experts\), "
                                         r"got 0"):
        MoELayer(weights, topk=0, capacity=64, num_global_experts=64, cache=cache)
    # With an expert map, ids index the global experts: top-9 of 64 passes this check and
    # stops at the next one (CPU weights).
    with pytest.raises(ValueError, match="needs weights on a CUDA device"):
        MoELayer(weights, topk=9, capacity=64, num_global_experts=64, cache=cache)


def test_weights_must_be_a_weights_container(tmp_path):
    with pytest.raises(TypeError, match="weights must be a kquant_cute.weights.MoEWeights"):
        MoELayer(object(), topk=2, capacity=64, cache=CompileCache(tmp_path))


def test_cpu_weights_point_to_planning_without_a_gpu(weights, tmp_path):
    with pytest.raises(ValueError) as info:
        MoELayer(weights, topk=2, capacity=64, cache=CompileCache(tmp_path))
    msg = str(info.value)
    assert msg.startswith("MoELayer needs weights on a CUDA device (these are on cpu)")
    for hint in ("kquant_cute.layer_spec(weights, topk=...)", "plan_forward(", "prewarm_plans("):
        assert hint in msg


def test_a_bad_plan_variable_is_one_configuration_error_first(weights, tmp_path):
    """The environment is checked before anything else, even before the weights' type."""
    with pytest.raises(ConfigurationError, match=ENV_PREFILL_BLOCK_M):
        MoELayer(object(), topk=2, capacity=64, cache=CompileCache(tmp_path),
                 environ={ENV_PREFILL_BLOCK_M: "12"})


# ---------------------------------------------------------------------------------------
# Plan binding: what MoELayer allocates and binds, from the plan of its layer_spec
# ---------------------------------------------------------------------------------------


def test_the_plan_owns_the_route_bounds_a_layer_allocates_and_binds(weights, monkeypatch,
                                                                    tmp_path):
    """The layer sizes its arena by the plan's route list (the bound over every band), and a
    call with m tokens binds the M of m's band and launches that M's block bound at m; the
    describe() text reports the arena (MoELayer.describe adds the same scratch sizes)."""
    FakeBuild().install(monkeypatch)
    cap, topk = 4096, 2
    base = layer_spec(weights, topk=topk)
    plan = plan_forward(base, capacity=cap, arch="sm_120", env=PlanEnv(),
                        cache=CompileCache(tmp_path))
    n = cap * topk
    assert plan.route.route_slots == max(padded_route_slots(n, 8, m) for m in plan.entries)
    arena = scratch_layout(base, capacity=cap, max_slots=plan.route.route_slots)
    assert arena["sorted_routes"].shape == (plan.route.route_slots,)
    for m in (1, 256, 257, 1000, 4096):
        bound = plan.plan_for(m)
        M = bound.spec.block_m
        assert M == plan.route.band_for(m).block_m
        ints = int_args(bound.spec, m=m, capacity=cap, max_blocks=plan.route.max_blocks(m),
                        sm_count=132)
        assert ints["max_blocks"] == max_route_blocks(m * topk, 8, M)
        # The grid's route blocks fit the arena's block list and its route list.
        assert ints["max_blocks"] * M <= arena["sorted_routes"].shape[0]
        assert ints["max_blocks"] < arena["block_expert"].shape[0]
    text = plan.describe(scratch_bytes={"arena": arena.nbytes, "output": cap * 256 * 4})
    assert f"scratch: one shared arena of {max(arena.nbytes, cap * 1024):,} B" in text

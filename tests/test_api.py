"""The public API of `import kquant_cute` (kquant_cute/__init__.py): lazy names, and planning /
describing / prewarming a layer from Python on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kquant_cute


def test_import_is_light_and_every_name_resolves():
    code = ("import sys, kquant_cute as k; heavy = {'torch', 'cutlass'} & set(sys.modules);"
            "assert not heavy, heavy; assert k.select_route_block_size_m(1536, 16, 896) == 32;"
            "assert not {'torch', 'cutlass'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
    # Each public name is the object its owning module defines, not a copy or a stand-in.
    import importlib

    owners = {
        "kquant_cute.layer": ("MoELayer", "BoundForward", "layer_spec"),
        "kquant_cute.weights": ("MoEWeights",),
        "kquant_cute.kernels.moe": ("MoESpec",),
        "kquant_cute.compiler": ("ForwardPlan", "plan_forward", "geometry_check"),
        "kquant_cute.prewarm": ("DEFAULT_GEOMETRY", "DEFAULT_CAPACITY", "prewarm_plans"),
        "kquant_cute.compile_cache": ("CompileCache",),
        "kquant_cute.planners": ("select_route_block_size_m", "resolve_env", "PlanEnv",
                                 "ROUTE_BLOCK_SIZES"),
    }
    named = [n for names in owners.values() for n in names]
    assert sorted(named) == sorted(n for n in kquant_cute.__all__ if n != "__version__")
    for module, names in owners.items():
        for name in names:
            assert getattr(kquant_cute, name) is getattr(importlib.import_module(module), name), name
    assert kquant_cute.__version__.count(".") == 2
    assert set(kquant_cute.__all__) <= set(dir(kquant_cute))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kquant_cute.nope  # noqa: B018


def test_plan_describe_and_prewarm_without_a_gpu(tmp_path):
    import torch

    k = kquant_cute
    weights = k.MoEWeights.random(8, 256, 256, 4, "mcg", shared_hidden_vectors=True, seed=0)
    assert weights.device.type == "cpu"
    with pytest.raises(ValueError, match="plan_forward") as info:
        k.MoELayer(weights, topk=2, capacity=64)
    assert "prewarm" in str(info.value)
    spec = k.layer_spec(weights, topk=2, act_dtype=torch.bfloat16, activation="situ")
    assert (spec.num_experts, spec.hidden, spec.bits, spec.activation) == (8, 256, 4, "situ")
    cache = k.CompileCache(tmp_path / "cache")
    plan = k.plan_forward(spec, capacity=64, arch="sm_120", env=k.resolve_env({}), cache=cache)
    text = plan.describe()
    assert "capacity 64 tokens" in text and "M=8" in text and "mma.sync" in text
    (arch,) = k.prewarm_plans(spec, archs=["sm_120"], capacity=64, env=k.resolve_env({}),
                              cache=cache)
    assert [(r.block_m, r.role, r.status) for r in arch.records] == [(8, "decode", "cached")]
    assert arch.describe().startswith("[sm_120a]")


def test_cuda_weights_without_a_gpu_say_so():
    """On a torch that sees no GPU, asking for CUDA weights is the toolkit's error, naming
    the call and the way out, not torch's assertion at the first allocation."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA GPU: the error is for machines without one")
    weights = kquant_cute.MoEWeights.random(2, 128, 128, 2, "mcg", seed=0)
    for call in (lambda: kquant_cute.MoEWeights.random(2, 128, 128, 2, "mcg", device="cuda"),
                 lambda: weights.to("cuda:0")):
        with pytest.raises(ValueError, match=r"needs a CUDA GPU.*sees none") as info:
            call()
        assert "plan_forward" in str(info.value) and "kquant-compile" in str(info.value)

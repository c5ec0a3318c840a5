"""kquant-cute: CuTe DSL kernels for trellis-coded (EXL3-style) W4A16 MoE layers.

This package owns the public API: the names below, imported lazily on first use (so
``import kquant_cute`` imports neither torch nor cutlass). Subpackages:
kquant_cute.kernels (CuTe DSL kernels), kquant_cute.planners (policy, geometry, plans),
kquant_cute.compile_cache (disk cache).

Serving (a CUDA GPU): ``MoEWeights`` -> ``MoELayer(weights, topk=..., capacity=...)``,
``layer(x, topk_ids, topk_weights)`` or ``layer.bind(...).run()`` (CUDA graphs). For
engines and torch.compile: ``import kquant_cute.ops`` registers the forward as
``torch.ops.kquant.moe_forward`` (a bound layer's ``handle`` and arena; the reference
math on the CPU).
Planning and prewarming (no GPU needed): ``layer_spec(weights, topk=...)`` or
``DEFAULT_GEOMETRY``, then ``plan_forward(spec, capacity=..., arch="sm_90").describe()``
and ``prewarm_plans(spec, archs=["sm_90", "sm_120"])`` (``kquant_cute.prewarm`` is the
module; its ``prewarm`` returns the flat records).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that owns it.
_EXPORTS = {
    "MoELayer": "kquant_cute.layer",
    "BoundForward": "kquant_cute.layer",
    "layer_spec": "kquant_cute.layer",
    "MoEWeights": "kquant_cute.weights",
    "MoESpec": "kquant_cute.kernels.moe",
    "ForwardPlan": "kquant_cute.compiler",
    "plan_forward": "kquant_cute.compiler",
    "geometry_check": "kquant_cute.compiler",
    "DEFAULT_GEOMETRY": "kquant_cute.prewarm",
    "DEFAULT_CAPACITY": "kquant_cute.prewarm",
    "prewarm_plans": "kquant_cute.prewarm",
    "CompileCache": "kquant_cute.compile_cache",
    "select_route_block_size_m": "kquant_cute.planners",
    "resolve_env": "kquant_cute.planners",
    "PlanEnv": "kquant_cute.planners",
    "ROUTE_BLOCK_SIZES": "kquant_cute.planners",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kquant_cute' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

"""Route-size policy, per-SM geometry model and the decode / prefill plans (pure Python).

* :mod:`.policy` -- route block sizes, the M-selection policy and route-slot bounds.
* :mod:`.geometry` -- the per-SM limits table and the one resource validity predicate.
* :mod:`.plans` -- environment knobs, prefill block choice with fallback, the route plan
  (token bands, every candidate's verdict).

Nothing here imports torch or cutlass.
"""

from .geometry import (
    ARCH_TABLE,
    ArchLimits,
    GeometryVerdict,
    arch_limits,
    check_resources,
    geometry_verdict,
    known_archs,
    normalize_arch,
)
from .plans import (
    DECODE_BLOCK_M,
    PAIR_PLAN_DECODES,
    DEFAULT_PREFILL_MIN_M,
    ENV_PREFILL_BLOCK_M,
    ENV_PREFILL_MIN_M,
    TABLE_FILL_TARGETS,
    WIDE_FROM_ROWS,
    WIDE_SPAN,
    Candidate,
    GeometryCheck,
    PlanEnv,
    RoutePlan,
    TokenBand,
    candidate_bound,
    choose_prefill_block,
    default_banded,
    plan_routes,
    policy_runs,
    resolve_env,
    wide_block,
    wide_from_m,
)
from .policy import (
    FILL_TARGET,
    ROUTE_BLOCK_SIZES,
    max_route_blocks,
    padded_route_slots,
    route_block_sizes_for_capacity,
    select_route_block_size_m,
)

__all__ = [
    "ARCH_TABLE",
    "ArchLimits",
    "Candidate",
    "DECODE_BLOCK_M",
    "DEFAULT_PREFILL_MIN_M",
    "ENV_PREFILL_BLOCK_M",
    "ENV_PREFILL_MIN_M",
    "FILL_TARGET",
    "GeometryCheck",
    "GeometryVerdict",
    "PAIR_PLAN_DECODES",
    "TABLE_FILL_TARGETS",
    "PlanEnv",
    "ROUTE_BLOCK_SIZES",
    "RoutePlan",
    "TokenBand",
    "WIDE_FROM_ROWS",
    "WIDE_SPAN",
    "arch_limits",
    "candidate_bound",
    "check_resources",
    "choose_prefill_block",
    "default_banded",
    "geometry_verdict",
    "known_archs",
    "max_route_blocks",
    "normalize_arch",
    "padded_route_slots",
    "plan_routes",
    "policy_runs",
    "wide_block",
    "wide_from_m",
    "resolve_env",
    "route_block_sizes_for_capacity",
    "select_route_block_size_m",
]

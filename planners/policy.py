"""Route-size policy: which route block M a launch uses, and how many route slots it pads to.

This module owns the route-block arithmetic (docs/formats.md, "Route policy") and nothing else:

* :func:`select_route_block_size_m` -- the route policy. With ``avg = m * topk / E`` routed
  rows per expert, it picks the first block size ``s`` of :data:`ROUTE_BLOCK_SIZES` with
  ``avg < FILL_TARGET * s`` (blocks at least ~90 % full on average), else the widest; a
  plan may ask for other targets per size (``fill_targets``: the planner's rule for layers
  whose decode costs more per work item, ``planners.plans.TABLE_FILL_TARGETS``).
* :func:`route_block_sizes_for_capacity` -- every size the policy can pick for
  ``m in [1, max_tokens]`` (the policy is monotone in ``m``, so this is a contiguous run).
* :func:`padded_route_slots` / :func:`max_route_blocks` -- upper bounds on the packed
  (per-expert padded) route count and on the number of route blocks, used to size the
  route-pack buffers once per plan.

Pure Python; no torch import.
"""

from __future__ import annotations

__all__ = [
    "ROUTE_BLOCK_SIZES",
    "FILL_TARGET",
    "select_route_block_size_m",
    "route_block_sizes_for_capacity",
    "padded_route_slots",
    "max_route_blocks",
]

# Route block sizes (rows of one route block) the fused kernel is specialised for, ascending:
# a kernel fact, owned by the launch contract.
from ..kernels.launch import ROUTE_BLOCK_SIZES  # noqa: E402

#: Average fill a route block should reach before the policy moves to a wider one.
FILL_TARGET: float = 0.9


def check_fill_targets(value: object) -> tuple[tuple[int, float], ...]:
    """``value`` as a sorted tuple of ``(block size, fill target)`` pairs, else ValueError:
    sizes of :data:`ROUTE_BLOCK_SIZES`, each at most once; targets in (0, 1]; and with the
    other sizes at FILL_TARGET the boundaries ``target * size`` strictly increasing, so the
    policy stays monotone in ``m``."""
    bad = ValueError(f"fill_targets must be (block size, target in (0, 1]) pairs of distinct "
                     f"sizes of {ROUTE_BLOCK_SIZES}, got {value!r}")
    if not isinstance(value, (tuple, list)):
        raise bad
    pairs = []
    for item in value:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise bad
        size, target = item
        if isinstance(size, bool) or size not in ROUTE_BLOCK_SIZES:
            raise bad
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
            raise bad
        pairs.append((int(size), float(target)))
    table = dict(pairs)
    if len(table) != len(pairs):
        raise bad
    bounds = [table.get(s, FILL_TARGET) * s for s in ROUTE_BLOCK_SIZES[:-1]]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"fill_targets {value!r}: target x size must grow with the size "
                         f"(the policy monotone in m), got {bounds}")
    return tuple(sorted(pairs))


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) ``>= minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        kind = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def select_route_block_size_m(m: int, topk: int, num_experts: int,
                              fill_targets: tuple = ()) -> int:
    """Route block size M the policy picks for ``m`` tokens routed top-``topk`` over ``num_experts``.

    ``avg = m * topk / num_experts``; returns the first ``s`` in :data:`ROUTE_BLOCK_SIZES` with
    ``avg < FILL_TARGET * s``, else the largest size (64). This is the reference float formula
    verbatim; for every size in the table it agrees with the exact rational comparison
    ``10 * m * topk < 9 * s * num_experts`` (the products ``0.9 * s`` round to the same doubles
    as ``9 * s / 10``), which the tests check.

    Examples (E=896, top-16): m=16 -> 8, m=1536 -> 32, m=2048 -> 48, m=4096 -> 64.
    ``fill_targets`` (``(size, target)`` pairs) replace FILL_TARGET for those sizes
    (``()``: the reference's policy).

    Raises:
        ValueError: if any argument is not a positive int, or for ``fill_targets`` that
            :func:`check_fill_targets` refuses.
    """
    _check_int("m", m, minimum=1)
    _check_int("topk", topk, minimum=1)
    _check_int("num_experts", num_experts, minimum=1)
    targets = dict(check_fill_targets(fill_targets)) if fill_targets else {}
    avg = m * topk / num_experts
    for size in ROUTE_BLOCK_SIZES:
        if avg < targets.get(size, FILL_TARGET) * size:
            return size
    return ROUTE_BLOCK_SIZES[-1]


def route_block_sizes_for_capacity(max_tokens: int, topk: int, num_experts: int) -> tuple[int, ...]:
    """Every block size the policy can pick for ``m in [1, max_tokens]``, ascending.

    The policy is monotone non-decreasing in ``m``, so this is the contiguous slice of
    :data:`ROUTE_BLOCK_SIZES` from the choice at ``m = 1`` to the choice at ``m = max_tokens``.

    Raises:
        ValueError: if any argument is not a positive int.
    """
    _check_int("max_tokens", max_tokens, minimum=1)
    lo = select_route_block_size_m(1, topk, num_experts)
    hi = select_route_block_size_m(max_tokens, topk, num_experts)
    return tuple(s for s in ROUTE_BLOCK_SIZES if lo <= s <= hi)


def padded_route_slots(n_routes: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the packed route count of ``n_routes`` routes over ``num_experts`` at ``block_m``.

    The route pack pads every expert's count up to a multiple of ``block_m``; an expert with
    ``c > 0`` routes gains at most ``block_m - 1`` padding rows and an expert with none gains
    nothing. At most ``min(n_routes, num_experts)`` experts are non-empty, so

        packed = sum_e ceil(c_e / b) * b  <=  n + min(n, E) * (b - 1).

    That is the reference formula ``n + E * (b - 1)`` (docs/formats.md), capped at ``n * b`` when ``n < E`` (for
    ``n >= E`` the cap ``n * b >= n + E * (b - 1)`` never binds, so the two agree): a true
    upper bound for every routing. It is attained whenever every non-empty expert's count is
    ``1 (mod b)`` and ``min(n, E)`` experts are non-empty (e.g. ``n <= E`` routes on distinct
    experts). We deliberately keep the reference value rather than rounding it down to a
    multiple of ``b`` (also a valid bound). Routes dropped by an expert map only lower the
    count; pass the local expert count as ``num_experts``.

    ``n_routes`` may be 0 (an empty batch packs to 0 slots).

    Raises:
        ValueError: if ``n_routes`` is not an int ``>= 0`` or ``num_experts`` / ``block_m`` are
            not positive ints.
    """
    _check_int("n_routes", n_routes, minimum=0)
    _check_int("num_experts", num_experts, minimum=1)
    _check_int("block_m", block_m, minimum=1)
    if n_routes < num_experts:
        return n_routes * block_m
    return n_routes + num_experts * (block_m - 1)


def max_route_blocks(n_routes: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of non-empty route blocks: ``padded_route_slots(...) // block_m``.

    The packed count is a multiple of ``block_m`` and at most :func:`padded_route_slots`, so the
    floor is exact as a bound; the last ``padded_route_slots % block_m`` slots are never used.
    """
    return padded_route_slots(n_routes, num_experts, block_m) // block_m

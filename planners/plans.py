"""The route plan of one layer shape: which route block M serves which token counts, and why.

This module owns the plan decisions (docs/formats.md, "Route policy"), independent of the
kernel, which is injected as a ``check(block_m) -> reason | None | GeometryVerdict``:

* :func:`resolve_env` reads ``KQUANT_W4A16_PREFILL_BLOCK_M`` (pin the prefill M; ``0``
  disables the prefill plan) and ``KQUANT_W4A16_PREFILL_MIN_M`` (the prefill plan binds only
  for ``m`` above it; default 256, at least 8) into a frozen :class:`PlanEnv`.
* :func:`choose_prefill_block` -- the fallback walk: the pinned M, else the policy's choice
  at the planned capacity; a geometry the kernel rejects falls back to the next narrower
  size, every answer recorded as a :class:`GeometryVerdict`.
* :func:`plan_routes` -- the whole plan as one frozen :class:`RoutePlan`: the token bands
  (:class:`TokenBand`: token range, block M, padded-slot bound, max blocks), every candidate
  the check was asked about with its verdict (:class:`Candidate`) and notes. Its
  :meth:`RoutePlan.band_for` is the one answer to "which M does a call with ``m`` tokens
  bind"; :meth:`RoutePlan.max_blocks` (a call's grid bound) and :attr:`RoutePlan.route_slots`
  (the scratch route list) are the route bounds a layer allocates and launches with.
* the wide rule (:data:`WIDE_SPAN`, :func:`wide_from_m`, :func:`wide_block`): once the
  average expert's routed rows fill the widest route block, a banded plan binds work items
  of two route blocks of one expert, at the block size the policy picks for half the rows.
* the fill rule (:data:`TABLE_FILL_TARGETS`): a layer whose decode costs most per work
  item (the K=2 pair table, mixed rates on wgmma) moves to the next wider block at a lower
  average fill than the policy's, so fewer experts overflow into a second block
  (``fill_targets``).
* :func:`candidate_bound` -- how many candidates a plan can ask about (progress bars).
* :func:`default_banded` -- which plan a layer gets when it asks for none: banded, or
  the decode / prefill pair (:data:`PAIR_PLAN_DECODES`).

Policy lives here, not in the kernels: a change to it chooses other specializations but
never changes what a specialization compiles to (its cache key).

The plans of one layer share one scratch arena sized to the largest band and one fp32 output
buffer (that sizing belongs to the kernel module; ``describe`` only reports it).

Pure Python; no torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Literal, Mapping, Optional, Union

from ..kernels.format import codebook as codebook_record
from .geometry import GeometryVerdict
from .policy import (
    FILL_TARGET,
    ROUTE_BLOCK_SIZES,
    _check_int,
    check_fill_targets,
    max_route_blocks,
    padded_route_slots,
    select_route_block_size_m,
)

__all__ = [
    "ENV_PREFILL_BLOCK_M",
    "ENV_PREFILL_MIN_M",
    "DEFAULT_PREFILL_MIN_M",
    "DECODE_BLOCK_M",
    "PlanEnv",
    "resolve_env",
    "GeometryCheck",
    "choose_prefill_block",
    "TokenBand",
    "Candidate",
    "RoutePlan",
    "plan_routes",
    "TABLE_FILL_TARGETS",
    "candidate_bound",
    "policy_runs",
    "PAIR_PLAN_DECODES",
    "default_banded",
    "WIDE_SPAN",
    "WIDE_FROM_ROWS",
    "wide_from_m",
    "wide_block",
    "wide_runs",
]

#: Codebook decodes (``format.Codebook.decode``) whose layers default to the decode /
#: prefill pair instead of the banded plan. None: since the table codebook's GEMM runs
#: several workers per CTA at narrow blocks, its banded plan is as fast as the pair or
#: faster from 512 tokens up (docs/benchmarks.md), as the arithmetic codebooks' always was.
PAIR_PLAN_DECODES: tuple[str, ...] = ()


def default_banded(codebook: str) -> bool:
    """The default route plan of a layer of ``codebook``: banded (True: above the prefill
    threshold a call binds the policy's M at its own m) or the decode / prefill pair (False:
    the capacity's M), by the codebook's decode (:data:`PAIR_PLAN_DECODES`).

    Raises:
        ValueError: for an unknown codebook.
    """
    return codebook_record(codebook).decode not in PAIR_PLAN_DECODES


#: The wide rule. Work items of WIDE_SPAN consecutive route blocks of one expert decode its
#: weights once per N tile for all of their rows. Measured on the H200 for both codebooks
#: (docs/benchmarks.md, "Block size and span"): they win once the average expert has more routed
#: rows than the widest block holds (73 rows: -5 % sqg_e4m3, -14 % mcg against M=64) and
#: lose below (55 rows: +19 % / +13 %; 37 rows: more), where most experts' rows fit one
#: block and the second block of an item is padding.
WIDE_SPAN = 2
#: The wide rule binds from this many routed rows per expert on average: the widest block.
WIDE_FROM_ROWS = ROUTE_BLOCK_SIZES[-1]


def wide_from_m(topk: int, num_experts: int) -> int:
    """The fewest tokens at which the wide rule binds: ``m * topk >= WIDE_FROM_ROWS * E``."""
    _check_int("topk", topk, minimum=1)
    _check_int("num_experts", num_experts, minimum=1)
    return -(-WIDE_FROM_ROWS * num_experts // topk)


#: The fill rule: ``(block size, fill target)`` of layers whose wgmma GEMM runs workers that
#: share tables leaving one CTA per SM (the K=2 pair table, mixed rates' direct state
#: tables: ``kquant_cute.compiler.plan_fill_targets``), instead of the policy's FILL_TARGET
#: (M=48 keeps it). Each route block of an expert decodes its weights again, and that decode
#: is these layers' cost, so the wider block wins before the narrower one is 90 % full on
#: average. Measured on the H200, one M against the next (docs/benchmarks.md, "Block
#: boundaries of the table layers"): for the production QSRT layer M=16 beats 8 at 0.67 of 8
#: rows and more (the lowest measured), 32 beats 16 from ~0.7 of 16, 48 beats 32 from ~0.8
#: of 32, 64 beats 48 from ~0.9 of 48 (the policy's); the mixed k3x22_k4x2 layer crosses at
#: the same fills (16 over 8 by 6 % at 0.67, 32 over 16 by 3 % at 0.71, 48 over 32 within 1 %
#: at 0.79 and by 6 % at 0.86, 48 over 64 at 0.85). 48 and 64 run 3 and 2 workers per CTA,
#: which is why the last boundary stays. Layers of other decodes keep the policy.
TABLE_FILL_TARGETS = ((8, 0.6), (16, 0.7), (32, 0.8))


def wide_block(m: int, topk: int, num_experts: int) -> int:
    """The route block M of the wide rule's work items at ``m`` tokens: the policy's choice
    for half of each expert's rows (``select_route_block_size_m`` over ``WIDE_SPAN * E``
    experts), so an item's WIDE_SPAN blocks hold about what the average expert routes
    (4,096 tokens, E=896, top-16: 73 rows -> M=48 x 2, 96 rows)."""
    _check_int("m", m, minimum=1)
    return wide_runs(m, m, topk, num_experts)[0][2]


def wide_runs(lo: int, hi: int, topk: int, num_experts: int) -> list[tuple[int, int, int]]:
    """``[(a, b, M), ...]``: the wide rule's block M over ``m in [lo, hi]`` as maximal runs
    of one choice (:func:`wide_block`; ``[]`` when ``lo > hi``)."""
    return policy_runs(lo, hi, topk, WIDE_SPAN * num_experts)


def _wide_lo(topk: int, num_experts: int, env: PlanEnv) -> int:
    """The fewest tokens a plan applies the wide rule at: :func:`wide_from_m`, and above
    the prefill threshold."""
    return max(wide_from_m(topk, num_experts), env.prefill_min_m + 1)


#: Pins the prefill route block M (one of ROUTE_BLOCK_SIZES); ``0`` disables the prefill plan.
ENV_PREFILL_BLOCK_M = "KQUANT_W4A16_PREFILL_BLOCK_M"
#: The prefill plan binds only for ``m`` strictly above this (default 256, must be >= 8).
ENV_PREFILL_MIN_M = "KQUANT_W4A16_PREFILL_MIN_M"
#: Default prefill threshold: above every CUDA-graph capture size we use.
DEFAULT_PREFILL_MIN_M = 256
#: The decode plan's route block size (also the narrowest size and the fallback floor).
DECODE_BLOCK_M = ROUTE_BLOCK_SIZES[0]

#: A geometry check: the reason the kernel rejects route block ``block_m`` (``None`` = ok), or
#: a full :class:`GeometryVerdict` carrying the measured numbers.
GeometryCheck = Callable[[int], Union[str, None, GeometryVerdict]]
#: The same question for work items of ``span`` route blocks: ``check(block_m, span)``.
SpanCheck = Callable[[int, int], Union[str, None, GeometryVerdict]]


@dataclass(frozen=True)
class PlanEnv:
    """The plan knobs read from the environment (see :func:`resolve_env`).

    Attributes:
        pinned_block_m: prefill M forced by ``KQUANT_W4A16_PREFILL_BLOCK_M``, else ``None``.
        prefill_disabled: ``True`` when that variable is ``0``: only the decode plan exists.
        prefill_min_m: the prefill plan binds only for ``m > prefill_min_m`` (>= 8).
    """

    pinned_block_m: Optional[int] = None
    prefill_disabled: bool = False
    prefill_min_m: int = DEFAULT_PREFILL_MIN_M

    def __post_init__(self) -> None:
        if self.pinned_block_m is not None and self.pinned_block_m not in ROUTE_BLOCK_SIZES:
            raise ValueError(
                f"pinned_block_m must be one of {ROUTE_BLOCK_SIZES} or None, got {self.pinned_block_m!r}"
            )
        if self.pinned_block_m is not None and self.prefill_disabled:
            raise ValueError("a pinned prefill block and a disabled prefill plan are exclusive")
        _check_int("prefill_min_m", self.prefill_min_m, minimum=DECODE_BLOCK_M)


def _parse_env_int(name: str, raw: str) -> int:
    text = raw.strip()
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def resolve_env(environ: Mapping[str, str] = os.environ) -> PlanEnv:
    """Read the plan knobs from ``environ`` (default: the process environment).

    * ``KQUANT_W4A16_PREFILL_BLOCK_M``: unset or empty -> policy choice; ``0`` -> no prefill
      plan; one of :data:`~planners.policy.ROUTE_BLOCK_SIZES` -> pinned prefill M.
    * ``KQUANT_W4A16_PREFILL_MIN_M``: unset or empty -> 256; otherwise an integer >= 8.

    Raises:
        ValueError: naming the variable, for a non-integer value, a block size outside
            ``{0} | ROUTE_BLOCK_SIZES``, or a threshold below 8.
    """
    pinned: Optional[int] = None
    disabled = False
    raw_block = environ.get(ENV_PREFILL_BLOCK_M, "")
    if raw_block.strip():
        value = _parse_env_int(ENV_PREFILL_BLOCK_M, raw_block)
        if value == 0:
            disabled = True
        elif value in ROUTE_BLOCK_SIZES:
            pinned = value
        else:
            allowed = ", ".join(str(s) for s in (0,) + ROUTE_BLOCK_SIZES)
            raise ValueError(
                f"{ENV_PREFILL_BLOCK_M}={raw_block!r} is not an allowed route block size; "
                f"use one of {allowed} (0 disables the prefill plan)"
            )

    min_m = DEFAULT_PREFILL_MIN_M
    raw_min = environ.get(ENV_PREFILL_MIN_M, "")
    if raw_min.strip():
        min_m = _parse_env_int(ENV_PREFILL_MIN_M, raw_min)
        if min_m < DECODE_BLOCK_M:
            raise ValueError(
                f"{ENV_PREFILL_MIN_M}={raw_min!r} is below {DECODE_BLOCK_M}: the prefill plan "
                f"must never bind for m <= {DECODE_BLOCK_M}"
            )
    return PlanEnv(pinned_block_m=pinned, prefill_disabled=disabled, prefill_min_m=min_m)


def _as_verdict(block_m: int, result: Union[str, None, GeometryVerdict],
                span: int = 0) -> GeometryVerdict:
    if isinstance(result, GeometryVerdict):
        if result.block_m != block_m or result.span not in (0, span):
            raise ValueError(
                f"geometry check for M={block_m} (span {span}) returned a verdict for "
                f"{result.label}"
            )
        return result if result.span == span else replace(result, span=span)
    if result is None:
        return GeometryVerdict(block_m=block_m, ok=True, span=span)
    if isinstance(result, str):
        if not result:
            raise ValueError(f"geometry check for M={block_m} returned an empty reason")
        return GeometryVerdict(block_m=block_m, ok=False, reason=result, span=span)
    raise TypeError(
        f"geometry check must return str | None | GeometryVerdict, got {type(result).__name__}"
    )


def choose_prefill_block(
    capacity: int,
    topk: int,
    num_experts: int,
    env: PlanEnv,
    check: GeometryCheck,
    fill_targets: tuple = (),
) -> tuple[Optional[int], list[GeometryVerdict]]:
    """Pick the prefill plan's route block M and record every geometry decision.

    The candidate is ``env.pinned_block_m`` if set, else
    ``select_route_block_size_m(capacity, topk, num_experts, fill_targets)``. ``check(M)`` is called for the
    candidate and, while it returns a reason, for each next narrower size of
    :data:`~planners.policy.ROUTE_BLOCK_SIZES` down to 8.

    A pinned M that the kernel rejects is *not* an error: it falls back the same way and the
    rejection is recorded (a pin is a preference for the widest block to try; a kernel that
    cannot run it must still serve). Callers that want to surface the pin's failure can look
    at ``decisions[0]``.

    Returns:
        ``(block_m, decisions)``: the first accepted size (``None`` if even 8 is rejected, or
        if ``env.prefill_disabled``, in which case ``check`` is never called) and the verdicts
        in the order they were made (rejections, then the accepted one).

    Raises:
        ValueError: for non-positive sizes, or a check returning a verdict for another M.
        TypeError: for a check returning something other than ``str | None | GeometryVerdict``.
        Any exception ``check`` raises propagates unchanged (e.g. a frozen compile cache's
        miss): only a returned reason means "this geometry does not fit".
    """
    _check_int("capacity", capacity, minimum=1)
    policy_m = select_route_block_size_m(capacity, topk, num_experts, fill_targets)  # validates
    if env.prefill_disabled:
        return None, []
    candidate = policy_m if env.pinned_block_m is None else env.pinned_block_m
    decisions: list[GeometryVerdict] = []
    for size in sorted((s for s in ROUTE_BLOCK_SIZES if s <= candidate), reverse=True):
        verdict = _as_verdict(size, check(size))
        decisions.append(verdict)
        if verdict.ok:
            return size, decisions
    return None, decisions


#: Why the planner asked the check about a size: the prefill fallback walk, the decode plan
#: (M=8, when the walk did not ask), a banded plan's size between the two, or the wide
#: rule's work items of WIDE_SPAN blocks.
Purpose = Literal["prefill", "decode", "band", "wide"]
#: What a plan uses a token band's M for.
BandRole = Literal["decode", "prefill", "band", "wide"]
#: What a plan uses a candidate for: a band role, or a rejected walk / band / wide candidate.
CandidateRole = Literal["decode", "prefill", "band", "wide", "fallback-rejected", "band-rejected",
                        "wide-rejected"]


def policy_runs(lo: int, hi: int, topk: int, num_experts: int,
                fill_targets: tuple = ()) -> list[tuple[int, int, int]]:
    """``[(a, b, M), ...]``: the route-size policy's choice over ``m in [lo, hi]`` (at
    ``fill_targets``), as maximal runs of one choice (the policy is monotone in ``m``, so each
    run is found by bisection)."""
    _check_int("lo", lo, minimum=1)
    out: list[tuple[int, int, int]] = []
    start = lo
    while start <= hi:
        size = select_route_block_size_m(start, topk, num_experts, fill_targets)
        a, b = start, hi  # the largest end in [start, hi] with the same choice
        while a < b:
            mid = (a + b + 1) // 2
            if select_route_block_size_m(mid, topk, num_experts, fill_targets) == size:
                a = mid
            else:
                b = mid - 1
        out.append((start, a, size))
        start = a + 1
    return out


@dataclass(frozen=True)
class TokenBand:
    """A maximal run of token counts ``m in [lo, hi]`` that binds one route block M.

    Attributes:
        lo, hi: the inclusive token range.
        block_m: the route block rows M every call in the band binds.
        role: ``"decode"`` (M=8), ``"prefill"`` (the prefill plan's M), ``"band"`` (a banded
            plan's size between the two) or ``"wide"`` (the wide rule's work items).
        route_slots: :func:`~planners.policy.padded_route_slots` of ``hi * topk`` routes at
            ``block_m``: the most packed routes a call in the band produces.
        max_blocks: ``route_slots // block_m``: the most route blocks of a call in the band
            (a call with ``m`` tokens launches :meth:`RoutePlan.max_blocks` of ``m``, at most this).
        span: 0 -- the specialization's own work item (its GEMM's default span); WIDE_SPAN
            -- the wide rule's items of that many route blocks (role ``"wide"``).
    """

    lo: int
    hi: int
    block_m: int
    role: BandRole
    route_slots: int
    max_blocks: int
    span: int = 0

    @classmethod
    def build(cls, lo: int, hi: int, block_m: int, role: BandRole, topk: int,
              num_experts: int, span: int = 0) -> "TokenBand":
        """The band ``[lo, hi]`` at ``block_m`` with its route bounds from the policy."""
        slots = padded_route_slots(hi * topk, num_experts, block_m)
        return cls(lo=lo, hi=hi, block_m=block_m, role=role, route_slots=slots,
                   max_blocks=slots // block_m, span=span)

    @property
    def key(self) -> tuple[int, int]:
        """``(block_m, span)``: the specialization the band binds."""
        return (self.block_m, self.span)

    def __post_init__(self) -> None:
        _check_int("lo", self.lo, minimum=1)
        _check_int("hi", self.hi, minimum=self.lo)
        if self.block_m not in ROUTE_BLOCK_SIZES:
            raise ValueError(f"TokenBand: block_m {self.block_m} not in {ROUTE_BLOCK_SIZES}")
        if self.role not in ("decode", "prefill", "band", "wide"):
            raise ValueError(f"TokenBand: unknown role {self.role!r}")
        if (self.role == "wide") != (self.span != 0) or self.span not in (0, WIDE_SPAN):
            raise ValueError(f"TokenBand: span {self.span!r} is the wide role's "
                             f"({WIDE_SPAN}), else 0")
        if (self.role == "decode") != (self.block_m == DECODE_BLOCK_M):
            raise ValueError(f"TokenBand: the decode role is exactly M={DECODE_BLOCK_M}")
        if self.max_blocks != self.route_slots // self.block_m:
            raise ValueError("TokenBand: max_blocks must be route_slots // block_m")


@dataclass(frozen=True)
class Candidate:
    """One route block size the planner asked the geometry check about, and the answer.

    The planner asks about each size at most once per plan (a failing compile is paid once),
    so when the fallback walk reached M=8 its answer is also the decode plan's.
    """

    verdict: GeometryVerdict
    purpose: Purpose

    @property
    def block_m(self) -> int:
        return self.verdict.block_m

    @property
    def span(self) -> int:
        return self.verdict.span

    @property
    def key(self) -> tuple[int, int]:
        return (self.verdict.block_m, self.verdict.span)

    @property
    def ok(self) -> bool:
        return self.verdict.ok


@dataclass(frozen=True)
class RoutePlan:
    """The whole route plan of one layer shape (built by :func:`plan_routes`).

    Attributes:
        capacity / topk / num_experts: the most tokens per call, routes per token, (local)
            experts the route pack spans.
        prefill_min_m: the prefill plan binds only for ``m > prefill_min_m``.
        prefill_m: the prefill plan's M, or ``None`` (disabled, every wider size rejected,
            the capacity not above the threshold, or the choice was M=8 itself).
        bands: the token bands, ascending, covering ``[1, capacity]``.
        candidates: every size the check was asked about, in the order asked: the fallback
            walk (widest first), then M=8 unless the walk asked, then a banded plan's sizes,
            then the wide rule's (block, WIDE_SPAN) items.
        notes: why the prefill plan is absent or how the plan was chosen.
        banded: the plan was asked for bands: when some size between M=8 and ``prefill_m`` is
            accepted, a call above the threshold binds the policy's M at its own ``m`` among
            those sizes and ``prefill_m`` (the next narrower one where the policy's is not
            among them, M=8 below the narrowest); otherwise (and without ``banded``) every
            such call binds ``prefill_m``. A banded plan asked with a span check also binds
            the wide rule from :func:`wide_from_m` tokens on, where its items are accepted.
        fill_targets: the policy's per-size fill targets the plan chose its sizes with (the
            fill rule, :data:`TABLE_FILL_TARGETS`), ``()`` for the policy's own.
    """

    capacity: int
    topk: int
    num_experts: int
    prefill_min_m: int
    prefill_m: Optional[int]
    bands: tuple[TokenBand, ...]
    candidates: tuple[Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    banded: bool = False
    fill_targets: tuple = ()

    def __post_init__(self) -> None:
        _check_int("capacity", self.capacity, minimum=1)
        if self.fill_targets:
            check_fill_targets(self.fill_targets)
        _check_int("prefill_min_m", self.prefill_min_m, minimum=DECODE_BLOCK_M)
        if self.prefill_m is not None and self.prefill_m not in ROUTE_BLOCK_SIZES[1:]:
            raise ValueError(f"prefill_m must be one of {ROUTE_BLOCK_SIZES[1:]} or None, "
                             f"got {self.prefill_m!r}")
        if self.prefill_m is not None and self.capacity <= self.prefill_min_m:
            raise ValueError(f"a prefill plan at capacity {self.capacity} <= threshold "
                             f"{self.prefill_min_m} could never bind")
        if not self.bands or self.bands[0].lo != 1 or self.bands[-1].hi != self.capacity:
            raise ValueError(f"RoutePlan: the bands must cover [1, {self.capacity}]")
        for a, b in zip(self.bands, self.bands[1:]):
            if b.lo != a.hi + 1 or b.key == a.key:
                raise ValueError("RoutePlan: bands must be contiguous runs of distinct M")
        sizes = self.block_sizes
        for band in self.bands:
            if band != TokenBand.build(band.lo, band.hi, band.block_m, band.role, self.topk,
                                       self.num_experts, band.span):
                raise ValueError("RoutePlan: a band's route bounds disagree with the policy; "
                                 "use TokenBand.build")
            if band.span:
                v = self.verdict(band.block_m, band.span)
                if v is None or not v.ok or not self.banded:
                    raise ValueError(f"RoutePlan: a wide band binds an accepted wide candidate "
                                     f"of a banded plan, not M={band.block_m} x {band.span}")
            elif band.block_m not in sizes:
                raise ValueError(f"RoutePlan: band M={band.block_m} is no specialization of the plan")
            if (band.role == "prefill") != (band.block_m == self.prefill_m and not band.span):
                raise ValueError(f"RoutePlan: the prefill role is exactly M={self.prefill_m}")
            if band.lo <= self.prefill_min_m and band.block_m != DECODE_BLOCK_M:
                raise ValueError(f"RoutePlan: m <= {self.prefill_min_m} must bind M={DECODE_BLOCK_M}")
        if len({c.key for c in self.candidates}) != len(self.candidates):
            raise ValueError("RoutePlan: each size is a candidate at most once")

    # -- what the plan compiles -------------------------------------------------------------
    def verdict(self, block_m: int, span: int = 0) -> Optional[GeometryVerdict]:
        """The check's answer for ``block_m`` (``span``: a wide candidate's), or ``None`` if
        it was never asked."""
        return next((c.verdict for c in self.candidates if c.key == (block_m, span)), None)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The plan's specializations, ascending: M=8, the prefill M and (banded) every
        accepted size between them."""
        sizes = {DECODE_BLOCK_M}
        if self.prefill_m is not None:
            sizes.add(self.prefill_m)
            if self.banded:
                sizes |= {c.block_m for c in self.candidates
                          if c.ok and not c.span and DECODE_BLOCK_M < c.block_m < self.prefill_m}
        return tuple(sorted(sizes))

    @property
    def wide_keys(self) -> tuple[tuple[int, int], ...]:
        """The wide rule's specializations the bands bind, ``(block_m, span)``, ascending
        (compiled beside :attr:`block_sizes`)."""
        return tuple(sorted({b.key for b in self.bands if b.span}))

    @property
    def error(self) -> Optional[str]:
        """Why the plan cannot be bound (the decode geometry was rejected), else ``None``."""
        v = self.verdict(DECODE_BLOCK_M)
        if v is not None and not v.ok:
            return f"the decode specialization is not implementable: {v.reason}"
        return None

    def role(self, block_m: int, span: int = 0) -> CandidateRole:
        """What the plan uses candidate ``block_m`` (``span``: a wide one) for: ``"decode"``
        (M=8, accepted or not), ``"prefill"``, ``"band"``, ``"wide"``, or a rejected
        ``"fallback-rejected"`` / ``"band-rejected"`` / ``"wide-rejected"``."""
        if block_m == DECODE_BLOCK_M and not span:
            return "decode"
        c = next((c for c in self.candidates if c.key == (block_m, span)), None)
        if c is None:
            raise ValueError(f"M={block_m} (span {span}) is no candidate of this plan")
        if c.purpose in ("band", "wide"):
            return c.purpose if c.ok else f"{c.purpose}-rejected"  # type: ignore[return-value]
        return "prefill" if c.ok else "fallback-rejected"

    # -- what a call binds ------------------------------------------------------------------
    def band_for(self, m: int) -> TokenBand:
        """The band a call with ``m`` tokens binds (its M is the specialization to launch).

        Raises:
            ValueError: if ``m`` is not a positive int or exceeds the planned capacity.
        """
        _check_int("m", m, minimum=1)
        if m > self.capacity:
            raise ValueError(f"m={m} exceeds the planned capacity of {self.capacity} tokens")
        return next(b for b in self.bands if m <= b.hi)

    def max_blocks(self, m: int) -> int:
        """The route-block bound of a call with ``m`` tokens at the M it binds: the grid of
        that launch (:func:`~planners.policy.max_route_blocks` of ``m * topk`` routes)."""
        return max_route_blocks(m * self.topk, self.num_experts, self.band_for(m).block_m)

    @property
    def route_slots(self) -> int:
        """The packed-route bound over every band: the one scratch arena's route list serves
        every call (the bound grows with both ``m`` and M, so the widest band at the
        capacity sets it)."""
        return max(b.route_slots for b in self.bands)

    def describe(self, scratch_bytes: Optional[Mapping[str, int]] = None) -> str:
        """A readable multi-line summary of the plan.

        One line per token band with its M and route bounds, the route-size policy's own
        choices over that band (for information), the rejected and the accepted geometries,
        the notes, and -- given ``scratch_bytes`` (e.g. ``{"arena": ..., "output": ...}``) --
        the shared scratch arena size (the largest entry).
        """
        lines = [
            f"W4A16 MoE plans: capacity {self.capacity:,} tokens, top-{self.topk}, "
            f"{self.num_experts:,} experts, prefill threshold m > {self.prefill_min_m:,}"
        ]
        for band in self.bands:
            policy = ", ".join(f"M={size} for m in [{a:,}, {b:,}]" for a, b, size
                               in policy_runs(band.lo, band.hi, self.topk, self.num_experts,
                                              self.fill_targets))
            lines.append(f"  m in [{band.lo:,}, {band.hi:,}]: {band.role} M={band.block_m}"
                         f"{f' x {band.span} route blocks per work item' if band.span else ''} "
                         f"({band.route_slots:,} route slots, {band.max_blocks:,} blocks)")
            lines.append(f"    policy alone would pick: {policy}")
        rejected = [c for c in self.candidates if not c.ok]
        if rejected:
            lines.append("  rejected geometries:")
            lines.extend(f"    {c.verdict.summary()}" for c in rejected)
        lines.extend(f"  accepted geometry: {c.verdict.summary()}" for c in self.candidates if c.ok)
        lines.extend(f"  note: {n}" for n in self.notes)
        if scratch_bytes:
            parts = ", ".join(f"{k} {v:,} B" for k, v in scratch_bytes.items())
            lines.append(f"  scratch: one shared arena of {max(scratch_bytes.values()):,} B ({parts})")
        return "\n".join(lines)


def candidate_bound(capacity: int, topk: int, num_experts: int, env: PlanEnv, *,
                    wide: bool = False, fill_targets: tuple = ()) -> int:
    """Upper bound on the sizes :func:`plan_routes` asks the check about (progress bars).

    Every size asked is at most the prefill candidate (the pin, else the policy's choice at
    ``capacity``): the walk goes down from it, a banded plan asks the sizes below the accepted
    one, and M=8 is the floor; with ``wide`` (a plan with a span check) the wide rule asks
    each block it picks between :func:`wide_from_m` and ``capacity`` once.
    Just M=8 when no prefill plan is possible.
    """
    _check_int("capacity", capacity, minimum=1)
    if env.prefill_disabled or capacity <= env.prefill_min_m:
        return 1
    top = env.pinned_block_m or select_route_block_size_m(capacity, topk, num_experts,
                                                          fill_targets)
    count = sum(1 for s in ROUTE_BLOCK_SIZES if s <= top)
    if wide and env.pinned_block_m is None:
        count += len(wide_runs(_wide_lo(topk, num_experts, env), capacity, topk, num_experts))
    return count


def plan_routes(
    capacity: int,
    topk: int,
    num_experts: int,
    env: PlanEnv,
    check: GeometryCheck,
    *,
    banded: bool = True,
    span_check: Optional[SpanCheck] = None,
    fill_targets: tuple = (),
) -> RoutePlan:
    """Plan the route block M of every call with up to ``capacity`` tokens.

    The decode plan is M=8 for ``m <= env.prefill_min_m`` (and for every ``m`` without a
    prefill plan). The prefill plan's M is chosen by :func:`choose_prefill_block` unless the
    capacity does not exceed ``env.prefill_min_m`` (it could never bind). It is dropped, with a
    note, when disabled, when every size is rejected, or when the choice is M=8 (it would be
    the decode plan again). Then ``check`` is asked about M=8 (the decode plan; a rejection is
    the plan's :attr:`~RoutePlan.error`), and with ``banded`` about each size between M=8 and
    the prefill M, ascending (see :attr:`RoutePlan.banded` for how the bands then bind).
    ``check`` is called at most once per size. ``banded`` is the default plan (a call binds
    about the M its own m needs, not the capacity's); ``banded=False`` is the decode / prefill pair.
    A pinned prefill M (``env.pinned_block_m``) binds every call above the threshold: no bands.
    With ``span_check`` a banded plan also applies the wide rule: a call of at least
    :func:`wide_from_m` tokens (and above the threshold) binds :func:`wide_block` x
    :data:`WIDE_SPAN` where ``span_check(block, WIDE_SPAN)`` accepts it (blocks up to the
    prefill M), else its band's M as without the rule. ``fill_targets`` (the fill rule,
    :data:`TABLE_FILL_TARGETS`) replace the policy's for the prefill M and the bands;
    the wide rule keeps the policy's.

    Raises:
        ValueError / TypeError: as :func:`choose_prefill_block`; any exception ``check``
            raises propagates unchanged (a frozen compile cache's miss is never a rejection).
    """
    _check_int("capacity", capacity, minimum=1)
    fill_targets = check_fill_targets(fill_targets) if fill_targets else ()
    select_route_block_size_m(capacity, topk, num_experts, fill_targets)  # validate the rest
    asked: dict[tuple[int, int], Candidate] = {}

    def asking(purpose: Purpose, span: int = 0) -> Callable[[int], GeometryVerdict]:
        def ask(block_m: int) -> GeometryVerdict:
            if (block_m, span) not in asked:
                result = span_check(block_m, span) if span else check(block_m)
                asked[block_m, span] = Candidate(_as_verdict(block_m, result, span), purpose)
            return asked[block_m, span].verdict
        return ask

    notes: list[str] = []
    if fill_targets:
        rule = ", ".join(f"M={s} at {t:g}" for s, t in fill_targets)
        notes.append(f"fill rule: the next wider block once a block is this full on average: "
                     f"{rule} (the policy's {FILL_TARGET:g} elsewhere): this layer's decode "
                     "costs most per work item")
    prefill_m: Optional[int] = None
    if env.prefill_disabled:
        notes.append(f"prefill plan disabled by {ENV_PREFILL_BLOCK_M}=0")
    elif capacity <= env.prefill_min_m:
        notes.append(f"no prefill plan: capacity {capacity:,} <= threshold {env.prefill_min_m:,}")
    else:
        prefill_m, _ = choose_prefill_block(capacity, topk, num_experts, env, asking("prefill"),
                                            fill_targets)
        if env.pinned_block_m is not None:
            notes.append(f"prefill M pinned to {env.pinned_block_m} by {ENV_PREFILL_BLOCK_M}")
        if prefill_m is None:
            notes.append("no prefill plan: every route block size was rejected")
        elif prefill_m == DECODE_BLOCK_M:
            notes.append(f"no prefill plan: its M={prefill_m} equals the decode plan's")
            prefill_m = None
    asking("decode")(DECODE_BLOCK_M)

    if banded and env.pinned_block_m is not None:
        banded = False  # the pin's meaning: every call above the threshold binds that M
        notes.append(f"not banded: {ENV_PREFILL_BLOCK_M} pins every call above the threshold")
    between: list[int] = []
    if banded and prefill_m is not None:
        ask = asking("band")
        between = [s for s in ROUTE_BLOCK_SIZES if DECODE_BLOCK_M < s < prefill_m and ask(s).ok]
        if between:
            notes.append(f"banded: above the threshold a call binds the policy's M at its own m "
                         f"among {between + [prefill_m]} (the next narrower one where the "
                         f"policy's is not among them, M={DECODE_BLOCK_M} below the narrowest)")
        else:  # nothing to band with: the pair's binding
            notes.append(f"banded: no accepted size between M={DECODE_BLOCK_M} and "
                         f"M={prefill_m}: every call above the threshold binds M={prefill_m}")
    runs = [(1, capacity if prefill_m is None else env.prefill_min_m, DECODE_BLOCK_M, 0)]
    if prefill_m is not None and not between:
        runs.append((env.prefill_min_m + 1, capacity, prefill_m, 0))
    elif prefill_m is not None:
        sizes = between + [prefill_m]
        for a, b, want in policy_runs(env.prefill_min_m + 1, capacity, topk, num_experts,
                                      fill_targets):
            runs.append((a, b, max((s for s in sizes if s <= want), default=DECODE_BLOCK_M), 0))
    wide_lo = _wide_lo(topk, num_experts, env)
    if banded and prefill_m is not None and span_check is not None and capacity >= wide_lo:
        wide = wide_runs(wide_lo, capacity, topk, num_experts)
        ask_wide = asking("wide", WIDE_SPAN)
        split: list[tuple[int, int, int, int]] = []
        for a, b, size, span in runs:
            if b < wide_lo:
                split.append((a, b, size, span))
                continue
            if a < wide_lo:
                split.append((a, wide_lo - 1, size, span))
            for c, d, block in wide:
                lo, hi = max(a, c), min(b, d)
                if lo > hi:
                    continue
                if block <= prefill_m and ask_wide(block).ok:
                    split.append((lo, hi, block, WIDE_SPAN))
                else:  # not accepted: the band's own binding at these m
                    split.append((lo, hi, size, span))
        runs = split
        notes.append(f"wide: from m = {wide_lo:,} (the average expert's routed rows fill "
                     f"M={WIDE_FROM_ROWS}) a call binds work items of {WIDE_SPAN} route blocks "
                     "of the policy's M for half the rows, where accepted")
    merged: list[tuple[int, int, int, int]] = []
    for a, b, size, span in runs:
        if merged and merged[-1][2:] == (size, span):
            merged[-1] = (merged[-1][0], b, size, span)
        else:
            merged.append((a, b, size, span))

    def role(size: int, span: int) -> BandRole:
        if span:
            return "wide"
        return "decode" if size == DECODE_BLOCK_M else "prefill" if size == prefill_m else "band"

    return RoutePlan(
        capacity=capacity,
        topk=topk,
        num_experts=num_experts,
        prefill_min_m=env.prefill_min_m,
        prefill_m=prefill_m,
        bands=tuple(TokenBand.build(a, b, size, role(size, span), topk, num_experts, span)
                    for a, b, size, span in merged),
        candidates=tuple(asked.values()),
        notes=tuple(notes),
        banded=banded,
        fill_targets=fill_targets,
    )

"""Decode / prefill plan-pair layout: env knobs, prefill block choice with geometry fallback.

This module owns the decision logic of BRIEF section 4 ("the seed's plan"), independent of
the kernel, which is injected as a ``check(block_m) -> reason | None`` callable:

* :func:`resolve_env` reads ``KQUANT_W4A16_PREFILL_BLOCK_M`` (pin the prefill M; ``0``
  disables the prefill plan) and ``KQUANT_W4A16_PREFILL_MIN_M`` (the prefill plan binds only
  for ``m`` above it; default 256, at least 8) into a frozen :class:`PlanEnv`.
* :func:`choose_prefill_block` picks the prefill route block M: the pinned one, else the
  policy's choice at the planned capacity; a geometry the kernel rejects falls back to the
  next narrower size, every rejection recorded as a :class:`GeometryVerdict`.
* :class:`PlanLayout` / :class:`PlanPairLayout` (built by :func:`plan_pair_layout`) describe
  the two plans -- the decode plan at M=8 and the optional prefill plan -- their route-slot
  sizing, which one binds for a given ``m`` and a readable :meth:`PlanPairLayout.describe`.

Both plans share one scratch arena sized to the larger and one fp32 output buffer (that
sizing belongs to the kernel module; ``describe`` only reports it).

Pure Python; no torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

from .geometry import GeometryVerdict
from .policy import (
    ROUTE_BLOCK_SIZES,
    _check_int,
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
    "PlanLayout",
    "PlanPairLayout",
    "plan_pair_layout",
]

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


def _as_verdict(block_m: int, result: Union[str, None, GeometryVerdict]) -> GeometryVerdict:
    if isinstance(result, GeometryVerdict):
        if result.block_m != block_m:
            raise ValueError(
                f"geometry check for M={block_m} returned a verdict for M={result.block_m}"
            )
        return result
    if result is None:
        return GeometryVerdict(block_m=block_m, ok=True)
    if isinstance(result, str):
        if not result:
            raise ValueError(f"geometry check for M={block_m} returned an empty reason")
        return GeometryVerdict(block_m=block_m, ok=False, reason=result)
    raise TypeError(
        f"geometry check must return str | None | GeometryVerdict, got {type(result).__name__}"
    )


def choose_prefill_block(
    capacity: int,
    topk: int,
    num_experts: int,
    env: PlanEnv,
    check: GeometryCheck,
) -> tuple[Optional[int], list[GeometryVerdict]]:
    """Pick the prefill plan's route block M and record every geometry decision.

    The candidate is ``env.pinned_block_m`` if set, else
    ``select_route_block_size_m(capacity, topk, num_experts)``. ``check(M)`` is called for the
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
    if env.prefill_disabled:
        select_route_block_size_m(capacity, topk, num_experts)  # validate the other arguments
        return None, []
    candidate = env.pinned_block_m
    if candidate is None:
        candidate = select_route_block_size_m(capacity, topk, num_experts)
    else:
        select_route_block_size_m(capacity, topk, num_experts)  # validate the other arguments
    decisions: list[GeometryVerdict] = []
    for size in sorted((s for s in ROUTE_BLOCK_SIZES if s <= candidate), reverse=True):
        verdict = _as_verdict(size, check(size))
        decisions.append(verdict)
        if verdict.ok:
            return size, decisions
    return None, decisions


@dataclass(frozen=True)
class PlanLayout:
    """One plan: a route block size and the route-pack sizing for the tokens it serves.

    Attributes:
        block_m: route block rows M.
        capacity: the most tokens one launch of this plan serves.
        topk: routes per token.
        num_experts: (local) experts the route pack spans.
        route_slots: :func:`~planners.policy.padded_route_slots` of ``capacity * topk``.
        num_blocks: ``route_slots // block_m``, a bound on the non-empty route blocks.
    """

    block_m: int
    capacity: int
    topk: int
    num_experts: int
    route_slots: int
    num_blocks: int

    @classmethod
    def build(cls, block_m: int, capacity: int, topk: int, num_experts: int) -> "PlanLayout":
        """Size a plan for ``capacity`` tokens at route block ``block_m``."""
        _check_int("block_m", block_m, minimum=1)
        _check_int("capacity", capacity, minimum=1)
        _check_int("topk", topk, minimum=1)
        slots = padded_route_slots(capacity * topk, num_experts, block_m)
        return cls(
            block_m=block_m,
            capacity=capacity,
            topk=topk,
            num_experts=num_experts,
            route_slots=slots,
            num_blocks=slots // block_m,
        )

    def __post_init__(self) -> None:
        expected = padded_route_slots(self.capacity * self.topk, self.num_experts, self.block_m)
        if self.route_slots != expected or self.num_blocks != expected // self.block_m:
            raise ValueError(
                "PlanLayout: route_slots / num_blocks disagree with the policy; use PlanLayout.build"
            )


@dataclass(frozen=True)
class PlanPairLayout:
    """The decode plan (M=8) and the optional prefill plan, and when each binds.

    Attributes:
        decode: the M=8 plan; serves ``m <= prefill_min_m`` (every ``m`` without a prefill).
        prefill: the wide plan, or ``None`` (disabled, every size rejected, redundant, or the
            capacity does not exceed the threshold).
        prefill_min_m: the prefill plan binds only for ``m > prefill_min_m``.
        decisions: geometry verdicts of the prefill choice, in order.
        notes: why the prefill plan is absent or how it was chosen, for :meth:`describe`.
    """

    decode: PlanLayout
    prefill: Optional[PlanLayout]
    prefill_min_m: int
    decisions: tuple[GeometryVerdict, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_int("prefill_min_m", self.prefill_min_m, minimum=DECODE_BLOCK_M)
        if self.decode.block_m != DECODE_BLOCK_M:
            raise ValueError(f"the decode plan must use M={DECODE_BLOCK_M}, got {self.decode.block_m}")
        if self.prefill is not None:
            if (self.prefill.topk, self.prefill.num_experts) != (self.decode.topk, self.decode.num_experts):
                raise ValueError("decode and prefill plans must share topk and num_experts")
            if self.prefill.capacity <= self.prefill_min_m:
                raise ValueError(
                    f"prefill capacity {self.prefill.capacity} <= threshold {self.prefill_min_m}: "
                    "it could never bind"
                )
            if self.decode.capacity < self.prefill_min_m:
                raise ValueError(
                    f"decode capacity {self.decode.capacity} < threshold {self.prefill_min_m}: "
                    "tokens in between would have no plan"
                )

    @property
    def capacity(self) -> int:
        """The most tokens the pair serves."""
        return self.prefill.capacity if self.prefill is not None else self.decode.capacity

    @property
    def topk(self) -> int:
        """Routes per token."""
        return self.decode.topk

    @property
    def num_experts(self) -> int:
        """(Local) experts the route packs span."""
        return self.decode.num_experts

    def binds_prefill(self, m: int) -> bool:
        """``True`` iff a prefill plan exists and ``m > prefill_min_m`` and ``m > 8``."""
        return self.prefill is not None and m > self.prefill_min_m and m > DECODE_BLOCK_M

    def plan_for(self, m: int) -> PlanLayout:
        """The plan a call with ``m`` tokens binds.

        Raises:
            ValueError: if ``m`` is not a positive int or exceeds the planned capacity.
        """
        _check_int("m", m, minimum=1)
        if m > self.capacity:
            raise ValueError(f"m={m} exceeds the planned capacity of {self.capacity} tokens")
        return self.prefill if self.binds_prefill(m) else self.decode  # type: ignore[return-value]

    def bands(self) -> list[tuple[int, int, PlanLayout]]:
        """``[(lo, hi, plan), ...]``: inclusive token bands and the plan bound on each."""
        cap = self.capacity
        if self.prefill is None:
            return [(1, cap, self.decode)]
        return [(1, self.prefill_min_m, self.decode), (self.prefill_min_m + 1, cap, self.prefill)]

    def _policy_bands(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``[(lo, hi, M)]``: where the route-size policy would switch M within ``[lo, hi]``."""
        out: list[tuple[int, int, int]] = []
        start = lo
        while start <= hi:
            size = select_route_block_size_m(start, self.topk, self.num_experts)
            # Largest end in [start, hi] with the same choice (the policy is monotone in m).
            a, b = start, hi
            while a < b:
                mid = (a + b + 1) // 2
                if select_route_block_size_m(mid, self.topk, self.num_experts) == size:
                    a = mid
                else:
                    b = mid - 1
            out.append((start, a, size))
            start = a + 1
        return out

    def describe(self, scratch_bytes: Optional[Mapping[str, int]] = None) -> str:
        """A readable multi-line summary of the plan pair.

        One line per token band with the bound plan, the route-size policy's own choices over
        that band (for information), the rejected geometries with their reasons, any notes, and
        -- given ``scratch_bytes`` (e.g. ``{"decode": ..., "prefill": ...}``) -- the shared scratch
        arena size (the largest entry).
        """
        lines = [
            f"W4A16 MoE plans: capacity {self.capacity:,} tokens, top-{self.topk}, "
            f"{self.num_experts:,} experts, prefill threshold m > {self.prefill_min_m:,}"
        ]
        for lo, hi, plan in self.bands():
            kind = "prefill" if plan is self.prefill and plan is not None else "decode"
            policy = ", ".join(
                f"M={size} for m in [{a:,}, {b:,}]" for a, b, size in self._policy_bands(lo, hi)
            )
            lines.append(
                f"  m in [{lo:,}, {hi:,}]: {kind} M={plan.block_m} "
                f"({plan.route_slots:,} route slots, {plan.num_blocks:,} blocks)"
            )
            lines.append(f"    policy alone would pick: {policy}")
        rejected = [v for v in self.decisions if not v.ok]
        if rejected:
            lines.append("  rejected geometries:")
            lines.extend(f"    {v.summary()}" for v in rejected)
        accepted = [v for v in self.decisions if v.ok]
        if accepted:
            lines.append(f"  accepted geometry: {accepted[-1].summary()}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if scratch_bytes:
            parts = ", ".join(f"{k} {v:,} B" for k, v in scratch_bytes.items())
            lines.append(f"  scratch: one shared arena of {max(scratch_bytes.values()):,} B ({parts})")
        return "\n".join(lines)


def plan_pair_layout(
    capacity: int,
    topk: int,
    num_experts: int,
    env: PlanEnv,
    check: GeometryCheck,
) -> PlanPairLayout:
    """Lay out the decode / prefill plan pair for up to ``capacity`` tokens.

    The decode plan always exists at M=8 (its geometry is the kernel's to validate at
    compile time; ``check`` is only consulted for the prefill choice). The prefill plan is
    chosen by :func:`choose_prefill_block` unless the capacity does not exceed
    ``env.prefill_min_m`` (it could never bind; ``check`` is not called). It is dropped, with a
    note, when disabled, when every size is rejected, or when the choice is M=8 (it would be
    the decode plan again). With a prefill plan the decode plan's capacity is
    ``env.prefill_min_m``; without one it is ``capacity``.
    """
    _check_int("capacity", capacity, minimum=1)
    select_route_block_size_m(capacity, topk, num_experts)  # validate topk / num_experts
    notes: list[str] = []
    decisions: list[GeometryVerdict] = []
    prefill_m: Optional[int] = None
    if env.prefill_disabled:
        notes.append(f"prefill plan disabled by {ENV_PREFILL_BLOCK_M}=0")
    elif capacity <= env.prefill_min_m:
        notes.append(
            f"no prefill plan: capacity {capacity:,} <= threshold {env.prefill_min_m:,}"
        )
    else:
        prefill_m, decisions = choose_prefill_block(capacity, topk, num_experts, env, check)
        if env.pinned_block_m is not None:
            notes.append(f"prefill M pinned to {env.pinned_block_m} by {ENV_PREFILL_BLOCK_M}")
        if prefill_m is None:
            notes.append("no prefill plan: every route block size was rejected")
        elif prefill_m == DECODE_BLOCK_M:
            notes.append(f"no prefill plan: its M={prefill_m} equals the decode plan's")
            prefill_m = None

    if prefill_m is None:
        decode = PlanLayout.build(DECODE_BLOCK_M, capacity, topk, num_experts)
        prefill = None
    else:
        decode = PlanLayout.build(DECODE_BLOCK_M, env.prefill_min_m, topk, num_experts)
        prefill = PlanLayout.build(prefill_m, capacity, topk, num_experts)
    return PlanPairLayout(
        decode=decode,
        prefill=prefill,
        prefill_min_m=env.prefill_min_m,
        decisions=tuple(decisions),
        notes=tuple(notes),
    )

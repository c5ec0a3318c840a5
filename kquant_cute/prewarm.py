"""Prewarm the compile cache: compile every specialization the planner would bind, per arch.

This module owns the "what to compile ahead of time" question and its report, nothing
else: per target arch it runs the planner itself (:func:`kquant_cute.compiler.compile_plan`:
``planners.plan_routes`` with ``geometry_check`` as the predicate) and formats what it
decided -- every candidate with its role and verdict -- together with the compile cache's
answer to each request the planning made (built now, served from disk or memory, or
failed; seconds), read from the cache's own :class:`~kquant_cute.compile_cache.CacheResult`
objects. It re-implements neither the route-size policy, the fallback walk nor the
validity predicate.

- :data:`DEFAULT_GEOMETRY`: the reference geometry, one TP8 shard of Kimi-K3 (E=896,
  H=3584, I=384, top-16, K=4, MCG, bf16 in, fp32 out, SiTU, shared hidden-side vectors).
- :func:`prewarm`: a flat list of :class:`PrewarmRecord`.
- :func:`prewarm_plans`: the same per arch, with the plan (for ``describe()``).

The planner asks about each size at most once per plan, so a failing specialization is
compiled once per run. Works on a machine with no GPU (cross-compiles for each arch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

from .compile_cache import CompileCache, CompileCacheMiss, default_cache
from .compiler import (CacheOutcome, ForwardPlan, candidate_spec, compile_plan,
                       geometry_check_outcome, plan_fill_targets, plans_wide,
                       spec_route_plan)
from .defaults import DEFAULT_CAPACITY, REFERENCE_LAYER
from .kernels.moe import MoESpec
from .planners import (DECODE_BLOCK_M, GeometryVerdict, PlanEnv, candidate_bound, default_banded,
                        normalize_arch, resolve_env)
from .planners.plans import CandidateRole

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_GEOMETRY",
    "ArchPrewarm",
    "error_text",
    "PrewarmEvent",
    "PrewarmRecord",
    "needed_failures",
    "prewarm",
    "prewarm_plans",
]

#: The reference geometry (:data:`kquant_cute.defaults.REFERENCE_LAYER`, one TP8 shard of
#: Kimi-K3); ``block_m`` / ``arch`` are replaced per planned specialization.
DEFAULT_GEOMETRY = MoESpec(**REFERENCE_LAYER, block_m=DECODE_BLOCK_M, arch="sm_90a")

#: What the plan uses the specialization for (``planners.RoutePlan.role``).
Role = CandidateRole
Status = Literal["compiled", "cached", "rejected", "failed"]
#: How the cache answered: built now, read from disk, already in this process, or None
#: (never asked: a static rejection, or the build raised).
CacheAnswer = Optional[Literal["compiled", "disk", "memory"]]


@dataclass(frozen=True)
class PrewarmRecord:
    """One specialization the planner evaluated for one arch.

    ``role``: ``"decode"`` (M=8), ``"prefill"``, ``"band"`` (a banded plan's size), ``"wide"``
    (the wide rule's work items of ``span`` route blocks), or a rejected
    ``"fallback-rejected"`` (the prefill walk's) / ``"band-rejected"`` / ``"wide-rejected"``
    candidate.
    ``status``: ``"compiled"`` (built in this run), ``"cached"`` (served by the cache),
    ``"rejected"`` (the geometry check said no: static reason or measured resources; it may
    still have been compiled to measure them, see ``cache``) or ``"failed"`` (the build
    raised, or a frozen cache misses it). ``reason`` is None for usable ones.
    ``registers`` / ``shared_bytes`` / ``spill_bytes`` are the measured maxima over the
    object's kernels (None when never compiled or not measured). ``seconds`` is the wall
    time of the cache call (build + write + load, or load) in this run.
    """

    arch: str
    block_m: int
    role: Role
    status: Status
    reason: Optional[str] = None
    registers: Optional[int] = None
    shared_bytes: Optional[int] = None
    spill_bytes: Optional[int] = None
    seconds: float = 0.0
    cache: CacheAnswer = None
    key: Optional[str] = None
    kernel: str = ""
    #: The GEMM of the specialization: "wgmma" or "sync", and route blocks per work item.
    mma: str = ""
    span: int = 0
    #: False when the object's registers / spills could not be read (no cuobjdump): the
    #: geometry was accepted unmeasured. None when never compiled.
    measured: Optional[bool] = None

    @property
    def needed(self) -> bool:
        """True for a specialization a plan binds (decode, or the chosen prefill)."""
        return self.role in ("decode", "prefill")

    @property
    def ok(self) -> bool:
        """True when the specialization is usable (compiled now or cached)."""
        return self.status in ("compiled", "cached")

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict of the fields."""
        return asdict(self)


@dataclass(frozen=True)
class PrewarmEvent:
    """A progress notification: a cache call for one specialization starts or ends.

    ``index`` counts cache calls started in this run (1-based); ``bound`` is an upper bound
    on how many there will be (``planners.candidate_bound``: the fallback walk stops at the
    first accepted size, so the real count can be lower). ``answer`` (``kind == "done"``)
    is ``"compiled"``, ``"disk"``, ``"memory"`` or ``"failed"``.
    """

    kind: Literal["start", "done"]
    arch: str
    block_m: int
    index: int
    bound: int
    elapsed: float
    answer: Optional[str] = None
    seconds: float = 0.0
    error: Optional[str] = None
    #: Seconds the cache call waited for another process building the same entry.
    waited: float = 0.0


ProgressFn = Callable[[PrewarmEvent], None]


@dataclass
class ArchPrewarm:
    """What prewarming one arch produced: the planner's plan and one record per candidate.

    ``plan`` is None only when planning itself raised before a plan existed (a frozen
    cache's miss); ``error`` holds the reason the plans cannot be bound (e.g. the decode
    specialization was rejected).
    """

    arch: str
    plan: Optional[ForwardPlan]
    records: list[PrewarmRecord] = field(default_factory=list)
    error: Optional[str] = None

    def describe(self) -> str:
        """The planner's ``describe()`` text (or the error), headed by the arch."""
        head = f"[{self.arch}]"
        if self.plan is None:
            return f"{head} no plan: {self.error}"
        text = f"{head} {self.plan.describe()}"
        if self.error:
            text += f"\n  error: {self.error}"
        return text


def error_text(exc: BaseException, limit: int = 300) -> str:
    """A one-line reason for a failed build: the exception type and its first line.

    A :class:`CompileCacheMiss` (frozen cache, or a CUDA graph capture) is shortened to
    its reason and key prefix; the full text is in the exception.
    """
    if isinstance(exc, CompileCacheMiss):
        return f"CompileCacheMiss: not in the cache and compiling is off ({exc.reason}; key {exc.key[:16]})"
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Counter:
    """Numbers the cache calls of one prewarm run and forwards progress events."""

    def __init__(self, progress: Optional[ProgressFn], bound: int) -> None:
        self._progress = progress
        self.bound = bound
        self.index = 0
        self._t0 = time.perf_counter()

    def _emit(self, event: PrewarmEvent) -> None:
        if self._progress is not None:
            self._progress(event)

    def start(self, arch: str, block_m: int) -> int:
        self.index += 1
        self.bound = max(self.bound, self.index)
        self._emit(PrewarmEvent("start", arch, block_m, self.index, self.bound,
                                time.perf_counter() - self._t0))
        return self.index

    def done(self, arch: str, block_m: int, index: int, answer: str, seconds: float,
             error: Optional[str], waited: float = 0.0) -> None:
        self._emit(PrewarmEvent("done", arch, block_m, index, self.bound,
                                time.perf_counter() - self._t0, answer, seconds, error, waited))


def _record(arch: str, plan: ForwardPlan, block_m: int, span: int = 0) -> PrewarmRecord:
    """The report of candidate ``(block_m, span)``: the planner's verdict and role, and the
    cache's outcome of the request that planning made for it (None: never asked, a static
    reject)."""
    verdict = plan.route.verdict(block_m, span)
    outcome: Optional[CacheOutcome] = (plan.wide_outcomes.get((block_m, span)) if span
                                       else plan.outcomes.get(block_m))
    result = outcome.result if outcome is not None else None
    extra = dict(result.meta.get("extra") or {}) if result is not None else {}
    spec = candidate_spec(plan.base, block_m, span)
    status: Status
    reason = verdict.reason
    if outcome is not None and outcome.error is not None:
        status = "failed"
        # geometry_check's reason embeds the whole exception text; keep one line of it.
        reason = f"compile failed: {error_text(outcome.error)}"
    elif not verdict.ok:
        status = "rejected"
    elif result is not None and result.status == "compiled":
        status = "compiled"
    else:
        status = "cached"
    return PrewarmRecord(
        arch=arch,
        block_m=block_m,
        role=plan.route.role(block_m, span),
        status=status,
        reason=reason,
        registers=extra.get("registers", verdict.registers),
        shared_bytes=extra.get("shared_bytes", verdict.smem_bytes),
        spill_bytes=extra.get("spill_bytes", verdict.spills),
        seconds=round(outcome.seconds, 3) if outcome is not None else 0.0,
        cache=result.status if result is not None else None,  # type: ignore[arg-type]
        key=result.key if result is not None else None,
        kernel=spec.kernel_name(),
        mma=spec.mma,
        span=spec.span,
        measured=verdict.measured,
    )


def _frozen_misses(spec: MoESpec, arch: str, capacity: int, env: PlanEnv,
                   banded: Optional[bool], cache: CompileCache,
                   answers: dict[tuple[int, int], str]) -> Optional[ArchPrewarm]:
    """A frozen cache's check of every specialization the plan would bind; None when none
    is missing. The planner asks about each size as it would when compiling; a size the
    cache lacks (or holds corrupt) is recorded as failed and taken as the one the plan
    binds (a frozen cache never falls back to a narrower M), so the walk stops there and
    every other planned size is still asked: the report lists all of them, not the first.
    ``answers`` receives the cache's answer per candidate ``(M, span)`` (``"disk"`` for an
    entry this call loaded),
    so the records of the plan that follows report it rather than the memory hit it causes."""
    banded = default_banded(spec.codebook) if banded is None else banded
    misses: dict[tuple[int, int], CompileCacheMiss] = {}

    def check(block_m: int, span: int = 0) -> GeometryVerdict:
        s = candidate_spec(spec, block_m, span)
        try:
            verdict, outcome = geometry_check_outcome(s, cache)  # a static rejection asks no cache
        except CompileCacheMiss as exc:
            misses[block_m, span] = exc
            return GeometryVerdict(block_m=block_m, ok=True)
        if outcome is not None and outcome.result is not None:
            answers.setdefault((block_m, span), outcome.result.status)
        return verdict

    route = spec_route_plan(spec, capacity, env, check, banded)
    if not misses:
        return None
    # What is on disk under each missing key: a corrupt entry, or one that does not load.
    corrupt = {str(e.get("key")): str(e.get("error", "its object does not load"))
               for e in cache.entries()}
    records = []
    for m, span in _candidate_keys(route):
        verdict = route.verdict(m, span)
        candidate = candidate_spec(spec, m, span)
        named = dict(arch=arch, block_m=m, role=route.role(m, span),
                     kernel=candidate.kernel_name(), mma=candidate.mma, span=candidate.span)
        miss = misses.get((m, span))
        if miss is not None:
            why = corrupt.get(miss.key)
            reason = (f"corrupt cache entry {miss.key[:16]} ({why})" if why is not None
                      else f"not in the cache (key {miss.key[:16]})")
            records.append(PrewarmRecord(**named, status="failed", reason=reason, key=miss.key))
            continue
        records.append(PrewarmRecord(
            **named, status="cached" if verdict.ok else "rejected", reason=verdict.reason,
            registers=verdict.registers, shared_bytes=verdict.smem_bytes,
            spill_bytes=verdict.spills, cache="disk" if verdict.measured is not None else None,
            measured=verdict.measured))
    labels = ", ".join(f"{m}" + (f" x {n}" if n else "") for m, n in sorted(misses))
    error = (f"{len(misses)} planned specializations (M={labels}) "
             "are missing from the frozen cache or corrupt")
    return ArchPrewarm(arch=arch, plan=None, records=records, error=error)


def _candidate_keys(route) -> list[tuple[int, int]]:
    """The decode record first (M=8, whichever question asked it), then the other candidates
    in the order the planner asked: the prefill walk (widest first), a banded plan's sizes,
    the wide rule's items; as ``(block_m, span)``."""
    decode = (DECODE_BLOCK_M, 0)
    return [decode] + [c.key for c in route.candidates if c.key != decode]


def _prewarm_arch(base: MoESpec, arch: str, capacity: int, env: PlanEnv, banded: Optional[bool],
                  cache: CompileCache, counter: _Counter) -> ArchPrewarm:
    spec = base.replace(arch=arch)
    first_answers: dict[tuple[int, int], str] = {}
    if cache.is_frozen:  # report every missing specialization, then plan as usual
        missing = _frozen_misses(spec, arch, capacity, env, banded, cache, first_answers)
        if missing is not None:
            return missing
    started: dict[int, int] = {}

    def observe(s: MoESpec, outcome: Optional[CacheOutcome]) -> None:
        if outcome is None:
            started[s.block_m] = counter.start(arch, s.block_m)
            return
        answer = outcome.result.status if outcome.result is not None else "failed"
        error = error_text(outcome.error) if outcome.error is not None else None
        waited = outcome.result.waited if outcome.result is not None else 0.0
        counter.done(arch, s.block_m, started[s.block_m], answer, outcome.seconds, error, waited)

    try:
        plan = compile_plan(spec, capacity=capacity, arch=arch, env=env, cache=cache,
                            banded=banded, observe=observe)
    except CompileCacheMiss as exc:
        # Frozen: a missing specialization is never replaced by a narrower one; report it.
        m = int(exc.spec.get("block_m", DECODE_BLOCK_M)) if isinstance(exc.spec, Mapping) else DECODE_BLOCK_M
        role: Role = "decode" if m == DECODE_BLOCK_M else "prefill"
        rec = PrewarmRecord(arch=arch, block_m=m, role=role, status="failed",
                            reason=error_text(exc), kernel=spec.replace(block_m=m).kernel_name())
        return ArchPrewarm(arch=arch, plan=None, records=[rec], error=error_text(exc))
    keys = _candidate_keys(plan.route)
    records = [_record(arch, plan, m, span) for m, span in keys]
    records = [dataclasses.replace(r, cache=first_answers[key])
               if r.cache == "memory" and key in first_answers else r
               for key, r in zip(keys, records)]
    return ArchPrewarm(arch=arch, plan=plan, records=records, error=plan.error)


def _normalize_archs(archs: Iterable[Any]) -> list[str]:
    out: list[str] = []
    for a in archs:
        name = normalize_arch(a)
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("prewarm needs at least one arch")
    return out


def prewarm_plans(
    base: MoESpec = DEFAULT_GEOMETRY,
    *,
    archs: Sequence[Any] = ("sm_120",),
    capacity: int = DEFAULT_CAPACITY,
    env: Optional[PlanEnv] = None,
    cache: Optional[CompileCache] = None,
    progress: Optional[ProgressFn] = None,
    banded: Optional[bool] = None,
) -> list[ArchPrewarm]:
    """Compile, through ``cache``, every specialization the planner binds or evaluates.

    For each arch (any spelling :func:`~kquant_cute.planners.normalize_arch` accepts,
    duplicates dropped) this runs :func:`kquant_cute.compiler.compile_plan` on ``base``'s
    shape: the prefill fallback walk (each M from the pin / policy choice down to the
    accepted one, each checked by ``geometry_check``), then the decode plan (M=8), then
    when banded each size between them: ``None`` (the default) prewarms ``MoELayer``'s
    default plan (:func:`kquant_cute.planners.default_banded`), ``True`` / ``False`` the
    banded plan / the decode / prefill pair (``MoELayer(banded=...)``).

    ``env`` defaults to :func:`~kquant_cute.planners.resolve_env` of the process
    environment (ValueError naming the variable when invalid); ``cache`` to
    :func:`~kquant_cute.compile_cache.default_cache`. ``progress`` receives a
    :class:`PrewarmEvent` before and after each cache call.

    Raises:
        ValueError: unknown arch, invalid env, or invalid capacity / topk / experts.
    """
    arch_names = _normalize_archs(archs)
    env = resolve_env() if env is None else env
    cache = default_cache() if cache is None else cache
    def bound(arch: str) -> int:
        spec = base.replace(arch=arch)
        wide = (default_banded(spec.codebook) if banded is None else banded) and plans_wide(spec)
        return candidate_bound(capacity, base.topk, base.num_experts, env, wide=wide,
                               fill_targets=plan_fill_targets(spec))

    counter = _Counter(progress, sum(bound(a) for a in arch_names))
    return [_prewarm_arch(base, a, capacity, env, banded, cache, counter) for a in arch_names]


def prewarm(
    base: MoESpec = DEFAULT_GEOMETRY,
    *,
    archs: Sequence[Any] = ("sm_120",),
    capacity: int = DEFAULT_CAPACITY,
    env: Optional[PlanEnv] = None,
    cache: Optional[CompileCache] = None,
    progress: Optional[ProgressFn] = None,
    banded: Optional[bool] = None,
) -> list[PrewarmRecord]:
    """:func:`prewarm_plans` flattened: one :class:`PrewarmRecord` per specialization.

    Per arch: the decode record first, then the other candidates in the order the planner
    asked about them (the prefill walk widest first, then a banded plan's sizes). Check
    :func:`needed_failures` for plans that cannot be bound.
    """
    results = prewarm_plans(base, archs=archs, capacity=capacity, env=env, cache=cache,
                            progress=progress, banded=banded)
    return [r for res in results for r in res.records]


def needed_failures(records: Iterable[PrewarmRecord]) -> list[PrewarmRecord]:
    """Records of specializations a plan binds (decode / chosen prefill) that are unusable."""
    return [r for r in records if r.needed and not r.ok]

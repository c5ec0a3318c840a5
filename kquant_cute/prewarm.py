"""Prewarm the compile cache: compile every specialization the planner would bind, per arch.

This module owns the "what to compile ahead of time" question and nothing else: it runs
the planner's own decision path (:func:`kquant_cute.compiler.plan_forward`, i.e.
``plan_pair_layout`` with ``geometry_check`` as the predicate) for each target arch and
reports, per specialization, whether it was compiled now, served from the cache, rejected
by the geometry check, or failed. It does not re-implement the route-size policy or the
validity predicate.

- :data:`DEFAULT_GEOMETRY`: the BRIEF's Kimi-K3 TP8 shard (E=896, H=3584, I=384, top-16,
  K=4, MCG, bf16 in, fp32 out, SiTU, shared hidden-side vectors).
- :func:`prewarm`: a flat list of :class:`PrewarmRecord`.
- :func:`prewarm_plans`: the same per arch, with the plan layout (for ``describe()``).

Compile-vs-cached is learned from the real cache call: the cache handed to the planner is
wrapped in a thin recorder of ``get_or_build_result`` (the one call
``compiler.get_specialization`` makes), which also memoises a failed build per key so a
failing specialization is compiled once per run, not once per planner question.
Works on a machine with no GPU (cross-compiles for each arch).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

from .compile_cache import CacheResult, CompileCache, CompileCacheMiss, default_cache
from .compiler import describe_gemm, geometry_check, plan_forward
from .kernels.moe import MoESpec
from .planners import (
    DECODE_BLOCK_M,
    ROUTE_BLOCK_SIZES,
    GeometryVerdict,
    PlanEnv,
    PlanPairLayout,
    normalize_arch,
    plan_pair_layout,
    resolve_env,
    select_route_block_size_m,
)

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
    "spec_bound",
]

#: Tokens the default plans are sized for (the BRIEF's largest benchmark point, doubled).
DEFAULT_CAPACITY = 8192

#: One TP8 shard of Kimi-K3 (BRIEF sections 1 and 8); ``block_m`` / ``arch`` are replaced
#: per planned specialization.
DEFAULT_GEOMETRY = MoESpec(
    num_experts=896,
    hidden=3584,
    intermediate=384,
    topk=16,
    bits=4,
    codebook="mcg",
    block_m=DECODE_BLOCK_M,
    act_dtype="bfloat16",
    out_dtype="float32",
    activation="situ",
    shared_hidden_vectors=True,
    has_expert_map=False,
    arch="sm_90a",
)

Role = Literal["decode", "prefill", "fallback-rejected"]
Status = Literal["compiled", "cached", "rejected", "failed"]
#: How the cache answered: built now, read from disk, already in this process, or None
#: (never asked: a static rejection, or the build raised).
CacheAnswer = Optional[Literal["compiled", "disk", "memory"]]


@dataclass(frozen=True)
class PrewarmRecord:
    """One specialization the planner evaluated for one arch.

    ``status``: ``"compiled"`` (built in this run), ``"cached"`` (served by the cache),
    ``"rejected"`` (the geometry check said no: static reason or measured resources; it may
    still have been compiled to measure them, see ``cache``) or ``"failed"`` (the build
    raised, or the decode plan is not implementable). ``reason`` is None for usable ones.
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
    on how many there will be (the fallback walk stops at the first accepted size, so the
    real count can be lower). ``answer`` (``kind == "done"``) is ``"compiled"``,
    ``"disk"``, ``"memory"`` or ``"failed"``.
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


ProgressFn = Callable[[PrewarmEvent], None]


@dataclass
class ArchPrewarm:
    """What prewarming one arch produced: the layout the planner chose and the records.

    ``layout`` is None only when planning itself raised before a layout existed; ``error``
    holds the reason the plans cannot be bound (e.g. the decode specialization failed).
    """

    arch: str
    layout: Optional[PlanPairLayout]
    records: list[PrewarmRecord] = field(default_factory=list)
    error: Optional[str] = None

    def describe(self) -> str:
        """The planner's ``describe()`` text (or the error), headed by the arch."""
        head = f"[{self.arch}]"
        if self.layout is None:
            return f"{head} no plan: {self.error}"
        text = f"{head} {self.layout.describe()}"
        bound = [(r.block_m, r.mma, r.span) for r in self.records if r.needed and r.mma]
        if bound:
            text += "\n  " + describe_gemm(bound)
        if self.error:
            text += f"\n  error: {self.error}"
        return text


@dataclass
class _Outcome:
    """The first cache call for one key in this run."""

    block_m: int
    answer: Optional[str]  # "compiled" | "disk" | "memory" | None (raised)
    seconds: float
    key: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: Optional[BaseException] = None


class _RecordingCache:
    """Duck-typed :class:`CompileCache` that records the first ``get_or_build_result`` per key.

    Everything else is forwarded to the wrapped cache. A build that raised is memoised per
    key and re-raised on later calls, so one run never compiles a failing spec twice.
    """

    def __init__(self, cache: CompileCache, arch: str, counter: "_Counter") -> None:
        self._cache = cache
        self._arch = arch
        self._counter = counter
        self.outcomes: dict[int, _Outcome] = {}
        self._failed: dict[str, BaseException] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def get_or_build_result(self, name: str, spec: Mapping[str, Any], **kwargs: Any) -> CacheResult:
        token = name + json.dumps(dict(spec), sort_keys=True, default=str) + str(kwargs.get("arch"))
        if token in self._failed:
            raise self._failed[token]
        block_m = int(spec.get("block_m", 0))
        first = block_m not in self.outcomes
        if not first:
            return self._cache.get_or_build_result(name, spec, **kwargs)
        index = self._counter.start(self._arch, block_m)
        t0 = time.perf_counter()
        try:
            res = self._cache.get_or_build_result(name, spec, **kwargs)
        except Exception as exc:
            seconds = time.perf_counter() - t0
            self._failed[token] = exc
            self.outcomes[block_m] = _Outcome(block_m, None, seconds, error=exc)
            self._counter.done(self._arch, block_m, index, "failed", seconds, error_text(exc))
            raise
        self.outcomes[block_m] = _Outcome(block_m, res.status, res.seconds, res.key,
                                          dict(res.meta.get("extra") or {}))
        self._counter.done(self._arch, block_m, index, res.status, res.seconds, None)
        return res


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
             error: Optional[str]) -> None:
        self._emit(PrewarmEvent("done", arch, block_m, index, self.bound,
                                time.perf_counter() - self._t0, answer, seconds, error))


def spec_bound(base: MoESpec, capacity: int, env: PlanEnv) -> int:
    """Upper bound on the specializations one arch's plans evaluate (for progress bars).

    The decode M=8 plus every size of the fallback walk from the prefill candidate (the
    pin, else the policy's choice at ``capacity``) down to 8; just the decode when no
    prefill plan is possible.
    """
    if env.prefill_disabled or capacity <= env.prefill_min_m:
        return 1
    top = env.pinned_block_m or select_route_block_size_m(capacity, base.topk, base.num_experts)
    return len({DECODE_BLOCK_M} | {s for s in ROUTE_BLOCK_SIZES if s <= top})


def _record(arch: str, verdict: GeometryVerdict, role: Role, outcome: Optional[_Outcome],
            spec: MoESpec) -> PrewarmRecord:
    extra = outcome.extra if outcome is not None else {}
    answer = outcome.answer if outcome is not None else None
    status: Status
    if outcome is not None and outcome.error is not None:
        status = "failed"
    elif not verdict.ok:
        status = "rejected"
    elif answer == "compiled":
        status = "compiled"
    else:
        status = "cached"
    reason = verdict.reason
    if outcome is not None and outcome.error is not None:
        # geometry_check's reason embeds the whole exception text; keep one line of it.
        reason = f"compile failed: {error_text(outcome.error)}"
    return PrewarmRecord(
        arch=arch,
        block_m=verdict.block_m,
        role=role,
        status=status,
        reason=reason,
        registers=extra.get("registers", verdict.registers),
        shared_bytes=extra.get("shared_bytes", verdict.smem_bytes),
        spill_bytes=extra.get("spill_bytes", verdict.spills),
        seconds=round(outcome.seconds, 3) if outcome is not None else 0.0,
        cache=answer,  # type: ignore[arg-type]
        key=outcome.key if outcome is not None else None,
        kernel=spec.kernel_name(),
        mma=spec.mma,
        span=spec.span,
        measured=verdict.measured,
    )


def _prewarm_arch(base: MoESpec, arch: str, capacity: int, env: PlanEnv,
                  cache: CompileCache, counter: _Counter) -> ArchPrewarm:
    spec = base.replace(arch=arch)
    rec = _RecordingCache(cache, arch, counter)
    rcache: Any = rec  # duck-typed CompileCache
    layout: Optional[PlanPairLayout] = None
    error: Optional[str] = None
    try:
        layout = plan_forward(spec, capacity=capacity, arch=arch, env=env, cache=rcache).layout
    except CompileCacheMiss as exc:
        # Frozen: a missing specialization is never replaced by a narrower one; report it.
        m = int(exc.spec.get("block_m", DECODE_BLOCK_M)) if isinstance(exc.spec, Mapping) else DECODE_BLOCK_M
        role: Role = "decode" if m == DECODE_BLOCK_M else "prefill"
        rec_ = PrewarmRecord(arch=arch, block_m=m, role=role, status="failed",
                             reason=error_text(exc), kernel=spec.replace(block_m=m).kernel_name())
        return ArchPrewarm(arch=arch, layout=None, records=[rec_], error=error_text(exc))
    except ValueError as exc:
        # plan_forward raises when the decode specialization is not implementable; the
        # prefill walk's answers are memoised, so re-running the layout costs nothing.
        error = str(exc)
        layout = plan_pair_layout(capacity, spec.topk, spec.num_experts, env,
                                  lambda m: geometry_check(spec.replace(block_m=m), rcache))

    records: list[PrewarmRecord] = []
    decode_m = layout.decode.block_m
    decode_verdict = geometry_check(spec.replace(block_m=decode_m), rcache)  # memoised
    decode = _record(arch, decode_verdict, "decode", rec.outcomes.get(decode_m),
                     spec.replace(block_m=decode_m))
    records.append(decode)
    prefill_m = layout.prefill.block_m if layout.prefill is not None else None
    for verdict in layout.decisions:
        if verdict.block_m == decode_m and verdict.ok:
            continue  # the walk accepted M=8: that is the decode specialization itself
        role: Role = "prefill" if verdict.ok and verdict.block_m == prefill_m else "fallback-rejected"
        if verdict.block_m == decode_m and not verdict.ok:
            continue  # the decode record already reports M=8's rejection
        records.append(_record(arch, verdict, role, rec.outcomes.get(verdict.block_m),
                               spec.replace(block_m=verdict.block_m)))
    return ArchPrewarm(arch=arch, layout=layout, records=records, error=error)


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
) -> list[ArchPrewarm]:
    """Compile, through ``cache``, every specialization the planner binds or evaluates.

    For each arch (any spelling :func:`~kquant_cute.planners.normalize_arch` accepts,
    duplicates dropped) this runs :func:`kquant_cute.compiler.plan_forward` on ``base``'s
    shape: the prefill fallback walk (each M from the pin / policy choice down to the
    accepted one, each checked by ``geometry_check``), then the decode plan (M=8).

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
    counter = _Counter(progress, spec_bound(base, capacity, env) * len(arch_names))
    return [_prewarm_arch(base, a, capacity, env, cache, counter) for a in arch_names]


def prewarm(
    base: MoESpec = DEFAULT_GEOMETRY,
    *,
    archs: Sequence[Any] = ("sm_120",),
    capacity: int = DEFAULT_CAPACITY,
    env: Optional[PlanEnv] = None,
    cache: Optional[CompileCache] = None,
    progress: Optional[ProgressFn] = None,
) -> list[PrewarmRecord]:
    """:func:`prewarm_plans` flattened: one :class:`PrewarmRecord` per specialization.

    Per arch: the decode record first, then the prefill walk in the order the planner
    made its decisions (widest first). Check :func:`needed_failures` for plans that
    cannot be bound.
    """
    results = prewarm_plans(base, archs=archs, capacity=capacity, env=env, cache=cache,
                            progress=progress)
    return [r for res in results for r in res.records]


def needed_failures(records: Iterable[PrewarmRecord]) -> list[PrewarmRecord]:
    """Records of specializations a plan binds (decode / chosen prefill) that are unusable."""
    return [r for r in records if r.needed and not r.ok]

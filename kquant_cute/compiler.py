"""Specializations through the compile cache, and the decode / prefill plan of a layer.

Owns the composition of kernels (what a specialization is and how it compiles), the
compile cache (never re-pay a compile) and the planners (which route block M to use):
- `get_specialization(spec)`: the cached compile of one `MoESpec` (compiles on a miss,
  also on a machine with no GPU); the cache's load step links the object into this
  process (host side, no GPU needed), so an entry whose checksum matches but whose
  object does not load is deleted and rebuilt by the cache instead of being served.
- `geometry_check(spec, arch)`: the validity predicate the planner's fallback uses:
  static reasons from the kernel, then measured registers / spills / shared memory of
  every sub-kernel (`MoESpec.sub_kernels()`) against the per-SM table.
- `compile_plan(base, capacity, arch, env)`: the planner's `RoutePlan`
  (`planners.plan_routes` with `geometry_check` as the predicate) with the compiled entries
  attached by M, and the cache's answer to every request the planning made, as a
  `ForwardPlan`; `plan_forward` is the same for a layer, raising when the decode plan is
  not implementable.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from .compile_cache import CacheResult, CompileCache, CompileCacheMiss, default_cache
from .compile_cache.store import sweep_stale
from .kernels import build as kbuild
from .kernels.gemms import GEMMS
from .kernels.moe import MoESpec
from .planners import (DECODE_BLOCK_M, TABLE_FILL_TARGETS, WIDE_SPAN, GeometryVerdict,
                       PlanEnv, RoutePlan, arch_limits, check_resources, default_banded,
                       normalize_arch, plan_routes, resolve_env)

KERNEL_NAME = "w4a16_trellis_moe"


def describe_gemm(plans) -> str:
    """The "GEMM:" line of a describe(): per plan (block_m, mma, span), its MMA instruction
    and, above 1, the route blocks of one expert per work item."""
    return "GEMM: " + ", ".join(
        f"M={block_m} {GEMMS[mma].instruction if mma in GEMMS else mma}"
        + (f" x {span} route blocks per work item" if span > 1 else "")
        for block_m, mma, span in plans)


def candidate_spec(spec: MoESpec, block_m: int, span: int = 0) -> MoESpec:
    """`spec` at plan candidate `(block_m, span)`: span 0 is the block's own work item (the
    span `spec` asked for, resolved again), n > 1 the wide rule's items of n blocks."""
    return spec.replace(block_m=block_m, span=span) if span else spec.replace(block_m=block_m)


def plans_wide(spec: MoESpec) -> bool:
    """Whether `spec`'s banded plan applies the wide rule (`planners.plans.WIDE_SPAN`): its
    span is not pinned (asked for 0) and its GEMM runs work items of that many blocks."""
    mma = GEMMS.get(spec.mma)
    return spec.requested[1] == 0 and mma is not None and WIDE_SPAN in mma.spans


def plan_fill_targets(spec: MoESpec) -> tuple:
    """The per-size route-block fill targets `spec`'s plan chooses its sizes with: the fill
    rule's (`planners.plans.TABLE_FILL_TARGETS`) where the GEMM's CTA runs several
    workers that share directly read state tables, which leave one CTA per SM (the K=2
    pair table; mixed rates' per-rate tables on wgmma), asked of its M=8 specialization;
    else () (the policy's own)."""
    shared_tables = (spec.table_decode == "direct"
                     and spec.replace(block_m=DECODE_BLOCK_M).gemm_workers() > 1)
    return TABLE_FILL_TARGETS if shared_tables else ()


def spec_route_plan(spec: MoESpec, capacity: int, env: PlanEnv, check,
                    banded: bool) -> RoutePlan:
    """`planners.plan_routes` for `spec`'s shape with the spec's own rules: the wide rule
    where `plans_wide(spec)` (`check(block_m, span)` answers its items too) and the fill
    rule's targets (`plan_fill_targets`). Every planner of a layer asks through here."""
    return plan_routes(capacity, spec.topk, spec.num_experts, env, check, banded=banded,
                       span_check=check if plans_wide(spec) else None,
                       fill_targets=plan_fill_targets(spec))


def source_files() -> list[str]:
    """Files whose bytes key the cache: the kernel package alone (the kernels, their format
    constants, the launch contract and the compile step in `kernels/build.py`). The
    planners and this module only choose which specializations to build, so editing the
    route policy or the plan leaves every compiled object valid."""
    import kquant_cute.kernels as kernels_pkg

    return sorted(glob.glob(os.path.join(os.path.dirname(kernels_pkg.__file__), "*.py")))


@dataclass
class CompiledEntry:
    """A cached specialization: its metadata and its object, already linked into this
    process (and, where the process has a GPU of its arch, its cubin loaded onto it)."""

    spec: MoESpec
    meta: dict
    payload: bytes
    _fn: object = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def resources(self) -> dict:
        return self.meta.get("extra", {})

    def function(self):
        with self._lock:
            if self._fn is None:  # an entry built by hand, not through the cache
                with tempfile.NamedTemporaryFile(prefix=f"kq_obj_{os.getpid()}_", suffix=".o",
                                                 delete=False) as f:
                    f.write(self.payload)
                    path = f.name
                try:
                    self._fn = kbuild.load_forward(path)
                finally:
                    os.unlink(path)
            return self._fn


#: Temporaries of compiles and loads in the system temp directory; a killed process leaves
#: them behind, the next compile sweeps the stale ones (compile_cache.store.sweep_stale).
_TMP_RE = re.compile(r"^kq_(?:cubin|obj)_(?:(?P<pid>[0-9]+)_)?[A-Za-z0-9_]+(?:\.o)?$")


def _build(spec: MoESpec):
    sweep_stale(tempfile.gettempdir(), _TMP_RE)
    return kbuild.compile_forward(spec)


def _runs_here(arch: str) -> bool:
    """True iff this process sees a CUDA device of ``arch`` (every device must be, as cute
    loads an object onto all of them); False on a build box or for another arch's entry."""
    import torch

    if not torch.cuda.is_available():
        return False
    want = arch_limits(arch)
    return all(arch_limits(torch.cuda.get_device_capability(d)) is want
               for d in range(torch.cuda.device_count()))


def get_specialization(spec: MoESpec, cache: Optional[CompileCache] = None):
    """The `CacheResult` of one specialization (value: a `CompiledEntry`)."""
    cache = cache or default_cache()
    spec_dict = spec.key_fields()  # "auto" MMA / span: keyed as what they resolved to
    arch = spec_dict.pop("arch")

    def load(path, meta):
        # Loading is the loadability check: a payload that fails it raises here, inside
        # the cache, which deletes the entry and rebuilds it. The host link always runs;
        # where this process has a GPU of the entry's arch, the device image is loaded too.
        with open(path, "rb") as f:
            payload = f.read()
        fn = kbuild.load_forward(path, on_device=_runs_here(spec.arch))
        return CompiledEntry(spec=spec, meta=meta, payload=payload, _fn=fn)

    return cache.get_or_build_result(KERNEL_NAME, spec_dict, arch=arch,
                                     build=lambda: _build(spec), load=load,
                                     sources=source_files())


@dataclass(frozen=True)
class CacheOutcome:
    """The compile cache's answer to the one request planning made for a specialization:
    its `CacheResult` (status "compiled" / "disk" / "memory", seconds, key, metadata), or
    the exception the request raised (then `seconds` is the time until it raised)."""

    spec: MoESpec
    result: Optional[CacheResult] = None
    error: Optional[BaseException] = None
    seconds: float = 0.0


#: Called before a cache request (outcome None) and after it (the outcome).
Observer = Callable[[MoESpec, Optional[CacheOutcome]], None]


def _check(spec: MoESpec, cache: Optional[CompileCache],
           observe: Optional[Observer] = None) -> tuple[GeometryVerdict, Optional[CacheOutcome]]:
    """`geometry_check`, also returning the cache's outcome (None: never asked)."""
    limits = arch_limits(spec.arch)
    reason = spec.check()
    if reason is not None:
        return GeometryVerdict(block_m=spec.block_m, ok=False, reason=reason), None
    cache = cache or default_cache()  # an invalid cache environment raises, not "rejected"
    if observe is not None:
        observe(spec, None)
    t0 = time.perf_counter()
    try:
        res = get_specialization(spec, cache)
    except Exception as exc:
        outcome = CacheOutcome(spec, error=exc, seconds=time.perf_counter() - t0)
        if observe is not None:
            observe(spec, outcome)
        if isinstance(exc, CompileCacheMiss):
            raise  # frozen / graph capture: never silently fall back to a narrower block
        # A compile failure rejects the geometry, with its reason.
        return GeometryVerdict(block_m=spec.block_m, ok=False,
                               reason=f"compile failed: {type(exc).__name__}: {exc}"), outcome
    outcome = CacheOutcome(spec, result=res, seconds=res.seconds)
    if observe is not None:
        observe(spec, outcome)
    extra = res.value.resources
    if not extra.get("resources_measured", bool(extra.get("kernels"))):
        return GeometryVerdict(block_m=spec.block_m, ok=True, measured=False), outcome
    launches = spec.kernel_launches()
    reasons = []
    for k in extra.get("kernels", []):
        if k["kernel"] not in launches:
            reasons.append(f"{k['kernel']}: a kernel of the object that MoESpec.sub_kernels() "
                           "does not list (its threads are unknown)")
            continue
        r = check_resources(limits, smem_bytes=k["shared"], registers=k["registers"],
                            spills=k["stack"] + k["local"], threads=launches[k["kernel"]][0])
        if r is not None:
            reasons.append(f"{k['kernel']}: {r}")
    reasons = list(dict.fromkeys(reasons))  # one line per distinct reason (gate/up/down alike)
    return GeometryVerdict(block_m=spec.block_m, ok=not reasons,
                           reason="; ".join(reasons) if reasons else None,
                           registers=extra.get("registers"), spills=extra.get("spill_bytes"),
                           smem_bytes=extra.get("shared_bytes"), measured=True), outcome


def geometry_check(spec: MoESpec, cache: Optional[CompileCache] = None) -> GeometryVerdict:
    """Static check, then compile (cached) and check the measured resources of every
    sub-kernel on spec.arch. Without measurements (no cuobjdump where it was compiled) the
    verdict accepts the geometry as "unmeasured" (`measured=False`), never silently."""
    return _check(spec, cache)[0]


def geometry_check_outcome(spec: MoESpec, cache: Optional[CompileCache] = None
                           ) -> tuple[GeometryVerdict, Optional[CacheOutcome]]:
    """`geometry_check` with the cache's outcome of its request (None: never asked)."""
    return _check(spec, cache)


@dataclass
class BoundPlan:
    spec: MoESpec
    entry: CompiledEntry

    @property
    def fn(self):
        return self.entry.function()


class ForwardPlan:
    """The planner's `RoutePlan` of one layer shape with its compiled entries attached by M.

    `route` decides (bands, candidates, route bounds); `entries[M]` is the compiled
    specialization of each accepted size of `route.block_sizes`; `outcomes[M]` is the
    cache's answer to every request planning made (also for the sizes the check rejected
    after compiling them, and for failed builds). `wide[(M, span)]` / `wide_outcomes` are
    the same for the wide rule's work items (`route.wide_keys`).
    """

    def __init__(self, route: RoutePlan, base: MoESpec, entries: dict[int, BoundPlan],
                 outcomes: Optional[dict[int, CacheOutcome]] = None,
                 wide: Optional[dict[tuple[int, int], BoundPlan]] = None,
                 wide_outcomes: Optional[dict[tuple[int, int], CacheOutcome]] = None):
        self.route = route
        self.base = base
        self.entries = dict(sorted(entries.items()))
        self.outcomes = dict(outcomes or {})
        self.wide = dict(sorted((wide or {}).items()))
        self.wide_outcomes = dict(wide_outcomes or {})

    @property
    def error(self) -> Optional[str]:
        return self.route.error

    @property
    def decode(self) -> BoundPlan:
        return self.entries[DECODE_BLOCK_M]

    @property
    def prefill(self) -> Optional[BoundPlan]:
        return None if self.route.prefill_m is None else self.entries.get(self.route.prefill_m)

    def specs(self) -> list[MoESpec]:
        return [p.spec for p in (*self.entries.values(), *self.wide.values())]

    def plan_for(self, m: int) -> BoundPlan:
        """The compiled specialization a call with `m` tokens binds (`RoutePlan.band_for`)."""
        band = self.route.band_for(m)
        return self.wide[band.key] if band.span else self.entries[band.block_m]

    def load(self) -> None:
        for p in (*self.entries.values(), *self.wide.values()):
            p.fn  # noqa: B018 - load now, not on the first (possibly captured) call

    def describe(self, scratch_bytes=None) -> str:
        text = self.route.describe(scratch_bytes=scratch_bytes)
        keys = [(m, 0) for m in self.route.block_sizes] + list(self.route.wide_keys)
        specs = [candidate_spec(self.base, m, n) for m, n in keys]
        return text + "\n  " + describe_gemm((s.block_m, s.mma, s.span) for s in specs)


def compile_plan(base: MoESpec, *, capacity: int, arch, env: Optional[PlanEnv] = None,
                 cache: Optional[CompileCache] = None, banded: Optional[bool] = None,
                 observe: Optional[Observer] = None) -> ForwardPlan:
    """Plan `base`'s shape for `arch` (`planners.plan_routes`, with `geometry_check`, which
    compiles through the cache, as the predicate) and attach the compiled entries by M.
    A rejected decode geometry is the plan's `error`, not an exception (see
    `plan_forward`). `observe` sees every cache request before and after. Needs no GPU
    (objects are cross-compiled for `arch`); `env` defaults to the process environment's
    plan knobs (`planners.resolve_env`). `banded=None` is the layer's default plan
    (`planners.default_banded`); True / False ask for the banded plan / the decode /
    prefill pair. A banded plan also applies the wide rule where `plans_wide(base)`: its wide
    items compile through the same check."""
    arch = normalize_arch(arch)
    env = resolve_env() if env is None else env
    banded = default_banded(base.codebook) if banded is None else banded
    # The MMA kind resolves per arch, so every plan of the layer shares it (bitwise
    # equality across M); an "auto" span resolves per block size.
    base = base.replace(arch=arch)
    outcomes: dict[int, CacheOutcome] = {}
    wide_outcomes: dict[tuple[int, int], CacheOutcome] = {}

    def check(block_m: int, span: int = 0) -> GeometryVerdict:
        verdict, outcome = _check(candidate_spec(base, block_m, span), cache, observe)
        if outcome is not None and span:
            wide_outcomes[block_m, span] = outcome
        elif outcome is not None:
            outcomes[block_m] = outcome
        return verdict

    route = spec_route_plan(base, capacity, env, check, banded)
    entries = {}
    for m in route.block_sizes:
        if route.verdict(m).ok:  # accepted: the check got the entry from the cache
            entries[m] = BoundPlan(outcomes[m].spec, outcomes[m].result.value)
    wide = {key: BoundPlan(wide_outcomes[key].spec, wide_outcomes[key].result.value)
            for key in route.wide_keys}
    return ForwardPlan(route, base, entries, outcomes, wide, wide_outcomes)


def plan_forward(base: MoESpec, *, capacity: int, arch, env: Optional[PlanEnv] = None,
                 cache: Optional[CompileCache] = None, banded: Optional[bool] = None) -> ForwardPlan:
    """`compile_plan` for a layer: the decode / prefill specializations (with `banded`, also
    every accepted size between them; `banded=False` is the decode / prefill pair; `None`,
    the default, is `planners.default_banded`; see `planners.RoutePlan`), compiled through
    the cache.

    Raises:
        ValueError: when the decode specialization is not implementable.
    """
    plan = compile_plan(base, capacity=capacity, arch=arch, env=env, cache=cache, banded=banded)
    if plan.error is not None:
        raise ValueError(plan.error)
    return plan

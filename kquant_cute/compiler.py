"""Specializations through the compile cache, and the decode / prefill plan of a layer.

Owns the composition of kernels (what a specialization is and how it compiles), the
compile cache (never re-pay a compile) and the planners (which route block M to use):
- `get_specialization(spec)`: the cached compile of one `MoESpec` (compiles on a miss,
  also on a machine with no GPU); the cache's load step links the object into this
  process (host side, no GPU needed, ~2 ms), so an entry whose checksum matches but whose
  object does not load is deleted and rebuilt by the cache instead of being served.
- `geometry_check(spec, arch)`: the validity predicate the planner's fallback uses:
  static reasons from the kernel, then measured registers / spills / shared memory of
  every sub-kernel (`MoESpec.sub_kernels()`) against the per-SM table.
- `plan_forward(base, capacity, arch, env)`: the plan pair (decode M = 8, prefill M from
  the policy with fallback) as a `ForwardPlan`.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Optional

from .compile_cache import CompileCache, CompileCacheMiss, default_cache
from .compile_cache.store import sweep_stale
from .kernels import build as kbuild
from .kernels.moe import MoESpec
from .planners import (GeometryVerdict, PlanEnv, arch_limits, check_resources, normalize_arch,
                       resolve_env)
from .planners.plans import PlanPairLayout, plan_pair_layout
from .planners.policy import (ROUTE_BLOCK_SIZES, max_route_blocks, padded_route_slots,
                              select_route_block_size_m)

KERNEL_NAME = "w4a16_trellis_moe"
_GEMM_NAMES = {"sync": "mma.sync", "wgmma": "async wgmma"}


def describe_gemm(plans) -> str:
    """The "GEMM:" line of a describe(): per plan (block_m, mma, span), its MMA instruction
    and, above 1, the route blocks of one expert per work item."""
    return "GEMM: " + ", ".join(
        f"M={block_m} {_GEMM_NAMES.get(mma, mma)}"
        + (f" x {span} route blocks per work item" if span > 1 else "")
        for block_m, mma, span in plans)


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


def geometry_check(spec: MoESpec, cache: Optional[CompileCache] = None) -> GeometryVerdict:
    """Static check, then compile (cached) and check the measured resources of every
    sub-kernel on spec.arch. Without measurements (no cuobjdump where it was compiled) the
    verdict accepts the geometry as "unmeasured" (`measured=False`), never silently."""
    limits = arch_limits(spec.arch)
    reason = spec.check(smem_limit=limits.smem_per_block_optin)
    if reason is not None:
        return GeometryVerdict(block_m=spec.block_m, ok=False, reason=reason)
    cache = cache or default_cache()  # an invalid cache environment raises, not "rejected"
    try:
        res = get_specialization(spec, cache)
    except CompileCacheMiss:
        raise  # frozen / graph capture: never silently fall back to a narrower block
    except Exception as exc:  # a compile failure rejects the geometry, with its reason
        return GeometryVerdict(block_m=spec.block_m, ok=False,
                               reason=f"compile failed: {type(exc).__name__}: {exc}")
    extra = res.value.resources
    if not extra.get("resources_measured", bool(extra.get("kernels"))):
        return GeometryVerdict(block_m=spec.block_m, ok=True, measured=False)
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
                           smem_bytes=extra.get("shared_bytes"), measured=True)


@dataclass
class BoundPlan:
    spec: MoESpec
    entry: CompiledEntry

    @property
    def fn(self):
        return self.entry.function()


class ForwardPlan:
    """Decode (M = 8) and optional prefill specialization of one layer shape.

    `bands` (opt-in): the accepted sizes between the two, compiled too. Then a call with m
    above the prefill threshold binds the policy's choice at m itself (clamped to the
    prefill M, falling back to the next narrower accepted size) instead of the capacity's.
    """

    def __init__(self, layout: PlanPairLayout, decode: BoundPlan, prefill: Optional[BoundPlan],
                 bands: Optional[dict] = None):
        self.layout = layout
        self.decode = decode
        self.prefill = prefill
        self.bands = dict(bands or {})
        if prefill is not None and self.bands:
            self.bands[prefill.spec.block_m] = prefill

    def specs(self) -> list[MoESpec]:
        plans = [self.decode, self.prefill, *self.bands.values()]
        return list({p.spec: None for p in plans if p is not None})

    def plan_for(self, m: int) -> BoundPlan:
        if self.prefill is None or not self.layout.binds_prefill(m):
            return self.decode
        if not self.bands:
            return self.prefill
        want = select_route_block_size_m(m, self.layout.topk, self.layout.num_experts)
        fits = [b for b in self.bands if b <= want]
        return self.bands[max(fits)] if fits else self.decode

    def max_blocks(self, m: int) -> int:
        """The route-block bound of a call with `m` tokens at the M it binds: the grid
        size of that launch (`planners.policy.max_route_blocks`)."""
        return max_route_blocks(m * self.layout.topk, self.layout.num_experts,
                                self.plan_for(m).spec.block_m)

    def route_slots(self) -> int:
        """The packed-route bound at the capacity over every plan's M: the one scratch
        arena's route list serves them all."""
        n = self.layout.capacity * self.layout.topk
        return max(padded_route_slots(n, self.layout.num_experts, s.block_m)
                   for s in self.specs())

    def load(self) -> None:
        for p in [self.decode, self.prefill, *self.bands.values()]:
            if p is not None:
                p.fn  # noqa: B018 - load now, not on the first (possibly captured) call

    def describe(self, scratch_bytes=None) -> str:
        text = self.layout.describe(scratch_bytes=scratch_bytes)
        specs = sorted(self.specs(), key=lambda s: s.block_m)
        text += "\n  " + describe_gemm((s.block_m, s.mma, s.span) for s in specs)
        if self.bands:
            text += ("\n  banded: above the threshold each call binds the policy's M at its own m "
                     f"among {sorted(self.bands)}")
        return text


def plan_forward(base: MoESpec, *, capacity: int, arch, env: Optional[PlanEnv] = None,
                 cache: Optional[CompileCache] = None, banded: bool = False) -> ForwardPlan:
    """Plan (and compile through the cache) the decode / prefill pair for `base`'s shape;
    with `banded`, also every accepted size between them (see `ForwardPlan`). Needs no
    GPU (objects are cross-compiled for `arch`); `env` defaults to the process
    environment's plan knobs (`planners.resolve_env`)."""
    arch = normalize_arch(arch)
    env = resolve_env() if env is None else env
    # The MMA kind resolves per arch, so every plan of the layer shares it (bitwise
    # equality across M); an "auto" span resolves per block size.
    base = base.replace(arch=arch)

    def check(block_m: int) -> GeometryVerdict:
        return geometry_check(base.replace(block_m=block_m), cache)

    layout = plan_pair_layout(capacity, base.topk, base.num_experts, env, check)
    decode_spec = base.replace(block_m=layout.decode.block_m)
    verdict = check(decode_spec.block_m)
    if not verdict.ok:
        raise ValueError(f"the decode specialization is not implementable: {verdict.reason}")
    decode = BoundPlan(decode_spec, get_specialization(decode_spec, cache).value)
    prefill = None
    if layout.prefill is not None:
        pspec = base.replace(block_m=layout.prefill.block_m)
        prefill = BoundPlan(pspec, get_specialization(pspec, cache).value)
    bands = {}
    if banded and prefill is not None:
        for size in ROUTE_BLOCK_SIZES:
            if decode_spec.block_m < size < prefill.spec.block_m and check(size).ok:
                bspec = base.replace(block_m=size)
                bands[size] = BoundPlan(bspec, get_specialization(bspec, cache).value)
    return ForwardPlan(layout, decode, prefill, bands)

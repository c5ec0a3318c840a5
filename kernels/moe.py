"""The fused W4A16 trellis MoE forward: one JIT specialization = one compiled object.

Owns `MoESpec` (the compile-time key of a specialization, "auto" values resolved when it
is made), its validity predicate `MoESpec.check()` (the spec's static reasons, then each
sub-kernel's `can_implement`), the list of its device kernels (`MoESpec.sub_kernels()`,
which resource measurement and the geometry check iterate), and `MoEForward`, the
`@cute.jit` host function that launches, on one stream with no host synchronisation and
no allocation:

  route count -> route pack (M) -> input rotation (gate, up) -> trellis GEMM gate + up (one
  launch, the two slots' work items interleaved) -> FC1 output rotation + activation + FC2
  input rotation -> trellis GEMM down -> router-weighted top-k sum with FC2's output rotation.

`MoESpec.coupled` adds the QSRT coupled transforms (profile k2_coupled_h512_h128) inside the
three rotation stages (kernels/rotate.py); the per-expert sign vectors are the entry
point's `pre_signs` [E, 2I] / `post_signs` [E, I] fp16 (ignored, any valid address, when
not coupled).

Every pointer argument is a raw device address and every size a 32-bit integer, so an
object compiled on a CPU-only machine has the same C ABI as a JIT compile on the GPU.
The arguments, their order and the scratch buffers are the launch contract of
`kernels/launch.py`.
Token count, routed experts and the grid (from the plan's block bound) are run-time values.
`codebook_table` is the codebook's state table (sqg_e4m3: uint8 [65536] from
`kquant_cute.trellis.sqg_kernel_tables`: the direct state table of each K, then T12, from
which the direct and the T12 decodes stage their part (`MoESpec.table_decode`); or the
128 KiB `sqg_pair_table(bits)` where `MoESpec.table_layout()` says "pair"; any valid
address for the other codebooks)
and `sm_count` the device's SMs (the table codebooks' GEMMs run a persistent grid).

`MoESpec.bits_set` makes a mixed-rate specialization (QSRT `k3x22_k4x2`, docs/mixed_rates.md):
K varies along the intermediate axis per 16-channel tile, read at run time from the rate
maps (`fc1_bits` / `fc1_words` / `fc2_bits` / `fc2_words`, `fc1_row_words`; launch.RATE_ARGS);
the table holds one direct state table per rate in `bits_set` order (then T12). Uniform
specs never read the rate maps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
from cutlass import Int32


from . import format as fmt
from .arch import arch_limits, known_archs, mma_archs, normalize_arch
from .bring import (DEFAULT_STAGES, DSL_STATIC_SMEM, K_STEPS_PER_STAGE, MAX_CTAS_PER_SM,
                    SMEM_RESERVED_PER_CTA, TILE_N, check_rates)
from .decode import check_table_decode
from .gemms import GEMMS, MMA_KINDS, auto_mma
from .launch import ARG_NAMES, ROUTE_BLOCK_SIZES  # noqa: F401 - ARG_NAMES: the entry point's order
from .rotate import CombineOutput, MidActivation, RotateInput
from .route_pack import RouteCount, RoutePack
from .sqg_t12 import TABLE_DECODES, choose_table_decode

ACT_DTYPES = ("bfloat16", "float16")
OUT_DTYPES = ("float32", "bfloat16", "float16")
MAX_TOPK = 64
INDEX_LIMIT = 2**31 - 1

_DSL_DTYPES = {
    "float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
    "int32": cutlass.Int32, "int16": cutlass.Int16, "uint8": cutlass.Uint8,
}


def _resolve_mma(mma: str, arch: str) -> str:
    """`mma` "auto" -> the registry's preferred kind on this arch (`gemms.auto_mma`)."""
    return auto_mma(arch) if mma == "auto" else mma


def _resolve_span(spec: "MoESpec") -> int:
    """`span` 0 -> the GEMM class's `default_span` for this block size and geometry (on
    this arch's dynamic shared memory per block; without them, the block size's plain
    default). Values that are not resolvable are left for `MoESpec.check` to report."""
    if spec.span != 0 or spec.mma not in GEMMS or not isinstance(spec.block_m, int):
        return spec.span
    limit, geo = spec.smem_limit(), {}
    if limit is not None:
        try:
            geo = {k: v for k, v in spec._gemm_geometry().items() if k not in ("block_m", "span")}
        except (TypeError, ValueError, KeyError):
            limit = None
    return GEMMS[spec.mma].default_span(spec.block_m, limit, **geo)


def _resolve_stages(spec: "MoESpec", requested: int) -> int:
    """`stages` 0 -> the GEMM class's `default_stages` for this geometry (block size and
    span resolved; on this arch's dynamic shared memory per block), `DEFAULT_STAGES` where
    the geometry cannot be asked (`MoESpec.check` reports why)."""
    if requested != 0:
        return requested
    if spec.mma not in GEMMS or not isinstance(spec.block_m, int):
        return DEFAULT_STAGES
    limit = spec.smem_limit()
    if limit is None:
        return DEFAULT_STAGES
    try:
        geo = {k: v for k, v in spec._gemm_geometry().items() if k != "stages"}
        return GEMMS[spec.mma].default_stages(limit, **geo)
    except (TypeError, ValueError, KeyError):
        return DEFAULT_STAGES


def _resolve_table_decode(spec: "MoESpec") -> str:
    """`table_decode` "auto" -> "direct" where the layer's direct tables (one 64 KiB table per
    K) fit the target beside the smallest GEMM (M=8, span 1, one worker), else "t12"
    (`sqg_t12.choose_table_decode`). One answer per layer, whatever its block size: a
    larger M that does not fit with direct tables is rejected, as without T12, and the
    planner falls back to a smaller one (direct decodes faster than T12 + bijection:
    docs/benchmarks.md). Arithmetic codebooks read no table: "direct"."""
    if spec.table_decode != "auto":
        return spec.table_decode
    book = fmt.CODEBOOK.get(spec.codebook) if isinstance(spec.codebook, str) else None
    if book is None or not book.table or spec.mma not in GEMMS:
        return "direct"
    limit = spec.smem_limit()
    if limit is None:
        return "direct"  # an unknown arch: `check` reports it
    bits_set = spec.bits_set if isinstance(spec.bits_set, tuple) else ()
    try:
        need = GEMMS[spec.mma].smem_bytes_for(block_m=min(ROUTE_BLOCK_SIZES), bits=spec.bits,
                                              stages=spec.stages, codebook=spec.codebook,
                                              bits_set=bits_set)
    except TypeError:
        return "direct"  # malformed fields: `check` reports them
    return choose_table_decode(need <= limit)


@dataclass(frozen=True)
class MoESpec:
    """Compile-time key of one fused-forward specialization.

    `mma="auto"`, `span=0` and `stages=0` are requests: they are resolved when the spec is made (the
    fields hold the concrete values), and `replace` resolves them again from the request,
    so a spec moved to another block size or arch gets that one's defaults."""

    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    bits: int
    codebook: str
    block_m: int
    act_dtype: str = "bfloat16"
    out_dtype: str = "float32"
    activation: str = "silu"
    shared_hidden_vectors: bool = False
    has_expert_map: bool = False
    #: B-ring (and activation-ring) stages of the GEMMs' cp.async pipeline; 0 = the GEMM
    #: class's `default_stages` for this geometry (`DEFAULT_STAGES`, one less where that
    #: lets one more worker share the tables).
    stages: int = 0
    #: GEMM register target in CTAs per SM (nvvm.minctasm): 1 = none (the default; see
    #: docs/benchmarks.md), 0 = as many as shared memory allows (the GEMM class's
    #: `resident_ctas`), n = n.
    occupancy: int = 1
    #: MMA kind of the GEMMs, a key of the registry `kernels/gemms.py` ("sync": mma.sync,
    #: every arch; "wgmma": sm_90a only, decoded weights as the register A operand of
    #: async wgmma) or "auto" (the registry's preferred kind on `arch`).
    mma: str = "auto"
    #: Route blocks of one expert per work item (rows = span x block_m), so an expert's
    #: weights are decoded once per N tile for up to that many rows (wgmma: 1, 2 or 4, at
    #: most 128 rows; mma.sync: 1); 0 = the GEMM class's `default_span` for this geometry.
    span: int = 0
    arch: str = "sm_90a"
    #: QSRT coupled transforms (H512 on the latent axis, signed H128 around the activation,
    #: FC1 slots interleaved per 32-channel atom); needs shared hidden-side vectors.
    coupled: bool = False
    #: Mixed rates: the distinct K of the layer's tiles, ascending (>= 2 of them; `bits` is
    #: the widest, which sizes the B ring and the index check). () = every tile at `bits`.
    #: The one owner of a layer's rate set in a specialization (`MixedMoEWeights.rate_set`
    #: is what the layer passes).
    bits_set: tuple = ()
    #: How a table codebook's GEMMs decode (sqg_e4m3): "direct" (one 64 KiB state table per
    #: K in shared memory, one byte load per weight; the K=2 pair table where `pair_table`),
    #: "t12" (the 4 KiB T12 every K shares plus the state bijection on the integer ALU,
    #: kernels/sqg_t12.py) or "auto" (direct where the layer's direct tables fit the target,
    #: else t12: `_resolve_table_decode`). Arithmetic codebooks read no table ("direct").
    table_decode: str = "auto"
    #: (mma, span, table_decode, stages) as asked for, before resolution (not part of the key or
    #: of equality).
    requested: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # `arch` holds the DSL target it compiles for (any spelling the arch table accepts:
        # "sm_90" -> "sm_90a"), so the MMA kind chosen and checked from the arch table is
        # one ptxas accepts for the target given to it. An unknown arch stays as given for
        # `check` to report.
        try:
            object.__setattr__(self, "arch", normalize_arch(self.arch))
        except (ValueError, TypeError):
            pass
        object.__setattr__(self, "requested",
                           (self.mma, self.span, self.table_decode, self.stages))
        object.__setattr__(self, "mma", _resolve_mma(self.mma, self.arch))
        # The table decode and the span are chosen against the default ring depth, then the
        # ring depth for the resolved span (`_resolve_stages`).
        if self.stages == 0:
            object.__setattr__(self, "stages", DEFAULT_STAGES)
        object.__setattr__(self, "table_decode", _resolve_table_decode(self))
        object.__setattr__(self, "span", _resolve_span(self))
        object.__setattr__(self, "stages", _resolve_stages(self, self.requested[3]))

    def resolved(self) -> "MoESpec":
        """This spec (specs are resolved when they are made; kept for callers)."""
        return self

    def key_fields(self) -> dict:
        """The fields that identify the compiled object (every field but `requested`)."""
        d = dataclasses.asdict(self)
        d.pop("requested")
        return d

    def check(self) -> str | None:
        """None when this specialization can be built, else the reason: the spec's own
        static checks, then every sub-kernel's `can_implement` against the per-block
        shared memory of `arch` (from the arch table)."""
        if self.mma not in GEMMS:
            return f"mma {self.mma!r} not in {MMA_KINDS}"
        for name in ("num_experts", "hidden", "intermediate", "topk", "bits", "block_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"{name} must be a positive int, got {v!r}"
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % fmt.HADAMARD_BLOCK:
                return (f"{name} {getattr(self, name)} is not a positive multiple of "
                        f"{fmt.HADAMARD_BLOCK} (the Hadamard block)")
        if not self.has_expert_map and self.topk > self.num_experts:
            return (f"topk {self.topk} is above num_experts {self.num_experts} (a token routes "
                    "to top-k distinct experts; with an expert map the ids are global and may "
                    "outnumber the local experts)")
        if (not isinstance(self.occupancy, int) or isinstance(self.occupancy, bool)
                or not 0 <= self.occupancy <= MAX_CTAS_PER_SM):
            return f"occupancy must be an int in 0..{MAX_CTAS_PER_SM}, got {self.occupancy!r}"
        if self.act_dtype not in ACT_DTYPES:
            return f"act_dtype {self.act_dtype!r} not in {ACT_DTYPES}"
        if self.out_dtype not in OUT_DTYPES:
            return f"out_dtype {self.out_dtype!r} not in {OUT_DTYPES}"
        limits = self.arch_limits()
        if limits is None:
            return f"arch {self.arch!r} is not in the arch table ({', '.join(known_archs())})"
        if self.mma not in limits.mma_kinds:
            return f"mma {self.mma!r} needs {' or '.join(mma_archs(self.mma))}, not {self.arch}"
        if not isinstance(self.span, int) or isinstance(self.span, bool) or self.span < 0:
            return f"span must be an int >= 0, got {self.span!r}"
        if self.topk > MAX_TOPK:
            return f"topk {self.topk} > {MAX_TOPK}"
        reason = check_rates(self.bits, self.bits_set, self.codebook, "n")
        if reason is not None:
            return reason
        if self.table_decode not in TABLE_DECODES:
            return f"table_decode {self.table_decode!r} not in {('auto',) + TABLE_DECODES}"
        reason = check_table_decode(self.codebook, self.table_decode)
        if reason is not None:
            return reason
        if self.coupled:
            if not self.shared_hidden_vectors:
                return "coupled transforms need shared hidden-side vectors"
            if self.hidden % 512:
                return f"coupled transforms need hidden % 512 == 0 (H512), got {self.hidden}"
        book = fmt.CODEBOOK.get(self.codebook)
        if book is not None and book.needs_cvt_e4m3 and not limits.cvt_e4m3:
            return (f"codebook {self.codebook!r} needs cvt.rn.f16x2.e4m3x2 (sm_89 or later), "
                    f"not {self.arch}")
        for sub in self.sub_kernels():
            reason = sub.check(self.smem_limit())
            if reason is not None:
                return reason
        words = self.num_experts * self.hidden * self.intermediate * self.bits // 32
        if words > INDEX_LIMIT:
            return f"one projection holds {words:,} 32-bit words > 2^31 - 1 (32-bit indexing)"
        return None

    def smem_limit(self) -> int | None:
        """Dynamic shared memory one CTA of this arch may allocate: the per-block opt-in
        limit less the DSL's static bytes (`bring.DSL_STATIC_SMEM`), or None for an arch
        the table does not list. The one limit every sub-kernel's `can_implement` and the
        GEMM's `workers_for` / `default_span` are asked against."""
        limits = self.arch_limits()
        return None if limits is None else limits.smem_per_block_optin - DSL_STATIC_SMEM

    def arch_limits(self):
        """The arch table's entry for `arch`, or None for an arch it does not list."""
        try:
            return arch_limits(self.arch)
        except ValueError:
            return None

    @property
    def mixed(self) -> bool:
        """Mixed rates (`bits_set` given): the GEMMs read K per stage from the rate maps."""
        return bool(self.bits_set)

    @staticmethod
    def rate_runs() -> dict:
        """Channels of the intermediate axis that must share one K in a mixed layer, per
        matrix family: an FC1 work item's N tile and an FC2 pipeline stage's rows (the
        GEMMs pick K per stage). QSRT records (128 channels) satisfy both."""
        return {"fc1": TILE_N, "fc2": 16 * K_STEPS_PER_STAGE}

    def sub_kernels(self) -> tuple["SubKernel", ...]:
        """The device kernels `MoEForward` launches, in launch order (the GEMMs once per
        projection shape: gate and up are `gemm1`'s two operands, one launch). Resource
        measurement and the geometry check iterate this list; nothing else names the
        kernels."""
        per_route = not self.shared_hidden_vectors
        gemm = GEMMS[self.mma]
        common = dict(self._gemm_geometry(), topk=self.topk, workers=self.gemm_workers(),
                      min_ctas_per_sm=self.gemm_ctas_per_sm())
        if self._table():  # persistent grid: SMs x resident CTAs
            common["ctas_per_sm"] = self.gemm_resident_ctas()
        rates1, rates2 = {}, {}
        if self.mixed:  # FC1's intermediate axis is its N, FC2's its K
            rates1, rates2 = dict(rate_axis="n"), dict(rate_axis="k")
        return (
            SubKernel("count", RouteCount, dict(num_experts=self.num_experts,
                                                has_map=self.has_expert_map)),
            SubKernel("pack", RoutePack, dict(num_experts=self.num_experts,
                                              block_m=self.block_m,
                                              has_map=self.has_expert_map)),
            SubKernel("rotate_in", RotateInput, dict(hidden=self.hidden, topk=self.topk,
                                                     per_route=per_route,
                                                     has_map=self.has_expert_map,
                                                     coupled=self.coupled)),
            SubKernel("gemm1", gemm, dict(k_dim=self.hidden, n_dim=self.intermediate,
                                          a_rows_per_token=not per_route, **common, **rates1)),
            SubKernel("mid", MidActivation, dict(intermediate=self.intermediate,
                                                 activation=self.activation,
                                                 has_map=self.has_expert_map,
                                                 coupled=self.coupled)),
            SubKernel("gemm2", gemm, dict(k_dim=self.intermediate, n_dim=self.hidden,
                                          a_rows_per_token=False, **common, **rates2)),
            SubKernel("combine", CombineOutput, dict(hidden=self.hidden, topk=self.topk,
                                                     shared_svh=self.shared_hidden_vectors,
                                                     has_map=self.has_expert_map,
                                                     out_dtype=_DSL_DTYPES.get(self.out_dtype),
                                                     coupled=self.coupled)),
        )

    def kernel_launches(self) -> dict:
        """{kernel class name: (threads per block, dynamic shared memory bytes)} of every
        sub-kernel (one entry per class: the two GEMMs of a spec share their geometry)."""
        out = {}
        for sub in self.sub_kernels():
            k = sub.build()
            threads, smem = out.get(sub.name, (0, 0))
            out[sub.name] = (max(threads, k.threads), max(smem, k.smem_bytes))
        return out

    def dynamic_smem(self) -> dict:
        """Dynamic shared memory per block of each kernel (bytes), by kernel class name."""
        return {name: smem for name, (_, smem) in self.kernel_launches().items()}

    def max_tokens(self) -> int:
        """Largest token count whose scratch indices stay inside 32-bit range."""
        return INDEX_LIMIT // (self.topk * max(self.hidden, self.intermediate) + 1) - 1

    def replace(self, **changes) -> "MoESpec":
        """A copy with `changes`; "auto" / 0 requests are resolved again for the copy."""
        mma, span, table_decode, stages = self.requested
        changes.setdefault("stages", stages)
        changes.setdefault("mma", mma)
        changes.setdefault("span", span)
        changes.setdefault("table_decode", table_decode)
        return dataclasses.replace(self, **changes)

    def kernel_name(self) -> str:
        return (f"kq_moe_m{self.block_m}_k{self.bits}_{self.codebook}_{self.act_dtype}_"
                f"{self.out_dtype}_{self.activation}_{'shared' if self.shared_hidden_vectors else 'perexp'}"
                f"{'_map' if self.has_expert_map else ''}{'_cpl' if self.coupled else ''}"
                f"{'_r' + ''.join(map(str, self.bits_set)) if self.bits_set else ''}"
                f"{'_t12' if self.table_decode == 't12' else ''}"
                f"_e{self.num_experts}_h{self.hidden}_"
                f"i{self.intermediate}_t{self.topk}_s{self.stages}"
                f"{f'_o{self.occupancy}' if self.occupancy != 1 else ''}"
                f"{GEMMS[self.mma].kernel_tag if self.mma in GEMMS else '_' + str(self.mma)}"
                f"{f'_x{self.span}' if self.span != 1 else ''}_{self.arch}")

    def _table(self) -> bool:
        """The codebook decodes through state tables (persistent GEMM grid)."""
        book = fmt.CODEBOOK.get(self.codebook)
        return book is not None and book.table

    def _gemm_geometry(self) -> dict:
        """The GEMM constructor arguments both projections share (static questions read
        theirs from it), with the GEMM class's `pair_table_for` answer."""
        geo = dict(block_m=self.block_m, bits=self.bits, codebook=self.codebook,
                   stages=self.stages, span=self.span, bits_set=self.bits_set,
                   table_decode=self.table_decode)
        geo["pair_table"] = self.mma in GEMMS and GEMMS[self.mma].pair_table_for(**geo)
        return geo

    def gemm_ctas_per_sm(self) -> int:
        """The GEMM's register target in CTAs per SM (see `occupancy`). Table codebooks:
        the resident CTAs of their persistent grid, whatever `occupancy` says (registers
        must not leave a grid slot unscheduled)."""
        if self.occupancy and not self._table():
            return self.occupancy
        return self.gemm_resident_ctas()

    def pair_table(self) -> bool:
        """The GEMMs decode through the K=2 pair table (their class's `pair_table_for`;
        `decode.decode_lane_tile_pair`,
        128 KiB, `kquant_cute.trellis.sqg_pair_table`) instead of the 64 KiB direct table:
        the wgmma GEMMs of a uniform sqg_e4m3 layer of K in `PAIR_TABLE_BITS` (sm_90a, whose
        227 KB per block hold the table beside two workers' rings; the mma.sync GEMM runs
        128-thread CTAs, of which the table would leave one per SM, and sm_120's 99 KB per
        block hold no 128 KiB table). The same for every block size and span of a layer,
        so one table serves all of its plans."""
        return self._gemm_geometry()["pair_table"]

    def table_layout(self) -> str | None:
        """What `codebook_table` holds for this spec: "pair" (`pair_table`), "direct" (one
        64 KiB state table per rate, then T12: what the direct and the T12 decodes stage
        from, `kquant_cute.trellis.sqg_kernel_tables`) or None (arithmetic codebooks read
        none)."""
        if not self._table():
            return None
        return "pair" if self.pair_table() else "direct"

    def gemm_workers(self) -> int:
        """Work-item loops per GEMM CTA (the GEMM class's `workers_for` this arch's
        per-block shared memory)."""
        limit = self.smem_limit()
        if limit is None:
            return 1
        return GEMMS[self.mma].workers_for(limit, **self._gemm_geometry())

    def gemm_resident_ctas(self) -> int:
        """GEMM CTAs per SM that shared memory allows (the GEMM class's `resident_ctas`; the
        persistent grid of a table codebook is SMs x this); with T12 also no more than fit
        at the per-thread register maximum: the direct tables' shared memory bounds the
        CTAs long before registers do, T12's 4 KiB does not, and the register cap that
        more CTAs would set makes ptxas spill in the bijection."""
        limits = self.arch_limits()
        smem_per_sm = limits.smem_per_block_optin + SMEM_RESERVED_PER_CTA
        gemm, geo = GEMMS[self.mma], dict(self._gemm_geometry(), workers=self.gemm_workers())
        ctas = gemm.resident_ctas(smem_per_sm, **geo)
        if self.table_decode == "t12":
            threads = gemm.threads_for(**geo)
            ctas = max(1, min(ctas, limits.regs_per_sm // (threads * limits.regs_per_thread_max)))
        return ctas


@dataclass(frozen=True)
class SubKernel:
    """One device kernel of the fused forward: its role (the `MoEForward` attribute), class
    and constructor arguments. Every kernel class answers the same questions: the static
    `can_implement(**args, smem_limit=...)` (a reason or None) and, once built, its
    `threads` per block and dynamic shared memory `smem_bytes`."""

    role: str
    cls: type
    args: dict = field(compare=False)

    @property
    def name(self) -> str:
        """The class name, which is also how the compiled object names this kernel."""
        return self.cls.__name__

    def check(self, smem_limit: int | None = None) -> str | None:
        return self.cls.can_implement(**self.args, smem_limit=smem_limit)

    def build(self):
        return self.cls(**self.args)


def dsl_dtype(name: str, spec: MoESpec):
    if name == "act":
        name = spec.act_dtype
    elif name == "out":
        name = spec.out_dtype
    return _DSL_DTYPES[name]


class MoEForward:
    """Host-side launcher of one specialization (see module docstring)."""

    def __init__(self, spec: MoESpec):
        reason = spec.check()
        if reason is not None:
            raise ValueError(f"cannot build {spec.kernel_name()}: {reason}")
        self.spec = spec
        kernels = {sub.role: sub.build() for sub in spec.sub_kernels()}
        self.count = kernels["count"]
        self.pack = kernels["pack"]
        self.rotate_in = kernels["rotate_in"]
        self.gemm1 = kernels["gemm1"]
        self.mid = kernels["mid"]
        self.gemm2 = kernels["gemm2"]
        self.combine = kernels["combine"]

    @cute.jit
    def __call__(self, x, topk_ids, topk_weights, expert_map, gate_trellis, up_trellis,
                 down_trellis, gate_suh, up_suh, gate_svh, up_svh, down_suh, down_svh,
                 pre_signs, post_signs, codebook_table, fc1_bits, fc1_words, fc2_bits, fc2_words,
                 sorted_routes, block_expert, num_padded,
                 expert_offsets, expert_counts, route_hist, xg, xu, g, u, a2, y, out,
                 m: Int32, max_blocks: Int32, rows_cap: Int32, routes_cap: Int32,
                 sm_count: Int32, fc1_row_words: Int32, stream):
        n_routes = m * self.spec.topk
        rows = n_routes
        a_zero_row = routes_cap
        if cutlass.const_expr(self.spec.shared_hidden_vectors):
            rows = m
            a_zero_row = rows_cap
        self.count(topk_ids, expert_map, route_hist, n_routes, stream)
        self.pack(topk_ids, expert_map, route_hist, sorted_routes, block_expert, num_padded,
                  expert_offsets, expert_counts, n_routes, max_blocks, stream)
        self.rotate_in(x, gate_suh, up_suh, topk_ids, expert_map, xg, xu, rows, stream)
        # Every GEMM takes the per-expert offsets and counts (those with spans read them).
        groups = (block_expert, num_padded, expert_offsets, expert_counts)
        # The rate maps (mixed rates; uniform GEMMs never read them): FC1's per N tile.
        rates1 = (fc1_bits, fc1_words, fc1_row_words)
        # Both FC1 slots in one launch (their work items interleaved: one tail, one table
        # staging). Coupled: both read the one rotated input (xu is not written).
        x_up = xg if self.spec.coupled else xu
        self.gemm1(xg, gate_trellis, sorted_routes, *groups, g, x_up, up_trellis, u, Int32(2),
                   n_routes, a_zero_row, max_blocks, codebook_table, sm_count, *rates1, stream)
        self.mid(g, u, gate_svh, up_svh, down_suh, pre_signs, post_signs, topk_ids, expert_map,
                 a2, n_routes, stream)
        self.gemm2(a2, down_trellis, sorted_routes, *groups, y, a2, down_trellis, y, Int32(1),
                   n_routes, routes_cap,
                   max_blocks, codebook_table, sm_count, fc2_bits, fc2_words, fc1_row_words,
                   stream)
        self.combine(y, down_svh, topk_ids, expert_map, topk_weights, out, m, stream)

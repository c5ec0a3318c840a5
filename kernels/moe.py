"""The fused W4A16 trellis MoE forward: one JIT specialization = one compiled object.

Owns `MoESpec` (the compile-time key of a specialization), its validity predicate
`MoESpec.check()` (static reasons: sizes, alignment, shared memory of the route pack,
32-bit index range), the argument order of the compiled entry point (`ARG_NAMES`), and
`MoEForward`, the `@cute.jit` host function that launches, on one stream with no host
synchronisation and no allocation:

  route pack (M) -> input rotation (gate, up) -> trellis GEMM gate -> trellis GEMM up
  -> FC1 output rotation + activation + FC2 input rotation -> trellis GEMM down
  -> router-weighted top-k sum with FC2's output rotation.

`MoESpec.coupled` adds the QSRT coupled transforms (profile k2_coupled_h512_h128) inside the
three rotation stages (kernels/rotate.py); the per-expert sign vectors are the entry
point's `pre_signs` [E, 2I] / `post_signs` [E, I] fp16 (ignored, any valid address, when
not coupled).

Every pointer argument is a raw device address and every size a 32-bit integer, so an
object compiled on a CPU-only machine has the same C ABI as a JIT compile on the GPU.
Token count, routed experts and the grid (from the plan's block bound) are run-time values.
`codebook_table` is the codebook's state table (sqg_e4m3: uint8 [65536] from
`kquant_cute.trellis.sqg_state_table(bits)`; any valid address for the other codebooks)
and `sm_count` the device's SMs (the table codebooks' GEMMs run a persistent grid).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


from .rotate import ACTIVATIONS, CombineOutput, MidActivation, RotateInput
from .route_pack import RoutePack
from .trellis_gemm import (DEFAULT_STAGES, MAX_CTAS_PER_SM, SMEM_RESERVED_PER_CTA,
                           TABLE_CODEBOOKS, TrellisGemm, smem_bytes as gemm_smem_bytes)
from .trellis_wgmma import TrellisWgmma, check_span, default_span, smem_bytes as wgmma_smem_bytes

ACT_DTYPES = ("bfloat16", "float16")
MMA_KINDS = ("auto", "sync", "wgmma")
WGMMA_ARCH = "sm_90a"
#: Archs without `cvt.rn.f16x2.e4m3x2` (sm_89 and later have it): no sqg_e4m3 decode.
NO_E4M3_CVT_ARCHS = ("sm_80", "sm_86")
OUT_DTYPES = ("float32", "bfloat16", "float16")
MAX_TOPK = 64
INDEX_LIMIT = 2**31 - 1

_DSL_DTYPES = {
    "float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
    "int32": cutlass.Int32, "int16": cutlass.Int16, "uint8": cutlass.Uint8,
}

# Entry-point arguments, in order: (name, dtype of the pointee) for pointers, (name, None)
# for Int32 scalars. The stream comes last.
ARG_NAMES = (
    ("x", "act"), ("topk_ids", "int32"), ("topk_weights", "float32"), ("expert_map", "int32"),
    ("gate_trellis", "int16"), ("up_trellis", "int16"), ("down_trellis", "int16"),
    ("gate_suh", "float16"), ("up_suh", "float16"), ("gate_svh", "float16"),
    ("up_svh", "float16"), ("down_suh", "float16"), ("down_svh", "float16"),
    ("pre_signs", "float16"), ("post_signs", "float16"),
    ("codebook_table", "uint8"),
    ("sorted_routes", "int32"), ("block_expert", "int32"), ("num_padded", "int32"),
    ("expert_offsets", "int32"), ("expert_counts", "int32"),
    ("xg", "float16"), ("xu", "float16"), ("g", "float32"), ("u", "float32"),
    ("a2", "float16"), ("y", "float32"), ("out", "out"),
    ("m", None), ("max_blocks", None), ("rows_cap", None), ("routes_cap", None),
    ("sm_count", None),
)


@dataclass(frozen=True)
class MoESpec:
    """Compile-time key of one fused-forward specialization."""

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
    stages: int = DEFAULT_STAGES
    #: GEMM register target in CTAs per SM (nvvm.minctasm): 1 = none (the default; on the
    #: H200 a target measured no faster), 0 = as many as shared memory allows
    #: (`TrellisGemm.occupancy_target`), n = n.
    occupancy: int = 1
    #: GEMM instruction: "sync" (mma.sync, every arch), "wgmma" (sm_90a only: decoded
    #: weights as the register A operand of async wgmma, see trellis_wgmma) or "auto" (the
    #: faster one measured on the H200, 2026-11-30, docs/benchmarks.md entry 22: wgmma on
    #: sm_90a, else sync).
    mma: str = "auto"
    #: wgmma only: route blocks of one expert per work item (rows = span x block_m <= 128),
    #: so an expert's weights are decoded once per N tile for up to that many rows; 0 =
    #: `trellis_wgmma.default_span(block_m)` under wgmma, 1 under mma.sync.
    span: int = 0
    arch: str = "sm_90a"
    #: QSRT coupled transforms (H512 on the latent axis, signed H128 around the activation,
    #: FC1 slots interleaved per 32-channel atom); needs shared hidden-side vectors.
    coupled: bool = False

    def resolved(self) -> "MoESpec":
        """This spec with `mma` and `span` made concrete for its arch ("auto" / 0 resolved).
        The compiled object, its name and its cache key are those of the resolved spec."""
        mma = self.mma
        if mma == "auto":
            mma = "wgmma" if self.arch == WGMMA_ARCH else "sync"
        span = self.span
        if span == 0 and mma in ("sync", "wgmma"):
            span = default_span(self.block_m) if mma == "wgmma" else 1
        if (mma, span) == (self.mma, self.span):
            return self
        return dataclasses.replace(self, mma=mma, span=span)

    def check(self, smem_limit: int | None = None) -> str | None:
        """None when this specialization can be built, else the reason (static checks)."""
        if self.mma not in MMA_KINDS:
            return f"mma {self.mma!r} not in {MMA_KINDS}"
        if isinstance(self.block_m, int) and (self.mma == "auto" or self.span == 0):
            return self.resolved().check(smem_limit)
        for name in ("num_experts", "hidden", "intermediate", "topk", "bits", "block_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"{name} must be a positive int, got {v!r}"
        if (not isinstance(self.occupancy, int) or isinstance(self.occupancy, bool)
                or not 0 <= self.occupancy <= MAX_CTAS_PER_SM):
            return f"occupancy must be an int in 0..{MAX_CTAS_PER_SM}, got {self.occupancy!r}"
        if self.act_dtype not in ACT_DTYPES:
            return f"act_dtype {self.act_dtype!r} not in {ACT_DTYPES}"
        if self.out_dtype not in OUT_DTYPES:
            return f"out_dtype {self.out_dtype!r} not in {OUT_DTYPES}"
        if self.mma == "wgmma" and self.arch != WGMMA_ARCH:
            return f"mma 'wgmma' needs {WGMMA_ARCH}, not {self.arch}"
        if not isinstance(self.span, int) or isinstance(self.span, bool) or self.span < 0:
            return f"span must be an int >= 0, got {self.span!r}"
        if self.span != 1:
            if self.mma != "wgmma":
                return f"span {self.span!r} needs mma 'wgmma'"
            reason = check_span(self.block_m, self.span)
            if reason is not None:
                return reason
        if self.activation not in ACTIVATIONS:
            return f"activation {self.activation!r} not in {ACTIVATIONS}"
        if self.topk > MAX_TOPK:
            return f"topk {self.topk} > {MAX_TOPK}"
        if self.coupled:
            if not self.shared_hidden_vectors:
                return "coupled transforms need shared hidden-side vectors"
            if self.hidden % 512:
                return f"coupled transforms need hidden % 512 == 0 (H512), got {self.hidden}"
        if self.codebook == "sqg_e4m3" and self.arch in NO_E4M3_CVT_ARCHS:
            return (f"codebook 'sqg_e4m3' needs cvt.rn.f16x2.e4m3x2 (sm_89 or later), "
                    f"not {self.arch}")
        for k_dim, n_dim in ((self.hidden, self.intermediate), (self.intermediate, self.hidden)):
            reason = TrellisGemm.can_implement(block_m=self.block_m, k_dim=k_dim, n_dim=n_dim,
                                               bits=self.bits, codebook=self.codebook,
                                               stages=self.stages, smem_limit=smem_limit)
            if reason is not None:
                return reason
        words = self.num_experts * self.hidden * self.intermediate * self.bits // 32
        if words > INDEX_LIMIT:
            return f"one projection holds {words:,} 32-bit words > 2^31 - 1 (32-bit indexing)"
        if smem_limit is not None and RoutePack.smem_bytes(self.num_experts) > smem_limit:
            return (f"route pack needs {RoutePack.smem_bytes(self.num_experts):,} B shared "
                    f"memory > {smem_limit:,} B limit of {self.arch}")
        return None

    def dynamic_smem(self) -> dict:
        """Dynamic shared memory per block of each kernel (bytes), by kernel class name."""
        self = self.resolved()
        if self.mma == "wgmma":
            return {"TrellisWgmma": wgmma_smem_bytes(self.block_m, self.bits, self.stages,
                                                     self.span, self.codebook),
                    "RoutePack": RoutePack.smem_bytes(self.num_experts)}
        return {"TrellisGemm": gemm_smem_bytes(self.block_m, self.bits, self.stages,
                                               self.codebook),
                "RoutePack": RoutePack.smem_bytes(self.num_experts)}

    def max_tokens(self) -> int:
        """Largest token count whose scratch indices stay inside 32-bit range."""
        return INDEX_LIMIT // (self.topk * max(self.hidden, self.intermediate) + 1) - 1

    def replace(self, **changes) -> "MoESpec":
        return dataclasses.replace(self, **changes)

    def kernel_name(self) -> str:
        self = self.resolved()
        return (f"kq_moe_m{self.block_m}_k{self.bits}_{self.codebook}_{self.act_dtype}_"
                f"{self.out_dtype}_{self.activation}_{'shared' if self.shared_hidden_vectors else 'perexp'}"
                f"{'_map' if self.has_expert_map else ''}{'_cpl' if self.coupled else ''}"
                f"_e{self.num_experts}_h{self.hidden}_"
                f"i{self.intermediate}_t{self.topk}_s{self.stages}"
                f"{f'_o{self.occupancy}' if self.occupancy != 1 else ''}"
                f"{'_wgmma' if self.mma == 'wgmma' else ''}"
                f"{f'_x{self.span}' if self.span != 1 else ''}_{self.arch}")

    def gemm_ctas_per_sm(self) -> int:
        """The GEMM's register target in CTAs per SM (see `occupancy`). Table codebooks:
        the resident CTAs of their persistent grid, whatever `occupancy` says (registers
        must not leave a grid slot unscheduled)."""
        if self.codebook in TABLE_CODEBOOKS:
            return self.gemm_resident_ctas()
        if self.occupancy:
            return self.occupancy
        smem_per_sm = (cutlass.memory.get_smem_capacity_in_bytes(self.arch.removesuffix("a"))
                       + SMEM_RESERVED_PER_CTA)
        return TrellisGemm.occupancy_target(self.block_m, self.bits, self.stages, smem_per_sm)

    def gemm_resident_ctas(self) -> int:
        """GEMM CTAs per SM that shared memory allows (the persistent grid of a table
        codebook is SMs x this)."""
        self = self.resolved()
        smem_per_sm = (cutlass.memory.get_smem_capacity_in_bytes(self.arch.removesuffix("a"))
                       + SMEM_RESERVED_PER_CTA)
        need = self.dynamic_smem()["TrellisWgmma" if self.mma == "wgmma" else "TrellisGemm"]
        return max(1, min(MAX_CTAS_PER_SM, smem_per_sm // (need + SMEM_RESERVED_PER_CTA)))


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
        spec = spec.resolved()
        self.spec = spec
        per_route = not spec.shared_hidden_vectors
        self.pack = RoutePack(num_experts=spec.num_experts, block_m=spec.block_m,
                              has_map=spec.has_expert_map)
        self.rotate_in = RotateInput(hidden=spec.hidden, topk=spec.topk, per_route=per_route,
                                     has_map=spec.has_expert_map, coupled=spec.coupled)
        Gemm = TrellisGemm
        if spec.mma == "wgmma":
            Gemm = functools.partial(TrellisWgmma, span=spec.span)
        if spec.codebook in TABLE_CODEBOOKS:
            Gemm = functools.partial(Gemm, ctas_per_sm=spec.gemm_resident_ctas())
        self.gemm1 = Gemm(block_m=spec.block_m, k_dim=spec.hidden, n_dim=spec.intermediate,
                                 bits=spec.bits, codebook=spec.codebook, topk=spec.topk,
                                 a_rows_per_token=not per_route, stages=spec.stages,
                                 min_ctas_per_sm=spec.gemm_ctas_per_sm())
        self.mid = MidActivation(intermediate=spec.intermediate, activation=spec.activation,
                                 has_map=spec.has_expert_map, coupled=spec.coupled)
        self.gemm2 = Gemm(block_m=spec.block_m, k_dim=spec.intermediate, n_dim=spec.hidden,
                                 bits=spec.bits, codebook=spec.codebook, topk=spec.topk,
                                 a_rows_per_token=False, stages=spec.stages,
                                 min_ctas_per_sm=spec.gemm_ctas_per_sm())
        self.combine = CombineOutput(hidden=spec.hidden, topk=spec.topk,
                                     shared_svh=spec.shared_hidden_vectors,
                                     has_map=spec.has_expert_map,
                                     out_dtype=_DSL_DTYPES[spec.out_dtype], coupled=spec.coupled)

    @cute.jit
    def __call__(self, x, topk_ids, topk_weights, expert_map, gate_trellis, up_trellis,
                 down_trellis, gate_suh, up_suh, gate_svh, up_svh, down_suh, down_svh,
                 pre_signs, post_signs, codebook_table, sorted_routes, block_expert, num_padded,
                 expert_offsets, expert_counts, xg, xu, g, u, a2, y, out,
                 m: Int32, max_blocks: Int32, rows_cap: Int32, routes_cap: Int32,
                 sm_count: Int32, stream):
        n_routes = m * self.spec.topk
        rows = n_routes
        a_zero_row = routes_cap
        if cutlass.const_expr(self.spec.shared_hidden_vectors):
            rows = m
            a_zero_row = rows_cap
        self.pack(topk_ids, expert_map, sorted_routes, block_expert, num_padded,
                  expert_offsets, expert_counts, n_routes, max_blocks, stream)
        self.rotate_in(x, gate_suh, up_suh, topk_ids, expert_map, xg, xu, rows, stream)
        # The wgmma GEMM also reads the per-expert offsets and counts (spans).
        groups = (block_expert, num_padded)
        if cutlass.const_expr(self.spec.mma == "wgmma"):
            groups = (block_expert, num_padded, expert_offsets, expert_counts)
        self.gemm1(xg, gate_trellis, sorted_routes, *groups, g, n_routes, a_zero_row,
                   max_blocks, codebook_table, sm_count, stream)
        # Coupled: both FC1 slots read the one rotated input (xu is not written).
        x_up = xg if self.spec.coupled else xu
        self.gemm1(x_up, up_trellis, sorted_routes, *groups, u, n_routes, a_zero_row,
                   max_blocks, codebook_table, sm_count, stream)
        self.mid(g, u, gate_svh, up_svh, down_suh, pre_signs, post_signs, topk_ids, expert_map,
                 a2, n_routes, stream)
        self.gemm2(a2, down_trellis, sorted_routes, *groups, y, n_routes, routes_cap,
                   max_blocks, codebook_table, sm_count, stream)
        self.combine(y, down_svh, topk_ids, expert_map, topk_weights, out, m, stream)

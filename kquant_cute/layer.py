"""Public serving API: plan, bind and run the fused trellis MoE forward on torch tensors.

Owns `MoELayer`: built once per layer shape (weights, top-k, token capacity, dtypes), it
plans the decode (M = 8) and prefill (policy M with fallback) specializations, gets both
from the compile cache, and allocates ONE scratch arena (sized to the larger plan) plus
one output buffer. `bind(x, topk_ids, topk_weights)` validates every input (dtype, device,
shape, contiguity, capacity, id range) and returns a `BoundForward` holding only views
and raw pointers; `BoundForward.run()` launches on the current torch stream and never
allocates, so it can be captured in a CUDA graph and replayed with new input contents.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import trellis
from .compiler import ForwardPlan, plan_forward
from .kernels.moe import ARG_NAMES, MoESpec
from .planners import resolve_env
from .planners.policy import padded_route_slots
from .weights import MoEWeights

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dt: torch.dtype) -> str:
    for k, v in _TORCH_DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"unsupported activation dtype {dt} (use torch.bfloat16 or torch.float16)")


@dataclass(frozen=True)
class ScratchLayout:
    """Byte offset, size, shape and dtype of every scratch buffer in the shared arena."""

    offsets: dict
    sizes: dict
    shapes: dict
    dtypes: dict
    nbytes: int


def scratch_layout(spec: MoESpec, capacity: int, max_slots: int) -> ScratchLayout:
    E, H, I, k = spec.num_experts, spec.hidden, spec.intermediate, spec.topk
    n = capacity * k
    rows = capacity if spec.shared_hidden_vectors else n
    bufs = [
        ("sorted_routes", (max_slots,), torch.int32),
        ("block_expert", (max_slots // 8 + 1,), torch.int32),
        ("num_padded", (4,), torch.int32),
        ("expert_offsets", (E + 1,), torch.int32),
        ("expert_counts", (E,), torch.int32),
        ("xg", (rows + 1, H), torch.float16),
        ("xu", (rows + 1, H), torch.float16),
        ("g", (n, I), torch.float32),
        ("u", (n, I), torch.float32),
        ("a2", (n + 1, I), torch.float16),
        ("y", (n, H), torch.float32),
    ]
    offsets, sizes, shapes, dtypes, off = {}, {}, {}, {}, 0
    for name, shape, dt in bufs:
        off = (off + 255) // 256 * 256
        numel = 1
        for s in shape:
            numel *= s
        offsets[name], shapes[name], dtypes[name] = off, shape, dt
        sizes[name] = numel * torch.empty((), dtype=dt).element_size()
        off += sizes[name]
    return ScratchLayout(offsets, sizes, shapes, dtypes, (off + 255) // 256 * 256)


def plan_scratch(base: MoESpec, capacity: int, block_ms) -> ScratchLayout:
    """The one arena every plan of a layer shares: M-independent buffers sized once for
    the capacity, the packed route list sized to the widest plan's bound (the max)."""
    n = capacity * base.topk
    slots = max(padded_route_slots(n, base.num_experts, m) for m in block_ms)
    return scratch_layout(base, capacity, slots)


class MoELayer:
    """One MoE layer's compiled plans, scratch and output buffer (see module docstring)."""

    def __init__(self, weights: MoEWeights, *, topk: int, capacity: int,
                 act_dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.float32,
                 activation: str = "silu", num_global_experts: Optional[int] = None,
                 arch: Optional[str] = None, stages: Optional[int] = None,
                 occupancy: Optional[int] = None, mma: Optional[str] = None,
                 span: Optional[int] = None,
                 environ=None, cache=None,
                 banded: bool = False):
        if not isinstance(weights, MoEWeights):
            raise TypeError("weights must be a kquant_cute.weights.MoEWeights")
        if weights.device.type != "cuda":
            raise ValueError("MoELayer needs weights on a CUDA device")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.weights = weights
        self.device = weights.device
        self.capacity = capacity
        self.topk = topk
        self.act_dtype = act_dtype
        self.out_dtype = out_dtype
        self.num_global_experts = num_global_experts
        env = resolve_env(os.environ if environ is None else environ)
        if arch is None:
            major, minor = torch.cuda.get_device_capability(self.device)
            arch = f"sm_{major}{minor}"
        base = MoESpec(num_experts=weights.num_experts, hidden=weights.hidden,
                       intermediate=weights.intermediate, topk=topk, bits=weights.bits,
                       codebook=weights.codebook, block_m=8, act_dtype=_dtype_name(act_dtype),
                       out_dtype=_dtype_name(out_dtype), activation=activation,
                       shared_hidden_vectors=weights.shared_hidden_vectors,
                       has_expert_map=num_global_experts is not None, coupled=weights.coupled)
        if stages is not None:
            base = base.replace(stages=stages)
        if occupancy is not None:
            base = base.replace(occupancy=occupancy)
        if mma is not None:
            base = base.replace(mma=mma)
        if span is not None:
            base = base.replace(span=span)
        if capacity > base.max_tokens():
            raise ValueError(f"capacity {capacity} > {base.max_tokens()} (32-bit scratch indexing)")
        self.plan: ForwardPlan = plan_forward(base, capacity=capacity, arch=arch, env=env,
                                              cache=cache, banded=banded)
        self.plan.load()
        self.scratch = plan_scratch(base, capacity, [s.block_m for s in self.plan.specs()])
        self.arena = torch.zeros(self.scratch.nbytes, dtype=torch.uint8, device=self.device)
        self.output = torch.empty((capacity, weights.hidden), dtype=out_dtype, device=self.device)
        self._views = {name: self._view(name) for name in self.scratch.offsets}
        w = weights
        self._weight_tensors = {
            "gate_trellis": w.gate_trellis, "up_trellis": w.up_trellis, "down_trellis": w.down_trellis,
            "gate_suh": w.gate_suh, "up_suh": w.up_suh, "gate_svh": w.gate_svh, "up_svh": w.up_svh,
            "down_suh": w.down_suh, "down_svh": w.down_svh,
            # Not coupled: the kernels never read the sign pointers; any valid address.
            "pre_signs": w.pre_signs if w.coupled else w.down_suh,
            "post_signs": w.post_signs if w.coupled else w.down_suh,
        }
        for name, t in self._weight_tensors.items():
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"weights.{name} must be contiguous and 16-byte aligned")
        # A placeholder int32 so the expert_map argument always has a valid address.
        self._no_map = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        # The codebook's state table (sqg_e4m3: 64 KiB of E4M3 bytes, staged into shared
        # memory by each persistent GEMM CTA); other codebooks read none (any address).
        if weights.codebook == "sqg_e4m3":
            self._table = trellis.sqg_state_table(weights.bits, self.device)
        else:
            self._table = torch.zeros(16, dtype=torch.uint8, device=self.device)
        self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count

    def _view(self, name: str) -> torch.Tensor:
        sl = self.scratch
        raw = self.arena[sl.offsets[name]: sl.offsets[name] + sl.sizes[name]]
        return raw.view(sl.dtypes[name]).view(sl.shapes[name])

    def describe(self) -> str:
        return self.plan.describe(scratch_bytes={"arena": self.scratch.nbytes,
                                                 "output": self.output.numel() * self.output.element_size()})

    # -- binding -----------------------------------------------------------------------
    def _check_input(self, name, t, dtype, shape):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, expected {self.device}")
        if t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")

    def bind(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
             out: Optional[torch.Tensor] = None, expert_map: Optional[torch.Tensor] = None,
             check_ids: Optional[bool] = None) -> "BoundForward":
        """Validate inputs and return a launchable binding (views and pointers only).

        `check_ids` (default: True unless a CUDA graph is being captured) verifies that
        every id indexes an expert (one device-to-host read); during capture it is skipped.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor [m, hidden]")
        m = x.shape[0]
        if not 1 <= m <= self.capacity:
            raise ValueError(f"token count {m} outside 1..{self.capacity} (the layer's capacity)")
        H = self.weights.hidden
        self._check_input("x", x, self.act_dtype, (m, H))
        self._check_input("topk_ids", topk_ids, torch.int32, (m, self.topk))
        self._check_input("topk_weights", topk_weights, torch.float32, (m, self.topk))
        if out is None:
            out = self.output[:m]
        self._check_input("out", out, self.out_dtype, (m, H))
        n_ids = self.weights.num_experts
        if self.num_global_experts is not None:
            if expert_map is None:
                raise ValueError("this layer was planned with an expert map; pass expert_map")
            self._check_input("expert_map", expert_map, torch.int32, (self.num_global_experts,))
            n_ids = self.num_global_experts
        elif expert_map is not None:
            raise ValueError("expert_map given but the layer was planned without num_global_experts")
        if check_ids is None:
            check_ids = not torch.cuda.is_current_stream_capturing()
        if check_ids:
            lo, hi = torch.aminmax(topk_ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= n_ids:
                raise ValueError(f"topk_ids must lie in [0, {n_ids}), got range [{lo}, {hi}]")
            if expert_map is not None:
                lo, hi = torch.aminmax(expert_map)
                if int(lo) < -1 or int(hi) >= self.weights.num_experts:
                    raise ValueError(f"expert_map values must lie in [-1, {self.weights.num_experts})")
        plan = self.plan.plan_for(m)
        tensors = dict(self._weight_tensors)
        tensors.update(self._views)
        tensors.update(x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out,
                       expert_map=expert_map if expert_map is not None else self._no_map,
                       codebook_table=self._table)
        n = self.capacity * self.topk
        slots = padded_route_slots(m * self.topk, self.weights.num_experts, plan.spec.block_m)
        ints = {
            "m": m,
            "max_blocks": slots // plan.spec.block_m,
            "rows_cap": self.capacity if plan.spec.shared_hidden_vectors else n,
            "routes_cap": n,
            "sm_count": self._sm_count,
        }
        return BoundForward(plan, tensors, ints, out)

    def __call__(self, x, topk_ids, topk_weights, **kw) -> torch.Tensor:
        return self.bind(x, topk_ids, topk_weights, **kw).run()


class BoundForward:
    """A validated call: run() launches on the current stream, allocation-free."""

    def __init__(self, plan, tensors, ints, out):
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        from .kernels.moe import dsl_dtype

        self.plan = plan
        self.out = out
        self._tensors = tensors  # keep the tensors alive while bound
        args = []
        for name, dt in ARG_NAMES:
            if dt is None:
                args.append(cutlass.Int32(ints[name]))
            else:
                args.append(make_ptr(dsl_dtype(dt, plan.spec), tensors[name].data_ptr(),
                                     cute.AddressSpace.gmem, assumed_align=16))
        self._args = args

    @property
    def block_m(self) -> int:
        return self.plan.spec.block_m

    def run(self) -> torch.Tensor:
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(self.out.device).cuda_stream)
        self.plan.fn(*self._args, stream)
        return self.out

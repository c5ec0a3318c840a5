"""Public serving API: plan, bind and run the fused trellis MoE forward on torch tensors.

Owns `MoELayer`: built once per layer shape (weights, top-k, token capacity, dtypes), it
plans the decode (M = 8) and prefill (policy M with fallback) specializations and, when
banded (`planners.default_banded`: every codebook today), the sizes between
them a call's own m selects, gets them
from the compile cache, and allocates ONE scratch arena (its route list sized by the plan's
`RoutePlan.route_slots`, the bound over every token band) plus one output buffer; a call
binds the M of its token band and launches `RoutePlan.max_blocks(m)` route blocks. `bind(x, topk_ids, topk_weights)` validates every input (dtype, device,
shape, contiguity, capacity, id range) and returns a `BoundForward` holding only views
and raw pointers; `BoundForward.run()` launches on the current torch stream and never
allocates, so it can be captured in a CUDA graph and replayed with new input contents.

Mixed-rate weights (`kquant_cute.mixed.MixedMoEWeights`, QSRT `k3x22_k4x2`): the plans get
the layer's rate set (`MoESpec.bits_set`) and the layer binds the rate maps
(`MixedMoEWeights.rate_args`, the launch contract's "rates" arguments) and one state table
per rate; one K throughout binds the uniform kernels on the same storage (it is EXL3's).

Input semantics (the same as `kquant_cute.reference.reference_moe`): m = 0 launches
nothing and returns an empty [0, H] output; a topk id of -1 is "no route" (it contributes
nothing, with or without an expert map; other negative ids are rejected); duplicate ids in
one row each add their weighted expert output; an expert map may send several global ids
to one local expert; a NaN or Inf in a row of x reaches only that token's output row.

Stream rule: the scratch arena is one buffer, so at most one forward may use it at a
time. A layer's arena remembers the stream of its last forward and an event recorded
after it. `run()` on another stream while that forward may still be running raises
(`run(wait_for_previous=True)` instead makes the new stream wait for it, on the GPU, no
host sync). `MoELayer(stream_arenas=True)` gives each stream its own arena (allocated at
the first `bind` on that stream, outside graph capture); a binding then runs only on the
stream it was bound on. During CUDA-graph capture nothing is checked or recorded: order
graph replays against eager forwards of the same arena yourself.

The op: a layer registers itself in `kquant_cute.ops` at construction (`layer.handle`), and
`layer(x, topk_ids, topk_weights)` runs through `torch.ops.kquant.moe_forward` with the
arena as its declared-mutated `scratch` argument, so torch.compile traces a call without a
graph break and CUDA graphs capture it (`op_forward` is the op's implementation for this
layer: the same `bind(...).run()`).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import ops, trellis
from .compile_cache import default_cache
from .compiler import ForwardPlan, plan_forward
from .environment import ConfigurationError, check_environment
from .kernels.launch import ARGS, RATE_ARGS, ScratchLayout, int_args, scratch_layout
from .kernels.moe import MoESpec
from .mixed import MixedMoEWeights
from .planners import resolve_env
from .weights import MoEWeights

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8}


def _dtype_name(dt: torch.dtype) -> str:
    for k, v in _TORCH_DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"unsupported activation dtype {dt} (use torch.bfloat16 or torch.float16)")


def layer_spec(weights, *, topk: int, act_dtype: torch.dtype = torch.bfloat16,
               out_dtype: torch.dtype = torch.float32, activation: str = "silu",
               num_global_experts: Optional[int] = None, stages: Optional[int] = None,
               occupancy: Optional[int] = None, mma: Optional[str] = None,
               span: Optional[int] = None, table_decode: Optional[str] = None) -> MoESpec:
    """The base `MoESpec` (block_m 8) a `MoELayer` with these arguments plans from; weights
    may be any object with the `MoEWeights` shape properties (e.g. CPU weights, to prewarm
    the cache for a GPU run with `compiler.plan_forward`), or `MixedMoEWeights` (their
    `rate_set` becomes `bits_set`, `bits` its widest K; one K: a uniform spec)."""
    bits, bits_set = _rates(weights)
    base = MoESpec(num_experts=weights.num_experts, hidden=weights.hidden,
                   intermediate=weights.intermediate, topk=topk, bits=bits, bits_set=bits_set,
                   codebook=weights.codebook, block_m=8, act_dtype=_dtype_name(act_dtype),
                   out_dtype=_dtype_name(out_dtype), activation=activation,
                   shared_hidden_vectors=weights.shared_hidden_vectors,
                   has_expert_map=num_global_experts is not None,
                   coupled=bool(getattr(weights, "coupled", False)))
    knobs = {"stages": stages, "occupancy": occupancy, "mma": mma, "span": span,
             "table_decode": table_decode}
    return base.replace(**{k: v for k, v in knobs.items() if v is not None})


def _rates(weights) -> tuple[int, tuple]:
    """(bits, bits_set) of a layer's weights: mixed weights with several K give their rate
    set (bits = its widest), everything else a uniform K."""
    if isinstance(weights, MixedMoEWeights):
        rates = weights.rate_set
        return rates[-1], (rates if len(rates) > 1 else ())
    return weights.bits, ()


class MoELayer:
    """One MoE layer's compiled plans, scratch and output buffer (see module docstring)."""

    def __init__(self, weights: MoEWeights, *, topk: int, capacity: int,
                 act_dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.float32,
                 activation: str = "silu", num_global_experts: Optional[int] = None,
                 arch: Optional[str] = None, stages: Optional[int] = None,
                 occupancy: Optional[int] = None, mma: Optional[str] = None,
                 span: Optional[int] = None, table_decode: Optional[str] = None,
                 environ=None, cache=None,
                 banded: Optional[bool] = None, stream_arenas: bool = False):
        # Configuration first: a bad KQUANT_* variable is one clear error here, never a
        # "compile failure" of some specialization later.
        check_environment(os.environ, cache=cache is None, plan_environ=environ)
        if cache is None:
            try:
                cache = default_cache()
            except ValueError as exc:  # pragma: no cover - check_environment saw it first
                raise ConfigurationError([str(exc)]) from None
        if not isinstance(weights, (MoEWeights, MixedMoEWeights)):
            raise TypeError("weights must be a kquant_cute.weights.MoEWeights or a "
                            "kquant_cute.mixed.MixedMoEWeights")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        id_bound = weights.num_experts if num_global_experts is None else num_global_experts
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= id_bound:
            what = ("num_global_experts" if num_global_experts is not None
                    else f"the weights' {weights.num_experts} experts")
            raise ValueError(f"topk must be an int in 1..{id_bound} ({what}), got {topk!r}")
        if weights.device.type != "cuda":
            raise ValueError(
                f"MoELayer needs weights on a CUDA device (these are on {weights.device}). "
                "Without a GPU, plan, describe and prewarm the layer instead: "
                "spec = kquant_cute.layer_spec(weights, topk=...); "
                "kquant_cute.plan_forward(spec, capacity=..., arch='sm_90').describe() or "
                "kquant_cute.prewarm_plans(spec, archs=['sm_90'], capacity=...)")
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
        base = layer_spec(weights, topk=topk, act_dtype=act_dtype, out_dtype=out_dtype,
                          activation=activation, num_global_experts=num_global_experts,
                          stages=stages, occupancy=occupancy, mma=mma, span=span,
                          table_decode=table_decode)
        if capacity > base.max_tokens():
            raise ValueError(f"capacity {capacity} > {base.max_tokens()} (32-bit scratch indexing)")
        self.plan: ForwardPlan = plan_forward(base, capacity=capacity, arch=arch, env=env,
                                              cache=cache, banded=banded)
        self.plan.load()
        self.scratch = scratch_layout(base, capacity=capacity,
                                      max_slots=self.plan.route.route_slots)
        self.stream_arenas = bool(stream_arenas)
        first = _Arena(self.scratch, capacity, weights.hidden, out_dtype, self.device, topk)
        self._arenas = {torch.cuda.current_stream(self.device).cuda_stream: first}
        self._default_arena = first
        self.arena, self.output, self._views = first.buffer, first.output, first.views
        # The launch contract names the weight arguments after MoEWeights' tensors.
        self._weight_tensors = {a.name: getattr(weights, a.name) for a in ARGS if a.kind == "weight"}
        if not weights.coupled:  # the kernels never read the sign pointers; any valid address
            self._weight_tensors.update(pre_signs=weights.down_suh, post_signs=weights.down_suh)
        self._fc1_row_words = 0
        if base.mixed:
            weights.check_rate_runs(MoESpec.rate_runs())
            rates, self._fc1_row_words = weights.rate_args()
            self._weight_tensors.update(rates)
        else:  # uniform kernels never read the rate maps; any valid address
            if isinstance(weights, MixedMoEWeights):
                _check_uniform_storage(weights)
            self._weight_tensors.update({name: weights.down_suh for name in RATE_ARGS})
        for name, t in self._weight_tensors.items():
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"weights.{name} must be contiguous and 16-byte aligned")
        # A placeholder int32 so the expert_map argument always has a valid address.
        self._no_map = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        # The codebook's state table (sqg_e4m3: 64 KiB of E4M3 bytes per K then the 4 KiB
        # T12, or the 128 KiB K=2 pair table; each persistent GEMM CTA stages the part its
        # spec decodes through); other codebooks read none (any address).
        layouts = {s.table_layout() for s in self.plan.specs()}
        if len(layouts) > 1:  # MoESpec.pair_table is the same for every block size
            raise RuntimeError(f"the layer's plans read different state tables: {layouts}")
        if layouts == {"pair"}:  # the K=2 pair table (MoESpec.pair_table)
            self._table = trellis.sqg_pair_table(base.bits, self.device)
        elif trellis.codebook_record(weights.codebook).table:  # direct tables per K, then T12
            self._table = trellis.kernel_tables(weights.codebook, base.bits_set or (base.bits,),
                                                self.device)
        else:
            self._table = torch.zeros(16, dtype=torch.uint8, device=self.device)
        self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.handle = ops.register(self)

    # -- the op interface (kquant_cute.ops) --------------------------------------------
    @property
    def hidden(self) -> int:
        return self.weights.hidden

    def check_scratch(self, scratch: torch.Tensor) -> None:
        """Shape-level check of the op's scratch argument (also on fake tensors)."""
        n = _arena_bytes(self.scratch, self.capacity, self.topk)
        if scratch.dtype != torch.uint8 or tuple(scratch.shape) != (n,):
            raise ValueError(f"scratch must be one of this layer's arenas (uint8 [{n}]), got "
                             f"{scratch.dtype} {tuple(scratch.shape)}")

    def _arena_of(self, scratch: torch.Tensor) -> "_Arena":
        """The arena whose buffer `scratch` is; else views over it (a functionalized graph
        passes a copy of the arena, torch.library.opcheck a clone: the same contents,
        among them the GEMMs' zero rows)."""
        ptr = scratch.data_ptr()
        for stream, arena in self._arenas.items():
            if arena.buffer.data_ptr() == ptr:
                if self.stream_arenas and stream != torch.cuda.current_stream(self.device).cuda_stream:
                    raise RuntimeError(
                        f"scratch is the arena of stream {stream:#x} (stream_arenas=True); "
                        "pass the current stream's arena")
                return arena
        return _Arena.over(scratch, self.scratch, self.capacity, self.topk)

    def op_forward(self, x, topk_ids, topk_weights, out, scratch, expert_map, *,
                   check_ids: bool, wait_for_previous: bool) -> None:
        """`torch.ops.kquant.moe_forward`'s implementation for this layer: bind on the
        arena `scratch` (misaligned ids / weights staged in it) and launch (`check_ids`:
        the host id check unless capturing)."""
        arena = self._arena_of(scratch)
        if topk_ids.device == topk_weights.device == self.device \
                and topk_ids.is_contiguous() and topk_weights.is_contiguous():
            topk_ids, topk_weights = arena.stage(topk_ids, topk_weights)
        self.bind(x, topk_ids, topk_weights, out=out, expert_map=expert_map,
                  check_ids=None if check_ids else False,
                  _arena=arena).run(wait_for_previous=wait_for_previous)

    def _arena_for_current_stream(self) -> "_Arena":
        if not self.stream_arenas:
            return self._default_arena
        handle = torch.cuda.current_stream(self.device).cuda_stream
        arena = self._arenas.get(handle)
        if arena is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "MoELayer(stream_arenas=True): the first bind on a stream allocates its "
                    "arena, which cannot happen during CUDA-graph capture; bind once on this "
                    "stream before capturing")
            arena = _Arena(self.scratch, self.capacity, self.weights.hidden, self.out_dtype,
                           self.device, self.topk)
            self._arenas[handle] = arena
        return arena

    def describe(self) -> str:
        return self.plan.describe(scratch_bytes={"arena": _arena_bytes(self.scratch, self.capacity,
                                                                        self.topk),
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
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")

    def bind(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
             out: Optional[torch.Tensor] = None, expert_map: Optional[torch.Tensor] = None,
             check_ids: Optional[bool] = None, _arena: Optional["_Arena"] = None) -> "BoundForward":
        """Validate inputs and return a launchable binding (views and pointers only).

        `check_ids` (default: True unless a CUDA graph is being captured) verifies that
        every id indexes an expert (one device-to-host read); during capture it is skipped.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor [m, hidden]")
        m = x.shape[0]
        if not 0 <= m <= self.capacity:
            raise ValueError(f"token count {m} outside 0..{self.capacity} (the layer's capacity)")
        H = self.weights.hidden
        self._check_input("x", x, self.act_dtype, (m, H))
        self._check_input("topk_ids", topk_ids, torch.int32, (m, self.topk))
        self._check_input("topk_weights", topk_weights, torch.float32, (m, self.topk))
        arena = self._arena_for_current_stream() if _arena is None else _arena
        if out is None:
            out = arena.output[:m]
        self._check_input("out", out, self.out_dtype, (m, H))
        n_ids = self.weights.num_experts
        if self.num_global_experts is not None:
            if expert_map is None:
                raise ValueError("this layer was planned with an expert map; pass expert_map")
            self._check_input("expert_map", expert_map, torch.int32, (self.num_global_experts,))
            n_ids = self.num_global_experts
        elif expert_map is not None:
            raise ValueError("expert_map given but the layer was planned without num_global_experts")
        if m == 0:  # nothing to route: no launch, an empty output
            return BoundForward(self.plan.decode, {}, {}, out, arena, self._stream_key())
        if check_ids is None:
            check_ids = not torch.cuda.is_current_stream_capturing()
        if check_ids:
            lo, hi = torch.aminmax(topk_ids)
            lo, hi = int(lo), int(hi)
            if lo < -1 or hi >= n_ids:
                raise ValueError(f"topk_ids must lie in [0, {n_ids}) or be -1 (no route), "
                                 f"got range [{lo}, {hi}]")
            if expert_map is not None:
                lo, hi = torch.aminmax(expert_map)
                if int(lo) < -1 or int(hi) >= self.weights.num_experts:
                    raise ValueError(f"expert_map values must lie in [-1, {self.weights.num_experts})")
        plan = self.plan.plan_for(m)
        tensors = dict(self._weight_tensors)
        tensors.update(arena.views)
        tensors.update(x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out,
                       expert_map=expert_map if expert_map is not None else self._no_map,
                       codebook_table=self._table)
        ints = int_args(plan.spec, m=m, capacity=self.capacity,
                        max_blocks=self.plan.route.max_blocks(m), sm_count=self._sm_count,
                        fc1_row_words=self._fc1_row_words)
        return BoundForward(plan, tensors, ints, out, arena, self._stream_key())

    def _stream_key(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self.stream_arenas else None

    def __call__(self, x, topk_ids, topk_weights, *, out: Optional[torch.Tensor] = None,
                 expert_map: Optional[torch.Tensor] = None, check_ids: Optional[bool] = None,
                 wait_for_previous: bool = False) -> torch.Tensor:
        """The forward through `torch.ops.kquant.moe_forward`; returns `out` (default: a
        view of the arena's output buffer, valid until the next forward on it).
        `check_ids=False` skips the host id check (it is skipped while capturing anyway)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor [m, hidden]")
        arena = self._arena_for_current_stream()
        if out is None:
            if not 0 <= x.shape[0] <= self.capacity:
                raise ValueError(f"token count {x.shape[0]} outside 0..{self.capacity} "
                                 "(the layer's capacity)")
            out = arena.output[:x.shape[0]]
        ops.moe_forward(x, topk_ids, topk_weights, out, arena.buffer, expert_map, self.handle,
                        check_ids is not False, wait_for_previous)
        return out


def _check_uniform_storage(weights: MixedMoEWeights) -> None:
    """Mixed storage at one K is EXL3's layout when its rows are not padded; the uniform
    kernels index it so."""
    k = weights.rate_set[0]
    i16, h16 = weights.intermediate // trellis.TILE, weights.hidden // trellis.TILE
    for name, got, want in (("gate_trellis", weights.gate_trellis.shape[2], i16 * 16 * k),
                            ("down_trellis", weights.down_trellis.shape[1], i16 * h16 * 16 * k)):
        if got != want:
            raise ValueError(f"weights.{name}: every tile is at K={k} but rows hold {got} int16, "
                             f"not {want} (padded rows; the uniform kernel needs the EXL3 layout)")


def _arena_bytes(scratch: ScratchLayout, capacity: int, topk: int) -> int:
    """Bytes of an arena buffer: the kernels' scratch plus the two staging slots."""
    return scratch.nbytes + 2 * (-(-capacity * topk * 4 // 16) * 16)


class _Arena:
    """One scratch arena and output buffer, with the stream-ordering state of the stream
    rule (module docstring): the stream of the last forward and an event recorded after it.

    The buffer is the kernels' scratch (`ScratchLayout`) followed by two staging slots of
    [capacity, topk] (int32 ids, fp32 router weights): the op copies a misaligned ids or
    weights tensor there (a compiler may hand it a view at any 4-byte offset), so the
    kernels' 16-byte alignment never reaches the caller. The op's `scratch` argument is
    the whole buffer, or a copy of it (`over`: views only, no stream state)."""

    def __init__(self, scratch: ScratchLayout, capacity: int, hidden: int, out_dtype, device,
                 topk: int, buffer: Optional[torch.Tensor] = None):
        if buffer is None:
            buffer = torch.zeros(_arena_bytes(scratch, capacity, topk), dtype=torch.uint8,
                                 device=device)
            self.output = torch.empty((capacity, hidden), dtype=out_dtype, device=device)
            self.tracked = True
        else:
            self.output, self.tracked = None, False
        self.buffer = buffer
        self.views = {}
        for buf in scratch.buffers:
            raw = self.buffer[buf.offset: buf.offset + buf.nbytes]
            self.views[buf.name] = raw.view(_TORCH_DTYPES[buf.dtype]).view(buf.shape)
        n = capacity * topk * 4
        stage = scratch.nbytes
        self.stage_ids = buffer[stage: stage + n].view(torch.int32).view(capacity, topk)
        stage = -(-(stage + n) // 16) * 16
        self.stage_weights = buffer[stage: stage + n].view(torch.float32).view(capacity, topk)
        self.last_stream: Optional[int] = None
        self.done: Optional[torch.cuda.Event] = None

    @classmethod
    def over(cls, buffer: torch.Tensor, scratch: ScratchLayout, capacity: int, topk: int):
        """Views over a copy of an arena (what a functionalized graph passes the op)."""
        if not buffer.is_contiguous() or buffer.data_ptr() % 16:
            raise ValueError("scratch must be a contiguous, 16-byte aligned copy of the arena")
        return cls(scratch, capacity, 0, None, buffer.device, topk, buffer=buffer)

    def stage(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """`topk_ids` / `topk_weights`, each copied into its staging slot if misaligned."""
        m = topk_ids.shape[0]
        if topk_ids.data_ptr() % 16:
            topk_ids = self.stage_ids[:m].copy_(topk_ids)
        if topk_weights.data_ptr() % 16:
            topk_weights = self.stage_weights[:m].copy_(topk_weights)
        return topk_ids, topk_weights

    def before_launch(self, stream: torch.cuda.Stream, wait_for_previous: bool) -> None:
        if not self.tracked or self.last_stream is None or self.last_stream == stream.cuda_stream:
            return  # same stream: launches are ordered
        if wait_for_previous:
            stream.wait_event(self.done)
        elif not self.done.query():
            raise RuntimeError(
                f"this MoELayer's scratch arena is still in use by a forward on stream "
                f"{self.last_stream:#x}; a forward on stream {stream.cuda_stream:#x} now would "
                "corrupt it. Order the two (run(wait_for_previous=True), or synchronize), or "
                "build the layer with stream_arenas=True for one arena per stream")

    def after_launch(self, stream: torch.cuda.Stream) -> None:
        if not self.tracked:
            return
        if self.done is None:
            self.done = torch.cuda.Event()
        self.done.record(stream)
        self.last_stream = stream.cuda_stream


class BoundForward:
    """A validated call: run() launches on the current stream, allocation-free."""

    def __init__(self, plan, tensors, ints, out, arena: "_Arena", stream_key=None):
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        from .kernels.moe import dsl_dtype

        self.plan = plan
        self.out = out
        self._arena = arena
        self._stream_key = stream_key  # per-stream arenas: the stream it was bound on
        self._tensors = tensors  # keep the tensors alive while bound
        self._empty = not tensors  # m = 0: nothing to launch
        args = []
        if self._empty:
            self._args = args
            return
        for a in ARGS:
            if a.dtype is None:
                args.append(cutlass.Int32(ints[a.name]))
            else:
                args.append(make_ptr(dsl_dtype(a.dtype, plan.spec), tensors[a.name].data_ptr(),
                                     cute.AddressSpace.gmem, assumed_align=16))
        self._args = args

    @property
    def block_m(self) -> int:
        return self.plan.spec.block_m

    def run(self, *, wait_for_previous: bool = False) -> torch.Tensor:
        """Launch on the current stream (see the stream rule in the module docstring)."""
        import cuda.bindings.driver as cuda

        if self._empty:
            return self.out
        stream = torch.cuda.current_stream(self.out.device)
        if self._stream_key is not None and stream.cuda_stream != self._stream_key:
            raise RuntimeError(
                f"this binding uses the arena of stream {self._stream_key:#x} "
                f"(stream_arenas=True); bind again on stream {stream.cuda_stream:#x}")
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._arena.before_launch(stream, wait_for_previous)
        self.plan.fn(*self._args, cuda.CUstream(stream.cuda_stream))
        if not capturing:
            self._arena.after_launch(stream)
        return self.out

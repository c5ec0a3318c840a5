"""Trellis-coded experts inside Hugging Face transformers MoE models.

This module owns the bridge between transformers' sparse MoE blocks and kquant_cute:

* :func:`find_moe_blocks` -- the supported sparse MoE blocks of a model
  (:data:`SUPPORTED_BLOCKS`) and the geometry of their routed experts;
* :func:`quantize_model` -- every routed expert's gate / up / down projection through the
  Viterbi quantizer (:func:`kquant_cute.quantize.quantize`), with a progress bar;
* :func:`save_quantized` / :func:`load_quantized` (owned by :mod:`.exl3_files`) --
  safetensors files with EXL3 tensor names (``{experts}.{e}.{gate_proj|up_proj|down_proj}.{trellis|suh|svh|mcg|mul1}``),
  reloaded through :class:`kquant_cute.weights.TrellisLinear` and
  :meth:`kquant_cute.weights.MoEWeights.from_experts`;
* :class:`TrellisExperts` / :func:`replace_experts` -- a drop-in for the block's
  ``experts`` module: the fused :class:`kquant_cute.layer.MoELayer` on CUDA, the torch
  reference (:class:`kquant_cute.ops.ReferenceMoELayer`) on the CPU, both called through
  the registered op ``torch.ops.kquant.moe_forward``, so ``torch.compile(fullgraph=True)``
  traces a model whole;
* :func:`dequantize_into` -- the dense dequantized weights written back into an original
  experts module (the comparison model the checks run against);
* :class:`RoutingLog` -- the router decisions each experts module received, recorded from
  one model and replayed into another, so two models can be compared with the same
  routing (top-k routing is discontinuous: a token at a near-tie reroutes under any
  numerical change and moves its output wholesale, docs/integration.md);
* :class:`GraphDecoder` -- whole-model decode steps on transformers' ``StaticCache``
  replayed from one captured CUDA graph.

The model's router, shared experts, residuals and everything else stay as they are: in
transformers 5.x every supported block calls ``self.experts(hidden [T, H], top_k_index
[T, k], top_k_weights [T, k])`` with experts stored as stacked ``gate_up_proj`` /
``down_proj`` parameters, so replacing that one module replaces exactly the routed-expert
computation. The fused forward takes int32 ids and fp32 router weights (converted here).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn

from .. import trellis as tc
from ..ops import ReferenceMoELayer, moe_forward
from ..weights import MoEWeights, TrellisLinear
from .exl3_files import EXL3_PROJECTIONS, FILE_FORMAT, load_quantized, save_quantized  # noqa: F401

__all__ = [
    "SUPPORTED_BLOCKS",
    "MoEBlockInfo",
    "find_moe_blocks",
    "quantize_model",
    "quantize_experts",
    "dense_projections",
    "dequantize_into",
    "save_quantized",
    "load_quantized",
    "TrellisExperts",
    "replace_experts",
    "RoutingLog",
    "GraphDecoder",
]

#: Sparse MoE block classes whose routed experts can be replaced. Each calls
#: ``self.experts(hidden, top_k_index, top_k_weights)`` after its own router and adds any
#: shared expert itself (checked in transformers 5.17 and 5.24).
SUPPORTED_BLOCKS: tuple[str, ...] = (
    "Qwen3MoeSparseMoeBlock",   # softmax top-k, optional norm_topk_prob
    "DeepseekV3MoE",            # sigmoid grouped routing + shared experts
    "Qwen2MoeSparseMoeBlock",   # softmax top-k + sigmoid-gated shared expert
    "MixtralSparseMoeBlock",
    "OlmoeSparseMoeBlock",
)

#: Gated activations the fused kernel implements, by transformers' ``hidden_act`` name.
_ACTIVATIONS = {"silu": "silu", "swish": "silu"}
_BACKENDS = ("auto", "fused", "reference")


@dataclass(frozen=True)
class MoEBlockInfo:
    """One sparse MoE block of a model and the geometry of its routed experts."""

    name: str            # module path of the block, e.g. "model.layers.1.mlp"
    experts_name: str    # module path of its experts, e.g. "model.layers.1.mlp.experts"
    block: nn.Module
    experts: nn.Module
    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    activation: str      # kquant_cute activation name

    @property
    def replaced(self) -> bool:
        return isinstance(self.experts, TrellisExperts)


# --------------------------------------------------------------------------------------
# Finding blocks
# --------------------------------------------------------------------------------------


def _experts_geometry(path: str, mod: nn.Module) -> tuple[int, int, int, str]:
    """(E, H, I, activation) of a transformers stacked-experts module, or a ValueError
    naming the module and the feature the fused forward does not implement."""
    if isinstance(mod, TrellisExperts):
        return mod.num_experts, mod.hidden_dim, mod.intermediate_dim, mod.activation
    gate_up = getattr(mod, "gate_up_proj", None)
    down = getattr(mod, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(f"{path}: {type(mod).__name__} has no stacked gate_up_proj / down_proj "
                         "tensors (transformers >= 5 experts layout expected)")
    unsupported = [flag for flag, bad in (("has_bias", True), ("has_gate", False),
                                          ("has_post_expert_norm", True),
                                          ("is_concatenated", False))
                   if getattr(mod, flag, not bad) == bad]
    if getattr(type(mod), "_apply_gate", None) is not None and \
            type(mod)._apply_gate.__name__ != "_default_apply_gate":
        unsupported.append("custom _apply_gate")
    if unsupported:
        raise ValueError(f"{path}: {type(mod).__name__} uses {', '.join(unsupported)}; the "
                         "fused forward implements bias-free gated experts (act(gate) * up)")
    act_name = getattr(getattr(mod, "config", None), "hidden_act", None)
    if act_name not in _ACTIVATIONS:
        raise ValueError(f"{path}: activation {act_name!r} is not supported (supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))})")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{path}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} must be 3-D [E, ., .]")
    transposed = bool(getattr(mod, "is_transposed", False))
    if transposed:  # gate_up [E, H, 2I], down [E, I, H]
        e, h, i2 = gate_up.shape
        want_down = (e, i2 // 2, h)
    else:           # gate_up [E, 2I, H], down [E, H, I]
        e, i2, h = gate_up.shape
        want_down = (e, h, i2 // 2)
    if i2 % 2 or tuple(down.shape) != want_down:
        raise ValueError(f"{path}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} do not describe one [E, H, I] expert stack")
    i = i2 // 2
    for what, n in (("hidden size", h), ("expert intermediate size", i)):
        if n % tc.HADAMARD_BLOCK:
            raise ValueError(f"{path}: {what} {n} is not a multiple of {tc.HADAMARD_BLOCK} "
                             "(trellis tiles are rotated in 128-blocks)")
    return e, h, i, _ACTIVATIONS[act_name]


def _block_topk(path: str, block: nn.Module) -> int:
    for owner in (getattr(block, "gate", None), block):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    k = getattr(getattr(block, "config", None), "num_experts_per_tok", None)
    if isinstance(k, int) and k > 0:
        return k
    raise ValueError(f"{path}: cannot find the router's top-k (no gate.top_k)")


def find_moe_blocks(model: nn.Module) -> list[MoEBlockInfo]:
    """The model's supported sparse MoE blocks, in module order.

    Raises ValueError when the model has no supported block, or has a module that looks
    like an MoE block (``experts`` and ``gate`` children) of an unsupported class.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found, unknown = [], []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in SUPPORTED_BLOCKS:
            experts = getattr(mod, "experts", None)
            if experts is None:
                raise ValueError(f"{name}: {cls} has no experts module")
            path = f"{name}.experts" if name else "experts"
            e, h, i, act = _experts_geometry(path, experts)
            found.append(MoEBlockInfo(name, path, mod, experts, e, h, i, _block_topk(name, mod),
                                      act))
        elif hasattr(mod, "experts") and hasattr(mod, "gate") and not isinstance(mod, TrellisExperts):
            unknown.append(f"{name} ({cls})")
    if unknown:
        raise ValueError(f"unsupported MoE block type(s): {', '.join(unknown)}; supported: "
                         f"{', '.join(SUPPORTED_BLOCKS)}")
    if not found:
        raise ValueError(f"{type(model).__name__} has no supported sparse MoE block "
                         f"(supported: {', '.join(SUPPORTED_BLOCKS)})")
    return found


# --------------------------------------------------------------------------------------
# Dense views, quantization, dequantization
# --------------------------------------------------------------------------------------


def dense_projections(experts: nn.Module) -> dict[str, torch.Tensor]:
    """Views of an original experts module's weights in the ``y = x @ W`` orientation:
    ``gate``, ``up`` [E, H, I] and ``down`` [E, I, H] (no copies)."""
    _, _, i, _ = _experts_geometry(type(experts).__name__, experts)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):
        return {"gate": gate_up[:, :, :i], "up": gate_up[:, :, i:], "down": down}
    return {"gate": gate_up[:, :i, :].transpose(1, 2), "up": gate_up[:, i:, :].transpose(1, 2),
            "down": down.transpose(1, 2)}


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        return None
    return tqdm(total=total, desc=desc, unit="expert")


def quantize_experts(experts: nn.Module, bits: int, codebook: str = "mcg", *,
                     device: Optional[torch.device | str] = None,
                     generator: Optional[torch.Generator] = None,
                     bar=None, **quantize_options: Any) -> MoEWeights:
    """Quantize one original experts module's projections; returns :class:`MoEWeights` on
    ``device`` (default: the weights' device). ``bar`` (a tqdm bar) advances per expert."""
    tc.check_codebook(codebook, bits)
    views = dense_projections(experts)
    dev = torch.device(device) if device is not None else views["gate"].device
    out = []
    with torch.no_grad():
        for e in range(views["gate"].shape[0]):
            out.append({p: TrellisLinear.from_dense(views[p][e], bits, codebook,
                                                    generator=generator, device=dev,
                                                    **quantize_options)
                        for p in EXL3_PROJECTIONS})
            if bar is not None:
                bar.update(1)
    return MoEWeights.from_experts(out)


def quantize_model(model: nn.Module, bits: int = 4, codebook: str = "mcg", *,
                   device: Optional[torch.device | str] = None, seed: int = 0,
                   progress: bool = True, **quantize_options: Any) -> dict[str, MoEWeights]:
    """Trellis-quantize every routed expert of every supported block.

    Returns ``{experts module path: MoEWeights}`` on ``device`` (default: CUDA when
    available, else the CPU); the Viterbi search runs there. Sign vectors come from a CPU
    generator seeded with ``seed``, so a seed gives the same codes on every device up to
    the search's floating-point ties. The model is not modified.
    """
    blocks = find_moe_blocks(model)
    replaced = [b.experts_name for b in blocks if b.replaced]
    if replaced:
        raise ValueError(f"already replaced, nothing dense to quantize: {', '.join(replaced)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    bar = _progress(sum(b.num_experts for b in blocks), f"quantize K={bits} {codebook}", progress)
    result = {}
    try:
        for b in blocks:
            if bar is not None:
                bar.set_postfix_str(b.experts_name)
            result[b.experts_name] = quantize_experts(b.experts, bits, codebook, device=device,
                                                      generator=gen, bar=bar, **quantize_options)
    finally:
        if bar is not None:
            bar.close()
    return result


def dense_weights(weights: MoEWeights, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The dequantized ``gate``, ``up`` [E, H, I] and ``down`` [E, I, H] (``y = x @ W``) of
    ``weights``, built expert by expert with :meth:`TrellisLinear.dense` on their device."""
    e_n, h, i = weights.num_experts, weights.hidden, weights.intermediate
    shapes = {"gate": (e_n, h, i), "up": (e_n, h, i), "down": (e_n, i, h)}
    out = {p: torch.empty(s, dtype=dtype, device=weights.device) for p, s in shapes.items()}
    for e in range(e_n):
        for p, lin in weights.expert(e).items():
            out[p][e].copy_(lin.dense(torch.float32))
    return out


def dequantize_into(model: nn.Module, experts: Mapping[str, MoEWeights]) -> nn.Module:
    """Overwrite the original experts modules named in ``experts`` with the dense
    dequantized weights (cast to each parameter's dtype and device). Returns ``model``."""
    blocks = {b.experts_name: b for b in find_moe_blocks(model)}
    _check_names(blocks, experts)
    with torch.no_grad():
        for name, w in experts.items():
            b = blocks[name]
            if b.replaced:
                raise ValueError(f"{name} is already a TrellisExperts; dequantize into an "
                                 "unreplaced copy of the model")
            _check_geometry(b, w)
            views = dense_projections(b.experts)
            for p, dense in dense_weights(w).items():
                views[p].copy_(dense.to(views[p].device))
    return model


def _check_names(blocks: Mapping[str, MoEBlockInfo], experts: Mapping[str, MoEWeights]) -> None:
    if not isinstance(experts, Mapping):
        raise TypeError("experts must map experts module paths to MoEWeights")
    extra = sorted(set(experts) - set(blocks))
    if extra:
        raise ValueError(f"no supported MoE block has experts at {', '.join(extra)} (the "
                         f"model's: {', '.join(blocks)})")
    for name, w in experts.items():
        if not isinstance(w, MoEWeights):
            raise TypeError(f"experts[{name!r}] must be a MoEWeights, got {type(w).__name__}")


def _check_geometry(block: MoEBlockInfo, w: MoEWeights) -> None:
    got = (w.num_experts, w.hidden, w.intermediate)
    want = (block.num_experts, block.hidden, block.intermediate)
    if got != want:
        raise ValueError(f"{block.experts_name}: quantized experts have (E, H, I) = {got}, the "
                         f"model's block {want}")


# --------------------------------------------------------------------------------------
# The replacement experts module
# --------------------------------------------------------------------------------------


class TrellisExperts(nn.Module):
    """Routed experts of one MoE block on trellis-coded weights.

    Same call as transformers' experts modules: ``forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` in the hidden states' dtype.
    Backend ``"fused"`` runs :class:`kquant_cute.layer.MoELayer` (CUDA weights; token counts
    above ``capacity`` run in chunks of ``capacity``; capture-safe: the layer's plans are
    compiled and its buffers allocated here, at construction); ``"reference"`` runs
    :func:`kquant_cute.reference.reference_moe` in fp32 on any device. Either way the
    forward calls ``torch.ops.kquant.moe_forward`` (:mod:`kquant_cute.ops`) with the layer's
    handle and arena (a non-persistent buffer, ``_scratch``), and reads no tensor data on
    the host outside the op: torch.compile traces it without a graph break, and CUDA graphs
    (``mode="reduce-overhead"``, :class:`GraphDecoder`) capture it. A deep copy builds its
    own layer.

    The weights are a plain attribute, not parameters or buffers, so ``model.to(dtype)``
    cannot cast the fp16 rotation vectors; move the model before replacing.
    """

    def __init__(self, weights: MoEWeights, topk: int, *, activation: str = "silu",
                 backend: str = "auto", capacity: int = 1024,
                 act_dtype: torch.dtype = torch.bfloat16, check_ids: bool = True,
                 **layer_options: Any):
        super().__init__()
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights must be a MoEWeights, got {type(weights).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend {backend!r} not in {_BACKENDS}")
        if backend == "auto":
            backend = "fused" if weights.device.type == "cuda" else "reference"
        if backend == "fused" and weights.device.type != "cuda":
            raise ValueError(f"backend 'fused' needs weights on a CUDA device, got {weights.device}")
        self.weights = weights
        self.num_experts, self.hidden_dim = weights.num_experts, weights.hidden
        self.intermediate_dim = weights.intermediate
        self.top_k, self.activation, self.backend = topk, activation, backend
        self.check_ids = check_ids
        self._layer_options = dict(layer_options)
        if backend == "fused":
            from ..layer import MoELayer  # local: the CPU path never imports the DSL

            self.layer = MoELayer(weights, topk=topk, capacity=capacity, act_dtype=act_dtype,
                                  out_dtype=torch.float32, activation=activation,
                                  **layer_options)
            scratch = self.layer.arena
        else:
            self.layer = ReferenceMoELayer(weights, topk=topk, activation=activation)
            scratch = self.layer.scratch
        self._bind_op(scratch)

    def _bind_op(self, scratch: torch.Tensor) -> None:
        """What a traced forward reads: the op handle and capacity as plain ints and the
        arena as a non-persistent buffer with a static address (CUDA-graph trees may then
        keep its in-place writes inside a graph)."""
        self._handle = self.layer.handle
        self._capacity = self.layer.capacity
        self._act_dtype = self.layer.act_dtype
        self.register_buffer("_scratch", scratch, persistent=False)
        if scratch.is_cuda:
            torch._dynamo.mark_static_address(scratch)

    def __deepcopy__(self, memo):
        """A copy is a new module on its own layer (a new op handle): a fused layer's
        plans and arena are not copied, the copy builds its own."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k in ("layer", "_buffers"):
                continue
            new.__dict__[k] = copy.deepcopy(v, memo)
        new.__dict__["_buffers"] = {}
        if self.backend == "fused":
            from ..layer import MoELayer

            new.layer = MoELayer(new.weights, topk=self.top_k, capacity=self.layer.capacity,
                                 act_dtype=self.layer.act_dtype, out_dtype=torch.float32,
                                 activation=self.activation, **self._layer_options)
            new._bind_op(new.layer.arena)
        else:
            new.layer = copy.deepcopy(self.layer, memo)
            new._bind_op(new.layer.scratch)
        return new

    def extra_repr(self) -> str:
        w = self.weights
        return (f"experts={w.num_experts}, hidden={w.hidden}, intermediate={w.intermediate}, "
                f"top_k={self.top_k}, K={w.bits}, codebook={w.codebook}, "
                f"activation={self.activation}, backend={self.backend}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be [tokens, {self.hidden_dim}], got "
                             f"{tuple(hidden_states.shape)}")
        t = hidden_states.shape[0]
        for name, v in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if tuple(v.shape) != (t, self.top_k):
                raise ValueError(f"{name} must be [{t}, {self.top_k}], got {tuple(v.shape)}")
        # Traceable by torch.compile as it stands (no data_ptr, no host read): the op's
        # fake implementation checks shapes, a compiled graph keeps the call whole.
        ids = top_k_index.to(torch.int32).contiguous()
        wts = top_k_weights.to(torch.float32).contiguous()
        x = hidden_states if self._act_dtype is None else hidden_states.to(self._act_dtype)
        x = x.contiguous()
        out = torch.empty((t, self.hidden_dim), dtype=torch.float32, device=x.device)
        cap = self._capacity
        if cap is None or t <= cap:
            moe_forward(x, ids, wts, out, self._scratch, None, self._handle, self.check_ids)
        else:  # chunks of the capacity; rows of H (a multiple of 128) keep x and out
            # aligned, the op stages misaligned ids / weights rows in its arena
            for s in range(0, t, cap):
                e = min(t, s + cap)
                moe_forward(x[s:e], ids[s:e], wts[s:e], out[s:e], self._scratch, None,
                            self._handle, self.check_ids)
        return out.to(hidden_states.dtype)


def replace_experts(model: nn.Module, experts: Mapping[str, MoEWeights], *,
                    backend: str = "auto", capacity: int = 1024,
                    act_dtype: Optional[torch.dtype] = None, check_ids: bool = True,
                    **layer_options: Any) -> list[str]:
    """Swap the routed experts of every block named in ``experts`` for a
    :class:`TrellisExperts`; returns the replaced module paths.

    Every supported block of the model must be covered (a half-quantized model is refused:
    pass ``experts`` for all of :func:`find_moe_blocks`' blocks). ``act_dtype`` (fused
    only) defaults to the model dtype when it is bf16 / fp16, else bf16; ``layer_options``
    go to :class:`kquant_cute.layer.MoELayer` (e.g. ``banded=True``).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r} not in {_BACKENDS}")
    blocks = {b.experts_name: b for b in find_moe_blocks(model)}
    _check_names(blocks, experts)
    missing = sorted(set(blocks) - set(experts))
    if missing:
        raise ValueError(f"no quantized experts for {', '.join(missing)}")
    for name, w in experts.items():
        b = blocks[name]
        if b.replaced:
            raise ValueError(f"{name} is already replaced")
        _check_geometry(b, w)
    done = []
    for name, w in experts.items():
        b = blocks[name]
        dtype = act_dtype
        if dtype is None:
            p = b.experts.gate_up_proj.dtype
            dtype = p if p in (torch.bfloat16, torch.float16) else torch.bfloat16
        new = TrellisExperts(w, b.topk, activation=b.activation, backend=backend,
                             capacity=capacity, act_dtype=dtype, check_ids=check_ids,
                             **layer_options)
        b.block.experts = new
        done.append(name)
    return done


def cache_kwarg(model: nn.Module) -> str:
    """The forward keyword of the KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def iter_experts(model: nn.Module) -> Iterable[TrellisExperts]:
    """The model's :class:`TrellisExperts` modules."""
    return (m for m in model.modules() if isinstance(m, TrellisExperts))


# --------------------------------------------------------------------------------------
# Routing record / replay
# --------------------------------------------------------------------------------------


class RoutingLog:
    """The ``(top_k_index, top_k_weights)`` every supported block's experts module received,
    per block in call order (forward pre-hooks on the experts modules of
    :func:`find_moe_blocks`, original or :class:`TrellisExperts`).

    ``with log.record(model_a): model_a(ids)`` stores them; ``with log.replay(model_b):
    model_b(ids)`` feeds them, call by call, to ``model_b``'s experts in place of its own
    router's (the router still runs; its decisions are dropped). Both models must have the
    same block paths and make the same calls: a call whose token count differs from the
    recorded one, a call past the recorded ones, or recorded calls left unreplayed raise
    ``ValueError``. Not for CUDA-graph capture (the hooks copy and compare shapes on the host).
    """

    def __init__(self):
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self.calls.values())

    @contextlib.contextmanager
    def record(self, model: nn.Module) -> Iterator["RoutingLog"]:
        """Record (appending to anything recorded before)."""
        handles = []
        try:
            for b in find_moe_blocks(model):
                calls = self.calls.setdefault(b.experts_name, [])

                def hook(mod, args, kwargs, calls=calls):
                    ids, wts = _routing_args(args, kwargs)
                    calls.append((ids.detach().clone(), wts.detach().clone()))
                handles.append(b.experts.register_forward_pre_hook(hook, with_kwargs=True))
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replay(self, model: nn.Module) -> Iterator["RoutingLog"]:
        """Replay every recorded call once, in order; the log itself is not consumed."""
        blocks = find_moe_blocks(model)
        names = [b.experts_name for b in blocks]
        if sorted(names) != sorted(self.calls):
            raise ValueError(f"the log has routing for {', '.join(sorted(self.calls)) or 'no block'}; "
                             f"the model's blocks are {', '.join(sorted(names))}")
        used = dict.fromkeys(names, 0)
        handles = []
        try:
            for b in blocks:
                name, calls = b.experts_name, self.calls[b.experts_name]

                def hook(mod, args, kwargs, name=name, calls=calls):
                    n = used[name]
                    if n >= len(calls):
                        raise ValueError(f"{name}: call {n + 1} past the {len(calls)} recorded")
                    ids, wts = calls[n]
                    hidden = args[0] if args else kwargs["hidden_states"]
                    if hidden.shape[0] != ids.shape[0]:
                        raise ValueError(f"{name}: call {n + 1} has {hidden.shape[0]} tokens, "
                                         f"the recorded one {ids.shape[0]}")
                    used[name] = n + 1
                    _, own_w = _routing_args(args, kwargs)
                    others = {k: v for k, v in kwargs.items() if k not in _CALL_KEYS}
                    return (hidden, ids.to(hidden.device),
                            wts.to(device=hidden.device, dtype=own_w.dtype)), others
                handles.append(b.experts.register_forward_pre_hook(hook, with_kwargs=True))
            yield self
        finally:
            for h in handles:
                h.remove()
        short = {n: (used[n], len(self.calls[n])) for n in names if used[n] != len(self.calls[n])}
        if short:
            raise ValueError("recorded calls not replayed: " + ", ".join(
                f"{n} {u} of {t}" for n, (u, t) in short.items()))


_CALL_KEYS = ("hidden_states", "top_k_index", "top_k_weights")


def _routing_args(args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index, top_k_weights) of an experts call ``(hidden, index, weights)``, given
    positionally (as every supported block calls it) or by keyword."""
    rest = list(args[1:])
    for key in ("top_k_index", "top_k_weights"):
        if key in kwargs:
            rest.append(kwargs[key])
    if len(rest) != 2:
        raise ValueError("experts call without (hidden_states, top_k_index, top_k_weights)")
    return rest[0], rest[1]


# --------------------------------------------------------------------------------------
# Whole-model decode steps in one CUDA graph
# --------------------------------------------------------------------------------------


class GraphDecoder:
    """One-token decode steps of a whole transformers causal LM on its ``StaticCache``,
    replayed from one captured CUDA graph.

    What makes a step capturable: transformers (>= 5) keeps a static cache's fill length on
    the device (each layer's ``cumulative_length``, advanced in place by ``update``) and,
    for a compileable cache and one query token, builds the positions, the rotary
    embedding and the causal mask over the whole ``max_cache_len`` from it with device
    ops, never a host read; the cache's key / value tensors are allocated once, by the
    prefill. So one captured step reads its token from a static ``[batch, 1]`` buffer,
    writes the new key / values at the device-held length and advances it: every replay
    is the next step. :class:`TrellisExperts` launches the fused layer from buffers and
    plans made at its construction; the capture runs with the process compile cache
    frozen, so a specialization that is not already loaded raises instead of compiling.

    ``prefill(ids [batch, P])`` (eager; resets the cache in place, so the graph stays
    valid) returns the last position's logits ``[batch, vocab]``; ``step(ids [batch] or
    [batch, 1])`` returns the next position's logits. The first ``step`` after a prefill
    captures the graph (after ``warmup`` eager steps on a side stream whose cache writes
    are rewound); later ones copy the tokens in and replay. With ``graph=False`` steps run
    eagerly on the same cache (the comparison path, and the CPU path). The returned
    logits of a replayed step are the graph's static output: read or copy them before
    the next step.

    ``step_model`` (with ``graph=False``): the module the steps call instead of ``model``,
    e.g. ``torch.compile(model, fullgraph=True, mode="reduce-overhead")`` -- transformers'
    compiled static path, whose CUDA graphs torch's cudagraph trees capture and replay
    (each step first marks a new cudagraph-tree step). The prefill stays eager.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_cache_len: int, *,
                 graph: bool = True, warmup: int = 2, step_model: Optional[nn.Module] = None):
        import transformers

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2, got {max_cache_len!r}")
        self.device = next(model.parameters()).device
        if graph and self.device.type != "cuda":
            raise ValueError(f"graph=True needs the model on a CUDA device, got {self.device}; "
                             "pass graph=False for eager steps on the static cache")
        if step_model is not None and graph:
            raise ValueError("step_model runs the steps itself: pass graph=False with it")
        self.model, self.batch_size, self.max_cache_len = model, batch_size, max_cache_len
        self.step_model = step_model
        self.use_graph, self.warmup = bool(graph), int(warmup)
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        sliding = [i for i, layer in enumerate(self.cache.layers)
                   if getattr(layer, "is_sliding", False) or not hasattr(layer, "cumulative_length")]
        if sliding:
            raise ValueError(f"cache layers {sliding} are sliding-window / non-static layers, "
                             "which track their length on the host: not capturable here")
        self._kw = cache_kwarg(model)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None
        self.length = 0  # tokens in the cache (host-side bookkeeping; the device holds its own)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids, use_cache=True, **{self._kw: self.cache})
        return out.logits[:, -1]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids must be [{self.batch_size}, tokens], got "
                             f"{tuple(input_ids.shape)}")
        if not 0 < input_ids.shape[1] < self.max_cache_len:
            raise ValueError(f"a {input_ids.shape[1]}-token prompt leaves no room in a "
                             f"{self.max_cache_len}-token cache")
        self.cache.reset()
        self.length = 0
        logits = self._forward(input_ids.to(self.device))
        self.length = input_ids.shape[1]
        return logits

    @torch.no_grad()
    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        if self.length == 0:
            raise RuntimeError("prefill a prompt before the first step")
        if self.length >= self.max_cache_len:
            raise RuntimeError(f"the {self.max_cache_len}-token cache is full")
        ids = next_ids.reshape(self.batch_size, 1)
        if self.step_model is not None:
            torch.compiler.cudagraph_mark_step_begin()
            out = self.step_model(ids.to(self.device), use_cache=True, **{self._kw: self.cache})
            logits = out.logits[:, -1]
        elif not self.use_graph:
            logits = self._forward(ids.to(self.device))
        else:
            if self.graph is None:
                self._capture()
            self.ids.copy_(ids)
            self.graph.replay()
            logits = self.logits
        self.length += 1
        return logits

    def _warm_up(self) -> None:
        """``warmup`` eager steps (first launches, library handles, lazy state), each
        rewound: the lengths go back in place and the next real step overwrites the
        key / values they wrote."""
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]
        for _ in range(self.warmup):
            self._forward(self.ids)
            for layer, n in zip(self.cache.layers, lengths):
                layer.cumulative_length.copy_(n)

    def _capture(self) -> None:
        from ..compile_cache import default_cache

        # The warm-up runs on a side stream (as capture does); MoELayer refuses a launch
        # there while its arena's last forward, from the prefill, may still be running.
        torch.cuda.current_stream(self.device).synchronize()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with default_cache().frozen(), torch.cuda.graph(graph):
            logits = self._forward(self.ids)
        self.graph, self.logits = graph, logits

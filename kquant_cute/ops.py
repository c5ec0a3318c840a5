"""The fused MoE forward as a registered torch op: ``torch.ops.kquant.moe_forward``.

This module owns the op (its schema, its fake implementation, its real implementation),
the registry of bound layers that the op's integer ``handle`` names, and
:class:`ReferenceMoELayer` (the reference math bound under a handle, on any device).
Importing it registers the op; it imports neither cutlass nor the kernels.

    torch.ops.kquant.moe_forward(x [m, H], topk_ids [m, k] int32, topk_weights [m, k] fp32,
                                 out [m, H] (written), scratch (written), expert_map [E_g]
                                 int32 or None, handle, check_ids=True,
                                 wait_for_previous=False) -> None

``out`` receives the layer's output (the fused layer's ``out_dtype``, fp32 by default);
``scratch`` is the layer's arena (``MoELayer.arena``, or the stream's arena with
``stream_arenas=True``; a reference layer's ``scratch`` placeholder). Both are declared
mutated: the op allocates nothing, and two calls on one arena are ordered by their data
dependency on it, also after a compiler has reordered the graph. The ``handle`` is an int
from :func:`register`: the weights, plans and compiled kernels stay in the Python object
it names, so a call passes no weight tensor and does no planning; under torch.compile it is
a constant of the graph. ``check_ids`` lets the fused layer read the id range on the host
(one device-to-host read) unless a CUDA graph is being captured; pass False where calls
must never sync (the reference math always checks: it runs on the host anyway).

Real implementation, every device: the registered object's ``op_forward``. A fused
:class:`kquant_cute.layer.MoELayer` binds and launches on the current stream (no host
sync with ``check_ids=False`` or while capturing, no allocation); a
:class:`ReferenceMoELayer` runs :func:`kquant_cute.reference.reference_moe` in fp32 (the
CPU implementation; CI runs ``torch.library.opcheck`` on it). Fake implementation: the
shape and dtype checks of the bound layer, nothing else (the op returns nothing).

Handles are never reused within a process. The registry holds its objects weakly: a layer
that is freed leaves its handle dead, and a call through it raises.
"""

from __future__ import annotations

import copy
import itertools
import threading
import weakref
from typing import Optional

import torch

from .reference import reference_moe

__all__ = ["moe_forward", "register", "lookup", "ReferenceMoELayer", "OP_NAME"]

OP_NAME = "kquant::moe_forward"

_lock = threading.Lock()
_handles = itertools.count(1)
_registry: dict[int, weakref.ReferenceType] = {}


def register(obj) -> int:
    """Put ``obj`` (an object with the op interface: ``hidden``, ``topk``, ``act_dtype``,
    ``out_dtype``, ``capacity``, ``num_global_experts``, ``check_scratch`` and
    ``op_forward``) in the registry; returns its new handle. Held weakly."""
    with _lock:
        handle = next(_handles)
        _registry[handle] = weakref.ref(obj, lambda _ref, h=handle: _registry.pop(h, None))
    return handle


def lookup(handle: int):
    """The live object registered under ``handle``, or a ValueError naming it."""
    ref = _registry.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        raise ValueError(f"kquant.moe_forward: no live layer under handle {handle} (the layer "
                         "was freed, or the handle comes from another process)")
    return obj


def check_args(layer, x, topk_ids, topk_weights, out, scratch, expert_map) -> None:
    """The shape and dtype contract of one call on ``layer`` (no data read, no device
    check: this is the fake implementation, and the real ones check devices themselves).
    Token counts may be symbolic: the capacity bound becomes a runtime assertion."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("out", out), ("scratch", scratch)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        raise ValueError(f"x must be [tokens, {layer.hidden}], got {tuple(x.shape)}")
    m = x.shape[0]
    if layer.act_dtype is None:
        if not x.dtype.is_floating_point:
            raise ValueError(f"x must be floating point, got {x.dtype}")
    elif x.dtype != layer.act_dtype:
        raise ValueError(f"x has dtype {x.dtype}, expected {layer.act_dtype}")
    for name, t, dt in (("topk_ids", topk_ids, torch.int32),
                        ("topk_weights", topk_weights, torch.float32)):
        if t.dtype != dt:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {dt}")
        if t.dim() != 2 or t.shape[0] != m or t.shape[1] != layer.topk:
            raise ValueError(f"{name} must be [{m}, {layer.topk}], got {tuple(t.shape)}")
    if out.dtype != layer.out_dtype:
        raise ValueError(f"out has dtype {out.dtype}, expected {layer.out_dtype}")
    if out.dim() != 2 or out.shape[0] != m or out.shape[1] != layer.hidden:
        raise ValueError(f"out must be [{m}, {layer.hidden}], got {tuple(out.shape)}")
    if layer.capacity is not None:
        if isinstance(m, int):
            if m > layer.capacity:
                raise ValueError(f"token count {m} outside 0..{layer.capacity} (the layer's "
                                 "capacity)")
        else:  # a symbolic token count (torch.compile): a runtime assertion
            torch._check(m <= layer.capacity, lambda: (
                f"token count above the layer's capacity {layer.capacity}"))
    if layer.num_global_experts is None:
        if expert_map is not None:
            raise ValueError("expert_map given but the layer was bound without num_global_experts")
    else:
        if expert_map is None:
            raise ValueError("this layer was bound with an expert map; pass expert_map")
        if expert_map.dtype != torch.int32 or tuple(expert_map.shape) != (layer.num_global_experts,):
            raise ValueError(f"expert_map must be int32 [{layer.num_global_experts}], got "
                             f"{expert_map.dtype} {tuple(expert_map.shape)}")
    layer.check_scratch(scratch)


#: ``int handle`` (not SymInt): a compiled graph holds the handle as a constant, never a
#: symbol that could stand for another layer.
SCHEMA = ("(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor(a!) out, Tensor(b!) scratch, "
          "Tensor? expert_map, int handle, bool check_ids=True, bool wait_for_previous=False) "
          "-> ()")


@torch.library.custom_op(OP_NAME, mutates_args=("out", "scratch"), schema=SCHEMA)
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor, scratch: torch.Tensor, expert_map: Optional[torch.Tensor],
                handle: int, check_ids: bool = True, wait_for_previous: bool = False) -> None:
    """The MoE forward of the layer registered under ``handle`` into ``out`` (module
    docstring)."""
    layer = lookup(handle)
    check_args(layer, x, topk_ids, topk_weights, out, scratch, expert_map)
    layer.op_forward(x, topk_ids, topk_weights, out, scratch, expert_map,
                     check_ids=check_ids, wait_for_previous=wait_for_previous)


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, out, scratch, expert_map, handle,
                      check_ids=True, wait_for_previous=False) -> None:
    check_args(lookup(handle), x, topk_ids, topk_weights, out, scratch, expert_map)


class ReferenceMoELayer:
    """The reference MoE layer (:func:`kquant_cute.reference.reference_moe`, fp32) bound
    under an op handle, on the weights' device; the op's CPU implementation.

    Same call as :class:`kquant_cute.layer.MoELayer`: ``layer(x, topk_ids, topk_weights,
    expert_map=None)`` returns ``[m, H]`` fp32 through ``torch.ops.kquant.moe_forward``.
    ``x`` may be any floating dtype; there is no token capacity. A deep copy is a new
    layer under a new handle.
    """

    act_dtype = None
    out_dtype = torch.float32
    capacity = None

    def __init__(self, weights, *, topk: int, activation: str = "silu",
                 num_global_experts: Optional[int] = None):
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be a positive int, got {topk!r}")
        self.weights = weights
        self.topk = topk
        self.activation = activation
        self.num_global_experts = num_global_experts
        self.hidden = weights.hidden
        self.device = weights.device
        # The op declares a scratch argument; the reference math needs none.
        self.scratch = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self.handle = register(self)

    def __deepcopy__(self, memo):
        new = ReferenceMoELayer(copy.deepcopy(self.weights, memo), topk=self.topk,
                                activation=self.activation,
                                num_global_experts=self.num_global_experts)
        memo[id(self)] = new
        return new

    def check_scratch(self, scratch: torch.Tensor) -> None:
        if scratch.dtype != torch.uint8 or scratch.dim() != 1:
            raise ValueError("scratch must be the layer's uint8 placeholder (layer.scratch)")

    def op_forward(self, x, topk_ids, topk_weights, out, scratch, expert_map, *,
                   check_ids: bool, wait_for_previous: bool) -> None:
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                        ("out", out)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the layer's weights on {self.device}")
        y = reference_moe(x, topk_ids, topk_weights, self.weights, activation=self.activation,
                          dtype=torch.float32, expert_map=expert_map)
        out.copy_(y)

    def __call__(self, x, topk_ids, topk_weights, *, expert_map=None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            out = torch.empty((x.shape[0], self.hidden), dtype=self.out_dtype, device=x.device)
        moe_forward(x, topk_ids, topk_weights, out, self.scratch, expert_map, self.handle)
        return out

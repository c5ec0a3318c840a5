"""Tensor- and expert-parallel MoE layers over torch.distributed (NCCL on GPUs, gloo on CPUs).

This module owns how one MoE layer is spread over ranks and how the ranks' partial outputs
are combined (docs/distributed.md):

* :class:`ParallelPlan` -- a pure description of one rank of a ``tp_size x ep_size`` grid
  (rank = ep_rank * tp_size + tp_rank): its intermediate channels (whole 128-wide Hadamard
  blocks, quotient/remainder, padded to the widest rank), its experts (contiguous
  quotient/remainder, padded to the largest count) and its expert map (global id -> local
  id, -1 = not on this rank);
* :func:`shard_weights` / :func:`shard_experts` -- a full :class:`MoEWeights` (or a QSRT
  rank from :mod:`kquant_cute.qsrt`, which owns the QSRT TP extents) cut to one rank;
* :class:`DistributedMoE` -- one rank's layer: the per-rank compute (the fused
  :class:`~kquant_cute.layer.MoELayer`, or :func:`~kquant_cute.reference.reference_moe` for
  CPU checks) followed by the combine: ``all_reduce`` of the rank's partial output when every
  rank holds the same tokens, or all-gather of the tokens + ``reduce_scatter`` of the
  outputs when each rank holds its own slice. ``bind`` validates once; ``run`` is
  allocation-free and, on NCCL, can be captured in a CUDA graph with its collectives;
* :func:`launch` -- one process per device (torchrun's environment, or local processes with
  a file rendezvous). The whole-layer check against the unsharded fp64 reference that the
  tests and ``benchmarks/dist_check.py`` run is built on these.

Why the sharding is exact: on the intermediate axis every operation is either elementwise
(gate/up ``svh``, ``down_suh``, the activation, the coupled sign vectors) or block-diagonal
over 128-wide Hadamard blocks (FC1's output rotation, FC2's input rotation; the coupled
pre-activation H128 covers 64 channels of each FC1 slot), so a cut at a multiple of 128
splits FC2's reduction over the intermediate axis into per-rank partial sums. Everything on
the hidden side (``gate_suh``, ``up_suh``, ``down_svh``, H512) is replicated, and FC2's output
rotation is linear, so summing the rotated partials equals rotating the sum.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from . import trellis as tc
from .weights import MoEWeights

__all__ = [
    "CHANNEL_ALIGN",
    "ParallelPlan",
    "layouts",
    "shard_weights",
    "shard_experts",
    "DistributedMoE",
    "BoundDistributedForward",
    "launch",
    "init_from_env",
    "TOKEN_LAYOUTS",
]

#: Intermediate-axis cut granularity: the Hadamard block (trellis tiles are 16 wide, but a
#: 128-wide rotation block must not straddle two ranks).
CHANNEL_ALIGN = tc.HADAMARD_BLOCK

TOKEN_LAYOUTS = ("replicated", "sharded")


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(first, count) of part ``index`` of ``n`` units split quotient/remainder."""
    q, r = divmod(n, parts)
    return index * q + min(index, r), q + int(index < r)


def _pos_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


# --------------------------------------------------------------------------------------
# The plan of one rank
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelPlan:
    """Rank ``rank`` of a ``tp_size x ep_size`` grid over a layer of ``num_experts`` experts
    and ``intermediate`` channels (both global).

    ``rank = ep_rank * tp_size + tp_rank``: the ranks of one expert group are consecutive, so
    a TP group is a contiguous set of GPUs. Every rank computes a partial output of all
    tokens; the sum over all ``world_size`` ranks is the layer's output (one collective over
    the whole group).

    ``pad``: every rank is built at the widest channel count and the largest expert count,
    so all ranks share one kernel specialization (one compile, one CUDA graph shape).
    Padded channels carry zero ``svh`` / ``down_suh`` (their activations and FC2
    contributions are exactly zero); padded experts are never in the expert map.
    """

    num_experts: int
    intermediate: int
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    pad: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "intermediate", "tp_size", "ep_size"):
            _pos_int(name, getattr(self, name))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or \
                not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank!r} is out of range for tp_size {self.tp_size} x "
                             f"ep_size {self.ep_size} = {self.world_size} ranks")
        if self.intermediate % CHANNEL_ALIGN:
            raise ValueError(f"intermediate {self.intermediate} is not a multiple of "
                             f"{CHANNEL_ALIGN} (the Hadamard block a shard boundary must respect)")
        blocks = self.intermediate // CHANNEL_ALIGN
        if self.tp_size > blocks:
            raise ValueError(f"tp_size {self.tp_size} > {blocks} Hadamard blocks of "
                             f"{CHANNEL_ALIGN} channels in intermediate {self.intermediate}: a "
                             "rank would hold no channels")
        if self.ep_size > self.num_experts:
            raise ValueError(f"ep_size {self.ep_size} > num_experts {self.num_experts}: a rank "
                             "would hold no experts")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp_size

    def channel_range(self, tp_rank: Optional[int] = None) -> tuple[int, int]:
        """(first channel, channel count) of ``tp_rank`` (default: this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        first, count = _split(self.intermediate // CHANNEL_ALIGN, self.tp_size, t)
        return first * CHANNEL_ALIGN, count * CHANNEL_ALIGN

    def expert_range(self, ep_rank: Optional[int] = None) -> tuple[int, int]:
        """(first global expert, expert count) of ``ep_rank`` (default: this rank's)."""
        return _split(self.num_experts, self.ep_size, self.ep_rank if ep_rank is None else ep_rank)

    @property
    def local_intermediate(self) -> int:
        """The intermediate width this rank's weights are built at (padded if ``pad``)."""
        if self.pad:
            return self.channel_range(0)[1]  # rank 0 holds the most blocks
        return self.channel_range()[1]

    @property
    def local_experts(self) -> int:
        """The expert count this rank's weights are built at (padded if ``pad``)."""
        return self.expert_range(0)[1] if self.pad else self.expert_range()[1]

    @property
    def uses_expert_map(self) -> bool:
        return self.ep_size > 1

    def expert_map(self, device: Optional[torch.device | str] = None) -> Optional[torch.Tensor]:
        """int32 [num_experts]: global id -> local id on this rank, -1 elsewhere (None
        without expert parallelism: ids are then local and every expert is here)."""
        if not self.uses_expert_map:
            return None
        first, count = self.expert_range()
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        emap[first:first + count] = torch.arange(count, dtype=torch.int32)
        return emap.to(device) if device is not None else emap

    def describe(self) -> str:
        c0, cn = self.channel_range()
        e0, en = self.expert_range()
        return (f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp_size}, ep "
                f"{self.ep_rank}/{self.ep_size}): channels [{c0}, {c0 + cn}) of "
                f"{self.intermediate} (built at {self.local_intermediate}), experts [{e0}, "
                f"{e0 + en}) of {self.num_experts} (built at {self.local_experts})")


def layouts(world_size: int) -> list[tuple[int, int]]:
    """Every (tp_size, ep_size) with tp_size * ep_size == world_size, TP-only first."""
    _pos_int("world_size", world_size)
    return [(world_size // ep, ep) for ep in range(1, world_size + 1) if world_size % ep == 0]


# --------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------

# Tensors with an intermediate axis: name -> (axis, channels per unit). Trellis axes count
# 16-channel tiles; pre_signs holds 2 coordinates per channel (the coupled 2I axis; slot s
# channel c sits at 64 * (c // 32) + 32 * s + c % 32, so a cut at a multiple of 128 channels
# is a cut at twice that coordinate).
_CHANNEL_AXES = {
    "gate_trellis": (2, tc.TILE), "up_trellis": (2, tc.TILE), "down_trellis": (1, tc.TILE),
    "gate_svh": (1, 1), "up_svh": (1, 1), "down_suh": (1, 1),
    "pre_signs": (1, 0.5), "post_signs": (1, 1),
}
# Padding values: zero vectors make padded channels / experts contribute exactly nothing;
# sign vectors must stay +-1.
_PAD_ONE = ("pre_signs", "post_signs")


def _fields(w: MoEWeights) -> dict[str, Any]:
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}


def _pad_axis(name: str, t: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    if t.shape[axis] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[axis] = size
    out = (torch.ones if name in _PAD_ONE else torch.zeros)(shape, dtype=t.dtype, device=t.device)
    out.narrow(axis, 0, t.shape[axis]).copy_(t)
    return out


def shard_experts(weights: MoEWeights, plan: ParallelPlan) -> MoEWeights:
    """``weights`` (all ``plan.num_experts`` experts, any intermediate width) cut to the plan's
    experts, padded to ``plan.local_experts``. Shared ([H]) hidden-side vectors are kept;
    per-expert ones are cut like the experts. Use it on a QSRT rank
    (``qsrt.load_layer(..., tp_size=plan.tp_size, tp_rank=plan.tp_rank)``) for EP x TP."""
    if weights.num_experts != plan.num_experts:
        raise ValueError(f"weights have {weights.num_experts} experts, the plan "
                         f"{plan.num_experts}")
    if plan.ep_size == 1:
        return weights
    first, count = plan.expert_range()
    size = plan.local_experts
    shared = weights.shared_hidden_vectors
    out = _fields(weights)
    for name, t in out.items():
        if not isinstance(t, torch.Tensor) or (shared and name in ("gate_suh", "up_suh",
                                                                    "down_svh")):
            continue
        out[name] = _pad_axis(name, t[first:first + count], 0, size)
    return MoEWeights(**out)


def shard_weights(weights: MoEWeights, plan: ParallelPlan) -> MoEWeights:
    """The plan's rank of a full layer: its experts (:func:`shard_experts`) and its
    intermediate channels ``plan.channel_range()`` (whole 128-channel Hadamard blocks), padded
    to ``plan.local_intermediate`` with zero vectors. Hidden-side vectors are replicated.

    For QSRT coupled weights given here the cut is exact too (the pre-activation H128 blocks
    cover 64 channels of each FC1 slot); a whole QSRT layer file has two input vectors (its
    halves) and is sharded by :mod:`kquant_cute.qsrt`, which owns its TP extents.
    """
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a MoEWeights, got {type(weights).__name__}")
    if weights.intermediate != plan.intermediate:
        raise ValueError(f"weights have intermediate {weights.intermediate}, the plan "
                         f"{plan.intermediate}")
    w = shard_experts(weights, plan)
    if plan.tp_size == 1:
        return w
    c0, cn = plan.channel_range()
    size = plan.local_intermediate
    out = _fields(w)
    for name, (axis, per_unit) in _CHANNEL_AXES.items():
        t = out[name]
        if t is None:
            continue
        lo, n, full = int(c0 / per_unit), int(cn / per_unit), int(size / per_unit)
        out[name] = _pad_axis(name, t.narrow(axis, lo, n), axis, full)
    return MoEWeights(**out)


# --------------------------------------------------------------------------------------
# Collectives (torch renamed the tensor forms: use whichever this torch has)
# --------------------------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    return dist


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


# --------------------------------------------------------------------------------------
# Per-rank compute
# --------------------------------------------------------------------------------------


class _KernelCompute:
    """The fused forward (MoELayer) of one rank; writes its partial into ``out``."""

    capturable = True

    def __init__(self, shard: MoEWeights, plan: ParallelPlan, *, topk: int, capacity: int,
                 act_dtype: torch.dtype, out_dtype: torch.dtype, activation: str,
                 **layer_kwargs):
        from .layer import MoELayer

        self.layer = MoELayer(shard, topk=topk, capacity=capacity, act_dtype=act_dtype,
                              out_dtype=out_dtype, activation=activation,
                              num_global_experts=plan.num_experts if plan.uses_expert_map
                              else None, **layer_kwargs)
        self.device = shard.device

    def bind(self, x, topk_ids, topk_weights, out, expert_map, check_ids):
        return self.layer.bind(x, topk_ids, topk_weights, out=out, expert_map=expert_map,
                               check_ids=check_ids).run

    def describe(self) -> str:
        return self.layer.describe()


class _ReferenceCompute:
    """:func:`reference_moe` of one rank (CPU checks): exact, allocating, not capturable."""

    capturable = False

    def __init__(self, shard: MoEWeights, plan: ParallelPlan, *, topk: int, capacity: int,
                 act_dtype: torch.dtype, out_dtype: torch.dtype, activation: str):
        if out_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the reference backend computes in float32 or float64, not "
                             f"{out_dtype}")
        self.shard, self.activation, self.dtype = shard, activation, out_dtype
        self.device = shard.device

    def bind(self, x, topk_ids, topk_weights, out, expert_map, check_ids):
        from .reference import reference_moe

        def run():
            out.copy_(reference_moe(x, topk_ids, topk_weights, self.shard,
                                    activation=self.activation, dtype=self.dtype,
                                    expert_map=expert_map))
            return out

        return run

    def describe(self) -> str:
        return f"reference_moe ({self.dtype})"


_BACKENDS = {"kernel": _KernelCompute, "reference": _ReferenceCompute}


# --------------------------------------------------------------------------------------
# One rank's distributed layer
# --------------------------------------------------------------------------------------


class DistributedMoE:
    """One rank's share of a tensor/expert-parallel MoE layer (see module docstring).

    Args:
        shard: this rank's weights (:func:`shard_weights`, or a QSRT rank through
            :func:`shard_experts`), on this rank's device.
        plan: this rank's :class:`ParallelPlan`; ``plan.world_size`` must equal the size of
            ``group``.
        topk, activation, act_dtype: as :class:`~kquant_cute.layer.MoELayer`.
        capacity: most tokens per call *on this rank* (``tokens="sharded"``: the layer itself
            is planned for ``world_size * capacity`` gathered tokens).
        comm_dtype: dtype of the partial outputs and of the collective (the layer's
            ``out_dtype``): float32 (default: the kernel accumulates in fp32, so the sum
            rounds once, at the end) or the activation dtype (half the bytes; every rank's
            partial and every ring hop rounds to it). float64 only with the reference.
        tokens: ``"replicated"`` (every rank passes the same tokens: partials summed with
            one ``all_reduce``) or ``"sharded"`` (each rank passes its own equally sized
            slice: ``all_gather`` of x / ids / weights, compute on all, ``reduce_scatter``).
        group: the torch.distributed process group (default: the world).
        backend: ``"kernel"`` (the fused forward, CUDA) or ``"reference"`` (torch reference,
            any device; for CPU/gloo checks).
        layer_kwargs: passed to :class:`~kquant_cute.layer.MoELayer` (``banded``, ``mma``...).
    """

    def __init__(self, shard: MoEWeights, plan: ParallelPlan, *, topk: int, capacity: int,
                 comm_dtype: torch.dtype = torch.float32,
                 act_dtype: torch.dtype = torch.bfloat16, activation: str = "silu",
                 tokens: str = "replicated", group=None, backend: str = "kernel",
                 **layer_kwargs):
        dist = _dist()
        if not isinstance(shard, MoEWeights):
            raise TypeError(f"shard must be a MoEWeights, got {type(shard).__name__}")
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"plan must be a ParallelPlan, got {type(plan).__name__}")
        if tokens not in TOKEN_LAYOUTS:
            raise ValueError(f"tokens must be one of {TOKEN_LAYOUTS}, got {tokens!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {tuple(_BACKENDS)}, got {backend!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (init_process_group, or "
                               "kquant_cute.distributed.launch / init_from_env)")
        world = dist.get_world_size(group)
        if world != plan.world_size or dist.get_rank(group) != plan.rank:
            raise ValueError(f"plan is rank {plan.rank} of {plan.world_size}, the process group "
                             f"says rank {dist.get_rank(group)} of {world}")
        if shard.num_experts != plan.local_experts:
            raise ValueError(f"shard has {shard.num_experts} experts, the plan builds ranks at "
                             f"{plan.local_experts} (use shard_weights / shard_experts)")
        _pos_int("capacity", capacity)
        self.plan, self.group, self.tokens = plan, group, tokens
        self.topk, self.capacity, self.comm_dtype, self.act_dtype = topk, capacity, comm_dtype, act_dtype
        self.hidden = shard.hidden
        self.device = shard.device
        total = capacity * (world if tokens == "sharded" else 1)
        kw = dict(topk=topk, capacity=total, act_dtype=act_dtype, out_dtype=comm_dtype,
                  activation=activation)
        self.compute = _BACKENDS[backend](shard, plan, **kw, **layer_kwargs)
        dev = self.device
        self.expert_map = plan.expert_map(dev)
        # Persistent buffers: bind() hands out views, run() never allocates.
        self.partial = torch.empty(total, self.hidden, dtype=comm_dtype, device=dev)
        if tokens == "sharded":
            self.x_all = torch.empty(total, self.hidden, dtype=act_dtype, device=dev)
            self.ids_all = torch.empty(total, topk, dtype=torch.int32, device=dev)
            self.w_all = torch.empty(total, topk, dtype=torch.float32, device=dev)
            self.output = torch.empty(capacity, self.hidden, dtype=comm_dtype, device=dev)

    def describe(self) -> str:
        return (f"{self.plan.describe()}; tokens {self.tokens}, combine "
                f"{'all_reduce' if self.tokens == 'replicated' else 'all_gather + reduce_scatter'}"
                f" in {self.comm_dtype}\n{self.compute.describe()}")

    def bind(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
             check: Optional[bool] = None) -> "BoundDistributedForward":
        """Validate this rank's inputs; return a :class:`BoundDistributedForward`.

        ``x`` [m, H] (act dtype), ``topk_ids`` [m, topk] int32 *global* expert ids,
        ``topk_weights`` [m, topk] fp32. ``"replicated"``: the same tensors on every rank.
        ``"sharded"``: this rank's m tokens; every rank must pass the same m (checked with
        one small all_gather when ``check``, default: not while capturing a CUDA graph).
        """
        if check is None:
            check = not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        for name, t, dt in (("x", x, self.act_dtype), ("topk_ids", topk_ids, torch.int32),
                            ("topk_weights", topk_weights, torch.float32)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D torch.Tensor")
            if t.dtype != dt:
                raise ValueError(f"{name} has dtype {t.dtype}, expected {dt}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, expected {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        m = x.shape[0]
        if not 1 <= m <= self.capacity:
            raise ValueError(f"token count {m} outside 1..{self.capacity} (this rank's capacity)")
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has hidden {x.shape[1]}, the layer {self.hidden}")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(t.shape) != (m, self.topk):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(m, self.topk)}")
        if check:
            if m and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.plan.num_experts):
                raise ValueError(f"topk_ids must be global expert ids in [0, "
                                 f"{self.plan.num_experts})")
        if self.tokens == "replicated":
            out = self.partial[:m]
            run = self.compute.bind(x, topk_ids, topk_weights, out, self.expert_map,
                                    check_ids=False)
            return BoundDistributedForward(self, run, out, out, None)
        world = self.plan.world_size
        if check:
            sizes = torch.empty(world, dtype=torch.int64, device=self.device)
            _all_gather(sizes, torch.full((1,), m, dtype=torch.int64, device=self.device),
                        self.group)
            if bool((sizes != m).any()):
                raise ValueError(f"tokens='sharded' needs the same token count on every rank, "
                                 f"got {sizes.tolist()}")
        n = world * m
        gathered = (self.x_all[:n], self.ids_all[:n], self.w_all[:n])
        out = self.partial[:n]
        run = self.compute.bind(*gathered, out, self.expert_map, check_ids=False)
        return BoundDistributedForward(self, run, out, self.output[:m],
                                       ((x, topk_ids, topk_weights), gathered))

    def __call__(self, x, topk_ids, topk_weights, **kw) -> torch.Tensor:
        return self.bind(x, topk_ids, topk_weights, **kw).run()


class BoundDistributedForward:
    """A validated call of one rank: :meth:`run` = (gather) + compute + combine, in stream
    order, allocation-free with the kernel backend (capturable with its collectives)."""

    def __init__(self, owner: DistributedMoE, compute: Callable[[], Any], partial: torch.Tensor,
                 out: torch.Tensor, gather):
        self.owner, self._compute, self.partial, self.out, self._gather = (owner, compute,
                                                                            partial, out, gather)

    @property
    def block_m(self) -> Optional[int]:
        """The route block M of the bound kernel plan (None for the reference backend)."""
        return getattr(getattr(self._compute, "__self__", None), "block_m", None)

    def run_compute(self) -> torch.Tensor:
        """The rank's partial output only (no collective): the single-GPU shard time."""
        return self._compute()

    def run_comm(self) -> torch.Tensor:
        """The collectives only (on whatever the buffers hold): the communication time."""
        g = self.owner.group
        if self._gather is not None:
            for local, full in zip(*self._gather):
                _all_gather(full, local, g)
            _reduce_scatter(self.out, self.partial, g)
        else:
            _dist().all_reduce(self.partial, group=g)
        return self.out

    def run(self) -> torch.Tensor:
        g = self.owner.group
        if self._gather is not None:
            for local, full in zip(*self._gather):
                _all_gather(full, local, g)
            self._compute()
            _reduce_scatter(self.out, self.partial, g)
        else:
            self._compute()
            _dist().all_reduce(self.partial, group=g)
        return self.out

    def capture(self, *, warmup: int = 1) -> "torch.cuda.CUDAGraph":
        """Capture :meth:`run` (compute and collectives) into a CUDA graph. Runs it eagerly
        ``warmup`` times first (the NCCL communicator is created by the first collective,
        which must not happen inside the capture). Replay after writing new input contents
        into the bound tensors."""
        if not self.owner.compute.capturable or self.owner.device.type != "cuda":
            raise RuntimeError("only the kernel backend on CUDA can be captured")
        side = torch.cuda.Stream(self.owner.device)
        side.wait_stream(torch.cuda.current_stream(self.owner.device))
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                self.run()
        torch.cuda.current_stream(self.owner.device).wait_stream(side)
        torch.cuda.synchronize(self.owner.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.run()
        return graph


# --------------------------------------------------------------------------------------
# Launcher: one process per device
# --------------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def init_from_env(backend: Optional[str] = None, *, timeout_s: float = 300.0) -> tuple[int, int]:
    """``init_process_group`` from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT); NCCL ranks bind ``cuda:LOCAL_RANK``. Returns (rank, world_size)."""
    dist = _dist()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kw = {}
    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s),
                            **kw)
    return dist.get_rank(), dist.get_world_size()


def _child(rank: int, fn, world: int, backend: str, store: str, outdir: str, timeout_s: float,
           args: tuple) -> None:
    dist = _dist()
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # N CPU ranks share the host's cores
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kw)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def launch(fn: Callable[..., Any], nprocs: int, *, backend: str, args: Sequence[Any] = (),
           timeout_s: float = 300.0, start_method: Optional[str] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes, one per rank, with the
    process group initialised (``backend`` "nccl": rank r on ``cuda:r``; "gloo": CPU), and
    return the per-rank results (``torch.save``-able) in rank order.

    Under torchrun (its environment present) nothing is spawned: the process group comes
    from the environment and every rank gets all ranks' results (``all_gather_object``). Otherwise the ranks
    rendezvous through a file store in a fresh temporary directory (no TCP port to pick or
    collide on) and the call fails after ``timeout_s`` (children that did not finish are
    terminated). ``start_method``: default "fork" for gloo when CUDA is not initialised here
    (fast: no re-import), "spawn" otherwise (CUDA children must not be forked).
    """
    if _under_torchrun():
        init_from_env(backend, timeout_s=timeout_s)
        dist = _dist()
        try:
            result = fn(dist.get_rank(), dist.get_world_size(), *args)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
        finally:
            dist.destroy_process_group()
        return gathered
    import torch.multiprocessing as mp

    _pos_int("nprocs", nprocs)
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise RuntimeError(f"{nprocs} NCCL ranks need {nprocs} GPUs, "
                           f"{torch.cuda.device_count()} present")
    if start_method is None:
        fork_ok = backend == "gloo" and not torch.cuda.is_initialized() and sys.platform == "linux"
        start_method = "fork" if fork_ok else "spawn"
    with tempfile.TemporaryDirectory(prefix="kquant-dist-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_child, args=(fn, nprocs, backend, store, tmp, timeout_s,
                                               tuple(args)),
                                 nprocs=nprocs, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{nprocs} ranks did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(nprocs)]

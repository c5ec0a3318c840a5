"""Torch reference MoE layer and reference route pack: the numerical oracles for the kernels.

This module owns:

* the activations (:data:`ACTIVATIONS`, :func:`activation_fn`: SiLU-gated and SiTU);
* :func:`reference_moe` -- a trellis MoE layer computed the way the fused kernel factors it
  (per-projection input rotation, decoded ``W_hat``, output rotation; with shared hidden-side
  vectors the gate/up input rotations run once per token and FC2's output rotation once per
  token after the top-k sum), in float32 or float64, with an optional expert map for expert
  parallelism; for QSRT coupled weights (``weights.coupled``) the coupled transforms of the
  ``k2_coupled_h512_h128`` profile, step by step (:func:`_coupled_moe`); mixed-rate weights
  (:class:`~kquant_cute.mixed.MixedMoEWeights`, per-tile K) go through the same math, each
  expert's ``W_hat`` decoded record by record (:func:`decoded_weight`);
* :func:`naive_moe` -- the same layer as a plain per-token, per-route loop over dense
  weights (``weights.expert(e)[name].dense()``; for coupled weights the dense expert matrices
  with every transform folded in, :func:`coupled_dense_expert`), the test oracle for
  :func:`reference_moe`;
* :class:`RoutePack` / :func:`route_pack_reference` -- the per-expert route packing of
  docs/formats.md, "Route policy" (histogram, counts padded to the route block, prefix sums,
  packed route ids with a sentinel, expert id per block).

Weights come from :mod:`kquant_cute.weights` (``MoEWeights``), decoding from
:mod:`kquant_cute.trellis`. Everything runs on CPU (or any torch device) and is meant for
correctness, not speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import trellis
from .planners.policy import padded_route_slots

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .mixed import MixedMoEWeights
    from .weights import MoEWeights

    AnyWeights = MoEWeights | MixedMoEWeights

__all__ = [
    "ACTIVATIONS",
    "SITU_BETA",
    "SITU_LBETA",
    "activation_fn",
    "reference_moe",
    "naive_moe",
    "coupled_dense_expert",
    "plain_dense_expert",
    "decoded_weight",
    "RoutePack",
    "route_pack_reference",
]

#: Activation names accepted by :func:`activation_fn` and the MoE references.
ACTIVATIONS: tuple[str, ...] = ("silu", "situ")
#: SiTU gate saturation: ``beta * tanh(gate / beta) * sigmoid(gate)``.
SITU_BETA: float = 4.0
#: SiTU up saturation: ``lbeta * tanh(up / lbeta)``.
SITU_LBETA: float = 25.0

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _silu_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _situ_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = SITU_BETA * torch.tanh(gate / SITU_BETA) * torch.sigmoid(gate)
    return g * (SITU_LBETA * torch.tanh(up / SITU_LBETA))


_ACTIVATION_FNS: dict[str, Activation] = {"silu": _silu_gated, "situ": _situ_gated}


def activation_fn(name: str) -> Activation:
    """The gated activation ``act(gate, up)`` named ``name``.

    * ``"silu"``: ``silu(gate) * up``;
    * ``"situ"``: ``beta*tanh(gate/beta)*sigmoid(gate) * lbeta*tanh(up/lbeta)`` with
      ``beta = SITU_BETA = 4.0`` and ``lbeta = SITU_LBETA = 25.0``.

    Raises:
        ValueError: for an unknown name (the message lists :data:`ACTIVATIONS`).
    """
    try:
        return _ACTIVATION_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}") from None


# --------------------------------------------------------------------------------------
# Input validation shared by the MoE references and the route pack
# --------------------------------------------------------------------------------------


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _check_topk_ids(topk_ids: object) -> torch.Tensor:
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [m, topk], got shape {tuple(topk_ids.shape)}")
    if not _is_int_dtype(topk_ids.dtype):
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids needs at least one route per token, got shape {tuple(topk_ids.shape)}")
    return topk_ids


def _local_expert_ids(
    topk_ids: torch.Tensor, num_local: int, expert_map: Optional[torch.Tensor]
) -> torch.Tensor:
    """int64 tensor shaped like ``topk_ids``: the local expert of every route, -1 if none.

    Without ``expert_map`` the ids are already local and must lie in ``[0, num_local)``.
    With it they are global ids in ``[0, len(expert_map))`` and map to
    ``expert_map[id]`` in ``[-1, num_local)``. An id of -1 means "no route" in both cases
    (it maps to -1 and contributes nothing); any other negative id is an error.
    """
    ids = topk_ids.to(torch.int64)
    if expert_map is None:
        bound, what = num_local, "local experts"
    else:
        if not isinstance(expert_map, torch.Tensor):
            raise ValueError(f"expert_map must be a torch.Tensor, got {type(expert_map).__name__}")
        if expert_map.dim() != 1 or expert_map.numel() < 1:
            raise ValueError(f"expert_map must be 1-D [E_global], got shape {tuple(expert_map.shape)}")
        if not _is_int_dtype(expert_map.dtype):
            raise ValueError(f"expert_map must have an integer dtype, got {expert_map.dtype}")
        emap = expert_map.to(device=ids.device, dtype=torch.int64)
        if bool(((emap < -1) | (emap >= num_local)).any()):
            raise ValueError(
                f"expert_map values must be -1 (not on this rank) or local ids in [0, {num_local}), "
                f"got min {int(emap.min())} max {int(emap.max())}"
            )
        bound, what = emap.numel(), "global experts (len(expert_map))"
    if ids.numel() and bool(((ids < -1) | (ids >= bound)).any()):
        raise ValueError(
            f"topk_ids must lie in [0, {bound}) ({what}) or be -1 (no route), got min "
            f"{int(ids.min())} max {int(ids.max())}"
        )
    if expert_map is None:
        return ids
    return torch.where(ids >= 0, emap[ids.clamp(min=0)], torch.full_like(ids, -1))


def _check_moe_inputs(
    x: object,
    topk_ids: object,
    topk_weights: object,
    weights: "MoEWeights",
    activation: str,
    dtype: torch.dtype,
    expert_map: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Activation]:
    """Validate the MoE reference arguments; return the local expert ids [m, k] and the act."""
    act = activation_fn(activation)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m, hidden], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if x.shape[1] != weights.hidden:
        raise ValueError(f"x has hidden size {x.shape[1]}, the weights {weights.hidden}")
    ids = _check_topk_ids(topk_ids)
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {ids.shape[0]} rows, x has {x.shape[0]}")
    if not isinstance(topk_weights, torch.Tensor):
        raise ValueError(f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
    if topk_weights.shape != ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(ids.shape)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    local = _local_expert_ids(ids, weights.num_experts, expert_map)
    return local.to(x.device), act


def decoded_weight(weights: "AnyWeights", proj: str, e: int) -> torch.Tensor:
    """float32 ``W_hat`` of expert ``e``'s projection ``proj`` ([in, out]): one decode at the
    layer's K, or for mixed-rate weights each run of equal-K tiles at its own K."""
    if hasattr(weights, "fc1_bits"):
        return weights.w_hat(proj, e)
    return trellis.decode(getattr(weights, f"{proj}_trellis")[e], weights.codebook)


def _per_expert(vec: torch.Tensor, e: int) -> torch.Tensor:
    """``vec[e]`` for a per-expert [E, n] vector, ``vec`` itself for a shared [n] one."""
    return vec if vec.dim() == 1 else vec[e]


# --------------------------------------------------------------------------------------
# MoE references
# --------------------------------------------------------------------------------------


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: "MoEWeights",
    *,
    activation: str = "silu",
    dtype: torch.dtype = torch.float32,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference trellis MoE layer, factored like the fused kernel: ``[m, hidden]`` in ``dtype``.

    For every route ``(t, k)`` to local expert ``e`` with router weight ``w``:
    ``g = FC1_gate_e(x_t)``, ``u = FC1_up_e(x_t)``, ``y = FC2_e(act(g, u))`` and
    ``out_t += w * y``. Each projection is applied as ``((x * suh) @ H_blk) @ W_hat @ H_blk *
    svh``. Hidden-side vectors shared across experts (1-D ``gate_suh`` / ``up_suh`` /
    ``down_svh``) are applied once per token: the gate/up input rotations before routing and
    FC2's output rotation after the weighted top-k sum (valid because that sum is linear).

    Only routed experts are decoded, each once per call (its routes are gathered), so the
    cost scales with the routed experts, not ``E``.

    Args:
        x: ``[m, hidden]`` floating activations (any float dtype; computed in ``dtype``).
        topk_ids: ``[m, topk]`` integer expert ids -- local ids in ``[0, E)``, or global ids in
            ``[0, len(expert_map))`` when ``expert_map`` is given; -1 = no route. Duplicate
            ids in one row each add their weighted expert output.
        topk_weights: ``[m, topk]`` floating router weights.
        weights: the layer's :class:`~kquant_cute.weights.MoEWeights` (``E`` local experts).
        activation: one of :data:`ACTIVATIONS`.
        dtype: ``torch.float32`` or ``torch.float64`` (computation and result).
        expert_map: optional integer ``[E_global]``: global id -> local id, or -1 for experts
            not on this rank (their routes contribute nothing).

    Raises:
        ValueError: for bad shapes, dtypes, ids out of range, an unknown activation or dtype.
    """
    local, act = _check_moe_inputs(x, topk_ids, topk_weights, weights, activation, dtype, expert_map)
    if weights.coupled:
        return _coupled_moe(x, local, topk_weights, weights, act, dtype)
    m, hidden = x.shape
    device = x.device
    xw = x.to(dtype)
    rw = topk_weights.to(device=device, dtype=dtype)

    def rot_in(rows: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
        return trellis.rotate_blocks(rows * suh.to(device=device, dtype=dtype), dim=-1)

    def rot_out(rows: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
        return trellis.rotate_blocks(rows, dim=-1) * svh.to(device=device, dtype=dtype)

    def w_hat(proj: str, e: int) -> torch.Tensor:
        return decoded_weight(weights, proj, e).to(device=device, dtype=dtype)

    shared_gate_in = weights.gate_suh.dim() == 1
    shared_up_in = weights.up_suh.dim() == 1
    shared_down_out = weights.down_svh.dim() == 1
    xg_all = rot_in(xw, weights.gate_suh) if shared_gate_in else None
    xu_all = rot_in(xw, weights.up_suh) if shared_up_in else None

    # Accumulates sum_k w_k * y1_k (pre output rotation) when down_svh is shared, else the
    # finished per-route outputs.
    acc = torch.zeros(m, hidden, dtype=dtype, device=device)
    routed = torch.unique(local[local >= 0]).tolist()
    for e in routed:
        tok, kk = (local == e).nonzero(as_tuple=True)
        wts = rw[tok, kk].unsqueeze(1)
        xg = xg_all[tok] if xg_all is not None else rot_in(xw[tok], weights.gate_suh[e])
        xu = xu_all[tok] if xu_all is not None else rot_in(xw[tok], weights.up_suh[e])
        gate = rot_out(xg @ w_hat("gate", e), weights.gate_svh[e])
        up = rot_out(xu @ w_hat("up", e), weights.up_svh[e])
        h = rot_in(act(gate, up), weights.down_suh[e])
        y1 = h @ w_hat("down", e)
        y = y1 if shared_down_out else rot_out(y1, weights.down_svh[e])
        acc.index_add_(0, tok, y * wts)
    if shared_down_out:
        acc = rot_out(acc, weights.down_svh)
    return acc


def naive_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: "MoEWeights",
    *,
    activation: str = "silu",
    dtype: torch.dtype = torch.float32,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MoE layer as a plain loop over tokens and routes with dense weights (test oracle).

    Same arguments, validation and result as :func:`reference_moe`; every route computes
    ``w * (act(x_t @ W_gate, x_t @ W_up) @ W_down)`` with ``W = weights.expert(e)[name].dense(dtype)``
    (plus the layer bias, if any). Dense weights are built once per routed expert per call.
    """
    local, act = _check_moe_inputs(x, topk_ids, topk_weights, weights, activation, dtype, expert_map)
    m, hidden = x.shape
    out = torch.zeros(m, hidden, dtype=dtype, device=x.device)
    dense: dict[int, dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]] = {}

    def layers(e: int) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
        if e not in dense and (weights.coupled or hasattr(weights, "fc1_bits")):
            build = coupled_dense_expert if weights.coupled else plain_dense_expert
            mats = build(weights, e, dtype)
            dense[e] = {name: (w.to(x.device), None) for name, w in mats.items()}
        if e not in dense:
            mats = {}
            for name, lin in weights.expert(e).items():
                w = lin.dense(dtype).to(device=x.device)
                b = None if lin.bias is None else lin.bias.to(device=x.device, dtype=dtype)
                mats[name] = (w, b)
            dense[e] = mats
        return dense[e]

    def apply(v: torch.Tensor, wb: tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
        w, b = wb
        return v @ w if b is None else v @ w + b

    for t in range(m):
        xt = x[t].to(dtype)
        for k in range(local.shape[1]):
            e = int(local[t, k])
            if e < 0:
                continue
            mats = layers(e)
            h = act(apply(xt, mats["gate"]), apply(xt, mats["up"]))
            out[t] += topk_weights[t, k].to(dtype) * apply(h, mats["down"])
    return out


# --------------------------------------------------------------------------------------
# QSRT coupled transforms (profile k2_coupled_h512_h128)
# --------------------------------------------------------------------------------------


def _interleave_atoms(slot0: torch.Tensor, slot1: torch.Tensor) -> torch.Tensor:
    """[..., I] x 2 -> [..., 2I]: per 32-channel atom, 32 of slot 0 then 32 of slot 1."""
    atom = 32  # kquant_cute.qsrt.ATOM_CHANNELS (a storage fact of the coupled profile)
    lead, n = slot0.shape[:-1], slot0.shape[-1]
    pair = torch.stack((slot0.reshape(*lead, n // atom, atom),
                        slot1.reshape(*lead, n // atom, atom)), dim=-2)
    return pair.reshape(*lead, 2 * n)


def _coupled_moe(
    x: torch.Tensor,
    local: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: "MoEWeights",
    act: Activation,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The coupled MoE layer, one step per line (b12x ``_reference_coupled_decoded`` order).

    ``H128`` is the block-diagonal 128-point Hadamard of :func:`trellis.rotate_blocks`, ``H512``
    :func:`trellis.rotate_h512` (both symmetric, self-inverse). Per route to expert ``e``:

    1. ``z = H512(x)`` on the latent axis (same for all experts);
    2. ``a = H128(z * suh)`` (one input vector per rank: ``gate_suh == up_suh``);
    3. ``raw = interleave_atoms(a @ W_hat_slot0, a @ W_hat_slot1)`` -- the 2I pre-activation
       axis, 32 channels of each slot per atom; ``svh`` is interleaved the same way;
    4. ``pre = H128(H128(raw) * svh) * pre_signs[e]``;
    5. ``h = act(pre[0::2], pre[1::2]) * post_signs[e]`` (gate / up are the even / odd
       coordinates);
    6. ``y = H128(H128(H128(h) * down_suh) @ W_hat_down) * down_svh``;

    then ``out = H512(sum_k w_k * y_k)`` (H512 is its own inverse; ``down_svh`` is shared, so
    it, like H512, is applied once per token after the sum).
    """
    device = x.device
    rw = topk_weights.to(device=device, dtype=dtype)

    def vec(v: torch.Tensor) -> torch.Tensor:
        return v.to(device=device, dtype=dtype)

    def w_hat(proj: str, e: int) -> torch.Tensor:
        return decoded_weight(weights, proj, e).to(device=device, dtype=dtype)

    h128 = trellis.rotate_blocks
    z = trellis.rotate_h512(x.to(dtype))                                   # 1
    a_all = h128(z * vec(weights.gate_suh))                                # 2
    acc = torch.zeros(x.shape[0], weights.hidden, dtype=dtype, device=device)
    for e in torch.unique(local[local >= 0]).tolist():
        tok, kk = (local == e).nonzero(as_tuple=True)
        a = a_all[tok]
        raw = _interleave_atoms(a @ w_hat("gate", e),                    # 3
                                a @ w_hat("up", e))
        svh = _interleave_atoms(vec(weights.gate_svh[e]), vec(weights.up_svh[e]))
        pre = h128(h128(raw) * svh) * vec(weights.pre_signs[e])          # 4
        h = act(pre[:, 0::2], pre[:, 1::2]) * vec(weights.post_signs[e])  # 5
        d = h128(h128(h) * vec(weights.down_suh[e]))                      # 6
        y1 = h128(d @ w_hat("down", e))
        acc.index_add_(0, tok, y1 * rw[tok, kk].unsqueeze(1))
    return trellis.rotate_h512(acc * vec(weights.down_svh))


def _sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The normalised n-point Sylvester Hadamard, ``(-1)^popcount(i & j) / sqrt(n)``."""
    idx = torch.arange(n)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for b in range(max(n - 1, 1).bit_length()):
        parity ^= (both >> b) & 1
    return ((1 - 2 * parity).to(torch.float64) / n ** 0.5).to(dtype)


def coupled_dense_expert(
    weights: "MoEWeights", e: int, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Expert ``e`` of coupled weights in the ordinary basis: ``{"gate", "up"}`` [H, I] and
    ``"down"`` [I, H] with ``y = act(x @ gate, x @ up) @ down`` (router weight aside).

    Built as explicit matrices (block-diagonal Sylvester Hadamards, sign diagonals, the atom
    interleave as a permutation) rather than by transforming activations, so it checks
    :func:`_coupled_moe` independently: ``A = H512 diag(suh) H128 [W0 | W1] P H128 diag(svh)
    H128 diag(pre_signs)``, ``gate = A[:, 0::2]``, ``up = A[:, 1::2]``, ``down = diag(post_signs)
    H128 diag(down_suh) H128 W_down H128 diag(down_svh) H512``.
    """
    work = torch.float64
    hid, inter = weights.hidden, weights.intermediate

    def blockdiag(block: int, n: int) -> torch.Tensor:
        return torch.block_diag(*[_sylvester(block, work)] * (n // block))

    def diag(v: torch.Tensor) -> torch.Tensor:
        return torch.diag(v.to(device="cpu", dtype=work))

    def w_hat(proj: str) -> torch.Tensor:
        return decoded_weight(weights, proj, e).cpu().to(work)

    h512 = blockdiag(512, hid)
    both = torch.cat((w_hat("gate"), w_hat("up")), dim=1)
    # Column j of [W0 | W1] lands at pre coordinate dest[j]: slot s, channel c -> 64*(c//32)
    # + 32*s + c%32.
    c = torch.arange(inter)
    dest = torch.cat((64 * (c // 32) + c % 32, 64 * (c // 32) + 32 + c % 32))
    perm = torch.zeros(2 * inter, 2 * inter, dtype=work)
    perm[torch.arange(2 * inter), dest] = 1.0
    svh = torch.zeros(2 * inter, dtype=work)
    svh[dest] = torch.cat((weights.gate_svh[e], weights.up_svh[e])).to(device="cpu", dtype=work)
    h_pre, h_post = blockdiag(128, 2 * inter), blockdiag(128, inter)
    a = (h512 @ diag(weights.gate_suh) @ blockdiag(128, hid) @ both @ perm @ h_pre
         @ torch.diag(svh) @ h_pre @ diag(weights.pre_signs[e]))
    down = (diag(weights.post_signs[e]) @ h_post @ diag(weights.down_suh[e]) @ h_post
            @ w_hat("down") @ blockdiag(128, hid) @ diag(weights.down_svh)
            @ h512)
    return {"gate": a[:, 0::2].to(dtype), "up": a[:, 1::2].to(dtype), "down": down.to(dtype)}


def plain_dense_expert(
    weights: "AnyWeights", e: int, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Expert ``e`` of uncoupled weights as explicit matrices ``{"gate", "up"}`` [H, I] and
    ``"down"`` [I, H]: ``W = diag(suh) H128 W_hat H128 diag(svh)`` per projection, built from
    block-diagonal Sylvester matrices (not :func:`trellis.rotate_blocks`), so it checks the
    factored :func:`reference_moe` independently of its rotation code."""
    work = torch.float64

    def blockdiag(n: int) -> torch.Tensor:
        return torch.block_diag(*[_sylvester(128, work)] * (n // 128))

    def diag(v: torch.Tensor) -> torch.Tensor:
        return torch.diag(_per_expert(v, e).to(device="cpu", dtype=work))

    out = {}
    for proj in ("gate", "up", "down"):
        w = decoded_weight(weights, proj, e).cpu().to(work)
        suh = getattr(weights, f"{proj}_suh")
        svh = getattr(weights, f"{proj}_svh")
        out[proj] = (diag(suh) @ blockdiag(w.shape[0]) @ w @ blockdiag(w.shape[1])
                     @ diag(svh)).to(dtype)
    return out


# --------------------------------------------------------------------------------------
# Route pack
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutePack:
    """Routes grouped by local expert into route blocks of ``block_m`` rows (docs/formats.md,
    "Route policy").

    Route id ``r = token * topk + k``; the sentinel ``num_routes = m * topk`` marks padding.

    Attributes:
        sorted_route_ids: int32 ``[padded_route_slots(num_routes, E, block_m)]``: expert ``e``'s
            routes, in increasing route id, at ``[expert_offsets[e], expert_offsets[e] +
            expert_counts[e])``, the rest of its padded range and every slot from
            ``num_routes_padded`` on hold the sentinel.
        block_expert: int32 ``[padded_route_slots // block_m]``: local expert of each route block,
            -1 for blocks past ``num_routes_padded``.
        num_routes_padded: packed count ``expert_offsets[E]`` (a multiple of ``block_m``).
        expert_offsets: int32 ``[E + 1]``: prefix sums of the padded per-expert counts.
        expert_counts: int32 ``[E]``: routes per local expert (routes mapped to -1 dropped).
        block_m: route block rows.
        num_routes: ``m * topk`` (all routes, including dropped ones): the sentinel value.
    """

    sorted_route_ids: torch.Tensor
    block_expert: torch.Tensor
    num_routes_padded: int
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    block_m: int
    num_routes: int

    @property
    def sentinel(self) -> int:
        """Route id stored in padding slots (``m * topk``)."""
        return self.num_routes

    @property
    def num_experts(self) -> int:
        """Local experts the pack spans."""
        return int(self.expert_counts.numel())

    @property
    def num_blocks_used(self) -> int:
        """Route blocks holding at least one route (``num_routes_padded // block_m``)."""
        return self.num_routes_padded // self.block_m


def route_pack_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: Optional[torch.Tensor] = None,
) -> RoutePack:
    """Pack the routes of ``topk_ids`` by local expert into blocks of ``block_m`` rows.

    Per-expert histogram (routes to -1 experts dropped), each count padded up to a multiple
    of ``block_m``, exclusive prefix sums as offsets; within an expert routes keep increasing
    route id order. Buffers are sized by
    :func:`~kquant_cute.planners.policy.padded_route_slots` so one allocation serves every
    routing of ``m * topk`` routes.

    Args:
        topk_ids: ``[m, topk]`` integer expert ids (local, or global with ``expert_map``).
        num_experts: local expert count ``E``.
        block_m: route block rows (any positive int; the kernels use ROUTE_BLOCK_SIZES).
        expert_map: optional integer ``[E_global]``: global id -> local id or -1.

    Returns:
        A :class:`RoutePack` on ``topk_ids``' device.

    Raises:
        ValueError: for bad shapes / dtypes, non-positive ``num_experts`` / ``block_m``, or ids
            (or map values) out of range.
    """
    for name, value in (("num_experts", num_experts), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    ids = _check_topk_ids(topk_ids)
    device = ids.device
    n = ids.numel()
    local = _local_expert_ids(ids, num_experts, expert_map).reshape(-1)

    valid = local >= 0
    route_ids = torch.arange(n, device=device, dtype=torch.int64)[valid]
    experts = local[valid]
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    total = int(offsets[-1])

    capacity = padded_route_slots(n, num_experts, block_m)
    if total > capacity:  # pragma: no cover - padded_route_slots is a proven bound
        raise AssertionError(f"packed count {total} exceeds padded_route_slots {capacity}")

    # Stable sort by expert keeps increasing route ids within each expert.
    order = torch.sort(experts, stable=True).indices
    experts_sorted = experts[order]
    unpadded_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(experts_sorted.numel(), device=device) - unpadded_start[experts_sorted]
    sorted_route_ids = torch.full((capacity,), n, dtype=torch.int32, device=device)
    sorted_route_ids[offsets[experts_sorted] + rank] = route_ids[order].to(torch.int32)

    block_expert = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=device)
    block_expert[: total // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=device, dtype=torch.int32), padded // block_m
    )
    return RoutePack(
        sorted_route_ids=sorted_route_ids,
        block_expert=block_expert,
        num_routes_padded=total,
        expert_offsets=offsets.to(torch.int32),
        expert_counts=counts.to(torch.int32),
        block_m=block_m,
        num_routes=n,
    )

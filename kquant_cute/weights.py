"""Expert-weight objects: validated trellis linear layers and stacked MoE expert weights.

This module owns the in-memory weight containers the planners and kernels consume:

* :class:`TrellisLinear` -- one EXL3 / QSRT trellis-coded linear layer (``trellis``,
  ``suh``, ``svh``, optional ``bias``, codebook), with loaders from checkpoint tensor
  mappings and the dense / reference-forward views from :mod:`kquant_cute.trellis`;
* :class:`ExpertVectors` -- the one validation of a layer's expert vectors (hidden-side
  ``suh`` / ``svh`` shared or per expert, intermediate-side spans, the QSRT coupled sign
  vectors, profile and rotation draws) against the layer's shape, used by both
  :class:`MoEWeights` and :class:`~kquant_cute.mixed.MixedMoEWeights`, and
  :class:`ExpertShape`, the shape properties both containers read from those vectors;
* :class:`MoEWeights` -- the gate / up / down projections of a layer's experts stacked
  along a leading expert axis at one K, plus a seeded random constructor for tests and
  benches.

All are frozen dataclasses validated on construction: every inconsistency raises a
ValueError that names the offending tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from . import trellis as tc
from .qsrt import format as qsrt_format

__all__ = ["TrellisLinear", "ExpertVectors", "ExpertShape", "MoEWeights", "PROJECTIONS"]

#: Projection names of one expert, in kernel order.
PROJECTIONS = ("gate", "up", "down")


def _check_tensor(name: str, value: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")


def _trellis_geometry(name: str, value: object, ndim: int) -> tuple[int, ...]:
    """Validate an int16 trellis tensor of ``ndim`` dims; return its shape."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int16:
        raise ValueError(f"{name} must be torch.int16, got {value.dtype}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if value.shape[-1] == 0 or value.shape[-1] % tc.TILE:
        raise ValueError(
            f"{name} last dimension must be 16*K (K bits per weight), got shape "
            f"{tuple(value.shape)}"
        )
    return tuple(value.shape)


def _check_features(name: str, in_features: int, out_features: int) -> None:
    for axis, n in (("in", in_features), ("out", out_features)):
        if n <= 0 or n % tc.HADAMARD_BLOCK:
            raise ValueError(
                f"{name}: {axis}_features = {n} is not a positive multiple of "
                f"{tc.HADAMARD_BLOCK}"
            )


def _check_bits(name: str, codebook: str, bits: int) -> None:
    try:
        tc.check_codebook(codebook, bits)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _target_device(name: str, device: Optional[torch.device | str]) -> torch.device:
    """``device`` as a torch.device (None: the CPU); a CUDA device this torch cannot reach
    raises here, in words, instead of torch's assertion at the first allocation."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name}: device {str(device)!r} needs a CUDA GPU, and this torch "
            f"({torch.__version__}) sees none. Without a GPU, build the weights on the CPU "
            "(device=None) and plan, describe and prewarm the layer: "
            "kquant_cute.layer_spec(weights, topk=...), kquant_cute.plan_forward(...), "
            "kquant_cute.prewarm_plans(...) or kquant-compile")
    return dev


def _same_device(name: str, tensors: Mapping[str, Optional[torch.Tensor]]) -> torch.device:
    devices = {k: v.device for k, v in tensors.items() if v is not None}
    unique = set(devices.values())
    if len(unique) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"{name}: tensors are on different devices ({listing})")
    return next(iter(unique))


def _agree(experts: Sequence[Mapping[str, "TrellisLinear"]], what: str, value, show,
           rule: str, projections: Sequence[str] = PROJECTIONS):
    """The common value of ``value(layer)`` over every expert's ``projections``; ValueError
    naming the expert(s) and projection(s) that differ from the most common value."""
    seen: dict[Any, list[str]] = {}
    for idx, ex in enumerate(experts):
        for p in projections:
            seen.setdefault(value(ex[p]), []).append(f"expert {idx} {p}")
    if len(seen) == 1:
        return next(iter(seen))
    # The majority value is the expected one (ties: the one seen first).
    common = max(seen, key=lambda v: len(seen[v]))
    odd = [(where, v) for v, places in seen.items() if v != common for where in places]
    listing = ", ".join(f"{where} has {show(v)}" for where, v in odd[:8])
    more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
    raise ValueError(f"{what} differs across experts: {listing}{more}, the other "
                     f"{len(seen[common])} have {show(common)}; {rule}")


# --------------------------------------------------------------------------------------
# One linear layer
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TrellisLinear:
    """One trellis-coded linear layer ``y = x @ W`` with ``W`` [in, out].

    ``trellis`` int16 [in/16, out/16, 16K]; ``suh`` fp16 [in]; ``svh`` fp16 [out];
    ``bias`` fp16 [out] or None; ``codebook`` one of :data:`kquant_cute.trellis.CODEBOOKS`.
    ``W = diag(suh) H_blk W_hat H_blk diag(svh)`` (see :func:`kquant_cute.trellis.dense_weight`).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: str
    bias: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        shape = _trellis_geometry("trellis", self.trellis, 3)
        if self.codebook not in tc.CODEBOOKS:
            raise ValueError(
                f"unknown codebook {self.codebook!r}; expected one of {tc.CODEBOOKS}"
            )
        bits = shape[2] // tc.TILE
        _check_bits("trellis", self.codebook, bits)
        n_in, n_out = shape[0] * tc.TILE, shape[1] * tc.TILE
        _check_features("trellis", n_in, n_out)
        _check_tensor("suh", self.suh, torch.float16, (n_in,))
        _check_tensor("svh", self.svh, torch.float16, (n_out,))
        if self.bias is not None:
            _check_tensor("bias", self.bias, torch.float16, (n_out,))
        _same_device(
            "TrellisLinear",
            {"trellis": self.trellis, "suh": self.suh, "svh": self.svh, "bias": self.bias},
        )

    @property
    def bits(self) -> int:
        """K, bits per weight."""
        return self.trellis.shape[-1] // tc.TILE

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * tc.TILE

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * tc.TILE

    @property
    def device(self) -> torch.device:
        return self.trellis.device

    # -- loaders -----------------------------------------------------------------------

    @staticmethod
    def _take(tensors: Mapping[str, torch.Tensor], prefix: str, key: str) -> torch.Tensor:
        full = prefix + key
        if full not in tensors:
            raise ValueError(f"missing tensor {full!r}")
        return tensors[full]

    @classmethod
    def from_exl3(
        cls, tensors: Mapping[str, torch.Tensor], prefix: str = ""
    ) -> "TrellisLinear":
        """Build from EXL3 checkpoint tensors ``{prefix}trellis``, ``suh``, ``svh``, ``bias``.

        The codebook follows the marker tensors (``kernels.format.exl3_codebook``: a
        ``{prefix}<codebook>`` tensor selects that codebook; none selects 3inst; only
        presence matters).
        """
        return cls._load(tensors, prefix, tc.exl3_codebook(lambda name: prefix + name in tensors))

    @classmethod
    def from_qsrt(
        cls,
        tensors: Mapping[str, torch.Tensor],
        codebook: str = "sqg_e4m3",
        prefix: str = "",
    ) -> "TrellisLinear":
        """Build from QSRT tensors (same names as EXL3; the codebook is given)."""
        return cls._load(tensors, prefix, codebook)

    @classmethod
    def _load(
        cls, tensors: Mapping[str, torch.Tensor], prefix: str, codebook: str
    ) -> "TrellisLinear":
        return cls(
            trellis=cls._take(tensors, prefix, "trellis"),
            suh=cls._take(tensors, prefix, "suh"),
            svh=cls._take(tensors, prefix, "svh"),
            codebook=codebook,
            bias=tensors.get(prefix + "bias"),
        )

    @classmethod
    def from_dense(
        cls,
        w: torch.Tensor,
        bits: int,
        codebook: str = "mcg",
        *,
        bias: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        device: Optional[torch.device | str] = None,
        **quantize_options: Any,
    ) -> "TrellisLinear":
        """Quantize a dense ``w`` [in, out] with :func:`kquant_cute.quantize.quantize`.

        ``quantize_options`` are passed through (e.g. ``scale_factors``).
        """
        from .quantize import quantize  # local: keeps this module's import light

        q = quantize(w, bits, codebook, generator=generator, device=device, **quantize_options)
        if bias is not None:
            bias = bias.to(device=q["trellis"].device, dtype=torch.float16)
        return cls(q["trellis"], q["suh"], q["svh"], codebook, bias)

    # -- views -------------------------------------------------------------------------

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``W`` [in, out] such that ``y = x @ W (+ bias)``."""
        return tc.dense_weight(self.trellis, self.suh, self.svh, self.codebook, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Four-step reference forward (float32, or float64 for float64 ``x``)."""
        return tc.linear_forward(x, self.trellis, self.suh, self.svh, self.codebook, self.bias)

    __call__ = forward

    def to(self, device: torch.device | str) -> "TrellisLinear":
        bias = self.bias.to(device) if self.bias is not None else None
        return TrellisLinear(
            self.trellis.to(device), self.suh.to(device), self.svh.to(device), self.codebook,
            bias,
        )


# --------------------------------------------------------------------------------------
# Stacked MoE experts
# --------------------------------------------------------------------------------------


#: Vector fields of a layer's experts, in container field order.
VECTOR_FIELDS = ("gate_suh", "gate_svh", "up_suh", "up_svh", "down_suh", "down_svh")
#: Optional QSRT fields (coupled transforms and where they came from).
QSRT_FIELDS = ("rotation_draws", "pre_signs", "post_signs")


@dataclass(frozen=True, eq=False)
class ExpertVectors:
    """A layer's expert vectors, validated against its shape (``num_experts``, ``hidden``,
    ``intermediate``) and ``codebook``.

    * ``gate_suh``, ``up_suh``, ``down_svh``: fp16 [E, H] per expert, or [H] shared by all
      experts -- all three per-expert or all three shared;
    * ``gate_svh``, ``up_svh``, ``down_suh``: fp16 [E, I];
    * QSRT: ``profile`` (a known QSRT profile, which fixes the codebook and whether the
      layer is coupled), ``rotation_draws`` uint8 [E] in 0..7, and the coupled transforms
      ``pre_signs`` fp16 [E, 2I] / ``post_signs`` fp16 [E, I] of +-1 (both or neither;
      coupled layers share one input vector: ``gate_suh == up_suh`` shared, and ``hidden``
      is a multiple of the latent H512).
    """

    num_experts: int
    hidden: int
    intermediate: int
    codebook: str
    gate_suh: torch.Tensor
    gate_svh: torch.Tensor
    up_suh: torch.Tensor
    up_svh: torch.Tensor
    down_suh: torch.Tensor
    down_svh: torch.Tensor
    profile: Optional[str] = None
    rotation_draws: Optional[torch.Tensor] = None
    pre_signs: Optional[torch.Tensor] = None
    post_signs: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, owner: Any, num_experts: int, hidden: int, intermediate: int) -> "ExpertVectors":
        """The vectors of a weight container ``owner`` (its fields of the same names)."""
        return cls(num_experts, hidden, intermediate, owner.codebook,
                   **{n: getattr(owner, n) for n in (*VECTOR_FIELDS, "profile", *QSRT_FIELDS)})

    def __post_init__(self) -> None:
        e, hidden, inter = self.num_experts, self.hidden, self.intermediate
        hidden_side = {"gate_suh": self.gate_suh, "up_suh": self.up_suh,
                       "down_svh": self.down_svh}
        for name, vec in hidden_side.items():
            if not isinstance(vec, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(vec).__name__}")
        dims = {vec.dim() for vec in hidden_side.values()}
        if dims not in ({1}, {2}):
            listing = ", ".join(f"{n} {tuple(v.shape)}" for n, v in hidden_side.items())
            raise ValueError(
                "hidden-side vectors must be all shared ([H]) or all per-expert ([E, H]); "
                f"got {listing}"
            )
        hshape = (hidden,) if self.shared else (e, hidden)
        for name, vec in hidden_side.items():
            _check_tensor(name, vec, torch.float16, hshape)
        for name in ("gate_svh", "up_svh", "down_suh"):
            _check_tensor(name, getattr(self, name), torch.float16, (e, inter))
        self._check_qsrt()
        _same_device("expert vectors", {n: getattr(self, n) for n in (*VECTOR_FIELDS,
                                                                      *QSRT_FIELDS)})

    @property
    def shared(self) -> bool:
        """True iff the hidden-side vectors are shared ([H]) across experts."""
        return self.gate_suh.dim() == 1

    @property
    def coupled(self) -> bool:
        return self.pre_signs is not None

    def _check_qsrt(self) -> None:
        e, inter = self.num_experts, self.intermediate
        if (self.pre_signs is None) != (self.post_signs is None):
            raise ValueError("pre_signs and post_signs must both be given (coupled) or both None")
        if self.rotation_draws is not None:
            _check_tensor("rotation_draws", self.rotation_draws, torch.uint8, (e,))
            if bool((self.rotation_draws > qsrt_format.MAX_DRAW).any()):
                raise ValueError(f"rotation_draws must lie in 0..{qsrt_format.MAX_DRAW}")
        if self.profile is not None:
            if self.profile not in qsrt_format.PROFILES:
                raise ValueError(f"unknown QSRT profile {self.profile!r}; known: "
                                 f"{', '.join(qsrt_format.PROFILES)}")
            wants = qsrt_format.PROFILES[self.profile].coupled
            if wants != self.coupled:
                raise ValueError(f"profile {self.profile!r} "
                                 f"{'needs' if wants else 'has no'} coupled sign vectors")
            if self.codebook != qsrt_format.CODEBOOK:
                raise ValueError(f"profile {self.profile!r} uses codebook "
                                 f"{qsrt_format.CODEBOOK!r}, got {self.codebook!r}")
        if not self.coupled:
            return
        for name, n in (("pre_signs", 2 * inter), ("post_signs", inter)):
            t = getattr(self, name)
            _check_tensor(name, t, torch.float16, (e, n))
            if not bool((t.abs() == 1).all()):
                raise ValueError(f"{name} must hold only +1 / -1")
        if not self.shared:
            raise ValueError("coupled weights need shared hidden-side vectors ([H])")
        if not torch.equal(self.gate_suh, self.up_suh):
            raise ValueError("coupled weights: both FC1 slots read one rotated input, so "
                             "gate_suh must equal up_suh")
        if self.hidden % tc.COUPLED_RESIDUAL_BLOCK:
            raise ValueError(f"coupled weights: hidden {self.hidden} is not a multiple of "
                             f"{tc.COUPLED_RESIDUAL_BLOCK} (the latent H512)")


class ExpertShape:
    """Shape properties of a weight container, read from its validated vectors (mixin of
    :class:`MoEWeights` and :class:`~kquant_cute.mixed.MixedMoEWeights`; both keep
    ``gate_trellis``'s dimension 1 at H/16)."""

    gate_trellis: torch.Tensor
    gate_suh: torch.Tensor
    gate_svh: torch.Tensor
    pre_signs: Optional[torch.Tensor]

    @property
    def num_experts(self) -> int:
        return self.gate_svh.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_trellis.shape[1] * tc.TILE

    @property
    def intermediate(self) -> int:
        return self.gate_svh.shape[1]

    @property
    def shared_hidden_vectors(self) -> bool:
        """True iff gate_suh, up_suh and down_svh are shared ([H]) across experts."""
        return self.gate_suh.dim() == 1

    @property
    def coupled(self) -> bool:
        """True iff the QSRT coupled transforms apply (sign vectors present)."""
        return self.pre_signs is not None

    @property
    def device(self) -> torch.device:
        return self.gate_trellis.device



@dataclass(frozen=True, eq=False)
class MoEWeights(ExpertShape):
    """A layer's experts, each projection stacked along a leading expert axis E.

    * ``gate_trellis``, ``up_trellis``: int16 [E, H/16, I/16, 16K] (FC1, [H, I] each);
      ``down_trellis``: int16 [E, I/16, H/16, 16K] (FC2, [I, H]).
    * ``gate_suh``, ``up_suh``: fp16 [E, H] per expert, or [H] shared by all experts;
      ``down_svh``: fp16 [E, H] or [H] (shared) -- the three hidden-side vectors are
      either all per-expert or all shared.
    * ``gate_svh``, ``up_svh``, ``down_suh``: fp16 [E, I].
    * ``codebook``: one codebook and one K for all projections.
    * QSRT coupled transforms (profile ``k2_coupled_h512_h128``; both or neither of the sign
      vectors): ``pre_signs`` fp16 [E, 2I] and ``post_signs`` fp16 [E, I] of +-1. Then
      ``gate_trellis`` / ``up_trellis`` are not semantic gate / up but the two stored FC1
      *slots*: their outputs interleave per 32-channel atom (32 of slot 0, then 32 of slot 1)
      into the 2I pre-activation axis, whose even / odd coordinates are gate / up after the
      coupled H128 (see :func:`kquant_cute.reference.reference_moe` for the math). Coupled
      weights have shared hidden-side vectors with ``gate_suh == up_suh`` (one input vector
      per rank) and ``hidden`` a multiple of 512 (the latent H512).
    * ``profile``: the QSRT profile name these weights were loaded as (None otherwise);
      ``rotation_draws``: uint8 [E] per-expert draw ids 0..7 the signs came from (or None).
    """

    gate_trellis: torch.Tensor
    up_trellis: torch.Tensor
    down_trellis: torch.Tensor
    gate_suh: torch.Tensor
    gate_svh: torch.Tensor
    up_suh: torch.Tensor
    up_svh: torch.Tensor
    down_suh: torch.Tensor
    down_svh: torch.Tensor
    codebook: str
    profile: Optional[str] = None
    rotation_draws: Optional[torch.Tensor] = None
    pre_signs: Optional[torch.Tensor] = None
    post_signs: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.codebook not in tc.CODEBOOKS:
            raise ValueError(
                f"unknown codebook {self.codebook!r}; expected one of {tc.CODEBOOKS}"
            )
        gate = _trellis_geometry("gate_trellis", self.gate_trellis, 4)
        up = _trellis_geometry("up_trellis", self.up_trellis, 4)
        down = _trellis_geometry("down_trellis", self.down_trellis, 4)
        if up != gate:
            raise ValueError(
                f"up_trellis shape {up} must equal gate_trellis shape {gate}"
            )
        e, h16, i16, k16 = gate
        expected_down = (e, i16, h16, k16)
        if down != expected_down:
            if down[-1] != k16:
                raise ValueError(
                    f"down_trellis has {down[-1] // tc.TILE} bits per weight, gate/up have "
                    f"{k16 // tc.TILE}: all projections must share K"
                )
            raise ValueError(
                f"down_trellis must have shape {expected_down} ([E, I/16, H/16, 16K]), got "
                f"{down}"
            )
        if e == 0:
            raise ValueError("gate_trellis has zero experts")
        bits = k16 // tc.TILE
        _check_bits("gate_trellis", self.codebook, bits)
        hidden, inter = h16 * tc.TILE, i16 * tc.TILE
        _check_features("gate_trellis", hidden, inter)

        ExpertVectors.of(self, e, hidden, inter)
        _same_device("MoEWeights", {**{name: getattr(self, name) for name in self._tensor_names()},
                                    **self._optional_tensors()})

    @staticmethod
    def _tensor_names() -> tuple[str, ...]:
        return ("gate_trellis", "up_trellis", "down_trellis", "gate_suh", "gate_svh",
                "up_suh", "up_svh", "down_suh", "down_svh")

    def _optional_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("rotation_draws", "pre_signs", "post_signs")
                if getattr(self, name) is not None}

    # -- properties --------------------------------------------------------------------

    @property
    def bits(self) -> int:
        return self.gate_trellis.shape[3] // tc.TILE

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every stacked tensor, in field order."""
        for name in self._tensor_names():
            yield name, getattr(self, name)

    # -- views and conversions -----------------------------------------------------------

    def expert(self, e: int) -> dict[str, TrellisLinear]:
        """The three projections of expert ``e`` as :class:`TrellisLinear` views."""
        n = self.num_experts
        if not -n <= e < n:
            raise IndexError(f"expert index {e} out of range for {n} experts")

        def hid(vec: torch.Tensor) -> torch.Tensor:
            return vec if self.shared_hidden_vectors else vec[e]

        return {
            "gate": TrellisLinear(self.gate_trellis[e], hid(self.gate_suh), self.gate_svh[e],
                                  self.codebook),
            "up": TrellisLinear(self.up_trellis[e], hid(self.up_suh), self.up_svh[e],
                                self.codebook),
            "down": TrellisLinear(self.down_trellis[e], self.down_suh[e], hid(self.down_svh),
                                  self.codebook),
        }

    def to(self, device: torch.device | str) -> "MoEWeights":
        _target_device("MoEWeights.to", device)
        moved = {name: t.to(device) for name, t in self.tensors()}
        moved.update({name: t.to(device) for name, t in self._optional_tensors().items()})
        return MoEWeights(codebook=self.codebook, profile=self.profile, **moved)

    @classmethod
    def from_experts(cls, experts: Sequence[Mapping[str, TrellisLinear]]) -> "MoEWeights":
        """Stack per-expert ``{"gate", "up", "down"}`` layers.

        The hidden-side vectors (gate.suh, up.suh, down.svh) are stored shared ([H]) when
        every expert's are identical, per expert ([E, H]) otherwise.
        """
        if len(experts) == 0:
            raise ValueError("from_experts needs at least one expert")
        for idx, ex in enumerate(experts):
            missing = [p for p in PROJECTIONS if p not in ex]
            if missing:
                raise ValueError(f"expert {idx} is missing projections {missing}")
            for p in PROJECTIONS:
                layer = ex[p]
                if not isinstance(layer, TrellisLinear):
                    raise ValueError(
                        f"expert {idx} {p} must be a TrellisLinear, got {type(layer).__name__}"
                    )
                if layer.bias is not None:
                    raise ValueError(f"expert {idx} {p} has a bias; MoE experts take none")
        # One codebook, one K and one shape per projection across the layer: the odd ones
        # out (against the most common value) are named, with expert and projection.
        codebook = _agree(experts, "codebook", lambda layer: layer.codebook, repr,
                          "all experts must share one codebook")
        _agree(experts, "K", lambda layer: layer.bits, lambda k: f"{k} bits per weight",
               "all projections must share K")
        for p in PROJECTIONS:
            _agree(experts, f"{p} shape", lambda layer: (layer.in_features, layer.out_features),
                   lambda f: f"[in {f[0]}, out {f[1]}]",
                   f"every expert's {p} projection must have the same shape", projections=(p,))

        def stack(proj: str, attr: str) -> torch.Tensor:
            parts = [getattr(ex[proj], attr) for ex in experts]
            shapes = {tuple(t.shape) for t in parts}
            if len(shapes) > 1:  # pragma: no cover - the shape check above names the expert
                raise ValueError(f"{proj}.{attr} shapes differ across experts: {sorted(shapes)}")
            return torch.stack(parts)

        hidden_side = {"gate_suh": ("gate", "suh"), "up_suh": ("up", "suh"),
                       "down_svh": ("down", "svh")}
        stacked_hidden = {name: stack(*src) for name, src in hidden_side.items()}
        shared = all(bool((v == v[:1]).all()) for v in stacked_hidden.values())
        if shared:
            stacked_hidden = {name: v[0].clone() for name, v in stacked_hidden.items()}
        return cls(
            gate_trellis=stack("gate", "trellis"),
            up_trellis=stack("up", "trellis"),
            down_trellis=stack("down", "trellis"),
            gate_svh=stack("gate", "svh"),
            up_svh=stack("up", "svh"),
            down_suh=stack("down", "suh"),
            codebook=codebook,
            **stacked_hidden,
        )

    @classmethod
    def random(
        cls,
        num_experts: int,
        hidden: int,
        intermediate: int,
        bits: int,
        codebook: str = "mcg",
        *,
        shared_hidden_vectors: bool = False,
        coupled: bool = False,
        seed: int = 0,
        device: Optional[torch.device | str] = None,
    ) -> "MoEWeights":
        """Seeded random experts with O(1) activations for O(1) inputs.

        Trellis codes are uniform random bits (every bitstream is valid). Input-side
        vectors (``suh``) are random-sign with magnitudes in [0.75, 1.25), so the rotated
        activations keep the input's scale. Output-side vectors (``svh``) are random-sign
        with magnitudes around ``1 / (sqrt(in_features) * rms(codebook))``, so each
        projection maps unit-RMS inputs to roughly unit-RMS outputs. The same seed gives
        the same weights on every device (generated on the CPU, one expert at a time).

        ``coupled``: add the QSRT coupled transforms (random per-expert draws 0..7 and their
        sign vectors, as rank 0 of a layer whose global intermediate is ``intermediate``);
        needs ``shared_hidden_vectors`` and uses one input vector for both FC1 slots.
        """
        for name, n in (("num_experts", num_experts), ("hidden", hidden),
                        ("intermediate", intermediate), ("bits", bits), ("seed", seed)):
            if isinstance(n, bool) or not isinstance(n, int):
                raise ValueError(f"{name} must be an int, got {n!r}")
        if num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        _check_bits("random", codebook, bits)
        _check_features("random", hidden, intermediate)
        dev = _target_device("MoEWeights.random", device)
        gen = torch.Generator().manual_seed(seed)
        rms = float(tc.codebook_lut(codebook, bits).square().mean().sqrt())

        def codes(rows: int, cols: int) -> torch.Tensor:
            out = torch.empty(num_experts, rows // tc.TILE, cols // tc.TILE, tc.TILE * bits,
                              dtype=torch.int16, device=dev)
            for e in range(num_experts):
                out[e].copy_(tc.random_trellis(rows, cols, bits, gen))
            return out

        def vec(shape: tuple[int, ...], magnitude: float) -> torch.Tensor:
            sign = torch.randint(0, 2, shape, generator=gen).to(torch.float32) * 2.0 - 1.0
            mag = torch.rand(shape, generator=gen) * 0.5 + 0.75
            return (sign * mag * magnitude).to(torch.float16).to(dev)

        out_fc1 = 1.0 / (math.sqrt(hidden) * rms)
        out_fc2 = 1.0 / (math.sqrt(intermediate) * rms)
        hshape = (hidden,) if shared_hidden_vectors else (num_experts, hidden)
        ishape = (num_experts, intermediate)
        extra: dict[str, Any] = {}
        if coupled:
            if not shared_hidden_vectors:
                raise ValueError("random: coupled weights need shared_hidden_vectors=True")
            draws = torch.randint(0, qsrt_format.MAX_DRAW + 1, (num_experts,), generator=gen)
            pre, post = qsrt_format.coupled_signs(draws.to(torch.uint8), intermediate, 0,
                                                  intermediate // qsrt_format.ATOM_CHANNELS)
            extra = {"rotation_draws": draws.to(torch.uint8).to(dev), "pre_signs": pre.to(dev),
                     "post_signs": post.to(dev)}
        gate_suh = vec(hshape, 1.0)
        return cls(
            gate_trellis=codes(hidden, intermediate),
            up_trellis=codes(hidden, intermediate),
            down_trellis=codes(intermediate, hidden),
            gate_suh=gate_suh,
            gate_svh=vec(ishape, out_fc1),
            up_suh=gate_suh.clone() if coupled else vec(hshape, 1.0),
            up_svh=vec(ishape, out_fc1),
            down_suh=vec(ishape, 1.0),
            down_svh=vec(hshape, out_fc2),
            codebook=codebook,
            **extra,
        )

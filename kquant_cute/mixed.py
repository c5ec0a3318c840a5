"""Mixed-rate expert weights: per-tile K on the intermediate axis (QSRT ``k3x22_k4x2``).

This module owns :class:`MixedMoEWeights`, the in-memory container of a layer whose expert
matrices change K along the intermediate axis (QSRT records of 128 channels at K2 / K3 / K4),
and its kernel-side storage layout. The rate map is run-time data: one ``uint8`` K per
16-channel intermediate tile per expert and matrix family, not one specialization per expert.

Storage (what a kernel indexes; ``I16 = I / 16``, ``H16 = H / 16``):

* ``fc1_bits`` / ``fc2_bits``: uint8 [E, I16]. ``fc1_bits[e, j]`` is K of FC1 output tile
  column ``j`` (gate and up slots share it: both read the same records); ``fc2_bits[e, i]``
  is K of FC2 reduction tile row ``i``.
* ``gate_trellis`` / ``up_trellis``: int16 [E, H16, W1]. Tile row ``i`` of expert ``e`` is
  the concatenation over columns ``j`` of that tile's ``16 * fc1_bits[e, j]`` words, so tile
  ``(i, j)`` starts at word ``fc1_offsets()[e, j]`` of row ``[e, i]`` (the prefix sums of
  ``16 * fc1_bits[e]``, identical for every row). ``W1`` is the widest expert's row; shorter
  rows are zero padded. For a uniform K this is exactly the EXL3 [E, H16, I16, 16K] layout.
* ``down_trellis``: int16 [E, W2]. Row tile ``i`` (16 intermediate rows) is
  ``[H16, 16 * fc2_bits[e, i]]`` contiguous words starting at ``fc2_offsets()[e, i]``
  (prefix sums of ``H16 * 16 * fc2_bits[e]``); again the uniform case is EXL3's
  [E, I16, H16, 16K] flattened.

The fused kernels (``MoESpec.bits_set``, kernels/trellis_gemm.py) read these rate maps at run
time as the launch contract's ``rate`` arguments, which :meth:`MixedMoEWeights.rate_args`
builds (K per tile and 32-bit word indices of each tile's trellis), and take K once per
pipeline stage: :meth:`MixedMoEWeights.check_rate_runs` says whether a layer's rates are
constant over the channel runs that needs. See docs/mixed_rates.md.

Everything is validated on construction (ValueError naming the tensor); the reference MoE in
:mod:`kquant_cute.reference` accepts these weights wherever it accepts :class:`MoEWeights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from . import trellis as tc
from .weights import (ExpertShape, ExpertVectors, MoEWeights, _check_features, _check_tensor,
                      _same_device)

__all__ = ["MixedMoEWeights", "pack_fc1", "pack_fc2", "unpack_fc1", "unpack_fc2"]


def _check_bits_map(name: str, bits: object, e: int, i16: int, codebook: str) -> None:
    _check_tensor(name, bits, torch.uint8, (e, i16))
    lo, hi = tc.BITS_RANGE[codebook]
    bad = ((bits < lo) | (bits > hi)).nonzero()  # type: ignore[operator]
    if bad.numel():
        ex, j = bad[0].tolist()
        raise ValueError(f"{name}[{ex}, {j}] = {int(bits[ex, j])}: codebook {codebook!r} "  # type: ignore[index]
                         f"takes K in {lo}..{hi}")


def fc1_offsets(bits: torch.Tensor) -> torch.Tensor:
    """int64 [E, I16 + 1]: word offset of each FC1 tile column within a tile row."""
    words = tc.TILE * bits.to(torch.int64)
    return torch.nn.functional.pad(torch.cumsum(words, dim=1), (1, 0))


def fc2_offsets(bits: torch.Tensor, hidden: int) -> torch.Tensor:
    """int64 [E, I16 + 1]: word offset of each FC2 row tile within the expert's storage."""
    words = (hidden // tc.TILE) * tc.TILE * bits.to(torch.int64)
    return torch.nn.functional.pad(torch.cumsum(words, dim=1), (1, 0))


def pack_fc1(padded: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """[E, H16, I16, 16*Kmax] (tile words, zero past 16K) + bits -> [E, H16, W1] packed rows."""
    e, h16, i16, _ = padded.shape
    off = fc1_offsets(bits)
    width = int(off[:, -1].max())
    out = torch.zeros(e, width, h16, dtype=torch.int16, device=padded.device)
    src = padded.permute(0, 2, 3, 1)                       # [E, I16, 16Kmax, H16]
    for k in sorted({int(b) for b in bits.unique()}):
        ex, j = (bits == k).nonzero(as_tuple=True)
        cols = off[ex, j][:, None] + torch.arange(16 * k, device=padded.device)
        out[ex[:, None], cols] = src[ex, j, : 16 * k]
    return out.permute(0, 2, 1).contiguous()


def unpack_fc1(packed: torch.Tensor, bits: torch.Tensor, kmax: int) -> torch.Tensor:
    """Inverse of :func:`pack_fc1`: [E, H16, I16, 16*kmax], zero past each tile's 16K words."""
    e, h16, _ = packed.shape
    i16 = bits.shape[1]
    off = fc1_offsets(bits)
    out = torch.zeros(e, i16, 16 * kmax, h16, dtype=torch.int16, device=packed.device)
    src = packed.permute(0, 2, 1)
    for k in sorted({int(b) for b in bits.unique()}):
        ex, j = (bits == k).nonzero(as_tuple=True)
        cols = off[ex, j][:, None] + torch.arange(16 * k, device=packed.device)
        out[ex, j, : 16 * k] = src[ex[:, None], cols]
    return out.permute(0, 3, 1, 2).contiguous()


def pack_fc2(padded: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """[E, I16, H16, 16*Kmax] + bits -> [E, W2]: row tile i = [H16, 16K_i] words, in order."""
    e, i16, h16, _ = padded.shape
    off = fc2_offsets(bits, h16 * tc.TILE)
    out = torch.zeros(e, int(off[:, -1].max()), dtype=torch.int16, device=padded.device)
    for k in sorted({int(b) for b in bits.unique()}):
        ex, i = (bits == k).nonzero(as_tuple=True)
        cols = off[ex, i][:, None] + torch.arange(h16 * 16 * k, device=padded.device)
        out[ex[:, None], cols] = padded[ex, i, :, : 16 * k].reshape(ex.numel(), -1)
    return out


def unpack_fc2(packed: torch.Tensor, bits: torch.Tensor, hidden: int, kmax: int) -> torch.Tensor:
    """Inverse of :func:`pack_fc2`: [E, I16, H16, 16*kmax]."""
    e, i16 = bits.shape
    h16 = hidden // tc.TILE
    off = fc2_offsets(bits, hidden)
    out = torch.zeros(e, i16, h16, 16 * kmax, dtype=torch.int16, device=packed.device)
    for k in sorted({int(b) for b in bits.unique()}):
        ex, i = (bits == k).nonzero(as_tuple=True)
        cols = off[ex, i][:, None] + torch.arange(h16 * 16 * k, device=packed.device)
        out[ex, i, :, : 16 * k] = packed[ex[:, None], cols].reshape(-1, h16, 16 * k)
    return out


@dataclass(frozen=True, eq=False)
class MixedMoEWeights(ExpertShape):
    """A layer's experts with per-tile K on the intermediate axis (see the module docstring).

    Same vectors and coupled fields as :class:`~kquant_cute.weights.MoEWeights`, validated
    by the same :class:`~kquant_cute.weights.ExpertVectors`: ``gate_suh`` / ``up_suh`` /
    ``down_svh`` fp16 [H] (shared) or [E, H]; ``gate_svh`` / ``up_svh`` / ``down_suh`` fp16
    [E, I]; optional ``pre_signs`` [E, 2I] / ``post_signs`` [E, I] (QSRT coupled transforms),
    ``profile`` and ``rotation_draws``.
    """

    gate_trellis: torch.Tensor
    up_trellis: torch.Tensor
    down_trellis: torch.Tensor
    fc1_bits: torch.Tensor
    fc2_bits: torch.Tensor
    gate_suh: torch.Tensor
    gate_svh: torch.Tensor
    up_suh: torch.Tensor
    up_svh: torch.Tensor
    down_suh: torch.Tensor
    down_svh: torch.Tensor
    codebook: str = "sqg_e4m3"
    profile: Optional[str] = None
    rotation_draws: Optional[torch.Tensor] = None
    pre_signs: Optional[torch.Tensor] = None
    post_signs: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.codebook not in tc.CODEBOOKS:
            raise ValueError(f"unknown codebook {self.codebook!r}; expected one of {tc.CODEBOOKS}")
        for name in ("gate_trellis", "up_trellis", "down_trellis", "fc1_bits", "fc2_bits"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor")
        if self.fc1_bits.dim() != 2:
            raise ValueError(f"fc1_bits must be 2-D [E, I/16], got {tuple(self.fc1_bits.shape)}")
        e, i16 = self.fc1_bits.shape
        if e == 0 or i16 == 0:
            raise ValueError(f"fc1_bits has an empty shape {tuple(self.fc1_bits.shape)}")
        for name in ("fc1_bits", "fc2_bits"):
            _check_bits_map(name, getattr(self, name), e, i16, self.codebook)
        g = self.gate_trellis
        if g.dtype != torch.int16 or g.dim() != 3 or g.shape[0] != e:
            raise ValueError(f"gate_trellis must be int16 [E={e}, H/16, W1], got "
                             f"{g.dtype} {tuple(g.shape)}")
        h16 = g.shape[1]
        _check_tensor("up_trellis", self.up_trellis, torch.int16, tuple(g.shape))
        row = fc1_offsets(self.fc1_bits)[:, -1]
        if int(row.max()) > g.shape[2]:
            x = int(row.argmax())
            raise ValueError(f"gate_trellis rows hold {g.shape[2]} words, expert {x}'s "
                             f"fc1_bits need {int(row[x])}")
        d = self.down_trellis
        need = fc2_offsets(self.fc2_bits, h16 * tc.TILE)[:, -1]
        if d.dtype != torch.int16 or d.dim() != 2 or d.shape[0] != e or d.shape[1] < int(need.max()):
            raise ValueError(f"down_trellis must be int16 [E={e}, W2 >= {int(need.max())}], got "
                             f"{d.dtype} {tuple(d.shape)}")
        _check_features("gate_trellis", h16 * tc.TILE, i16 * tc.TILE)
        ExpertVectors.of(self, e, h16 * tc.TILE, i16 * tc.TILE)
        _same_device("MixedMoEWeights", {"gate_trellis": g, "up_trellis": self.up_trellis,
                                         "down_trellis": d, "fc1_bits": self.fc1_bits,
                                         "fc2_bits": self.fc2_bits,
                                         "gate_svh": self.gate_svh})

    # -- shape and rates ---------------------------------------------------------------

    @property
    def rate_set(self) -> tuple[int, ...]:
        """The distinct K of the layer (what the kernel must hold decode tables for)."""
        both = torch.cat([self.fc1_bits.flatten(), self.fc2_bits.flatten()])
        return tuple(sorted(int(k) for k in both.unique()))

    @property
    def bits_per_weight(self) -> float:
        """Mean trellis bits per weight over the three matrices (vectors not counted)."""
        return float((2 * self.fc1_bits.double().mean() + self.fc2_bits.double().mean()) / 3)

    def fc1_offsets(self) -> torch.Tensor:
        """int64 [E, I/16 + 1]: FC1 column word offsets within a tile row (kernel table)."""
        return fc1_offsets(self.fc1_bits)

    def fc2_offsets(self) -> torch.Tensor:
        """int64 [E, I/16 + 1]: FC2 row-tile word offsets within an expert (kernel table)."""
        return fc2_offsets(self.fc2_bits, self.hidden)

    def check_rate_runs(self, runs: dict) -> None:
        """ValueError unless K is constant over every aligned run of ``runs[family]``
        channels of the intermediate axis (``{"fc1": 128, "fc2": 64}`` from
        ``MoESpec.rate_runs()``: what the fused kernel takes one K for); names the map,
        expert and channels."""
        for family, channels in runs.items():
            bits = getattr(self, f"{family}_bits")
            per = channels // tc.TILE
            if bits.shape[1] % per:
                raise ValueError(f"{family}_bits: {self.intermediate} channels are not a multiple "
                                 f"of the kernel's {channels}-channel rate runs")
            runs_k = bits.view(bits.shape[0], -1, per)
            bad = (runs_k != runs_k[:, :, :1]).any(dim=2).nonzero()
            if bad.numel():
                e, r = bad[0].tolist()
                ks = sorted({int(k) for k in runs_k[e, r]})
                raise ValueError(
                    f"{family}_bits[{e}]: channels {r * channels}..{(r + 1) * channels - 1} mix "
                    f"K {ks}; the fused kernel takes one K per {channels} channels of "
                    f"{'gate / up (an N tile)' if family == 'fc1' else 'down (a pipeline stage)'} "
                    "(QSRT records are 128 channels)")

    def rate_args(self) -> tuple[dict[str, torch.Tensor], int]:
        """The fused kernel's rate maps (``kernels.launch.RATE_ARGS``) and ``fc1_row_words``:
        ``fc1_bits`` / ``fc2_bits`` as stored, ``fc1_words[e, j]`` = 32-bit word index of tile
        (0, j) of expert e in ``gate_trellis`` / ``up_trellis`` (tile row i another
        ``fc1_row_words`` x i on), ``fc2_words[e, i]`` = word index of row tile i of expert e
        in ``down_trellis``; int32, on the weights' device. ValueError when a row width is
        not 16-byte aligned (every tile row must be, for the kernel's 16-byte copies) or an
        index leaves int32."""
        e = self.num_experts
        h16 = self.gate_trellis.shape[1]
        w1, w2 = self.gate_trellis.shape[2], self.down_trellis.shape[1]
        for name, width in (("gate_trellis", w1), ("down_trellis", w2)):
            if width % 8:
                raise ValueError(f"{name} rows hold {width} int16, not a multiple of 8 "
                                 "(16-byte aligned tile rows)")
        experts = torch.arange(e, device=self.device, dtype=torch.int64)[:, None]
        fc1 = (experts * h16 * w1 + self.fc1_offsets()[:, :-1].to(self.device)) // 2
        fc2 = (experts * w2 + self.fc2_offsets()[:, :-1].to(self.device)) // 2
        for name, words, total in (("fc1_words", fc1, e * h16 * w1 // 2),
                                   ("fc2_words", fc2, e * w2 // 2)):
            if total >= 2**31:
                raise ValueError(f"{name}: {total:,} trellis words exceed int32 indexing")
        return ({"fc1_bits": self.fc1_bits.contiguous(), "fc1_words": fc1.to(torch.int32),
                 "fc2_bits": self.fc2_bits.contiguous(), "fc2_words": fc2.to(torch.int32)},
                w1 // 2)

    # -- views -------------------------------------------------------------------------

    def tile_words(self, proj: str, e: int) -> list[tuple[int, int, torch.Tensor]]:
        """Runs of equal K of one expert's matrix: ``(first tile, K, trellis [in/16, out/16,
        16K])`` along the intermediate axis (FC1: output columns, FC2: input rows)."""
        if proj not in ("gate", "up", "down"):
            raise ValueError(f"projection must be gate, up or down, got {proj!r}")
        bits = (self.fc2_bits if proj == "down" else self.fc1_bits)[e].tolist()
        h16 = self.gate_trellis.shape[1]
        runs, start = [], 0
        for j in range(1, len(bits) + 1):
            if j == len(bits) or bits[j] != bits[start]:
                runs.append((start, j, bits[start]))
                start = j
        out = []
        if proj == "down":
            off = self.fc2_offsets()[e].tolist()
            for a, b, k in runs:
                words = self.down_trellis[e, off[a]: off[b]]
                out.append((a, k, words.reshape(b - a, h16, 16 * k)))
        else:
            off = self.fc1_offsets()[e].tolist()
            rows = getattr(self, f"{proj}_trellis")[e]
            for a, b, k in runs:
                out.append((a, k, rows[:, off[a]: off[b]].reshape(h16, b - a, 16 * k)))
        return out

    def w_hat(self, proj: str, e: int) -> torch.Tensor:
        """float32 ``W_hat`` of one expert's projection ([H, I] for gate / up, [I, H] for
        down), each run of tiles decoded at its own K."""
        parts = [tc.decode(words, self.codebook) for _, _, words in self.tile_words(proj, e)]
        return torch.cat(parts, dim=0 if proj == "down" else 1)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("gate_trellis", "up_trellis", "down_trellis", "fc1_bits", "fc2_bits",
                     "gate_suh", "gate_svh", "up_suh", "up_svh", "down_suh", "down_svh"):
            yield name, getattr(self, name)
        for name in ("rotation_draws", "pre_signs", "post_signs"):
            if getattr(self, name) is not None:
                yield name, getattr(self, name)

    def to(self, device: torch.device | str) -> "MixedMoEWeights":
        moved = {name: t.to(device) for name, t in self.tensors()}
        return MixedMoEWeights(codebook=self.codebook, profile=self.profile, **moved)

    # -- constructors --------------------------------------------------------------------

    @classmethod
    def from_tiles(
        cls,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        fc1_bits: torch.Tensor,
        fc2_bits: torch.Tensor,
        **vectors,
    ) -> "MixedMoEWeights":
        """Build from tile-form trellis padded to a common width: ``gate`` / ``up`` int16
        [E, H/16, I/16, 16*Kmax], ``down`` [E, I/16, H/16, 16*Kmax], each tile's first
        ``16K`` words used (the rest must be zero). ``vectors``: the remaining fields."""
        for name, t, bits in (("gate", gate, fc1_bits), ("up", up, fc1_bits)):
            cut = torch.arange(t.shape[-1], device=t.device) >= 16 * bits[:, None, :, None]
            if bool((t.masked_select(cut) != 0).any()):
                raise ValueError(f"{name} tiles have nonzero words past their 16K")
        cut = torch.arange(down.shape[-1], device=down.device) >= 16 * fc2_bits[:, :, None, None]
        if bool((down.masked_select(cut) != 0).any()):
            raise ValueError("down tiles have nonzero words past their 16K")
        return cls(gate_trellis=pack_fc1(gate, fc1_bits), up_trellis=pack_fc1(up, fc1_bits),
                   down_trellis=pack_fc2(down, fc2_bits), fc1_bits=fc1_bits, fc2_bits=fc2_bits,
                   **vectors)

    def to_tiles(self, kmax: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The tile form of :meth:`from_tiles` (``gate``, ``up``, ``down``), padded to
        ``16 * kmax`` words per tile (default: the widest K present)."""
        k = max(self.rate_set) if kmax is None else kmax
        return {"gate": unpack_fc1(self.gate_trellis, self.fc1_bits, k),
                "up": unpack_fc1(self.up_trellis, self.fc1_bits, k),
                "down": unpack_fc2(self.down_trellis, self.fc2_bits, self.hidden, k)}

    @classmethod
    def from_uniform(cls, w: MoEWeights) -> "MixedMoEWeights":
        """The same layer in mixed storage (every tile at ``w.bits``)."""
        e, i16 = w.num_experts, w.intermediate // tc.TILE
        bits = torch.full((e, i16), w.bits, dtype=torch.uint8, device=w.device)
        vecs = {n: t for n, t in w.tensors() if not n.endswith("_trellis")}
        extra = {n: getattr(w, n) for n in ("rotation_draws", "pre_signs", "post_signs")}
        return cls.from_tiles(w.gate_trellis, w.up_trellis, w.down_trellis, bits, bits.clone(),
                              codebook=w.codebook, profile=w.profile, **vecs, **extra)

    @classmethod
    def random(
        cls,
        fc1_bits: torch.Tensor,
        fc2_bits: torch.Tensor,
        hidden: int,
        codebook: str = "sqg_e4m3",
        *,
        shared_hidden_vectors: bool = True,
        coupled: bool = False,
        seed: int = 0,
        device: Optional[torch.device | str] = None,
    ) -> "MixedMoEWeights":
        """Seeded random experts at the given rate maps (vectors as
        :meth:`MoEWeights.random` draws them at the widest K; codes uniform random), packed
        on ``device`` (default: the CPU)."""
        e, i16 = fc1_bits.shape
        kmax = int(max(fc1_bits.max(), fc2_bits.max()))
        base = MoEWeights.random(e, hidden, i16 * tc.TILE, kmax, codebook,
                                 shared_hidden_vectors=shared_hidden_vectors, coupled=coupled,
                                 seed=seed, device=device)
        fc1_bits, fc2_bits = fc1_bits.to(base.device), fc2_bits.to(base.device)
        words = torch.arange(16 * kmax, device=base.device)
        keep1 = words < 16 * fc1_bits[:, None, :, None]
        keep2 = words < 16 * fc2_bits[:, :, None, None]
        vecs = {n: t for n, t in base.tensors() if not n.endswith("_trellis")}
        extra = {n: getattr(base, n) for n in ("rotation_draws", "pre_signs", "post_signs")}
        return cls.from_tiles(base.gate_trellis * keep1, base.up_trellis * keep1,
                              base.down_trellis * keep2, fc1_bits, fc2_bits,
                              codebook=codebook, **vecs, **extra)


def uniform_bits_map(e: int, intermediate: int, bits: Sequence[int] | int) -> torch.Tensor:
    """uint8 [E, I/16] from one K or one K per 128-channel record (same for every expert)."""
    i16 = intermediate // tc.TILE
    if isinstance(bits, int):
        return torch.full((e, i16), bits, dtype=torch.uint8)
    per_tile = torch.tensor(list(bits), dtype=torch.uint8).repeat_interleave(8)
    if per_tile.numel() != i16:
        raise ValueError(f"{len(bits)} records do not cover {intermediate} channels")
    return per_tile.expand(e, i16).clone()

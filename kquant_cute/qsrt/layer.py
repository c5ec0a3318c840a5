"""The in-memory QSRT layer: :class:`QSRTLayer` (a whole atoms-v2 layer in global, all-atom
coordinates), its file sections (:meth:`~QSRTLayer.atom_rows`, format and shared-scale
sections), its ranks sliced in memory (:meth:`~QSRTLayer.rank`, the same code the loader
uses), and :func:`random_layer` (seeded synthetic layers for tests and benchmarks).

For the mixed H308 profiles a :class:`QSRTLayer` holds every tile padded to K=4 words (the
first 16K used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import trellis as tc
from ..mixed import MixedMoEWeights
from ..weights import MoEWeights
from . import format as fmt
from . import layout, rows
from .extent import rank_extent
from .format import (ATOM_CHANNELS, CODEBOOK, FORMAT_SECTION_BYTES, KIMI_K3, MAX_DRAW,
                     MIXED_TILE_BITS, PRODUCTION_PROFILE, PROFILES, SHARED_SCALE_SECTION_BYTES,
                     Geometry, QSRTFormatError)

__all__ = ["QSRTLayer", "random_layer"]


@dataclass(frozen=True, eq=False)
class QSRTLayer:
    """One whole atoms-v2 layer in global (all-atom) coordinates.

    * ``fc1``: int16 [E, H/16, 2I/16, 16K] -- the stored upstream matrix [H, 2I] whose
      output axis is the transformed pre-activation axis q (its first half is the file's
      ``w1``, read with ``w1_suh``; its second half ``w3``, read with ``w3_suh``). Atom ``a``
      holds q-chunks ``2a`` and ``2a + 1`` (32 coordinates each).
    * ``fc1_svh``: fp16 [E, 2I] in q order. ``fc2``: int16 [E, I/16, H/16, 16K] (the
      down matrix [I, H]); ``fc2_suh``: fp16 [E, I].
    * ``w1_suh``, ``w3_suh``, ``w2_svh``: fp16 [H] shared by the layer's experts.
    * ``format_codes``: uint8 [E]; ``draws``: uint8 [E] (zeros for uncoupled profiles).
    """

    layer: int
    profile: str
    geometry: Geometry
    fc1: torch.Tensor
    fc1_svh: torch.Tensor
    fc2: torch.Tensor
    fc2_suh: torch.Tensor
    w1_suh: torch.Tensor
    w3_suh: torch.Tensor
    w2_svh: torch.Tensor
    format_codes: torch.Tensor
    draws: torch.Tensor

    def __post_init__(self) -> None:
        fmt.check_layer_index(self.layer)
        prof = fmt.supported(fmt.profile(self.profile))
        g, bits = self.geometry, prof.uniform_bits
        e, h16, i16 = g.num_experts, g.hidden // tc.TILE, g.intermediate // tc.TILE
        if bits is None:
            layout.check_geometry(prof, g)
            bits = MIXED_TILE_BITS
        expected = {
            "fc1": (torch.int16, (e, h16, 2 * i16, tc.TILE * bits)),
            "fc1_svh": (torch.float16, (e, 2 * g.intermediate)),
            "fc2": (torch.int16, (e, i16, h16, tc.TILE * bits)),
            "fc2_suh": (torch.float16, (e, g.intermediate)),
            "w1_suh": (torch.float16, (g.hidden,)),
            "w3_suh": (torch.float16, (g.hidden,)),
            "w2_svh": (torch.float16, (g.hidden,)),
            "format_codes": (torch.uint8, (e,)),
            "draws": (torch.uint8, (e,)),
        }
        for name, (dtype, shape) in expected.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise QSRTFormatError(f"QSRTLayer.{name} must be {dtype} {shape}, got {got}")
        if prof.uniform_bits is None:
            for name in ("fc1", "fc2"):
                words = getattr(self, name)
                k = self.tile_bits(name)
                k = k[None, None, :, None] if name == "fc1" else k[None, :, None, None]
                if bool((words.masked_select(torch.arange(words.shape[-1]) >= 16 * k) != 0).any()):
                    raise QSRTFormatError(f"QSRTLayer.{name}: nonzero words past a tile's 16K")

    def tile_bits(self, family: str) -> torch.Tensor:
        """uint8 [tiles] K of each logical FC1 column tile (``fc1``) or FC2 row tile."""
        prof = PROFILES[self.profile]
        i16 = self.geometry.intermediate // tc.TILE
        n = 2 * i16 if family == "fc1" else i16
        if prof.uniform_bits is not None:
            return torch.full((n,), prof.uniform_bits, dtype=torch.uint8)
        return torch.tensor([layout.logical_tile_bits(family, j, i16) for j in range(n)],
                            dtype=torch.uint8)

    # -- the file's sections ------------------------------------------------------------

    def atom_rows(self) -> torch.Tensor:
        """uint8 [atom_slots, stride]: the ``qsrt_atoms`` tensor of this layer (mixed coupled
        profile: 1-D, each row 4 KiB aligned)."""
        if PROFILES[self.profile].uniform_bits is None:
            return _mixed_atom_tensor(self)
        g = self.geometry
        bits = PROFILES[self.profile].uniform_bits
        e, a, h16 = g.num_experts, g.atom_slots, g.hidden // tc.TILE
        # FC1 plane p of section s of atom a is q-tile 4a + 2s + p; FC2 plane p is K-tile 2a + p.
        fc1 = self.fc1.reshape(e, h16, a, 2, 2, tc.TILE * bits).permute(2, 0, 3, 4, 1, 5)
        fc2 = self.fc2.reshape(e, a, 2, h16, tc.TILE * bits).permute(1, 0, 2, 3, 4)
        sections = torch.cat(
            [fc1[:, :, 0].reshape(a, e, -1), fc1[:, :, 1].reshape(a, e, -1),
             fc2.reshape(a, e, -1)], dim=2).contiguous().view(torch.uint8)
        svh = self.fc1_svh.reshape(e, a, 2, ATOM_CHANNELS).permute(1, 0, 2, 3)
        suh = self.fc2_suh.reshape(e, a, 1, ATOM_CHANNELS).permute(1, 0, 2, 3)
        spans = torch.cat([svh, suh], dim=2).contiguous().view(torch.uint8).reshape(a, e, -1)
        bundles = torch.cat([sections, spans], dim=2).reshape(a, -1)
        out = torch.zeros(a, g.row_stride(bits), dtype=torch.uint8)
        out[:, : bundles.shape[1]] = bundles
        return out

    def format_section(self) -> torch.Tensor:
        e = self.geometry.num_experts
        out = torch.zeros(FORMAT_SECTION_BYTES, dtype=torch.uint8)
        out[:e] = self.format_codes
        if PROFILES[self.profile].coupled:
            out[e: 2 * e] = self.draws
        return out

    def shared_scale_section(self) -> torch.Tensor:
        out = torch.zeros(SHARED_SCALE_SECTION_BYTES, dtype=torch.uint8)
        raw = torch.stack([self.w1_suh, self.w3_suh, self.w2_svh]).contiguous().view(torch.uint8)
        out[: raw.numel()] = raw.reshape(-1)
        return out

    def rank(self, tp_size: int, tp_rank: int, *,
             pad: bool = True) -> MoEWeights | MixedMoEWeights:
        """The weights of one rank, sliced in memory (same as :func:`~.read.load_layer`)."""
        ext = rank_extent(self.profile, self.geometry, self.layer, tp_size, tp_rank, pad=pad)
        if PROFILES[self.profile].uniform_bits is None:
            flat = self.atom_rows().reshape(-1)
            split = rows.mixed_split_rows(self.profile, self.geometry, self.layer, ext, flat, 0)
            return rows.mixed_rank_weights(self.profile, self.geometry, self.layer, ext, split,
                                           self.w1_suh, self.w3_suh, self.w2_svh, self.draws)
        mine = self.atom_rows()[ext.first_atom: ext.first_atom + ext.atom_count]
        return rows.rank_weights(self.profile, self.geometry, self.layer, ext, mine,
                                 self.w1_suh, self.w3_suh, self.w2_svh, self.draws)


def _mixed_atom_tensor(layer: QSRTLayer) -> torch.Tensor:
    """The ``qsrt_atoms`` tensor of a mixed layer (2-D fixed stride, or 1-D coupled)."""
    g, name = layer.geometry, layer.profile
    i16 = g.intermediate // tc.TILE
    out = []
    for row in layout.row_layouts(name, g.num_experts, g.hidden, layer.layer):
        buf = torch.zeros(row.row_bytes, dtype=torch.uint8)
        for e in range(g.num_experts):
            kinds = row.kinds[e]
            planes, spans = [], []
            for m, pair in enumerate(layout.bundle_sources(name, layer.layer, e, row.atom, i16)):
                kind_bits = layout.PAIR_KIND_BITS[kinds[0 if m < 2 else 1]]
                for side, (family, tile) in enumerate(pair):
                    k = kind_bits[side]
                    if layout.logical_tile_bits(family, tile, i16) != k:  # pragma: no cover
                        raise AssertionError("placement and record schedule disagree")
                    if family == "fc1":
                        planes.append(layer.fc1[e, :, tile, : 16 * k])
                        spans.append(layer.fc1_svh[e, 16 * tile: 16 * tile + 16])
                    else:
                        planes.append(layer.fc2[e, tile, :, : 16 * k])
                        spans.append(layer.fc2_suh[e, 16 * tile: 16 * tile + 16])
            raw = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in planes] +
                            [torch.cat(spans).contiguous().view(torch.uint8)])
            buf[row.offsets[e]: row.offsets[e] + raw.numel()] = raw
        out.append(buf)
    if name == layout.UNCOUPLED:
        return torch.stack(out)
    return torch.cat(out)


def random_layer(
    layer: int,
    geometry: Geometry = KIMI_K3,
    *,
    seed: int = 0,
    draws: Optional[Sequence[int]] = None,
    profile: str = PRODUCTION_PROFILE,
) -> QSRTLayer:
    """A seeded synthetic layer: uniform random trellis codes (every bitstream is a valid
    weight), random-sign vectors with O(1) input-side and ~1/sqrt(fan-in) output-side
    magnitudes, and per-expert draws (random in 0..7 unless given)."""
    prof = fmt.supported(fmt.profile(profile))
    bits = prof.uniform_bits
    g = geometry
    e = g.num_experts
    gen = torch.Generator().manual_seed(seed)
    if bits is None:   # mixed: tile form at K=4 words, each tile's codes at its record's K
        layout.check_geometry(prof, g)
        i16 = g.intermediate // tc.TILE
        rms = float(tc.codebook_lut(CODEBOOK, 3).square().mean().sqrt())

        def codes(n_rows: int, cols: int) -> torch.Tensor:
            full = torch.stack([tc.random_trellis(n_rows, cols, MIXED_TILE_BITS, gen)
                                for _ in range(e)])
            family = "fc1" if cols == 2 * g.intermediate else "fc2"
            k = torch.tensor([layout.logical_tile_bits(family, j, i16)
                              for j in range(full.shape[2 if family == "fc1" else 1])])
            keep = torch.arange(full.shape[-1]) < 16 * (k[None, None, :, None] if family == "fc1"
                                                       else k[None, :, None, None])
            return full * keep
    else:
        rms = float(tc.codebook_lut(CODEBOOK, bits).square().mean().sqrt())

        def codes(n_rows: int, cols: int) -> torch.Tensor:
            return torch.stack([tc.random_trellis(n_rows, cols, bits, gen) for _ in range(e)])

    def vec(shape: tuple[int, ...], magnitude: float) -> torch.Tensor:
        sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
        return (sign * (torch.rand(shape, generator=gen) * 0.5 + 0.75) * magnitude).half()

    if not prof.coupled:
        d = torch.zeros(e, dtype=torch.int64)
        if draws is not None:
            raise QSRTFormatError(f"profile {prof.name} is uncoupled: it has no rotation draws")
    elif draws is None:
        d = torch.randint(0, MAX_DRAW + 1, (e,), generator=gen, dtype=torch.int64)
    else:
        d = torch.tensor(list(draws), dtype=torch.int64)
        if d.shape != (e,) or bool(((d < 0) | (d > MAX_DRAW)).any()):
            raise QSRTFormatError(f"draws must be {e} ints in 0..{MAX_DRAW}")
    return QSRTLayer(
        layer=layer, profile=prof.name, geometry=g,
        fc1=codes(g.hidden, 2 * g.intermediate),
        fc1_svh=vec((e, 2 * g.intermediate), 1.0 / (math.sqrt(g.hidden) * rms)),
        fc2=codes(g.intermediate, g.hidden),
        fc2_suh=vec((e, g.intermediate), 1.0),
        w1_suh=vec((g.hidden,), 1.0), w3_suh=vec((g.hidden,), 1.0),
        w2_svh=vec((g.hidden,), 1.0 / (math.sqrt(g.intermediate) * rms)),
        format_codes=torch.full((e,), prof.format_code, dtype=torch.uint8),
        draws=d.to(torch.uint8),
    )

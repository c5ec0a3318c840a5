"""QSRT atom rows -> one rank's weights: splitting rows into bundles, checking them, and
building :class:`~kquant_cute.weights.MoEWeights` (uniform K) or
:class:`~kquant_cute.mixed.MixedMoEWeights` (H308) of a :class:`~.extent.RankExtent`.

Shared by the reader (rows read from a file) and :class:`~.layer.QSRTLayer` (rows built in
memory), so a loaded rank and an in-memory rank are built by the same code.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import trellis as tc
from ..mixed import MixedMoEWeights
from ..weights import MoEWeights
from . import format as fmt
from . import layout
from .extent import RankExtent
from .format import ATOM_CHANNELS, CODEBOOK, PROFILES, SPAN_BYTES, Geometry


def bundles(rows: torch.Tensor, geometry: Geometry, bits: int) -> dict[str, torch.Tensor]:
    """Split uniform-K atom rows [A, stride] into per-atom tensors (the inverse of
    :meth:`QSRTLayer.atom_rows`): ``words`` int16 [A, E, 3, 2, H/16, 16K] and ``spans`` fp16
    [A, E, 3, 32]."""
    e, a, h16 = geometry.num_experts, rows.shape[0], geometry.hidden // tc.TILE
    sec = fmt.matrix_atom_bytes(geometry.hidden, bits, bits)
    b = fmt.bundle_bytes(geometry.hidden, bits)
    parts = rows[:, : e * b].reshape(a, e, b)
    # A view, not a copy: each bundle's words are contiguous and start at an even byte.
    words = parts[:, :, : 3 * sec].view(torch.int16).reshape(a, e, 3, 2, h16, tc.TILE * bits)
    spans = parts[:, :, 3 * sec:].contiguous().view(torch.float16).reshape(a, e, 3, ATOM_CHANNELS)
    return {"words": words, "spans": spans}


def check_uniform_rows(path: Any, geometry: Geometry, bits: int, first: int,
                       rows: torch.Tensor) -> None:
    """QSRTFormatError naming ``path`` and the atom when a row has nonzero padding after its
    bundles or a non-finite span."""
    payload = geometry.num_experts * fmt.bundle_bytes(geometry.hidden, bits)
    tail = rows[:, payload:]
    if bool((tail != 0).any()):
        r = int((tail != 0).any(dim=1).nonzero()[0])
        raise fmt.fail(path, f"atom row {first + r} has nonzero padding after its "
                             f"{payload} bundle bytes")
    spans = bundles(rows, geometry, bits)["spans"]
    if not bool(torch.isfinite(spans).all()):
        a, e = (~torch.isfinite(spans)).flatten(2).any(dim=2).nonzero()[0].tolist()
        raise fmt.fail(path, f"atom {first + a}, expert {e}: non-finite svh/suh span")


def rank_weights(
    profile: str,
    geometry: Geometry,
    layer: int,
    ext: RankExtent,
    rows: torch.Tensor,
    w1_suh: torch.Tensor,
    w3_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    draws: torch.Tensor,
) -> MoEWeights:
    """One rank's MoEWeights from its uniform-K atom rows (validated by the caller), built
    on the rows' device (the header's CPU vectors and the signs are moved there)."""
    bits = PROFILES[profile].uniform_bits
    assert bits is not None
    parts = bundles(rows, geometry, bits)
    words, spans = parts["words"], parts["spans"]
    e, a, h16 = geometry.num_experts, ext.atom_count, geometry.hidden // tc.TILE
    pa = ext.padded_atoms
    k16 = tc.TILE * bits
    dev = rows.device

    def fc1_slot(s: int) -> torch.Tensor:
        # [A, E, plane, H/16, 16K] -> [E, H/16, 2A(+pad), 16K]: N-tile 2a + plane; padded
        # tiles are zero (every word is written once: no zero fill of the whole tensor).
        out = torch.empty(e, h16, 2 * pa, k16, dtype=torch.int16, device=dev)
        out[:, :, : 2 * a].view(e, h16, a, 2, k16).copy_(words[:, :, s].permute(1, 3, 0, 2, 4))
        out[:, :, 2 * a:].zero_()
        return out

    down = torch.empty(e, 2 * pa, h16, k16, dtype=torch.int16, device=dev)
    down[:, : 2 * a].view(e, a, 2, h16, k16).copy_(words[:, :, 2].permute(1, 0, 2, 3, 4))
    down[:, 2 * a:].zero_()

    def span(m: int) -> torch.Tensor:
        # Padded channels keep zero vectors: zero svh zeroes the padded pre-activations,
        # so the padded SiTU outputs and their FC2 contributions are exactly zero.
        out = torch.zeros(e, pa * ATOM_CHANNELS, dtype=torch.float16, device=dev)
        out[:, : a * ATOM_CHANNELS] = spans[:, :, m].permute(1, 0, 2).reshape(e, -1)
        return out

    source_suh = w1_suh if ext.first_atom < geometry.half_slot else w3_suh
    pre, post = fmt.coupled_signs(draws, geometry.intermediate, ext.first_atom, ext.atom_count,
                                  ext.padded_atoms)
    return MoEWeights(
        gate_trellis=fc1_slot(0), up_trellis=fc1_slot(1), down_trellis=down,
        gate_suh=source_suh.to(dev, copy=True), up_suh=source_suh.to(dev, copy=True),
        down_svh=w2_svh.to(dev, copy=True), gate_svh=span(0), up_svh=span(1),
        down_suh=span(2), codebook=CODEBOOK, profile=profile,
        rotation_draws=draws.to(dev, copy=True), pre_signs=pre.to(dev), post_signs=post.to(dev),
    )


# --------------------------------------------------------------------------------------
# Mixed-rate (H308) rows
# --------------------------------------------------------------------------------------


def mixed_split_rows(profile: str, g: Geometry, layer: int, ext: RankExtent,
                     flat: torch.Tensor, base: int) -> dict[int, torch.Tensor]:
    """Atom rows of ``ext`` from ``flat`` bytes that start at atom-tensor offset ``base``."""
    rows = layout.row_layouts(profile, g.num_experts, g.hidden, layer)
    out = {}
    for a in range(ext.first_atom, ext.first_atom + ext.atom_count):
        start = layout.row_offset(profile, rows, a) - base
        out[a] = flat[start: start + rows[a].row_bytes]
    return out


def mixed_bundle(row: torch.Tensor, row_layout: layout.RowLayout, e: int,
                 hidden: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """One bundle: ``planes[section][side]`` int16 [H/16, 16K] and spans fp16 [3, 2, 16]."""
    h16 = hidden // tc.TILE
    cursor = row_layout.offsets[e]
    planes = []
    for m in range(3):
        bits = layout.PAIR_KIND_BITS[row_layout.kinds[e][0 if m < 2 else 1]]
        pair = []
        for k in bits:
            n = h16 * tc.TILE * k * 2
            pair.append(row[cursor: cursor + n].clone().view(torch.int16).reshape(h16, 16 * k))
            cursor += n
        planes.append(pair)
    spans = row[cursor: cursor + 3 * SPAN_BYTES].clone().view(torch.float16).reshape(3, 2, 16)
    return planes, spans


def check_mixed_rows(path: Any, profile: str, g: Geometry, layer: int,
                     rows: dict[int, torch.Tensor]) -> None:
    """QSRTFormatError naming ``path`` and the atom when a row has nonzero padding after its
    bundles or a non-finite span."""
    layouts = layout.row_layouts(profile, g.num_experts, g.hidden, layer)
    for a, row in rows.items():
        tail = row[layouts[a].payload:]
        if bool((tail != 0).any()):
            raise fmt.fail(path, f"atom row {a} has nonzero padding after its "
                                 f"{layouts[a].payload} bundle bytes")
        for e in range(g.num_experts):
            spans = mixed_bundle(row, layouts[a], e, g.hidden)[1]
            if not bool(torch.isfinite(spans).all()):
                raise fmt.fail(path, f"atom {a}, expert {e}: non-finite svh/suh span")


def mixed_rank_weights(
    profile: str, g: Geometry, layer: int, ext: RankExtent, rows: dict[int, torch.Tensor],
    w1_suh: torch.Tensor, w3_suh: torch.Tensor, w2_svh: torch.Tensor, draws: torch.Tensor,
) -> MixedMoEWeights:
    """One rank's MixedMoEWeights from its atom rows (validated by the caller)."""
    layouts = layout.row_layouts(profile, g.num_experts, g.hidden, layer)
    src = layout.rank_sources(profile, ext)
    e, h16, n = g.num_experts, g.hidden // tc.TILE, len(src["down"])
    kw = tc.TILE * fmt.MIXED_TILE_BITS
    tiles = {"gate": torch.zeros(e, h16, n, kw, dtype=torch.int16),
             "up": torch.zeros(e, h16, n, kw, dtype=torch.int16),
             "down": torch.zeros(e, n, h16, kw, dtype=torch.int16)}
    vecs = {name: torch.zeros(e, 16 * n, dtype=torch.float16) for name in ("gate", "up", "down")}
    bits = {"fc1": torch.zeros(e, n, dtype=torch.uint8), "fc2": torch.zeros(e, n, dtype=torch.uint8)}
    for x in range(e):
        cache = {a: mixed_bundle(rows[a], layouts[a], x, g.hidden) for a in rows}
        for name, family in (("gate", "fc1"), ("up", "fc1"), ("down", "fc2")):
            for j, (atom, section, side) in enumerate(src[name]):
                planes, spans = cache[atom]
                words = planes[section][side]
                k = words.shape[1] // tc.TILE
                if name == "down":
                    tiles[name][x, j, :, : 16 * k] = words
                else:
                    tiles[name][x, :, j, : 16 * k] = words
                vecs[name][x, 16 * j: 16 * j + 16] = spans[section, side]
                if name != "up":
                    bits[family][x, j] = k
    extra: dict[str, Any]
    if PROFILES[profile].coupled:
        suh = w1_suh if ext.first_atom < g.half_slot else w3_suh
        pre, post = fmt.coupled_signs(draws, g.intermediate, ext.first_atom, ext.atom_count)
        extra = dict(gate_suh=suh.clone(), up_suh=suh.clone(), rotation_draws=draws.clone(),
                     pre_signs=pre, post_signs=post)
    else:
        extra = dict(gate_suh=w1_suh.clone(), up_suh=w3_suh.clone())
    return MixedMoEWeights.from_tiles(
        tiles["gate"], tiles["up"], tiles["down"], bits["fc1"], bits["fc2"],
        gate_svh=vecs["gate"], up_svh=vecs["up"], down_suh=vecs["down"], down_svh=w2_svh.clone(),
        codebook=CODEBOOK, profile=profile, **extra)

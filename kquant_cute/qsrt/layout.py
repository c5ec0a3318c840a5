"""QSRT atoms-v2 byte layout of every profile: uniform bundles, the H308 rate maps and
their bundles, and the layer file's rate-dependent header metadata.

This module owns, for the two H308 profiles (22 K3 + 2 K4 records of 128 channels per expert
and matrix family, ~3.08 bpw):

* the placement rule as pure functions: :func:`pair_rotation` (``rho = (5e + layer) mod 12``),
  :func:`physical_to_logical_records`, :func:`pair_kinds` (per expert, layer and physical
  record pair: FC1 / FC2 pair kind P22 / P24 / P33 / P43 / P44), :func:`record_bits` and
  :func:`rate_map` (bits of every physical record);
* the byte layout of a bundle: per matrix section a low and a high 16-channel plane (each
  ``[H/16][16K]`` int16 at its record's K), then the three 64-byte fp16 spans, each
  ``[low 16][high 16]``. ``k3x22_k4x2``: each atom row holds the row's P33 experts (expert
  order), then its P43 experts, padded to one 4 KiB-aligned stride. Coupled H308: one static
  pair kind per physical pair (FC1 P43 at pairs 5 and 11, FC2 P44 at pair 11), one 1-D atom
  tensor whose rows are each 4 KiB aligned, and P43 stores its K4 record first;
* which tile of the layer's logical matrices each plane holds (:func:`bundle_sources`) and
  which plane each tile of a rank's weights comes from (:func:`rank_sources`);

and for every profile the ``qsrt_atoms`` tensor shape and the canonical header
``__metadata__`` (:func:`atom_shape`, :func:`file_metadata`: what the writer emits and the
reader requires). Alignment, span bytes, layer range and profile names are asked of
:mod:`kquant_cute.qsrt.format`; rank extents live in :mod:`kquant_cute.qsrt.extent`.
Sources: docs/formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import trellis as tc
from . import format as fmt
from .format import Geometry, Profile, QSRTFormatError

__all__ = [
    "MIXED_PROFILES",
    "LOGICAL_RECORD_BITS",
    "RATE_SET",
    "PAIR_KIND_BITS",
    "pair_rotation",
    "pair_is_p43",
    "physical_to_logical_records",
    "pair_kinds",
    "record_bits",
    "rate_map",
    "row_layouts",
    "bundle_sources",
    "rank_sources",
    "atom_shape",
    "file_metadata",
]

UNCOUPLED = fmt.H308_UNCOUPLED
COUPLED = fmt.H308_COUPLED
MIXED_PROFILES = fmt.MIXED_PROFILES

RECORD_CHANNELS = 128
RECORDS = 24                      # per expert and matrix family (Kimi-K3: 3072 channels)
PAIRS = RECORDS // 2
ATOMS_PER_PAIR = 8                # a 32-channel atom = stripe t of both records of a pair
TILES_PER_RECORD = RECORD_CHANNELS // tc.TILE
PAIR_ROTATION_MUL = 5
#: The logical record schedule of both H308 profiles (records 22 and 23 at K4).
LOGICAL_RECORD_BITS = (3,) * 22 + (4,) * 2
#: The distinct K of both H308 profiles (what a fused kernel for them decodes: MoESpec.bits_set).
RATE_SET = tuple(sorted(set(LOGICAL_RECORD_BITS)))
#: (low, high) record bits of each pair kind.
PAIR_KIND_BITS = {"P22": (2, 2), "P24": (2, 4), "P33": (3, 3), "P43": (4, 3), "P44": (4, 4)}
#: Coupled H308: static (FC1, FC2) kinds; every other pair is (P33, P33).
COUPLED_KINDS = {5: ("P43", "P33"), 11: ("P43", "P44")}
FAMILIES = ("fc1", "fc2")


def _check(profile: str, layer: int, expert: int, num_experts: Optional[int] = None) -> None:
    if profile not in MIXED_PROFILES:
        raise QSRTFormatError(f"{profile!r} is not a mixed-rate profile "
                              f"({', '.join(MIXED_PROFILES)})")
    fmt.check_layer_index(layer)
    if isinstance(expert, bool) or not isinstance(expert, int) or expert < 0 or \
            (num_experts is not None and expert >= num_experts):
        raise QSRTFormatError(f"expert must be an int in 0..{(num_experts or 1) - 1}, "
                              f"got {expert!r}")


def check_geometry(prof: Profile, g: Geometry, path=None) -> None:
    """QSRTFormatError unless ``g`` has the channels the H308 placement rule covers."""
    want = RECORDS * RECORD_CHANNELS
    if g.intermediate != want:
        raise fmt.fail(path, f"profile {prof.name}: intermediate {g.intermediate} is not the "
                             f"{want} channels ({RECORDS} records) its placement rule covers")


def pair_rotation(layer: int, expert: int) -> int:
    """``rho = (5 * expert + layer) mod 12``: the cyclic shift of an expert's pairs."""
    _check(UNCOUPLED, layer, expert)
    return (PAIR_ROTATION_MUL * expert + layer) % PAIRS


def pair_is_p43(layer: int, expert: int, pair: int) -> bool:
    """``k3x22_k4x2``: physical pair ``pair`` is P43 iff ``(pair - rho) mod 12`` is 0 or 6."""
    return (pair - pair_rotation(layer, expert)) % PAIRS in (0, PAIRS // 2)


def _base_placement() -> tuple[int, ...]:
    # Base order: the two K4 logical records (22, 23) at physical records 0 and 12 (the low
    # records of base pairs 0 and 6), the K3 records 0..21 in order everywhere else.
    out, ordinary = [], iter(range(22))
    for physical in range(RECORDS):
        out.append({0: 22, RECORDS // 2: 23}.get(physical) or next(ordinary))
    return tuple(out)


_BASE = _base_placement()


def physical_to_logical_records(layer: int, expert: int) -> tuple[int, ...]:
    """``k3x22_k4x2``: the logical record stored at each of the 24 physical records
    (``2 * pair + side``; side 0 = low, 1 = high) of ``expert`` in ``layer``."""
    rho = pair_rotation(layer, expert)
    return tuple(_BASE[2 * ((p // 2 - rho) % PAIRS) + p % 2] for p in range(RECORDS))


def pair_kinds(profile: str, layer: int, expert: int) -> tuple[tuple[str, str], ...]:
    """``(fc1_kind, fc2_kind)`` of each physical record pair of ``expert`` in ``layer``."""
    _check(profile, layer, expert)
    if profile == COUPLED:
        return tuple(COUPLED_KINDS.get(p, ("P33", "P33")) for p in range(PAIRS))
    kinds = []
    for p in range(PAIRS):
        k = "P43" if pair_is_p43(layer, expert, p) else "P33"
        kinds.append((k, k))
    return tuple(kinds)


def record_bits(profile: str, layer: int, expert: int, family: str) -> tuple[int, ...]:
    """K of each physical record (``2 * pair + side``) of one matrix family."""
    if family not in FAMILIES:
        raise QSRTFormatError(f"family must be one of {FAMILIES}, got {family!r}")
    f = FAMILIES.index(family)
    return tuple(b for kinds in pair_kinds(profile, layer, expert)
                 for b in PAIR_KIND_BITS[kinds[f]])


def rate_map(profile: str, num_experts: int, layer: int) -> torch.Tensor:
    """uint8 [E, 2, 24]: :func:`record_bits` of every expert, FC1 then FC2."""
    return torch.tensor([[record_bits(profile, layer, e, f) for f in FAMILIES]
                         for e in range(num_experts)], dtype=torch.uint8)


# --------------------------------------------------------------------------------------
# Byte layout
# --------------------------------------------------------------------------------------


def section_bytes(hidden: int, kind: str) -> int:
    """One matrix section of one atom: two 16-channel planes [H/16][16K] int16."""
    lo, hi = PAIR_KIND_BITS[kind]
    return (hidden // tc.TILE) * tc.TILE * (lo + hi) * 2


def bundle_bytes(hidden: int, fc1_kind: str, fc2_kind: str) -> int:
    return (2 * section_bytes(hidden, fc1_kind) + section_bytes(hidden, fc2_kind)
            + 3 * fmt.SPAN_BYTES)


@dataclass(frozen=True)
class RowLayout:
    """Where each expert's bundle sits in atom row ``atom``: ``offsets[e]`` bytes into the
    row, with kinds ``kinds[e]``; ``payload`` bytes used, ``row_bytes`` the row's extent."""

    atom: int
    offsets: tuple[int, ...]
    kinds: tuple[tuple[str, str], ...]
    payload: int
    row_bytes: int


def row_layouts(profile: str, num_experts: int, hidden: int, layer: int) -> tuple[RowLayout, ...]:
    """Every atom row's bundle placement (96 rows)."""
    kinds = [pair_kinds(profile, layer, e) for e in range(num_experts)]
    rows = []
    for pair in range(PAIRS):
        per = [kinds[e][pair] for e in range(num_experts)]
        if profile == COUPLED:
            order = list(range(num_experts))
        else:   # P33 group first, then the P43 group, each in expert order
            order = [e for e in range(num_experts) if per[e][0] != "P43"] + \
                    [e for e in range(num_experts) if per[e][0] == "P43"]
        offsets = [0] * num_experts
        cursor = 0
        for e in order:
            offsets[e] = cursor
            cursor += bundle_bytes(hidden, *per[e])
        for t in range(ATOMS_PER_PAIR):
            rows.append(RowLayout(ATOMS_PER_PAIR * pair + t, tuple(offsets), tuple(per),
                                  cursor, fmt.align(cursor)))
    if profile == UNCOUPLED:   # one fixed stride: the widest row, aligned
        stride = max(r.row_bytes for r in rows)
        rows = [RowLayout(r.atom, r.offsets, r.kinds, r.payload, stride) for r in rows]
    return tuple(rows)


def header_metadata(profile: str, num_experts: int, hidden: int, layer: int) -> dict[str, str]:
    """The rate-dependent ``__metadata__`` keys of a mixed layer file (see
    :func:`file_metadata` for the whole header)."""
    if profile == UNCOUPLED:
        return {"atom_slot_stride_bytes": str(row_layouts(profile, num_experts, hidden, layer)[0].row_bytes),
                "p33_atom_bundle_bytes": str(bundle_bytes(hidden, "P33", "P33")),
                "p43_atom_bundle_bytes": str(bundle_bytes(hidden, "P43", "P43"))}
    pairs = ",".join(str(bundle_bytes(hidden, *COUPLED_KINDS.get(p, ("P33", "P33"))))
                     for p in range(PAIRS))
    return {"atom_storage": "pair_variable_stride", "atom_pair_bundle_bytes": pairs,
            **{f"{k.lower()}_matrix_trellis_bytes": str(section_bytes(hidden, k))
               for k in ("P33", "P43", "P44")}}


def atom_tensor_shape(profile: str, num_experts: int, hidden: int, layer: int) -> list[int]:
    rows = row_layouts(profile, num_experts, hidden, layer)
    if profile == UNCOUPLED:
        return [len(rows), rows[0].row_bytes]
    return [sum(r.row_bytes for r in rows)]


def row_offset(profile: str, rows: tuple[RowLayout, ...], atom: int) -> int:
    """Byte offset of atom row ``atom`` in the (flattened) atom tensor."""
    return sum(r.row_bytes for r in rows[:atom])


# --------------------------------------------------------------------------------------
# Which tile each plane holds
# --------------------------------------------------------------------------------------


def _coupled_record_of(kind: str, slot: int, side: int) -> int:
    """Coupled H308 FC1: the pair-local q record (0..3) in file slot ``slot``, ``side``.
    P33 / P44: slot s holds records (s, s + 2); P43 stores its K4 record first: (s + 2, s)."""
    k4_first = kind == "P43"
    return slot + 2 * (1 - side if k4_first else side)


def bundle_sources(profile: str, layer: int, expert: int, atom: int,
                   intermediate_tiles: int) -> list[list[tuple[str, int]]]:
    """For sections 0, 1 (FC1) and 2 (FC2) of ``expert``'s bundle in ``atom``: the
    ``(family, tile)`` of its low and high planes in the layer's logical matrices (FC1: a
    column tile of the [H, 2I] upstream matrix whose first half is w1, second w3; FC2: a
    row tile of the [I, H] down matrix)."""
    pair, t = divmod(atom, ATOMS_PER_PAIR)
    if profile == UNCOUPLED:
        logical = physical_to_logical_records(layer, expert)
        recs = (logical[2 * pair], logical[2 * pair + 1])
        fc1 = [[("fc1", m * intermediate_tiles + TILES_PER_RECORD * r + t) for r in recs]
               for m in (0, 1)]
        return fc1 + [[("fc2", TILES_PER_RECORD * r + t) for r in recs]]
    kind = COUPLED_KINDS.get(pair, ("P33", "P33"))[0]
    fc1 = [[("fc1", TILES_PER_RECORD * (4 * pair + _coupled_record_of(kind, s, side)) + t)
            for side in (0, 1)] for s in (0, 1)]
    return fc1 + [[("fc2", TILES_PER_RECORD * (2 * pair + side) + t) for side in (0, 1)]]


def logical_tile_bits(family: str, tile: int, intermediate_tiles: int) -> int:
    """K of a tile of the logical matrices (both H308 profiles follow one record schedule)."""
    record = (tile % intermediate_tiles) // TILES_PER_RECORD
    return LOGICAL_RECORD_BITS[record]


def rank_sources(profile: str, ext) -> dict[str, list[tuple[int, int, int]]]:
    """Where each local tile of a rank's weights comes from: for ``gate`` / ``up`` (FC1 output
    column tiles) and ``down`` (FC2 row tiles), a list over local tiles of ``(atom, section,
    side)``. Uncoupled: local record ``2 * (pair - first_pair) + side`` is the physical
    record, 128 contiguous channels (one H128 block, one K). Coupled: the slot matrices in
    the production convention (atom ``a``'s slot ``s`` = q chunk ``2a + s``), so each 64-column
    run of a slot is one q record."""
    first_pair = ext.first_atom // ATOMS_PER_PAIR
    npairs = ext.atom_count // ATOMS_PER_PAIR
    out: dict[str, list[tuple[int, int, int]]] = {"gate": [], "up": [], "down": []}
    for p in range(first_pair, first_pair + npairs):
        for side in (0, 1):
            for t in range(ATOMS_PER_PAIR):
                out["down"].append((ATOMS_PER_PAIR * p + t, 2, side))
        if profile == UNCOUPLED:
            for side in (0, 1):
                for t in range(ATOMS_PER_PAIR):
                    out["gate"].append((ATOMS_PER_PAIR * p + t, 0, side))
                    out["up"].append((ATOMS_PER_PAIR * p + t, 1, side))
            continue
        kind = COUPLED_KINDS.get(p, ("P33", "P33"))[0]
        for slot, name in ((0, "gate"), (1, "up")):
            for c in range(2 * ATOMS_PER_PAIR):        # 16 local tile columns of the slot
                chunk = 2 * (c // 2) + slot            # q chunk of 32 within the pair
                k, within = divmod(chunk, 4)           # q record of the pair, 32-chunk in it
                t = 2 * within + c % 2                 # stripe = 16-coordinate tile
                f = k % 2
                side = (1 - k // 2) if kind == "P43" else k // 2
                assert _coupled_record_of(kind, f, side) == k
                out[name].append((ATOMS_PER_PAIR * p + t, f, side))
    return out


# --------------------------------------------------------------------------------------
# Every profile: the atom tensor and the header metadata
# --------------------------------------------------------------------------------------


def atom_shape(prof: Profile, geometry: Geometry, layer: int) -> list[int]:
    """Shape of the ``qsrt_atoms`` u8 tensor: [atom_slots, stride] (uniform, uncoupled H308)
    or [bytes] (coupled H308: variable-stride rows)."""
    if prof.uniform_bits is not None:
        return [geometry.atom_slots, geometry.row_stride(prof.uniform_bits)]
    return atom_tensor_shape(prof.name, geometry.num_experts, geometry.hidden, layer)


def file_metadata(layer: int, prof: Profile, geometry: Geometry) -> dict[str, str]:
    """The canonical ``__metadata__`` of a layer file (what the writer emits, the reader
    requires)."""
    e = geometry.num_experts
    meta = {
        "format": "pt",
        "schema": fmt.SCHEMA,
        "version": str(fmt.VERSION),
        "encoding": fmt.ENCODING,
        "codebook": fmt.CODEBOOK_ID,
        "profile": prof.name,
        "profile_id": str(prof.profile_id),
        "layer": str(layer),
        "experts": str(e),
        "intermediate_channels": str(geometry.intermediate),
        "latent_channels": str(geometry.hidden),
        "atom_channels": str(fmt.ATOM_CHANNELS),
        "atom_slots": str(geometry.atom_slots),
        "alignment_bytes": str(fmt.STORAGE_ALIGNMENT),
    }
    if prof.uniform_bits is not None:
        bits = prof.uniform_bits
        meta["atom_slot_stride_bytes"] = str(geometry.row_stride(bits))
        meta[f"p{bits}{bits}_atom_bundle_bytes"] = str(fmt.bundle_bytes(geometry.hidden, bits))
    else:
        meta.update(header_metadata(prof.name, e, geometry.hidden, layer))
    if prof.coupled:
        meta["residual_hadamard_block_size"] = str(fmt.RESIDUAL_BLOCK)
        meta["preactivation_hadamard_block_size"] = str(fmt.PRE_BLOCK)
        meta["postactivation_hadamard_block_size"] = str(fmt.POST_BLOCK)
        meta["intermediate_rotation_draws"] = f"format_section[{e}:{2 * e}]"
    return meta

"""QSRT atoms-v2 layer files (Kimi-K3): the single owner of the on-disk layout.

This module owns everything about how a QSRT layer is stored and sliced:

* the profiles (:data:`PROFILES`) and per-expert format codes of the 4 KiB format section;
* the atoms-v2 file layout: one ``qsrt-layer-NNNNN.safetensors`` per MoE layer (a canonical
  4 KiB safetensors header, then ``_qsrt_format_section`` u8 [4096],
  ``_qsrt_shared_scale_section`` u8 [24576] and ``qsrt_atoms`` u8 [atom_slots, stride]) plus
  ``qsrt-manifest.json``;
* the coupled-profile channel map (atom ``a``'s two FC1 sections are the 32-coordinate chunks
  ``2a`` and ``2a+1`` of the length-2I transformed pre-activation axis; its FC2 section is
  post-activation channels ``32a .. 32a+31``) and the seeded sign draws of that axis;
* tensor-parallel rank extents (even TP: whole H128 blocks per half; TP9: the rotating
  six-384 / three-256 plan, padded to 384);
* :func:`load_layer` (file -> :class:`~kquant_cute.weights.MoEWeights` of one rank, all
  validation before anything is built), :func:`read_layer` (the whole file as a
  :class:`QSRTLayer`), :func:`write_layer` / :func:`random_layer` (synthetic files for tests).

Facts come from the public kquant / pedapudi/qsrt (``qsrt_atoms_v2.py``,
``pack/qsrt_atoms_v2.py``, ``qsrt_coupled.py``), b12x (``btx_compat.py``, ``btx.py``,
``qsrt_sharding.py``) and vLLM-fork (``kquant_qsrt_atoms_v2.py``) sources. Only the uniform
K=2 coupled production profile ``k2_coupled_h512_h128`` loads into
:class:`~kquant_cute.weights.MoEWeights`; the mixed-rate H308 profiles ``k3x22_k4x2`` and
``k3x22_k4x2_coupled_h512_h128`` load into :class:`~kquant_cute.mixed.MixedMoEWeights` (per-tile
K), with their rate maps, bundle layouts and rank extents owned by :mod:`kquant_cute.qsrt_mixed`.
For mixed profiles :class:`QSRTLayer` holds every tile padded to K=4 words (the first 16K used).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from . import qsrt_mixed as qm
from . import trellis as tc
from .mixed import MixedMoEWeights
from .weights import MoEWeights

__all__ = [
    "QSRTFormatError",
    "Profile",
    "PROFILES",
    "PRODUCTION_PROFILE",
    "Geometry",
    "KIMI_K3",
    "RankExtent",
    "QSRTLayer",
    "layer_filename",
    "rank_extent",
    "rotation_signs",
    "coupled_signs",
    "read_header",
    "read_layer",
    "load_layer",
    "write_layer",
    "random_layer",
]

# --------------------------------------------------------------------------------------
# Format constants
# --------------------------------------------------------------------------------------

SCHEMA = "qsrt_kimi_k3_qsrt_atoms_v2"
#: Schemas a reader accepts (the kquant-era name is an alias of the same layout).
SCHEMAS = (SCHEMA, "kquant_kimi_k3_qsrt_atoms_v2")
VERSION = 2
ENCODING = "qsrt_sqg_e4m3"
#: The file's codebook id; the toolkit's name for the same decode law is "sqg_e4m3".
CODEBOOK_ID = "sqg_xor_cheb_t12"
CODEBOOK = "sqg_e4m3"

STORAGE_ALIGNMENT = 4096
HEADER_BYTES = 4096
FORMAT_SECTION_BYTES = 4096
SHARED_SCALE_SECTION_BYTES = 6 * 4096
#: File offset of the atom slab (header + format + shared-scale sections).
ATOM_SLAB_OFFSET = HEADER_BYTES + FORMAT_SECTION_BYTES + SHARED_SCALE_SECTION_BYTES
FORMAT_TENSOR = "_qsrt_format_section"
SHARED_SCALE_TENSOR = "_qsrt_shared_scale_section"
ATOM_TENSOR = "qsrt_atoms"
TENSORS = (FORMAT_TENSOR, SHARED_SCALE_TENSOR, ATOM_TENSOR)
LAYER_FILE_PREFIX = "qsrt-layer-"
LAYER_FILE_SUFFIX = ".safetensors"
MANIFEST_FILE = "qsrt-manifest.json"
MANIFEST_KIND = "qsrt_kimi_k3_qsrt_artifact"

#: Channels per atom (the resharding unit) and per trellis plane of a section.
ATOM_CHANNELS = 32
PLANE_CHANNELS = 16
#: Bytes of one atom's fp16 intermediate-side span of one matrix (32 values).
SPAN_BYTES = ATOM_CHANNELS * 2
#: Shared hidden-side vectors, in file order, and their toolkit meaning.
SHARED_SCALE_ORDER = ("w1.suh", "w3.suh", "w2.svh")
#: Coupled transforms: residual (latent) block, pre- and post-activation blocks.
RESIDUAL_BLOCK = tc.COUPLED_RESIDUAL_BLOCK
PRE_BLOCK = tc.HADAMARD_BLOCK
POST_BLOCK = tc.HADAMARD_BLOCK
#: Atoms per post-activation H128 block: the alignment of every coupled rank extent.
ATOMS_PER_POST_BLOCK = POST_BLOCK // ATOM_CHANNELS
#: Sign draws: 3-bit per-expert id; seed = (DRAW_MUL * draw + AXIS_MUL * axis) mod 2^63.
DRAW_SEED_MUL = 0x6A09E667F3BCC909
AXIS_SEED_MUL = 0xBB67AE8584CAA73B
PRE_SIGN_AXIS = 1
POST_SIGN_AXIS = 2
MAX_DRAW = 7
#: Per-expert format byte: (r13 << 4) | r2 for compressed experts, 0xFF for the exact X4T tier.
FORMAT_X4T = 0xFF
#: Kimi-K3's MoE layers are numbered 1..92 (the TP9 plan rotates with the layer).
LAYER_RANGE = (1, 92)
TP9 = 9


class QSRTFormatError(ValueError):
    """A QSRT layer file, manifest or request is malformed or not supported."""


def _fail(path: Any, message: str) -> QSRTFormatError:
    where = f"{path}: " if path is not None else ""
    return QSRTFormatError(f"{where}{message}")


def _format_name(code: int) -> str:
    if code == FORMAT_X4T:
        return "X4T"
    r13, r2 = code >> 4, code & 0xF
    names = {0: "R0", 1: "R1", 2: "R2", 3: "H308", 4: "K2"}
    if r13 not in names or r2 not in names:
        return "invalid"
    return names[r13] if r13 == r2 else f"{names[r13]}/{names[r2]}"


# --------------------------------------------------------------------------------------
# Profiles and geometry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """One atoms-v2 profile: its header id, every expert's format code, transforms, rates.

    ``uniform_bits`` is K for a uniform-rate profile, None for mixed record rates (which
    need a per-record rate table and are not loadable yet). ``supported`` says whether
    :func:`load_layer` builds weights for it; ``reason`` says why not.
    """

    name: str
    profile_id: int
    format_code: int
    coupled: bool
    uniform_bits: Optional[int]
    supported: bool
    reason: str = ""


#: The profile Kimi-K3 serves (TP8 / TP9): uniform K=2 sqg_e4m3, coupled transforms.
PRODUCTION_PROFILE = "k2_coupled_h512_h128"

PROFILES: dict[str, Profile] = {
    # Mixed rates: 22 K3 + 2 K4 records per expert, P43 pairs placed by the per-expert pair
    # rotation (uncoupled) or static (coupled); see kquant_cute.qsrt_mixed.
    "k3x22_k4x2": Profile("k3x22_k4x2", 2, 0x33, False, None, True),
    PRODUCTION_PROFILE: Profile(PRODUCTION_PROFILE, 3, 0x44, True, 2, True),
    "k3x22_k4x2_coupled_h512_h128": Profile("k3x22_k4x2_coupled_h512_h128", 4, 0x33, True,
                                            None, True),
}
_PROFILE_BY_ID = {p.profile_id: p for p in PROFILES.values()}


def _profile(name: object, path: Any = None) -> Profile:
    if name not in PROFILES:
        known = ", ".join(f"{p.name} (id {p.profile_id})" for p in PROFILES.values())
        raise _fail(path, f"unknown QSRT profile {name!r}; known profiles: {known}")
    return PROFILES[name]  # type: ignore[index]


def _supported(profile: Profile, path: Any = None) -> Profile:
    if not profile.supported:
        raise _fail(
            path,
            f"QSRT profile {profile.name!r} (id {profile.profile_id}) is recognised but not "
            f"supported: {profile.reason}",
        )
    return profile


def matrix_atom_bytes(hidden: int, low_bits: int, high_bits: int) -> int:
    """Bytes of one matrix section of one atom: two 16-channel planes [H/16][16K] int16."""
    return (hidden // tc.TILE) * PLANE_CHANNELS * (low_bits + high_bits) * 2


def bundle_bytes(hidden: int, bits: int) -> int:
    """Bytes of one expert's bundle in one atom row at uniform K: gate | up | down | 3 spans."""
    return 3 * matrix_atom_bytes(hidden, bits, bits) + 3 * SPAN_BYTES


def _align(n: int, alignment: int = STORAGE_ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Geometry:
    """A layer's global shape: experts, latent (hidden) width, global intermediate width.

    Kimi-K3 is ``Geometry(896, 3584, 3072)`` (:data:`KIMI_K3`); synthetic test layers use
    fewer experts and a narrower latent axis with the same atom axis.
    """

    num_experts: int
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden", "intermediate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise QSRTFormatError(f"geometry {name} must be a positive int, got {v!r}")
        if 2 * self.num_experts > FORMAT_SECTION_BYTES:
            raise QSRTFormatError(
                f"{self.num_experts} experts do not fit the {FORMAT_SECTION_BYTES}-byte format "
                "section (one code and one draw byte per expert)")
        if 3 * self.hidden * 2 > SHARED_SCALE_SECTION_BYTES:
            raise QSRTFormatError(
                f"hidden {self.hidden}: three fp16 [hidden] vectors exceed the "
                f"{SHARED_SCALE_SECTION_BYTES}-byte shared-scale section")
        if self.hidden % RESIDUAL_BLOCK:
            raise QSRTFormatError(
                f"hidden {self.hidden} is not a multiple of the {RESIDUAL_BLOCK}-wide latent "
                "Hadamard")
        half = 2 * ATOM_CHANNELS * ATOMS_PER_POST_BLOCK
        if self.intermediate % half:
            raise QSRTFormatError(
                f"intermediate {self.intermediate} is not a multiple of {half}: each stored "
                "upstream half must hold whole post-activation H128 blocks")

    @property
    def atom_slots(self) -> int:
        return self.intermediate // ATOM_CHANNELS

    @property
    def half_slot(self) -> int:
        """First atom of the second stored upstream half (w3.suh); no rank crosses it."""
        return self.atom_slots // 2

    def row_stride(self, bits: int) -> int:
        return _align(self.num_experts * bundle_bytes(self.hidden, bits))


KIMI_K3 = Geometry(896, 3584, 3072)


def layer_filename(layer: int) -> str:
    return f"{LAYER_FILE_PREFIX}{layer:05d}{LAYER_FILE_SUFFIX}"


def _check_layer_index(layer: object) -> int:
    lo, hi = LAYER_RANGE
    if isinstance(layer, bool) or not isinstance(layer, int) or not lo <= layer <= hi:
        raise QSRTFormatError(f"MoE layer must be an int in {lo}..{hi}, got {layer!r}")
    return layer


def _header_metadata(layer: int, profile: Profile, geometry: Geometry) -> dict[str, str]:
    """The canonical ``__metadata__`` of a layer file (what the writer emits, the reader
    requires)."""
    e = geometry.num_experts
    meta = {
        "format": "pt",
        "schema": SCHEMA,
        "version": str(VERSION),
        "encoding": ENCODING,
        "codebook": CODEBOOK_ID,
        "profile": profile.name,
        "profile_id": str(profile.profile_id),
        "layer": str(layer),
        "experts": str(e),
        "intermediate_channels": str(geometry.intermediate),
        "latent_channels": str(geometry.hidden),
        "atom_channels": str(ATOM_CHANNELS),
        "atom_slots": str(geometry.atom_slots),
        "alignment_bytes": str(STORAGE_ALIGNMENT),
    }
    if profile.uniform_bits is not None:
        bits = profile.uniform_bits
        meta["atom_slot_stride_bytes"] = str(geometry.row_stride(bits))
        meta[f"p{bits}{bits}_atom_bundle_bytes"] = str(bundle_bytes(geometry.hidden, bits))
    else:
        meta.update(qm.header_metadata(profile.name, e, geometry.hidden, layer))
    if profile.coupled:
        meta["residual_hadamard_block_size"] = str(RESIDUAL_BLOCK)
        meta["preactivation_hadamard_block_size"] = str(PRE_BLOCK)
        meta["postactivation_hadamard_block_size"] = str(POST_BLOCK)
        meta["intermediate_rotation_draws"] = f"format_section[{e}:{2 * e}]"
    return meta


# --------------------------------------------------------------------------------------
# Rank extents
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankExtent:
    """The atom rows one tensor-parallel rank owns: ``[first_atom, first_atom + atom_count)``.

    ``padded_atoms`` >= ``atom_count`` is the local width the weights are built at (TP9's
    256-channel ranks pad to 384); padded channels have zero vectors, so they add nothing.
    """

    tp_size: int
    tp_rank: int
    first_atom: int
    atom_count: int
    padded_atoms: int

    @property
    def channels(self) -> int:
        return self.atom_count * ATOM_CHANNELS

    @property
    def padded_channels(self) -> int:
        return self.padded_atoms * ATOM_CHANNELS


def _split(blocks: int, ranks: int, index: int) -> tuple[int, int]:
    q, r = divmod(blocks, ranks)
    return index * q + min(index, r), q + int(index < r)


def _raw_extent(geometry: Geometry, layer: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first_atom, atom_count) of a coupled rank: whole post-H128 blocks inside one half."""
    half_blocks = geometry.half_slot // ATOMS_PER_POST_BLOCK
    if tp_size == TP9:
        # b12x qsrt_sharding.plan_qsrt_tp9_rank: five ranks split half 0, four split half 1,
        # and which rank owns which extent rotates with the layer (balances resident bytes).
        owner = (tp_rank - (layer - 1)) % TP9
        half, index, ranks = (0, owner, 5) if owner < 5 else (1, owner - 5, 4)
    else:
        ranks = tp_size // 2
        half, index = divmod(tp_rank, ranks)
    if half_blocks < ranks:
        raise QSRTFormatError(
            f"tp_size {tp_size}: a half of {geometry.half_slot} atoms has {half_blocks} "
            f"H128 blocks, fewer than its {ranks} ranks")
    first_block, count = _split(half_blocks, ranks, index)
    return (half * geometry.half_slot + first_block * ATOMS_PER_POST_BLOCK,
            count * ATOMS_PER_POST_BLOCK)


def rank_extent(
    profile: str,
    geometry: Geometry,
    layer: int,
    tp_size: int,
    tp_rank: int,
    *,
    pad: bool = True,
) -> RankExtent:
    """The atoms tensor-parallel rank ``tp_rank`` of ``tp_size`` owns in layer ``layer``.

    Coupled profiles: a rank holds whole post-activation H128 blocks (4 atoms) and never
    crosses the half boundary (atom ``atom_slots / 2``: the halves carry different input
    vectors). Even ``tp_size``: each half's blocks are split quotient/remainder among
    ``tp_size / 2`` ranks (Kimi-K3 TP8: 12 atoms = 384 channels each, TP12: 8 = 256).
    ``tp_size == 9``: the published TP9 plan (six ranks 384, three 256, rotating per layer);
    with ``pad`` every rank is built at the widest rank's width (384). Other sizes
    (including 1: the whole layer crosses the half boundary) are refused.

    Raises:
        QSRTFormatError: unsupported profile or tp_size, rank out of range, or a geometry too
            narrow for the requested split.
    """
    prof = _supported(_profile(profile))
    _check_layer_index(layer)
    if prof.uniform_bits is None:
        try:
            m = qm.mixed_extent(prof.name, geometry.atom_slots, layer, tp_size, tp_rank)
        except ValueError as exc:
            raise QSRTFormatError(str(exc)) from None
        return RankExtent(tp_size, tp_rank, m.first_atom, m.atom_count, m.atom_count)
    for name, v in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise QSRTFormatError(f"{name} must be an int, got {v!r}")
    if tp_size < 1:
        raise QSRTFormatError(f"tp_size must be positive, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise QSRTFormatError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size} "
                              f"(ranks 0..{tp_size - 1})")
    if prof.coupled and not (tp_size == TP9 or tp_size % 2 == 0):
        why = ("the whole layer crosses the half boundary at atom "
               f"{geometry.half_slot} (gate.suh / up.suh halves)" if tp_size == 1
               else "only even sizes and the TP9 plan split the two halves")
        raise QSRTFormatError(
            f"tp_size {tp_size} is not supported for coupled profile {prof.name!r}: {why}")
    first, count = _raw_extent(geometry, layer, tp_size, tp_rank)
    padded = count
    if pad:
        padded = max(_raw_extent(geometry, layer, tp_size, r)[1] for r in range(tp_size))
    return RankExtent(tp_size, tp_rank, first, count, padded)


# --------------------------------------------------------------------------------------
# Coupled sign draws
# --------------------------------------------------------------------------------------


def rotation_signs(length: int, draw: int, axis: int) -> torch.Tensor:
    """float32 [length] of +-1: the frozen Rademacher draw ``draw`` of axis ``axis``.

    Draw 0 is all ones. Otherwise a CPU ``torch.Generator`` seeded with
    ``(DRAW_SEED_MUL * draw + AXIS_SEED_MUL * axis) mod 2^63`` draws
    ``randint(0, 2, (length,)) * 2 - 1`` (kquant / b12x). The vector spans the *global* axis
    (2 * intermediate for the pre-activation axis 1, intermediate for axis 2); ranks slice it.
    """
    if isinstance(draw, bool) or not isinstance(draw, int) or not 0 <= draw <= MAX_DRAW:
        raise QSRTFormatError(f"rotation draw must be an int in 0..{MAX_DRAW}, got {draw!r}")
    if length <= 0:
        raise QSRTFormatError(f"sign length must be positive, got {length}")
    if draw == 0:
        return torch.ones(length, dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    gen.manual_seed((DRAW_SEED_MUL * draw + AXIS_SEED_MUL * axis) & ((1 << 63) - 1))
    return torch.randint(0, 2, (length,), generator=gen).mul_(2).sub_(1).float()


def coupled_signs(
    draws: torch.Tensor,
    global_intermediate: int,
    first_atom: int,
    atom_count: int,
    padded_atoms: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``pre_signs`` [E, 2 * 32 * padded] and ``post_signs`` [E, 32 * padded] of a rank.

    Each expert's global sign vectors (length ``2 * global_intermediate`` on axis 1,
    ``global_intermediate`` on axis 2, from its draw) are sliced to the rank's atoms
    ``[first_atom, first_atom + atom_count)``: pre-activation coordinates
    ``[64 * first, 64 * (first + count))``, post-activation channels
    ``[32 * first, 32 * (first + count))``. Padded coordinates get +1 (their activations
    are zero anyway).
    """
    padded = atom_count if padded_atoms is None else padded_atoms
    if first_atom < 0 or atom_count <= 0 or padded < atom_count or \
            (first_atom + atom_count) * ATOM_CHANNELS > global_intermediate:
        raise QSRTFormatError(f"atoms [{first_atom}, {first_atom + atom_count}) (padded to "
                              f"{padded}) do not fit {global_intermediate} channels")
    e, n = draws.shape[0], atom_count * ATOM_CHANNELS
    pre = torch.ones(e, 2 * padded * ATOM_CHANNELS, dtype=torch.float16)
    post = torch.ones(e, padded * ATOM_CHANNELS, dtype=torch.float16)
    pre0, post0 = 2 * first_atom * ATOM_CHANNELS, first_atom * ATOM_CHANNELS
    for draw in sorted({int(d) for d in draws.tolist()}):
        rows = (draws == draw).nonzero(as_tuple=True)[0]
        p = rotation_signs(2 * global_intermediate, draw, PRE_SIGN_AXIS)[pre0:pre0 + 2 * n]
        q = rotation_signs(global_intermediate, draw, POST_SIGN_AXIS)[post0:post0 + n]
        pre[rows, : 2 * n] = p.half()
        post[rows, :n] = q.half()
    return pre, post


# --------------------------------------------------------------------------------------
# The whole layer, format level
# --------------------------------------------------------------------------------------


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
        _check_layer_index(self.layer)
        prof = _supported(_profile(self.profile))
        g, bits = self.geometry, prof.uniform_bits
        e, h16, i16 = g.num_experts, g.hidden // tc.TILE, g.intermediate // tc.TILE
        if bits is None:
            _check_mixed_geometry(prof, g)
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
        return torch.tensor([qm.logical_tile_bits(family, j, i16) for j in range(n)],
                            dtype=torch.uint8)

    # -- the file's atom bundles --------------------------------------------------------

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
        rows = torch.zeros(a, g.row_stride(bits), dtype=torch.uint8)
        rows[:, : bundles.shape[1]] = bundles
        return rows

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
        """The :class:`MoEWeights` of one rank, sliced in memory (same as :func:`load_layer`)."""
        ext = rank_extent(self.profile, self.geometry, self.layer, tp_size, tp_rank, pad=pad)
        if PROFILES[self.profile].uniform_bits is None:
            flat = self.atom_rows().reshape(-1)
            return _mixed_rank_weights(self.profile, self.geometry, self.layer, ext,
                                       _mixed_split_rows(self.profile, self.geometry, self.layer,
                                                         ext, flat, 0),
                                       self.w1_suh, self.w3_suh, self.w2_svh, self.draws)
        rows = self.atom_rows()[ext.first_atom: ext.first_atom + ext.atom_count]
        return _rank_weights(self.profile, self.geometry, self.layer, ext, rows,
                             self.w1_suh, self.w3_suh, self.w2_svh, self.draws)


def _bundles(rows: torch.Tensor, geometry: Geometry, bits: int) -> dict[str, torch.Tensor]:
    """Split atom rows [A, stride] into per-atom tensors (the inverse of atom_rows)."""
    e, a, h16 = geometry.num_experts, rows.shape[0], geometry.hidden // tc.TILE
    sec = matrix_atom_bytes(geometry.hidden, bits, bits)
    b = bundle_bytes(geometry.hidden, bits)
    bundles = rows[:, : e * b].reshape(a, e, b)
    words = bundles[:, :, : 3 * sec].contiguous().view(torch.int16)
    words = words.reshape(a, e, 3, 2, h16, tc.TILE * bits)
    spans = bundles[:, :, 3 * sec:].contiguous().view(torch.float16).reshape(a, e, 3, ATOM_CHANNELS)
    return {"words": words, "spans": spans}


def _rank_weights(
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
    """Build one rank's MoEWeights from its atom rows (validated by the caller)."""
    bits = PROFILES[profile].uniform_bits
    assert bits is not None
    parts = _bundles(rows, geometry, bits)
    words, spans = parts["words"], parts["spans"]
    e, a, h16 = geometry.num_experts, ext.atom_count, geometry.hidden // tc.TILE
    pa = ext.padded_atoms
    k16 = tc.TILE * bits

    def fc1_slot(s: int) -> torch.Tensor:
        # [A, E, plane, H/16, 16K] -> [E, H/16, 2A(+pad), 16K]: N-tile 2a + plane.
        w = words[:, :, s].permute(1, 3, 0, 2, 4).reshape(e, h16, 2 * a, k16)
        out = torch.zeros(e, h16, 2 * pa, k16, dtype=torch.int16)
        out[:, :, : 2 * a] = w
        return out

    down = torch.zeros(e, 2 * pa, h16, k16, dtype=torch.int16)
    down[:, : 2 * a] = words[:, :, 2].permute(1, 0, 2, 3, 4).reshape(e, 2 * a, h16, k16)

    def span(m: int) -> torch.Tensor:
        # Padded channels keep zero vectors: zero svh zeroes the padded pre-activations,
        # so the padded SiTU outputs and their FC2 contributions are exactly zero.
        out = torch.zeros(e, pa * ATOM_CHANNELS, dtype=torch.float16)
        out[:, : a * ATOM_CHANNELS] = spans[:, :, m].permute(1, 0, 2).reshape(e, -1)
        return out

    source_suh = w1_suh if ext.first_atom < geometry.half_slot else w3_suh
    pre, post = coupled_signs(draws, geometry.intermediate, ext.first_atom, ext.atom_count,
                              ext.padded_atoms)
    return MoEWeights(
        gate_trellis=fc1_slot(0), up_trellis=fc1_slot(1), down_trellis=down,
        gate_suh=source_suh.clone(), up_suh=source_suh.clone(), down_svh=w2_svh.clone(),
        gate_svh=span(0), up_svh=span(1), down_suh=span(2),
        codebook=CODEBOOK, profile=profile, rotation_draws=draws.clone(),
        pre_signs=pre, post_signs=post,
    )


# --------------------------------------------------------------------------------------
# Mixed-rate (H308) bundles
# --------------------------------------------------------------------------------------

#: Words per tile of a mixed layer's tile form (K=4, the widest record).
MIXED_TILE_BITS = 4


def _check_mixed_geometry(prof: Profile, g: Geometry, path: Any = None) -> None:
    want = qm.RECORDS * qm.RECORD_CHANNELS
    if g.intermediate != want:
        raise _fail(path, f"profile {prof.name}: intermediate {g.intermediate} is not the "
                          f"{want} channels ({qm.RECORDS} records) its placement rule covers")


def _mixed_atom_tensor(layer: "QSRTLayer") -> torch.Tensor:
    """The ``qsrt_atoms`` tensor of a mixed layer (2-D fixed stride, or 1-D coupled)."""
    g, name = layer.geometry, layer.profile
    i16 = g.intermediate // tc.TILE
    rows = qm.row_layouts(name, g.num_experts, g.hidden, layer.layer)
    out = []
    for row in rows:
        buf = torch.zeros(row.row_bytes, dtype=torch.uint8)
        for e in range(g.num_experts):
            kinds = row.kinds[e]
            planes, spans = [], []
            for m, pair in enumerate(qm.bundle_sources(name, layer.layer, e, row.atom, i16)):
                kind_bits = qm.PAIR_KIND_BITS[kinds[0 if m < 2 else 1]]
                for side, (family, tile) in enumerate(pair):
                    k = kind_bits[side]
                    if qm.logical_tile_bits(family, tile, i16) != k:  # pragma: no cover
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
    if name == qm.UNCOUPLED:
        return torch.stack(out)
    return torch.cat(out)


def _mixed_split_rows(profile: str, g: Geometry, layer: int, ext: RankExtent,
                      flat: torch.Tensor, base: int) -> dict[int, torch.Tensor]:
    """Atom rows of ``ext`` from ``flat`` bytes that start at atom-tensor offset ``base``."""
    rows = qm.row_layouts(profile, g.num_experts, g.hidden, layer)
    out = {}
    for a in range(ext.first_atom, ext.first_atom + ext.atom_count):
        start = qm.row_offset(profile, rows, a) - base
        out[a] = flat[start: start + rows[a].row_bytes]
    return out


def _mixed_check_rows(path: Any, profile: str, g: Geometry, layer: int,
                      rows: dict[int, torch.Tensor]) -> None:
    layouts = qm.row_layouts(profile, g.num_experts, g.hidden, layer)
    for a, row in rows.items():
        tail = row[layouts[a].payload:]
        if bool((tail != 0).any()):
            raise _fail(path, f"atom row {a} has nonzero padding after its "
                              f"{layouts[a].payload} bundle bytes")
        for e in range(g.num_experts):
            spans = _mixed_bundle(row, layouts[a], e, g.hidden)[1]
            if not bool(torch.isfinite(spans).all()):
                raise _fail(path, f"atom {a}, expert {e}: non-finite svh/suh span")


def _mixed_bundle(row: torch.Tensor, layout: "qm.RowLayout", e: int,
                  hidden: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """One bundle: ``planes[section][side]`` int16 [H/16, 16K] and spans fp16 [3, 2, 16]."""
    h16 = hidden // tc.TILE
    cursor = layout.offsets[e]
    planes = []
    for m in range(3):
        bits = qm.PAIR_KIND_BITS[layout.kinds[e][0 if m < 2 else 1]]
        pair = []
        for k in bits:
            n = h16 * tc.TILE * k * 2
            pair.append(row[cursor: cursor + n].clone().view(torch.int16).reshape(h16, 16 * k))
            cursor += n
        planes.append(pair)
    spans = row[cursor: cursor + 3 * SPAN_BYTES].clone().view(torch.float16).reshape(3, 2, 16)
    return planes, spans


def _mixed_rank_weights(
    profile: str, g: Geometry, layer: int, ext: RankExtent, rows: dict[int, torch.Tensor],
    w1_suh: torch.Tensor, w3_suh: torch.Tensor, w2_svh: torch.Tensor, draws: torch.Tensor,
) -> MixedMoEWeights:
    """One rank's MixedMoEWeights from its atom rows (validated by the caller)."""
    layouts = qm.row_layouts(profile, g.num_experts, g.hidden, layer)
    src = qm.rank_sources(profile, qm.MixedExtent(ext.tp_size, ext.tp_rank, ext.first_atom,
                                                  ext.atom_count))
    e, h16, n = g.num_experts, g.hidden // tc.TILE, len(src["down"])
    kw = tc.TILE * MIXED_TILE_BITS
    tiles = {"gate": torch.zeros(e, h16, n, kw, dtype=torch.int16),
             "up": torch.zeros(e, h16, n, kw, dtype=torch.int16),
             "down": torch.zeros(e, n, h16, kw, dtype=torch.int16)}
    vecs = {name: torch.zeros(e, 16 * n, dtype=torch.float16) for name in ("gate", "up", "down")}
    bits = {"fc1": torch.zeros(e, n, dtype=torch.uint8), "fc2": torch.zeros(e, n, dtype=torch.uint8)}
    for x in range(e):
        cache = {a: _mixed_bundle(rows[a], layouts[a], x, g.hidden) for a in rows}
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
    coupled = PROFILES[profile].coupled
    extra: dict[str, Any] = {}
    if coupled:
        suh = w1_suh if ext.first_atom < g.half_slot else w3_suh
        pre, post = coupled_signs(draws, g.intermediate, ext.first_atom, ext.atom_count)
        extra = dict(gate_suh=suh.clone(), up_suh=suh.clone(), rotation_draws=draws.clone(),
                     pre_signs=pre, post_signs=post)
    else:
        extra = dict(gate_suh=w1_suh.clone(), up_suh=w3_suh.clone())
    return MixedMoEWeights.from_tiles(
        tiles["gate"], tiles["up"], tiles["down"], bits["fc1"], bits["fc2"],
        gate_svh=vecs["gate"], up_svh=vecs["up"], down_suh=vecs["down"], down_svh=w2_svh.clone(),
        codebook=CODEBOOK, profile=profile, **extra)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerHeader:
    """What a layer file declares, validated; its atom rows are not read yet."""

    path: Path
    layer: int
    profile: str
    geometry: Geometry
    stride: int
    format_codes: torch.Tensor
    draws: torch.Tensor
    w1_suh: torch.Tensor
    w3_suh: torch.Tensor
    w2_svh: torch.Tensor
    metadata: dict = field(repr=False, default_factory=dict)


def _safe_open(path: Path):
    from safetensors import safe_open  # local: the loader is the only user

    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _fail(path, f"cannot read the layer file ({exc.strerror})") from None
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise _fail(path, f"truncated file: {size} bytes, no safetensors header")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise _fail(path, f"truncated file: the header declares {n} bytes, the file has {size}")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type
        msg = str(exc)
        if "not fully covered" in msg or "incomplete" in msg.lower():
            raise _fail(path, f"truncated file ({size} bytes): {msg}") from None
        raise _fail(path, f"not a valid safetensors file: {msg}") from None


def _int_meta(meta: dict, key: str, path: Path) -> int:
    try:
        return int(meta[key])
    except (KeyError, TypeError, ValueError):
        raise _fail(path, f"header metadata {key!r} is missing or not an int "
                          f"(got {meta.get(key)!r})") from None


def read_header(path: str | os.PathLike, *, layer: Optional[int] = None) -> LayerHeader:
    """Open and validate a layer file's header, format and shared-scale sections.

    Checks: a complete safetensors file; exactly the three atoms-v2 tensors (uint8, canonical
    shapes); schema / version / encoding / codebook; a known and supported profile with its
    profile id; the declared geometry; the atom row stride; every expert's format code; the
    coupled draws (0..7) and zero section padding; finite shared vectors. Reads no atom row.

    Raises:
        QSRTFormatError: naming the file and what is wrong.
    """
    p = Path(path)
    with _safe_open(p) as handle:
        meta = dict(handle.metadata() or {})
        keys = set(handle.keys())
        if keys != set(TENSORS):
            raise _fail(p, f"tensors {sorted(keys)} are not the atoms-v2 inventory {list(TENSORS)}")
        if meta.get("schema") not in SCHEMAS:
            raise _fail(p, f"schema {meta.get('schema')!r} is not one of {list(SCHEMAS)}")
        for key, want in (("version", str(VERSION)), ("encoding", ENCODING),
                          ("codebook", CODEBOOK_ID)):
            if meta.get(key) != want:
                raise _fail(p, f"header {key} is {meta.get(key)!r}, expected {want!r}")
        if "profile" not in meta:
            raise _fail(p, "header metadata has no 'profile'")
        prof = _profile(meta["profile"], p)
        pid = _int_meta(meta, "profile_id", p)
        if pid != prof.profile_id:
            other = _PROFILE_BY_ID.get(pid)
            raise _fail(p, f"profile {prof.name!r} has id {prof.profile_id}, the header says "
                           f"{pid}" + (f" ({other.name})" if other else ""))
        _supported(prof, p)
        file_layer = _int_meta(meta, "layer", p)
        _check_layer_index(file_layer)
        if layer is not None and file_layer != layer:
            raise _fail(p, f"file holds layer {file_layer}, layer {layer} was requested")
        try:
            geometry = Geometry(_int_meta(meta, "experts", p), _int_meta(meta, "latent_channels", p),
                                _int_meta(meta, "intermediate_channels", p))
        except QSRTFormatError as exc:
            raise _fail(p, f"declared geometry: {exc}") from None
        expected = _header_metadata(file_layer, prof, geometry)
        for key, want in expected.items():
            if key == "schema":
                continue
            if meta.get(key) != want:
                what = "wrong stride" if key == "atom_slot_stride_bytes" else "wrong value"
                raise _fail(p, f"{what}: header {key} is {meta.get(key)!r}, expected {want!r} "
                               f"for {prof.name} at {geometry}")
        bits = prof.uniform_bits
        if bits is None:
            _check_mixed_geometry(prof, geometry, p)
            atom_shape = qm.atom_tensor_shape(prof.name, geometry.num_experts, geometry.hidden,
                                              file_layer)
            stride = atom_shape[1] if len(atom_shape) == 2 else 0
            per_row = "mixed P33 / P43 / P44 bundles per row"
        else:
            stride = geometry.row_stride(bits)
            atom_shape = [geometry.atom_slots, stride]
            per_row = f"{geometry.num_experts} bundles of {bundle_bytes(geometry.hidden, bits)} B per row"
        shapes = {FORMAT_TENSOR: [FORMAT_SECTION_BYTES],
                  SHARED_SCALE_TENSOR: [SHARED_SCALE_SECTION_BYTES],
                  ATOM_TENSOR: atom_shape}
        for name, shape in shapes.items():
            sl = handle.get_slice(name)
            if sl.get_dtype() != "U8":
                raise _fail(p, f"tensor {name} has dtype {sl.get_dtype()}, expected U8")
            if list(sl.get_shape()) != shape:
                what = ("wrong stride: " if name == ATOM_TENSOR
                        and sl.get_shape()[:1] == shape[:1] else "")
                raise _fail(p, f"{what}tensor {name} has shape {sl.get_shape()}, expected "
                               f"{shape} ({per_row}, {STORAGE_ALIGNMENT}-aligned)")
        fmt = handle.get_tensor(FORMAT_TENSOR)
        shared = handle.get_tensor(SHARED_SCALE_TENSOR)
    e = geometry.num_experts
    codes = fmt[:e].clone()
    bad = (codes != prof.format_code).nonzero(as_tuple=True)[0]
    if bad.numel():
        i = int(bad[0])
        c = int(codes[i])
        raise _fail(p, f"expert {i} has format code 0x{c:02x} ({_format_name(c)}), profile "
                       f"{prof.name} needs 0x{prof.format_code:02x} "
                       f"({_format_name(prof.format_code)}) for every expert "
                       f"({bad.numel()} experts differ)")
    draws = fmt[e: 2 * e].clone() if prof.coupled else torch.zeros(e, dtype=torch.uint8)
    bad = (draws > MAX_DRAW).nonzero(as_tuple=True)[0]
    if bad.numel():
        i = int(bad[0])
        raise _fail(p, f"expert {i} has rotation draw {int(draws[i])}, draws are 0..{MAX_DRAW}")
    pad_from = 2 * e if prof.coupled else e
    if bool((fmt[pad_from:] != 0).any()):
        i = pad_from + int((fmt[pad_from:] != 0).nonzero()[0])
        raise _fail(p, f"format section byte {i} is nonzero (padding from byte {pad_from})")
    nbytes = 3 * geometry.hidden * 2
    if bool((shared[nbytes:] != 0).any()):
        raise _fail(p, f"shared-scale section has nonzero padding after byte {nbytes}")
    vecs = shared[:nbytes].clone().view(torch.float16).reshape(3, geometry.hidden)
    for name, v in zip(SHARED_SCALE_ORDER, vecs):
        if not bool(torch.isfinite(v).all()):
            raise _fail(p, f"shared vector {name} has non-finite values")
    return LayerHeader(p, file_layer, prof.name, geometry, stride, codes, draws,
                       vecs[0].clone(), vecs[1].clone(), vecs[2].clone(), meta)


def _read_mixed_rows(header: LayerHeader, ext: RankExtent) -> dict[int, torch.Tensor]:
    """A mixed layer's atom rows of ``ext`` (only those bytes are read), validated."""
    g = header.geometry
    layouts = qm.row_layouts(header.profile, g.num_experts, g.hidden, header.layer)
    begin = qm.row_offset(header.profile, layouts, ext.first_atom)
    end = qm.row_offset(header.profile, layouts, ext.first_atom + ext.atom_count)
    with _safe_open(header.path) as handle:
        sl = handle.get_slice(ATOM_TENSOR)
        if header.profile == qm.UNCOUPLED:
            flat = sl[ext.first_atom: ext.first_atom + ext.atom_count].clone().reshape(-1)
        else:
            flat = sl[begin:end].clone()
    rows = _mixed_split_rows(header.profile, g, header.layer, ext, flat, begin)
    _mixed_check_rows(header.path, header.profile, g, header.layer, rows)
    return rows


def _read_rows(header: LayerHeader, first: int, count: int) -> torch.Tensor:
    with _safe_open(header.path) as handle:
        rows = handle.get_slice(ATOM_TENSOR)[first: first + count].clone()
    bits = PROFILES[header.profile].uniform_bits
    payload = header.geometry.num_experts * bundle_bytes(header.geometry.hidden, bits)
    tail = rows[:, payload:]
    if bool((tail != 0).any()):
        r = int((tail != 0).any(dim=1).nonzero()[0])
        raise _fail(header.path, f"atom row {first + r} has nonzero padding after its "
                                 f"{payload} bundle bytes")
    spans = _bundles(rows, header.geometry, bits)["spans"]
    if not bool(torch.isfinite(spans).all()):
        a, e = (~torch.isfinite(spans)).flatten(2).any(dim=2).nonzero()[0].tolist()
        raise _fail(header.path, f"atom {first + a}, expert {e}: non-finite svh/suh span")
    return rows


def _resolve(path_or_root: str | os.PathLike, layer: Optional[int]) -> tuple[Path, Optional[int]]:
    """A layer file path, or a model root + layer read through its manifest."""
    p = Path(path_or_root)
    if not p.is_dir():
        return p, layer
    if layer is None:
        raise QSRTFormatError(f"{p} is a directory: pass layer= to pick a layer file")
    _check_layer_index(layer)
    mpath = p / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except OSError as exc:
        raise _fail(mpath, f"cannot read the manifest ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise _fail(mpath, f"manifest is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise _fail(mpath, f"manifest kind is {manifest.get('kind') if isinstance(manifest, dict) else None!r}, "
                           f"expected {MANIFEST_KIND!r}")
    if manifest.get("storage_schema") not in SCHEMAS:
        raise _fail(mpath, f"storage_schema {manifest.get('storage_schema')!r} is not one of "
                           f"{list(SCHEMAS)}")
    _supported(_profile(manifest.get("profile"), mpath), mpath)
    entry = (manifest.get("layers") or {}).get(str(layer))
    if not isinstance(entry, dict) or not isinstance(entry.get("qsrt_atoms"), str):
        raise _fail(mpath, f"manifest has no entry for layer {layer}")
    if entry["qsrt_atoms"] != layer_filename(layer):
        raise _fail(mpath, f"layer {layer} names file {entry['qsrt_atoms']!r}, expected "
                           f"{layer_filename(layer)!r}")
    fpath = p / entry["qsrt_atoms"]
    size = entry.get("atom_disk_bytes")
    if isinstance(size, int) and fpath.exists() and fpath.stat().st_size != size:
        raise _fail(fpath, f"truncated or resized file: {fpath.stat().st_size} bytes, the "
                           f"manifest says {size}")
    return fpath, layer


def _check_manifest_profile(path_or_root: str | os.PathLike, header: LayerHeader) -> None:
    root = Path(path_or_root)
    if root.is_dir():
        profile = json.loads((root / MANIFEST_FILE).read_text())["profile"]
        if profile != header.profile:
            raise _fail(header.path, f"file profile {header.profile!r} differs from the "
                                     f"manifest's {profile!r}")


def _read_mixed_layer(h: LayerHeader) -> QSRTLayer:
    """Every bundle of a mixed layer put back at its logical tile (tile form, K=4 words)."""
    g = h.geometry
    e, h16, i16, kw = g.num_experts, g.hidden // tc.TILE, g.intermediate // tc.TILE, \
        tc.TILE * MIXED_TILE_BITS
    rows = _read_mixed_rows(h, RankExtent(1, 0, 0, g.atom_slots, g.atom_slots))
    layouts = qm.row_layouts(h.profile, e, g.hidden, h.layer)
    fc1 = torch.zeros(e, h16, 2 * i16, kw, dtype=torch.int16)
    fc2 = torch.zeros(e, i16, h16, kw, dtype=torch.int16)
    svh = torch.zeros(e, 2 * g.intermediate, dtype=torch.float16)
    suh = torch.zeros(e, g.intermediate, dtype=torch.float16)
    for a, row in rows.items():
        for x in range(e):
            planes, spans = _mixed_bundle(row, layouts[a], x, g.hidden)
            for m, pair in enumerate(qm.bundle_sources(h.profile, h.layer, x, a, i16)):
                for side, (family, tile) in enumerate(pair):
                    w = planes[m][side]
                    if family == "fc1":
                        fc1[x, :, tile, : w.shape[1]] = w
                        svh[x, 16 * tile: 16 * tile + 16] = spans[m, side]
                    else:
                        fc2[x, tile, :, : w.shape[1]] = w
                        suh[x, 16 * tile: 16 * tile + 16] = spans[m, side]
    return QSRTLayer(layer=h.layer, profile=h.profile, geometry=g, fc1=fc1, fc1_svh=svh,
                     fc2=fc2, fc2_suh=suh, w1_suh=h.w1_suh, w3_suh=h.w3_suh, w2_svh=h.w2_svh,
                     format_codes=h.format_codes, draws=h.draws)


def read_layer(path_or_root: str | os.PathLike, *, layer: Optional[int] = None) -> QSRTLayer:
    """The whole layer file as a :class:`QSRTLayer` (every atom row, validated)."""
    path, layer = _resolve(path_or_root, layer)
    h = read_header(path, layer=layer)
    _check_manifest_profile(path_or_root, h)
    if PROFILES[h.profile].uniform_bits is None:
        return _read_mixed_layer(h)
    rows = _read_rows(h, 0, h.geometry.atom_slots)
    g, bits = h.geometry, PROFILES[h.profile].uniform_bits
    parts = _bundles(rows, g, bits)
    words, spans = parts["words"], parts["spans"]
    e, a, h16, k16 = g.num_experts, g.atom_slots, g.hidden // tc.TILE, tc.TILE * bits
    fc1 = words[:, :, :2].permute(1, 4, 0, 2, 3, 5).reshape(e, h16, 4 * a, k16)
    fc2 = words[:, :, 2].permute(1, 0, 2, 3, 4).reshape(e, 2 * a, h16, k16)
    return QSRTLayer(
        layer=h.layer, profile=h.profile, geometry=g,
        fc1=fc1.contiguous(), fc1_svh=spans[:, :, :2].permute(1, 0, 2, 3).reshape(e, -1).contiguous(),
        fc2=fc2.contiguous(), fc2_suh=spans[:, :, 2].permute(1, 0, 2).reshape(e, -1).contiguous(),
        w1_suh=h.w1_suh, w3_suh=h.w3_suh, w2_svh=h.w2_svh,
        format_codes=h.format_codes, draws=h.draws,
    )


def load_layer(
    path_or_root: str | os.PathLike,
    *,
    layer: Optional[int] = None,
    tp_size: int,
    tp_rank: int,
    pad: bool = True,
    device: Optional[torch.device | str] = None,
) -> MoEWeights:
    """Load one tensor-parallel rank of a layer into :class:`MoEWeights`.

    ``path_or_root`` is a ``qsrt-layer-NNNNN.safetensors`` file, or a model directory with
    ``qsrt-manifest.json`` (then ``layer`` picks the file and the manifest's profile and
    file size are checked). Only the rank's atom rows are read. Everything -- header,
    sections, extent, row padding, finite spans -- is validated before any weight tensor is
    built; on error nothing is returned and nothing is moved to ``device``.

    The result: slot matrices ``gate_trellis`` / ``up_trellis`` (atom ``a``'s FC1 sections
    0 / 1, i.e. pre-activation chunks 2a / 2a+1), ``down_trellis``, their intermediate-side
    spans, one shared ``gate_suh == up_suh`` (w1.suh below the half boundary, w3.suh above),
    ``down_svh`` = w2.svh, and the coupled ``pre_signs`` / ``post_signs`` of the rank's
    coordinates. See :func:`rank_extent` for the split.
    """
    path, layer = _resolve(path_or_root, layer)
    h = read_header(path, layer=layer)
    _check_manifest_profile(path_or_root, h)
    ext = rank_extent(h.profile, h.geometry, h.layer, tp_size, tp_rank, pad=pad)
    if PROFILES[h.profile].uniform_bits is None:
        rows_by_atom = _read_mixed_rows(h, ext)
        mixed = _mixed_rank_weights(h.profile, h.geometry, h.layer, ext, rows_by_atom,
                                    h.w1_suh, h.w3_suh, h.w2_svh, h.draws)
        return mixed if device is None else mixed.to(device)
    rows = _read_rows(h, ext.first_atom, ext.atom_count)
    w = _rank_weights(h.profile, h.geometry, h.layer, ext, rows, h.w1_suh, h.w3_suh,
                      h.w2_svh, h.draws)
    return w if device is None else w.to(device)


# --------------------------------------------------------------------------------------
# Writing (synthetic layers for tests)
# --------------------------------------------------------------------------------------


def _header_bytes(layer: QSRTLayer) -> bytes:
    g = layer.geometry
    meta = _header_metadata(layer.layer, PROFILES[layer.profile], g)
    bits = PROFILES[layer.profile].uniform_bits
    atom_shape = ([g.atom_slots, g.row_stride(bits)] if bits is not None else
                  qm.atom_tensor_shape(layer.profile, g.num_experts, g.hidden, layer.layer))
    slab = math.prod(atom_shape)
    doc = {
        "__metadata__": meta,
        FORMAT_TENSOR: {"dtype": "U8", "shape": [FORMAT_SECTION_BYTES],
                        "data_offsets": [0, FORMAT_SECTION_BYTES]},
        SHARED_SCALE_TENSOR: {"dtype": "U8", "shape": [SHARED_SCALE_SECTION_BYTES],
                              "data_offsets": [FORMAT_SECTION_BYTES,
                                               FORMAT_SECTION_BYTES + SHARED_SCALE_SECTION_BYTES]},
        ATOM_TENSOR: {"dtype": "U8", "shape": atom_shape,
                      "data_offsets": [ATOM_SLAB_OFFSET - HEADER_BYTES,
                                       ATOM_SLAB_OFFSET - HEADER_BYTES + slab]},
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    capacity = HEADER_BYTES - 8
    if len(text) > capacity:  # pragma: no cover - the metadata is a few hundred bytes
        raise AssertionError("atoms-v2 header exceeds its 4 KiB budget")
    # The canonical header is padded with spaces to 4 KiB so the slab is 4 KiB aligned.
    return struct.pack("<Q", capacity) + text + b" " * (capacity - len(text))


def write_layer(root: str | os.PathLike, layer: QSRTLayer, *, manifest: bool = True) -> Path:
    """Write ``layer`` as ``root/qsrt-layer-NNNNN.safetensors`` (atomically) and, with
    ``manifest``, add it to ``root/qsrt-manifest.json`` (created if missing; its profile must
    match)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / layer_filename(layer.layer)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_header_bytes(layer))
            f.write(layer.format_section().numpy().tobytes())
            f.write(layer.shared_scale_section().numpy().tobytes())
            f.write(layer.atom_rows().numpy().tobytes())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if manifest:
        _update_manifest(root, layer, path)
    return path


def _update_manifest(root: Path, layer: QSRTLayer, path: Path) -> None:
    mpath = root / MANIFEST_FILE
    if mpath.exists():
        doc = json.loads(mpath.read_text())
        if doc.get("profile") != layer.profile:
            raise QSRTFormatError(f"{mpath}: profile {doc.get('profile')!r}, cannot add a "
                                  f"{layer.profile!r} layer")
    else:
        prof = PROFILES[layer.profile]
        doc = {
            "kind": MANIFEST_KIND, "schema_version": VERSION, "codec": "QSRT",
            "storage_schema": SCHEMA, "storage_format": "qsrt_atoms_v2",
            "profile": layer.profile,
            "trellis_bits_per_weight": (prof.uniform_bits if prof.uniform_bits is not None
                                        else sum(qm.LOGICAL_RECORD_BITS) / qm.RECORDS),
            "tensor_parallel_independent": True, "layers": {},
        }
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    doc["layers"][str(layer.layer)] = {
        "qsrt_atoms": path.name, "atom_disk_bytes": path.stat().st_size, "sha256": digest,
    }
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{MANIFEST_FILE}.", suffix=".partial")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, mpath)


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
    prof = _supported(_profile(profile))
    bits = prof.uniform_bits
    g = geometry
    e = g.num_experts
    gen = torch.Generator().manual_seed(seed)
    if bits is None:   # mixed: tile form at K=4 words, each tile's codes at its record's K
        _check_mixed_geometry(prof, g)
        i16 = g.intermediate // tc.TILE
        rms = float(tc.codebook_lut(CODEBOOK, 3).square().mean().sqrt())

        def codes(rows: int, cols: int) -> torch.Tensor:
            full = torch.stack([tc.random_trellis(rows, cols, MIXED_TILE_BITS, gen)
                                for _ in range(e)])
            family = "fc1" if cols == 2 * g.intermediate else "fc2"
            k = torch.tensor([qm.logical_tile_bits(family, j, i16)
                              for j in range(full.shape[2 if family == "fc1" else 1])])
            keep = torch.arange(full.shape[-1]) < 16 * (k[None, None, :, None] if family == "fc1"
                                                       else k[None, :, None, None])
            return full * keep
    else:
        rms = float(tc.codebook_lut(CODEBOOK, bits).square().mean().sqrt())

        def codes(rows: int, cols: int) -> torch.Tensor:
            return torch.stack([tc.random_trellis(rows, cols, bits, gen) for _ in range(e)])

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

"""QSRT atoms-v2 format facts: constants, profiles, geometry, validation helpers, sign draws.

The leaf of :mod:`kquant_cute.qsrt`: it imports no other QSRT module and nothing that
builds weights, so :mod:`kquant_cute.weights` may ask it (profile names, the codebook, the
coupled sign draws). It owns:

* the file constants: schema names, section sizes, tensor names, the 4 KiB storage
  alignment, the atom width (32 channels) and span bytes, the layer file / manifest /
  completion-record names;
* the profiles (:data:`PROFILES`) and per-expert format codes of the 4 KiB format section;
* :class:`Geometry` (experts, latent width, global intermediate width) and its checks;
* the one validation of a MoE layer index (:func:`check_layer_index`) and of a
  tensor-parallel size / rank pair (:func:`check_tp`), raising :class:`QSRTFormatError`;
* the seeded coupled sign draws (:func:`rotation_signs`, :func:`coupled_signs`).

Sources: docs/formats.md (the public kquant / pedapudi/qsrt, b12x and vLLM-fork sources).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import trellis as tc

__all__ = [
    "QSRTFormatError",
    "Profile",
    "PROFILES",
    "PRODUCTION_PROFILE",
    "H308_UNCOUPLED",
    "H308_COUPLED",
    "MIXED_PROFILES",
    "Geometry",
    "KIMI_K3",
    "layer_filename",
    "check_layer_index",
    "check_tp",
    "rotation_signs",
    "coupled_signs",
]

# --------------------------------------------------------------------------------------
# File constants
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
#: The completion record a finished production checkpoint carries next to its manifest.
COMPLETION_FILE = "qsrt-completion.json"
COMPLETION_KIND = "kquant_kimi_k3_qsrt_completion"
COMPLETION_SCHEMA_VERSION = 2

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
#: Words per tile of a mixed layer's tile form (K=4, the widest record).
MIXED_TILE_BITS = 4


class QSRTFormatError(ValueError):
    """A QSRT layer file, manifest, completion record or request is malformed or not
    supported."""


def fail(path: Any, message: str) -> QSRTFormatError:
    """A :class:`QSRTFormatError` whose message starts with ``path`` (when given)."""
    where = f"{path}: " if path is not None else ""
    return QSRTFormatError(f"{where}{message}")


def format_name(code: int) -> str:
    """Readable name of a per-expert format byte (``K2``, ``H308``, ``X4T``, ...)."""
    if code == FORMAT_X4T:
        return "X4T"
    r13, r2 = code >> 4, code & 0xF
    names = {0: "R0", 1: "R1", 2: "R2", 3: "H308", 4: "K2"}
    if r13 not in names or r2 not in names:
        return "invalid"
    return names[r13] if r13 == r2 else f"{names[r13]}/{names[r2]}"


def align(n: int, alignment: int = STORAGE_ALIGNMENT) -> int:
    """``n`` rounded up to the storage alignment."""
    return (n + alignment - 1) // alignment * alignment


# --------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """One atoms-v2 profile: its header id, every expert's format code, transforms, rates.

    ``uniform_bits`` is K for a uniform-rate profile, None for the mixed H308 profiles
    (per-record rates, laid out by :mod:`kquant_cute.qsrt.layout`). ``supported`` says
    whether the loader builds weights for it; ``reason`` says why not.
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
#: Mixed rates (22 K3 + 2 K4 records per expert): P43 pairs placed by the per-expert pair
#: rotation (uncoupled) or static (coupled).
H308_UNCOUPLED = "k3x22_k4x2"
H308_COUPLED = "k3x22_k4x2_coupled_h512_h128"

PROFILES: dict[str, Profile] = {
    H308_UNCOUPLED: Profile(H308_UNCOUPLED, 2, 0x33, False, None, True),
    PRODUCTION_PROFILE: Profile(PRODUCTION_PROFILE, 3, 0x44, True, 2, True),
    H308_COUPLED: Profile(H308_COUPLED, 4, 0x33, True, None, True),
}
PROFILE_BY_ID = {p.profile_id: p for p in PROFILES.values()}
MIXED_PROFILES = tuple(p.name for p in PROFILES.values() if p.uniform_bits is None)


def profile(name: object, path: Any = None) -> Profile:
    """The :class:`Profile` called ``name``; QSRTFormatError listing the known ones."""
    if name not in PROFILES:
        known = ", ".join(f"{p.name} (id {p.profile_id})" for p in PROFILES.values())
        raise fail(path, f"unknown QSRT profile {name!r}; known profiles: {known}")
    return PROFILES[name]  # type: ignore[index]


def supported(prof: Profile, path: Any = None) -> Profile:
    """``prof`` if the loader supports it, else QSRTFormatError saying why not."""
    if not prof.supported:
        raise fail(path, f"QSRT profile {prof.name!r} (id {prof.profile_id}) is recognised "
                         f"but not supported: {prof.reason}")
    return prof


# --------------------------------------------------------------------------------------
# Uniform-rate bundle sizes and the geometry
# --------------------------------------------------------------------------------------


def matrix_atom_bytes(hidden: int, low_bits: int, high_bits: int) -> int:
    """Bytes of one matrix section of one atom: two 16-channel planes [H/16][16K] int16."""
    return (hidden // tc.TILE) * PLANE_CHANNELS * (low_bits + high_bits) * 2


def bundle_bytes(hidden: int, bits: int) -> int:
    """Bytes of one expert's bundle in one atom row at uniform K: gate | up | down | 3 spans."""
    return 3 * matrix_atom_bytes(hidden, bits, bits) + 3 * SPAN_BYTES


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
        """Bytes of one atom row at uniform K (every expert's bundle, aligned)."""
        return align(self.num_experts * bundle_bytes(self.hidden, bits))


KIMI_K3 = Geometry(896, 3584, 3072)


def layer_filename(layer: int) -> str:
    return f"{LAYER_FILE_PREFIX}{layer:05d}{LAYER_FILE_SUFFIX}"


def check_layer_index(layer: object) -> int:
    """``layer`` if it is a MoE layer number (1..92), else QSRTFormatError."""
    lo, hi = LAYER_RANGE
    if isinstance(layer, bool) or not isinstance(layer, int) or not lo <= layer <= hi:
        raise QSRTFormatError(f"MoE layer must be an int in {lo}..{hi}, got {layer!r}")
    return layer


def check_tp(tp_size: object, tp_rank: object) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` if both are ints with ``0 <= tp_rank < tp_size``."""
    for name, v in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise QSRTFormatError(f"{name} must be an int, got {v!r}")
    if tp_size < 1:  # type: ignore[operator]
        raise QSRTFormatError(f"tp_size must be positive, got {tp_size}")
    if not 0 <= tp_rank < tp_size:  # type: ignore[operator]
        raise QSRTFormatError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size} "
                              f"(ranks 0..{tp_size - 1})")  # type: ignore[operator]
    return tp_size, tp_rank  # type: ignore[return-value]


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

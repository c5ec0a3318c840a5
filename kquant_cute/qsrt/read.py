"""Reading QSRT atoms-v2 layer files: header validation, a rank's atom rows, whole layers.

* :func:`read_header` -- a layer file's header, format and shared-scale sections, validated
  (reads no atom row);
* :func:`read_rank_rows` -- only the byte range of one rank's atom rows, with plain
  positional reads into a caller's buffer (no mapping of the multi-GB file), checked;
* :func:`load_layer` -- file (or model directory + layer) -> one rank's
  :class:`~kquant_cute.weights.MoEWeights` / :class:`~kquant_cute.mixed.MixedMoEWeights`,
  everything validated before anything is built;
* :func:`read_layer` -- the whole file as a :class:`~.layer.QSRTLayer`;
* :func:`read_manifest` -- a model directory's ``qsrt-manifest.json``, checked.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .. import trellis as tc
from ..mixed import MixedMoEWeights
from ..weights import MoEWeights
from . import format as fmt
from . import layout, rows
from .extent import RankExtent, rank_extent
from .format import (ATOM_TENSOR, FORMAT_SECTION_BYTES, FORMAT_TENSOR, MANIFEST_FILE,
                     MANIFEST_KIND, MAX_DRAW, PROFILES, SCHEMAS, SHARED_SCALE_ORDER,
                     SHARED_SCALE_SECTION_BYTES, SHARED_SCALE_TENSOR, TENSORS, Geometry)
from .layer import QSRTLayer

__all__ = ["LayerHeader", "read_header", "read_rank_rows", "read_layer", "load_layer",
           "read_manifest"]


@dataclass(frozen=True)
class LayerHeader:
    """What a layer file declares, validated; its atom rows are not read yet.
    ``atom_offset`` is the file offset of the ``qsrt_atoms`` tensor's first byte."""

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
    atom_offset: int = 0
    file_bytes: int = 0


def _safe_open(path: Path):
    from safetensors import safe_open  # local: the reader is the only user

    try:
        size = path.stat().st_size
    except OSError as exc:
        raise fmt.fail(path, f"cannot read the layer file ({exc.strerror})") from None
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise fmt.fail(path, f"truncated file: {size} bytes, no safetensors header")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise fmt.fail(path, f"truncated file: the header declares {n} bytes, the file has {size}")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type
        msg = str(exc)
        if "not fully covered" in msg or "incomplete" in msg.lower():
            raise fmt.fail(path, f"truncated file ({size} bytes): {msg}") from None
        raise fmt.fail(path, f"not a valid safetensors file: {msg}") from None


def _atom_offset(path: Path) -> int:
    """File offset of the atom tensor (8-byte length + JSON header + its data offset)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
    return 8 + n + int(doc[ATOM_TENSOR]["data_offsets"][0])


def _int_meta(meta: dict, key: str, path: Path) -> int:
    try:
        return int(meta[key])
    except (KeyError, TypeError, ValueError):
        raise fmt.fail(path, f"header metadata {key!r} is missing or not an int "
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
            raise fmt.fail(p, f"tensors {sorted(keys)} are not the atoms-v2 inventory "
                              f"{list(TENSORS)}")
        if meta.get("schema") not in SCHEMAS:
            raise fmt.fail(p, f"schema {meta.get('schema')!r} is not one of {list(SCHEMAS)}")
        for key, want in (("version", str(fmt.VERSION)), ("encoding", fmt.ENCODING),
                          ("codebook", fmt.CODEBOOK_ID)):
            if meta.get(key) != want:
                raise fmt.fail(p, f"header {key} is {meta.get(key)!r}, expected {want!r}")
        if "profile" not in meta:
            raise fmt.fail(p, "header metadata has no 'profile'")
        prof = fmt.profile(meta["profile"], p)
        pid = _int_meta(meta, "profile_id", p)
        if pid != prof.profile_id:
            other = fmt.PROFILE_BY_ID.get(pid)
            raise fmt.fail(p, f"profile {prof.name!r} has id {prof.profile_id}, the header says "
                              f"{pid}" + (f" ({other.name})" if other else ""))
        fmt.supported(prof, p)
        file_layer = _int_meta(meta, "layer", p)
        fmt.check_layer_index(file_layer)
        if layer is not None and file_layer != layer:
            raise fmt.fail(p, f"file holds layer {file_layer}, layer {layer} was requested")
        try:
            geometry = Geometry(_int_meta(meta, "experts", p),
                                _int_meta(meta, "latent_channels", p),
                                _int_meta(meta, "intermediate_channels", p))
        except fmt.QSRTFormatError as exc:
            raise fmt.fail(p, f"declared geometry: {exc}") from None
        for key, want in layout.file_metadata(file_layer, prof, geometry).items():
            if key == "schema":
                continue
            if meta.get(key) != want:
                what = "wrong stride" if key == "atom_slot_stride_bytes" else "wrong value"
                raise fmt.fail(p, f"{what}: header {key} is {meta.get(key)!r}, expected "
                                  f"{want!r} for {prof.name} at {geometry}")
        if prof.uniform_bits is None:
            layout.check_geometry(prof, geometry, p)
            per_row = "mixed P33 / P43 / P44 bundles per row"
        else:
            per_row = (f"{geometry.num_experts} bundles of "
                       f"{fmt.bundle_bytes(geometry.hidden, prof.uniform_bits)} B per row")
        atom_shape = layout.atom_shape(prof, geometry, file_layer)
        stride = atom_shape[1] if len(atom_shape) == 2 else 0
        shapes = {FORMAT_TENSOR: [FORMAT_SECTION_BYTES],
                  SHARED_SCALE_TENSOR: [SHARED_SCALE_SECTION_BYTES],
                  ATOM_TENSOR: atom_shape}
        for name, shape in shapes.items():
            sl = handle.get_slice(name)
            if sl.get_dtype() != "U8":
                raise fmt.fail(p, f"tensor {name} has dtype {sl.get_dtype()}, expected U8")
            if list(sl.get_shape()) != shape:
                what = ("wrong stride: " if name == ATOM_TENSOR
                        and sl.get_shape()[:1] == shape[:1] else "")
                raise fmt.fail(p, f"{what}tensor {name} has shape {sl.get_shape()}, expected "
                                  f"{shape} ({per_row}, {fmt.STORAGE_ALIGNMENT}-aligned)")
        section = handle.get_tensor(FORMAT_TENSOR)
        shared = handle.get_tensor(SHARED_SCALE_TENSOR)
    e = geometry.num_experts
    codes = section[:e].clone()
    bad = (codes != prof.format_code).nonzero(as_tuple=True)[0]
    if bad.numel():
        i = int(bad[0])
        c = int(codes[i])
        raise fmt.fail(p, f"expert {i} has format code 0x{c:02x} ({fmt.format_name(c)}), "
                          f"profile {prof.name} needs 0x{prof.format_code:02x} "
                          f"({fmt.format_name(prof.format_code)}) for every expert "
                          f"({bad.numel()} experts differ)")
    draws = section[e: 2 * e].clone() if prof.coupled else torch.zeros(e, dtype=torch.uint8)
    bad = (draws > MAX_DRAW).nonzero(as_tuple=True)[0]
    if bad.numel():
        i = int(bad[0])
        raise fmt.fail(p, f"expert {i} has rotation draw {int(draws[i])}, draws are "
                          f"0..{MAX_DRAW}")
    pad_from = 2 * e if prof.coupled else e
    if bool((section[pad_from:] != 0).any()):
        i = pad_from + int((section[pad_from:] != 0).nonzero()[0])
        raise fmt.fail(p, f"format section byte {i} is nonzero (padding from byte {pad_from})")
    nbytes = 3 * geometry.hidden * 2
    if bool((shared[nbytes:] != 0).any()):
        raise fmt.fail(p, f"shared-scale section has nonzero padding after byte {nbytes}")
    vecs = shared[:nbytes].clone().view(torch.float16).reshape(3, geometry.hidden)
    for name, v in zip(SHARED_SCALE_ORDER, vecs):
        if not bool(torch.isfinite(v).all()):
            raise fmt.fail(p, f"shared vector {name} has non-finite values")
    return LayerHeader(p, file_layer, prof.name, geometry, stride, codes, draws,
                       vecs[0].clone(), vecs[1].clone(), vecs[2].clone(), meta,
                       _atom_offset(p), p.stat().st_size)


# --------------------------------------------------------------------------------------
# A rank's atom rows
# --------------------------------------------------------------------------------------


def rank_byte_range(header: LayerHeader, ext: RankExtent) -> tuple[int, int]:
    """``(offset, nbytes)`` in the file of the rank's atom rows (one contiguous range)."""
    g = header.geometry
    if PROFILES[header.profile].uniform_bits is not None or header.profile == layout.UNCOUPLED:
        return (header.atom_offset + ext.first_atom * header.stride,
                ext.atom_count * header.stride)
    layouts = layout.row_layouts(header.profile, g.num_experts, g.hidden, header.layer)
    begin = layout.row_offset(header.profile, layouts, ext.first_atom)
    end = layout.row_offset(header.profile, layouts, ext.first_atom + ext.atom_count)
    return header.atom_offset + begin, end - begin


def read_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous uint8 CPU tensor ``out`` with the file's bytes at ``offset``
    (positional reads; a short read is a truncated file)."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise fmt.fail(path, f"truncated file: {len(view) - done} of the rank's bytes "
                                     f"past offset {offset + done} are missing")
            done += n
    finally:
        os.close(fd)


def read_rank_rows(header: LayerHeader, ext: RankExtent,
                   buffer: Optional[torch.Tensor] = None) -> torch.Tensor | dict[int, torch.Tensor]:
    """The rank's atom rows, checked (zero row padding, finite spans): uniform K, uint8
    [atom_count, stride]; H308, ``{atom: row bytes}``. Only the rank's byte range is read,
    into ``buffer`` (a uint8 CPU tensor of at least that many bytes; allocated when None)."""
    offset, nbytes = rank_byte_range(header, ext)
    flat = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer[:nbytes]
    read_into(header.path, offset, flat)
    return split_rank_rows(header, ext, flat)


def split_rank_rows(header: LayerHeader, ext: RankExtent,
                    flat: torch.Tensor) -> torch.Tensor | dict[int, torch.Tensor]:
    """:func:`read_rank_rows` on bytes already read (``flat``: the rank's byte range)."""
    g = header.geometry
    bits = PROFILES[header.profile].uniform_bits
    if bits is not None:
        out = flat.view(ext.atom_count, header.stride)
        rows.check_uniform_rows(header.path, g, bits, ext.first_atom, out)
        return out
    base = rank_byte_range(header, ext)[0] - header.atom_offset
    split = rows.mixed_split_rows(header.profile, g, header.layer, ext, flat, base)
    rows.check_mixed_rows(header.path, header.profile, g, header.layer, split)
    return split


def rank_weights(header: LayerHeader, ext: RankExtent,
                 rank_rows: torch.Tensor | dict[int, torch.Tensor]) -> MoEWeights | MixedMoEWeights:
    """The rank's weights (CPU) from its checked rows."""
    h = header
    if isinstance(rank_rows, dict):
        return rows.mixed_rank_weights(h.profile, h.geometry, h.layer, ext, rank_rows,
                                       h.w1_suh, h.w3_suh, h.w2_svh, h.draws)
    return rows.rank_weights(h.profile, h.geometry, h.layer, ext, rank_rows, h.w1_suh,
                             h.w3_suh, h.w2_svh, h.draws)


# --------------------------------------------------------------------------------------
# Model directories
# --------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise fmt.fail(path, f"cannot read the {what} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise fmt.fail(path, f"{what} is not JSON: {exc}") from None


def read_manifest(root: str | os.PathLike) -> dict:
    """``root/qsrt-manifest.json``, checked: its kind, storage schema and a known, supported
    profile."""
    mpath = Path(root) / MANIFEST_FILE
    manifest = _read_json(mpath, "manifest")
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind != MANIFEST_KIND:
        raise fmt.fail(mpath, f"manifest kind is {kind!r}, expected {MANIFEST_KIND!r}")
    if manifest.get("storage_schema") not in SCHEMAS:
        raise fmt.fail(mpath, f"storage_schema {manifest.get('storage_schema')!r} is not one "
                              f"of {list(SCHEMAS)}")
    fmt.supported(fmt.profile(manifest.get("profile"), mpath), mpath)
    if not isinstance(manifest.get("layers"), dict):
        raise fmt.fail(mpath, "manifest has no 'layers' object")
    return manifest


def manifest_entry(root: Path, manifest: dict, layer: int) -> dict:
    """The manifest's entry for ``layer``, checked (file name)."""
    mpath = root / MANIFEST_FILE
    entry = manifest["layers"].get(str(layer))
    if not isinstance(entry, dict) or not isinstance(entry.get("qsrt_atoms"), str):
        raise fmt.fail(mpath, f"manifest has no entry for layer {layer}")
    if entry["qsrt_atoms"] != fmt.layer_filename(layer):
        raise fmt.fail(mpath, f"layer {layer} names file {entry['qsrt_atoms']!r}, expected "
                              f"{fmt.layer_filename(layer)!r}")
    return entry


def _resolve(path_or_root: str | os.PathLike,
             layer: Optional[int]) -> tuple[Path, Optional[int], Optional[str]]:
    """A layer file path, or a model root + layer read through its manifest (then also the
    manifest's profile)."""
    p = Path(path_or_root)
    if not p.is_dir():
        return p, layer, None
    if layer is None:
        raise fmt.QSRTFormatError(f"{p} is a directory: pass layer= to pick a layer file")
    fmt.check_layer_index(layer)
    manifest = read_manifest(p)
    entry = manifest_entry(p, manifest, layer)
    fpath = p / entry["qsrt_atoms"]
    size = entry.get("atom_disk_bytes")
    if isinstance(size, int) and fpath.exists() and fpath.stat().st_size != size:
        raise fmt.fail(fpath, f"truncated or resized file: {fpath.stat().st_size} bytes, the "
                              f"manifest says {size}")
    return fpath, layer, manifest["profile"]


def _header(path_or_root: str | os.PathLike, layer: Optional[int]) -> LayerHeader:
    path, layer, profile = _resolve(path_or_root, layer)
    h = read_header(path, layer=layer)
    if profile is not None and profile != h.profile:
        raise fmt.fail(h.path, f"file profile {h.profile!r} differs from the manifest's "
                               f"{profile!r}")
    return h


def _read_mixed_layer(h: LayerHeader) -> QSRTLayer:
    """Every bundle of a mixed layer put back at its logical tile (tile form, K=4 words)."""
    g = h.geometry
    e, h16, i16 = g.num_experts, g.hidden // tc.TILE, g.intermediate // tc.TILE
    kw = tc.TILE * fmt.MIXED_TILE_BITS
    by_atom = read_rank_rows(h, RankExtent(1, 0, 0, g.atom_slots, g.atom_slots))
    assert isinstance(by_atom, dict)
    layouts = layout.row_layouts(h.profile, e, g.hidden, h.layer)
    fc1 = torch.zeros(e, h16, 2 * i16, kw, dtype=torch.int16)
    fc2 = torch.zeros(e, i16, h16, kw, dtype=torch.int16)
    svh = torch.zeros(e, 2 * g.intermediate, dtype=torch.float16)
    suh = torch.zeros(e, g.intermediate, dtype=torch.float16)
    for a, row in by_atom.items():
        for x in range(e):
            planes, spans = rows.mixed_bundle(row, layouts[a], x, g.hidden)
            for m, pair in enumerate(layout.bundle_sources(h.profile, h.layer, x, a, i16)):
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
    h = _header(path_or_root, layer)
    if PROFILES[h.profile].uniform_bits is None:
        return _read_mixed_layer(h)
    g, bits = h.geometry, PROFILES[h.profile].uniform_bits
    all_rows = read_rank_rows(h, RankExtent(1, 0, 0, g.atom_slots, g.atom_slots))
    assert isinstance(all_rows, torch.Tensor)
    parts = rows.bundles(all_rows, g, bits)
    words, spans = parts["words"], parts["spans"]
    e, a, h16, k16 = g.num_experts, g.atom_slots, g.hidden // tc.TILE, tc.TILE * bits
    fc1 = words[:, :, :2].permute(1, 4, 0, 2, 3, 5).reshape(e, h16, 4 * a, k16)
    fc2 = words[:, :, 2].permute(1, 0, 2, 3, 4).reshape(e, 2 * a, h16, k16)
    return QSRTLayer(
        layer=h.layer, profile=h.profile, geometry=g,
        fc1=fc1.contiguous(),
        fc1_svh=spans[:, :, :2].permute(1, 0, 2, 3).reshape(e, -1).contiguous(),
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
) -> MoEWeights | MixedMoEWeights:
    """Load one tensor-parallel rank of a layer into :class:`MoEWeights` (uniform K) or
    :class:`MixedMoEWeights` (H308 profiles).

    ``path_or_root`` is a ``qsrt-layer-NNNNN.safetensors`` file, or a model directory with
    ``qsrt-manifest.json`` (then ``layer`` picks the file and the manifest's profile and
    file size are checked). Only the rank's atom rows are read. Everything -- header,
    sections, extent, row padding, finite spans -- is validated before any weight tensor is
    built; on error nothing is returned and nothing is moved to ``device``.

    The result (coupled K=2): slot matrices ``gate_trellis`` / ``up_trellis`` (atom ``a``'s
    FC1 sections 0 / 1, i.e. pre-activation chunks 2a / 2a+1), ``down_trellis``, their
    intermediate-side spans, one shared ``gate_suh == up_suh`` (w1.suh below the half
    boundary, w3.suh above), ``down_svh`` = w2.svh, and the coupled ``pre_signs`` /
    ``post_signs`` of the rank's coordinates. See :func:`~.extent.rank_extent` for the split.
    """
    h = _header(path_or_root, layer)
    ext = rank_extent(h.profile, h.geometry, h.layer, tp_size, tp_rank, pad=pad)
    w = rank_weights(h, ext, read_rank_rows(h, ext))
    return w if device is None else w.to(device)

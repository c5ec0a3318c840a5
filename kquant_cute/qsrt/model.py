"""Whole-model QSRT loading: one tensor-parallel rank of every MoE layer of a model
directory, checked against its completion record and manifest, streamed layer by layer.

A model directory holds ``qsrt-layer-NNNNN.safetensors`` files, ``qsrt-manifest.json`` and
``qsrt-completion.json``, the record a finished checkpoint carries:

* ``kind`` ``"kquant_kimi_k3_qsrt_completion"``, ``schema_version`` 2, ``complete`` true;
* ``profile``, ``storage_schema`` (either atoms-v2 schema name), ``layer_count``,
  ``candidate_pool_content_sha256`` (64 hex digits);
* ``layers`` = ``{"N": {"file": name, "bytes": size}}``, optionally with ``"sha256"`` (hex
  SHA-256 of the whole file; :func:`~.write.write_completion` emits it, and the manifest's
  layer entries carry it too).

:func:`load_model` checks the two records against each other and every selected file's
existence and size before it reads a row; ``verify="sha256"`` also hashes each whole file
against the digest the records carry. A reader thread reads the next layer's rank rows
(positional reads of the rank's byte range only, into one of two reusable buffers) while
the main thread copies, checks and builds the current layer. On a CUDA device the buffers
are page-locked, the raw rows go to the GPU in one copy and a uniform-K layer is checked and
built there, so host memory holds the two buffers and nothing else per layer; on the CPU
(and for H308 layers, built on the CPU and then moved) also the layer being built. A tqdm bar shows
progress when stderr is a terminal. On any error nothing is returned: the layers loaded so
far are dropped and the reader is stopped before the exception propagates.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ..mixed import MixedMoEWeights
from ..weights import MoEWeights
from . import format as fmt
from .extent import rank_extent
from .format import COMPLETION_FILE, COMPLETION_KIND, COMPLETION_SCHEMA_VERSION, MANIFEST_FILE
from .read import (manifest_entry, rank_byte_range, rank_weights, read_header, read_into,
                   read_manifest, split_rank_rows, _read_json)

__all__ = ["load_model", "read_completion", "VERIFY_MODES"]

#: ``verify`` modes of :func:`load_model`: file sizes only, or sizes and whole-file SHA-256.
VERIFY_MODES = ("size", "sha256")
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Bytes per read while hashing a whole file.
_HASH_CHUNK = 16 << 20


def read_completion(root: str | os.PathLike) -> dict:
    """``root/qsrt-completion.json``, checked field by field (a wrong field is named)."""
    path = Path(root) / COMPLETION_FILE
    doc = _read_json(path, "completion record")

    def field(name: str, ok, want: str) -> Any:
        value = doc.get(name) if isinstance(doc, dict) else None
        if not ok(value):
            raise fmt.fail(path, f"field {name!r} is {value!r}, expected {want}")
        return value

    field("kind", lambda v: v == COMPLETION_KIND, repr(COMPLETION_KIND))
    field("schema_version", lambda v: v == COMPLETION_SCHEMA_VERSION and not isinstance(v, bool),
          str(COMPLETION_SCHEMA_VERSION))
    field("complete", lambda v: v is True, "true (the checkpoint is finished)")
    field("storage_schema", lambda v: v in fmt.SCHEMAS, f"one of {list(fmt.SCHEMAS)}")
    field("candidate_pool_content_sha256", lambda v: isinstance(v, str) and _HEX64.fullmatch(v),
          "64 lowercase hex digits")
    fmt.supported(fmt.profile(doc.get("profile"), path), path)
    layers = field("layers", lambda v: isinstance(v, dict) and v, "a non-empty object")
    field("layer_count", lambda v: isinstance(v, int) and not isinstance(v, bool)
          and v == len(layers), f"{len(layers)} (the number of entries in 'layers')")
    for key, entry in layers.items():
        where = f"layers.{key}"
        if not (key.isdigit() and fmt.LAYER_RANGE[0] <= int(key) <= fmt.LAYER_RANGE[1]):
            raise fmt.fail(path, f"{where}: layer key {key!r} is not a MoE layer number "
                                 f"{fmt.LAYER_RANGE[0]}..{fmt.LAYER_RANGE[1]}")
        if not isinstance(entry, dict):
            raise fmt.fail(path, f"{where} is {entry!r}, expected an object")
        want = fmt.layer_filename(int(key))
        if entry.get("file") != want:
            raise fmt.fail(path, f"field {where}.file is {entry.get('file')!r}, expected {want!r}")
        size = entry.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise fmt.fail(path, f"field {where}.bytes is {size!r}, expected a positive int")
        digest = entry.get("sha256")
        if digest is not None and not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
            raise fmt.fail(path, f"field {where}.sha256 is {digest!r}, expected 64 lowercase "
                                 "hex digits")
    return doc


def _select(completion: dict, layers: Optional[Iterable[int]], root: Path) -> list[int]:
    have = sorted(int(k) for k in completion["layers"])
    if layers is None:
        return have
    wanted = []
    for n in layers:
        fmt.check_layer_index(n)
        if str(n) not in completion["layers"]:
            raise fmt.fail(root / COMPLETION_FILE, f"missing layer {n}: the completion record "
                                                   f"lists layers {have[0]}..{have[-1]} "
                                                   f"({len(have)} layers)")
        if n not in wanted:
            wanted.append(n)
    return sorted(wanted)


def _plan(root: Path, completion: dict, manifest: dict, wanted: list[int],
          verify: str) -> list[tuple[int, Path, int, Optional[str]]]:
    """(layer, path, bytes, sha256 or None) of every selected layer, each checked against
    both records and the file system."""
    cpath, mpath = root / COMPLETION_FILE, root / MANIFEST_FILE
    out = []
    for n in wanted:
        rec = completion["layers"][str(n)]
        try:
            ment = manifest_entry(root, manifest, n)
        except fmt.QSRTFormatError:
            raise fmt.fail(mpath, f"missing layer {n}: the manifest has no entry for it, the "
                                  "completion record has") from None
        size = rec["bytes"]
        if ment.get("atom_disk_bytes") not in (None, size):
            raise fmt.fail(mpath, f"size mismatch: field layers.{n}.atom_disk_bytes is "
                                  f"{ment['atom_disk_bytes']}, {COMPLETION_FILE} field "
                                  f"layers.{n}.bytes is {size}")
        digests = {src: d for src, d in ((COMPLETION_FILE, rec.get("sha256")),
                                         (MANIFEST_FILE, ment.get("sha256"))) if d is not None}
        if len(set(digests.values())) > 1:
            raise fmt.fail(mpath, f"digest mismatch: field layers.{n}.sha256 differs between "
                                  f"{COMPLETION_FILE} and {MANIFEST_FILE}")
        digest = next(iter(digests.values()), None)
        if verify == "sha256" and digest is None:
            raise fmt.fail(cpath, f"layer {n}: verify='sha256', but neither {COMPLETION_FILE} "
                                  f"nor {MANIFEST_FILE} carries a field layers.{n}.sha256")
        path = root / rec["file"]
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise fmt.fail(path, f"missing layer {n}: the file does not exist (listed in "
                                 f"{COMPLETION_FILE})") from None
        if actual != size:
            what = "truncated file" if actual < size else "size mismatch"
            raise fmt.fail(path, f"{what}: {actual} bytes, {COMPLETION_FILE} field "
                                 f"layers.{n}.bytes says {size}")
        out.append((n, path, size, digest if verify == "sha256" else None))
    return out


def _read_hashed(path: Path, offset: int, out: torch.Tensor, digest: str, layer: int) -> None:
    """Read the whole file sequentially, hashing it, keeping bytes ``[offset, offset +
    len(out))`` in ``out``; QSRTFormatError naming the file and field on a digest mismatch."""
    h = hashlib.sha256()
    dst = memoryview(out.numpy()).cast("B")
    chunk = bytearray(_HASH_CHUNK)
    view = memoryview(chunk)
    pos = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(chunk)
            if not n:
                break
            h.update(view[:n])
            lo, hi = max(pos, offset), min(pos + n, offset + len(dst))
            if lo < hi:
                dst[lo - offset: hi - offset] = view[lo - pos: hi - pos]
            pos += n
    if pos < offset + len(dst):
        raise fmt.fail(path, f"truncated file: {pos} bytes, the rank's rows end at byte "
                             f"{offset + len(dst)}")
    if h.hexdigest() != digest:
        raise fmt.fail(path, f"digest mismatch: sha256 {h.hexdigest()}, the records' field "
                             f"layers.{layer}.sha256 says {digest}")


class _Reader(threading.Thread):
    """Reads each planned layer's header and rank rows into one of two reusable buffers and
    hands them over through a queue of depth one: at most two layers' rows are in flight."""

    def __init__(self, plan, profile: str, tp_size: int, tp_rank: int, pad: bool,
                 pin: bool) -> None:
        super().__init__(name="qsrt-load-model-reader", daemon=True)
        self.plan, self.profile, self.pad, self.pin = plan, profile, pad, pin
        self.tp = (tp_size, tp_rank)
        self.ready: queue.Queue = queue.Queue(maxsize=1)
        self.free: queue.Queue = queue.Queue()
        for _ in range(2):
            self.free.put(torch.empty(0, dtype=torch.uint8))
        self.stop = threading.Event()

    def _buffer(self, nbytes: int) -> Optional[torch.Tensor]:
        while not self.stop.is_set():
            try:
                buf = self.free.get(timeout=0.1)
            except queue.Empty:
                continue
            if buf.numel() < nbytes:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            return buf
        return None

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def run(self) -> None:
        try:
            for n, path, _, digest in self.plan:
                h = read_header(path, layer=n)
                if h.profile != self.profile:
                    raise fmt.fail(path, f"wrong profile: the file holds {h.profile!r}, "
                                         f"{COMPLETION_FILE} field profile says "
                                         f"{self.profile!r}")
                ext = rank_extent(h.profile, h.geometry, h.layer, *self.tp, pad=self.pad)
                offset, nbytes = rank_byte_range(h, ext)
                buf = self._buffer(nbytes)
                if buf is None:
                    return
                if digest is None:
                    read_into(path, offset, buf[:nbytes])
                else:
                    _read_hashed(path, offset, buf[:nbytes], digest, n)
                self._put((n, h, ext, buf, nbytes))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(exc)


def _progress(total: int, enabled: Optional[bool]):
    show = sys.stderr.isatty() if enabled is None else enabled
    from tqdm import tqdm

    return tqdm(total=total, desc="qsrt layers", unit="layer", disable=not show,
                file=sys.stderr)


def load_model(
    root: str | os.PathLike,
    *,
    tp_size: int,
    tp_rank: int,
    device: Optional[torch.device | str] = None,
    layers: Optional[Iterable[int]] = None,
    verify: str = "size",
    profile: Optional[str] = None,
    pad: bool = True,
    progress: Optional[bool] = None,
) -> dict[int, MoEWeights | MixedMoEWeights]:
    """One tensor-parallel rank of a QSRT model directory: ``{layer: weights}``.

    ``root`` holds the layer files, ``qsrt-manifest.json`` and ``qsrt-completion.json``.
    ``layers``: the MoE layer numbers to load (default: every layer of the completion
    record). ``verify``: ``"size"`` checks each file's size against the records;
    ``"sha256"`` also hashes each whole file against the records' ``layers.N.sha256``
    (the whole file is read, not only the rank's rows). ``profile``: the profile the caller
    serves (the records must name it). ``pad`` / the extent: as
    :func:`~.read.load_layer`. ``device``: where the weights go (default: the CPU).
    ``progress``: a tqdm bar on stderr (default: when stderr is a terminal).

    Weights are :class:`~kquant_cute.weights.MoEWeights` (uniform K) or
    :class:`~kquant_cute.mixed.MixedMoEWeights` (H308), each identical to
    ``load_layer(root, layer=N, tp_size=..., tp_rank=...)``.

    Raises:
        QSRTFormatError: a malformed or disagreeing record (names the file and field), a
            missing layer or file, a size or digest mismatch, a wrong profile, a bad
            layer file or rank. Nothing is returned half-loaded.
    """
    root = Path(root)
    if verify not in VERIFY_MODES:
        raise fmt.QSRTFormatError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    fmt.check_tp(tp_size, tp_rank)
    completion = read_completion(root)
    manifest = read_manifest(root)
    name = completion["profile"]
    if profile is not None and profile != name:
        fmt.profile(profile)
        raise fmt.fail(root / COMPLETION_FILE, f"wrong profile: field profile is {name!r}, "
                                               f"{profile!r} was requested")
    if manifest["profile"] != name:
        raise fmt.fail(root / MANIFEST_FILE, f"wrong profile: field profile is "
                                             f"{manifest['profile']!r}, {COMPLETION_FILE} "
                                             f"says {name!r}")
    plan = _plan(root, completion, manifest, _select(completion, layers, root), verify)
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # A CUDA device: page-locked read buffers, each layer's rows copied as they were read
    # (one DMA, the reader already reading the next layer) and, at uniform K, checked and
    # built on the GPU, so host memory holds only the two buffers.
    on_gpu = dev is not None and dev.type == "cuda"
    gpu_build = on_gpu and fmt.PROFILES[name].uniform_bits is not None
    reader = _Reader(plan, name, tp_size, tp_rank, pad, pin=on_gpu)
    out: dict[int, MoEWeights | MixedMoEWeights] = {}
    bar = _progress(len(plan), progress)
    reader.start()
    try:
        for _ in plan:
            item = reader.ready.get()
            if isinstance(item, BaseException):
                raise item
            n, h, ext, buf, nbytes = item
            try:
                flat = buf[:nbytes].to(dev) if gpu_build else buf[:nbytes]
            finally:
                if gpu_build:
                    reader.free.put(buf)        # the copy from it has completed
            try:
                w = rank_weights(h, ext, split_rank_rows(h, ext, flat))
            finally:
                if not gpu_build:
                    reader.free.put(buf)
            out[n] = w if dev is None or w.device == dev else w.to(dev)
            bar.update(1)
    except BaseException:
        out.clear()
        raise
    finally:
        reader.stop.set()
        reader.join()
        bar.close()
    return out

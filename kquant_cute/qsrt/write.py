"""Writing QSRT atoms-v2 model directories: layer files, the manifest, the completion record.

* :func:`write_layer` -- ``root/qsrt-layer-NNNNN.safetensors`` from a
  :class:`~.layer.QSRTLayer` (canonical 4 KiB header, the three sections), written to a
  temporary name and renamed into place, and its entry in ``qsrt-manifest.json``;
* :func:`write_completion` -- ``root/qsrt-completion.json``, the record that says a model
  directory is complete, from the manifest.

Every file is created with mode ``0o666`` less the process umask (what ``open()`` gives),
never the ``0o600`` of a ``mkstemp`` file. Digests: each layer entry of the manifest and of
the completion record carries ``"sha256"`` (hex SHA-256 of the whole layer file), the digest
``load_model(verify="sha256")`` checks; ``bytes`` / ``atom_disk_bytes`` carry its size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import struct
from pathlib import Path
from typing import Callable, Optional

from . import format as fmt
from . import layout
from .format import (ATOM_SLAB_OFFSET, ATOM_TENSOR, COMPLETION_FILE, COMPLETION_KIND,
                     COMPLETION_SCHEMA_VERSION, FORMAT_SECTION_BYTES, FORMAT_TENSOR,
                     HEADER_BYTES, MANIFEST_FILE, MANIFEST_KIND, PROFILES,
                     SHARED_SCALE_SECTION_BYTES, SHARED_SCALE_TENSOR, QSRTFormatError)
from .layer import QSRTLayer

__all__ = ["write_layer", "write_completion"]


def _header_bytes(layer: QSRTLayer) -> bytes:
    g = layer.geometry
    prof = PROFILES[layer.profile]
    meta = layout.file_metadata(layer.layer, prof, g)
    atom_shape = layout.atom_shape(prof, g, layer.layer)
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


def _atomic_write(path: Path, fill: Callable) -> None:
    """Create ``path`` through a temporary sibling (mode 0o666 less the umask, applied by
    the OS as for any ``open()``), filled by ``fill(file)``, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_layer(root: str | os.PathLike, layer: QSRTLayer, *, manifest: bool = True) -> Path:
    """Write ``layer`` as ``root/qsrt-layer-NNNNN.safetensors`` (atomically) and, with
    ``manifest``, add it to ``root/qsrt-manifest.json`` (created if missing; its profile must
    match) with its size and SHA-256."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / fmt.layer_filename(layer.layer)
    digest = hashlib.sha256()

    def fill(f) -> None:
        for part in (_header_bytes(layer), layer.format_section().numpy(),
                     layer.shared_scale_section().numpy(), layer.atom_rows().numpy()):
            digest.update(part)
            f.write(part)

    _atomic_write(path, fill)
    if manifest:
        _update_manifest(root, layer, path, digest.hexdigest())
    return path


def _update_manifest(root: Path, layer: QSRTLayer, path: Path, sha256: str) -> None:
    mpath = root / MANIFEST_FILE
    if mpath.exists():
        doc = json.loads(mpath.read_text())
        if doc.get("profile") != layer.profile:
            raise QSRTFormatError(f"{mpath}: profile {doc.get('profile')!r}, cannot add a "
                                  f"{layer.profile!r} layer")
    else:
        prof = PROFILES[layer.profile]
        doc = {
            "kind": MANIFEST_KIND, "schema_version": fmt.VERSION, "codec": "QSRT",
            "storage_schema": fmt.SCHEMA, "storage_format": "qsrt_atoms_v2",
            "profile": layer.profile,
            "trellis_bits_per_weight": (prof.uniform_bits if prof.uniform_bits is not None
                                        else sum(layout.LOGICAL_RECORD_BITS) / layout.RECORDS),
            "tensor_parallel_independent": True, "layers": {},
        }
    doc["layers"][str(layer.layer)] = {
        "qsrt_atoms": path.name, "atom_disk_bytes": path.stat().st_size, "sha256": sha256,
    }
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    _atomic_write(mpath, lambda f: f.write(text))


def write_completion(root: str | os.PathLike, *,
                     candidate_pool_sha256: Optional[str] = None) -> Path:
    """Write ``root/qsrt-completion.json`` for every layer the manifest lists.

    Fields: ``kind``, ``schema_version`` 2, ``profile``, ``complete`` true, ``layer_count``,
    ``storage_schema``, ``candidate_pool_content_sha256``, ``layers`` =
    ``{"N": {"file", "bytes", "sha256"}}``, the total ``layer_bytes`` and the ``manifest``
    file name. The candidate-pool digest names the quantizer's
    input; a directory written from synthetic layers has none, so it defaults to the
    SHA-256 of the layers' ``"N:sha256"`` lines in layer order.
    """
    root = Path(root)
    mpath = root / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except OSError as exc:
        raise fmt.fail(mpath, f"cannot read the manifest ({exc.strerror}): write the layers "
                              "first") from None
    layers = {}
    for key in sorted(manifest["layers"], key=int):
        entry = manifest["layers"][key]
        layers[key] = {"file": entry["qsrt_atoms"], "bytes": entry["atom_disk_bytes"],
                       "sha256": entry["sha256"]}
    if candidate_pool_sha256 is None:
        lines = "".join(f"{k}:{v['sha256']}\n" for k, v in layers.items())
        candidate_pool_sha256 = hashlib.sha256(lines.encode()).hexdigest()
    doc = {
        "kind": COMPLETION_KIND, "schema_version": COMPLETION_SCHEMA_VERSION,
        "profile": manifest["profile"], "complete": True, "layer_count": len(layers),
        "storage_schema": manifest["storage_schema"],
        "candidate_pool_content_sha256": candidate_pool_sha256, "layers": layers,
        "layer_bytes": sum(e["bytes"] for e in layers.values()), "manifest": MANIFEST_FILE,
    }
    path = root / COMPLETION_FILE
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    _atomic_write(path, lambda f: f.write(text))
    return path

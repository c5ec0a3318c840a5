"""QSRT atoms-v2 checkpoints (Kimi-K3): the single owner of how QSRT layers are stored,
split over tensor-parallel ranks, read and written.

Modules (each owns one job; :mod:`.format` is the leaf every other one asks):

* :mod:`.format` -- constants, profiles, :class:`Geometry`, layer / TP validation, the
  coupled sign draws (imported by :mod:`kquant_cute.weights`, so it builds no weights);
* :mod:`.layout` -- the byte layout of every profile (uniform bundles, the H308 rate maps
  and bundles) and the canonical header metadata;
* :mod:`.extent` -- tensor-parallel rank extents (:func:`rank_extent`);
* :mod:`.rows` -- atom rows -> one rank's :class:`~kquant_cute.weights.MoEWeights` /
  :class:`~kquant_cute.mixed.MixedMoEWeights`;
* :mod:`.layer` -- the in-memory :class:`QSRTLayer` and :func:`random_layer`;
* :mod:`.read` -- :func:`read_header`, :func:`load_layer`, :func:`read_layer`;
* :mod:`.write` -- :func:`write_layer`, :func:`write_completion`;
* :mod:`.model` -- :func:`load_model`: a whole model directory, one rank, streamed.

The names below are re-exported here; the format facts are imported eagerly (torch only),
the rest on first use, so importing this package never imports the weight containers.
"""

from __future__ import annotations

import importlib

from .format import *  # noqa: F401,F403  (the format facts; see format.__all__)
from .format import (ATOM_CHANNELS, ATOM_SLAB_OFFSET, ATOM_TENSOR, CODEBOOK,  # noqa: F401
                     COMPLETION_FILE, COMPLETION_KIND, FORMAT_SECTION_BYTES, FORMAT_TENSOR,
                     HEADER_BYTES, MANIFEST_FILE, MANIFEST_KIND, MAX_DRAW, SCHEMA, SCHEMAS,
                     SHARED_SCALE_SECTION_BYTES, SHARED_SCALE_TENSOR, STORAGE_ALIGNMENT,
                     bundle_bytes, matrix_atom_bytes)
from .format import __all__ as _format_all

#: Public name -> the submodule that owns it (imported on first use).
_LAZY = {
    "RankExtent": "extent",
    "rank_extent": "extent",
    "QSRTLayer": "layer",
    "random_layer": "layer",
    "LayerHeader": "read",
    "read_header": "read",
    "read_layer": "read",
    "load_layer": "read",
    "read_manifest": "read",
    "write_layer": "write",
    "write_completion": "write",
    "load_model": "model",
    "read_completion": "model",
}

__all__ = [*_format_all, *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

"""EXL3-named safetensors files of a model's quantized routed experts.

Owns the file layout that :mod:`kquant_cute.integrations.transformers` saves and loads:
per expert ``e`` and projection, ``{experts path}.{e}.{gate_proj|up_proj|down_proj}.``
``trellis`` / ``suh`` / ``svh`` and the codebook's EXL3 marker tensor, with a header that
records the codebook, K and each block's vector sharing. Re-exported by the
transformers integration; needs no transformers import itself.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, Optional

import torch

from .. import trellis as tc
from ..weights import MoEWeights, TrellisLinear

__all__ = ["EXL3_PROJECTIONS", "FILE_FORMAT", "save_quantized", "load_quantized"]

#: EXL3 names of an expert's projections, in kernel order.
EXL3_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
#: EXL3 codebook marker tensors (int32 scalars holding the codebook's multiplier; only the
#: marker's presence selects the codebook, see TrellisLinear.from_exl3), by codebook name.
_MARKERS = {name: c.exl3_marker for name, c in tc.CODEBOOK.items() if c.exl3_marker is not None}
#: safetensors metadata ``format`` of files written by :func:`save_quantized`.
FILE_FORMAT = "kquant-cute/exl3-experts/1"


# --------------------------------------------------------------------------------------
# safetensors with EXL3 names
# --------------------------------------------------------------------------------------


def save_quantized(experts: Mapping[str, MoEWeights], path: str, *,
                   metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``{experts path: MoEWeights}`` to one safetensors file with EXL3 names: per
    expert ``e`` and projection, ``{path}.{e}.{gate_proj|up_proj|down_proj}.trellis`` (int16),
    ``.suh`` / ``.svh`` (fp16) and the codebook marker ``.mcg`` / ``.mul1`` (none for 3inst).
    Shared hidden-side vectors are written into every expert (EXL3 has no shared tensor);
    the header records the sharing so :func:`load_quantized` restores the layout exactly."""
    from safetensors.torch import save_file

    if not experts:
        raise ValueError("nothing to save: experts is empty")
    codebooks = {w.codebook for w in experts.values()}
    bits = {w.bits for w in experts.values()}
    if len(codebooks) != 1 or len(bits) != 1:
        raise ValueError(f"one codebook and K per file, got {sorted(codebooks)} / {sorted(bits)}")
    tensors: dict[str, torch.Tensor] = {}
    blocks = {}
    for prefix, w in experts.items():
        if not isinstance(w, MoEWeights):
            raise TypeError(f"experts[{prefix!r}] must be a MoEWeights, got {type(w).__name__}")
        blocks[prefix] = {"num_experts": w.num_experts, "shared": w.shared_hidden_vectors}
        cpu = w.to("cpu")
        for e in range(cpu.num_experts):
            for p, lin in cpu.expert(e).items():
                base = f"{prefix}.{e}.{EXL3_PROJECTIONS[p]}."
                tensors[base + "trellis"] = lin.trellis.contiguous()
                # clones: a shared vector would otherwise alias across experts
                tensors[base + "suh"] = lin.suh.clone()
                tensors[base + "svh"] = lin.svh.clone()
                if lin.codebook in _MARKERS:
                    marker = _MARKERS[lin.codebook]
                    tensors[base + lin.codebook] = torch.tensor(
                        marker - (1 << 32) if marker >= 1 << 31 else marker, dtype=torch.int32)
    meta = {"format": FILE_FORMAT, "codebook": codebooks.pop(), "bits": str(bits.pop()),
            "blocks": json.dumps(blocks)}
    meta.update(metadata or {})
    save_file(tensors, path, metadata=meta)


_EXPERT_KEY = re.compile(r"^(?P<prefix>.+)\.(?P<e>\d+)\.(gate_proj|up_proj|down_proj)\.trellis$")


def load_quantized(path: str, device: torch.device | str = "cpu",
                   codebook: Optional[str] = None) -> dict[str, MoEWeights]:
    """Read a file written by :func:`save_quantized` (or any EXL3-named expert checkpoint:
    blocks are then found from the ``{prefix}.{e}.gate_proj.trellis`` keys, and QSRT
    ``sqg_e4m3`` files need ``codebook``) into ``{experts path: MoEWeights}`` on ``device``."""
    from safetensors import safe_open

    dev = torch.device(device)
    with safe_open(path, framework="pt", device=str(dev)) as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        if meta.get("format") == FILE_FORMAT:
            blocks = json.loads(meta["blocks"])
            codebook = codebook or meta["codebook"]
        else:
            counts: dict[str, int] = {}
            for k in keys:
                m = _EXPERT_KEY.match(k)
                if m:
                    counts[m["prefix"]] = max(counts.get(m["prefix"], 0), int(m["e"]) + 1)
            if not counts:
                raise ValueError(f"{path}: no expert tensors named "
                                 "'{prefix}.{e}.gate_proj.trellis'")
            blocks = {p: {"num_experts": n, "shared": None} for p, n in counts.items()}
        out = {}
        for prefix, info in blocks.items():
            experts = []
            for e in range(info["num_experts"]):
                layers = {}
                for p, pname in EXL3_PROJECTIONS.items():
                    base = f"{prefix}.{e}.{pname}."
                    if base + "trellis" not in keys:
                        raise ValueError(f"{path}: missing tensor {base}trellis")
                    t = {k: f.get_tensor(base + k) for k in ("trellis", "suh", "svh", "bias",
                                                            *_MARKERS) if base + k in keys}
                    if codebook is not None and tc.codebook_record(codebook).family == "qsrt":
                        lin = TrellisLinear.from_qsrt(t, codebook)
                    else:
                        lin = TrellisLinear.from_exl3(t)
                        if codebook is not None and lin.codebook != codebook:
                            raise ValueError(f"{path}: {base}* markers say codebook "
                                             f"{lin.codebook!r}, the header {codebook!r}")
                    layers[p] = lin
                experts.append(layers)
            w = MoEWeights.from_experts(experts)
            if info["shared"] is False and w.shared_hidden_vectors:
                # identical per-expert vectors (e.g. one expert): keep the saved layout
                per = {n: getattr(w, n).unsqueeze(0).expand(w.num_experts, -1).clone()
                       for n in ("gate_suh", "up_suh", "down_svh")}
                w = MoEWeights(**{**dict(w.tensors()), **per}, codebook=w.codebook)
            out[prefix] = w
    return out

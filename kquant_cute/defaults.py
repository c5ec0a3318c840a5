"""The reference layer shape and token capacity that `kquant-compile` and
:mod:`kquant_cute.prewarm` default to, as plain values.

This module owns those values only. It imports nothing, so `kquant-compile --help` can
show them without loading torch or cutlass; :data:`kquant_cute.prewarm.DEFAULT_GEOMETRY`
is the `MoESpec` built from them.
"""

from __future__ import annotations

__all__ = ["DEFAULT_CAPACITY", "REFERENCE_LAYER"]

#: Tokens the default plans are sized for (the largest benchmark point, doubled).
DEFAULT_CAPACITY = 8192

#: One tensor-parallel shard (TP8) of Kimi-K3's MoE layer (docs/formats.md): the `MoESpec`
#: fields of the reference geometry, K=4 mcg weights, bf16 in, fp32 out, SiTU.
REFERENCE_LAYER = {
    "num_experts": 896,
    "hidden": 3584,
    "intermediate": 384,
    "topk": 16,
    "bits": 4,
    "codebook": "mcg",
    "act_dtype": "bfloat16",
    "out_dtype": "float32",
    "activation": "situ",
    "shared_hidden_vectors": True,
    "has_expert_map": False,
}

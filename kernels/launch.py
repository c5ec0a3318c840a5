"""The fused forward's launch contract: block sizes, arguments, scratch buffers (no torch, no cutlass).

Owns what a caller must know to launch a compiled `MoEForward` object and nothing about
how it computes:

* :data:`ROUTE_BLOCK_SIZES` -- the route block sizes M the kernels are specialized for
  (the policy in `planners/policy.py` picks among them);
* :data:`ARGS` -- the entry point's arguments in order: pointers (with the dtype of the
  pointee and what they hold) and Int32 scalars; the stream comes last;
* :func:`scratch_layout` -- every scratch buffer the forward reads or writes between its
  kernels (shape, dtype, byte offset in one 256-byte-aligned arena);
* :func:`int_args` -- the Int32 arguments of one call;
* :data:`PACK_ROUTES_PER_CTA` / :func:`pack_ctas` -- the route pack's grid, which sizes
  its histogram scratch.

`kquant_cute/layer.py` allocates the arena and binds tensors to these names; it computes
no shape or size itself. Dtypes are names: ``"act"`` / ``"out"`` stand for the spec's
activation and output dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ARGS",
    "ARG_NAMES",
    "ARENA_ALIGN",
    "DTYPE_BYTES",
    "PACK_ROUTES_PER_CTA",
    "RATE_ARGS",
    "ROUTE_BLOCK_SIZES",
    "Arg",
    "ScratchBuffer",
    "ScratchLayout",
    "int_args",
    "pack_ctas",
    "scratch_layout",
]

#: Route block sizes (rows of one route block) the fused kernel is specialized for, ascending.
ROUTE_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 48, 64)

#: Routes one CTA of the route pack's two kernels owns (`kernels/route_pack.py`).
PACK_ROUTES_PER_CTA = 2048


def pack_ctas(n_routes: int) -> int:
    """CTAs of the route pack's kernels for `n_routes` routes (at least one), and so the
    rows of its per-CTA expert histogram (``route_hist``)."""
    return max(1, -(-n_routes // PACK_ROUTES_PER_CTA))


#: Bytes per element of every dtype name the contract uses.
DTYPE_BYTES = {"int32": 4, "int16": 2, "uint8": 1, "float32": 4, "float16": 2, "bfloat16": 2}

#: Every scratch buffer starts at a multiple of this many bytes of the arena.
ARENA_ALIGN = 256


@dataclass(frozen=True)
class Arg:
    """One entry-point argument: a pointer (``dtype`` = its pointee) or an Int32 (``dtype`` None).

    ``kind``: ``"input"`` (per call: x, routing), ``"weight"`` (a tensor of the layer's
    weights, same name), ``"table"`` (the codebook's tables: sqg_e4m3's uint8
    [65536] direct table per K in the spec's `bits_set` order (its one K when uniform),
    then T12 [4096]: `kquant_cute.trellis.sqg_kernel_tables`; any valid address otherwise), ``"rates"`` (a mixed
    layer's rate maps, :data:`RATE_ARGS`; any valid address for a uniform K),
    ``"scratch"`` (a buffer of :func:`scratch_layout`), ``"output"`` or ``"int"``.
    """

    name: str
    dtype: str | None
    kind: str


ARGS: tuple[Arg, ...] = (
    Arg("x", "act", "input"), Arg("topk_ids", "int32", "input"),
    Arg("topk_weights", "float32", "input"), Arg("expert_map", "int32", "input"),
    Arg("gate_trellis", "int16", "weight"), Arg("up_trellis", "int16", "weight"),
    Arg("down_trellis", "int16", "weight"),
    Arg("gate_suh", "float16", "weight"), Arg("up_suh", "float16", "weight"),
    Arg("gate_svh", "float16", "weight"), Arg("up_svh", "float16", "weight"),
    Arg("down_suh", "float16", "weight"), Arg("down_svh", "float16", "weight"),
    Arg("pre_signs", "float16", "weight"), Arg("post_signs", "float16", "weight"),
    Arg("codebook_table", "uint8", "table"),
    Arg("fc1_bits", "uint8", "rates"), Arg("fc1_words", "int32", "rates"),
    Arg("fc2_bits", "uint8", "rates"), Arg("fc2_words", "int32", "rates"),
    Arg("sorted_routes", "int32", "scratch"), Arg("block_expert", "int32", "scratch"),
    Arg("num_padded", "int32", "scratch"), Arg("expert_offsets", "int32", "scratch"),
    Arg("expert_counts", "int32", "scratch"), Arg("route_hist", "int32", "scratch"),
    Arg("xg", "float16", "scratch"), Arg("xu", "float16", "scratch"),
    Arg("g", "float32", "scratch"), Arg("u", "float32", "scratch"),
    Arg("a2", "float16", "scratch"), Arg("y", "float32", "scratch"),
    Arg("out", "out", "output"),
    Arg("m", None, "int"), Arg("max_blocks", None, "int"), Arg("rows_cap", None, "int"),
    Arg("routes_cap", None, "int"), Arg("sm_count", None, "int"),
    Arg("fc1_row_words", None, "int"),
)

#: The rate maps of a mixed-rate layer (kind ``"rates"``), E experts, I/16 tiles of the
#: intermediate axis: K per tile (``fc1_bits`` / ``fc2_bits`` uint8 [E, I/16]) and where each
#: tile's trellis starts, in 32-bit words (int32 [E, I/16]): ``fc1_words[e, j]`` indexes tile
#: (0, j) of expert e in gate_trellis / up_trellis (tile (i, j) is ``fc1_row_words`` x i
#: further), ``fc2_words[e, i]`` row tile i of expert e in down_trellis (its 16-column tiles
#: follow at 8 K words each). ``kquant_cute.mixed.MixedMoEWeights.rate_args`` builds them.
RATE_ARGS: tuple[str, ...] = tuple(a.name for a in ARGS if a.kind == "rates")

#: ``(name, dtype)`` of :data:`ARGS`, in order.
ARG_NAMES: tuple[tuple[str, str | None], ...] = tuple((a.name, a.dtype) for a in ARGS)


@dataclass(frozen=True)
class ScratchBuffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ScratchLayout:
    """The scratch buffers of one arena, in order, and the arena's size in bytes."""

    buffers: tuple[ScratchBuffer, ...]
    nbytes: int

    def __getitem__(self, name: str) -> ScratchBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)


def scratch_layout(spec, *, capacity: int, max_slots: int) -> ScratchLayout:
    """The scratch arena of a layer of `spec`'s shape (a `MoESpec`: num_experts, hidden,
    intermediate, topk, shared_hidden_vectors) serving up to `capacity` tokens whose widest
    plan packs at most `max_slots` route slots (the route pack's padded bound).

    Rows of the rotated activations are tokens (shared hidden-side vectors) or routes, plus
    one: the GEMMs' nominal zero row. The block list holds one entry per block of the
    narrowest size plus a terminator, so it serves every plan of the layer."""
    E, H, I, n = spec.num_experts, spec.hidden, spec.intermediate, capacity * spec.topk
    rows = capacity if spec.shared_hidden_vectors else n
    shapes = (
        ("sorted_routes", (max_slots,), "int32"),
        ("block_expert", (max_slots // ROUTE_BLOCK_SIZES[0] + 1,), "int32"),
        ("num_padded", (4,), "int32"),
        ("expert_offsets", (E + 1,), "int32"),
        ("expert_counts", (E,), "int32"),
        ("route_hist", (pack_ctas(n), E), "int32"),
        ("xg", (rows + 1, H), "float16"),
        ("xu", (rows + 1, H), "float16"),
        ("g", (n, I), "float32"),
        ("u", (n, I), "float32"),
        ("a2", (n + 1, I), "float16"),
        ("y", (n, H), "float32"),
    )
    buffers, off = [], 0
    for name, shape, dtype in shapes:
        off = -(-off // ARENA_ALIGN) * ARENA_ALIGN
        numel = 1
        for s in shape:
            numel *= s
        buffers.append(ScratchBuffer(name, shape, dtype, off, numel * DTYPE_BYTES[dtype]))
        off += buffers[-1].nbytes
    return ScratchLayout(tuple(buffers), -(-off // ARENA_ALIGN) * ARENA_ALIGN)


def int_args(spec, *, m: int, capacity: int, max_blocks: int, sm_count: int,
             fc1_row_words: int = 0) -> dict[str, int]:
    """The Int32 arguments of a call with `m` tokens to a layer of `spec`'s shape planned
    for `capacity`: `max_blocks` (the plan's block bound at m, which sizes the grid), the
    row capacities whose last row is the nominal zero row of the GEMMs' A operands, the
    device's SM count (the persistent grid of the table codebooks' GEMMs) and, mixed rates
    only, the 32-bit words of one FC1 trellis tile row (:data:`RATE_ARGS`)."""
    routes_cap = capacity * spec.topk
    return {"m": m, "max_blocks": max_blocks,
            "rows_cap": capacity if spec.shared_hidden_vectors else routes_cap,
            "routes_cap": routes_cap, "sm_count": sm_count, "fc1_row_words": fc1_row_words}

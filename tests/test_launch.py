"""Tests for kernels/launch.py: the entry point's arguments (ARGS), the scratch arena
(scratch_layout) and the Int32 arguments of a call (int_args)."""

from __future__ import annotations

import inspect
import itertools

import pytest

from kquant_cute.kernels.launch import (
    ARENA_ALIGN,
    ARG_NAMES,
    ARGS,
    DTYPE_BYTES,
    PACK_ROUTES_PER_CTA,
    RATE_ARGS,
    ROUTE_BLOCK_SIZES,
    int_args,
    pack_ctas,
    scratch_layout,
)
from kquant_cute.kernels.moe import MoEForward, MoESpec

KINDS = {"input", "weight", "table", "rates", "scratch", "output", "int"}


def _spec(**kw) -> MoESpec:
    fields = dict(num_experts=4, hidden=256, intermediate=128, topk=2, bits=4, codebook="mcg",
                  block_m=8, shared_hidden_vectors=True)
    fields.update(kw)
    return MoESpec(**fields)


# ---------------------------------------------------------------------------------------
# ARGS
# ---------------------------------------------------------------------------------------


def test_args_are_well_formed():
    names = [a.name for a in ARGS]
    assert len(set(names)) == len(names)
    for a in ARGS:
        assert a.kind in KINDS, a
        # Int32 scalars carry no dtype; every pointer's pointee is a known dtype or the
        # spec's activation / output dtype.
        assert (a.dtype is None) == (a.kind == "int"), a
        assert a.dtype is None or a.dtype in DTYPE_BYTES or a.dtype in ("act", "out"), a
    assert ARG_NAMES == tuple((a.name, a.dtype) for a in ARGS)
    assert RATE_ARGS == tuple(a.name for a in ARGS if a.kind == "rates")
    # Exactly one output, one table, and the activations are the "act" input.
    assert [a.name for a in ARGS if a.kind == "output"] == ["out"]
    assert [a.dtype for a in ARGS if a.name in ("x", "out")] == ["act", "out"]


def test_entry_point_takes_the_launch_contract_in_order():
    """MoEForward's arguments are ARGS in order, then the stream: the layer binds by name and
    passes them positionally (the rate maps sit between the table and the scratch)."""
    params = list(inspect.signature(MoEForward.__call__).parameters)
    assert params[1:] == [a.name for a in ARGS] + ["stream"]
    kinds = [a.kind for a in ARGS]
    assert kinds.index("table") < kinds.index("rates") < kinds.index("scratch")


def test_weight_args_are_the_weights_tensors_with_their_dtypes():
    """The layer binds each "weight" argument to the MoEWeights tensor of the same name: the
    names exist on the weights (coupled ones have the sign vectors too) and the dtypes agree."""
    torch = pytest.importorskip("torch")
    from kquant_cute.weights import MoEWeights

    w = MoEWeights.random(2, 512, 256, 2, "mcg", shared_hidden_vectors=True, seed=0,
                          coupled=True)
    assert w.coupled
    names = {"int16": torch.int16, "float16": torch.float16}
    for a in ARGS:
        if a.kind == "weight":
            t = getattr(w, a.name)
            assert t.dtype == names[a.dtype], a


# ---------------------------------------------------------------------------------------
# scratch_layout
# ---------------------------------------------------------------------------------------


def test_scratch_layout_hand_computed():
    """E=4, H=256, I=128, top-2, shared vectors, 3 tokens (6 routes), 30 route slots."""
    layout = scratch_layout(_spec(), capacity=3, max_slots=30)
    got = [(b.name, b.shape, b.dtype, b.offset, b.nbytes) for b in layout.buffers]
    assert got == [
        ("sorted_routes", (30,), "int32", 0, 120),
        ("block_expert", (4,), "int32", 256, 16),       # 30 // 8 blocks + a terminator
        ("num_padded", (4,), "int32", 512, 16),
        ("expert_offsets", (5,), "int32", 768, 20),
        ("expert_counts", (4,), "int32", 1024, 16),
        ("route_hist", (1, 4), "int32", 1280, 16),      # one pack CTA for 6 routes
        ("xg", (4, 256), "float16", 1536, 2048),        # 3 tokens + the zero row
        ("xu", (4, 256), "float16", 3584, 2048),
        ("g", (6, 128), "float32", 5632, 3072),
        ("u", (6, 128), "float32", 8704, 3072),
        ("a2", (7, 128), "float16", 11776, 1792),       # 6 routes + the zero row
        ("y", (6, 256), "float32", 13568, 6144),
    ]
    assert layout.nbytes == 19712
    # Per-expert vectors: the rotated activations have one row per route (plus zero row).
    per_route = scratch_layout(_spec(shared_hidden_vectors=False), capacity=3, max_slots=30)
    assert per_route["xg"].shape == per_route["xu"].shape == (7, 256)


@pytest.mark.parametrize("shared", [True, False])
def test_scratch_layout_properties(shared):
    for (e, h, i, k), cap, slots in itertools.product(
            ((8, 256, 256, 2), (896, 3584, 384, 16), (3, 128, 512, 3)), (1, 7, 512), (1, 9, 4000)):
        spec = _spec(num_experts=e, hidden=h, intermediate=i, topk=k, shared_hidden_vectors=shared)
        layout = scratch_layout(spec, capacity=cap, max_slots=slots)
        # Every scratch argument of the entry point is a buffer, in ARGS order, and only those.
        assert layout.names == tuple(a.name for a in ARGS if a.kind == "scratch")
        end = 0
        for b in layout.buffers:
            numel = 1
            for s in b.shape:
                numel *= s
            assert b.nbytes == numel * DTYPE_BYTES[b.dtype]
            assert b.offset % ARENA_ALIGN == 0 and b.offset >= end  # aligned, no overlap
            assert b.offset - end < ARENA_ALIGN  # and no gap beyond the alignment
            end = b.offset + b.nbytes
            assert layout[b.name] is b
        assert layout.nbytes % ARENA_ALIGN == 0 and end <= layout.nbytes < end + ARENA_ALIGN
        # The block list holds a block of the narrowest M for every slot, plus a terminator.
        assert layout["block_expert"].shape[0] * ROUTE_BLOCK_SIZES[0] > slots
        assert layout["sorted_routes"].shape == (slots,)
        # The int arguments' row capacities index the last (zero) row of the A operands.
        ints = int_args(spec, m=cap, capacity=cap, max_blocks=1, sm_count=1)
        assert layout["xg"].shape[0] == ints["rows_cap"] + 1
        assert layout["a2"].shape[0] == ints["routes_cap"] + 1
        assert layout["y"].shape == (ints["routes_cap"], h)
        # One histogram row per route pack CTA of the largest call.
        assert layout["route_hist"].shape == (pack_ctas(ints["routes_cap"]), e)
    with pytest.raises(KeyError):
        layout["out"]


def test_pack_ctas_cover_the_routes_with_at_least_one_cta():
    assert PACK_ROUTES_PER_CTA == 2048
    assert [pack_ctas(n) for n in (0, 1, 2048, 2049, 24_576, 65_536)] == [1, 1, 1, 2, 12, 32]


# ---------------------------------------------------------------------------------------
# int_args
# ---------------------------------------------------------------------------------------


def test_int_args_cover_every_int_argument_of_the_entry_point():
    """int_args gives exactly the entry point's Int32 arguments, in order (a missing or stale
    one fails only at launch on a GPU otherwise)."""
    got = int_args(_spec(num_experts=8, intermediate=256), m=5, capacity=64, max_blocks=12,
                   sm_count=132)
    assert list(got) == [a.name for a in ARGS if a.kind == "int"]
    assert got == {"m": 5, "max_blocks": 12, "rows_cap": 64, "routes_cap": 128, "sm_count": 132,
                   "fc1_row_words": 0}  # a uniform layer has no rate maps
    per_route = int_args(_spec(shared_hidden_vectors=False), m=5, capacity=64, max_blocks=12,
                         sm_count=132)
    assert per_route["rows_cap"] == per_route["routes_cap"] == 128
    mixed = int_args(_spec(codebook="sqg_e4m3", bits_set=(3, 4)), m=5, capacity=64,
                     max_blocks=12, sm_count=132, fc1_row_words=1536)
    assert mixed["fc1_row_words"] == 1536

"""CPU tests of the registered op `torch.ops.kquant.moe_forward` (kquant_cute/ops.py):
`torch.library.opcheck` on the CPU implementation (the reference math), the fake
implementation's shape and dtype contract (also with meta tensors and symbolic token
counts), the op against `reference_moe` bit for bit, and the handle registry."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import kquant_cute.ops as ops
from kquant_cute.mixed import MixedMoEWeights
from kquant_cute.reference import reference_moe
from kquant_cute.weights import MoEWeights

OP = torch.ops.kquant.moe_forward.default
H, I, E = 128, 128, 4


def _inputs(m, n_ids, topk=2, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).to(dtype)
    ids = torch.randint(0, n_ids, (m, topk), generator=g, dtype=torch.int32)
    w = torch.rand(m, topk, generator=g)
    return x, ids, w


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(E, H, I, 3, "mcg", seed=1)


def test_op_is_registered_in_the_kquant_namespace():
    schema = str(OP._schema)
    assert schema.startswith("kquant::moe_forward(Tensor x, Tensor topk_ids, Tensor topk_weights, "
                             "Tensor(a!) out, Tensor(b!) scratch, Tensor? expert_map, "
                             "int handle"), schema
    assert schema.endswith("-> ()")


@pytest.mark.parametrize("case", ["bf16", "fp32_shared", "expert_map", "no_tokens", "mixed"])
def test_opcheck_cpu_reference(weights, case):
    """torch.library.opcheck: schema (mutation and aliasing as declared), autograd
    registration, the fake implementation against the real one, and AOT dispatch with
    dynamic shapes, on each kind of call."""
    emap = None
    if case == "fp32_shared":
        w = MoEWeights.random(E, H, I, 4, "mul1", shared_hidden_vectors=True, seed=2)
        layer, (x, ids, wt) = ops.ReferenceMoELayer(w, topk=3), _inputs(7, E, 3, torch.float32)
    elif case == "expert_map":
        layer = ops.ReferenceMoELayer(weights, topk=2, num_global_experts=6)
        x, ids, wt = _inputs(6, 6)
        emap = torch.tensor([0, -1, 3, 1, -1, 2], dtype=torch.int32)
    elif case == "mixed":
        bits = torch.tensor([[3, 4, 3, 3, 4, 3, 3, 3]] * E, dtype=torch.uint8)  # per 16-row tile
        w = MixedMoEWeights.random(bits, bits.flip(1).contiguous(), H, seed=3)
        layer, (x, ids, wt) = ops.ReferenceMoELayer(w, topk=2), _inputs(5, E)
    else:
        layer = ops.ReferenceMoELayer(weights, topk=2)
        x, ids, wt = _inputs(0 if case == "no_tokens" else 9, E)
    out = torch.empty(x.shape[0], H)
    result = torch.library.opcheck(OP, (x, ids, wt, out, layer.scratch, emap, layer.handle))
    assert set(result.values()) == {"SUCCESS"}, result


def test_op_writes_reference_output_bitwise(weights):
    layer = ops.ReferenceMoELayer(weights, topk=2, num_global_experts=6)
    x, ids, wt = _inputs(11, 6, seed=5)
    ids[3, 1] = -1
    emap = torch.tensor([2, -1, 0, 3, 1, -1], dtype=torch.int32)
    out = torch.full((11, H), float("nan"))
    assert torch.ops.kquant.moe_forward(x, ids, wt, out, layer.scratch, emap, layer.handle) is None
    want = reference_moe(x, ids, wt, weights, dtype=torch.float32, expert_map=emap)
    assert torch.equal(out, want)
    assert torch.equal(layer(x, ids, wt, expert_map=emap), want)


class _Capacity:
    """A stand-in for a fused layer's op interface (capacity 8, bf16 activations)."""

    hidden, topk, act_dtype, out_dtype, capacity, num_global_experts = H, 2, torch.bfloat16, torch.float32, 8, None

    def __init__(self):
        self.handle = ops.register(self)
        self.calls = 0

    def check_scratch(self, scratch):
        if scratch.dtype != torch.uint8 or tuple(scratch.shape) != (64,):
            raise ValueError("scratch must be one of this layer's arenas (uint8 [64])")

    def op_forward(self, x, ids, wt, out, scratch, emap, *, check_ids, wait_for_previous):
        self.calls += 1
        out.zero_()


def _bad_calls(weights):
    """(description, args, error pattern) of calls the fake implementation must refuse."""
    ref = ops.ReferenceMoELayer(weights, topk=2)
    cap = _Capacity()
    x, ids, wt = _inputs(4, E)
    out, scratch = torch.empty(4, H), torch.empty(64, dtype=torch.uint8)
    return [
        ("hidden", (x[:, :64], ids, wt, out[:, :64], ref.scratch, None, ref.handle),
         r"x must be \[tokens, 128\]"),
        ("ids dtype", (x, ids.long(), wt, out, ref.scratch, None, ref.handle),
         "topk_ids has dtype torch.int64, expected torch.int32"),
        ("weights shape", (x, ids, wt[:, :1], out, ref.scratch, None, ref.handle),
         r"topk_weights must be \[4, 2\]"),
        ("out dtype", (x, ids, wt, out.half(), ref.scratch, None, ref.handle),
         "out has dtype torch.float16, expected torch.float32"),
        ("out rows", (x, ids, wt, out[:3], ref.scratch, None, ref.handle), r"out must be \[4, 128\]"),
        ("unexpected map", (x, ids, wt, out, ref.scratch, torch.zeros(4, dtype=torch.int32),
                            ref.handle), "without num_global_experts"),
        ("act dtype", (x.float(), ids, wt, out, scratch, None, cap.handle),
         "x has dtype torch.float32, expected torch.bfloat16"),
        ("capacity", (torch.empty(9, H, dtype=torch.bfloat16), ids.repeat(3, 1)[:9],
                      wt.repeat(3, 1)[:9], torch.empty(9, H), scratch, None, cap.handle),
         r"token count 9 outside 0..8"),
        ("scratch", (x, ids, wt, out, torch.empty(32, dtype=torch.uint8), None, cap.handle),
         "scratch must be one of this layer's arenas"),
        ("handle", (x, ids, wt, out, scratch, None, 10 ** 9), "no live layer under handle"),
    ], (ref, cap)


def test_fake_implementation_refuses_bad_calls_without_running(weights):
    """Under FakeTensorMode (what torch.compile traces with) and on meta tensors, bad
    shapes and dtypes raise naming the tensor; nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases, (ref, cap) = _bad_calls(weights)
    for what, args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            OP(*args)  # eager: the same checks
        with FakeTensorMode() as mode:
            fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            with pytest.raises(ValueError, match=pattern):
                OP(*fake)
        meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(ValueError, match=pattern):
            OP(*meta)
    x, ids, wt = _inputs(8, E)
    good = (x.to("meta"), ids.to("meta"), wt.to("meta"), torch.empty(8, H, device="meta"),
            torch.empty(64, dtype=torch.uint8, device="meta"), None, cap.handle)
    assert OP(*good) is None and cap.calls == 0  # the fake ran, not the layer


def test_symbolic_token_count_checks_capacity_at_run_time():
    """Compiled with a dynamic token count, the capacity bound becomes a runtime
    assertion of the graph, not a specialization."""
    cap = _Capacity()
    scratch = torch.empty(64, dtype=torch.uint8)

    def f(x, ids, wt):
        out = torch.empty(x.shape[0], H)
        torch.ops.kquant.moe_forward(x, ids, wt, out, scratch, None, cap.handle)
        return out + 1

    cf = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (3, 6):
        x, ids, wt = _inputs(m, E)
        assert torch.equal(cf(x, ids, wt), torch.ones(m, H))
    x, ids, wt = _inputs(9, E)
    with pytest.raises(Exception, match="capacity 8"):
        cf(x, ids, wt)


def test_freed_layer_leaves_a_dead_handle(weights):
    layer = ops.ReferenceMoELayer(weights, topk=2)
    handle, scratch = layer.handle, layer.scratch
    assert ops.lookup(handle) is layer
    del layer
    gc.collect()
    x, ids, wt = _inputs(2, E)
    with pytest.raises(ValueError, match=f"no live layer under handle {handle}"):
        torch.ops.kquant.moe_forward(x, ids, wt, torch.empty(2, H), scratch, None, handle)


def test_deep_copy_is_a_new_layer_under_a_new_handle(weights):
    layer = ops.ReferenceMoELayer(weights, topk=2)
    twin = copy.deepcopy(layer)
    assert twin.handle != layer.handle and ops.lookup(twin.handle) is twin
    assert twin.weights.gate_trellis is not layer.weights.gate_trellis
    x, ids, wt = _inputs(5, E, seed=9)
    assert torch.equal(twin(x, ids, wt), layer(x, ids, wt))


def test_import_registers_without_cutlass():
    import subprocess
    import sys

    code = ("import sys, torch, kquant_cute.ops; "
            "assert torch.ops.kquant.moe_forward.default is not None; "
            "assert 'cutlass' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)

"""torch.compile of transformers MoE models with trellis experts, on the CPU.

The experts call `torch.ops.kquant.moe_forward` (kquant_cute/ops.py), whose CPU
implementation is the reference math, so dynamo traces the whole model here as it does on
a GPU with the fused layer: with `fullgraph=True` (a graph break is an error), the experts
module, the MoE block and the whole model give eager's outputs bit for bit (backend
`aot_eager`: the traced aten graph, no code generation that reorders float math), the op
appears in the graph once per MoE layer, static-cache decode steps through a compiled
forward equal eager steps, and transformers' `generate` with a static cache and a compiled
forward (`CompileConfig`) gives eager's tokens. The GPU versions (inductor, CUDA graphs,
the fused kernels) are in tests/test_hf_compile_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is in the test extra: pip install -e '.[test]'")

from kquant_cute.integrations import transformers as kqt  # noqa: E402

from test_hf_integration import COMMON, _model, _random_experts  # noqa: E402

OP = torch.ops.kquant.moe_forward.default
KINDS = ["qwen3_moe", "deepseek_v3"]


class _Graphs:
    """A torch.compile backend that keeps the FX graphs it is given and runs them with
    aot_eager."""

    def __init__(self):
        self.graphs = []

    def __deepcopy__(self, memo):  # transformers deep-copies its CompileConfig
        return self

    def __call__(self, gm, example_inputs, **_):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def op_calls(self) -> list[int]:
        return [sum(1 for n in g.graph.nodes if n.target in (OP, torch.ops.kquant.moe_forward))
                for g in self.graphs]


def _replaced(kind, **over):
    model = _model(kind, **over)
    kqt.replace_experts(model, _random_experts(model), backend="reference")
    return model


def _ids(batch, n, seed=4):
    return torch.randint(0, COMMON["vocab_size"], (batch, n),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_compile_fullgraph_experts_block_and_model_equal_eager(kind):
    torch._dynamo.reset()
    model = _replaced(kind)
    block = kqt.find_moe_blocks(model)[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, COMMON["hidden_size"], generator=g)
    ids = torch.randint(0, block.num_experts, (5, block.topk), generator=g)
    w = torch.rand(5, block.topk, generator=g)
    experts = torch.compile(block.experts, fullgraph=True, backend="aot_eager")
    assert torch.equal(experts(x, ids, w), block.experts(x, ids, w))
    h = torch.randn(2, 3, COMMON["hidden_size"], generator=g)
    assert torch.equal(torch.compile(block.block, fullgraph=True, backend="aot_eager")(h),
                       block.block(h))
    prompt = _ids(2, 9)
    want = model(prompt).logits
    backend = _Graphs()
    got = torch.compile(model, fullgraph=True, backend=backend)(prompt).logits
    assert torch.equal(got, want)
    assert backend.op_calls() == [len(kqt.find_moe_blocks(model))]  # one graph, one op a layer


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_compiled_static_cache_steps_and_generate_equal_eager(kind):
    """Decode steps on a StaticCache through a fullgraph-compiled forward (what
    `mode="reduce-overhead"` captures on a GPU) equal eager steps; so do transformers'
    own compiled static-cache `generate` tokens.

    One key / value head per query head: for grouped-query attention of one query token
    transformers packs the query heads in eager mode but repeats the key / value heads
    when dynamo traces (transformers.integrations.sdpa_attention), which changes the
    logits in the last bits; that is transformers' branch, not the op's."""
    torch._dynamo.reset()
    model = _replaced(kind, num_key_value_heads=COMMON["num_attention_heads"])
    prompt = _ids(2, 8, seed=6)
    eager = kqt.GraphDecoder(model, 2, 16, graph=False)
    tok_e = [eager.prefill(prompt).argmax(-1)]
    for _ in range(4):
        tok_e.append(eager.step(tok_e[-1]).argmax(-1))
    backend = _Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    dec = kqt.GraphDecoder(model, 2, 16, graph=False, step_model=compiled)
    tok_c = [dec.prefill(prompt).argmax(-1)]  # the prefill runs eagerly, as generate's does
    logits = []
    for _ in range(4):
        logits.append(dec.step(tok_c[-1]))
        tok_c.append(logits[-1].argmax(-1))
    assert torch.equal(torch.stack(tok_c), torch.stack(tok_e))
    assert len(backend.graphs) == 1  # later steps reuse the graph: the length lives on the device
    eager_again = kqt.GraphDecoder(model, 2, 16, graph=False)
    eager_again.prefill(prompt)
    for t, lg in zip(tok_c, logits):
        assert torch.equal(eager_again.step(t), lg)

    want = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          cache_implementation="static", disable_compile=True)
    torch._dynamo.reset()  # else the step's compiled code above would serve generate's calls
    backend = _Graphs()
    cfg = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    cfg._compile_all_devices = True  # transformers compiles on CUDA only unless told
    got = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         cache_implementation="static", compile_config=cfg)
    assert torch.equal(got, want)
    assert backend.graphs and all(n == len(kqt.find_moe_blocks(model)) for n in backend.op_calls())


@torch.no_grad()
def test_deep_copied_replaced_model_owns_its_layers():
    model = _replaced("qwen3_moe")
    twin = copy.deepcopy(model)
    for a, b in zip(kqt.iter_experts(model), kqt.iter_experts(twin)):
        assert a._handle != b._handle and b.layer.weights is b.weights
    prompt = _ids(1, 5)
    want = model(prompt).logits
    del model
    assert torch.equal(twin(prompt).logits, want)

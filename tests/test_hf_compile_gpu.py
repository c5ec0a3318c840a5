"""torch.compile of transformers MoE models with the fused trellis experts, on a GPU
(marker `gpu`; skipped without one). The CPU versions, on the reference math, are in
tests/test_hf_compile.py.

Tiny random-init Qwen3-MoE and DeepSeek-V3 models (those of tests/test_hf_gpu.py, bf16)
whose experts hold random K=4 mcg codes, replaced by the fused layer:
* `torch.library.opcheck` of `torch.ops.kquant.moe_forward` on a fused `MoELayer`;
* the experts module compiled by inductor with `fullgraph=True` (also in capacity
  chunks) equals eager bit for bit;
* the whole model compiled with `fullgraph=True` (no graph break anywhere, the MoE
  blocks included) on the aot_eager backend (eager's kernels through the traced graph)
  equals eager bit for bit;
* `mode="reduce-overhead"`: transformers' `generate` with a static cache and its
  compiled forward (`CompileConfig(fullgraph=True)`: inductor, CUDA graphs through
  cudagraph trees, none skipped) gives eager's greedy tokens up to near-ties; static
  decode steps through the cudagraphs backend (eager's kernels in CUDA graphs) give
  eager's logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip(
    "transformers", reason="transformers is in the test extra: pip install -e '.[test]'")

from kquant_cute.integrations import transformers as kqt  # noqa: E402
from kquant_cute.weights import MoEWeights  # noqa: E402

from test_hf_gpu import E, H, I, TOPK, _config, _prompt  # noqa: E402

OP = torch.ops.kquant.moe_forward.default
STEPS = 16


def _model(kind, seed=0):
    """test_hf_gpu's model with one key / value head per query head: for grouped-query
    attention of one query token transformers packs the query heads in eager mode but
    repeats the key / value heads when dynamo traces (transformers.integrations.
    sdpa_attention), which moves logits in the last bits -- transformers' branch, not
    the experts'."""
    cfg = _config(kind)
    cfg.num_key_value_heads = cfg.num_attention_heads
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.cuda().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.25)
    return model


def _fused(kind, capacity=512):
    model = _model(kind)
    q = {b.experts_name: MoEWeights.random(E, H, I, 4, "mcg", seed=i, device="cuda")
         for i, b in enumerate(kqt.find_moe_blocks(model))}
    kqt.replace_experts(model, q, backend="fused", capacity=capacity, check_ids=False)
    return model


@torch.no_grad()
def test_fused_layer_opcheck():
    from kquant_cute.layer import MoELayer

    w = MoEWeights.random(E, H, I, 4, "mcg", seed=5, device="cuda")
    layer = MoELayer(w, topk=TOPK, capacity=64)
    g = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 16, 0):
        x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, E, (m, TOPK), generator=g, device="cuda", dtype=torch.int32)
        wt = torch.rand(m, TOPK, generator=g, device="cuda")
        out = torch.empty(m, H, device="cuda")
        result = torch.library.opcheck(OP, (x, ids, wt, out, layer.arena, None, layer.handle,
                                            False, False))
        assert set(result.values()) == {"SUCCESS"}, (m, result)
        # opcheck runs on copies of the arguments; the op itself writes `out`
        assert torch.ops.kquant.moe_forward(x, ids, wt, out, layer.arena, None,
                                            layer.handle) is None
        assert torch.equal(out, layer(x, ids, wt))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@torch.no_grad()
def test_compiled_fused_model_equals_eager(kind):
    torch._dynamo.reset()
    model = _fused(kind)
    chunked = _fused(kind, capacity=13)
    g = torch.Generator(device="cuda").manual_seed(2)
    for mod, m in ((kqt.find_moe_blocks(model)[0].experts, 16),
                   (kqt.find_moe_blocks(chunked)[0].experts, 37)):
        x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(m, E, generator=g, device="cuda").topk(TOPK, -1).indices
        w = torch.rand(m, TOPK, generator=g, device="cuda")
        want = mod(x, ids, w)
        assert torch.equal(torch.compile(mod, fullgraph=True)(x, ids, w), want), m
    prompt = _prompt(64, batch=2)
    want = model(prompt).logits
    aot = torch.compile(model, fullgraph=True, backend="aot_eager")(prompt).logits
    assert torch.equal(aot, want)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@torch.no_grad()
def test_compiled_static_generate_gives_eager_tokens(kind):
    """transformers' compiled static path (inductor, `mode="reduce-overhead"`): CUDA graphs
    recorded, none skipped, and every token eager's greedy choice on the same prefix up to
    a near-tie (inductor's own kernels for the attention, norms and router move logits in
    the last bits, as any compiler does; test_hf_gpu.py's rule). The cudagraphs backend
    (eager's kernels replayed from CUDA graphs) gives eager's logits bit for bit."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    from test_hf_gpu import NEAR_TIE, _decode_logits

    torch._dynamo.reset()
    counters.clear()
    model = _fused(kind)
    prompt = _prompt(24)
    n = prompt.shape[1]
    kw = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
              cache_implementation="static")
    want = model.generate(prompt, disable_compile=True, **kw)
    got = model.generate(prompt, compile_config=transformers.CompileConfig(fullgraph=True), **kw)
    skips = counters["inductor"]["cudagraph_skips"]
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    recorded = manager is not None and any(manager.roots.values())
    same = int((got[0, n:] == want[0, n:]).int().cumprod(0).sum())
    eager_logits = _decode_logits(model, prompt, got[:, n:-1])  # teacher-forced, eager
    tokens = got[0, n:]
    regret = eager_logits.max(-1).values - eager_logits.gather(-1, tokens[:, None]).squeeze(-1)
    regret = regret / eager_logits.square().mean(-1).sqrt()
    print(f"\n{kind}: compiled static generate (inductor, reduce-overhead): {same} of {STEPS} "
          f"tokens equal eager's free run, worst regret {float(regret.max()):.3g} logit RMS; "
          f"cudagraph skips {skips}, graphs recorded {recorded}")
    assert skips == 0 and recorded
    assert got.shape == want.shape and float(regret.max()) <= NEAR_TIE
    torch._dynamo.reset()
    prompt = _prompt(24, batch=2)
    eager = kqt.GraphDecoder(model, 2, n + STEPS + 1, graph=False)
    graphed = kqt.GraphDecoder(model, 2, n + STEPS + 1, graph=False,
                               step_model=torch.compile(model, fullgraph=True,
                                                        backend="cudagraphs"))
    tok = eager.prefill(prompt).argmax(-1)
    assert torch.equal(graphed.prefill(prompt).argmax(-1), tok)
    for _ in range(STEPS):
        a = eager.step(tok)
        b = graphed.step(tok)
        assert torch.equal(a, b)
        tok = a.argmax(-1)

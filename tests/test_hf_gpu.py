"""GPU checks of kquant_cute.integrations.transformers (marker `gpu`; skipped without a GPU).

Tiny random-init transformers MoE models (bf16, CUDA), experts trellis-quantized on the GPU:
* the fused model vs the same model with the dequantized experts (computed exactly, fp32),
  both on the fused model's routing decisions (`RoutingLog`; why: docs/integration.md):
  logits relative error < 2e-2 over a 256-token prompt, and 32 greedy tokens each the exact
  model's greedy choice up to a near-tie (Qwen3-MoE and DeepSeek-V3 blocks); the same
  check fails on a fused model with one wrong expert; the experts module alone vs the
  fp64 reference;
* vs the original bf16 model at K = 2, 3, 4: top-1 agreement and KL, printed (run with
  -s) and written to $KQ_HF_REPORT as JSON when set; the KL must fall with K;
* a replaced MoE block (router + fused experts) captured in a CUDA graph and replayed
  with new inputs equals the eager block bit for bit;
* whole-model decode steps on transformers' StaticCache replayed from one CUDA graph
  (`GraphDecoder`) equal eager steps on a static cache bit for bit, with no compile-cache
  lookup and no new toolkit buffer during capture and replay.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip(
    "transformers", reason="transformers is in the test extra: pip install -e '.[test]'")

from kquant_cute.integrations import transformers as kqt  # noqa: E402
from kquant_cute.weights import MoEWeights  # noqa: E402

VOCAB, H, I, E, TOPK = 512, 256, 256, 8, 2
PROMPT, STEPS = 256, 32
LOGITS_TOL = 2e-2
#: A greedy token may differ from the exact model's choice only where the exact model's
#: logit for it is within this fraction of the logits' RMS of its best logit: a near-tie,
#: several times the bf16-level noise of a difference of two logits (docs/integration.md).
NEAR_TIE = 4e-2


def _config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=512, max_position_embeddings=1024)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=64,
                                           moe_intermediate_size=I, num_experts=E,
                                           num_experts_per_tok=TOPK, norm_topk_prob=True)
    return transformers.DeepseekV3Config(
        **common, num_key_value_heads=4, moe_intermediate_size=I, n_routed_experts=E,
        n_shared_experts=1, num_experts_per_tok=TOPK, n_group=2, topk_group=1,
        first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=32)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.bfloat16)
    model = model.cuda().eval()
    with torch.no_grad():
        # Experts at unit gain (their output is a real part of the residual stream, as in
        # trained models) and logits of RMS ~4 over the 512-token vocabulary.
        for b in kqt.find_moe_blocks(model):
            b.experts.gate_up_proj.normal_(0, H ** -0.5)
            b.experts.down_proj.normal_(0, I ** -0.5)
        model.lm_head.weight.normal_(0, 0.25)
    return model


def _prompt(n, seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g).cuda()


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def quantized(request):
    base = _model(request.param)
    q = kqt.quantize_model(base, bits=4, codebook="mcg", device="cuda", seed=0)
    return request.param, base, q


def _fused(base, q, **kw):
    model = copy.deepcopy(base)
    kqt.replace_experts(model, q, backend="fused", capacity=512, **kw)
    return model


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _same_routing_logits(model, exact, ids):
    """Logits of `model` and of `exact` run on `model`'s routing decisions."""
    log = kqt.RoutingLog()
    with log.record(model):
        lm = model(ids).logits.float()
    with log.replay(exact):
        le = exact(ids).logits.float()
    return lm, le


def _decode_logits(model, prompt, tokens):
    """[1 + len(tokens), vocab] next-token logits of `prompt`, then of each of `tokens`
    fed one per step through the model's KV cache."""
    out = model(prompt, use_cache=True)
    cache = getattr(out, "cache", None)  # transformers >= 5.2x; earlier: past_key_values
    if cache is None:
        cache = out.past_key_values
    rows = [out.logits[0, -1]]
    for i in range(tokens.shape[1]):
        out = model(tokens[:, i:i + 1], use_cache=True, **{kqt.cache_kwarg(model): cache})
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def _check_against_exact(model, exact):
    """The check of `test_fused_model_matches_dequantized_model`: its measurements and the
    list of what failed (empty: passed)."""
    prompt = _prompt(PROMPT)
    lm, le = _same_routing_logits(model, exact, prompt)
    own = _rel(lm, exact(prompt).logits.float())  # each on its own routing: printed only
    rel = _rel(lm, le)
    # Greedy: the model's tokens, each judged by the exact model on the same prefix and
    # the same routing (teacher forcing: the exact model decodes the generated tokens with
    # the routing the generating steps had), so every one of the STEPS steps is checked.
    short = prompt[:, :32]
    n = short.shape[1]
    log = kqt.RoutingLog()
    with log.record(model):
        gen = model.generate(short, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    free = exact.generate(short, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    with log.replay(exact):  # generate's calls: the prompt, then one token per new token
        le_gen = _decode_logits(exact, short, gen[:, n:-1])
    tokens = gen[0, n:]
    regret = le_gen.max(-1).values - le_gen.gather(-1, tokens[:, None]).squeeze(-1)
    regret = regret / le_gen.square().mean(-1).sqrt()
    stats = {"logits_rel": rel, "logits_rel_own_routing": own,
             "greedy_exact_choice": int((regret == 0).sum()),
             "greedy_worst_regret": float(regret.max()),
             "free_running_equal_prefix": int((gen[0, n:] == free[0, n:]).int().cumprod(0).sum())}
    failed = []
    if not (torch.isfinite(lm).all() and rel < LOGITS_TOL):
        failed.append(f"logits rel err {rel:.2e} >= {LOGITS_TOL}")
    if gen.shape[1] != n + STEPS:
        failed.append(f"generated {gen.shape[1] - n} tokens, not {STEPS}")
    elif not float(regret.max()) <= NEAR_TIE:
        failed.append(f"greedy token {int(regret.argmax())} is {float(regret.max()):.3f} logit "
                      f"RMS below the exact model's choice (> {NEAR_TIE}, not a near-tie)")
    return stats, failed


@torch.no_grad()
def test_fused_model_matches_dequantized_model(quantized):
    """The fused model against the same model whose experts compute the dequantized
    weights exactly (the reference backend: fp32, equal to the dense dequantized weights
    to 1e-4 by the CPU tests), on the fused model's routing. Top-k routing is
    discontinuous: a token at a near-tie in a later layer reroutes under any numerical
    change and its output moves wholesale (docs/integration.md), so each model on its own
    routing measures near-ties, not the kernel; that figure is printed. The same model
    with the dequantized weights cast to bf16 through transformers' own experts is
    printed beside it."""
    kind, base, q = quantized
    exact = copy.deepcopy(base)
    kqt.replace_experts(exact, q, backend="reference")
    fused = _fused(base, q)
    assert all(b.experts.backend == "fused" for b in kqt.find_moe_blocks(fused))
    stats, failed = _check_against_exact(fused, exact)
    dense_bf16 = kqt.dequantize_into(copy.deepcopy(base), q)
    ld, le = _same_routing_logits(dense_bf16, exact, _prompt(PROMPT))
    stats["bf16_dense_logits_rel"] = _rel(ld, le)
    print(f"\n{kind} vs exact dequantized experts: {json.dumps(stats)}")
    assert not failed, failed


@torch.no_grad()
def test_check_fails_on_one_wrong_expert(quantized):
    """The check above, run on a fused model whose layer-0 expert 3 holds expert 4's codes
    (an indexing-class kernel bug touching one expert of eight), must fail."""
    kind, base, q = quantized
    exact = copy.deepcopy(base)
    kqt.replace_experts(exact, q, backend="reference")
    name = kqt.find_moe_blocks(base)[0].experts_name
    t = dict(q[name].tensors())
    for p in ("gate_trellis", "up_trellis", "down_trellis"):
        t[p] = t[p].clone()
        t[p][3] = t[p][4]
    wrong = _fused(base, {**q, name: MoEWeights(**t, codebook=q[name].codebook)})
    stats, failed = _check_against_exact(wrong, exact)
    print(f"\n{kind}, one wrong expert: {json.dumps(stats)}; fails: {failed}")
    assert any(f.startswith("logits") for f in failed), stats


@torch.no_grad()
def test_fused_experts_match_fp64_reference_in_chunks(quantized):
    """The replaced experts module on its own against the fp64 reference, with a capacity
    that makes the call run in three chunks (one slice start not 16-byte aligned)."""
    from kquant_cute.reference import reference_moe

    kind, base, q = quantized
    fused = copy.deepcopy(base)
    kqt.replace_experts(fused, q, backend="fused", capacity=13)
    b = kqt.find_moe_blocks(fused)[0]
    g = torch.Generator(device="cuda").manual_seed(8)
    m = 37
    x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(m, E, generator=g, device="cuda").topk(TOPK, -1).indices
    w = torch.rand(m, TOPK, generator=g, device="cuda")
    y = b.experts(x, ids, w)
    ref = reference_moe(x.double(), ids, w.double(), q[b.experts_name], dtype=torch.float64)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    rel = _rel(y, ref)
    print(f"\n{kind}: experts module vs fp64 reference rel err {rel:.2e} (3 chunks)")
    assert rel < 1e-2


@torch.no_grad()
def test_quantized_vs_bf16_agreement_by_bits():
    base = _model("qwen3_moe", seed=2)
    prompt = _prompt(PROMPT, seed=3)
    lb = base(prompt).logits.float()[0]
    logp_b = lb.log_softmax(-1)
    rows = {}
    for bits in (2, 3, 4):
        q = kqt.quantize_model(base, bits=bits, codebook="mcg", device="cuda", seed=bits)
        lf = _fused(base, q)(prompt).logits.float()[0]
        kl = float((logp_b.exp() * (logp_b - lf.log_softmax(-1))).sum(-1).mean())
        top1 = float((lf.argmax(-1) == lb.argmax(-1)).float().mean())
        rows[bits] = {"top1": top1, "kl": kl, "logits_rel": _rel(lf, lb)}
        print(f"\nK={bits}: top-1 agreement {top1:.4f}, KL {kl:.3e} nats/token, "
              f"logits rel err {rows[bits]['logits_rel']:.3e} ({PROMPT} tokens)")
    path = os.environ.get("KQ_HF_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    assert rows[2]["kl"] > rows[3]["kl"] > rows[4]["kl"] > 0
    assert rows[4]["top1"] >= rows[2]["top1"]


@torch.no_grad()
def test_replaced_block_replays_in_cuda_graph(quantized):
    kind, base, q = quantized
    fused = _fused(base, q)
    block = kqt.find_moe_blocks(fused)[0].block
    g = torch.Generator(device="cuda").manual_seed(4)
    static_x = torch.randn(4, 1, H, generator=g, device="cuda").to(torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        block(static_x)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    for seed in (5, 6):
        x = torch.randn(4, 1, H, generator=g, device="cuda").to(torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        want = block(x)
        assert torch.equal(static_out, want), (kind, seed, _rel(static_out, want))


def _toolkit_buffers(model):
    return [(len(e.layer._arenas), e.layer.arena.data_ptr(), e.layer.output.data_ptr())
            for e in kqt.iter_experts(model)]


@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_whole_model_decode_step_replays_in_cuda_graph(quantized, batch):
    """Decode steps of the whole fused model on a StaticCache, replayed from one captured
    graph, against the same steps run eagerly on a second static cache of the same size:
    the same kernels on the same shapes and inputs, so the logits must be equal bit for
    bit at every step (a replay reading a stale buffer or a position baked in at capture
    would break that), and so the greedy tokens. The capture and the replays make no
    compile-cache lookup (the cache is frozen during capture) and leave the toolkit's
    arenas and output buffers as they were."""
    from kquant_cute.compile_cache import default_cache

    kind, base, q = quantized
    fused = _fused(base, q)
    prompt, steps = _prompt(40, seed=9, batch=batch), 12
    cache_len = prompt.shape[1] + steps + 4  # masked tail positions stay in every step
    eager = kqt.GraphDecoder(fused, batch, cache_len, graph=False)
    graphed = kqt.GraphDecoder(fused, batch, cache_len)
    want_tokens, want_logits = [eager.prefill(prompt).argmax(-1)], []
    for _ in range(steps):
        want_logits.append(eager.step(want_tokens[-1]).clone())
        want_tokens.append(want_logits[-1].argmax(-1))

    buffers = _toolkit_buffers(fused)
    tok = graphed.prefill(prompt).argmax(-1)
    assert torch.equal(tok, want_tokens[0])
    info0 = default_cache().cache_info()
    for s in range(steps):
        logits = graphed.step(tok)
        assert graphed.graph is not None
        assert torch.equal(logits, want_logits[s]), (kind, batch, s, _rel(logits, want_logits[s]))
        tok = logits.argmax(-1)
        assert torch.equal(tok, want_tokens[s + 1])
    info1 = default_cache().cache_info()
    assert (info1.hits, info1.misses, info1.compiles) == (info0.hits, info0.misses, info0.compiles)
    assert info1.frozen == info0.frozen  # restored after the capture
    assert _toolkit_buffers(fused) == buffers
    # A second prompt through the same graph (the prefill resets the cache in place).
    prompt2 = _prompt(40, seed=10, batch=batch)
    first = graphed.prefill(prompt2).argmax(-1)
    e2 = eager.prefill(prompt2).argmax(-1)
    assert torch.equal(first, e2)
    assert torch.equal(graphed.step(first), eager.step(e2))
    print(f"\n{kind} batch {batch}: {steps} graph-replayed decode steps bitwise equal to eager")

"""CPU tests of kquant_cute.integrations.transformers on tiny random-init models (no downloads).

Per supported block type: the replaced block (reference backend) equals the original block
run on the dequantized dense expert weights, block by block and through the whole model
(logits and greedy generate); the quantizer path end to end; the safetensors round trip
bit-exact; bad inputs raise clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is in the test extra: pip install -e '.[test]'")

from kquant_cute.integrations import transformers as kqt  # noqa: E402
from kquant_cute.weights import MoEWeights  # noqa: E402

H, I, E, TOPK = 128, 128, 4, 2
COMMON = dict(vocab_size=96, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.05)


def _config(kind: str, **over):
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=64, intermediate_size=I,
                                          moe_intermediate_size=I, num_experts=E,
                                          num_experts_per_tok=TOPK, norm_topk_prob=True)
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 2}, intermediate_size=I, moe_intermediate_size=I, n_routed_experts=E,
            n_shared_experts=1, num_experts_per_tok=TOPK, n_group=2, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=I, moe_intermediate_size=I,
                                          shared_expert_intermediate_size=I, num_experts=E,
                                          num_experts_per_tok=TOPK)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=I, num_local_experts=E,
                                         num_experts_per_tok=TOPK)
    elif kind == "olmoe":
        cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=I, num_experts=E,
                                       num_experts_per_tok=TOPK)
    else:  # pragma: no cover
        raise AssertionError(kind)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _model(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **over))
    model.eval()
    # non-zero correction bias so DeepSeek-V3's grouped selection is really exercised
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.normal_(0, 0.1)
    return model


def _random_experts(model, bits=3, codebook="mcg", shared=False):
    return {b.experts_name: MoEWeights.random(b.num_experts, b.hidden, b.intermediate, bits,
                                              codebook, shared_hidden_vectors=shared, seed=i)
            for i, b in enumerate(kqt.find_moe_blocks(model))}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


BLOCK_KINDS = ["qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_replaced_block_equals_dequantized_dense(kind):
    model = _model(kind)
    blocks = kqt.find_moe_blocks(model)
    assert blocks and all(type(b.block).__name__ in kqt.SUPPORTED_BLOCKS for b in blocks)
    assert {(b.num_experts, b.hidden, b.intermediate, b.topk, b.activation) for b in blocks} == {
        (E, H, I, TOPK, "silu")}
    experts = _random_experts(model, shared=(kind == "deepseek_v3"))
    dense = kqt.dequantize_into(copy.deepcopy(model), experts)
    # the copy really changed: its experts now hold the dequantized weights
    b0 = kqt.find_moe_blocks(dense)[0]
    want = experts[b0.experts_name].expert(1)["up"].dense()
    torch.testing.assert_close(kqt.dense_projections(b0.experts)["up"][1], want, rtol=0, atol=0)

    names = kqt.replace_experts(model, experts, backend="reference")
    assert names == list(experts)
    new_blocks = {b.name: b for b in kqt.find_moe_blocks(model)}
    assert all(b.replaced and b.experts.backend == "reference" for b in new_blocks.values())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, H, generator=g)
    with torch.no_grad():
        for b in kqt.find_moe_blocks(dense):
            ref = b.block(x)
            out = new_blocks[b.name].block(x)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            assert _rel(out, ref) < 1e-4, b.name
        ids = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=g)
        logits_ref = dense(ids).logits
        logits = model(ids).logits
    assert _rel(logits, logits_ref) < 1e-4
    gen_ref = dense.generate(ids[:1], max_new_tokens=4, do_sample=False)
    gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen, gen_ref)


def test_reference_backend_bf16_model_returns_model_dtype():
    model = _model("qwen3_moe").to(torch.bfloat16)
    experts = _random_experts(model, bits=2)
    kqt.replace_experts(model, experts)  # auto -> reference on CPU
    b = kqt.find_moe_blocks(model)[0]
    x = torch.randn(5, H, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2]])
    w = torch.rand(5, 2, dtype=torch.bfloat16)
    y = b.experts(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (5, H)
    from kquant_cute.reference import naive_moe
    ref = naive_moe(x, ids, w.float(), experts[b.experts_name])
    assert _rel(y, ref) < 1e-2  # bf16 output rounding only


@pytest.mark.slow
def test_quantize_model_end_to_end(tmp_path, capsys):
    """quantize_model (Viterbi, CPU) -> save -> load -> replace: the replaced model equals the
    dequantized one, the file round trip is bit-exact, the codes are close to the weights."""
    # one expert and one scale candidate keep the 2^16-state search to ~3 CPU passes
    model = _model("qwen3_moe", num_hidden_layers=1, num_experts=1, num_experts_per_tok=1)
    # unit-scale experts, as in trained models' rotated weights
    torch.nn.init.normal_(model.model.layers[0].mlp.experts.gate_up_proj, std=1.0)
    torch.nn.init.normal_(model.model.layers[0].mlp.experts.down_proj, std=1.0)
    original = copy.deepcopy(model)
    q = kqt.quantize_model(model, bits=2, codebook="mcg", device="cpu", seed=3, progress=True,
                           scale_factors=(1.0,))
    assert "quantize K=2 mcg" in capsys.readouterr().err  # the progress bar
    (name, w), = q.items()
    assert name == "model.layers.0.mlp.experts" and (w.num_experts, w.bits) == (1, 2)
    # K=2 trellis distortion is ~0.07 of the weight energy: relative error ~0.27
    views = kqt.dense_projections(original.model.layers[0].mlp.experts)
    for p, d in kqt.dense_weights(w).items():
        assert 0.0 < _rel(d, views[p]) < 0.35, p

    path = tmp_path / "experts.safetensors"
    kqt.save_quantized(q, str(path))
    back = kqt.load_quantized(str(path))
    _assert_same_weights(back[name], w)

    dense = kqt.dequantize_into(original, back)
    kqt.replace_experts(model, back, backend="reference")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _rel(model(ids).logits, dense(ids).logits) < 1e-4


def _assert_same_weights(a: MoEWeights, b: MoEWeights):
    assert a.codebook == b.codebook
    for (na, ta), (nb, tb) in zip(a.tensors(), b.tensors()):
        assert na == nb and ta.dtype == tb.dtype and torch.equal(ta, tb), na


@pytest.mark.parametrize("codebook,bits,shared", [("mcg", 4, False), ("mul1", 3, True),
                                                  ("3inst", 2, False), ("sqg_e4m3", 3, True)])
def test_save_load_round_trip_bit_exact(tmp_path, codebook, bits, shared):
    q = {f"model.layers.{i}.mlp.experts": MoEWeights.random(3, 256, 128, bits, codebook,
                                                            shared_hidden_vectors=shared,
                                                            seed=i)
         for i in range(2)}
    path = str(tmp_path / "x.safetensors")
    kqt.save_quantized(q, path, metadata={"model": "tiny"})
    back = kqt.load_quantized(path)
    assert list(back) == list(q)
    for name in q:
        assert back[name].shared_hidden_vectors == shared
        _assert_same_weights(back[name], q[name])
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata()["model"] == "tiny" and f.metadata()["bits"] == str(bits)
    base = "model.layers.1.mlp.experts.2.down_proj."
    assert {base + k for k in ("trellis", "suh", "svh")} <= keys
    assert (base + "mcg" in keys) == (codebook == "mcg")
    assert (base + "mul1" in keys) == (codebook == "mul1")


def test_single_expert_keeps_per_expert_layout(tmp_path):
    w = MoEWeights.random(1, 128, 128, 3, "mcg", seed=5)
    path = str(tmp_path / "one.safetensors")
    kqt.save_quantized({"blk.experts": w}, path)
    back = kqt.load_quantized(path)["blk.experts"]
    assert not back.shared_hidden_vectors
    _assert_same_weights(back, w)


def test_load_plain_exl3_file_without_header(tmp_path):
    """A checkpoint with only EXL3 tensors (no kquant header): blocks come from the names,
    the codebook from the markers."""
    from safetensors.torch import load_file, save_file

    q = {"model.layers.3.mlp.experts": MoEWeights.random(2, 128, 256, 4, "mul1", seed=2)}
    src = str(tmp_path / "a.safetensors")
    kqt.save_quantized(q, src)
    plain = str(tmp_path / "b.safetensors")
    save_file(load_file(src), plain)  # same tensors, no metadata
    back = kqt.load_quantized(plain)
    _assert_same_weights(back["model.layers.3.mlp.experts"], q["model.layers.3.mlp.experts"])


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def test_model_without_moe_block_is_rejected():
    cfg = transformers.LlamaConfig(**COMMON, intermediate_size=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no supported sparse MoE block"):
        kqt.find_moe_blocks(model)


def test_unsupported_block_type_is_named():
    class MyMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(H, E)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(H, H) for _ in range(E)])

    model = _model("qwen3_moe")
    model.model.layers[1].mlp = MyMoE()
    with pytest.raises(ValueError, match=r"unsupported MoE block type\(s\): model.layers.1.mlp \(MyMoE\)"):
        kqt.find_moe_blocks(model)


def test_unsupported_expert_features_are_named():
    with pytest.raises(ValueError, match="activation 'gelu' is not supported"):
        kqt.find_moe_blocks(_model("qwen3_moe", hidden_act="gelu"))
    model = _model("qwen3_moe")
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: .* uses has_bias"):
        kqt.find_moe_blocks(model)


def test_geometry_not_multiple_of_128_is_rejected():
    model = _model("mixtral", intermediate_size=192)
    with pytest.raises(ValueError, match="expert intermediate size 192 is not a multiple of 128"):
        kqt.find_moe_blocks(model)


def test_mismatched_or_missing_experts_are_rejected():
    model = _model("qwen3_moe")
    good = _random_experts(model)
    names = list(good)
    bad = dict(good)
    bad[names[0]] = MoEWeights.random(E + 1, H, I, 3, "mcg")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: quantized experts have "
                                         r"\(E, H, I\) = \(5, 128, 128\), the model's block \(4, 128, 128\)"):
        kqt.replace_experts(model, bad)
    bad[names[0]] = MoEWeights.random(E, H, 256, 3, "mcg")
    with pytest.raises(ValueError, match=r"\(4, 128, 256\)"):
        kqt.dequantize_into(model, bad)
    with pytest.raises(ValueError, match="no quantized experts for model.layers.1.mlp.experts"):
        kqt.replace_experts(model, {names[0]: good[names[0]]})
    with pytest.raises(ValueError, match="no supported MoE block has experts at model.layers.7"):
        kqt.replace_experts(model, {**good, "model.layers.7.mlp.experts": good[names[0]]})
    with pytest.raises(TypeError, match="must be a MoEWeights"):
        kqt.replace_experts(model, {**good, names[0]: "codes"})
    with pytest.raises(ValueError, match="backend 'triton'"):
        kqt.replace_experts(model, good, backend="triton")
    with pytest.raises(ValueError, match="backend 'fused' needs weights on a CUDA device"):
        kqt.replace_experts(model, good, backend="fused")
    # nothing was replaced by the refused calls
    assert not any(b.replaced for b in kqt.find_moe_blocks(model))
    kqt.replace_experts(model, good)
    with pytest.raises(ValueError, match="already replaced"):
        kqt.replace_experts(model, good)
    with pytest.raises(ValueError, match="already replaced, nothing dense to quantize"):
        kqt.quantize_model(model, progress=False)


def test_replaced_experts_reject_bad_call_shapes():
    model = _model("qwen3_moe")
    kqt.replace_experts(model, _random_experts(model))
    experts = kqt.find_moe_blocks(model)[0].experts
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match=r"hidden_states must be \[tokens, 128\]"):
        experts(torch.randn(3, H + 1), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"top_k_index must be \[3, 2\], got \(3, 3\)"):
        experts(x, torch.zeros(3, 3, dtype=torch.long), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        experts(x, torch.full((3, 2), 4), torch.ones(3, 2))


def test_load_reports_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    q = {"m.experts": MoEWeights.random(2, 128, 128, 2, "mcg", seed=1)}
    path = str(tmp_path / "a.safetensors")
    kqt.save_quantized(q, path)
    tensors = load_file(path)
    del tensors["m.experts.1.up_proj.trellis"]
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="missing tensor m.experts.1.up_proj.trellis"):
        kqt.load_quantized(path)
    with pytest.raises(ValueError, match="one codebook and K per file"):
        kqt.save_quantized({"a": q["m.experts"], "b": MoEWeights.random(2, 128, 128, 3, "mcg")},
                           str(tmp_path / "c.safetensors"))


# --------------------------------------------------------------------------------------
# Routing record / replay
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_replayed_routing_reproduces_the_recorded_model(kind):
    """A model whose routers are redrawn, fed the routing recorded from the original,
    computes exactly the original's logits and greedy tokens (its own routing gives other
    logits): the replay replaces the router's decisions and nothing else."""
    model = _model(kind)
    kqt.replace_experts(model, _random_experts(model), backend="reference")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for b in kqt.find_moe_blocks(other):
            b.block.gate.weight.normal_(0, 1.0)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    log = kqt.RoutingLog()
    with torch.no_grad():
        with log.record(model):
            want = model(ids).logits
        assert len(log) == len(kqt.find_moe_blocks(model))
        assert _rel(other(ids).logits, want) > 1e-2
        with log.replay(other):
            got = other(ids).logits
        assert torch.equal(got, want)
        with log.replay(other):  # the log is not consumed
            assert torch.equal(other(ids).logits, want)
    glog = kqt.RoutingLog()
    with glog.record(model):
        gen = model.generate(ids[:1], max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with glog.replay(other):
        assert torch.equal(other.generate(ids[:1], max_new_tokens=5, min_new_tokens=5,
                                          do_sample=False), gen)


def test_routing_replay_rejects_other_calls():
    model = _model("qwen3_moe")
    kqt.replace_experts(model, _random_experts(model), backend="reference")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(5))
    log = kqt.RoutingLog()
    with torch.no_grad():
        with log.record(model):
            model(ids)
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: call 1 has 5 tokens, "
                                             r"the recorded one 6"):
            with log.replay(model):
                model(ids[:, :5])
        with pytest.raises(ValueError, match=r"call 2 past the 1 recorded"):
            with log.replay(model):
                model(ids)
                model(ids)
        with pytest.raises(ValueError, match=r"recorded calls not replayed: model.layers.0.mlp.experts 0 of 1"):
            with log.replay(model):
                pass
        with pytest.raises(ValueError, match="the log has routing for model.layers.0"):
            with log.replay(_model("deepseek_v3")):
                pass
    # the hooks are gone after every exit
    assert not any(b.experts._forward_pre_hooks for b in kqt.find_moe_blocks(model))


# --------------------------------------------------------------------------------------
# Static-cache decode steps (GraphDecoder; the CUDA-graph replay itself is a GPU test)
# --------------------------------------------------------------------------------------


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records torch calls that read tensor data on the host (a sync on CUDA, an error
    inside a CUDA-graph capture); paused inside the experts modules, whose CPU reference
    gathers routes on the host (the fused forward on CUDA reads nothing: GPU tests)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
             "nonzero", "unique", "unique_consecutive", "masked_select", "argwhere",
             "bincount", "repeat_interleave", "cpu", "__format__", "__repr__"}

    def __init__(self, model):
        super().__init__()
        self.hits, self.paused = [], 0
        self.handles = []
        for e in kqt.iter_experts(model):
            self.handles.append(e.register_forward_pre_hook(lambda *a: self._pause(1)))
            self.handles.append(e.register_forward_hook(lambda *a: self._pause(-1)))

    def _pause(self, d):
        self.paused += d

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else ()
        bool_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                         for i in (index if isinstance(index, tuple) else (index,)))
        if not self.paused and (name in self.NAMES or bool_index):
            self.hits.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_static_cache_decode_step_reads_nothing_on_host(kind):
    """What makes a whole-model step capturable: outside the experts, a one-token step on
    the StaticCache reads no tensor data on the host.
    Eager static-cache steps, after a rewound warm-up, give generate's greedy tokens."""
    model = _model(kind)
    kqt.replace_experts(model, _random_experts(model), backend="reference")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(6))
    dec = kqt.GraphDecoder(model, 2, 16, graph=False)
    with torch.no_grad():
        logits = dec.prefill(ids)
        with _HostReads(model) as guard:
            bool(logits.sum() > 0)
            int(ids[0, 0])
        assert guard.hits == ["__bool__", "__int__"]  # the guard sees host reads
        with _HostReads(model) as guard:
            step = dec.step(logits.argmax(-1))
        assert guard.hits == [], guard.hits
        assert step.shape == (2, COMMON["vocab_size"])
        toks = [dec.prefill(ids).argmax(-1)]
        dec._warm_up()  # what the capture runs first: its cache writes must be rewound
        for _ in range(5):
            toks.append(dec.step(toks[-1]).argmax(-1))
    want = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(torch.stack(toks, 1), want[:, 8:])
    with pytest.raises(RuntimeError, match="the 16-token cache is full"):
        for _ in range(8):
            dec.step(toks[-1])
    with pytest.raises(ValueError, match="graph=True needs the model on a CUDA device"):
        kqt.GraphDecoder(model, 2, 16)
    with pytest.raises(ValueError, match=r"input_ids must be \[2, tokens\]"):
        dec.prefill(ids[:1])

"""Trellis-quantize the experts of a small random-init transformers MoE model and generate.

Builds a Qwen3-MoE (or, with --arch deepseek_v3, a DeepSeek-V3) model from a config (no
download), quantizes its routed experts with the Viterbi quantizer (progress bar), saves
them as EXL3-named safetensors, reloads them, swaps them in (the fused kernel on a GPU,
the torch reference on the CPU), then generates --new-tokens greedy tokens with the bf16
experts and with the trellis experts and prints prefill / decode tokens/s and how many
generated tokens agree.

    python examples/hf_trellis_generate.py [--bits 4] [--codebook mcg] [--arch qwen3_moe]

(On a CPU the Viterbi search takes seconds per matrix: shrink the model, e.g. --layers 1
--experts 4 --topk 2 --hidden 128 --intermediate 128 --new-tokens 8.)
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import torch
import transformers

from kquant_cute.integrations import transformers as kqt


def build(args, device: str, dtype: torch.dtype):
    common = dict(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=8, intermediate_size=2 * args.hidden,
                  max_position_embeddings=2048)
    if args.arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_key_value_heads=4, head_dim=64,
                                          moe_intermediate_size=args.intermediate,
                                          num_experts=args.experts, num_experts_per_tok=args.topk,
                                          norm_topk_prob=True)
    else:
        cfg = transformers.DeepseekV3Config(
            **common, num_key_value_heads=8, moe_intermediate_size=args.intermediate,
            n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=args.topk,
            n_group=4, topk_group=2,
            first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=64)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # experts at unit gain so they matter to the output
        for b in kqt.find_moe_blocks(model):
            b.experts.gate_up_proj.normal_(0, b.hidden ** -0.5)
            b.experts.down_proj.normal_(0, b.intermediate ** -0.5)
            b.block.gate.weight.normal_(0, 0.2)  # sharper routing than the default init
        model.lm_head.weight.normal_(0, 0.25)
    return model.eval()


def generate(model, prompt, new_tokens, device):
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        model(prompt, use_cache=False)  # prefill alone, for its rate
        sync()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
        sync()
        total = time.perf_counter() - t0
    decode = max(total - prefill, 1e-9)
    return out[:, prompt.shape[1]:], prompt.numel() / prefill, (new_tokens - 1) * prompt.shape[0] / decode


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--out", default=None, help="safetensors path (default: a temp file)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"device {device}, transformers {transformers.__version__}")

    model = build(args, device, dtype)
    blocks = kqt.find_moe_blocks(model)
    print(f"{len(blocks)} sparse MoE blocks ({type(blocks[0].block).__name__}): "
          f"E={blocks[0].num_experts} H={blocks[0].hidden} I={blocks[0].intermediate} "
          f"top-{blocks[0].topk}")

    t0 = time.perf_counter()
    q = kqt.quantize_model(model, bits=args.bits, codebook=args.codebook, device=device)
    n = sum(b.num_experts for b in blocks)
    sec = time.perf_counter() - t0
    print(f"quantized {n} experts in {sec:.1f} s ({n / sec:.2f} experts/s)")

    path = args.out or os.path.join(tempfile.mkdtemp(), "experts.safetensors")
    kqt.save_quantized(q, path)
    q = kqt.load_quantized(path, device=device)
    print(f"saved and reloaded {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")

    trellis = copy.deepcopy(model)
    kqt.replace_experts(trellis, q)  # fused on CUDA, reference on the CPU
    print("backend:", next(kqt.iter_experts(trellis)).backend)

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=g).to(device)
    generate(trellis, prompt[:, :8], 2, device)  # warm-up (first launches, caches)
    generate(model, prompt[:, :8], 2, device)
    ref, pre_b, dec_b = generate(model, prompt, args.new_tokens, device)
    out, pre_t, dec_t = generate(trellis, prompt, args.new_tokens, device)
    same = int((ref == out).sum())
    first = int((ref != out).nonzero()[0, 1]) if same < ref.numel() else ref.shape[1]
    print(f"{'experts':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    print(f"{'bf16' if dtype == torch.bfloat16 else 'fp32':<10} {pre_b:>14,.0f} {dec_b:>13,.1f}")
    print(f"{'trellis':<10} {pre_t:>14,.0f} {dec_t:>13,.1f}")
    print(f"greedy agreement: {same}/{ref.numel()} tokens, identical for the first {first}")


if __name__ == "__main__":
    main()

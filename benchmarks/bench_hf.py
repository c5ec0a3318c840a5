"""A transformers model with trellis experts, end to end: bf16 experts (transformers' own
experts path) vs the fused kernel, same model; plus the quantizer's throughput.

The model: transformers' DeepSeek-V3 architecture sized like one Kimi-K3 TP8 shard per MoE
layer (896 routed experts, hidden 3584, expert intermediate 384, top-16, one shared expert
of 384, 8 attention heads), `--layers` MoE layers, random init. Its experts take random
trellis codes (shared hidden-side vectors, as Kimi-K3 stores them); the bf16 side runs
their exact dense dequantization, so both sides compute the same function.

Measured (CUDA events, median over repeats after warm-up; eager PyTorch unless stated):
* prefill of `--prefill` tokens at batch 1 (one forward, no cache): ms and tokens/s;
* decode at batch 1 and 16: one token per sequence per step on a `--context`-token
  DynamicCache: ms per step and tokens/s;
* decode at batch 1 and 16 with the whole step replayed from one CUDA graph on a
  StaticCache of `--context` + `--decode-steps` tokens (`kqt.GraphDecoder`; the first step
  captures, the rest are timed): ms per step and tokens/s;
* the experts module alone (what the integration replaces) at 1, 16 and the prefill
  token count;
* the fused model's logits vs the bf16 model's over the prefill prompt (relative error);
* `quantize_experts`-style Viterbi on `--quant-experts` experts: experts/s.

    python3 benchmarks/bench_hf.py [--layers 2] [--json FILE] [--graph-only] [--compile]

(`--graph-only`: only the CUDA-graph decode rows and the logits comparison; no quantizer.)
(`--compile`: the fused model only, decode steps at batch 1 and 16 two ways on a
StaticCache of `--context` + `--decode-steps` tokens: `kqt.GraphDecoder` (one captured
graph per step) against the forward compiled by `torch.compile(fullgraph=True,
mode="reduce-overhead")` (transformers' compiled static path: inductor and cudagraph
trees), ms per step, compile + capture time, and whether both give the same greedy
tokens from the same context. `--compile-backend aot_eager --compile-mode none
--device cpu` smoke-runs it on the CPU.)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time

import torch


DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _ms(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        if DEVICE != "cuda":  # --device cpu: a smoke run of the script, not a measurement
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def random_experts(num_experts, hidden, inter, bits, codebook, seed):
    """Random trellis codes generated on the GPU (MoEWeights.random builds them on the
    CPU, expert by expert: minutes at this size), with MoEWeights.random's vector scales."""
    from kquant_cute import trellis as tc
    from kquant_cute.weights import MoEWeights

    device = DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    rms = float(tc.codebook_lut(codebook, bits).square().mean().sqrt())

    def codes(rows, cols):
        return torch.randint(-0x8000, 0x8000, (num_experts, rows // 16, cols // 16, 16 * bits),
                             generator=g, device=device, dtype=torch.int16)

    def vec(shape, magnitude):
        sign = torch.randint(0, 2, shape, generator=g, device=device).float() * 2 - 1
        mag = torch.rand(shape, generator=g, device=device) * 0.5 + 0.75
        return (sign * mag * magnitude).half()

    return MoEWeights(gate_trellis=codes(hidden, inter), up_trellis=codes(hidden, inter),
                      down_trellis=codes(inter, hidden),
                      gate_suh=vec((hidden,), 1.0), up_suh=vec((hidden,), 1.0),
                      gate_svh=vec((num_experts, inter), 1 / (math.sqrt(hidden) * rms)),
                      up_svh=vec((num_experts, inter), 1 / (math.sqrt(hidden) * rms)),
                      down_suh=vec((num_experts, inter), 1.0),
                      down_svh=vec((hidden,), 1 / (math.sqrt(inter) * rms)),
                      codebook=codebook)


def build_model(args):
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=args.experts,
        n_shared_experts=1, num_experts_per_tok=args.topk, n_group=1, topk_group=1,
        first_k_dense_replace=0, norm_topk_prob=True, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(args.bf16_impl)
    else:  # pragma: no cover - older transformers
        model.config._experts_implementation = args.bf16_impl
    return model


def time_graph_decode(model, args):
    """Whole-model decode steps replayed from one CUDA graph (eager static-cache steps
    with --device cpu, a smoke run)."""
    from kquant_cute.integrations import transformers as kqt

    gen = torch.Generator(device=DEVICE).manual_seed(13)
    out = {}
    for batch in args.decode_batch:
        ctx = torch.randint(0, args.vocab, (batch, args.context), generator=gen, device=DEVICE)
        dec = kqt.GraphDecoder(model, batch, args.context + args.decode_steps + 1,
                               graph=DEVICE == "cuda")
        try:
            with torch.no_grad():
                nxt = dec.prefill(ctx).argmax(-1)
                nxt = dec.step(nxt).argmax(-1)  # the first step captures
                steps = []
                for _ in range(args.decode_steps - 1):
                    def step():
                        nonlocal nxt
                        nxt = dec.step(nxt).argmax(-1)
                    steps.append(_ms(step, 1, warmup=0))
        except Exception as exc:  # report the failure, keep the other rows
            out[f"graph_b{batch}"] = {"batch": batch, "error": f"{type(exc).__name__}: {exc}"}
            print(f"graph decode b{batch} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            del dec
        ms = statistics.median(steps)
        out[f"graph_b{batch}"] = {"batch": batch, "ms": ms, "tok_s": batch / ms * 1e3}
    return out


def time_compiled_decode(model, args):
    """GraphDecoder steps against steps of the compiled forward, both from the same
    context and greedy tokens (the first GraphDecoder step captures; the compiled
    forward's first two steps compile, warm up and record, timed together)."""
    from kquant_cute.integrations import transformers as kqt

    mode = None if args.compile_mode == "none" else args.compile_mode
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    out = {}
    for batch in args.decode_batch:
        ctx = torch.randint(0, args.vocab, (batch, args.context), generator=gen, device=DEVICE)
        length = args.context + args.decode_steps + 1
        row = {"batch": batch}
        with torch.no_grad():
            dec = kqt.GraphDecoder(model, batch, length, graph=DEVICE == "cuda")
            tok = dec.prefill(ctx).argmax(-1)
            graph_tokens, graph_ms = [], []
            first = dec.step(tok)  # captures
            first_graph = first.float().clone()
            tok = first.argmax(-1)
            graph_tokens.append(tok)
            for _ in range(args.decode_steps - 1):
                def step():
                    nonlocal tok
                    tok = dec.step(tok).argmax(-1)
                graph_ms.append(_ms(step, 1, warmup=0))
                graph_tokens.append(tok)
            del dec
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend=args.compile_backend,
                                     mode=mode)
            dec = kqt.GraphDecoder(model, batch, length, graph=False, step_model=compiled)
            tok = dec.prefill(ctx).argmax(-1)
            _sync()
            t0 = time.perf_counter()
            comp_tokens = []
            for i in range(2):  # compile; warm up and record (cudagraph trees)
                logits = dec.step(tok)
                if i == 0:  # same context and token as the GraphDecoder's first step
                    row["first_step_logits_rel"] = float(
                        (logits.float() - first_graph).norm() / first_graph.norm())
                tok = logits.argmax(-1)
                comp_tokens.append(tok)
            _sync()
            row["compile_s"] = time.perf_counter() - t0
            comp_ms = []
            for _ in range(args.decode_steps - 2):
                def step():
                    nonlocal tok
                    tok = dec.step(tok).argmax(-1)
                comp_ms.append(_ms(step, 1, warmup=0))
                comp_tokens.append(tok)
            del dec, compiled
        eq = torch.stack(graph_tokens) == torch.stack(comp_tokens)  # [steps, batch]
        row.update(graph_ms=statistics.median(graph_ms), compiled_ms=statistics.median(comp_ms),
                   steps=args.decode_steps,
                   tokens_equal_prefix=int(eq.all(-1).int().cumprod(0).sum()),
                   first_step_tokens_equal=int(eq[0].sum()))
        out[f"b{batch}"] = row
        print(f"decode b{batch}: GraphDecoder {row['graph_ms']:.3f} ms/step, compiled "
              f"({args.compile_backend}, {args.compile_mode}) {row['compiled_ms']:.3f} ms/step, "
              f"compile+record {row['compile_s']:.1f} s, greedy tokens equal for "
              f"{row['tokens_equal_prefix']} of {args.decode_steps} steps (first step: "
              f"{row['first_step_tokens_equal']} of {batch} sequences, logits rel "
              f"{row['first_step_logits_rel']:.2e})", flush=True)
    return out


def compile_main(model, experts, args, info):
    from torch._dynamo.utils import counters

    from kquant_cute.integrations import transformers as kqt

    t0 = time.perf_counter()
    kqt.replace_experts(model, experts, backend="fused" if DEVICE == "cuda" else "reference",
                        capacity=args.prefill, check_ids=False)
    _sync()
    build_s = time.perf_counter() - t0
    res = time_compiled_decode(model, args)
    skips = counters["inductor"]["cudagraph_skips"]
    print(f"\nfused layers built in {build_s:.1f} s; cudagraph skips {skips}\n")
    print(f"| decode | GraphDecoder (ms/step) | torch.compile {args.compile_mode} (ms/step) | "
          "ratio | compile + record | greedy tokens equal |")
    print("|---|---|---|---|---|---|")
    for row in res.values():
        print(f"| batch {row['batch']} | {row['graph_ms']:.3f} ({row['batch'] / row['graph_ms'] * 1e3:,.0f} "
              f"tok/s) | {row['compiled_ms']:.3f} ({row['batch'] / row['compiled_ms'] * 1e3:,.0f} tok/s) | "
              f"{row['graph_ms'] / row['compiled_ms']:.2f}x | {row['compile_s']:.1f} s | "
              f"{row['tokens_equal_prefix']} of {row['steps']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "compile": res, "cudagraph_skips": skips,
                       "fused_build_s": build_s}, f, indent=1)
    return 0


def time_model(model, args, kv):
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    out = {}
    prompt = torch.randint(0, args.vocab, (1, args.prefill), generator=gen, device=DEVICE)
    with torch.no_grad():
        logits = model(prompt[:, :512], use_cache=False).logits.float()
    if args.graph_only:
        return time_graph_decode(model, args), logits
    with torch.no_grad():
        ms = _ms(lambda: model(prompt, use_cache=False), args.iters)
        out["prefill"] = {"tokens": args.prefill, "ms": ms, "tok_s": args.prefill / ms * 1e3}
        for batch in args.decode_batch:
            ctx = torch.randint(0, args.vocab, (batch, args.context), generator=gen, device=DEVICE)
            # Two identical passes, the first thrown away: every cache length is a new set
            # of attention shapes, whose first launches (library heuristics, lazy kernel
            # loads) would otherwise be charged to whichever model runs first.
            for _ in range(2):
                res = model(ctx, use_cache=True)
                cache = getattr(res, "cache", None)
                if cache is None:  # transformers < 5.2x names it past_key_values
                    cache = res.past_key_values
                nxt = res.logits[:, -1:].argmax(-1)
                steps = []
                for _ in range(args.decode_steps):
                    def step():
                        nonlocal nxt
                        r = model(nxt, use_cache=True, **{kv: cache})
                        nxt = r.logits[:, -1:].argmax(-1)
                    steps.append(_ms(step, 1, warmup=0))
            ms = statistics.median(steps)
            out[f"decode_b{batch}"] = {"batch": batch, "ms": ms, "tok_s": batch / ms * 1e3}
    out.update(time_graph_decode(model, args))
    return out, logits


def time_experts(experts, args):
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    out = {}
    with torch.no_grad():
        for m in (1, 16, args.prefill):
            x = torch.randn(m, args.hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
            ids = torch.rand(m, args.experts, generator=gen, device=DEVICE).topk(args.topk, -1).indices
            w = torch.rand(m, args.topk, generator=gen, device=DEVICE)
            w = w / w.sum(-1, keepdim=True)
            out[m] = _ms(lambda: experts(x, ids, w), args.iters)
    return out


def quantizer_throughput(dense_views, args):
    from kquant_cute.weights import TrellisLinear

    gen = torch.Generator().manual_seed(0)
    n = args.quant_experts
    if n < 1:
        return {"experts": 0, "seconds": 0.0, "experts_per_s": float("nan")}

    def one(e):
        for p in ("gate", "up", "down"):
            TrellisLinear.from_dense(dense_views[p][e], args.bits, args.codebook,
                                     generator=gen, device=DEVICE)
    one(0)  # warm-up (LUT, Hadamard caches)
    _sync()
    t0 = time.perf_counter()
    for e in range(1, n + 1):
        one(e)
    _sync()
    sec = time.perf_counter() - t0
    return {"experts": n, "seconds": sec, "experts_per_s": n / sec}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--prefill", type=int, default=1536)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--quant-experts", type=int, default=4)
    p.add_argument("--bf16-impl", default="grouped_mm",
                   help="transformers experts implementation of the bf16 side")
    p.add_argument("--json", default=None)
    p.add_argument("--graph-only", action="store_true",
                   help="only the CUDA-graph decode rows (and the logits comparison)")
    p.add_argument("--device", default="cuda", help="cpu: smoke-run the script (reference backend)")
    p.add_argument("--compile", action="store_true",
                   help="fused model only: GraphDecoder steps vs a torch.compile'd forward")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--compile-mode", default="reduce-overhead", help="'none': torch's default")
    args = p.parse_args(argv)
    if args.graph_only:
        args.quant_experts = 0
    global DEVICE
    DEVICE = args.device

    import transformers

    from kquant_cute.integrations import transformers as kqt

    t0 = time.perf_counter()
    model = build_model(args)
    blocks = kqt.find_moe_blocks(model)
    experts = {b.experts_name: random_experts(args.experts, args.hidden, args.intermediate,
                                              args.bits, args.codebook, seed=i)
               for i, b in enumerate(blocks)}
    if args.compile:  # the fused side only: no dense dequantization
        info = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                "torch": torch.__version__, "transformers": transformers.__version__,
                "args": vars(args)}
        print(f"# {info['gpu']}, torch {info['torch']}, transformers {info['transformers']}, "
              f"{args.layers} MoE layers E={args.experts} H={args.hidden} I={args.intermediate} "
              f"top-{args.topk} K={args.bits} {args.codebook}", flush=True)
        return compile_main(model, experts, args, info)
    kqt.dequantize_into(model, experts)
    _sync()
    setup = time.perf_counter() - t0
    kv = kqt.cache_kwarg(model)
    info = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "bf16_impl": args.bf16_impl,
            "args": vars(args), "setup_s": setup}
    print(f"# {info['gpu']}, torch {info['torch']}, transformers {info['transformers']}, "
          f"{args.layers} MoE layers E={args.experts} H={args.hidden} I={args.intermediate} "
          f"top-{args.topk} K={args.bits} {args.codebook}; setup {setup:.1f} s", flush=True)

    bf16_experts = blocks[0].experts
    res_bf16, logits_bf16 = time_model(model, args, kv)
    exp_bf16 = {} if args.graph_only else time_experts(bf16_experts, args)
    print("bf16 done", json.dumps(res_bf16), flush=True)

    views = kqt.dense_projections(bf16_experts)
    quant = quantizer_throughput(views, args)
    print("quantizer", json.dumps(quant), flush=True)

    t0 = time.perf_counter()
    kqt.replace_experts(model, experts, backend="fused" if DEVICE == "cuda" else "reference",
                        capacity=args.prefill, check_ids=False,
                        **({"banded": True} if DEVICE == "cuda" else {}))
    build_s = time.perf_counter() - t0
    res_fused, logits_fused = time_model(model, args, kv)
    print("fused done", json.dumps(res_fused), flush=True)
    exp_fused = {} if args.graph_only else time_experts(kqt.find_moe_blocks(model)[0].experts, args)
    rel = float((logits_fused - logits_bf16).norm() / logits_bf16.norm())
    top1 = float((logits_fused.argmax(-1) == logits_bf16.argmax(-1)).float().mean())

    rows = []
    print(f"\nfused layers built in {build_s:.1f} s (plans + compile cache); logits rel err "
          f"fused vs bf16-dequantized {rel:.2e}, top-1 agreement {top1:.4f} (512 tokens)\n")
    print("| measure | bf16 experts (transformers " + args.bf16_impl + ") | fused trellis | speedup |")
    print("|---|---|---|---|")
    for key in res_bf16:
        a, b = res_bf16[key], res_fused[key]
        label = (f"prefill {a['tokens']:,} tokens, b1" if key == "prefill"
                 else f"decode b{a['batch']}, CUDA graph (ms/step)" if key.startswith("graph")
                 else f"decode b{a['batch']} (ms/step)")
        rows.append({"measure": key, "bf16": a, "fused": b})
        if "error" in a or "error" in b:
            print(f"| {label} | {a.get('error', '')} | {b.get('error', '')} | |")
            continue
        print(f"| {label} | {a['ms']:.2f} ms ({a['tok_s']:,.0f} tok/s) | {b['ms']:.2f} ms "
              f"({b['tok_s']:,.0f} tok/s) | {a['ms'] / b['ms']:.2f}x |")
    for m in exp_bf16:
        print(f"| experts module only, {m:,} tokens | {exp_bf16[m]:.3f} ms | {exp_fused[m]:.3f} ms "
              f"| {exp_bf16[m] / exp_fused[m]:.2f}x |")
    print(f"\nquantizer (Viterbi, {args.bits} bits {args.codebook}, GPU): {quant['experts']} experts "
          f"x 3 projections in {quant['seconds']:.1f} s = {quant['experts_per_s']:.3f} experts/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "bf16": res_bf16, "fused": res_fused,
                       "experts_bf16_ms": exp_bf16, "experts_fused_ms": exp_fused,
                       "logits_rel": rel, "top1": top1, "fused_build_s": build_s,
                       "quantizer": quant}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The production QSRT layer against our mcg K=4 layer and the bf16 peer, in one run.

Issue 14's benchmark: the BRIEF's Kimi-K3 TP8 shard (E=896, H=3584, I=384, top-16, bf16
in, SiTU, shared hidden-side vectors) with
- the production QSRT profile `k2_coupled_h512_h128` (sqg_e4m3 K=2 weights and the coupled
  transforms: H512 on the latent axis, per-expert signed H128 around the activation),
- the BRIEF's mcg K=4 layer, and
- the bf16 grouped-GEMM peer (the mcg layer's weights dequantized),
all on the same routing (same tokens and top-k ids for every column), each the default
plan's choice of M, whole layer incl. route pack and top-k sum, CUDA-graph replay. Also the
decode-only ceiling of each codebook over the touched experts, and whether each layer's
output equals its M=8-only plan bitwise (none left NaN). Usage:

    python benchmarks/bench_qsrt.py [--tokens 16 128 512 1536 4096] [--iters 30] [--json F] [--png F]
    python benchmarks/bench_qsrt.py --plot-only F.json --png F.png   # plot a saved run (no GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench_moe import time_layer
from peers import Bf16GroupedMoE, DecodeCeiling, capture, graph_median_ms, random_tokens

PROFILES = {  # column -> MoEWeights.random arguments
    "mcg_k4": dict(bits=4, codebook="mcg"),
    "qsrt_k2_coupled": dict(bits=2, codebook="sqg_e4m3", coupled=True),
}


def layers_for(wts, capacity):
    """(default plan, M=8-only plan) of one layer; the second only for the bitwise check."""
    from kquant_cute.layer import MoELayer

    plan = MoELayer(wts, topk=16, capacity=capacity, activation="situ")
    m8 = MoELayer(wts, topk=16, capacity=capacity, activation="situ",
                  environ={"KQUANT_W4A16_PREFILL_BLOCK_M": "0"})
    return plan, m8


def run(tokens, iters):
    from kquant_cute.weights import MoEWeights

    rows = {m: {"tokens": m} for m in tokens}
    peer = None
    for name, kw in PROFILES.items():
        t0 = time.time()
        wts = MoEWeights.random(896, 3584, 384, shared_hidden_vectors=True, seed=0,
                                device="cuda", **kw)
        plan, m8 = layers_for(wts, max(tokens))
        decode = DecodeCeiling(wts)
        print(f"# {name}: weights + compiles in {time.time() - t0:.1f}s", flush=True)
        if name == "mcg_k4":
            peer = Bf16GroupedMoE(wts, topk=16, activation="situ")
        for m in tokens:
            row = rows[m]
            ms, block_m, out = time_layer(plan, m, iters=iters)
            _, _, out8 = time_layer(m8, m, iters=3)
            row[name] = ms
            row[f"{name}_M"] = block_m
            row[f"{name}_bitwise"] = bool(not torch.isnan(out).any() and torch.equal(out, out8))
            gen = torch.Generator(device="cuda").manual_seed(m)
            x, ids = random_tokens(m, wts.hidden, wts.num_experts, 16, gen)
            row[f"{name}_decode"] = decode.time(torch.unique(ids), iters)
            if peer is not None and "peer" not in row:
                w = torch.full((m, 16), 1 / 16, device="cuda")
                row["peer"] = graph_median_ms([capture(lambda: peer(x, ids, w))], iters)
            print(json.dumps(row), flush=True)
        del plan, m8, decode, wts
        peer = None
        torch.cuda.empty_cache()
    return [rows[m] for m in tokens]


def format_table(rows) -> list[str]:
    """Markdown table of `run` rows (pure; no GPU)."""
    head = ["tokens", "mcg K=4 (M)", "QSRT K=2 coupled (M)", "QSRT / mcg", "bf16 peer",
            "peer / QSRT", "decode-only sqg K=2", "decode-only mcg K=4", "bitwise equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        q, g = r["qsrt_k2_coupled"], r["mcg_k4"]
        eq = r["mcg_k4_bitwise"] and r["qsrt_k2_coupled_bitwise"]
        lines.append("| " + " | ".join([
            f"{r['tokens']:,}", f"{g:.3f} ({r['mcg_k4_M']})", f"{q:.3f} ({r['qsrt_k2_coupled_M']})",
            f"{q / g:.2f}x", f"{r['peer']:.3f}", f"{r['peer'] / q:.2f}x",
            f"{r['qsrt_k2_coupled_decode']:.3f}", f"{r['mcg_k4_decode']:.3f}",
            "yes" if eq else "NO"]) + " |")
    return lines


def plot(rows, path, device="") -> None:
    """Layer time per token count for the three columns, log-log (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in (("peer", "bf16 grouped-GEMM peer"), ("qsrt_k2_coupled",
                       "QSRT k2_coupled_h512_h128 (sqg_e4m3 K=2)"), ("mcg_k4", "mcg K=4")):
        ax.plot(t, [r[key] for r in rows], marker="o", label=label)
    ax.plot(t, [r["qsrt_k2_coupled_decode"] for r in rows], ls="--", color="C1",
            label="sqg_e4m3 K=2 decode-only ceiling")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("ms per layer (CUDA-graph replay)")
    ax.set_title(f"Kimi-K3 TP8 shard MoE layer {device}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 1536, 4096])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="also write a plot (needs matplotlib)")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="plot a saved --json run")
    a = p.parse_args(argv)
    if a.plot_only:
        with open(a.plot_only) as f:
            saved = json.load(f)
        print("\n".join(format_table(saved["rows"])))
        if a.png:
            plot(saved["rows"], a.png, saved.get("device", ""))
        return 0
    rows = run(a.tokens, a.iters)
    print(f"# {torch.cuda.get_device_name()}")
    print("\n".join(format_table(rows)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if a.png:
        plot(rows, a.png, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())

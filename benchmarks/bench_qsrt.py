"""The production QSRT layer against our mcg K=4 layer and the bf16 peer, in one run.

The reference geometry (docs/formats.md): the Kimi-K3 TP8 shard (E=896, H=3584, I=384, top-16, bf16
in, SiTU, shared hidden-side vectors) with
- the production QSRT profile `k2_coupled_h512_h128` (sqg_e4m3 K=2 weights and the coupled
  transforms: H512 on the latent axis, per-expert signed H128 around the activation),
- the mcg K=4 layer of the same geometry, and
- the bf16 grouped-GEMM peer (the mcg layer's weights dequantized),
- the mixed-rate pair, same shape: the mixed-rate profile `k3x22_k4x2` (sqg_e4m3 records at
  K=3 and K=4, uncoupled; rates from its placement rule, see `mixed_rate_maps`) and a
  uniform K=3 sqg_e4m3 layer,
all on the same routing (same tokens and top-k ids for every column), each the default
plan's choice of M, whole layer incl. route pack and top-k sum, CUDA-graph replay. Also the
decode-only ceiling of each uniform codebook over the touched experts, and whether each
layer's output equals its M=8-only plan bitwise (none left NaN). Usage:

    python benchmarks/bench_qsrt.py [--tokens 16 128 512 1536 4096] [--iters 30] [--json F] [--png F]
        [--columns mcg_k4 qsrt_k2_coupled sqg_k3 mixed_k3x22_k4x2] [--no-peer] [--no-decode]
    python benchmarks/bench_qsrt.py --plot-only F.json --png F.png   # plot a saved run (no GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench_moe import bound_label, layer_output, routing_sets, time_layer
from peers import Bf16GroupedMoE, DecodeCeiling, capture, graph_median_ms

E, H, I, TOPK = 896, 3584, 384, 16
PROFILES = {  # column -> MoEWeights.random arguments (None: the mixed-rate layer)
    "mcg_k4": dict(bits=4, codebook="mcg"),
    "qsrt_k2_coupled": dict(bits=2, codebook="sqg_e4m3", coupled=True),
    "sqg_k3": dict(bits=3, codebook="sqg_e4m3"),
    "mixed_k3x22_k4x2": None,
}
MIXED_LAYER = 1  # the MoE layer index the placement rule rotates by


def mixed_rate_maps(num_experts=E, intermediate=I, layer=MIXED_LAYER):
    """uint8 fc1 / fc2 maps [E, I/16] of a k3x22_k4x2 shard of `intermediate` channels: each
    expert's physical records 0 .. I/128 - 1 at their placement-rule K (`kquant_cute.qsrt.layout`). At
    the reference geometry's I = 384 that is 3 records, 1 / 9 of them K4 over the experts (the whole
    profile: 1 / 12); the uncoupled loader serves only whole record pairs (TP 1-4, 6, 12),
    so this slice is the reference shape at the profile's rates, not a loadable TP8 rank."""
    from kquant_cute.qsrt import layout as qm

    n = intermediate // 128
    maps = qm.rate_map(qm.UNCOUPLED, num_experts, layer)[:, :, :n]  # [E, fc1/fc2, records]
    return tuple(maps[:, f].repeat_interleave(8, dim=1).contiguous() for f in (0, 1))


UNIQUE = 64  # distinct random experts drawn (seeded, on the CPU), tiled to E on the GPU


def _tiled(w, e):
    """`w`'s experts repeated to `e` experts (the decode's cost does not depend on which
    codes it reads, and drawing 896 experts on the CPU took most of a run's time)."""
    from kquant_cute.weights import MoEWeights

    reps = -(-e // w.num_experts)
    fields = {}
    for name, t in [*w.tensors(), *w._optional_tensors().items()]:
        shared = name in ("gate_suh", "up_suh", "down_svh") and t.dim() == 1
        fields[name] = t if shared else t.repeat(reps, *[1] * (t.dim() - 1))[:e].contiguous()
    return MoEWeights(codebook=w.codebook, profile=w.profile, **fields)


def make_weights(name):
    from kquant_cute.mixed import MixedMoEWeights
    from kquant_cute.weights import MoEWeights

    kw = PROFILES[name]
    if kw is None:  # widest-K codes cut to each tile's K, packed on the GPU
        fc1, fc2 = (b.cuda() for b in mixed_rate_maps(E, I))
        base = _tiled(MoEWeights.random(UNIQUE, H, I, 4, "sqg_e4m3", shared_hidden_vectors=True,
                                        seed=0, device="cuda"), E)
        words = torch.arange(64, device="cuda")
        vecs = {n: t for n, t in base.tensors() if not n.endswith("_trellis")}
        return MixedMoEWeights.from_tiles(
            base.gate_trellis * (words < 16 * fc1[:, None, :, None]),
            base.up_trellis * (words < 16 * fc1[:, None, :, None]),
            base.down_trellis * (words < 16 * fc2[:, :, None, None]), fc1, fc2,
            codebook="sqg_e4m3", profile="k3x22_k4x2", **vecs)
    return _tiled(MoEWeights.random(UNIQUE, H, I, shared_hidden_vectors=True, seed=0,
                                    device="cuda", **kw), E)


def layers_for(wts, capacity):
    """(default plan, M=8-only plan) of one layer; the second only for the bitwise check."""
    from kquant_cute.layer import MoELayer

    plan = MoELayer(wts, topk=TOPK, capacity=capacity, activation="situ")
    m8 = MoELayer(wts, topk=TOPK, capacity=capacity, activation="situ",
                  environ={"KQUANT_W4A16_PREFILL_BLOCK_M": "0"})
    return plan, m8


def run(tokens, iters, columns=tuple(PROFILES), peer=True, decode=True):
    rows = {m: {"tokens": m} for m in tokens}
    for name in columns:
        t0 = time.time()
        wts = make_weights(name)
        plan, m8 = layers_for(wts, max(tokens))
        ceiling = DecodeCeiling(wts) if decode and PROFILES[name] is not None else None
        print(f"# {name}: weights + compiles in {time.time() - t0:.1f}s "
              f"({plan.plan.decode.spec.kernel_name()})", flush=True)
        bf16 = Bf16GroupedMoE(wts, topk=TOPK, activation="situ") if peer and name == "mcg_k4" else None
        for m in tokens:
            row = rows[m]
            inputs = routing_sets(plan, m)  # set 0 also feeds M=8, the decode and the peer
            t = time_layer(plan, m, iters=iters, inputs=inputs)
            out8 = layer_output(m8, *inputs[0])
            row[name] = t.ms
            row[f"{name}_sets"] = t.per_set
            row[f"{name}_M"] = bound_label(plan, m)
            row[f"{name}_bitwise"] = bool(not torch.isnan(t.out).any() and torch.equal(t.out, out8))
            x, ids, _ = inputs[0]
            if ceiling is not None:
                row[f"{name}_decode"] = ceiling.time(torch.unique(ids), iters)
            if bf16 is not None:
                w = torch.full((m, TOPK), 1 / TOPK, device="cuda")
                row["peer"] = graph_median_ms([capture(lambda: bf16(x, ids, w))], iters)
            print(json.dumps(row), flush=True)
        del plan, m8, ceiling, wts, bf16
        torch.cuda.empty_cache()
    return [rows[m] for m in tokens]


def _ms(r, key, fmt="{:.3f}"):
    return fmt.format(r[key]) if r.get(key) is not None else "-"


def _ratio(r, a, b):
    return f"{r[a] / r[b]:.2f}x" if r.get(a) is not None and r.get(b) is not None else "-"


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
            f"{q / g:.2f}x", _ms(r, "peer"), _ratio(r, "peer", "qsrt_k2_coupled"),
            _ms(r, "qsrt_k2_coupled_decode"), _ms(r, "mcg_k4_decode"),
            "yes" if eq else "NO"]) + " |")
    return lines


def format_mixed_table(rows) -> list[str]:
    """Markdown table of the mixed-rate pair (mixed k3x22_k4x2 vs uniform K=3 sqg_e4m3), with
    the other columns where the run has them (pure; no GPU)."""
    head = ["tokens", "sqg K=3 (M)", "mixed k3x22_k4x2 (M)", "mixed / K=3", "mixed / mcg K=4",
            "mixed / QSRT K=2", "decode-only sqg K=3", "bitwise equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mx = "mixed_k3x22_k4x2"
    for r in rows:
        eq = r["sqg_k3_bitwise"] and r[f"{mx}_bitwise"]
        lines.append("| " + " | ".join([
            f"{r['tokens']:,}", f"{r['sqg_k3']:.3f} ({r['sqg_k3_M']})",
            f"{r[mx]:.3f} ({r[f'{mx}_M']})", _ratio(r, mx, "sqg_k3"), _ratio(r, mx, "mcg_k4"),
            _ratio(r, mx, "qsrt_k2_coupled"), _ms(r, "sqg_k3_decode"),
            "yes" if eq else "NO"]) + " |")
    return lines


def tables(rows) -> list[str]:
    """The tables a run's columns fill (the production one, the mixed-rate pair)."""
    out = []
    if rows and "mcg_k4" in rows[0] and "qsrt_k2_coupled" in rows[0]:
        out += format_table(rows)
    if rows and "sqg_k3" in rows[0] and "mixed_k3x22_k4x2" in rows[0]:
        out += ([""] if out else []) + format_mixed_table(rows)
    return out


def plot(rows, path, device="") -> None:
    """Layer time per token count for the three columns, log-log (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in (("peer", "bf16 grouped-GEMM peer"), ("qsrt_k2_coupled",
                       "QSRT k2_coupled_h512_h128 (sqg_e4m3 K=2)"), ("mcg_k4", "mcg K=4"),
                       ("sqg_k3", "sqg_e4m3 K=3"), ("mixed_k3x22_k4x2", "mixed k3x22_k4x2 (K=3/4)")):
        if all(r.get(key) is not None for r in rows):
            ax.plot(t, [r[key] for r in rows], marker="o", label=label)
    if all(r.get("qsrt_k2_coupled_decode") is not None for r in rows):
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
    from plot_bench import save_small

    save_small(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 1536, 4096])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="also write a plot (needs matplotlib)")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="plot a saved --json run")
    p.add_argument("--columns", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    p.add_argument("--no-peer", action="store_true", help="skip the bf16 grouped-GEMM peer")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-only ceilings")
    a = p.parse_args(argv)
    if a.plot_only:
        with open(a.plot_only) as f:
            saved = json.load(f)
        print("\n".join(tables(saved["rows"])))
        if a.png:
            plot(saved["rows"], a.png, saved.get("device", ""))
        return 0
    rows = run(a.tokens, a.iters, a.columns, peer=not a.no_peer, decode=not a.no_decode)
    print(f"# {torch.cuda.get_device_name()}")
    print("\n".join(tables(rows)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if a.png:
        plot(rows, a.png, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())

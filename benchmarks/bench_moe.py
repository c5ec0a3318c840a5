"""Time the fused trellis MoE forward on the GPU with CUDA-graph replay.

Prints a table (tokens x route block M, plus the M the plan picks) for the Kimi-K3 TP8
shard of docs/formats.md, "Reference geometry" (E=896, H=3584, I=384, top-16, K=4 mcg,
bf16, SiTU, shared hidden-side vectors, balanced random routing). Each cell: the mean over
four input sets (routings) of each set's median over `--iters` graph replays, after
warm-up. Usage:

    python benchmarks/bench_moe.py [--tokens 16 128 ...] [--blocks 8 16 32] [--json FILE]

The EXL3 table of docs/benchmarks.md in one command (K=4 table, K=2 / K=3 at 16 and 1,536
tokens, peer, floors, JSON and PNG):
python benchmarks/bench_moe.py --peer --iters 30 --extra-bits 2 3 --json k4.json --png k4.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import NamedTuple

import torch

from kquant_cute.kernels.gemms import MMA_KINDS

from peers import capture, graph_median_ms, random_tokens


def bound_label(layer, m):
    """The route block M a call of m tokens binds, as "48x2" where the plan's wide rule binds
    work items of two blocks."""
    band = layer.plan.route.band_for(m)
    return f"{band.block_m}x{band.span}" if band.span else band.block_m


class LayerTime(NamedTuple):
    ms: float  # mean over the input sets of each set's median replay time
    block_m: int  # the route block M the last set bound
    out: torch.Tensor  # input set 0's output after the timing
    per_set: list  # each set's median ms


def routing_sets(layer, m, sets=4) -> list:
    """`sets` inputs (x, topk ids, normalized topk weights) of m tokens for `layer`, drawn
    from one generator seeded with m: the first `k` sets do not depend on `sets`."""
    H, topk, E = layer.weights.hidden, layer.topk, layer.weights.num_experts
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = []
    for _ in range(sets):
        x, ids = random_tokens(m, H, E, topk, gen)
        w = torch.rand(m, topk, generator=gen, device="cuda")
        inputs.append((x, ids, (w / w.sum(1, keepdim=True)).float().contiguous()))
    return inputs


def layer_output(layer, x, ids, w) -> torch.Tensor:
    """`layer`'s output on one input set (one of `routing_sets`) from one eager run (the
    output NaN-poisoned first): what `time_layer` returns as `out`, without the timing."""
    bound = layer.bind(x, ids, w)
    layer.output.fill_(float("nan"))
    bound.run()
    torch.cuda.synchronize()
    return layer.output[:x.shape[0]].clone()


def time_layer(layer, m, sets=4, iters=50, warmup=5, inputs=None) -> LayerTime:
    """`layer` at m tokens over `sets` routings drawn from one generator (or the given
    `inputs`, from `routing_sets`), each captured in a graph and timed on its own: the
    routing can change the time (how the work items fall on the SMs), and a median over
    replays that cycle the sets would land between two groups of sets and show neither."""
    if inputs is None:
        inputs = routing_sets(layer, m, sets)
    sets = len(inputs)
    graphs = []
    block_m = None
    for x, ids, w in inputs:
        bound = layer.bind(x, ids, w)
        graphs.append(capture(bound.run))
        block_m = bound.block_m
    for i in range(warmup):
        graphs[i % sets].replay()
    torch.cuda.synchronize()
    per_set = [graph_median_ms([g], iters) for g in graphs]
    layer.output.fill_(float("nan"))  # an element the replay does not write stays NaN
    graphs[0].replay()
    torch.cuda.synchronize()
    return LayerTime(statistics.mean(per_set), block_m, layer.output[:m].clone(), per_set)


def peer_and_floors(peer, wts, m, ceilings, decode=None, iters=30):
    """Graph-replayed bf16 grouped-GEMM peer time, the HBM / MMA floors and (with
    `decode`) the measured decode-only ceiling for m tokens."""
    H, I, E = wts.hidden, wts.intermediate, wts.num_experts
    gen = torch.Generator(device="cuda").manual_seed(m)
    x, ids = random_tokens(m, H, E, 16, gen)
    w = torch.full((m, 16), 1 / 16, device="cuda")
    peer_ms = graph_median_ms([capture(lambda: peer(x, ids, w))], iters)
    experts = torch.unique(ids)
    touched = experts.numel()
    extra = {"decode_floor": decode.time(experts, iters)} if decode is not None else {}
    hbm_bytes = touched * 3 * H * I * wts.bits / 8 + m * H * (2 + 4)
    flops = 2 * m * 16 * 3 * H * I
    return {"peer": peer_ms, "touched_experts": touched,
            "hbm_floor": hbm_bytes / ceilings["copy_Bps"] * 1e3,
            "mma_floor": flops / (0.75 * ceilings["bf16_flops"]) * 1e3, **extra}


def run_table(wts, tokens, blocks, *, iters, knobs, peer=None, ceilings=None, decode=None):
    """One row per token count: every pinned M, the plan pair, the banded plan and (with a
    peer) the bf16 peer and the floors. Prints each row as JSON as it completes."""
    from kquant_cute.layer import MoELayer

    rows = []
    for m in tokens:
        row = {"tokens": m}
        outs = []
        for M in blocks:
            env = {"KQUANT_W4A16_PREFILL_BLOCK_M": str(M), "KQUANT_W4A16_PREFILL_MIN_M": "8"}
            layer = MoELayer(wts, topk=16, capacity=m, activation="situ", environ=env, **knobs)
            t = time_layer(layer, m, iters=iters)
            row[f"M{M}"] = t.ms if t.block_m == M or m <= 8 else None
            outs.append(t.out)
            del layer
        layer = MoELayer(wts, topk=16, capacity=max(tokens), activation="situ", banded=False,
                         **knobs)  # the decode/prefill pair plan
        t = time_layer(layer, m, iters=iters)
        row["plan"], row["plan_M"] = t.ms, t.block_m
        outs.append(t.out)
        row["gemm"] = layer.plan.plan_for(m).spec.mma
        del layer
        layer = MoELayer(wts, topk=16, capacity=max(tokens), activation="situ",
                         **knobs)  # the default (banded) plan
        t = time_layer(layer, m, iters=iters)
        row["banded"], row["banded_sets"] = t.ms, t.per_set
        row["banded_M"] = bound_label(layer, m)
        outs.append(t.out)
        del layer
        # Every column computed the same forward: bitwise-equal outputs, none left unwritten.
        row["bitwise_equal"] = bool(not torch.isnan(outs[0]).any()
                                    and all(torch.equal(o, outs[0]) for o in outs[1:]))
        del outs
        if peer is not None:
            row.update(peer_and_floors(peer, wts, m, ceilings, decode))
        elif decode is not None:  # --decode-only: the ceiling for this m's routing alone
            gen = torch.Generator(device="cuda").manual_seed(m)
            _, ids = random_tokens(m, wts.hidden, wts.num_experts, 16, gen)
            row["decode_floor"] = decode.time(torch.unique(ids), iters)
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def format_table(rows, blocks, with_peer: bool) -> list[str]:
    """The markdown table of `run_table` rows (pure; no GPU)."""
    extra = (["bf16 peer", "HBM floor", "MMA floor", "decode-only", "plan/peer", "banded/peer",
              "banded/decode", "M8/banded"] if with_peer else [])
    if not with_peer and rows and "decode_floor" in rows[0]:
        extra = ["decode-only", "banded/decode"]
    head = ["tokens"] + [f"M{M}" for M in blocks] + ["plan (M)", "banded (M)"] + extra + [
        "bitwise equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["tokens"])] + [f"{r[f'M{M}']:.3f}" if r[f"M{M}"] else "-" for M in blocks]
        cells.append(f"{r['plan']:.3f} ({r['plan_M']})")
        cells.append(f"{r['banded']:.3f} ({r['banded_M']})")
        if with_peer:
            m8 = r.get("M8")
            cells += [f"{r['peer']:.3f}", f"{r['hbm_floor']:.3f}", f"{r['mma_floor']:.3f}",
                      f"{r['decode_floor']:.3f}",
                      f"{r['plan'] / r['peer']:.2f}", f"{r['banded'] / r['peer']:.2f}",
                      f"{r['banded'] / r['decode_floor']:.2f}",
                      f"{m8 / r['banded']:.2f}" if m8 else "-"]
        elif extra:
            cells += [f"{r['decode_floor']:.3f}", f"{r['banded'] / r['decode_floor']:.2f}"]
        cells.append({True: "yes", False: "NO"}.get(r.get("bitwise_equal"), "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    from kquant_cute.weights import MoEWeights

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 1024, 1536, 4096])
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 48, 64])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--codebook", default="mcg", choices=["mcg", "3inst", "mul1", "sqg_e4m3"],
                   help="trellis codebook of the random weights (the reference geometry's: mcg)")
    p.add_argument("--extra-bits", type=int, nargs="*", default=[],
                   help="after the main table, one table per K here at 16 and 1,536 tokens, "
                        "M = 8 and 32 (the K = 2, 3 rows of docs/benchmarks.md: --extra-bits 2 3)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the kernel's)")
    p.add_argument("--mma", default=None, choices=MMA_KINDS,
                   help="GEMM instruction (default auto: wgmma on sm_90, else mma.sync)")
    p.add_argument("--span", type=int, default=None,
                   help="wgmma: route blocks of one expert per work item (1, 2, 4; default: "
                        "2 at M=32)")
    p.add_argument("--occupancy", type=int, default=None,
                   help="GEMM register target in CTAs per SM (default 1: none; 0: what shared "
                        "memory allows)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="also write a plot (needs matplotlib)")
    p.add_argument("--peer", action="store_true",
                   help="also time the dense bf16 torch._grouped_mm peer and print the floors")
    p.add_argument("--decode-only", action="store_true",
                   help="without --peer: also time the decode-only ceiling (no peer, no floors)")
    a = p.parse_args(argv)
    knobs = {"stages": a.stages, "occupancy": a.occupancy, "mma": a.mma, "span": a.span}
    jobs = [(a.bits, a.tokens, a.blocks)] + [(b, [16, 1536], [8, 32]) for b in a.extra_bits]
    ceilings = None
    tables = {}
    for bits, tokens, blocks in jobs:
        t0 = time.time()
        wts = MoEWeights.random(896, 3584, 384, bits, a.codebook, shared_hidden_vectors=True,
                                seed=0, device="cuda")
        print(f"# {torch.cuda.get_device_name()}  K={bits} {a.codebook} weights ready in "
              f"{time.time() - t0:.1f}s", flush=True)
        peer = decode = None
        if a.peer:
            from peers import (Bf16GroupedMoE, DecodeCeiling, measure_bf16_matmul_rate,
                               measure_copy_bandwidth)

            peer = Bf16GroupedMoE(wts, topk=16, activation="situ")
            decode = DecodeCeiling(wts)
            print(f"# decode-only kernel: {decode.resources}", flush=True)
            if ceilings is None:
                ceilings = {"copy_Bps": measure_copy_bandwidth(),
                            "bf16_flops": measure_bf16_matmul_rate()}
            print(f"# ceilings: copy {ceilings['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
                  f"{ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s; peer weights "
                  f"{peer.weight_bytes() / 1e9:.2f} GB", flush=True)
        elif a.decode_only:
            from peers import DecodeCeiling

            decode = DecodeCeiling(wts)
            print(f"# decode-only kernel: {decode.resources}", flush=True)
        rows = run_table(wts, tokens, blocks, iters=a.iters, knobs=knobs, peer=peer,
                         ceilings=ceilings, decode=decode)
        print(f"# K={bits}, GEMM {rows[0].get('gemm', '?')}")
        print("\n".join(format_table(rows, blocks, peer is not None)), flush=True)
        tables[bits] = rows
        del wts, peer, decode
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "bits": a.bits, "codebook": a.codebook,
              "rows": tables[a.bits]}
    if a.extra_bits:
        result["extra"] = {str(b): tables[b] for b in a.extra_bits}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.png:
        try:
            from plot_bench import plot

            plot(result, a.png)
        except ImportError:
            print("# matplotlib missing: no plot (run plot_bench.py on the JSON elsewhere)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

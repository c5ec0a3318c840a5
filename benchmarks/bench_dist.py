"""Whole Kimi-K3 MoE layer across GPUs: time per step, split into kernels and communication.

One process per GPU (NCCL). For every (tp, ep) layout of the world, every token count and
every combine dtype, each rank builds its shard of the layer (E=896, H=3584, I=3072, top-16,
K=4 mcg, bf16, SiTU, shared hidden-side vectors; random codes drawn on the device: the time
does not depend on their values), replicated tokens with balanced random routing, and times
three CUDA graphs:

* ``kernel``: the rank's fused forward only -- the single-GPU shard time, with every GPU busy
  on its own shard (``alone``: rank 0's kernel graph while the other ranks wait);
* ``comm``: the combine only (``all_reduce`` of the [m, H] partial in the combine dtype);
* ``step``: both in one graph, as an engine replays a decode step.

Each figure is the median over ``--repeats`` of ``--iters`` back-to-back replays (one barrier
before each repeat), the max over ranks. Usage:

    python benchmarks/bench_dist.py --nproc 8 [--layouts 8x1 4x2 1x8] [--json dist.json]
    torchrun --nproc-per-node 8 benchmarks/bench_dist.py ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def random_shard(plan, hidden, bits, codebook, seed, device):
    """A rank's MoEWeights with uniform random codes and MoEWeights.random's vector scales,
    drawn on the device (the full layer's 14.8 GB at K=4 would take minutes on the host)."""
    from kquant_cute import trellis as tc
    from kquant_cute.weights import MoEWeights

    e, i = plan.local_experts, plan.local_intermediate
    g = torch.Generator(device=device).manual_seed(seed + 7919 * plan.rank)
    rms = float(tc.codebook_lut(codebook, bits).square().mean().sqrt())

    def codes(rows, cols):
        return torch.randint(-32768, 32768, (e, rows // 16, cols // 16, 16 * bits),
                             generator=g, device=device, dtype=torch.int32).to(torch.int16)

    def vec(shape, mag):
        sign = torch.randint(0, 2, shape, generator=g, device=device).float() * 2 - 1
        return (sign * (torch.rand(shape, generator=g, device=device) * 0.5 + 0.75) * mag).half()

    suh = vec((hidden,), 1.0)
    return MoEWeights(
        gate_trellis=codes(hidden, i), up_trellis=codes(hidden, i), down_trellis=codes(i, hidden),
        gate_suh=suh, up_suh=vec((hidden,), 1.0), down_svh=vec((hidden,), 1 / (math.sqrt(i) * rms)),
        gate_svh=vec((e, i), 1 / (math.sqrt(hidden) * rms)),
        up_svh=vec((e, i), 1 / (math.sqrt(hidden) * rms)), down_suh=vec((e, i), 1.0),
        codebook=codebook)


def _timed(graph, iters, repeats, *, barrier=True):
    """Median ms per replay of `graph` over `repeats` runs of `iters` replays; with
    `barrier`, every rank starts each run together (collectives inside the graph)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


def bench_worker(rank, world, args):
    import torch.distributed as dist
    from peers import capture, random_tokens

    from kquant_cute.distributed import DistributedMoE, ParallelPlan

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for tp, ep in args["layouts"]:
        plan = ParallelPlan(args["experts"], args["intermediate"], tp, ep, rank)
        shard = random_shard(plan, args["hidden"], args["bits"], args["codebook"], 0, dev)
        for comm in args["comm_dtypes"]:
            layer = DistributedMoE(shard, plan, topk=args["topk"], capacity=max(args["tokens"]),
                                   comm_dtype=getattr(torch, comm), act_dtype=torch.bfloat16,
                                   activation="situ", backend="kernel")
            for m in args["tokens"]:
                gen = torch.Generator(device=dev).manual_seed(m)  # same tokens on every rank
                x, ids = random_tokens(m, args["hidden"], args["experts"], args["topk"], gen)
                w = torch.rand(m, args["topk"], generator=gen, device=dev)
                w = (w / w.sum(1, keepdim=True)).float().contiguous()
                bound = layer.bind(x, ids, w)
                graphs = {"kernel": capture(bound.run_compute), "comm": capture(bound.run_comm),
                          "step": bound.capture()}
                t = {k: _timed(g, args["iters"], args["repeats"]) for k, g in graphs.items()}
                dist.barrier()
                if rank == 0:
                    t["alone"] = _timed(graphs["kernel"], args["iters"], args["repeats"], barrier=False)
                dist.barrier()
                rows.append({"tp": tp, "ep": ep, "comm_dtype": comm, "tokens": m,
                             "block_m": bound.block_m, **t})
                del graphs, bound
            del layer
            torch.cuda.empty_cache()
        del shard
        torch.cuda.empty_cache()
    return rows


def summarize(results):
    """Per (layout, dtype, tokens): max over ranks of each time; rank 0's ``alone``."""
    out = []
    for i, row in enumerate(results[0]):
        per_rank = [r[i] for r in results]
        cell = {k: row[k] for k in ("tp", "ep", "comm_dtype", "tokens", "block_m")}
        for k in ("kernel", "comm", "step"):
            cell[k] = max(r[k] for r in per_rank)
            cell[k + "_min"] = min(r[k] for r in per_rank)
        cell["alone"] = row.get("alone")
        cell["exposed_comm"] = cell["step"] - cell["kernel"]
        out.append(cell)
    return out


def format_table(cells, world):
    lines = ["| GPUs | layout | combine | tokens | M | kernel ms (shard) | alone ms | "
             "comm ms | step ms | step - kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {world} | tp{c['tp']} x ep{c['ep']} | {c['comm_dtype']} | "
                     f"{c['tokens']:,} | {c['block_m']} | {c['kernel']:.3f} | "
                     f"{c['alone']:.3f} | {c['comm']:.3f} | {c['step']:.3f} | "
                     f"{c['exposed_comm']:+.3f} |")
    return lines


def main(argv=None):
    from kquant_cute.distributed import launch, layouts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    p.add_argument("--layouts", nargs="+", default=None, help="TPxEP, e.g. 8x1 4x2 1x8")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 1536, 4096])
    p.add_argument("--comm-dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=float, default=3000)
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", a.nproc))
    lay = ([tuple(int(v) for v in s.lower().split("x")) for s in a.layouts] if a.layouts
           else layouts(world))
    for tp, ep in lay:
        if tp * ep != world:
            p.error(f"layout {tp}x{ep} does not cover {world} ranks")
    args = {"layouts": lay, "tokens": a.tokens, "comm_dtypes": a.comm_dtypes,
            "experts": a.experts, "hidden": a.hidden, "intermediate": a.intermediate,
            "topk": a.topk, "bits": a.bits, "codebook": a.codebook, "iters": a.iters,
            "repeats": a.repeats}
    results = launch(bench_worker, world, backend="nccl", args=(args,), timeout_s=a.timeout)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    cells = summarize(results)
    print(f"# {torch.cuda.get_device_name(0)} x {world}, E={a.experts} H={a.hidden} "
          f"I={a.intermediate} top-{a.topk} K={a.bits} {a.codebook}, bf16, SiTU")
    print("\n".join(format_table(cells, world)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": world, "args": args, "cells": cells}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

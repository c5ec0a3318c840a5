"""Per-kernel GPU time of one fused forward (torch.profiler / CUPTI), reference geometry
(docs/formats.md).

    python benchmarks/profile_moe.py [--tokens 16 1536] [--block-m M] [--layer qsrt_k2_coupled]

`--layer`: one of `bench_qsrt.py`'s layers, with its weights (seeded random experts tiled
to E; the decode's cost does not depend on the codes): mcg K=4 (default), the production
QSRT layer, uniform sqg_e4m3 K=3 or the mixed-rate layer. Prints, per token
count, each kernel's share of one forward (averaged over replays). With `--bare` it only
runs the forwards (3 warm-up + `--reps`), for an outside profiler; a forward launches two
GEMMs (gate and up in one, then down), so this profiles the fourth forward's:

    ncu --clock-control none -k regex:Trellis --launch-skip 6 --launch-count 2 \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python benchmarks/profile_moe.py --tokens 4096 --reps 1 --bare
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch

from kquant_cute.kernels.gemms import MMA_KINDS


def main(argv=None):
    from bench_qsrt import PROFILES, make_weights
    from peers import random_tokens

    from kquant_cute.kernels.build import short_kernel_name
    from kquant_cute.layer import MoELayer

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 1536])
    p.add_argument("--block-m", type=int, default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--stages", type=int, default=None, help="pipeline stages")
    p.add_argument("--mma", default=None, choices=MMA_KINDS,
                   help="GEMM instruction (default auto: wgmma on sm_90, else mma.sync)")
    p.add_argument("--span", type=int, default=None,
                   help="wgmma: route blocks of one expert per work item (1, 2, 4)")
    p.add_argument("--occupancy", type=int, default=None, help="GEMM register target (CTAs/SM)")
    p.add_argument("--bare", action="store_true", help="run the forwards only (no torch.profiler)")
    p.add_argument("--layer", default="mcg_k4", choices=tuple(PROFILES),
                   help="a bench_qsrt.py layer (default mcg K=4)")
    a = p.parse_args(argv)
    wts = make_weights(a.layer)
    for m in a.tokens:
        env = {}
        if a.block_m:
            env = {"KQUANT_W4A16_PREFILL_BLOCK_M": str(a.block_m), "KQUANT_W4A16_PREFILL_MIN_M": "8"}
        layer = MoELayer(wts, topk=16, capacity=m, activation="situ", environ=env,
                         stages=a.stages, occupancy=a.occupancy, mma=a.mma, span=a.span)
        x, ids = random_tokens(m, 3584, 896, 16, torch.Generator(device="cuda").manual_seed(m))
        w = torch.full((m, 16), 1 / 16, device="cuda")
        bound = layer.bind(x, ids, w)
        for _ in range(3):
            bound.run()
        torch.cuda.synchronize()
        if a.bare:
            for _ in range(a.reps):
                bound.run()
            torch.cuda.synchronize()
            del layer
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                bound.run()
            torch.cuda.synchronize()
        totals = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                name = short_kernel_name(ev.name)
                # GEMM specializations differ by their trailing index (FC1 vs FC2).
                idx = re.search(r"(\d+)$", ev.name)
                if name.startswith("Trellis") and idx:
                    name = f"{name} #{idx.group(1)}"
                totals[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        total = sum(totals.values()) / a.reps
        print(f"tokens={m} M={bound.block_m}: {total / 1000:.3f} ms of kernel time per forward")
        for name, t in totals.most_common():
            print(f"  {name:24s} {t / a.reps / 1000:8.3f} ms  {100 * t / a.reps / total:5.1f}%")
        del layer
    return 0


if __name__ == "__main__":
    sys.exit(main())

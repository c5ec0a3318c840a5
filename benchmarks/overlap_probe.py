"""Do the trellis decode and mma.sync overlap on this GPU? (H200 run: "Decode and MMA add on
the H200" in `git show 41b240f:docs/perf-log.md`)

    python3 benchmarks/overlap_probe.py [--rows 0 16 32 64] [--bits 4]

Times the decode-only kernel (`decode_probe.py`) over every expert of the reference
geometry's three projections, once per row count R: decode alone (R = 0), decode plus the
GEMM's mma.sync count for R rows per decoded tile from register-only A fragments, and the
same MMAs on raw trellis words with no decode. No activations, no shared-memory A, no
epilogue. If the two overlap, decode+MMA ~ max(decode, MMA); if they serialize, ~ the sum.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    from peers import DecodeCeiling

    from kquant_cute.weights import MoEWeights

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[0, 16, 32, 64])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args(argv)
    wts = MoEWeights.random(896, 3584, 384, a.bits, "mcg", shared_hidden_vectors=True, seed=0,
                            device="cuda")
    experts = torch.arange(896, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, K={a.bits}, all 896 experts x 3 projections, ms")
    print("| MMA rows | decode + MMA | MMA alone | decode alone | sum | max | regs |")
    print("|---|---|---|---|---|---|---|")
    alone = DecodeCeiling(wts).time(experts, a.iters)
    for rows in a.rows:
        if rows == 0:
            print(f"| 0 | {alone:.3f} | - | {alone:.3f} | - | - | - |")
            continue
        both = DecodeCeiling(wts, ctas_per_sm=1, mma_rows=rows)
        mma = DecodeCeiling(wts, ctas_per_sm=1, mma_rows=rows, decode=False)
        t_both, t_mma = both.time(experts, a.iters), mma.time(experts, a.iters)
        regs = max(r.registers for res in both.resources.values() for r in res)
        print(f"| {rows} | {t_both:.3f} | {t_mma:.3f} | {alone:.3f} | {alone + t_mma:.3f} | "
              f"{max(alone, t_mma):.3f} | {regs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

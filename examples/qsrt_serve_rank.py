"""Serve one tensor-parallel rank of a QSRT (Kimi-K3) model directory.

Writes a small synthetic model directory with the library's writer (a few MoE layers of
the production profile k2_coupled_h512_h128 at reduced experts, their manifest and the
completion record), loads one TP rank of every layer with ``qsrt.load_model`` (checked
against the records, streamed, ``verify="sha256"``), and runs each layer's MoE forward
through the registered op ``torch.ops.kquant.moe_forward``: the fused kernel
(``MoELayer``) on a GPU, the reference math (``ReferenceMoELayer``) on the CPU. With
``--check`` it also loads every other rank and checks that the ranks' outputs sum to the
whole layer (what the all-reduce after a row-parallel MoE computes), computed as the two
ranks of a TP2 split.

    python examples/qsrt_serve_rank.py [--tp-size 8] [--tp-rank 3] [--layers 2] [--check]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kquant_cute import qsrt
from kquant_cute.ops import ReferenceMoELayer
from kquant_cute.reference import reference_moe

ACTIVATION = "situ"  # Kimi-K3's gated activation


def write_model(root, layers: int, experts: int, seed: int = 0) -> None:
    geometry = qsrt.Geometry(experts, 512, 3072)  # Kimi-K3's atom axis, a narrow latent
    for n in range(1, layers + 1):
        qsrt.write_layer(root, qsrt.random_layer(n, geometry, seed=seed + n))
    qsrt.write_completion(root)


def bind(weights, topk: int, device: torch.device, capacity: int):
    """A layer object whose call runs the op: fused on CUDA, the reference elsewhere."""
    if device.type == "cuda":
        from kquant_cute.layer import MoELayer

        return MoELayer(weights, topk=topk, capacity=capacity, activation=ACTIVATION)
    return ReferenceMoELayer(weights, topk=topk, activation=ACTIVATION)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="model directory (default: a temporary one)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--tokens", type=int, default=5)
    p.add_argument("--tp-size", type=int, default=8)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true",
                   help="load every rank and check that their outputs sum to the whole layer")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or tmp
        write_model(root, args.layers, args.experts)
        print(f"wrote {args.layers} layers ({args.experts} experts, hidden 512) to {root}")

        t0 = time.perf_counter()
        rank = qsrt.load_model(root, tp_size=args.tp_size, tp_rank=args.tp_rank, device=device,
                               verify="sha256")
        print(f"loaded TP rank {args.tp_rank} of {args.tp_size}: layers {sorted(rank)} in "
              f"{time.perf_counter() - t0:.2f} s on {device}")

        gen = torch.Generator().manual_seed(1)
        x = torch.randn(args.tokens, 512, generator=gen).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.topk]
                           for _ in range(args.tokens)]).to(torch.int32).to(device)
        tw = torch.softmax(torch.randn(args.tokens, args.topk, generator=gen), -1).to(device)

        for n, weights in sorted(rank.items()):
            layer = bind(weights, args.topk, device, capacity=max(args.tokens, 8))
            y = layer(x, ids, tw)  # torch.ops.kquant.moe_forward
            print(f"layer {n}: {type(weights).__name__} I/rank={weights.intermediate}, output "
                  f"{tuple(y.shape)} {y.dtype}, rms {float(y.float().square().mean().sqrt()):.4f}")
            if not args.check:
                continue
            total = y.double().cpu()
            for r in range(args.tp_size):
                if r != args.tp_rank:
                    w = qsrt.load_model(root, tp_size=args.tp_size, tp_rank=r, layers=[n])[n]
                    total += reference_moe(x.cpu(), ids.cpu(), tw.cpu(), w, activation=ACTIVATION,
                                           dtype=torch.float64)
            # The whole layer as two ranks, one per stored upstream half (a coupled layer
            # has no TP1 split: its gate / up input vectors change at the half).
            want = sum(reference_moe(x.cpu(), ids.cpu(), tw.cpu(),
                                     qsrt.load_model(root, tp_size=2, tp_rank=r, layers=[n])[n],
                                     activation=ACTIVATION, dtype=torch.float64)
                       for r in range(2))
            rel = float((total - want).norm() / want.norm())
            print(f"  sum over {args.tp_size} ranks vs over 2 ranks: rel err {rel:.2e}")
            if rel > 1e-2:
                raise SystemExit(f"layer {n}: the ranks do not sum to the whole layer ({rel:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

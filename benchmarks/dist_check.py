"""The whole-layer tensor- / expert-parallel check: every (tp, ep) layout of a world, both
token layouts, against the unsharded fp64 reference (kquant_cute.distributed's TP / EP layer
on gloo with the torch reference as each rank's compute, or on NCCL with the fused kernels).

Used by tests/test_distributed.py (gloo, CPU), tests/test_distributed_gpu.py (NCCL) and as a
command:

    torchrun --nproc-per-node 8 benchmarks/dist_check.py      # or: python benchmarks/dist_check.py --nproc 8
    python benchmarks/dist_check.py --backend gloo --nproc 4 --experts 8 --hidden 256 --intermediate 512 --topk 2
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kquant_cute.distributed import (TOKEN_LAYOUTS, DistributedMoE, ParallelPlan, launch,
                                     layouts, shard_weights)
from kquant_cute.weights import MoEWeights


@dataclass(frozen=True)
class CheckConfig:
    """One whole-layer check: a seeded random layer (every rank builds the same full layer and
    keeps its shard), seeded tokens, the layouts and token layouts to run."""

    num_experts: int = 8
    hidden: int = 256
    intermediate: int = 512
    topk: int = 2
    bits: int = 3
    codebook: str = "mcg"
    shared_hidden_vectors: bool = True
    coupled: bool = False
    activation: str = "situ"
    tokens: tuple[int, ...] = (5,)
    layouts: Optional[tuple[tuple[int, int], ...]] = None  # None: every (tp, ep) of the world
    token_layouts: tuple[str, ...] = TOKEN_LAYOUTS
    backend: str = "reference"
    comm_dtype: str = "float64"
    act_dtype: str = "bfloat16"
    capture: bool = False
    seed: int = 0

    def weights(self) -> MoEWeights:
        return MoEWeights.random(self.num_experts, self.hidden, self.intermediate, self.bits,
                                 self.codebook, shared_hidden_vectors=self.shared_hidden_vectors,
                                 coupled=self.coupled, seed=self.seed)

    def inputs(self, m: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [m, H] fp32 (bf16-representable), global ids [m, k] int32, weights [m, k] fp32."""
        g = torch.Generator().manual_seed(1000 * self.seed + 7 * m + salt)
        x = torch.randn(m, self.hidden, generator=g).to(torch.bfloat16).float()
        ids = torch.rand(m, self.num_experts, generator=g).topk(self.topk, dim=1).indices
        w = torch.rand(m, self.topk, generator=g)
        return x, ids.to(torch.int32), (w / w.sum(1, keepdim=True)).float()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_worker(rank: int, world: int, cfg: CheckConfig) -> dict:
    """One rank of the check: for every layout and token layout, this rank's output of every
    token count (CPU tensors). ``key = (tp, ep, token_layout, m)``; "sharded" outputs are
    this rank's slice of the tokens (rows ``[rank * m / world, ...)``: every rank's slice has
    ``m // world`` rows, so m is rounded down to a multiple of ``world``). With ``capture``
    (kernel backend) also a decode step replayed from a CUDA graph on fresh inputs."""
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "kernel" \
        else torch.device("cpu")
    full = cfg.weights()
    act = _dtype(cfg.act_dtype) if cfg.backend == "kernel" else torch.float32
    comm = _dtype(cfg.comm_dtype)
    results: dict = {"describe": []}
    for tp, ep in cfg.layouts or layouts(world):
        plan = ParallelPlan(cfg.num_experts, cfg.intermediate, tp, ep, rank)
        shard = shard_weights(full, plan).to(dev)
        for tl in cfg.token_layouts:
            per_rank = [m // world if tl == "sharded" else m for m in cfg.tokens]
            layer = DistributedMoE(shard, plan, topk=cfg.topk, capacity=max(per_rank),
                                   comm_dtype=comm, act_dtype=act, activation=cfg.activation,
                                   tokens=tl, backend=cfg.backend)
            results["describe"].append(layer.describe())
            for m, mr in zip(cfg.tokens, per_rank):
                x, ids, w = cfg.inputs(m)
                if tl == "sharded":
                    x, ids, w = (t[rank * mr:(rank + 1) * mr] for t in (x, ids, w))
                args = (x.to(dev, act).contiguous(), ids.to(dev).contiguous(),
                        w.to(dev).contiguous())
                results[(tp, ep, tl, m)] = layer(*args).double().cpu().clone()
            if cfg.capture and tl == "replicated":
                m = min(cfg.tokens)
                bufs = [t.to(dev, act if i == 0 else t.dtype).contiguous()
                        for i, t in enumerate(cfg.inputs(m))]
                bound = layer.bind(*bufs)
                graph = bound.capture()
                for dst, src in zip(bufs, cfg.inputs(m, salt=1)):
                    dst.copy_(src)
                bound.out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                results[(tp, ep, "graph", m)] = bound.out.double().cpu().clone()
    return results


def reference_outputs(cfg: CheckConfig, *, device: str = "cpu") -> dict[tuple[str, int], torch.Tensor]:
    """The unsharded fp64 reference of every token count (``("eager", m)``) and of the
    capture's fresh inputs (``("graph", m)``)."""
    from kquant_cute.reference import reference_moe

    full = cfg.weights().to(device)
    out = {}
    for salt, tag in ((0, "eager"), (1, "graph")):
        for m in cfg.tokens if tag == "eager" else (min(cfg.tokens),):
            x, ids, w = (t.to(device) for t in cfg.inputs(m, salt))
            out[(tag, m)] = reference_moe(x, ids, w, full, activation=cfg.activation,
                                          dtype=torch.float64).cpu()
    return out


def assemble(results: Sequence[dict], key: tuple) -> torch.Tensor:
    """The layer output of ``key`` from the per-rank results: rank 0's (replicated: all ranks
    agree) or the ranks' slices concatenated (sharded)."""
    if key[2] == "sharded":
        return torch.cat([r[key] for r in results])
    return results[0][key]


def _main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/dist_check.py",
        description="Whole-layer TP / EP / EP+TP check against the unsharded fp64 reference. "
                    "Under torchrun (torchrun --nproc-per-node N benchmarks/dist_check.py) "
                    "each process is one rank; otherwise --nproc local processes are started.")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA (kernel compute), gloo without (reference)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 200])
    p.add_argument("--comm-dtype", default=None, help="float32 (default) or bfloat16")
    p.add_argument("--tol", type=float, default=1e-2)
    a = p.parse_args(argv)
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kernel = backend == "nccl"
    cfg = CheckConfig(num_experts=a.experts, hidden=a.hidden, intermediate=a.intermediate,
                      topk=a.topk, bits=a.bits, codebook=a.codebook, tokens=tuple(a.tokens),
                      backend="kernel" if kernel else "reference",
                      comm_dtype=a.comm_dtype or ("float32" if kernel else "float64"),
                      capture=kernel)
    world = int(os.environ.get("WORLD_SIZE", a.nproc))
    results = launch(check_worker, world, backend=backend, args=(cfg,))
    if int(os.environ.get("RANK", 0)) != 0:  # torchrun: rank 0 reports
        return 0
    ref = reference_outputs(cfg)
    worst = 0.0
    for key in sorted(k for k in results[0] if isinstance(k, tuple)):
        tag = "graph" if key[2] == "graph" else "eager"
        out = assemble(results, key)
        r = ref[(tag, key[3])][: out.shape[0]]
        err = float((out - r).norm() / r.norm())
        worst = max(worst, err)
        print(f"tp {key[0]} ep {key[1]} {key[2]:>10} m={key[3]:>5}: rel err {err:.3e}")
    print(f"worst {worst:.3e} (tolerance {a.tol})")
    return 0 if worst < a.tol else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())

"""Seeded GPU fuzz of the fused forward against the fp64 reference (marker `gpu`).

A compile costs seconds of CPU per specialization, so the fuzz draws a few dozen random
layer geometries (E, H, I, top-k, K, codebook, act / out dtype, activation, shared or
per-expert vectors, expert map, MMA kind, pinned prefill M, capacity), compiles each once,
and runs many random cases per geometry: token count m (0 and the capacity included),
routing (random top-k, duplicate ids, -1 ids, all on one expert), expert maps (-1 entries,
several global ids on one local expert) and fresh weight values copied into the layer's
tensors. Every case runs into a NaN-poisoned output and is compared with
`reference_moe` in fp64. Seed and counts are printed (`pytest -s`) and asserted.

KQUANT_FUZZ_SEED (default 2026) and KQUANT_FUZZ_CASES (default 240) change the draw.
`python tests/test_gpu_fuzz.py --prewarm [--arch sm_90] [--jobs N]` compiles the fuzz's
specializations into the cache on any machine (no GPU needed), so a GPU run pays none.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass

import pytest

from kquant_cute.kernels.moe import MoESpec

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("KQUANT_FUZZ_SEED", "2026"))
CASES = int(os.environ.get("KQUANT_FUZZ_CASES", "240"))
GEOMETRIES = 30


@dataclass(frozen=True)
class Geometry:
    """One fuzzed layer: its specialization (`MoESpec`, block_m 8 as `layer_spec` makes it;
    the plans replace block_m and arch) and what a spec does not hold."""

    spec: MoESpec
    num_global: int | None  # expert map over this many global ids, or None
    pin: int  # pinned prefill M, 0 = decode plan only
    capacity: int


def geometries(seed: int = SEED, count: int = GEOMETRIES, wgmma: bool = True) -> list[Geometry]:
    """The fuzz's layer geometries: a pure function of the seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        e = rng.choice([1, 2, 3, 5, 8, 12, 16, 33])
        num_global = rng.choice([None, None, e + rng.randint(0, 9)])
        ids = e if num_global is None else num_global
        spec = MoESpec(
            num_experts=e, hidden=128 * rng.randint(1, 4), intermediate=128 * rng.randint(1, 3),
            topk=rng.randint(1, min(8, ids)), bits=rng.randint(2, 6),
            codebook=rng.choice(["mcg", "3inst", "mul1"]), block_m=8,
            act_dtype=rng.choice(["bfloat16", "float16"]),
            out_dtype=rng.choice(["float32", "bfloat16", "float16"]),
            activation=rng.choice(["silu", "situ"]), shared_hidden_vectors=rng.random() < 0.5,
            has_expert_map=num_global is not None)
        mma = rng.choice(["sync", "wgmma"]) if wgmma else "sync"
        out.append(Geometry(spec=spec.replace(mma=mma), num_global=num_global,
                            pin=rng.choice([0, 16, 32, 48, 64]), capacity=rng.randint(8, 320)))
    return out


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _env(g: Geometry) -> dict:
    return {"KQUANT_W4A16_PREFILL_BLOCK_M": str(g.pin), "KQUANT_W4A16_PREFILL_MIN_M": "8"}


def _weights(g: Geometry, seed: int, device=None):
    from kquant_cute.weights import MoEWeights

    s = g.spec
    return MoEWeights.random(s.num_experts, s.hidden, s.intermediate, s.bits, s.codebook,
                             shared_hidden_vectors=s.shared_hidden_vectors, seed=seed,
                             device=device)


def _prewarm_one(args):
    g, arch = args
    from kquant_cute.compiler import plan_forward
    from kquant_cute.planners import resolve_env

    plan = plan_forward(g.spec, capacity=g.capacity, arch=arch, env=resolve_env(_env(g)))
    return [s.block_m for s in plan.specs()]


def prewarm(arch: str = "sm_90", jobs: int = 2, seed: int = SEED) -> None:
    import concurrent.futures
    import multiprocessing

    gs = geometries(seed, wgmma=arch in ("sm_90", "sm_90a", "90"))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for g, ms in zip(gs, pool.map(_prewarm_one, [(g, arch) for g in gs])):
            print(f"prewarmed M={ms} {g}", flush=True)


def _routing(rng, torch, m, g, emap):
    """(kind, ids [m, topk] int32) for one case."""
    n_ids = g.num_global or g.spec.num_experts
    kind = rng.choice(["random", "random", "duplicates", "minus_one", "one_expert"])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.rand(m, n_ids, generator=gen).argsort(dim=1)[:, :g.spec.topk].to(torch.int32)
    if kind == "duplicates" and g.spec.topk > 1:
        ids[:, -1] = ids[:, 0]
    elif kind == "minus_one":
        ids[torch.rand(m, g.spec.topk, generator=gen) < 0.3] = -1
    elif kind == "one_expert":
        ids[:] = rng.randrange(n_ids)
    return kind, ids


def _expert_map(rng, torch, g):
    """A random global -> local map: -1 entries and several globals per local expert."""
    emap = torch.tensor([rng.randrange(-1, g.spec.num_experts) for _ in range(g.num_global)],
                        dtype=torch.int32)
    return emap


def test_fuzz_against_fp64_reference():
    import torch

    from kquant_cute.layer import MoELayer
    from kquant_cute.reference import reference_moe

    wgmma = torch.cuda.get_device_capability() == (9, 0)
    gs = geometries(SEED, wgmma=wgmma)
    per = math.ceil(CASES / len(gs))
    rng = random.Random(SEED + 1)
    specs, counts, failures, worst = set(), {}, [], 0.0
    cases = 0
    for gi, g in enumerate(gs):
        s = g.spec
        wts = _weights(g, SEED + gi, device="cuda")
        layer = MoELayer(wts, topk=s.topk, capacity=g.capacity,
                         act_dtype=_torch_dtype(s.act_dtype), out_dtype=_torch_dtype(s.out_dtype),
                         activation=s.activation, num_global_experts=g.num_global, mma=s.mma,
                         environ=_env(g))
        # The layer plans the fuzz's spec (what --prewarm compiled), on this GPU's arch.
        assert layer.plan.base == s.replace(arch=layer.plan.base.arch), (layer.plan.base, s)
        specs.update(layer.plan.specs())
        tol = 1e-2 if "bfloat16" in (s.act_dtype, s.out_dtype) else 3e-3
        for ci in range(per):
            if ci:  # fresh weight values in the layer's own tensors (same geometry)
                fresh = _weights(g, rng.randrange(2**31))
                for name, t in fresh.tensors():
                    getattr(wts, name).copy_(t)
            m = rng.choice([0, 1, g.capacity, rng.randint(1, g.capacity), rng.randint(1, 16)])
            emap = _expert_map(rng, torch, g) if g.num_global else None
            kind, ids = _routing(rng, torch, m, g, emap)
            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            x = torch.randn(m, s.hidden, generator=gen).to(_torch_dtype(s.act_dtype))
            w = torch.rand(m, s.topk, generator=gen)
            x, ids, w = x.cuda(), ids.cuda(), w.cuda()
            kw = {} if emap is None else {"expert_map": emap.cuda()}
            layer.output.fill_(float("nan"))
            bound = layer.bind(x, ids, w, **kw)
            out = bound.run().clone()
            torch.cuda.synchronize()
            block = bound.block_m if m else 0
            counts[(kind, block)] = counts.get((kind, block), 0) + 1
            cases += 1
            ref = reference_moe(x, ids, w, wts, activation=s.activation, dtype=torch.float64,
                                **kw)
            where = f"geometry {gi} {g} case {ci}: m={m} {kind} M={block}"
            if torch.isnan(out).any():
                failures.append(f"{where}: NaN left in the poisoned output")
                continue
            norm = ref.norm().item()
            if norm == 0.0:
                if not torch.equal(out.double(), ref):
                    failures.append(f"{where}: reference is 0, output is not")
                continue
            err = ((out.double() - ref).norm() / norm).item()
            worst = max(worst, err / tol)
            if err >= tol:
                failures.append(f"{where}: rel err {err:.3e} >= {tol}")
    summary = (f"fuzz seed {SEED}: {cases} cases over {len(gs)} geometries, "
               f"{len(specs)} compiled specializations; worst err/tol {worst:.3f}; "
               f"cases by (routing, M): {dict(sorted(counts.items()))}")
    print(summary)
    assert not failures, summary + "\n" + "\n".join(failures[:20])
    assert cases >= 200 and len(gs) >= 24


if __name__ == "__main__":
    if "--prewarm" in sys.argv:
        arch = sys.argv[sys.argv.index("--arch") + 1] if "--arch" in sys.argv else "sm_90"
        jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 2
        prewarm(arch, jobs)

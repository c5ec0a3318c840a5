"""Seeded GPU fuzz of the fused forward against the fp64 reference (marker `gpu`).

A compile costs seconds of CPU per specialization, so the fuzz draws a few dozen random
layer geometries (E, H, I, top-k, K, codebook, act / out dtype, activation, shared or
per-expert vectors, expert map, MMA kind, pinned prefill M, capacity; for sqg_e4m3 also
K = 2..4, the QSRT coupled transforms, a mixed rate set with its rate maps, and the table
decode: direct tables or T12 + bijection), compiles each once,
and runs many random cases per geometry: token count m (0 and the capacity included),
routing (random top-k, duplicate ids, -1 ids, all on one expert), expert maps (-1 entries,
several global ids on one local expert) and fresh weight values copied into the layer's
tensors. Every case runs into a NaN-poisoned output and is compared with
`reference_moe` in fp64; a case bound to a block size other than the decode plan's M=8 is
run again through that M=8 specialization (a second layer over the same weights and cache
entry), and the two outputs must be bitwise equal. Seed and counts are printed
(`pytest -s`) and asserted.

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
    maps_seed: int = 0  # mixed rates (`spec.bits_set`): the seed of the rate maps


def geometries(seed: int = SEED, count: int = GEOMETRIES, wgmma: bool = True) -> list[Geometry]:
    """The fuzz's layer geometries: a pure function of the seed."""
    rng = random.Random(seed)
    out = []
    n_sqg = 0
    for _ in range(count):
        e = rng.choice([1, 2, 3, 5, 8, 12, 16, 33])
        num_global = rng.choice([None, None, e + rng.randint(0, 9)])
        ids = e if num_global is None else num_global
        spec = MoESpec(
            num_experts=e, hidden=128 * rng.randint(1, 4), intermediate=128 * rng.randint(1, 3),
            topk=rng.randint(1, min(8, ids)), bits=rng.randint(2, 6),
            codebook=rng.choice(["mcg", "3inst", "mul1", "sqg_e4m3", "sqg_e4m3"]), block_m=8,
            act_dtype=rng.choice(["bfloat16", "float16"]),
            out_dtype=rng.choice(["float32", "bfloat16", "float16"]),
            activation=rng.choice(["silu", "situ"]), shared_hidden_vectors=rng.random() < 0.5,
            has_expert_map=num_global is not None)
        mma = rng.choice(["sync", "wgmma"]) if wgmma else "sync"
        maps_seed = 0
        if spec.codebook == "sqg_e4m3":  # QSRT: K 2..4, coupled, mixed rates, table decode
            # Rate sets and coupling cycle (every pairing of the two within 15 draws).
            rates = [(), (3, 4), (), (2, 3, 4), (2, 4)][n_sqg % 5]
            coupled = n_sqg % 3 == 0
            n_sqg += 1
            spec = spec.replace(bits=rates[-1] if rates else 2 + spec.bits % 3, bits_set=rates,
                                coupled=coupled, hidden=512 if coupled else spec.hidden,
                                shared_hidden_vectors=(spec.shared_hidden_vectors or coupled
                                                       or bool(rates)),
                                table_decode=rng.choice(["auto", "t12"]))
            maps_seed = rng.randrange(2**31) if rates else 0
        out.append(Geometry(spec=spec.replace(mma=mma), num_global=num_global,
                            pin=rng.choice([0, 16, 32, 48, 64]), capacity=rng.randint(8, 320),
                            maps_seed=maps_seed))
    return out


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _env(g: Geometry) -> dict:
    return {"KQUANT_W4A16_PREFILL_BLOCK_M": str(g.pin), "KQUANT_W4A16_PREFILL_MIN_M": "8"}


def _weights(g: Geometry, seed: int, device=None):
    """Random weights of `g` (mixed rates: the geometry's own rate maps, the same for every
    seed, so fresh values fit the layer's rate arguments)."""
    import torch

    from kquant_cute.mixed import MixedMoEWeights
    from kquant_cute.weights import MoEWeights

    s = g.spec
    if not s.bits_set:
        return MoEWeights.random(s.num_experts, s.hidden, s.intermediate, s.bits, s.codebook,
                                 shared_hidden_vectors=s.shared_hidden_vectors,
                                 coupled=s.coupled, seed=seed, device=device)
    # One K per 128-channel FC1 N tile and per 64-channel FC2 stage (the kernels' runs,
    # `MoESpec.rate_runs`), every rate present.
    gen = torch.Generator().manual_seed(g.maps_seed)
    r = torch.tensor(s.bits_set, dtype=torch.uint8)
    runs = MoESpec.rate_runs()
    fc = [r[torch.randint(len(r), (s.num_experts, s.intermediate // n), generator=gen)]
          for n in (runs["fc1"], runs["fc2"])]
    for f in fc:
        f.view(-1)[: len(r)] = r
    fc1, fc2 = (f.repeat_interleave(n // 16, dim=1) for f, n in zip(fc, (runs["fc1"], runs["fc2"])))
    return MixedMoEWeights.random(fc1, fc2, s.hidden, s.codebook, coupled=s.coupled, seed=seed,
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
    cases = across_m = 0
    for gi, g in enumerate(gs):
        s = g.spec
        wts = _weights(g, SEED + gi, device="cuda")
        args = dict(topk=s.topk, capacity=g.capacity, act_dtype=_torch_dtype(s.act_dtype),
                    out_dtype=_torch_dtype(s.out_dtype), activation=s.activation,
                    num_global_experts=g.num_global, mma=s.mma, table_decode=s.requested[2])
        layer = MoELayer(wts, environ=_env(g), **args)
        # The layer plans the fuzz's spec (what --prewarm compiled), on this GPU's arch.
        assert layer.plan.base == s.replace(arch=layer.plan.base.arch), (layer.plan.base, s)
        # The decode plan's M=8 alone (the same specialization as `layer`'s decode entry):
        # the bitwise reference for cases `layer` binds to another M.
        m8 = MoELayer(wts, environ=_env(Geometry(s, g.num_global, 0, g.capacity)),
                      banded=False, **args)
        assert m8.plan.specs() == [layer.plan.decode.spec]
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
            if m and bound.block_m != m8.plan.decode.spec.block_m:
                m8.output.fill_(float("nan"))
                out8 = m8.bind(x, ids, w, **kw).run().clone()
                torch.cuda.synchronize()
                across_m += 1
                if not torch.equal(out, out8):
                    failures.append(f"{where}: output differs from the M=8 plan's")
            norm = ref.norm().item()
            if norm == 0.0:
                if not torch.equal(out.double(), ref):
                    failures.append(f"{where}: reference is 0, output is not")
                continue
            err = ((out.double() - ref).norm() / norm).item()
            worst = max(worst, err / tol)
            if err >= tol:
                failures.append(f"{where}: rel err {err:.3e} >= {tol}")
    kinds = {}
    for g in gs:
        s = g.spec
        kind = (s.codebook + (" coupled" if s.coupled else "") + (" mixed" if s.bits_set else "")
                + (" t12" if s.requested[2] == "t12" else ""))
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = (f"fuzz seed {SEED}: {cases} cases over {len(gs)} geometries "
               f"{dict(sorted(kinds.items()))}, "
               f"{len(specs)} compiled specializations; worst err/tol {worst:.3f}; "
               f"{across_m} cases bitwise against M=8; "
               f"cases by (routing, M): {dict(sorted(counts.items()))}")
    print(summary)
    assert not failures, summary + "\n" + "\n".join(failures[:20])
    # Every geometry ran its share (KQUANT_FUZZ_CASES sets the total), and the draw covered
    # the layer kinds the geometries promise.
    assert cases >= CASES and len(gs) >= 24
    assert all(any(k in kind for kind in kinds) for k in ("coupled", "mixed", "t12", "mcg")), kinds


if __name__ == "__main__":
    if "--prewarm" in sys.argv:
        arch = sys.argv[sys.argv.index("--arch") + 1] if "--arch" in sys.argv else "sm_90"
        jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 2
        prewarm(arch, jobs)

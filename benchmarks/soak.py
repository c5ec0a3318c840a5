"""Soak: many forwards of two fused MoE layers on one GPU, checked, with a pass/fail line.

Two small layers that still take every serving path: an mcg K=4 layer (ALU decode, shared
hidden-side vectors, the banded plan; at 16 experts and top-4 its policy binds M=8 up to the
prefill threshold and M=64 above it, so the band sizes between are planned and compiled but
not bound) and a QSRT-style
sqg_e4m3 K=2 layer with the coupled transforms and a global->local expert map (table
decode, the plan pair). Both are built with `stream_arenas=True` and driven from two CUDA
streams at once. Each iteration picks a layer, a stream and a mode:

- eager: a fresh random token count in 1..capacity (half uniform, half log-uniform so
  the decode and band sizes are hit as often as prefill), random top-k ids with -1 routes
  (a random share per call, from none to all), random router weights and, for the mapped
  layer, a fresh random expert map (several global ids per local expert, some -1);
- graph: one of the CUDA graphs captured during warm-up (per layer, stream and a set of
  token counts), replayed after new contents are written into its static inputs.

Checked: a sample of iterations against `reference_moe` in float64 (relative error below
1e-2, bf16 activations), sampled graph replays against an eager forward of the same
inputs (bitwise), `torch.cuda.memory_allocated` at every checkpoint after warm-up (equal
to the first: no growth), and the compile cache frozen after warm-up with its compile and
miss counters unchanged at the end (no compile). The last line is `SOAK PASS` or
`SOAK FAIL` with the figures; the exit status is 0 or 1.

    python3 benchmarks/soak.py                      # 10,000 forwards on the GPU
    python3 benchmarks/soak.py --forwards 2000 --json soak.json
    python3 benchmarks/soak.py --dry-run            # the same loop on the CPU, the reference
                                                    # standing in for the kernels (no GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 512, 256, 16, 4  # coupled: H a multiple of 512
GLOBAL_EXPERTS = 40           # the mapped layer's global id space (EXPERTS local ones)
CAPACITY = 512                # above the prefill threshold (256): bands and prefill bind
GRAPH_TOKENS = (1, 7, 64, 257, CAPACITY)
TOLERANCE = 1e-2              # relative error vs the float64 reference (bf16 activations)


@dataclass(frozen=True)
class LayerConfig:
    name: str
    bits: int
    codebook: str
    coupled: bool
    mapped: bool
    activation: str

    @property
    def id_space(self) -> int:
        return GLOBAL_EXPERTS if self.mapped else EXPERTS


LAYERS = (
    LayerConfig("mcg_k4", 4, "mcg", coupled=False, mapped=False, activation="silu"),
    LayerConfig("sqg_k2_coupled_map", 2, "sqg_e4m3", coupled=True, mapped=True, activation="situ"),
)


# -- inputs -------------------------------------------------------------------------------
def token_count(rng: random.Random, capacity: int) -> int:
    """1..capacity: half uniform, half log-uniform (small counts as often as large)."""
    if rng.random() < 0.5:
        return rng.randint(1, capacity)
    return min(capacity, max(1, int(math.exp(rng.uniform(0.0, math.log(capacity + 1))))))


def fill_routing(gen: torch.Generator, ids: torch.Tensor, w: torch.Tensor, id_space: int,
                 no_route_share: float) -> None:
    """Write distinct random ids per row (a `no_route_share` of them -1) and normalised
    router weights into ids [m, k] int32 / w [m, k] fp32, in place."""
    m, k = ids.shape
    if m == 0:
        return
    scores = torch.rand(m, id_space, generator=gen, device=ids.device)
    ids.copy_(scores.topk(k, dim=1).indices)
    drop = torch.rand(m, k, generator=gen, device=ids.device) < no_route_share
    ids.masked_fill_(drop, -1)
    w.copy_(torch.rand(m, k, generator=gen, device=w.device) + 0.05)
    w.div_(w.sum(1, keepdim=True))


def fill_expert_map(gen: torch.Generator, emap: torch.Tensor, local: int) -> None:
    """global -> local expert (several globals may share one), about a fifth -1 (remote)."""
    emap.copy_(torch.randint(-(local // 4), local, emap.shape, generator=gen,
                             device=emap.device).clamp_(min=-1))


@dataclass
class Inputs:
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    emap: Optional[torch.Tensor]

    @staticmethod
    def empty(m: int, cfg: LayerConfig, device) -> "Inputs":
        return Inputs(torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=device),
                      torch.empty(m, TOPK, dtype=torch.int32, device=device),
                      torch.empty(m, TOPK, dtype=torch.float32, device=device),
                      torch.empty(GLOBAL_EXPERTS, dtype=torch.int32, device=device)
                      if cfg.mapped else None)

    def fill(self, gen: torch.Generator, cfg: LayerConfig, rng: random.Random) -> None:
        self.x.copy_(torch.randn(self.x.shape, generator=gen, device=self.x.device))
        share = rng.choice((0.0, 0.0, 0.1, 0.3, 0.7, 1.0))
        fill_routing(gen, self.ids, self.w, cfg.id_space, share)
        if self.emap is not None:
            fill_expert_map(gen, self.emap, EXPERTS)

    def clone(self) -> "Inputs":
        return Inputs(self.x.clone(), self.ids.clone(), self.w.clone(),
                      None if self.emap is None else self.emap.clone())


# -- the layers (the GPU kernels, or the reference standing in for them) ------------------
class _StandInBinding:
    """--dry-run: what `BoundForward` does, computed by the reference into the output."""

    def __init__(self, layer: "_StandInLayer", inp: Inputs):
        self.layer, self.inp = layer, inp
        self.out = layer.output[: inp.x.shape[0]]

    def run(self) -> torch.Tensor:
        from kquant_cute.reference import reference_moe

        i = self.inp
        self.out.copy_(reference_moe(i.x, i.ids, i.w, self.layer.weights, dtype=torch.float32,
                                     activation=self.layer.activation, expert_map=i.emap))
        return self.out


class _StandInLayer:
    def __init__(self, weights, cfg: LayerConfig):
        self.weights, self.activation = weights, cfg.activation
        self.output = torch.empty(CAPACITY, HIDDEN, dtype=torch.float32)

    def bind(self, x, ids, w, *, expert_map=None):
        return _StandInBinding(self, Inputs(x, ids, w, expert_map))


class _StandInGraph:
    def __init__(self, binding):
        self.binding = binding

    def replay(self) -> None:
        self.binding.run()


def build_layers(device: str, cache) -> list[tuple[LayerConfig, Any, Any]]:
    from kquant_cute.weights import MoEWeights

    out = []
    for n, cfg in enumerate(LAYERS):
        weights = MoEWeights.random(EXPERTS, HIDDEN, INTERMEDIATE, cfg.bits, cfg.codebook,
                                    shared_hidden_vectors=True, coupled=cfg.coupled,
                                    seed=11 + n, device=device)
        if device == "cpu":
            layer = _StandInLayer(weights, cfg)
        else:
            from kquant_cute.layer import MoELayer

            layer = MoELayer(weights, topk=TOPK, capacity=CAPACITY, act_dtype=torch.bfloat16,
                             out_dtype=torch.float32, activation=cfg.activation,
                             num_global_experts=GLOBAL_EXPERTS if cfg.mapped else None,
                             stream_arenas=True, cache=cache, environ={})
        out.append((cfg, weights, layer))
    return out


# -- the soak -----------------------------------------------------------------------------
@dataclass
class Figures:
    forwards: int = 0
    eager: int = 0
    replays: int = 0
    tokens: int = 0
    checked: int = 0
    checked_replays_bitwise: int = 0
    worst_rel_err: float = 0.0
    failures: list[str] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    block_m_seen: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    warmup_seconds: float = 0.0
    compiles_after_warmup: int = 0
    misses_after_warmup: int = 0


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.norm().item()
    num = (out.double() - ref).norm().item()
    return num / den if den > 0 else num


def soak(forwards: int, *, device: str, sample_every: int, checkpoint_every: int,
         warmup: int, seed: int, log) -> Figures:
    from kquant_cute.compile_cache import CompileCache
    from kquant_cute.reference import reference_moe

    cuda = device == "cuda"
    rng = random.Random(seed)
    fig = Figures()
    cache_dir = tempfile.mkdtemp(prefix="kq_soak_cache_")
    try:
        cache = CompileCache(cache_dir)
        t0 = time.perf_counter()
        layers = build_layers(device, cache)
        streams = ([torch.cuda.Stream(), torch.cuda.Stream()] if cuda else [None, None])
        gens = [torch.Generator(device=device).manual_seed(seed + i) for i in range(2)]

        def on(s):
            return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

        # Graphs: per layer, stream and token count, static inputs and one captured forward
        # (binding on the stream first allocates that stream's arena outside capture).
        graphs: dict[tuple[int, int], list[tuple[Inputs, Any, Any]]] = {}
        for li, (cfg, weights, layer) in enumerate(layers):
            for si, s in enumerate(streams):
                entries = []
                with on(s):
                    for m in GRAPH_TOKENS:
                        inp = Inputs.empty(m, cfg, device)
                        inp.fill(gens[si], cfg, rng)
                        bound = layer.bind(inp.x, inp.ids, inp.w, expert_map=inp.emap)
                        bound.run()
                        if cuda:
                            s.synchronize()
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g, stream=s):
                                bound.run()
                        else:
                            g = _StandInGraph(bound)
                        entries.append((inp, bound, g))
                graphs[(li, si)] = entries
        if cuda:
            torch.cuda.synchronize()
        fig.warmup_seconds = time.perf_counter() - t0
        log(f"built {len(layers)} layers and {sum(map(len, graphs.values()))} graphs in "
            f"{fig.warmup_seconds:.1f} s")

        pending: list[tuple[int, int, str, Inputs, torch.Tensor, Optional[torch.Tensor]]] = []

        def check_pending() -> None:
            for it, li, mode, inp, out, eager_again in pending:
                cfg, weights, _ = layers[li]
                ref = reference_moe(inp.x, inp.ids, inp.w, weights, dtype=torch.float64,
                                    activation=cfg.activation, expert_map=inp.emap)
                err = _rel_err(out, ref)
                fig.checked += 1
                fig.worst_rel_err = max(fig.worst_rel_err, err)
                where = f"forward {it} ({cfg.name}, {mode}, m={inp.x.shape[0]})"
                if not torch.isfinite(out).all() or not err < TOLERANCE:
                    fig.failures.append(f"{where}: rel err {err:.3e} vs the reference")
                if eager_again is not None:
                    fig.checked_replays_bitwise += 1
                    if not torch.equal(out, eager_again):
                        fig.failures.append(f"{where}: replay differs from eager on its inputs")
            pending.clear()

        def step(it: int, *, sample: bool) -> None:
            """One forward (its locals die with it, so checkpoints see only live state)."""
            li = rng.randrange(len(layers))
            si = rng.randrange(2)
            cfg, weights, layer = layers[li]
            with on(streams[si]):
                if rng.random() < 0.5:  # eager, a fresh shape
                    mode, again = "eager", None
                    inp = Inputs.empty(token_count(rng, CAPACITY), cfg, device)
                    inp.fill(gens[si], cfg, rng)
                    bound = layer.bind(inp.x, inp.ids, inp.w, expert_map=inp.emap)
                    out = bound.run()
                    fig.eager += 1
                else:  # replay a captured graph on new contents
                    mode, again = "graph", None
                    inp, bound, g = rng.choice(graphs[(li, si)])
                    inp.fill(gens[si], cfg, rng)
                    g.replay()
                    out = bound.out
                    if sample:  # the same inputs eagerly: bitwise equal
                        out = out.clone()
                        again = layer.bind(inp.x, inp.ids, inp.w, expert_map=inp.emap).run().clone()
                    fig.replays += 1
                if cuda and bound.block_m not in fig.block_m_seen.setdefault(cfg.name, []):
                    fig.block_m_seen[cfg.name].append(bound.block_m)
                fig.tokens += inp.x.shape[0]
                if sample:
                    pending.append((it, li, mode, inp.clone(), out.clone(), again))

        frozen_info = None
        t_loop = time.perf_counter()
        for it in range(forwards):
            if it == warmup:  # warm: freeze the cache, start watching memory
                if cuda:
                    torch.cuda.synchronize()
                check_pending()
                cache.freeze(True)
                frozen_info = cache.cache_info()
            step(it, sample=it % sample_every == 0 or it < 8)
            fig.forwards += 1
            if (it + 1) % checkpoint_every == 0 or it + 1 == forwards:
                if cuda:
                    torch.cuda.synchronize()
                check_pending()
                if it >= warmup:
                    fig.memory.append(torch.cuda.memory_allocated() if cuda else 0)
                log(f"{it + 1:>6} forwards, {time.perf_counter() - t_loop:6.1f} s, checked "
                    f"{fig.checked}, worst rel err {fig.worst_rel_err:.2e}, memory_allocated "
                    f"{fig.memory[-1] if fig.memory else '-'}, failures {len(fig.failures)}")
        if cuda:
            torch.cuda.synchronize()
        check_pending()
        fig.seconds = time.perf_counter() - t_loop
        if frozen_info is not None:
            end = cache.cache_info()
            fig.compiles_after_warmup = end.compiles - frozen_info.compiles
            fig.misses_after_warmup = end.misses - frozen_info.misses
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return fig


def verdict(fig: Figures, forwards: int) -> tuple[bool, list[str]]:
    """(passed, reasons) from the figures; a pure function so it is tested on the CPU."""
    why = list(fig.failures)
    if fig.forwards != forwards:
        why.append(f"ran {fig.forwards} of {forwards} forwards")
    if fig.checked == 0:
        why.append("no forward was checked against the reference")
    if fig.memory and max(fig.memory) != fig.memory[0]:
        why.append(f"memory_allocated grew after warm-up: {fig.memory[0]:,} -> {max(fig.memory):,} B")
    if fig.compiles_after_warmup or fig.misses_after_warmup:
        why.append(f"{fig.compiles_after_warmup} compiles / {fig.misses_after_warmup} cache "
                   "misses after warm-up")
    return not why, why


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forwards", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=200, help="forwards before the cache freezes")
    p.add_argument("--sample-every", type=int, default=40, help="check every Nth forward")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="run on the CPU with the reference standing in for the kernels")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("soak: no CUDA GPU visible (use --dry-run to exercise the loop on the CPU)",
              file=sys.stderr)
        return 2
    warmup = min(a.warmup, a.forwards)

    def log(msg: str) -> None:
        print(f"soak: {msg}", flush=True)

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: reference kernels)"
    log(f"{a.forwards} forwards on {where}; layers {', '.join(c.name for c in LAYERS)}; "
        f"E={EXPERTS} (global {GLOBAL_EXPERTS} when mapped) H={HIDDEN} I={INTERMEDIATE} "
        f"top-{TOPK} capacity {CAPACITY}; graphs at m in {list(GRAPH_TOKENS)}")
    fig = soak(a.forwards, device=device, sample_every=a.sample_every,
               checkpoint_every=a.checkpoint_every, warmup=warmup, seed=a.seed, log=log)
    ok, why = verdict(fig, a.forwards)
    for reason in why[:20]:
        log(f"failure: {reason}")
    figures = {k: v for k, v in fig.__dict__.items() if k != "failures"}
    figures.update(passed=ok, failures=len(fig.failures), device=where,
                   torch=torch.__version__)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    mem = (f"memory_allocated after warm-up {min(fig.memory):,}..{max(fig.memory):,} B "
           f"over {len(fig.memory)} checkpoints" if fig.memory else "memory not sampled")
    print(f"SOAK {'PASS' if ok else 'FAIL'}: {fig.forwards} forwards ({fig.eager} eager, "
          f"{fig.replays} graph replays, {fig.tokens:,} tokens) in {fig.seconds:.1f} s after "
          f"{fig.warmup_seconds:.1f} s warm-up; {fig.checked} checked vs reference, worst rel "
          f"err {fig.worst_rel_err:.2e} (tol {TOLERANCE:g}), {fig.checked_replays_bitwise} "
          f"replays bitwise = eager; {mem}; {fig.compiles_after_warmup} compiles / "
          f"{fig.misses_after_warmup} misses after warm-up; block M seen {fig.block_m_seen}",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

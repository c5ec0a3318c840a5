"""benchmarks/soak.py's CPU-checkable parts: the input draws and the pass/fail verdict.

The soak itself needs a GPU (docs/benchmarks.md has its figures); its loop also runs on
the CPU with ``--dry-run``, the reference standing in for the kernels.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import soak  # noqa: E402


def test_token_counts_cover_one_to_capacity():
    rng = random.Random(0)
    counts = [soak.token_count(rng, 512) for _ in range(4000)]
    assert min(counts) == 1 and 500 <= max(counts) <= 512
    assert sum(c <= 8 for c in counts) > 300  # the log-uniform half hits decode sizes often


def test_routing_draws_distinct_ids_no_route_shares_and_maps():
    gen = torch.Generator().manual_seed(0)
    ids = torch.empty(300, 4, dtype=torch.int32)
    w = torch.empty(300, 4)
    soak.fill_routing(gen, ids, w, 40, 0.3)
    routed = ids[ids >= 0]
    assert routed.max() < 40 and ids.min() == -1
    assert 0.2 < (ids == -1).float().mean() < 0.4
    assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in ids)
    assert torch.allclose(w.sum(1), torch.ones(300))
    soak.fill_routing(gen, ids, w, 40, 1.0)
    assert (ids == -1).all()
    emap = torch.empty(40, dtype=torch.int32)
    soak.fill_expert_map(gen, emap, 16)
    assert emap.min() >= -1 and emap.max() < 16 and (emap == -1).any()
    assert len(set(emap.tolist())) < 40  # several globals share a local expert


def test_verdict_fails_on_each_broken_figure():
    good = soak.Figures(forwards=10, checked=3, memory=[100, 100, 100])
    assert soak.verdict(good, 10) == (True, [])
    for broken, word in ((soak.Figures(forwards=10, checked=3, memory=[100, 100, 164]), "grew"),
                         (soak.Figures(forwards=10, checked=0), "no forward was checked"),
                         (soak.Figures(forwards=9, checked=3), "ran 9 of 10"),
                         (soak.Figures(forwards=10, checked=3, compiles_after_warmup=1), "compiles"),
                         (soak.Figures(forwards=10, checked=3, failures=["x: rel err"]), "rel err")):
        ok, why = soak.verdict(broken, 10)
        assert not ok and any(word in w for w in why), (word, why)

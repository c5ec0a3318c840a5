"""Multi-GPU tests of kquant_cute.distributed (marker `gpu`; each skips with the reason when
fewer GPUs than its rank count are present).

One process per GPU over NCCL, every rank's compute the fused forward (MoELayer) on its
shard: TP, EP and EP+TP for every rank count the machine has, replicated and sharded tokens,
against the unsharded fp64 torch reference (bf16 activations: rel err < 1e-2), TP vs EP
compared, and a decode step captured in a CUDA graph with its all_reduce and replayed on fresh
inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kquant_cute.distributed import launch, layouts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dist_check import CheckConfig, assemble, check_worker, reference_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


def _need_gpus(n: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} GPUs for {n} NCCL ranks, {have} present")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cfg(**kw) -> CheckConfig:
    base = dict(num_experts=32, hidden=1024, intermediate=1024, topk=4, bits=4, codebook="mcg",
                tokens=(8, 200), backend="kernel", comm_dtype="float32", capture=True, seed=11)
    base.update(kw)
    return CheckConfig(**base)


def _check(world: int, cfg: CheckConfig) -> None:
    results = launch(check_worker, world, backend="nccl", args=(cfg,), timeout_s=900)
    ref = reference_outputs(cfg, device="cuda")
    keys = [k for k in results[0] if isinstance(k, tuple)]
    assert {(k[0], k[1]) for k in keys} == set(layouts(world))
    for key in keys:
        out = assemble(results, key)
        r = ref[("graph" if key[2] == "graph" else "eager", key[3])][: out.shape[0]]
        assert torch.isfinite(out).all(), key
        err = _rel(out, r)
        assert err < BF16_TOL, (key, err)
    for m in cfg.tokens:
        tp = assemble(results, (world, 1, "replicated", m))
        ep = assemble(results, (1, world, "replicated", m))
        assert _rel(tp, ep) < BF16_TOL, m
        for tp_ep in layouts(world):
            for rank_result in results[1:]:
                assert torch.equal(rank_result[(*tp_ep, "replicated", m)],
                                   results[0][(*tp_ep, "replicated", m)])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_layouts_match_the_unsharded_reference(world):
    _need_gpus(world)
    _check(world, _cfg())


def test_nccl_bf16_combine_and_per_expert_vectors():
    _need_gpus(2)
    _check(2, _cfg(comm_dtype="bfloat16", shared_hidden_vectors=False, num_experts=16))


def test_nccl_coupled_layer():
    _need_gpus(2)
    _check(2, _cfg(bits=2, codebook="sqg_e4m3", coupled=True, num_experts=16, hidden=1024,
                   intermediate=512))

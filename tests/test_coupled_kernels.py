"""The QSRT coupled transforms in the fused forward: compile-only checks on the CPU for
sm_90a / sm_100a / sm_120a, and (marker `gpu`) the forward against the fp64 coupled reference.

The coupled transforms live in the rotation kernels and do not depend on the codebook, so
the GPU checks run them with an mcg codebook; a loaded QSRT rank is relabelled mcg to run
its real channel map (slots, spans, signs) through the fused kernel.
"""

from __future__ import annotations

import pytest
import torch

from kquant_cute.kernels.build import find_cuobjdump
from kquant_cute.kernels.moe import MoESpec

ARCHS = ("sm_90a", "sm_100a", "sm_120a")
SPEC = MoESpec(num_experts=8, hidden=512, intermediate=384, topk=4, bits=4, codebook="mcg",
               block_m=8, activation="situ", shared_hidden_vectors=True, coupled=True)


def test_coupled_spec_rejections_and_name():
    assert SPEC.check() is None
    assert "_cpl_" in SPEC.kernel_name() and "_cpl" not in SPEC.replace(coupled=False).kernel_name()
    assert SPEC.replace(shared_hidden_vectors=False).check() == (
        "coupled transforms need shared hidden-side vectors")
    assert SPEC.replace(hidden=768).check() == (
        "coupled transforms need hidden % 512 == 0 (H512), got 768")


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_coupled_forward_compiles(arch):
    from kquant_cute.kernels import build
    from kquant_cute.planners import arch_limits

    names = []
    short = build.short_kernel_name

    def record(raw):
        names.append(raw)
        return short(raw)

    build.short_kernel_name = record
    try:
        _, meta = build.compile_forward(SPEC.replace(arch=arch))
    finally:
        build.short_kernel_name = short
    kernels = {k["kernel"]: k for k in meta["kernels"]}
    assert {"RotateInput", "MidActivation", "CombineOutput"} <= set(kernels)
    # The three rotation stages are their coupled variants.
    assert sum("coupled_kernel" in n for n in names) == 3
    limits = arch_limits(arch)
    for k in meta["kernels"]:
        assert 0 < k["registers"] <= limits.regs_per_thread_max
        assert k["stack"] + k["local"] == 0, f"{k['kernel']} spills"


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _layer(weights, *, topk, capacity, pin, mma="auto"):
    from kquant_cute.layer import MoELayer

    env = {"KQUANT_W4A16_PREFILL_BLOCK_M": str(pin), "KQUANT_W4A16_PREFILL_MIN_M": "8"}
    return MoELayer(weights, topk=topk, capacity=capacity, act_dtype=torch.bfloat16,
                    activation="situ", environ=env, mma=mma)


def _inputs(m, hidden, topk, num_experts, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(m, num_experts, generator=g, device="cuda").topk(topk, dim=1).indices
    w = torch.rand(m, topk, generator=g, device="cuda")
    return x, ids.to(torch.int32).contiguous(), (w / w.sum(1, keepdim=True)).float()


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["sync", "wgmma"])
def test_coupled_forward_matches_reference(mma):
    if mma == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 GPU")
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(12, 1024, 256, 4, "mcg", shared_hidden_vectors=True, coupled=True,
                            seed=3, device="cuda")
    assert {int(d) for d in wts.rotation_draws} != {0}
    layers = {M: _layer(wts, topk=4, capacity=96, pin=M, mma=mma) for M in (8, 32)}
    for m in (1, 7, 96):
        x, ids, w = _inputs(m, 1024, 4, 12, seed=m)
        ref = reference_moe(x, ids, w, wts, activation="situ", dtype=torch.float64)
        base = None
        for M, layer in layers.items():
            bound = layer.bind(x, ids, w)
            layer.output.fill_(float("nan"))
            out = bound.run().clone()
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), f"m={m} M={M}: unwritten output"
            err = _rel_err(out, ref)
            assert err < 1e-2, f"m={m} M={M}: rel err {err:.3e}"
            if base is None:
                base = out
            else:
                assert torch.equal(out, base), f"m={m}: M={M} differs from M=8"


@pytest.mark.gpu
def test_loaded_qsrt_rank_through_the_fused_forward(tmp_path):
    """A TP8 rank (and a padded TP9 rank) of a synthetic atoms-v2 layer, relabelled mcg."""
    from kquant_cute import qsrt
    from kquant_cute.reference import reference_moe
    from kquant_cute.weights import MoEWeights

    geom = qsrt.Geometry(8, 512, 3072)
    qsrt.write_layer(tmp_path, qsrt.random_layer(2, geom, seed=5))
    for tp, rank in ((8, 5), (9, 3)):
        w = qsrt.load_layer(tmp_path, layer=2, tp_size=tp, tp_rank=rank, device="cuda")
        fields = dict(w.tensors())
        # K=2 codes read as mcg: valid weights of the same layout.
        wts = MoEWeights(codebook="mcg", pre_signs=w.pre_signs, post_signs=w.post_signs,
                         rotation_draws=w.rotation_draws, **fields)
        layer = _layer(wts, topk=4, capacity=64, pin=8)
        x, ids, rw = _inputs(64, 512, 4, 8, seed=tp)
        layer.output.fill_(float("nan"))
        out = layer(x, ids, rw)
        torch.cuda.synchronize()
        ref = reference_moe(x, ids, rw, wts, activation="situ", dtype=torch.float64)
        assert not torch.isnan(out).any()
        assert _rel_err(out, ref) < 1e-2, f"tp{tp} rank {rank}"

"""Tests for kquant_cute.weights: TrellisLinear and MoEWeights validation and views."""

from __future__ import annotations

import pytest
import torch

from kquant_cute import trellis as tc
from kquant_cute.weights import MoEWeights, TrellisLinear


def _tensors(n_in=256, n_out=128, bits=3, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    out = {
        "trellis": tc.random_trellis(n_in, n_out, bits, gen),
        "suh": torch.randn(n_in, generator=gen).half(),
        "svh": (torch.randn(n_out, generator=gen) * 0.05).half(),
    }
    if bias:
        out["bias"] = torch.randn(n_out, generator=gen).half()
    return out


# --------------------------------------------------------------------------------------
# TrellisLinear
# --------------------------------------------------------------------------------------


def test_trellis_linear_properties_and_views():
    t = _tensors(bias=True)
    layer = TrellisLinear(t["trellis"], t["suh"], t["svh"], "mcg", t["bias"])
    assert (layer.bits, layer.in_features, layer.out_features) == (3, 256, 128)
    x = torch.randn(5, 256, dtype=torch.float64)
    y = layer.forward(x)
    torch.testing.assert_close(y, x @ layer.dense(torch.float64) + t["bias"].double(),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer(x), y)
    assert layer.to("cpu").trellis.data_ptr() == layer.trellis.data_ptr()


@pytest.mark.parametrize("markers,codebook", [((), "3inst"), (("mul1",), "mul1"),
                                              (("mcg",), "mcg"), (("mcg", "mul1"), "mcg")])
def test_from_exl3_codebook_markers(markers, codebook):
    prefix = "model.layers.0.mlp.experts.3.gate_proj."
    t = {prefix + k: v for k, v in _tensors(bias=True).items()}
    for m in markers:
        t[prefix + m] = torch.zeros(1)
    t["model.layers.0.mlp.experts.4.gate_proj.mcg"] = torch.zeros(1)  # other layer: ignored
    layer = TrellisLinear.from_exl3(t, prefix=prefix)
    assert layer.codebook == codebook
    assert layer.bias is not None and layer.trellis is t[prefix + "trellis"]


def test_from_exl3_without_prefix_and_missing_key():
    t = _tensors()
    assert TrellisLinear.from_exl3(t).codebook == "3inst"
    assert TrellisLinear.from_exl3(t).bias is None
    del t["svh"]
    with pytest.raises(ValueError, match="missing tensor 'svh'"):
        TrellisLinear.from_exl3(t)


def test_from_qsrt():
    layer = TrellisLinear.from_qsrt(_tensors(bits=4))
    assert layer.codebook == "sqg_e4m3" and layer.bits == 4
    with pytest.raises(ValueError, match="2..4 bits"):
        TrellisLinear.from_qsrt(_tensors(bits=5))


def test_from_dense_round_trip():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(2)) * 0.1
    bias = torch.randn(128)
    layer = TrellisLinear.from_dense(w, 3, "mcg", bias=bias, scale_factors=(1.05,),
                                     generator=torch.Generator().manual_seed(0))
    assert layer.bits == 3 and layer.bias.dtype == torch.float16
    err = float((layer.dense() - w).square().mean() / w.square().mean())
    assert err < 1.3 * 2.0 ** (-6), err


def test_trellis_linear_validation():
    t = _tensors()
    good = dict(trellis=t["trellis"], suh=t["suh"], svh=t["svh"], codebook="mcg")
    cases = [
        (dict(trellis=t["trellis"].int()), "trellis must be torch.int16"),
        (dict(trellis=t["trellis"][0]), "trellis must be 3-D"),
        (dict(trellis=t["trellis"][..., :40]), "16\\*K"),
        (dict(trellis=tc.random_trellis(256, 128, 7)), "2..6 bits"),
        (dict(codebook="sqg_e4m3", trellis=tc.random_trellis(256, 128, 5)), "2..4 bits"),
        (dict(codebook="nope"), "unknown codebook"),
        (dict(trellis=tc.random_trellis(256, 96, 3), svh=t["svh"][:96]),
         "out_features = 96"),
        (dict(trellis=tc.random_trellis(64, 128, 3), suh=t["suh"][:64]), "in_features = 64"),
        (dict(suh=t["suh"].float()), "suh must be torch.float16"),
        (dict(suh=t["suh"][:128]), "suh must have shape \\(256,\\)"),
        (dict(svh=t["svh"].bfloat16()), "svh must be torch.float16"),
        (dict(svh=t["svh"][None]), "svh must have shape"),
        (dict(bias=torch.zeros(64).half()), "bias must have shape"),
        (dict(bias=torch.zeros(128)), "bias must be torch.float16"),
        (dict(suh=[1.0] * 256), "suh must be a torch.Tensor"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            TrellisLinear(**{**good, **change})


# --------------------------------------------------------------------------------------
# MoEWeights
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_random_shapes_and_properties(shared):
    m = MoEWeights.random(3, 256, 128, 4, shared_hidden_vectors=shared, seed=1)
    assert (m.num_experts, m.hidden, m.intermediate, m.bits) == (3, 256, 128, 4)
    assert m.shared_hidden_vectors is shared and m.codebook == "mcg"
    assert m.device == torch.device("cpu")
    assert m.gate_trellis.shape == m.up_trellis.shape == (3, 16, 8, 64)
    assert m.down_trellis.shape == (3, 8, 16, 64)
    hshape = (256,) if shared else (3, 256)
    assert m.gate_suh.shape == m.up_suh.shape == m.down_svh.shape == hshape
    assert m.gate_svh.shape == m.up_svh.shape == m.down_suh.shape == (3, 128)
    for name, tensor in m.tensors():
        want = torch.int16 if name.endswith("trellis") else torch.float16
        assert tensor.dtype == want, name
        if tensor.dtype == torch.float16:
            assert bool((tensor > 0).any() and (tensor < 0).any()), name
            assert bool(torch.isfinite(tensor).all()) and float(tensor.abs().max()) < 2.0


def test_random_is_seeded_and_output_is_order_one():
    a = MoEWeights.random(2, 256, 128, 3, "3inst", seed=5)
    b = MoEWeights.random(2, 256, 128, 3, "3inst", seed=5)
    c = MoEWeights.random(2, 256, 128, 3, "3inst", seed=6)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.tensors(), b.tensors()))
    assert not torch.equal(a.gate_trellis, c.gate_trellis)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    ex = a.expert(1)
    gate, up = ex["gate"].forward(x), ex["up"].forward(x)
    h = torch.nn.functional.silu(gate) * up
    y = ex["down"].forward(h)
    for v in (gate, up, y):
        rms = float(v.square().mean().sqrt())
        assert 0.2 < rms < 5.0, rms
    # rotated activations stay O(1) too
    x2 = tc.rotate_blocks(x * ex["gate"].suh.float())
    assert 0.5 < float(x2.square().mean().sqrt()) < 2.0


@pytest.mark.parametrize("shared", [False, True])
def test_expert_views_and_from_experts_round_trip(shared):
    m = MoEWeights.random(3, 128, 256, 2, "mul1", shared_hidden_vectors=shared, seed=2)
    experts = [m.expert(e) for e in range(3)]
    ex = experts[2]
    assert ex["gate"].in_features == 128 and ex["gate"].out_features == 256
    assert ex["down"].in_features == 256 and ex["down"].out_features == 128
    assert torch.equal(ex["up"].trellis, m.up_trellis[2])
    assert torch.equal(ex["down"].svh, m.down_svh if shared else m.down_svh[2])
    back = MoEWeights.from_experts(experts)
    assert back.shared_hidden_vectors is shared and back.codebook == "mul1"
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back.tensors(), m.tensors()))
    assert m.to("cpu").shared_hidden_vectors is shared
    with pytest.raises(IndexError):
        m.expert(3)


def test_from_experts_detects_sharing_by_value():
    m = MoEWeights.random(2, 128, 128, 3, seed=3)
    experts = [m.expert(e) for e in range(2)]
    assert not MoEWeights.from_experts(experts).shared_hidden_vectors
    same = [dict(gate=TrellisLinear(ex["gate"].trellis, experts[0]["gate"].suh.clone(),
                                    ex["gate"].svh, "mcg"),
                 up=TrellisLinear(ex["up"].trellis, experts[0]["up"].suh.clone(),
                                  ex["up"].svh, "mcg"),
                 down=TrellisLinear(ex["down"].trellis, ex["down"].suh,
                                    experts[0]["down"].svh.clone(), "mcg"))
            for ex in experts]
    shared = MoEWeights.from_experts(same)
    assert shared.shared_hidden_vectors and shared.gate_suh.shape == (128,)


def test_from_experts_errors():
    m = MoEWeights.random(2, 128, 128, 3, seed=4)
    experts = [m.expert(e) for e in range(2)]
    with pytest.raises(ValueError, match="at least one"):
        MoEWeights.from_experts([])
    with pytest.raises(ValueError, match="missing projections \\['down'\\]"):
        MoEWeights.from_experts([{"gate": experts[0]["gate"], "up": experts[0]["up"]}])
    other = dict(experts[1])
    other["up"] = TrellisLinear(other["up"].trellis, other["up"].suh, other["up"].svh, "3inst")
    with pytest.raises(ValueError, match="codebook"):
        MoEWeights.from_experts([experts[0], other])
    biased = dict(experts[1])
    biased["down"] = TrellisLinear(biased["down"].trellis, biased["down"].suh,
                                   biased["down"].svh, "mcg", torch.zeros(128).half())
    with pytest.raises(ValueError, match="bias"):
        MoEWeights.from_experts([experts[0], biased])
    wider = dict(experts[1])
    wider["gate"] = TrellisLinear(**_tensors(128, 256, 3), codebook="mcg")
    with pytest.raises(ValueError, match="gate shape differs across experts: expert 1 gate has"):
        MoEWeights.from_experts([experts[0], wider])


def _fields(m: MoEWeights) -> dict:
    return dict(m.tensors(), codebook=m.codebook)


def test_moe_validation():
    per = _fields(MoEWeights.random(2, 256, 128, 3, seed=0))
    shr = _fields(MoEWeights.random(2, 256, 128, 3, shared_hidden_vectors=True, seed=0))
    cases = [
        (per, dict(gate_suh=shr["gate_suh"]), "all shared .* or all per-expert"),
        (shr, dict(down_svh=per["down_svh"]), "all shared .* or all per-expert"),
        (per, dict(down_trellis=tc.random_trellis(128, 256, 4)[None].expand(2, -1, -1, -1)),
         "must share K"),
        (per, dict(up_trellis=per["up_trellis"][:1]), "up_trellis shape"),
        (per, dict(down_trellis=per["down_trellis"][:, :4]), "down_trellis must have shape"),
        (per, dict(gate_trellis=per["gate_trellis"].int()), "gate_trellis must be torch.int16"),
        (per, dict(gate_trellis=per["gate_trellis"][0]), "gate_trellis must be 4-D"),
        (per, dict(gate_svh=per["gate_svh"].float()), "gate_svh must be torch.float16"),
        (per, dict(up_svh=per["up_svh"][:, :64]), "up_svh must have shape"),
        (per, dict(down_suh=per["down_suh"][:1]), "down_suh must have shape"),
        (per, dict(gate_suh=per["gate_suh"][:, :128]), "gate_suh must have shape"),
        (shr, dict(up_suh=shr["up_suh"].bfloat16()), "up_suh must be torch.float16"),
        (per, dict(codebook="sqg_e4m3"), None),  # K=3 is fine for sqg
        (per, dict(codebook="e8p"), "unknown codebook"),
    ]
    for base, change, message in cases:
        if message is None:
            MoEWeights(**{**base, **change})
            continue
        with pytest.raises(ValueError, match=message):
            MoEWeights(**{**base, **change})
    with pytest.raises(ValueError, match="2..4 bits"):
        MoEWeights.random(2, 256, 128, 5, "sqg_e4m3")
    with pytest.raises(ValueError, match="not a positive multiple of 128"):
        MoEWeights.random(2, 256, 96, 3)
    with pytest.raises(ValueError, match="not a positive multiple of 128"):
        MoEWeights.random(2, 64, 128, 3)
    with pytest.raises(ValueError, match="num_experts"):
        MoEWeights.random(0, 256, 128, 3)


def test_moe_geometry_multiple_of_128():
    e, h, i, k = 2, 128, 64, 2  # intermediate 64: tiles fine, Hadamard blocks not
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="out_features = 64"):
        MoEWeights(
            gate_trellis=torch.stack([tc.random_trellis(h, i, k, gen)] * e),
            up_trellis=torch.stack([tc.random_trellis(h, i, k, gen)] * e),
            down_trellis=torch.stack([tc.random_trellis(i, h, k, gen)] * e),
            gate_suh=torch.ones(h).half(), up_suh=torch.ones(h).half(),
            down_svh=torch.ones(h).half(), gate_svh=torch.ones(e, i).half(),
            up_svh=torch.ones(e, i).half(), down_suh=torch.ones(e, i).half(), codebook="mcg")


@pytest.mark.gpu
def test_moe_to_cuda():
    m = MoEWeights.random(2, 128, 128, 4, seed=0)
    g = m.to("cuda")
    assert g.device.type == "cuda" and g.shared_hidden_vectors == m.shared_hidden_vectors
    assert torch.equal(g.gate_trellis.cpu(), m.gate_trellis)
    cuda = MoEWeights.random(2, 128, 128, 4, seed=0, device="cuda")
    assert torch.equal(cuda.down_trellis.cpu(), m.down_trellis)


def test_from_experts_blames_the_odd_projection_and_names_k():
    """A codebook mismatch on expert 0's gate names expert 0's gate (it used to blame its up
    projection), and mixing K names expert, projection and both K (it used to say only
    "shapes differ")."""
    m = MoEWeights.random(3, 128, 128, 3, seed=6)
    experts = [dict(m.expert(e)) for e in range(3)]
    odd = [dict(ex) for ex in experts]
    g = odd[0]["gate"]
    odd[0]["gate"] = TrellisLinear(g.trellis, g.suh, g.svh, "mul1")
    with pytest.raises(ValueError, match=r"codebook differs across experts: expert 0 gate has "
                                         r"'mul1', the other 8 have 'mcg'"):
        MoEWeights.from_experts(odd)
    k4 = MoEWeights.random(3, 128, 128, 4, seed=7)
    mixed = [dict(ex) for ex in experts]
    mixed[2]["down"] = k4.expert(2)["down"]
    with pytest.raises(ValueError, match=r"K differs across experts: expert 2 down has 4 bits "
                                         r"per weight, the other 8 have 3 bits per weight"):
        MoEWeights.from_experts(mixed)

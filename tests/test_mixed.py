"""Tests for kquant_cute.mixed: the mixed-rate container (per-tile K storage, offsets,
packing, validation shared with MoEWeights through ExpertVectors), its reference MoE and the
fused kernel's rate maps (CPU only)."""

from __future__ import annotations

import pytest
import torch

from kquant_cute import reference
from kquant_cute import trellis as tc
from kquant_cute.mixed import (MixedMoEWeights, pack_fc1, pack_fc2, uniform_bits_map,
                               unpack_fc1, unpack_fc2)
from kquant_cute.weights import MoEWeights


# --------------------------------------------------------------------------------------
# Mixed weights and the mixed reference
# --------------------------------------------------------------------------------------


def _bits(rows):
    return torch.tensor(rows, dtype=torch.uint8).repeat_interleave(8, dim=1)


def test_mixed_storage_layout_and_decode():
    fc1 = _bits([[3, 4], [4, 4], [2, 2]])
    fc2 = _bits([[4, 3], [3, 3], [2, 4]])
    w = MixedMoEWeights.random(fc1, fc2, 256, seed=3)
    assert w.rate_set == (2, 3, 4)
    tiles = w.to_tiles()
    off1, off2 = w.fc1_offsets(), w.fc2_offsets()
    assert off1[0, 8].item() == 8 * 48 and off1[1, -1].item() == 16 * 64 == w.gate_trellis.shape[2]
    assert off2[2, 8].item() == 16 * 8 * 32
    for e in range(3):
        for proj, bits in (("gate", fc1), ("up", fc1), ("down", fc2)):
            what = w.w_hat(proj, e)
            for rec in range(2):
                k = int(bits[e, 8 * rec])
                part = tiles[proj][e][:, 8 * rec: 8 * rec + 8] if proj != "down" else \
                    tiles[proj][e][8 * rec: 8 * rec + 8]
                want = tc.decode(part[..., : 16 * k].contiguous(), "sqg_e4m3")
                got = what[:, 128 * rec: 128 * rec + 128] if proj != "down" else \
                    what[128 * rec: 128 * rec + 128]
                assert torch.equal(got, want)
            # the packed words of tile (i=1, j=9) sit at the column offset, 16K long
            if proj != "down":
                k = int(bits[e, 9])
                packed = getattr(w, f"{proj}_trellis")[e, 1, off1[e, 9]: off1[e, 9] + 16 * k]
                assert torch.equal(packed, tiles[proj][e, 1, 9, : 16 * k])
    assert w.bits_per_weight == pytest.approx((2 * (3.5 + 4 + 2) + (3.5 + 3 + 3)) / 9)


def test_mixed_weight_validation():
    fc1 = _bits([[3, 4], [4, 4]])
    w = MixedMoEWeights.random(fc1, fc1.clone(), 256)
    fields = dict(w.tensors())
    with pytest.raises(ValueError, match=r"fc2_bits\[1, 3\] = 5: codebook 'sqg_e4m3' takes K "
                                         r"in 2..4"):
        bad = fc1.clone()
        bad[1, 3] = 5
        MixedMoEWeights(**{**fields, "fc2_bits": bad})
    with pytest.raises(ValueError, match="gate_trellis rows hold 896 words, expert 1's"):
        MixedMoEWeights(**{**fields, "gate_trellis": w.gate_trellis[:, :, :896],
                           "up_trellis": w.up_trellis[:, :, :896]})
    with pytest.raises(ValueError, match="down_trellis must be int16"):
        MixedMoEWeights(**{**fields, "down_trellis": w.down_trellis[:, :100]})
    with pytest.raises(ValueError, match="gate_svh must have shape"):
        MixedMoEWeights(**{**fields, "gate_svh": w.gate_svh[:, :128]})
    t = w.to_tiles()
    t["gate"][0, 0, 0, 60] = 1                        # a word past a K=3 tile's 48
    with pytest.raises(ValueError, match="gate tiles have nonzero words past their 16K"):
        MixedMoEWeights.from_tiles(t["gate"], t["up"], t["down"], fc1, fc1,
                                   **{n: v for n, v in fields.items()
                                      if not n.endswith(("_trellis", "_bits"))})


@pytest.mark.parametrize("coupled", [False, True])
def test_mixed_reference_equals_naive_loop(coupled):
    fc1 = _bits([[3, 4, 3, 3], [4, 4, 2, 3], [3, 3, 3, 3]])
    fc2 = _bits([[3, 3, 4, 4], [2, 3, 4, 3], [4, 3, 3, 3]])
    w = MixedMoEWeights.random(fc1, fc2, 512, coupled=coupled, seed=5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(5)])
    tw = torch.rand(5, 2, generator=gen)
    ref = reference.reference_moe(x, ids, tw, w, activation="situ", dtype=torch.float64)
    naive = reference.naive_moe(x, ids, tw, w, activation="situ", dtype=torch.float64)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ref, naive, rtol=1e-10, atol=1e-12)
    # The rate map matters: the same words read with a record's K changed give another layer.
    other_bits = fc2.clone()
    other_bits[0, :8] = 4
    t = w.to_tiles(4)
    vecs = {n: v for n, v in w.tensors() if not n.endswith(("_trellis", "_bits"))}
    other = MixedMoEWeights.from_tiles(t["gate"], t["up"], t["down"], fc1, other_bits, **vecs)
    assert not torch.equal(reference.reference_moe(x, ids, tw, other, activation="situ",
                                                   dtype=torch.float64), ref)


def test_uniform_layer_in_mixed_storage_gives_the_same_reference():
    w = MoEWeights.random(3, 256, 256, 3, "sqg_e4m3", shared_hidden_vectors=True, seed=2)
    m = MixedMoEWeights.from_uniform(w)
    assert torch.equal(m.gate_trellis, w.gate_trellis.reshape(3, 16, -1))
    assert torch.equal(m.down_trellis, w.down_trellis.reshape(3, -1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=gen)
    ids = torch.randint(0, 3, (4, 2), generator=gen)
    tw = torch.rand(4, 2, generator=gen)
    assert torch.equal(reference.reference_moe(x, ids, tw, m), reference.reference_moe(x, ids, tw, w))


# --------------------------------------------------------------------------------------
# The fused kernel's rate maps
# --------------------------------------------------------------------------------------


def test_kernel_rate_maps_index_every_tile():
    """`rate_args` (the launch contract's rate maps) locate every tile's 16K int16 in the
    packed storage: FC1 tile (i, j) at word fc1_words[e, j] + i * fc1_row_words of
    gate/up, FC2 tile (i, n) at fc2_words[e, i] + 8 K n of down."""
    from kquant_cute.kernels.launch import RATE_ARGS

    fc1 = _bits([[3, 4], [4, 4], [2, 2]])
    fc2 = torch.tensor([[4, 3, 3, 2], [3, 3, 3, 3], [2, 4, 4, 4]],
                       dtype=torch.uint8).repeat_interleave(4, dim=1)  # K per 64 channels
    w = MixedMoEWeights.random(fc1, fc2, 256, seed=7)
    maps, row_words = w.rate_args()
    assert sorted(maps) == sorted(RATE_ARGS) and row_words == w.gate_trellis.shape[2] // 2
    assert maps["fc1_words"].dtype == maps["fc2_words"].dtype == torch.int32
    assert torch.equal(maps["fc1_bits"], fc1) and torch.equal(maps["fc2_bits"], fc2)
    tiles = w.to_tiles()
    flat = {p: getattr(w, f"{p}_trellis").flatten() for p in ("gate", "up", "down")}
    for e in range(3):
        for j in range(16):
            k = int(fc1[e, j])
            for i in range(16):
                at = 2 * (int(maps["fc1_words"][e, j]) + i * row_words)
                for p in ("gate", "up"):
                    assert torch.equal(flat[p][at: at + 16 * k], tiles[p][e, i, j, : 16 * k])
        for i in range(16):
            k = int(fc2[e, i])
            for n in range(16):
                at = 2 * (int(maps["fc2_words"][e, i]) + 8 * k * n)
                assert torch.equal(flat["down"][at: at + 16 * k], tiles["down"][e, i, n, : 16 * k])
    w.check_rate_runs({"fc1": 128, "fc2": 64})
    with pytest.raises(ValueError, match=r"fc2_bits\[0\]: channels 0\.\.127 mix K \[3, 4\]; "
                                         r"the fused kernel takes one K per 128 channels"):
        w.check_rate_runs({"fc2": 128})
    fields = dict(w.tensors())
    padded = {p: torch.nn.functional.pad(fields[f"{p}_trellis"], (0, 4)) for p in ("gate", "up")}
    odd = MixedMoEWeights(**{**fields, "gate_trellis": padded["gate"], "up_trellis": padded["up"]})
    with pytest.raises(ValueError, match="gate_trellis rows hold 1028 int16, not a multiple of 8"):
        odd.rate_args()


def test_mixed_layer_spec_takes_the_rate_set():
    """A mixed layer plans with bits_set = its rate set (bits = the widest); one K plans the
    uniform specialization."""
    from kquant_cute.layer import layer_spec

    w = MixedMoEWeights.random(_bits([[3, 4], [3, 3]]), _bits([[3, 3], [4, 3]]), 256)
    spec = layer_spec(w, topk=2)
    assert (spec.bits, spec.bits_set, spec.codebook) == (4, (3, 4), "sqg_e4m3")
    assert spec.check() is None
    one = MixedMoEWeights.from_uniform(MoEWeights.random(2, 256, 256, 3, "sqg_e4m3",
                                                         shared_hidden_vectors=True))
    assert (layer_spec(one, topk=2).bits, layer_spec(one, topk=2).bits_set) == (3, ())


# --------------------------------------------------------------------------------------
# Packing, shape and the vector validation shared with MoEWeights
# --------------------------------------------------------------------------------------


def test_pack_and_unpack_are_inverse_and_pack_tightly():
    fc1 = _bits([[3, 2], [4, 4]])
    fc2 = _bits([[2, 4], [3, 3]])
    gen = torch.Generator().manual_seed(4)
    words = torch.arange(64)
    tiles1 = torch.randint(-2**15, 2**15, (2, 8, 16, 64), generator=gen, dtype=torch.int32)
    tiles1 = (tiles1 * (words < 16 * fc1[:, None, :, None])).to(torch.int16)
    tiles2 = torch.randint(-2**15, 2**15, (2, 16, 8, 64), generator=gen, dtype=torch.int32)
    tiles2 = (tiles2 * (words < 16 * fc2[:, :, None, None])).to(torch.int16)
    p1, p2 = pack_fc1(tiles1, fc1), pack_fc2(tiles2, fc2)
    # expert 1 is the widest: 16 tiles x 64 words per FC1 row; expert 0 is zero padded
    assert p1.shape == (2, 8, 16 * 64) and p2.shape == (2, 8 * 16 * (8 * 3 + 8 * 3))
    assert not p1[0, :, 16 * (8 * 3 + 8 * 2):].any()
    assert torch.equal(unpack_fc1(p1, fc1, 4), tiles1)
    assert torch.equal(unpack_fc2(p2, fc2, 128, 4), tiles2)


def test_shape_properties_come_from_the_vectors():
    w = MixedMoEWeights.random(_bits([[3, 4], [4, 4], [3, 3]]), _bits([[3, 3]] * 3), 512,
                               coupled=True, seed=1)
    assert (w.num_experts, w.hidden, w.intermediate) == (3, 512, 256)
    assert w.coupled and w.shared_hidden_vectors and w.device == torch.device("cpu")
    moved = w.to("cpu")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(w.tensors(), moved.tensors()))
    assert uniform_bits_map(3, 256, [3, 4]).tolist() == _bits([[3, 4]] * 3).tolist()
    with pytest.raises(ValueError, match="3 records do not cover 256 channels"):
        uniform_bits_map(3, 256, [3, 3, 4])


@pytest.mark.parametrize("edit, message", [
    (lambda f: {"up_suh": -f["up_suh"]}, "gate_suh must equal up_suh"),
    (lambda f: {"pre_signs": f["pre_signs"] * 2}, "pre_signs must hold only"),
    (lambda f: {"post_signs": None}, "both be given"),
    (lambda f: {"rotation_draws": f["rotation_draws"] + 8}, "rotation_draws must lie in 0..7"),
    (lambda f: {"down_svh": f["down_svh"][None].expand(2, -1).contiguous()},
     "all shared .* or all per-expert"),
    (lambda f: {"profile": "k3x22_k4x2"}, "has no coupled sign vectors"),
    (lambda f: {"profile": "nope"}, "unknown QSRT profile 'nope'"),
])
def test_both_containers_reject_the_same_bad_vectors(edit, message):
    """MoEWeights and MixedMoEWeights validate their vectors with one ExpertVectors: the
    same bad field gets the same error from both."""
    u = MoEWeights.random(2, 512, 256, 3, "sqg_e4m3", shared_hidden_vectors=True, coupled=True,
                          seed=2)
    m = MixedMoEWeights.from_uniform(u)
    for cls, w in ((MoEWeights, u), (MixedMoEWeights, m)):
        fields = {**dict(w.tensors()), "rotation_draws": w.rotation_draws,
                  "pre_signs": w.pre_signs, "post_signs": w.post_signs}
        fields.update(edit(fields))
        with pytest.raises(ValueError, match=message):
            cls(codebook=w.codebook, **fields)


def test_mixed_rejects_a_hidden_width_off_the_hadamard_block():
    w = MixedMoEWeights.random(_bits([[3, 4]]), _bits([[3, 3]]), 256)
    fields = dict(w.tensors())
    cut = {"gate_trellis": w.gate_trellis[:, :4], "up_trellis": w.up_trellis[:, :4]}
    with pytest.raises(ValueError, match="in_features = 64 is not a positive multiple of 128"):
        MixedMoEWeights(**{**fields, **cut})

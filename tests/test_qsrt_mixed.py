"""Mixed-rate QSRT (k3x22_k4x2, k3x22_k4x2_coupled_h512_h128): rate maps, byte layout,
loader round trips, mixed weights and the mixed reference MoE (CPU only)."""

from __future__ import annotations

import json

import pytest
import torch

from kquant_cute import qsrt, reference
from kquant_cute.qsrt import layout as qm
from kquant_cute import trellis as tc
from kquant_cute.mixed import MixedMoEWeights
from kquant_cute.weights import MoEWeights

GEOM = qsrt.Geometry(4, 512, 3072)
LAYER = 5
UNC, CPL = "k3x22_k4x2", "k3x22_k4x2_coupled_h512_h128"


# --------------------------------------------------------------------------------------
# Rate maps
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [1, 2, 7, 46, 92])
@pytest.mark.parametrize("expert", [0, 1, 5, 11, 12, 431, 895])
def test_rate_map_matches_the_placement_rule(layer, expert):
    rho = (5 * expert + layer) % 12
    assert qm.pair_rotation(layer, expert) == rho
    for family in ("fc1", "fc2"):
        bits = qm.record_bits(UNC, layer, expert, family)
        direct = []
        for p in range(12):
            direct += [4, 3] if (p - rho) % 12 in (0, 6) else [3, 3]
        assert list(bits) == direct
        assert bits.count(4) == 2 and bits.count(3) == 22
    logical = qm.physical_to_logical_records(layer, expert)
    assert sorted(logical) == list(range(24))
    # The K4 logical records (22, 23) sit exactly where the rate map says K4.
    bits = qm.record_bits(UNC, layer, expert, "fc1")
    assert [r for r in range(24) if bits[r] == 4] == sorted(
        p for p in range(24) if logical[p] in (22, 23))
    # K3 records keep their logical order around the rotation.
    k3 = [logical[(2 * rho + i) % 24] for i in range(24) if logical[(2 * rho + i) % 24] < 22]
    assert k3 == list(range(22))
    # The coupled profile's kinds are static: FC1 P43 at pairs 5 and 11, FC2 P44 at 11.
    kinds = qm.pair_kinds(CPL, layer, expert)
    assert [p for p, k in enumerate(kinds) if k != ("P33", "P33")] == [5, 11]
    assert kinds[5] == ("P43", "P33") and kinds[11] == ("P43", "P44")


def test_rate_map_tensor_and_bad_arguments():
    m = qm.rate_map(UNC, 24, 3)
    assert m.shape == (24, 2, 24) and torch.equal(m[:, 0], m[:, 1])
    # Every physical pair gets the same P43 load over 12 consecutive experts (5 is a unit mod 12).
    p43 = (m[:12, 0, 0::2] == 4).sum(dim=0)
    assert p43.tolist() == [2] * 12
    with pytest.raises(ValueError, match="layer must be an int in 1..92"):
        qm.pair_rotation(0, 1)
    with pytest.raises(ValueError, match="family must be one of"):
        qm.record_bits(UNC, 1, 0, "fc3")
    with pytest.raises(ValueError, match="not a mixed-rate profile"):
        qm.pair_kinds("k2_coupled_h512_h128", 1, 0)


def test_kimi_k3_byte_layout_matches_the_published_constants():
    """Bundle, stride and slab sizes at E=896, H=3584 equal the constants in pedapudi/qsrt
    ``qsrt_atoms_v2.py`` and the vLLM fork's ``kquant_qsrt_atoms_v2.py``."""
    h = 3584
    assert qm.bundle_bytes(h, "P33", "P33") == 129216
    assert qm.bundle_bytes(h, "P43", "P43") == 150720
    assert qm.bundle_bytes(h, "P43", "P33") == 143552
    assert qm.bundle_bytes(h, "P43", "P44") == 157888
    assert qm.section_bytes(h, "P44") == 57344
    assert qsrt.bundle_bytes(h, 2) == 86208
    for layer in (1, 40, 92):
        meta = qm.header_metadata(UNC, 896, h, layer)
        assert meta["atom_slot_stride_bytes"] == "119005184"
        assert qm.atom_tensor_shape(UNC, 896, h, layer) == [96, 119005184]
    meta = qm.header_metadata(CPL, 896, h, 1)
    assert meta["atom_pair_bundle_bytes"].split(",") == \
        ["129216"] * 5 + ["143552"] + ["129216"] * 5 + ["157888"]
    align = lambda n: (n + 4095) // 4096 * 4096  # noqa: E731
    slab = sum(8 * align(896 * int(b)) for b in meta["atom_pair_bundle_bytes"].split(","))
    assert qm.atom_tensor_shape(CPL, 896, h, 1) == [slab]


def test_rank_extents_of_the_mixed_profiles():
    exts = [qsrt.rank_extent(UNC, GEOM, LAYER, 4, r) for r in range(4)]
    assert [(e.first_atom, e.atom_count) for e in exts] == [(0, 24), (24, 24), (48, 24), (72, 24)]
    with pytest.raises(qsrt.QSRTFormatError, match=r"tp_size 8 is not supported.*splits a "
                                                   r"record pair.*\[1, 2, 3, 4, 6, 12\]"):
        qsrt.rank_extent(UNC, GEOM, LAYER, 8, 0)
    pairs = [qsrt.rank_extent(CPL, GEOM, 7, 12, r).first_atom // 8 for r in range(12)]
    assert pairs == [(r + 6) % 12 for r in range(12)]
    with pytest.raises(qsrt.QSRTFormatError, match="tp_size 8 is not supported.*TP12"):
        qsrt.rank_extent(CPL, GEOM, LAYER, 8, 0)


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[UNC, CPL])
def mixed_file(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("qsrt-mixed")
    layer = qsrt.random_layer(LAYER, GEOM, seed=11, profile=request.param,
                              **({"draws": [0, 3, 6, 1]} if request.param == CPL else {}))
    path = qsrt.write_layer(root, layer)
    return request.param, root, path, layer


def _record_words(layer, e, family, record):
    """Logical record ``record`` of one matrix: tile form cut to its K (independent of the
    loader: straight from the global layer and the logical schedule)."""
    k = qm.LOGICAL_RECORD_BITS[record % 24]
    if family == "fc1":
        return layer.fc1[e, :, 8 * record: 8 * record + 8, : 16 * k]
    return layer.fc2[e, 8 * record: 8 * record + 8, :, : 16 * k]


def test_file_round_trip_and_header(mixed_file):
    profile, root, path, layer = mixed_file
    back = qsrt.read_layer(root, layer=LAYER)
    for name in ("fc1", "fc1_svh", "fc2", "fc2_suh", "w1_suh", "w3_suh", "w2_svh", "draws"):
        assert torch.equal(getattr(back, name), getattr(layer, name)), name
    h = qsrt.read_header(path)
    assert h.metadata["profile"] == profile and h.metadata["profile_id"] == \
        str(qsrt.PROFILES[profile].profile_id)
    manifest = json.loads((root / qsrt.MANIFEST_FILE).read_text())
    assert manifest["trellis_bits_per_weight"] == pytest.approx(74 / 24)
    if profile == UNC:
        assert "residual_hadamard_block_size" not in h.metadata
        assert h.metadata["p43_atom_bundle_bytes"] == str(qm.bundle_bytes(512, "P43", "P43"))
    else:
        assert h.metadata["atom_storage"] == "pair_variable_stride"


def test_uncoupled_bundles_hold_the_placed_records(mixed_file):
    """Byte-level: expert e's bundle in atom 8p + t holds stripe t of the logical records the
    placement rule puts at physical records 2p (low, K4 first in a P43 pair) and 2p + 1."""
    profile, _, _, layer = mixed_file
    if profile != UNC:
        pytest.skip("uncoupled layout only")
    rows = layer.atom_rows()
    h16 = GEOM.hidden // 16
    for e in range(GEOM.num_experts):
        logical = qm.physical_to_logical_records(LAYER, e)
        for atom in (0, 13, 47, 90):
            p, t = divmod(atom, 8)
            # Offset of e's bundle: P33 experts first, then P43, each in expert order.
            p43 = [x for x in range(GEOM.num_experts) if qm.pair_is_p43(LAYER, x, p)]
            order = [x for x in range(GEOM.num_experts) if x not in p43] + p43
            off = sum(qm.bundle_bytes(512, *(("P43",) * 2 if x in p43 else ("P33",) * 2))
                      for x in order[: order.index(e)])
            lo, hi = logical[2 * p], logical[2 * p + 1]
            want = []
            for m in (0, 1):
                for r in (lo, hi):
                    want.append(_record_words(layer, e, "fc1", 24 * m + r)[:, t])
            for r in (lo, hi):
                want.append(_record_words(layer, e, "fc2", r)[t])
            raw = torch.cat([w.reshape(-1) for w in want]).view(torch.uint8)
            assert torch.equal(rows[atom, off: off + raw.numel()], raw), (e, atom)
            assert raw.numel() == (h16 * 16 * 2) * (3 * qm.PAIR_KIND_BITS[
                "P43" if e in p43 else "P33"][0] + 3 * 3)


def _global_statement(layer, x, ids, tw):
    """The whole layer in global (logical) coordinates, record by record, fp64."""
    g = layer.geometry
    i = g.intermediate
    h128 = tc.rotate_blocks

    def decode(e, family):
        n = 48 if family == "fc1" else 24
        parts = [tc.decode(_record_words(layer, e, family, r).contiguous(), "sqg_e4m3")
                 for r in range(n)]
        return torch.cat(parts, dim=1 if family == "fc1" else 0).double()

    coupled = qsrt.PROFILES[layer.profile].coupled
    out = torch.zeros_like(x)
    z = tc.rotate_h512(x) if coupled else x
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            fc1, fc2 = decode(e, "fc1"), decode(e, "fc2")
            svh = layer.fc1_svh[e].double()
            a1 = h128(z[t] * layer.w1_suh.double())
            a3 = h128(z[t] * layer.w3_suh.double())
            if coupled:
                draw = int(layer.draws[e])
                raw = torch.cat([a1 @ fc1[:, :i], a3 @ fc1[:, i:]])
                pre = h128(h128(raw) * svh) * qsrt.rotation_signs(2 * i, draw, 1).double()
                hh = reference.activation_fn("situ")(pre[0::2], pre[1::2]) * \
                    qsrt.rotation_signs(i, draw, 2).double()
            else:
                gate = h128(a1 @ fc1[:, :i]) * svh[:i]
                up = h128(a3 @ fc1[:, i:]) * svh[i:]
                hh = reference.activation_fn("situ")(gate, up)
            # coupled: one more H128 on the post-activation axis before down.suh
            d = h128((h128(hh) if coupled else hh) * layer.fc2_suh[e].double())
            out[t] += tw[t, k].double() * (h128(d @ fc2) * layer.w2_svh.double())
    return tc.rotate_h512(out) if coupled else out


@pytest.mark.slow
def test_rank_outputs_sum_to_the_whole_mixed_layer(mixed_file):
    """Sum over TP ranks of the reference on loaded weights == the whole layer stated from the
    logical records: checks the placement, the P43 K4-first order, the grouping of atom rows,
    the coupled slot map and the per-rank sign / suh slices."""
    profile, root, _, layer = mixed_file
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 512, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(3)])
    tw = torch.rand(3, 2, generator=gen)
    whole = _global_statement(layer, x, ids, tw)
    assert whole.abs().max() > 0.1
    for tp in ((2, 12) if profile == UNC else (12,)):
        ranks = [qsrt.load_layer(root, layer=LAYER, tp_size=tp, tp_rank=r) for r in range(tp)]
        assert all(set(w.rate_set) <= {3, 4} for w in ranks)
        total = sum(reference.reference_moe(x, ids, tw, w, activation="situ",
                                            dtype=torch.float64) for w in ranks)
        torch.testing.assert_close(total, whole, rtol=1e-9, atol=1e-11)


def test_loaded_rank_matches_in_memory_rank_and_rates(mixed_file):
    profile, root, path, layer = mixed_file
    tp, r = 12, 3
    w = qsrt.load_layer(path, tp_size=tp, tp_rank=r)
    mem = layer.rank(tp, r)
    for (name, a), (_, b) in zip(w.tensors(), mem.tensors()):
        assert torch.equal(a, b), name
    assert isinstance(w, MixedMoEWeights) and w.profile == profile
    assert w.intermediate == 256 and w.coupled == (profile == CPL)
    ext = qsrt.rank_extent(profile, GEOM, LAYER, tp, r)
    pair = ext.first_atom // 8
    for e in range(GEOM.num_experts):
        want = qm.record_bits(profile, LAYER, e, "fc2")[2 * pair: 2 * pair + 2]
        assert w.fc2_bits[e].tolist() == [want[0]] * 8 + [want[1]] * 8
        if profile == UNC:
            assert torch.equal(w.fc1_bits[e], w.fc2_bits[e])


def _tamper(path, out, *, meta=None, atoms=None, fmt=None):
    """Rewrite a layer file with overrides (through safetensors, any header size)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        md = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    md.update(meta or {})
    if atoms is not None:
        tensors[qsrt.ATOM_TENSOR] = atoms
    if fmt is not None:
        tensors[qsrt.FORMAT_TENSOR] = fmt
    save_file(tensors, str(out), metadata=md)
    return out


def test_bad_mixed_files_are_rejected(mixed_file, tmp_path):
    profile, _, path, layer = mixed_file
    atoms = layer.atom_rows()
    name = "qsrt-layer-00005.safetensors"
    with pytest.raises(qsrt.QSRTFormatError, match="wrong value|wrong stride"):
        key = "atom_slot_stride_bytes" if profile == UNC else "atom_pair_bundle_bytes"
        qsrt.load_layer(_tamper(path, tmp_path / name, meta={key: "7"}), tp_size=12, tp_rank=0)
    wide = torch.nn.functional.pad(atoms, (0, 4096))
    with pytest.raises(qsrt.QSRTFormatError, match="tensor qsrt_atoms has shape"):
        qsrt.load_layer(_tamper(path, tmp_path / name, atoms=wide), tp_size=12, tp_rank=0)
    fmt = layer.format_section().clone()
    fmt[1] = 0x44
    with pytest.raises(qsrt.QSRTFormatError, match=r"expert 1 has format code 0x44 \(K2\)"):
        qsrt.load_layer(_tamper(path, tmp_path / name, fmt=fmt), tp_size=12, tp_rank=0)
    # Nonzero row padding is caught on the rank that reads that row, before weights exist.
    layouts = qm.row_layouts(profile, 4, 512, LAYER)
    a = 8 * ((3 + LAYER - 1) % 12) if profile == CPL else 24
    flat = atoms.clone().reshape(-1)
    flat[qm.row_offset(profile, layouts, a) + layouts[a].payload] = 1
    bad = _tamper(path, tmp_path / name, atoms=flat.reshape(atoms.shape))
    with pytest.raises(qsrt.QSRTFormatError, match=f"atom row {a} has nonzero padding"):
        qsrt.load_layer(bad, tp_size=12, tp_rank=3)
    if profile == UNC:
        fmt = layer.format_section().clone()
        fmt[GEOM.num_experts] = 2
        with pytest.raises(qsrt.QSRTFormatError, match="format section byte 4 is nonzero"):
            qsrt.load_layer(_tamper(path, tmp_path / name, fmt=fmt), tp_size=12, tp_rank=0)


def test_mixed_geometry_must_cover_the_24_records():
    with pytest.raises(qsrt.QSRTFormatError, match="intermediate 1536 is not the 3072"):
        qsrt.random_layer(1, qsrt.Geometry(2, 512, 1536), profile=UNC)

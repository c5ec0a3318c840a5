"""Tests for kquant_cute.qsrt (atoms-v2 layer files, rank extents, coupled signs) and the
coupled reference in kquant_cute.reference (CPU only)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from kquant_cute import qsrt, reference
from kquant_cute import trellis as tc
from kquant_cute.weights import MoEWeights

# Small latent axis and few experts, Kimi-K3's atom axis (3072 channels = 96 atoms), so
# TP8 / TP9 / TP12 split exactly as in production.
GEOM = qsrt.Geometry(4, 512, 3072)
LAYER = 3
PROFILE = qsrt.PRODUCTION_PROFILE


@pytest.fixture(scope="module")
def layer_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("qsrt")
    layer = qsrt.random_layer(LAYER, GEOM, seed=7, draws=[0, 6, 3, 6])
    path = qsrt.write_layer(root, layer)
    return root, path, layer


# --------------------------------------------------------------------------------------
# Rank extents
# --------------------------------------------------------------------------------------


def _extents(tp, layer=1, geometry=qsrt.KIMI_K3, pad=True):
    return [qsrt.rank_extent(PROFILE, geometry, layer, tp, r, pad=pad) for r in range(tp)]


@pytest.mark.parametrize("tp, channels", [(2, 1536), (8, 384), (12, 256)])
def test_even_tp_splits_whole_blocks_within_halves(tp, channels):
    ext = _extents(tp)
    assert [e.channels for e in ext] == [channels] * tp
    assert [e.padded_channels for e in ext] == [channels] * tp
    assert [e.first_atom for e in ext] == [r * channels // 32 for r in range(tp)]
    for e in ext:
        assert e.first_atom // 48 == (e.first_atom + e.atom_count - 1) // 48


def test_tp9_plan_rotates_and_pads_to_384():
    seen = set()
    for layer in range(1, 93):
        ext = _extents(9, layer)
        owned = sorted(a for e in ext for a in range(e.first_atom, e.first_atom + e.atom_count))
        assert owned == list(range(96))
        assert sorted(e.channels for e in ext) == [256] * 3 + [384] * 6
        assert all(e.padded_channels == 384 for e in ext)
        for e in ext:
            assert e.first_atom % 4 == 0
            assert e.first_atom // 48 == (e.first_atom + e.atom_count - 1) // 48
        seen.add(tuple(e.first_atom for e in ext))
    assert len(seen) == 9  # the assignment rotates with the layer, period 9
    # Layer 1: rank r owns plan slot r: half 0 = 12, 12, 8, 8, 8 atoms; half 1 = 12 x 4.
    assert [(e.first_atom, e.atom_count) for e in _extents(9, 1)] == [
        (0, 12), (12, 12), (24, 8), (32, 8), (40, 8), (48, 12), (60, 12), (72, 12), (84, 12)]
    assert _extents(9, 1, pad=False)[2].padded_channels == 256


@pytest.mark.parametrize("tp, rank, match", [
    (1, 0, "crosses the half boundary at atom 48"),
    (3, 0, "only even sizes and the TP9 plan"),
    (8, 8, "tp_rank 8 is out of range for tp_size 8"),
    (8, -1, "out of range"),
    (0, 0, "tp_size must be positive"),
    (48, 0, "fewer than its 24 ranks"),
])
def test_bad_rank_requests_are_refused(tp, rank, match):
    with pytest.raises(qsrt.QSRTFormatError, match=match):
        qsrt.rank_extent(PROFILE, qsrt.KIMI_K3, 1, tp, rank)


def test_mixed_tp8_and_unknown_profiles_are_named():
    with pytest.raises(qsrt.QSRTFormatError, match=r"tp_size 8 is not supported for "
                                                  r"'k3x22_k4x2'.*splits a record pair"):
        qsrt.rank_extent("k3x22_k4x2", qsrt.KIMI_K3, 1, 8, 0)
    with pytest.raises(qsrt.QSRTFormatError, match="unknown QSRT profile 'k2'"):
        qsrt.rank_extent("k2", qsrt.KIMI_K3, 1, 8, 0)


def test_kimi_k3_sizes_match_the_published_layout():
    prof = qsrt.PROFILES[PROFILE]
    assert (prof.profile_id, prof.format_code, prof.uniform_bits) == (3, 0x44, 2)
    assert qsrt.bundle_bytes(3584, 2) == 86208          # P22 atom bundle
    assert qsrt.KIMI_K3.row_stride(2) == 77242368        # 896 bundles, already 4 KiB aligned
    assert qsrt.ATOM_SLAB_OFFSET == 32768


# --------------------------------------------------------------------------------------
# Sign draws
# --------------------------------------------------------------------------------------


def test_rotation_signs_follow_the_seeded_draw():
    assert torch.equal(qsrt.rotation_signs(100, 0, 1), torch.ones(100))
    gen = torch.Generator().manual_seed((0x6A09E667F3BCC909 * 6 + 0xBB67AE8584CAA73B * 2)
                                        % 2 ** 63)
    expected = torch.randint(0, 2, (3072,), generator=gen).float() * 2 - 1
    got = qsrt.rotation_signs(3072, 6, 2)
    assert torch.equal(got, expected)
    assert 1300 < int((got > 0).sum()) < 1800
    assert not torch.equal(qsrt.rotation_signs(3072, 6, 1), got)
    assert not torch.equal(qsrt.rotation_signs(3072, 5, 2), got)
    with pytest.raises(qsrt.QSRTFormatError, match="rotation draw must be an int in 0..7"):
        qsrt.rotation_signs(8, 8, 1)


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------


_FIELDS = ("fc1", "fc1_svh", "fc2", "fc2_suh", "w1_suh", "w3_suh", "w2_svh", "format_codes",
           "draws")


def test_full_layer_round_trip(layer_file):
    root, path, layer = layer_file
    stride = GEOM.row_stride(2)
    assert path.name == "qsrt-layer-00003.safetensors"
    assert path.stat().st_size == qsrt.ATOM_SLAB_OFFSET + GEOM.atom_slots * stride
    for source in (path, root):
        back = qsrt.read_layer(source, layer=LAYER)
        for name in _FIELDS:
            assert torch.equal(getattr(back, name), getattr(layer, name)), name
    manifest = json.loads((root / qsrt.MANIFEST_FILE).read_text())
    assert manifest["profile"] == PROFILE
    assert manifest["layers"]["3"]["atom_disk_bytes"] == path.stat().st_size


def test_bundle_bytes_sit_where_the_layout_says(layer_file):
    """Byte-level pin of the atoms-v2 bundle, read straight from the file."""
    _, path, layer = layer_file
    raw = path.read_bytes()
    assert struct.unpack("<Q", raw[:8])[0] == qsrt.HEADER_BYTES - 8
    stride, bundle, sec = GEOM.row_stride(2), qsrt.bundle_bytes(512, 2), 512 * 8
    fmt = raw[qsrt.HEADER_BYTES: qsrt.HEADER_BYTES + 4096]
    assert list(fmt[:4]) == [0x44] * 4 and list(fmt[4:8]) == [0, 6, 3, 6] and not any(fmt[8:])
    shared = raw[8192: 8192 + 3 * 512 * 2]
    assert shared == torch.stack([layer.w1_suh, layer.w3_suh, layer.w2_svh]).numpy().tobytes()
    for atom, expert in ((0, 0), (47, 3), (48, 1), (95, 2)):
        base = qsrt.ATOM_SLAB_OFFSET + atom * stride + expert * bundle
        for s in range(2):       # FC1 section s = pre-activation chunk 2a + s: q-tiles 4a+2s+p
            for p in range(2):
                tile = layer.fc1[expert, :, 4 * atom + 2 * s + p].contiguous().numpy().tobytes()
                off = base + s * sec + p * (sec // 2)
                assert raw[off: off + sec // 2] == tile
        for p in range(2):       # FC2 section: K-tiles 2a + p
            tile = layer.fc2[expert, 2 * atom + p].contiguous().numpy().tobytes()
            off = base + 2 * sec + p * (sec // 2)
            assert raw[off: off + sec // 2] == tile
        spans = raw[base + 3 * sec: base + bundle]
        want = torch.cat([layer.fc1_svh[expert, 64 * atom: 64 * atom + 64],
                          layer.fc2_suh[expert, 32 * atom: 32 * atom + 32]]).numpy().tobytes()
        assert spans == want


def _expected_rank(layer, ext):
    """A rank's weights from the whole layer by the channel map, padded with zeros."""
    f, a, pa = ext.first_atom, ext.atom_count, ext.padded_atoms
    e, h16 = GEOM.num_experts, GEOM.hidden // 16
    slot_tiles = [[4 * (f + i) + 2 * s + p for i in range(a) for p in range(2)] for s in range(2)]
    slot_ch = [[64 * (f + i) + 32 * s + j for i in range(a) for j in range(32)] for s in range(2)]
    ch = list(range(32 * f, 32 * (f + a)))
    out = {}
    for s, name in enumerate(("gate", "up")):
        t = torch.zeros(e, h16, 2 * pa, 32, dtype=torch.int16)
        t[:, :, : 2 * a] = layer.fc1[:, :, slot_tiles[s]]
        out[f"{name}_trellis"] = t
        v = torch.zeros(e, 32 * pa, dtype=torch.float16)
        v[:, : 32 * a] = layer.fc1_svh[:, slot_ch[s]]
        out[f"{name}_svh"] = v
    d = torch.zeros(e, 2 * pa, h16, 32, dtype=torch.int16)
    d[:, : 2 * a] = layer.fc2[:, 2 * f: 2 * (f + a)]
    out["down_trellis"] = d
    v = torch.zeros(e, 32 * pa, dtype=torch.float16)
    v[:, : 32 * a] = layer.fc2_suh[:, ch]
    out["down_suh"] = v
    suh = layer.w1_suh if f < 48 else layer.w3_suh
    out.update(gate_suh=suh, up_suh=suh, down_svh=layer.w2_svh)
    pre = torch.ones(e, 64 * pa, dtype=torch.float16)
    post = torch.ones(e, 32 * pa, dtype=torch.float16)
    for x in range(e):
        draw = int(layer.draws[x])
        pre[x, : 64 * a] = qsrt.rotation_signs(6144, draw, 1)[64 * f: 64 * (f + a)].half()
        post[x, : 32 * a] = qsrt.rotation_signs(3072, draw, 2)[32 * f: 32 * (f + a)].half()
    out.update(pre_signs=pre, post_signs=post)
    return out


@pytest.mark.parametrize("tp, pad", [(2, True), (8, True), (12, True), (9, True), (9, False)])
def test_each_tp_rank_round_trips(layer_file, tp, pad):
    root, path, layer = layer_file
    for rank in range(tp):
        ext = qsrt.rank_extent(PROFILE, GEOM, LAYER, tp, rank, pad=pad)
        w = qsrt.load_layer(root, layer=LAYER, tp_size=tp, tp_rank=rank, pad=pad)
        assert (w.profile, w.codebook, w.coupled, w.bits) == (PROFILE, "sqg_e4m3", True, 2)
        assert w.intermediate == ext.padded_channels
        assert torch.equal(w.rotation_draws, layer.draws)
        for name, want in _expected_rank(layer, ext).items():
            assert torch.equal(getattr(w, name), want), (tp, rank, name)
        mem = layer.rank(tp, rank, pad=pad)
        for name, t in mem.tensors():
            assert torch.equal(t, getattr(w, name)), name


# --------------------------------------------------------------------------------------
# Bad files
# --------------------------------------------------------------------------------------


def _raw_file(path, layer, *, meta=None, fmt=None, shared=None, rows=None, atom_shape=None):
    """Write a layer file by hand (independent of qsrt.write_layer), with overrides."""
    g = layer.geometry
    stride = g.row_stride(2)
    metadata = {
        "format": "pt", "schema": "qsrt_kimi_k3_qsrt_atoms_v2", "version": "2",
        "encoding": "qsrt_sqg_e4m3", "codebook": "sqg_xor_cheb_t12", "profile": PROFILE,
        "profile_id": "3", "layer": str(layer.layer), "experts": str(g.num_experts),
        "intermediate_channels": str(g.intermediate), "latent_channels": str(g.hidden),
        "atom_channels": "32", "atom_slots": str(g.atom_slots), "alignment_bytes": "4096",
        "atom_slot_stride_bytes": str(stride),
        "p22_atom_bundle_bytes": str(qsrt.bundle_bytes(g.hidden, 2)),
        "residual_hadamard_block_size": "512", "preactivation_hadamard_block_size": "128",
        "postactivation_hadamard_block_size": "128",
        "intermediate_rotation_draws": f"format_section[{g.num_experts}:{2 * g.num_experts}]",
    }
    metadata.update(meta or {})
    fmt = layer.format_section() if fmt is None else fmt
    shared = layer.shared_scale_section() if shared is None else shared
    rows = layer.atom_rows() if rows is None else rows
    shape = list(atom_shape or rows.shape)
    doc = {"__metadata__": metadata,
           "_qsrt_format_section": {"dtype": "U8", "shape": [4096], "data_offsets": [0, 4096]},
           "_qsrt_shared_scale_section": {"dtype": "U8", "shape": [24576],
                                          "data_offsets": [4096, 28672]},
           "qsrt_atoms": {"dtype": "U8", "shape": shape,
                          "data_offsets": [28672, 28672 + rows.numel()]}}
    text = json.dumps(doc).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + fmt.numpy().tobytes()
                     + shared.numpy().tobytes() + rows.numpy().tobytes())
    return path


def test_hand_written_file_loads(tmp_path, layer_file):
    """The reader takes any standards-valid file, not only the writer's 4 KiB header."""
    layer = layer_file[2]
    path = _raw_file(tmp_path / "qsrt-layer-00003.safetensors", layer)
    assert torch.equal(qsrt.read_layer(path).fc1, layer.fc1)


def _bad_cases(layer):
    fmt_code = layer.format_section().clone()
    fmt_code[2] = 0x33
    fmt_draw = layer.format_section().clone()
    fmt_draw[4 + 1] = 9
    fmt_pad = layer.format_section().clone()
    fmt_pad[100] = 1
    shared_pad = layer.shared_scale_section().clone()
    shared_pad[-1] = 1
    shared_nan = layer.shared_scale_section().clone()
    shared_nan[0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)   # fp16 NaN
    rows = layer.atom_rows()
    wide = torch.zeros(rows.shape[0], rows.shape[1] + 4096, dtype=torch.uint8)
    wide[:, : rows.shape[1]] = rows
    return {
        "other profile's layout": ({"meta": {"profile": "k3x22_k4x2", "profile_id": "2"}},
                                   r"wrong stride: header atom_slot_stride_bytes is "
                                   r"'\d+', expected '\d+' for k3x22_k4x2"),
        "unknown profile": ({"meta": {"profile": "k4_uniform"}}, "unknown QSRT profile"),
        "profile id": ({"meta": {"profile_id": "4"}},
                       r"has id 3, the header says 4 \(k3x22_k4x2_coupled_h512_h128\)"),
        "schema": ({"meta": {"schema": "btx-atoms-v1"}}, "schema 'btx-atoms-v1'"),
        "codebook": ({"meta": {"codebook": "mcg"}}, "header codebook is 'mcg'"),
        "stride in header": ({"meta": {"atom_slot_stride_bytes": "53000"}}, "wrong stride"),
        "stride in tensor": ({"rows": wide, "meta": {"atom_slot_stride_bytes":
                                                      str(wide.shape[1])}}, "wrong stride"),
        "stride in shape only": ({"rows": wide}, "wrong stride: tensor qsrt_atoms"),
        "geometry": ({"meta": {"latent_channels": "384"}}, "not a multiple of the 512-wide"),
        "format code": ({"fmt": fmt_code},
                        r"expert 2 has format code 0x33 \(H308\), profile "
                        r"k2_coupled_h512_h128 needs 0x44 \(K2\)"),
        "draw": ({"fmt": fmt_draw}, "expert 1 has rotation draw 9"),
        "format padding": ({"fmt": fmt_pad}, "format section byte 100 is nonzero"),
        "shared padding": ({"shared": shared_pad}, "shared-scale section has nonzero padding"),
        "shared nan": ({"shared": shared_nan}, "shared vector w1.suh has non-finite values"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(qsrt.random_layer(LAYER, GEOM, seed=1))))
def test_bad_files_are_rejected(tmp_path, case):
    layer = qsrt.random_layer(LAYER, GEOM, seed=1)
    overrides, match = _bad_cases(layer)[case]
    path = _raw_file(tmp_path / "qsrt-layer-00003.safetensors", layer, **overrides)
    with pytest.raises(qsrt.QSRTFormatError, match=match):
        qsrt.load_layer(path, tp_size=8, tp_rank=0)


def test_truncated_file_is_rejected(tmp_path, layer_file):
    root, path, _ = layer_file
    raw = path.read_bytes()
    for keep in (len(raw) - 1, qsrt.ATOM_SLAB_OFFSET + 10, 3000, 5):
        cut = tmp_path / f"cut{keep}" / path.name
        cut.parent.mkdir()
        cut.write_bytes(raw[:keep])
        with pytest.raises(qsrt.QSRTFormatError, match="truncated file"):
            qsrt.load_layer(cut, tp_size=8, tp_rank=0)
    # Through the manifest the size disagreement is caught before the file is opened.
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / path.name).write_bytes(raw[:-4096])
    (tmp_path / "root" / qsrt.MANIFEST_FILE).write_text((root / qsrt.MANIFEST_FILE).read_text())
    with pytest.raises(qsrt.QSRTFormatError, match="truncated or resized file"):
        qsrt.load_layer(tmp_path / "root", layer=LAYER, tp_size=8, tp_rank=0)


def test_late_errors_still_load_nothing(tmp_path, layer_file):
    """Row padding and spans are checked on the rank's rows, before weights are built."""
    layer = layer_file[2]
    rows = layer.atom_rows()
    payload = GEOM.num_experts * qsrt.bundle_bytes(512, 2)
    rows[13, payload + 5] = 1                      # padding of atom 13: rank 1 of TP8
    path = _raw_file(tmp_path / "qsrt-layer-00003.safetensors", layer, rows=rows)
    qsrt.load_layer(path, tp_size=8, tp_rank=0)    # rank 0 never reads atom 13
    with pytest.raises(qsrt.QSRTFormatError, match="atom row 13 has nonzero padding"):
        qsrt.load_layer(path, tp_size=8, tp_rank=1, device="meta")
    rows = layer.atom_rows()
    base = qsrt.bundle_bytes(512, 2) - 2           # expert 0's last down.suh value
    rows[50, base: base + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)   # fp16 inf
    path = _raw_file(tmp_path / "qsrt-layer-00003.safetensors", layer, rows=rows)
    with pytest.raises(qsrt.QSRTFormatError, match="atom 50, expert 0: non-finite"):
        qsrt.load_layer(path, tp_size=8, tp_rank=4)


def test_manifest_and_layer_identity_errors(tmp_path, layer_file):
    root, path, _ = layer_file
    with pytest.raises(qsrt.QSRTFormatError, match="file holds layer 3, layer 4 was requested"):
        qsrt.read_header(path, layer=4)
    with pytest.raises(qsrt.QSRTFormatError, match="manifest has no entry for layer 5"):
        qsrt.load_layer(root, layer=5, tp_size=8, tp_rank=0)
    with pytest.raises(qsrt.QSRTFormatError, match="pass layer="):
        qsrt.load_layer(root, tp_size=8, tp_rank=0)
    with pytest.raises(qsrt.QSRTFormatError, match="cannot read the manifest"):
        qsrt.load_layer(tmp_path, layer=3, tp_size=8, tp_rank=0)
    with pytest.raises(qsrt.QSRTFormatError, match="tp_rank 12 is out of range"):
        qsrt.load_layer(path, tp_size=12, tp_rank=12)
    other = json.loads((root / qsrt.MANIFEST_FILE).read_text())
    other["profile"] = "k3x22_k4x2"
    (tmp_path / qsrt.MANIFEST_FILE).write_text(json.dumps(other))
    (tmp_path / path.name).write_bytes(path.read_bytes())
    with pytest.raises(qsrt.QSRTFormatError, match="file profile 'k2_coupled_h512_h128' differs "
                                                   "from the manifest's 'k3x22_k4x2'"):
        qsrt.load_layer(tmp_path, layer=3, tp_size=8, tp_rank=0)


# --------------------------------------------------------------------------------------
# Coupled weights and the coupled reference
# --------------------------------------------------------------------------------------


def test_coupled_weight_validation():
    w = MoEWeights.random(2, 512, 256, 2, "sqg_e4m3", shared_hidden_vectors=True, coupled=True)
    assert w.coupled and w.pre_signs.shape == (2, 512) and w.post_signs.shape == (2, 256)
    assert torch.equal(w.gate_suh, w.up_suh)
    fields = {n: t for n, t in w.tensors()}
    base = dict(codebook="sqg_e4m3", **fields)
    with pytest.raises(ValueError, match="pre_signs and post_signs must both be given"):
        MoEWeights(pre_signs=w.pre_signs, **base)
    with pytest.raises(ValueError, match=r"pre_signs must hold only \+1 / -1"):
        MoEWeights(pre_signs=w.pre_signs * 2, post_signs=w.post_signs, **base)
    with pytest.raises(ValueError, match="gate_suh must equal up_suh"):
        MoEWeights(pre_signs=w.pre_signs, post_signs=w.post_signs,
                   **{**base, "up_suh": -w.up_suh})
    with pytest.raises(ValueError, match=r"post_signs must have shape \(2, 256\)"):
        MoEWeights(pre_signs=w.pre_signs, post_signs=w.post_signs[:, :128], **base)
    with pytest.raises(ValueError, match="profile 'k2_coupled_h512_h128' needs coupled sign"):
        MoEWeights(profile=PROFILE, **base)
    with pytest.raises(ValueError, match="need shared_hidden_vectors"):
        MoEWeights.random(2, 512, 256, 2, "sqg_e4m3", coupled=True)
    moved = w.to("cpu")
    assert moved.coupled and torch.equal(moved.rotation_draws, w.rotation_draws)


@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_coupled_reference_equals_naive_loop(activation):
    w = MoEWeights.random(3, 512, 256, 2, "sqg_e4m3", shared_hidden_vectors=True, coupled=True,
                          seed=4)
    assert {int(d) for d in w.rotation_draws} != {0}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(6)])
    tw = torch.rand(6, 2, generator=gen)
    ref = reference.reference_moe(x, ids, tw, w, activation=activation, dtype=torch.float64)
    naive = reference.naive_moe(x, ids, tw, w, activation=activation, dtype=torch.float64)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ref, naive, rtol=1e-10, atol=1e-12)
    # The coupled transforms matter: the same codes read uncoupled give another layer.
    plain = MoEWeights(codebook="sqg_e4m3", **dict(w.tensors()))
    other = reference.reference_moe(x, ids, tw, plain, activation=activation, dtype=torch.float64)
    assert (other - ref).abs().max() > 0.1 * ref.abs().max()


def _global_layer_statement(layer, x, ids, tw):
    """The whole layer in global coordinates (w1.suh / w3.suh halves, global signs)."""
    g = layer.geometry
    h128, i = tc.rotate_blocks, g.intermediate
    z = tc.rotate_h512(x)
    a = torch.cat([tc.rotate_blocks(z * layer.w1_suh.double())[:, None],
                   tc.rotate_blocks(z * layer.w3_suh.double())[:, None]], dim=1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            fc1 = tc.decode(layer.fc1[e], "sqg_e4m3").double()
            raw = torch.cat([a[t, 0] @ fc1[:, :i], a[t, 1] @ fc1[:, i:]])
            draw = int(layer.draws[e])
            pre = h128(h128(raw) * layer.fc1_svh[e].double()) * \
                qsrt.rotation_signs(2 * i, draw, 1).double()
            h = reference.activation_fn("situ")(pre[0::2], pre[1::2]) * \
                qsrt.rotation_signs(i, draw, 2).double()
            d = h128(h128(h) * layer.fc2_suh[e].double())
            y = h128(d @ tc.decode(layer.fc2[e], "sqg_e4m3").double()) * layer.w2_svh.double()
            out[t] += tw[t, k].double() * y
    return tc.rotate_h512(out)


@pytest.mark.slow
def test_rank_outputs_sum_to_the_whole_layer(layer_file):
    """Sum over TP ranks of the coupled reference == the whole layer's statement: checks the
    rank split, the per-half input vector, the sign slices and TP9's zero padding."""
    _, path, layer = layer_file
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(3)])
    tw = torch.rand(3, 2, generator=gen)
    whole = _global_layer_statement(layer, x, ids, tw)
    assert whole.abs().max() > 0.1
    for tp in (8, 9):
        total = sum(reference.reference_moe(x, ids, tw, qsrt.load_layer(path, tp_size=tp, tp_rank=r),
                                            activation="situ", dtype=torch.float64)
                    for r in range(tp))
        torch.testing.assert_close(total, whole, rtol=1e-9, atol=1e-11)

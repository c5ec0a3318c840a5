"""Tests for kquant_cute.qsrt.model (load_model: a model directory's rank, checked against
its completion record and manifest) and the writer's records and file modes (CPU only)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading

import pytest
import torch

from kquant_cute import qsrt

GEOM = qsrt.Geometry(4, 512, 3072)
LAYERS = (1, 2, 3)
TP = (8, 3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qsrt_model")
    base = qsrt.random_layer(1, GEOM, seed=11)
    for n in LAYERS:
        layer = base if n == 1 else qsrt.random_layer(n, GEOM, seed=11 + n)
        qsrt.write_layer(root, layer)
    qsrt.write_completion(root)
    return root


@pytest.fixture
def copy_dir(model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(model_dir, dst)
    return dst


def _equal(a, b) -> bool:
    fields = dict(a.tensors()) | {n: getattr(a, n) for n in ("pre_signs", "post_signs",
                                                             "rotation_draws")}
    return all(torch.equal(t, getattr(b, n)) if t is not None else getattr(b, n) is None
               for n, t in fields.items())


def _edit(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "qsrt-load-model-reader"]


# --------------------------------------------------------------------------------------
# The writer's records
# --------------------------------------------------------------------------------------


def test_completion_record_lists_every_layer_with_size_and_digest(model_dir):
    doc = json.loads((model_dir / qsrt.COMPLETION_FILE).read_text())
    assert doc["kind"] == "kquant_kimi_k3_qsrt_completion" and doc["schema_version"] == 2
    assert doc["complete"] is True and doc["layer_count"] == len(LAYERS)
    assert doc["profile"] == qsrt.PRODUCTION_PROFILE and doc["storage_schema"] in qsrt.SCHEMAS
    assert len(doc["candidate_pool_content_sha256"]) == 64
    assert doc["layer_bytes"] == sum(e["bytes"] for e in doc["layers"].values())
    for n in LAYERS:
        entry = doc["layers"][str(n)]
        data = (model_dir / entry["file"]).read_bytes()
        assert entry["file"] == f"qsrt-layer-{n:05d}.safetensors"
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_take_the_umask_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        qsrt.write_layer(tmp_path, qsrt.random_layer(1, qsrt.Geometry(2, 512, 512), seed=1))
        qsrt.write_completion(tmp_path)
    finally:
        os.umask(old)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [qsrt.COMPLETION_FILE, "qsrt-layer-00001.safetensors", qsrt.MANIFEST_FILE]
    for p in tmp_path.iterdir():
        assert p.stat().st_mode & 0o777 == mode, p.name


def test_write_completion_needs_the_manifest(tmp_path):
    with pytest.raises(qsrt.QSRTFormatError, match="write the layers first"):
        qsrt.write_completion(tmp_path)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["size", "sha256"])
def test_load_model_equals_load_layer_of_each_layer(model_dir, verify):
    got = qsrt.load_model(model_dir, tp_size=TP[0], tp_rank=TP[1], verify=verify)
    assert sorted(got) == list(LAYERS)
    for n in LAYERS:
        want = qsrt.load_layer(model_dir, layer=n, tp_size=TP[0], tp_rank=TP[1])
        assert _equal(got[n], want), n
    # the layers differ (a rank of each file, not one file loaded three times)
    assert not torch.equal(got[1].gate_trellis, got[2].gate_trellis)
    assert not _readers()


def test_load_model_takes_a_subset_and_the_tp9_rotation(model_dir):
    got = qsrt.load_model(model_dir, tp_size=9, tp_rank=0, layers=[3, 2, 3])
    assert sorted(got) == [2, 3]
    for n in (2, 3):
        ext = qsrt.rank_extent(qsrt.PRODUCTION_PROFILE, GEOM, n, 9, 0)
        assert got[n].intermediate == ext.padded_channels
        assert _equal(got[n], qsrt.load_layer(model_dir, layer=n, tp_size=9, tp_rank=0))


def test_progress_bar_only_when_asked_or_on_a_terminal(model_dir, capsys):
    qsrt.load_model(model_dir, tp_size=2, tp_rank=1, layers=[1])
    assert capsys.readouterr().err == ""           # stderr is not a terminal under pytest
    qsrt.load_model(model_dir, tp_size=2, tp_rank=1, layers=[1], progress=True)
    assert "qsrt layers" in capsys.readouterr().err


def test_truncated_file(copy_dir):
    path = copy_dir / "qsrt-layer-00002.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 4096)
    with pytest.raises(qsrt.QSRTFormatError,
                       match=rf"qsrt-layer-00002.safetensors: truncated file: {size - 4096} "
                             rf"bytes, qsrt-completion.json field layers.2.bytes says {size}"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_size_mismatch(copy_dir):
    with open(copy_dir / "qsrt-layer-00003.safetensors", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(qsrt.QSRTFormatError,
                       match=r"qsrt-layer-00003.safetensors: size mismatch: .* field "
                             r"layers.3.bytes"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)
    _edit(copy_dir / qsrt.COMPLETION_FILE, lambda d: d["layers"]["1"].update(bytes=12345))
    with pytest.raises(qsrt.QSRTFormatError, match=r"size mismatch: field "
                                                   r"layers.1.atom_disk_bytes is \d+, "
                                                   r"qsrt-completion.json field layers.1.bytes"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_digest_mismatch_is_caught_by_sha256_only(copy_dir):
    path = copy_dir / "qsrt-layer-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[qsrt.ATOM_SLAB_OFFSET + 100] ^= 0x01        # a code bit of atom 0: still a valid file
    path.write_bytes(bytes(data))
    got = qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, layers=[2])
    assert 2 in got                                   # size-only verification loads it
    with pytest.raises(qsrt.QSRTFormatError,
                       match=r"qsrt-layer-00002.safetensors: digest mismatch: sha256 [0-9a-f]{64}, "
                             r"the records' field layers.2.sha256 says"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, verify="sha256")
    assert not _readers()


def test_sha256_needs_a_digest_and_agreeing_records(copy_dir):
    def drop(d):
        for e in d["layers"].values():
            e.pop("sha256")

    _edit(copy_dir / qsrt.COMPLETION_FILE, drop)
    _edit(copy_dir / qsrt.MANIFEST_FILE, drop)
    assert len(qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)) == 3
    with pytest.raises(qsrt.QSRTFormatError, match="verify='sha256', but neither "
                                                   "qsrt-completion.json nor qsrt-manifest.json "
                                                   "carries a field layers.1.sha256"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, verify="sha256")
    _edit(copy_dir / qsrt.MANIFEST_FILE, lambda d: d["layers"]["1"].update(sha256="0" * 64))
    _edit(copy_dir / qsrt.COMPLETION_FILE, lambda d: d["layers"]["1"].update(sha256="1" * 64))
    with pytest.raises(qsrt.QSRTFormatError, match="digest mismatch: field layers.1.sha256 "
                                                   "differs between"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_missing_layer(copy_dir):
    with pytest.raises(qsrt.QSRTFormatError, match="missing layer 7: the completion record "
                                                   "lists layers 1..3"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, layers=[1, 7])
    (copy_dir / "qsrt-layer-00003.safetensors").unlink()
    with pytest.raises(qsrt.QSRTFormatError, match=r"qsrt-layer-00003.safetensors: missing "
                                                   r"layer 3: the file does not exist"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)
    _edit(copy_dir / qsrt.MANIFEST_FILE, lambda d: d["layers"].pop("2"))
    with pytest.raises(qsrt.QSRTFormatError, match="missing layer 2: the manifest has no entry"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, layers=[2])


def test_wrong_profile(copy_dir):
    with pytest.raises(qsrt.QSRTFormatError, match="wrong profile: field profile is "
                                                   "'k2_coupled_h512_h128', 'k3x22_k4x2' was "
                                                   "requested"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, profile="k3x22_k4x2")
    assert qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, layers=[1],
                           profile=qsrt.PRODUCTION_PROFILE)
    _edit(copy_dir / qsrt.MANIFEST_FILE, lambda d: d.update(profile="k3x22_k4x2"))
    with pytest.raises(qsrt.QSRTFormatError, match=r"qsrt-manifest.json: wrong profile: field "
                                                   r"profile is 'k3x22_k4x2', "
                                                   r"qsrt-completion.json says"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_a_file_of_another_profile_is_refused(copy_dir, tmp_path):
    # A mixed-profile layer 2 in place of the K=2 one, the records updated to its size.
    other = tmp_path / "other"
    geom = qsrt.Geometry(2, 512, 3072)
    path = qsrt.write_layer(other, qsrt.random_layer(2, geom, profile="k3x22_k4x2", seed=1))
    shutil.copy(path, copy_dir / path.name)
    size = path.stat().st_size
    _edit(copy_dir / qsrt.COMPLETION_FILE, lambda d: d["layers"]["2"].update(bytes=size))
    _edit(copy_dir / qsrt.MANIFEST_FILE,
          lambda d: d["layers"]["2"].update(atom_disk_bytes=size))
    with pytest.raises(qsrt.QSRTFormatError, match=r"qsrt-layer-00002.safetensors: wrong "
                                                   r"profile: the file holds 'k3x22_k4x2'"):
        qsrt.load_model(copy_dir, tp_size=4, tp_rank=0)


@pytest.mark.parametrize("field, value, message", [
    ("kind", "other", r"field 'kind' is 'other', expected 'kquant_kimi_k3_qsrt_completion'"),
    ("schema_version", 1, "field 'schema_version' is 1, expected 2"),
    ("complete", False, "field 'complete' is False, expected true"),
    ("storage_schema", "v1", "field 'storage_schema' is 'v1'"),
    ("candidate_pool_content_sha256", "abc", "field 'candidate_pool_content_sha256' is 'abc'"),
    ("layer_count", 92, r"field 'layer_count' is 92, expected 3"),
    ("profile", "nope", "unknown QSRT profile 'nope'"),
])
def test_completion_record_fields_are_checked(copy_dir, field, value, message):
    _edit(copy_dir / qsrt.COMPLETION_FILE, lambda d: d.update({field: value}))
    with pytest.raises(qsrt.QSRTFormatError, match=message):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_production_schema_name_is_accepted(copy_dir):
    _edit(copy_dir / qsrt.COMPLETION_FILE,
          lambda d: d.update(storage_schema="kquant_kimi_k3_qsrt_atoms_v2"))
    assert len(qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, layers=[1])) == 1


def test_missing_records_and_bad_arguments(copy_dir):
    with pytest.raises(qsrt.QSRTFormatError, match="verify must be one of"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0, verify="md5")
    with pytest.raises(qsrt.QSRTFormatError, match="tp_rank 8 is out of range for tp_size 8"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=8)
    with pytest.raises(qsrt.QSRTFormatError, match="tp_size 3 is not supported"):
        qsrt.load_model(copy_dir, tp_size=3, tp_rank=0)
    (copy_dir / qsrt.COMPLETION_FILE).unlink()
    with pytest.raises(qsrt.QSRTFormatError, match="qsrt-completion.json: cannot read the "
                                                   "completion record"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)


def test_an_error_mid_stream_returns_nothing_and_stops_the_reader(copy_dir):
    # Layer 3 keeps its size but has nonzero padding after atom row 0's bundles: the error
    # comes from the row check after layers 1 and 2 were built.
    path = copy_dir / "qsrt-layer-00003.safetensors"
    data = bytearray(path.read_bytes())
    payload = GEOM.num_experts * qsrt.bundle_bytes(GEOM.hidden, 2)
    data[qsrt.ATOM_SLAB_OFFSET + payload] = 1
    path.write_bytes(bytes(data))
    with pytest.raises(qsrt.QSRTFormatError, match="atom row 0 has nonzero padding"):
        qsrt.load_model(copy_dir, tp_size=8, tp_rank=0)
    assert not _readers()


@pytest.mark.gpu
def test_load_model_onto_the_gpu_equals_load_layer_moved(model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (load_model(device='cuda'))")
    got = qsrt.load_model(model_dir, tp_size=9, tp_rank=4, device="cuda")
    for n in LAYERS:
        assert got[n].device.type == "cuda"
        want = qsrt.load_layer(model_dir, layer=n, tp_size=9, tp_rank=4, device="cuda")
        assert _equal(got[n], want), n
    assert not _readers()

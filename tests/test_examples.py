"""The examples run: examples/qsrt_serve_rank.py end to end on the CPU (writes a synthetic
QSRT model directory, loads one TP rank with qsrt.load_model, runs the op)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qsrt_serve_rank_example(tmp_path, capsys):
    example = _load("qsrt_serve_rank")
    assert example.main(["--dir", str(tmp_path), "--layers", "1", "--experts", "4",
                         "--topk", "2", "--tp-size", "8", "--tp-rank", "5",
                         "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "loaded TP rank 5 of 8: layers [1]" in out
    assert "layer 1: MoEWeights I/rank=384, output (5, 512) torch.float32" in out
    assert (tmp_path / "qsrt-completion.json").exists()

"""The benchmark's markdown table (benchmarks/bench_moe.py), on synthetic rows: no GPU."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import bench_moe  # noqa: E402


def _row(tokens, m8, m32, peer=None):
    row = {"tokens": tokens, "M8": m8, "M32": m32, "plan": 1.0, "plan_M": 32,
           "banded": 0.5, "banded_M": 32}
    if peer is not None:
        row.update(peer=peer, hbm_floor=0.1, mma_floor=0.2, decode_floor=0.25)
    return row


def test_table_columns_line_up_and_ratios_are_ours_over_peer():
    rows = [_row(1536, 2.0, 0.5, peer=2.0), _row(16, None, 0.4, 2.0)]
    rows[0]["bitwise_equal"] = True
    lines = bench_moe.format_table(rows, [8, 32], with_peer=True)
    assert len({line.count("|") for line in lines}) == 1  # header, rule and rows align
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == ["1536", "2.000", "0.500", "1.000 (32)", "0.500 (32)"]
    assert cells[-5:] == ["0.50", "0.25", "2.00", "4.00", "yes"]  # plan/peer, banded/peer,
    # /decode, M8/banded, every column's output bitwise equal
    assert lines[3].split("|")[2].strip() == "-"  # an M that did not bind
    assert [c.strip() for c in lines[3].strip(" |").split("|")][-2:] == ["-", "-"]  # no M8 ratio,
    # no equality check recorded


def test_table_without_peer_has_no_floor_columns():
    lines = bench_moe.format_table([_row(128, 1.0, 0.5)], [8, 32], with_peer=False)
    assert "bf16 peer" not in lines[0] and lines[0].count("|") == lines[2].count("|") == 7


def test_one_command_runs_the_extra_k_tables(monkeypatch, tmp_path):
    """`--extra-bits 2 3` runs K=4 over the given tokens, then K=2 and K=3 at 16 and 1,536
    tokens with M = 8, 32, and writes all of them into the JSON (GPU parts stubbed)."""
    import json

    import torch

    import kquant_cute.weights as weights

    class Weights:
        def __init__(self, bits):
            self.bits = bits

    calls = []

    def run_table(wts, tokens, blocks, **kw):
        calls.append((wts.bits, tokens, blocks))
        return [{"tokens": t, **{f"M{M}": 1.0 for M in blocks}, "plan": 1.0, "plan_M": 8,
                 "banded": 1.0, "banded_M": 8} for t in tokens]

    monkeypatch.setattr(weights.MoEWeights, "random", staticmethod(lambda *a, **k: Weights(a[3])))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_moe, "run_table", run_table)
    out = tmp_path / "k.json"
    assert bench_moe.main(["--tokens", "16", "4096", "--extra-bits", "2", "3", "--json", str(out)]) == 0
    assert calls == [(4, [16, 4096], [8, 16, 32, 48, 64]), (2, [16, 1536], [8, 32]),
                     (3, [16, 1536], [8, 32])]
    result = json.loads(out.read_text())
    assert result["bits"] == 4 and [r["tokens"] for r in result["rows"]] == [16, 4096]
    assert result["codebook"] == "mcg"  # the reference geometry's; --codebook changes it
    assert sorted(result["extra"]) == ["2", "3"]


def test_qsrt_table_ratios_and_bitwise_column():
    import bench_qsrt  # noqa: E402 (imports bench_moe / peers: torch only, no GPU use)

    row = {"tokens": 1536, "mcg_k4": 1.5, "mcg_k4_M": 32, "qsrt_k2_coupled": 3.0,
           "qsrt_k2_coupled_M": 32, "peer": 6.0, "qsrt_k2_coupled_decode": 1.9,
           "mcg_k4_decode": 0.8, "mcg_k4_bitwise": True, "qsrt_k2_coupled_bitwise": False}
    lines = bench_qsrt.format_table([row, dict(row, qsrt_k2_coupled_bitwise=True)])
    assert len({line.count("|") for line in lines}) == 1
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["1,536", "1.500 (32)", "3.000 (32)", "2.00x", "6.000", "2.00x", "1.900",
                     "0.800", "NO"]  # QSRT / mcg, peer / QSRT; one layer not bitwise: NO
    assert lines[3].rstrip(" |").endswith("yes")

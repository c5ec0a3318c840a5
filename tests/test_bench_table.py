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
    lines = bench_moe.format_table([_row(1536, 2.0, 0.5, peer=2.0), _row(16, None, 0.4, 2.0)],
                                   [8, 32], with_peer=True)
    assert len({line.count("|") for line in lines}) == 1  # header, rule and rows align
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == ["1536", "2.000", "0.500", "1.000 (32)", "0.500 (32)"]
    assert cells[-4:] == ["0.50", "0.25", "2.00", "4.00"]  # plan/peer, banded/peer, /decode, M8/
    assert lines[3].split("|")[2].strip() == "-"  # an M that did not bind
    assert lines[3].rstrip(" |").endswith("-")  # no M8 -> no M8 ratio


def test_table_without_peer_has_no_floor_columns():
    lines = bench_moe.format_table([_row(128, 1.0, 0.5)], [8, 32], with_peer=False)
    assert "bf16 peer" not in lines[0] and lines[0].count("|") == lines[2].count("|") == 6

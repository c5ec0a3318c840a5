"""Plot a `bench_moe.py --json` result as a PNG (needs matplotlib, a benchmark-only tool).

    python benchmarks/plot_bench.py results.json k4.png

Lines: our forward per route block M, the plan pair, the banded plan, the bf16 grouped-GEMM
peer, the HBM / MMA floors and the measured decode-only ceiling, milliseconds over tokens
(log-log).
"""

from __future__ import annotations

import json
import sys


#: Plots are drawn at this resolution and stored as palette PNGs of this many colours: the
#: docs' plots travel with the tree to the GPU machine, whose upload limit leaves little room.
DPI, COLOURS = 80, 64


def save_small(fig, path: str) -> None:
    """Save `fig` at `DPI` as a `COLOURS`-colour palette PNG (Pillow comes with matplotlib)."""
    from PIL import Image

    fig.savefig(path, dpi=DPI)
    Image.open(path).convert("RGB").quantize(colors=COLOURS).save(path, optimize=True)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in sorted(k for k in rows[0] if k.startswith("M") and k[1:].isdigit()):
        ys = [r.get(key) for r in rows]
        ax.plot(tokens, ys, marker=".", linewidth=1, alpha=0.6, label=f"ours M={key[1:]}")
    for key, style, label in (("plan", "o-", "ours, plan pair"), ("banded", "s-", "ours, banded plan"),
                              ("peer", "k^-", "bf16 torch._grouped_mm"),
                              ("hbm_floor", "k--", "HBM floor"), ("mma_floor", "k:", "MMA floor"),
                              ("decode_floor", "r-.", "decode-only kernel (measured)")):
        if key in rows[0]:
            ax.plot(tokens, [r[key] for r in rows], style, linewidth=2 if key in ("banded", "peer") else 1.2,
                    label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("ms per layer (CUDA-graph replay)")
    ax.set_title(f"W4A16 trellis MoE, Kimi-K3 TP8 shard, {data.get('device', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_small(fig, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

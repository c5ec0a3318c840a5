"""Whole-model QSRT loading speed and host memory: `kquant_cute.qsrt.load_model` against a
plain sequential read of the same bytes, on a synthetic model directory.

    python benchmarks/bench_load.py --root /tmp/qsrt-bench            # write (once) + measure
    python benchmarks/bench_load.py --root /tmp/qsrt-bench --experts 4 --layers 92 --tp 8 2

The directory (92 layers of Kimi-K3's latent and atom axes at a reduced expert count,
written by `qsrt.write_layer` / `qsrt.write_completion`) is written on the first run. Each
measurement runs in a fresh subprocess: after the imports it records VmRSS (the baseline),
evicts the directory's pages from the page cache (`posix_fadvise(DONTNEED)` on each file:
cold reads; `--warm` keeps them), times one pass and reports VmHWM - baseline (the peak host
memory the pass added) next to the bytes the loaded weights hold. "plain" reads exactly the
byte ranges load_model reads (the rank's rows of every layer; with sha256, every whole file)
with `os.preadv` into one reused buffer and does nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def write_model(root: Path, experts: int, layers: int) -> None:
    from kquant_cute import qsrt

    if (root / qsrt.COMPLETION_FILE).exists():
        doc = json.loads((root / qsrt.COMPLETION_FILE).read_text())
        if doc["layer_count"] == layers:
            return
    geom = qsrt.Geometry(experts, qsrt.KIMI_K3.hidden, qsrt.KIMI_K3.intermediate)
    base = qsrt.random_layer(1, geom, seed=1)
    t0 = time.perf_counter()
    for n in range(1, layers + 1):
        # One layer's codes under every layer number: the bytes differ only in the header,
        # which is all the loader's speed and memory depend on.
        qsrt.write_layer(root, dataclasses.replace(base, layer=n))
    qsrt.write_completion(root)
    total = sum(p.stat().st_size for p in root.glob("qsrt-layer-*.safetensors"))
    print(f"wrote {layers} layers, {total / 1e9:.2f} GB, in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)


def _ranges(root: Path, tp: int, rank: int, whole: bool) -> list[tuple[Path, int, int]]:
    from kquant_cute import qsrt
    from kquant_cute.qsrt.read import rank_byte_range

    out = []
    doc = json.loads((root / qsrt.COMPLETION_FILE).read_text())
    for key in sorted(doc["layers"], key=int):
        path = root / doc["layers"][key]["file"]
        if whole:
            out.append((path, 0, path.stat().st_size))
            continue
        h = qsrt.read_header(path)
        ext = qsrt.rank_extent(h.profile, h.geometry, h.layer, tp, rank)
        out.append((path, *rank_byte_range(h, ext)))
    return out


def _evict(root: Path) -> None:
    for p in root.glob("qsrt-layer-*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(kind: str, root: Path, tp: int, rank: int, verify: str, warm: bool) -> dict:
    import torch

    from kquant_cute import qsrt

    torch.set_num_threads(1)
    ranges = _ranges(root, tp, rank, whole=verify == "sha256")
    nbytes = sum(n for _, _, n in ranges)
    if not warm:
        _evict(root)
    base = _status("VmRSS")
    held = 0
    t0 = time.perf_counter()
    if kind == "load_model":
        got = qsrt.load_model(root, tp_size=tp, tp_rank=rank, verify=verify, progress=False)
        seconds = time.perf_counter() - t0
        held = sum(t.numel() * t.element_size() for w in got.values() for _, t in w.tensors())
        layers = len(got)
    else:
        buf = bytearray(max(n for _, _, n in ranges))
        view = memoryview(buf)
        for path, offset, n in ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < n:
                    done += os.preadv(fd, [view[done:n]], offset + done)
            finally:
                os.close(fd)
        seconds = time.perf_counter() - t0
        layers = len(ranges)
    peak = _status("VmHWM") - base
    return {"kind": kind, "tp": tp, "rank": rank, "verify": verify, "cache": "warm" if warm else "cold",
            "layers": layers, "bytes_read": nbytes, "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9, "peak_rss_above_baseline": peak,
            "weights_bytes": held}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/qsrt-bench"))
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--layers", type=int, default=92)
    p.add_argument("--tp", type=int, nargs="+", default=[8, 2])
    p.add_argument("--warm", action="store_true", help="keep the page cache (default: evict)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--measure", nargs=5, metavar=("KIND", "ROOT", "TP", "RANK", "VERIFY"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.measure:
        kind, root, tp, rank, verify = a.measure
        print(json.dumps(measure(kind, Path(root), int(tp), int(rank), verify, a.warm)))
        return 0
    a.root.mkdir(parents=True, exist_ok=True)
    write_model(a.root, a.experts, a.layers)
    rows = []
    for tp in a.tp:
        for verify in ("size", "sha256") if tp == a.tp[0] else ("size",):
            for _ in range(a.repeat):
                for kind in ("plain", "load_model"):
                    cmd = [sys.executable, __file__, "--measure", kind, str(a.root), str(tp), "0",
                           verify] + (["--warm"] if a.warm else [])
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                    rows.append(json.loads(out.stdout))
                    print(out.stdout.strip(), flush=True)
    print("\n| TP (rank 0) | verify | MB read | plain GB/s | load_model GB/s | load_model peak RSS "
          "above baseline (MB) | of which the loaded weights (MB) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for tp in a.tp:
        for verify in ("size", "sha256"):
            sel = [r for r in rows if r["tp"] == tp and r["verify"] == verify]
            if not sel:
                continue
            best = {k: max((r for r in sel if r["kind"] == k), key=lambda r: r["gb_per_s"])
                    for k in ("plain", "load_model")}
            lm = best["load_model"]
            print(f"| {tp} | {verify} | {lm['bytes_read'] / 1e6:,.0f} | "
                  f"{best['plain']['gb_per_s']:.2f} | {lm['gb_per_s']:.2f} | "
                  f"{lm['peak_rss_above_baseline'] / 1e6:,.0f} | {lm['weights_bytes'] / 1e6:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

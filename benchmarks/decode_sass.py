"""Decode cost per weight from the SASS of the decode-only kernel (CPU only, no GPU).

    python benchmarks/decode_sass.py [--arch sm_90a] [--codebooks mcg 3inst mul1] [--bits 2 3 4 5 6]
                                     [--pair-table] [--t12]

Cross-compiles the decode-only probe (`decode_probe.py`) per (codebook, K), disassembles the cubin
(cuobjdump + nvdisasm from the nvidia-cuda-* wheels or CUDA_HOME) and counts the
instructions of its main loop, which decodes 64 weights per thread per iteration (plus
0.5 packed fp16 adds per weight for the checksum). Prints a markdown table: all
instructions per weight, ALU-pipe instructions per weight (integer logic, shifts, byte
permutes, compares) and the most frequent opcodes. The decode-only kernel is ALU-pipe-bound
on the H200 (docs/benchmarks.md), so the ALU column predicts relative decode speed.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

ALU_OPS = ("LOP3", "PRMT", "SHF", "IADD3", "SEL", "ISETP", "LEA", "FLO", "POPC")
_INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)")


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode counts of the longest backward-branch loop of the first function."""
    ops = [(int(m.group(1), 16), m.group(2) + m.group(3), line)
           for line in sass.splitlines() if (m := _INST.search(line))]
    loops = []
    for off, op, line in ops:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", line.split("BRA", 1)[1])
            if t and int(t.group(1), 16) < off:
                loops.append((int(t.group(1), 16), off))
    if not loops:
        raise RuntimeError("no loop found in the SASS")
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return collections.Counter(op for off, op, _ in ops if lo <= off <= hi)


def main(argv=None) -> int:
    from decode_probe import compile_decode

    from kquant_cute.kernels.build import dump_sass, find_cuobjdump, find_nvdisasm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--codebooks", nargs="+", default=["mcg", "3inst", "mul1"])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    p.add_argument("--pair-table", action="store_true",
                   help="sqg_e4m3 K=2 through the 128 KiB pair table (the sm_90a GEMM's decode)")
    p.add_argument("--t12", action="store_true",
                   help="sqg_e4m3 through T12 + bijection (MoESpec.table_decode 't12')")
    a = p.parse_args(argv)
    if find_cuobjdump() is None or find_nvdisasm() is None:
        print("cuobjdump or nvdisasm not found (pip install -e \".[test]\")")
        return 2
    print("| codebook | K | table | loop instructions / 64 weights | per weight | ALU per weight "
          "| shared loads per weight | top opcodes |")
    print("|---|---|---|---|---|---|---|---|")
    for cb in a.codebooks:
        for bits in a.bits:
            pair = a.pair_table and cb == "sqg_e4m3" and bits == 2
            t12 = a.t12 and cb == "sqg_e4m3" and not pair
            table = ("pair" if pair else "t12" if t12 else "direct") if cb == "sqg_e4m3" else "-"
            with tempfile.TemporaryDirectory(prefix="kq_sass_") as tmp:
                compile_decode(k_dim=3584, n_dim=384, bits=bits, codebook=cb, arch=a.arch,
                               min_ctas_per_sm=8, cubin_dir=tmp, pair_table=pair,
                               table_decode="t12" if t12 else "direct")
                (cubin,) = glob.glob(os.path.join(tmp, "*.cubin"))
                sass = dump_sass(cubin)
            ops = loop_opcodes(sass)
            total = sum(ops.values())
            alu = sum(n for op, n in ops.items() if op.split(".")[0] in ALU_OPS)
            lds = sum(n for op, n in ops.items() if op.split(".")[0] == "LDS")
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
            print(f"| {cb} | {bits} | {table} | {total} | {total / 64:.2f} | {alu / 64:.2f} "
                  f"| {lds / 64:.3f} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

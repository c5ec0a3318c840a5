"""SASS hashes of a fixed set of fused-forward specializations (CPU only, no GPU).

    python benchmarks/sass_hashes.py [--out hashes.json] [--check hashes.json] [--only NAME ...]

Cross-compiles each specialization of `SPECS` for its arch, disassembles every kernel of
its cubin (`cuobjdump -sass`, which needs nvdisasm: both come with the `[test]` extra) and
prints one sha256 per specialization over the SASS text with the cubin's file name and
the DSL's per-compile function suffixes removed. A refactor that must not change the
generated code (moving modules, renaming arguments) is checked by comparing two runs:
`--check` exits 1 when any hash differs. The decode-only probe of the benchmarks is
hashed too (`decode_probe`).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import tempfile

KIMI = dict(num_experts=896, hidden=3584, intermediate=384, topk=16, bits=4, codebook="mcg",
            act_dtype="bfloat16", out_dtype="float32", activation="situ",
            shared_hidden_vectors=True)
SMALL = dict(num_experts=12, hidden=256, intermediate=256, topk=4, bits=3, codebook="3inst",
             act_dtype="float16", out_dtype="bfloat16", activation="silu",
             shared_hidden_vectors=False, has_expert_map=True)

#: name -> (MoESpec fields). Kimi geometry at the plans' block sizes on both archs, and a
#: small per-expert-vector geometry with an expert map (other rotation / combine paths),
#: the QSRT coupled transforms, the sqg_e4m3 table decodes (direct; the K=2 pair table on sm_90a)
#: and mixed rates (k3x22_k4x2).
SPECS = {
    "kimi_m8_sm90a": dict(KIMI, block_m=8, arch="sm_90a"),
    "kimi_m32x2_sm90a": dict(KIMI, block_m=32, arch="sm_90a"),
    "kimi_m64_sm90a": dict(KIMI, block_m=64, arch="sm_90a"),
    "kimi_m8_sm120a": dict(KIMI, block_m=8, arch="sm_120a"),
    "kimi_m32_sm120a": dict(KIMI, block_m=32, arch="sm_120a"),
    "kimi_coupled_m32x2_sm90a": dict(KIMI, block_m=32, arch="sm_90a", coupled=True),
    "kimi_coupled_m8_sm120a": dict(KIMI, block_m=8, arch="sm_120a", coupled=True),
    "sqg_k4_m32x2_sm90a": dict(KIMI, codebook="sqg_e4m3", block_m=32, arch="sm_90a"),
    "sqg_k2_m16_sm120a": dict(KIMI, codebook="sqg_e4m3", bits=2, block_m=16, arch="sm_120a"),
    "sqg_k2_cpl_m64_sm90a": dict(KIMI, codebook="sqg_e4m3", bits=2, block_m=64, arch="sm_90a",
                                 coupled=True),
    # the production QSRT layer's wide items (4,096 tokens): three 96-row pair-table workers
    "sqg_k2_cpl_m48x2_sm90a": dict(KIMI, codebook="sqg_e4m3", bits=2, block_m=48, span=2,
                                   arch="sm_90a", coupled=True),
    "sqg_r34_m64_sm90a": dict(KIMI, codebook="sqg_e4m3", bits_set=(3, 4), block_m=64, arch="sm_90a"),
    "sqg_r34_m8_sync_sm90a": dict(KIMI, codebook="sqg_e4m3", bits_set=(3, 4), block_m=8,
                                  mma="sync", arch="sm_90a"),
    "small_m16_sm90a": dict(SMALL, block_m=16, arch="sm_90a"),
    "small_m16_sm120a": dict(SMALL, block_m=16, arch="sm_120a"),
}

# The DSL names a kernel after its module path, class, argument types and a per-compile
# counter; only the class is kept, so moving a module does not change the hash.
_FUNCTION = re.compile(r"Function : \S*?([A-Z][A-Za-z0-9]*)_object_at_\S*")


def _sass(cubin: str) -> str:
    from kquant_cute.kernels.build import dump_sass

    lines = [ln for ln in dump_sass(cubin).splitlines()
             if not ln.lstrip().startswith(("Fatbin", "code for", "arch ="))
             and os.path.basename(cubin) not in ln]
    return "\n".join(_FUNCTION.sub(r"Function : \1", ln) for ln in lines)


def _compile(fn, args, arch: str, out: str) -> str:
    import cutlass.cute as cute

    cute.compile(fn, *args, options=f"--gpu-arch {arch} --keep-cubin --dump-dir {out}")
    (cubin,) = glob.glob(os.path.join(out, "*.cubin"))
    return cubin


def hash_spec(fields: dict) -> str:
    from kquant_cute.kernels import build
    from kquant_cute.kernels.moe import MoEForward, MoESpec

    spec = MoESpec(**fields)
    build._load_runtime_globally()
    with tempfile.TemporaryDirectory(prefix="kq_sass_") as tmp:
        cubin = _compile(MoEForward(spec), build.fake_args(spec), spec.arch, tmp)
        return hashlib.sha256(_sass(cubin).encode()).hexdigest()


def hash_decode_probe() -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_probe import compile_decode

    with tempfile.TemporaryDirectory(prefix="kq_sass_") as tmp:
        compile_decode(k_dim=384, n_dim=3584, bits=4, codebook="mcg", arch="sm_90a",
                       mma_rows=32, cubin_dir=tmp)
        (cubin,) = glob.glob(os.path.join(tmp, "*.cubin"))
        return hashlib.sha256(_sass(cubin).encode()).hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the hashes as JSON")
    p.add_argument("--check", help="compare with a JSON written by --out; exit 1 on a difference")
    p.add_argument("--only", nargs="+", help="names of SPECS (and/or decode_probe) to hash")
    a = p.parse_args(argv)
    names = a.only or [*SPECS, "decode_probe"]
    got = {}
    for name in names:
        got[name] = hash_decode_probe() if name == "decode_probe" else hash_spec(SPECS[name])
        print(f"{name:20} {got[name]}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    if a.check:
        with open(a.check) as f:
            want = json.load(f)
        bad = [n for n in got if want.get(n) != got[n]]
        for n in bad:
            print(f"DIFFERS: {n}: {want.get(n)} -> {got[n]}")
        print("all identical" if not bad else f"{len(bad)} differ")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

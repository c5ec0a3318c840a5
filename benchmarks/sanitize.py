"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every kernel of the
fused forward, both GEMM paths, small shapes, cold and warm compile cache.

    python3 benchmarks/sanitize.py --out DIR [--jobs 4] [--tools memcheck,racecheck,...]

Runs `python3 benchmarks/sanitize.py --workload CACHE` under each tool: eleven small layers
(E=16, H=512, I=256, top-4) whose plans cover TrellisWgmma (M=8; M=32 x 2 spans; M=64 x 2,
two warpgroups; mcg K=3 and 4; the persistent sqg_e4m3 pair-table GEMM at K=2, coupled,
with 6 workers at M=8, 5 at M=32 x 1, 3 at M=64, 3 of 96 rows at M=48 x 2; the mixed-rate
K=3/4 GEMM, with the direct tables (also 2 workers of 96 rows at M=48 x 2) and with T12 +
bijection), TrellisGemm (mma.sync, M=8 and M=64, mcg K=3;
sqg_e4m3 K=4 with its smem state table; mixed-rate K=3/4 at M=8/32),
RouteCount / RoutePack, RotateInput / MidActivation / CombineOutput (shared and per-expert vectors,
with and without an expert map, -1 ids, the QSRT coupled variants), each at a decode and
a prefill token count (the first layer also at 520 tokens: a route pack over two CTAs), plus the decode-only ceiling kernel (TrellisDecode). "cold": the cache starts empty, so every
specialization is compiled inside the sanitized process; "warm": it is filled first.
Writes DIR/<tool>-<cache>.log and DIR/summary.json and prints errors per kernel; each
error is attributed to the kernel named in its report (or to the host API call).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time

KERNELS = ("TrellisWgmma", "TrellisGemm", "TrellisDecode", "RouteCount", "RoutePack",
           "RotateInput", "MidActivation", "CombineOutput")
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: Reports understood and harmless: where they come from (see "Sanitizers, input semantics
#: and fuzz" in `git show 41b240f:docs/perf-log.md`).
EXPLAINED = {
    "host:cuGetProcAddress_v2": "cuda-bindings (cydriver) resolving driver entry points at the "
    "first cute.compile of a process (the DSL's detect_gpu_arch); a host API return code the "
    "bindings handle, not a kernel error: 34 per process that JIT-compiles, 0 otherwise",
}


# -- the workload (runs inside the sanitizer) ------------------------------------------------
def workload(cache_dir: str) -> None:
    import torch

    from kquant_cute.compile_cache import CompileCache
    from kquant_cute.layer import MoELayer
    from kquant_cute.mixed import MixedMoEWeights
    from kquant_cute.weights import MoEWeights

    cache = CompileCache(cache_dir, frozen=False)
    E, H, I = 16, 512, 256
    layers = []
    wgmma = torch.cuda.get_device_capability() == (9, 0)
    cfgs = [dict(mma="sync", bits=3, pin=64, shared=True, emap=False),
            dict(mma="sync", bits=4, pin=32, shared=True, emap=False, codebook="sqg_e4m3"),
            dict(mma="sync", bits=4, pin=32, shared=True, emap=False, mixed=True)]
    if wgmma:
        cfgs += [dict(mma="wgmma", bits=4, pin=32, shared=True, emap=False),  # spans of 2
                 dict(mma="wgmma", bits=3, pin=64, span=2, shared=False, emap=True),
                 dict(mma="wgmma", bits=2, pin=64, shared=True, emap=False,
                      codebook="sqg_e4m3", coupled=True),
                 dict(mma="wgmma", bits=4, pin=64, shared=True, emap=False, mixed=True),
                 # four pair-table workers at M=32 x 1 (and at M=8), with an expert map;
                 # both compute 1 in 8 pairs (the arithmetic T12)
                 dict(mma="wgmma", bits=2, pin=32, span=1, shared=True, emap=True,
                      codebook="sqg_e4m3", coupled=True),
                 # mixed rates through T12 + bijection (sm_120's table decode)
                 dict(mma="wgmma", bits=4, pin=32, shared=True, emap=False, mixed=True,
                      table_decode="t12"),
                 # three pair-table workers of 96 rows (M=48 x 2, one warpgroup each, 2-stage
                 # rings, one k step in flight)
                 dict(mma="wgmma", bits=2, pin=48, span=2, shared=True, emap=False,
                      codebook="sqg_e4m3", coupled=True),
                 # mixed rates at M=48 x 2: two 96-row workers on 3-stage rings
                 dict(mma="wgmma", bits=4, pin=48, span=2, shared=True, emap=False, mixed=True)]
    only = os.environ.get("KQ_SANITIZE_ONLY")  # one config (index), for a quick look
    if only:
        cfgs = [cfgs[int(only)]]
    for i, c in enumerate(cfgs):
        if c.get("mixed"):  # sqg_e4m3 at K = 3 / 4 per 128-channel FC1 and 64-row FC2 run
            k34 = torch.tensor([3, 4], dtype=torch.uint8)
            fc1 = k34[(torch.arange(E)[:, None] + torch.arange(I // 128)) % 2]
            fc2 = k34[(torch.arange(E)[:, None] + torch.arange(I // 64) + 1) % 2]
            wts = MixedMoEWeights.random(fc1.repeat_interleave(8, dim=1),
                                         fc2.repeat_interleave(4, dim=1), H, seed=i).to("cuda")
        else:
            wts = MoEWeights.random(E, H, I, c["bits"], c.get("codebook", "mcg"),
                                    shared_hidden_vectors=c["shared"],
                                    coupled=c.get("coupled", False), seed=i, device="cuda")
        n_global = 2 * E if c["emap"] else None
        knobs = {k: c[k] for k in ("span", "table_decode") if k in c}
        layer = MoELayer(wts, topk=4, capacity=520, mma=c["mma"], num_global_experts=n_global,
                         cache=cache, environ={"KQUANT_W4A16_PREFILL_BLOCK_M": str(c["pin"]),
                                               "KQUANT_W4A16_PREFILL_MIN_M": "8"}, **knobs)
        layers.append((c, layer, n_global))
    g = torch.Generator(device="cuda").manual_seed(0)
    for c, layer, n_global in layers:
        emap = None
        n_ids = E
        if n_global:
            emap = torch.full((n_global,), -1, dtype=torch.int32, device="cuda")
            emap[1::2] = torch.arange(E, dtype=torch.int32, device="cuda")
            n_ids = n_global
        # 5 <= the prefill threshold (8): the decode plan, M = 8; the first layer also at
        # 520 tokens (2,080 routes: two route pack CTAs)
        for m in (5, 200) + ((520,) if c is layers[0][0] else ()):
            x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
            ids = torch.rand(m, n_ids, generator=g, device="cuda").topk(4, dim=1).indices
            ids = ids.to(torch.int32)
            if not os.environ.get("KQ_SANITIZE_BASELINE"):  # older code rejects -1
                ids[::5, 3] = -1  # no route
            w = torch.rand(m, 4, generator=g, device="cuda")
            kw = {} if emap is None else {"expert_map": emap}
            bound = layer.bind(x, ids.contiguous(), w, **kw)
            out = bound.run()
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), (c, m)
            print(f"ran {c} m={m} M={bound.block_m} span={bound.plan.spec.span}", flush=True)
    decode_kernel()
    print("workload done", flush=True)


def decode_kernel() -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import make_ptr

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_probe import compile_decode

    from kquant_cute import trellis

    k_dim, n_dim, n_exp = 256, 256, 3
    # Two operands in one launch, as the ceiling runs gate and up.
    codes = [torch.stack([trellis.random_trellis(k_dim, n_dim, 4) for _ in range(n_exp)]).cuda()
             for _ in range(2)]
    experts = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    out = torch.zeros(2 * 2 * (n_dim // 128) * 128, dtype=torch.int32, device="cuda")
    major, minor = torch.cuda.get_device_capability()
    fn, _ = compile_decode(k_dim=k_dim, n_dim=n_dim, bits=4, codebook="mcg",
                           arch=f"sm_{major}{minor}a", operands=2)

    def P(t, dt):
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    table = torch.zeros(16, dtype=torch.uint8, device="cuda")  # mcg reads no state table
    fn(P(codes[0], cutlass.Int16), P(codes[1], cutlass.Int16), P(experts, cutlass.Int32),
       P(out, cutlass.Uint32), P(table, cutlass.Uint8), cutlass.Int32(2), cutlass.Int32(1),
       cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    print("ran TrellisDecode", flush=True)


# -- driver ----------------------------------------------------------------------------------
def find_sanitizer() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        cand = os.path.join(root, "bin", "compute-sanitizer")
        if os.access(cand, os.X_OK):
            return cand
    return None


def run_tool(sanitizer: str | None, tool: str | None, cache: str, log: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--workload", cache]
    if tool is not None:
        cmd = [sanitizer, "--tool", tool, "--print-limit", "2000", "--show-backtrace", "yes",
               *(["--racecheck-report", "all"] if tool == "racecheck" else []), *cmd]
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"tool": tool, "cache": cache, "log": log, "rc": rc,
            "seconds": round(time.monotonic() - t0, 1)}


_BLOCK_START = re.compile(r"^========= (?! )(.*)$")
_CONT = re.compile(r"^=========  +(.*)$")
_SKIP = ("ERROR SUMMARY", "RACECHECK SUMMARY", "COMPUTE-SANITIZER", "Target application returned",
         "Error: process didn't terminate")


def parse_log(text: str) -> dict:
    """Error reports of one sanitizer log: per kernel (or host API call) counts, hazards and
    the first report of each kind, plus the tool's own summary line."""
    blocks, cur = [], None
    summary = None
    for line in text.splitlines():
        m = _BLOCK_START.match(line)
        if m:
            head = m.group(1).strip()
            if not head or any(head.startswith(s) for s in _SKIP):
                if "SUMMARY" in head:
                    summary = head
                cur = None
                continue
            cur = [head]
            blocks.append(cur)
            continue
        c = _CONT.match(line)
        if c and cur is not None:
            cur.append(c.group(1).strip())
    per: dict[str, dict] = {}
    for b in blocks:
        text_b = " ".join(b)
        where = next((k for k in KERNELS if k in text_b), None)
        if where is None:
            api = re.search(r"CUDA API call to (\w+)", text_b)
            where = f"host:{api.group(1)}" if api else "other"
        hz = re.search(r"\[(\d[\d,]*) hazards?\]", text_b)
        kind = re.sub(r"0x[0-9a-f]+|\d+", "#", b[0])[:160]
        d = per.setdefault(where, {"errors": 0, "hazards": 0, "kinds": {}, "first": None})
        d["errors"] += 1
        d["hazards"] += int(hz.group(1).replace(",", "")) if hz else 0
        d["kinds"][kind] = d["kinds"].get(kind, 0) + 1
        if d["first"] is None:
            d["first"] = b[:14]
    return {"summary": summary, "by_kernel": per, "reports": len(blocks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", metavar="CACHE", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="sanitize-out")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=480, help="seconds per sanitized run")
    ap.add_argument("--cache-root", help="where the cold / warm caches live (default: --out)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache memcheck")
    args = ap.parse_args()
    if args.workload:
        workload(args.workload)
        return 0
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    root = args.cache_root or args.out
    cold, warm = os.path.join(root, "cache-cold"), os.path.join(root, "cache-warm")
    for d in (cold, warm):
        shutil.rmtree(d, ignore_errors=True)
    tools = [t for t in args.tools.split(",") if t]
    runs = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        first = [pool.submit(run_tool, None, None, warm, os.path.join(args.out, "fill-warm.log"),
                             args.timeout)]
        if "memcheck" in tools and not args.no_cold:
            first.append(pool.submit(run_tool, sanitizer, "memcheck", cold,
                                     os.path.join(args.out, "memcheck-cold.log"), args.timeout))
        fill = first[0].result()
        runs.append(fill)
        later = [pool.submit(run_tool, sanitizer, t, warm, os.path.join(args.out, f"{t}-warm.log"),
                             args.timeout) for t in tools]
        runs += [f.result() for f in first[1:] + later]
    results = []
    for r in runs:
        with open(r["log"], errors="replace") as f:
            parsed = parse_log(f.read())
        label = f"{r['tool'] or 'plain'}-{'cold' if r['cache'] == cold else 'warm'}"
        results.append({"run": label, **r, **parsed})
        errs = sum(d["errors"] for d in parsed["by_kernel"].values())
        unexplained = sum(d["errors"] for k, d in parsed["by_kernel"].items() if k not in EXPLAINED)
        results[-1]["unexplained"] = unexplained
        print(f"{label:16} rc={r['rc']} {r['seconds']:6.1f} s  {parsed['summary']}  "
              f"reports={errs} unexplained={unexplained}")
        for k, d in sorted(parsed["by_kernel"].items()):
            kinds = "; ".join(f"{n} x {kind}" for kind, n in d["kinds"].items())
            why = f"  [explained: {EXPLAINED[k]}]" if k in EXPLAINED else ""
            print(f"    {k:24} {d['errors']:4} reports {d['hazards']:8} hazards  {kinds}{why}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = sum(r["unexplained"] for r in results) + sum(r["rc"] != 0 for r in results)
    print(f"unexplained reports or failed runs: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Subprocess helper for tests/test_compile_cache.py (key stability, 8-process race, CuTe round trip).

Usage: python compile_cache_worker.py MODE JSON_ARGS; prints one JSON line on stdout.
Not a test module itself (pytest collects test_*.py only).
"""

import json
import os
import sys
import time


def _key(args: dict) -> dict:
    from kquant_cute.compile_cache import make_key

    hex_key, components = make_key(
        args["name"], args["spec"], arch=args["arch"], sources=args["sources"], options=args["options"]
    )
    return {"key": hex_key, "components": components}


def _race(args: dict) -> dict:
    from kquant_cute.compile_cache import CompileCache

    cache = CompileCache(args["dir"], frozen=False)
    # Barrier: announce readiness, then wait until every worker is ready.
    open(os.path.join(args["barrier"], f"ready.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 30
    while len(os.listdir(args["barrier"])) < args["n"] and time.monotonic() < deadline:
        time.sleep(0.002)

    def build() -> tuple[bytes, dict]:
        with open(args["counter"], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(args["sleep"])
        return b"payload-" + args["tag"].encode(), {"registers": 32}

    def load(path: str, meta: dict) -> str:
        with open(path, "rb") as f:
            return f.read().decode()

    res = cache.get_or_build_result(
        "race_kernel", {"tag": args["tag"]}, arch="sm_90a", build=build, load=load
    )
    return {"value": res.value, "status": res.status, "key": res.key}


def _cute(args: dict) -> dict:
    """Cross-compile a tiny elementwise kernel for sm_90a and store it through the cache."""
    os.environ["CUTE_DSL_ARCH"] = args["arch"]
    import cutlass
    import cutlass.cute as cute

    from kquant_cute.compile_cache import CompileCache

    @cute.kernel
    def add_one_kernel(x: cute.Tensor, y: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < cute.size(x):
            y[i] = x[i] + cutlass.Float32(1.0)

    @cute.jit
    def add_one(x: cute.Tensor, y: cute.Tensor):
        n = cute.size(x)
        add_one_kernel(x, y).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1))

    prefix = "kq_add_one"

    def build() -> tuple[bytes, dict]:
        n = cute.sym_int()
        x = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
        y = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
        compiled = cute.compile(add_one, x, y)
        obj = compiled.dump_to_object(prefix)
        with open(args["reference"], "wb") as f:
            f.write(obj)
        return obj, {"prefix": prefix, "registers": None, "smem_bytes": 0}

    cache = CompileCache(args["dir"], frozen=False)
    # No GPU here: cute.runtime.load_module(path) must not be called; the loader returns the path.
    res = cache.get_or_build_result(
        "add_one", args["spec"], arch=args["arch"], build=build, load=lambda path, meta: path,
        sources=args["sources"],
    )
    return {"status": res.status, "key": res.key, "meta": res.meta}


def _plans(args: dict) -> dict:
    """Plan (really compile) two layers of different geometry on one shared cache dir."""
    from kquant_cute.compile_cache import CompileCache
    from kquant_cute.compiler import plan_forward
    from kquant_cute.planners import PlanEnv
    from kquant_cute.prewarm import DEFAULT_GEOMETRY

    cache = CompileCache(args["dir"], frozen=False)
    open(os.path.join(args["barrier"], f"ready.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(args["barrier"])) < args["n"] and time.monotonic() < deadline:
        time.sleep(0.01)
    keys = []
    for geo in args["geometries"]:
        base = DEFAULT_GEOMETRY.replace(**geo)
        plan = plan_forward(base, capacity=64, arch=args["arch"], env=PlanEnv(prefill_disabled=True),
                            cache=cache)
        keys += [plan.decode.entry.meta["key"]]
    info = cache.cache_info()
    return {"keys": keys, "compiles": info.compiles, "disk_loads": info.disk_loads}


def main() -> int:
    mode, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    out = {"key": _key, "race": _race, "cute": _cute, "plans": _plans}[mode](args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

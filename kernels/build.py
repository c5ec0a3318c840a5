"""Compiling, inspecting and loading fused-forward specializations (no GPU needed to compile).

Owns the bridge between `MoESpec` and the CuTe DSL toolchain:
- `compile_forward(spec)`: cross-compiles a specialization for `spec.arch` with fake
  pointer arguments (the C ABI is pointers + int32, identical on every machine) and returns
  the relocatable object bytes plus the measured resources of every kernel in it
  (registers, stack/local bytes = spills, static shared memory), read from the cubin with
  `cuobjdump --dump-resource-usage`.
- `load_forward(path, spec)`: loads such an object into this process (needs a GPU).
- `find_cuobjdump` / `find_nvdisasm` / `dump_sass`: the CUDA binary tools, from PATH,
  CUDA_HOME or the nvidia-cuda-* wheels.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

from .launch import ARG_NAMES
from .moe import MoEForward, MoESpec, dsl_dtype

OBJECT_PREFIX = "kq_forward"
_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_FN_RE = re.compile(r"Function\s+(\S+):")


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    registers: int
    stack: int
    shared: int
    local: int


# The DSL names a compiled kernel after its module path, class and argument types:
# "kernel_cutlass_kernel_<module path><Class>_object_at_<types>_<n>".
_CLASS_RE = re.compile(r"([A-Z][A-Za-z0-9]*)_object_at_")


def short_kernel_name(raw: str) -> str:
    """The kernel class a compiled (mangled) kernel name belongs to, e.g. "TrellisWgmma"
    (the names `MoESpec.sub_kernels()` lists); the raw name's start if it has none."""
    m = _CLASS_RE.search(raw)
    return m.group(1) if m else raw[:48]


def _find_tool(tool: str) -> str | None:
    """`tool` from PATH, CUDA_HOME / CUDA_PATH / /usr/local/cuda, or an nvidia-cuda-* wheel."""
    exe = shutil.which(tool)
    if exe:
        return exe
    for root in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        cand = os.path.join(root, "bin", tool)
        if os.access(cand, os.X_OK):
            return cand
    try:
        import nvidia  # namespace package of the NVIDIA wheels
        for base in nvidia.__path__:
            for cand in sorted(glob.glob(os.path.join(base, "*", "bin", tool))):
                if os.access(cand, os.X_OK):
                    return cand
    except ImportError:
        pass
    return None


def find_cuobjdump() -> str | None:
    """cuobjdump (resource usage of a cubin; the nvidia-cuda-cuobjdump dependency)."""
    return _find_tool("cuobjdump")


def find_nvdisasm() -> str | None:
    """nvdisasm, which `cuobjdump -sass` runs (the nvidia-cuda-nvdisasm test extra)."""
    return _find_tool("nvdisasm")


def dump_sass(cubin_path: str) -> str:
    """The SASS of every kernel in a cubin (`cuobjdump -sass`, with nvdisasm on its PATH)."""
    exe, nvdisasm = find_cuobjdump(), find_nvdisasm()
    if exe is None or nvdisasm is None:
        missing = " and ".join(n for n, p in (("cuobjdump", exe), ("nvdisasm", nvdisasm)) if p is None)
        raise RuntimeError(f"{missing} not found (pip install -e \".[test]\", or set CUDA_HOME)")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(nvdisasm), env.get("PATH", "")])
    return subprocess.run([exe, "-sass", cubin_path], check=True, capture_output=True,
                          text=True, env=env).stdout


def read_resources(cubin_path: str, dynamic_smem: dict | None = None) -> list[KernelResources]:
    """Per-kernel resources of a cubin; `shared` = static + the launch's dynamic bytes."""
    exe = find_cuobjdump()
    if exe is None:
        raise RuntimeError("cuobjdump not found (install nvidia-cuda-cuobjdump or set CUDA_HOME)")
    text = subprocess.run([exe, "--dump-resource-usage", cubin_path], check=True,
                          capture_output=True, text=True).stdout
    out, name = [], None
    for line in text.splitlines():
        fm = _FN_RE.search(line)
        if fm:
            name = fm.group(1)
            continue
        rm = _RES_RE.search(line)
        if rm and name is not None:
            reg, stack, shared, local = map(int, rm.groups())
            short = short_kernel_name(name)
            shared += (dynamic_smem or {}).get(short, 0)
            out.append(KernelResources(short, reg, stack, shared, local))
            name = None
    return out


def resource_summary(resources: list[KernelResources]) -> dict:
    """The binding numbers of a specialization: max registers / shared / spill bytes."""
    return {
        "registers": max((r.registers for r in resources), default=0),
        "shared_bytes": max((r.shared for r in resources), default=0),
        "spill_bytes": max((r.stack + r.local for r in resources), default=0),
        "kernels": [asdict(r) for r in resources],
    }


def fake_args(spec: MoESpec) -> list:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    args = []
    for _name, dt in ARG_NAMES:
        if dt is None:
            args.append(Int32(1))
        else:
            args.append(make_ptr(dsl_dtype(dt, spec), 256, cute.AddressSpace.gmem, assumed_align=16))
    args.append(cuda.CUstream(0))
    return args


_RUNTIME_LOADED = False


def _load_runtime_globally() -> None:
    """Object export links host code against the DSL runtime's CUDA entry points; make
    them resolvable in this process (also on a machine with no GPU)."""
    global _RUNTIME_LOADED
    if _RUNTIME_LOADED:
        return
    import ctypes

    import cutlass.cute as cute

    for path in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _RUNTIME_LOADED = True


def compile_measured(fn, args, arch: str, dynamic_smem: dict, cubin_dir: str | None = None):
    """`cute.compile(fn, *args)` for `arch`, keeping the cubin (in `cubin_dir`, else a
    temporary directory) long enough to read its resources; returns (compiled, resources,
    compile seconds). Resources are empty when cuobjdump is missing."""
    import cutlass.cute as cute

    t0 = time.perf_counter()
    # The pid in the name lets a later compile sweep what a killed one left behind.
    with tempfile.TemporaryDirectory(prefix=f"kq_cubin_{os.getpid()}_") as tmp:
        out = cubin_dir or tmp
        compiled = cute.compile(fn, *args, options=f"--gpu-arch {arch} --keep-cubin --dump-dir {out}")
        seconds = time.perf_counter() - t0
        cubins = glob.glob(os.path.join(out, "*.cubin"))
        resources = (read_resources(cubins[0], dynamic_smem)
                     if cubins and find_cuobjdump() else [])
    return compiled, resources, seconds


def compile_forward(spec: MoESpec) -> tuple[bytes, dict]:
    """Cross-compile `spec` for `spec.arch`; returns (object bytes, metadata with resources)."""
    reason = spec.check()
    if reason is not None:
        raise ValueError(f"cannot compile {spec.kernel_name()}: {reason}")
    _load_runtime_globally()
    compiled, resources, seconds = compile_measured(MoEForward(spec), fake_args(spec), spec.arch,
                                                     spec.dynamic_smem())
    obj = compiled.dump_to_object(OBJECT_PREFIX)
    meta = {"compile_seconds": round(seconds, 3), **resource_summary(resources),
            "resources_measured": bool(resources)}
    return obj, meta


def load_forward(path: str, *, on_device: bool = False):
    """Load a compiled object; returns the callable entry point (needs the CUDA driver).

    The host part is linked here. cute loads the device image into the CUDA context
    lazily, at the first call; ``on_device=True`` loads it now (every visible device), so
    an object whose host code links but whose cubin the driver rejects fails here, where
    the compile cache can delete and rebuild it, not at the first launch."""
    import cutlass.cute as cute

    module = cute.runtime.load_module(path)
    fn = getattr(module, OBJECT_PREFIX)
    if on_device:
        fn.to(None)  # the executor is discarded; the loaded CUDA library stays on `fn`
    return LoadedForward(module, fn)


class LoadedForward:
    """A loaded object's entry point; holds the module so its engine stays alive."""

    def __init__(self, module, fn):
        self.module = module
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

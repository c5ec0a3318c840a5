"""A stand-in for the compile step (`kernels.build.compile_forward` / `load_forward`), so the
compiler's and prewarm's planning, caching and reporting run on the CPU in milliseconds.

`FakeBuild` answers every specialization with made-up object bytes and "measured"
resources: each sub-kernel of `MoESpec.sub_kernels()` with the spec's own threads and
dynamic shared memory and `registers` registers, unless `overrides[block_m]` changes some
of them (e.g. ``{"registers": 300}``) or `fail` lists the block sizes whose build raises.
It counts builds and loads; the loaded "function" is a marker naming the object."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeBuild:
    registers: int = 40  # fits every kernel, the route pack's 1,024 threads too (64 at most)
    overrides: dict = field(default_factory=dict)
    fail: tuple = ()
    measured: bool = True
    built: list = field(default_factory=list)
    loads: int = 0

    def compile_forward(self, spec):
        self.built.append((spec.arch, spec.block_m))
        if spec.block_m in self.fail:
            raise RuntimeError(f"ptxas died at M={spec.block_m}")
        kernels = []
        for name, (threads, smem) in spec.kernel_launches().items():
            k = dict(kernel=name, registers=self.registers, stack=0, shared=smem, local=0)
            k.update(self.overrides.get(spec.block_m, {}))
            kernels.append(k)
        if not self.measured:
            kernels = []
        meta = {"compile_seconds": 0.0, "kernels": kernels, "resources_measured": self.measured,
                "registers": max((k["registers"] for k in kernels), default=0),
                "shared_bytes": max((k["shared"] for k in kernels), default=0),
                "spill_bytes": max((k["stack"] + k["local"] for k in kernels), default=0)}
        return f"object {spec.kernel_name()}".encode(), meta

    def load_forward(self, path, *, on_device=False):
        self.loads += 1
        with open(path, "rb") as f:
            return ("loaded", f.read().decode())

    def install(self, monkeypatch):
        from kquant_cute import compiler

        monkeypatch.setattr(compiler.kbuild, "compile_forward", self.compile_forward)
        monkeypatch.setattr(compiler.kbuild, "load_forward", self.load_forward)
        return self

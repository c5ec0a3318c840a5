"""kquant-cute: CuTe DSL kernels for trellis-coded (EXL3-style) W4A16 MoE layers.

This package owns the public API (plan / bind / run, the kquant-compile CLI) and the
reference trellis codec. Subpackages: kquant_cute.kernels (CuTe DSL kernels),
kquant_cute.planners (policy, geometry, plans), kquant_cute.compile_cache (disk cache).
Heavy imports (torch, cutlass) happen lazily in the submodules.
"""

__version__ = "0.1.0"

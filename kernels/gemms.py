"""The GEMM registry: which trellis GEMM class runs each MMA kind.

Owns `GEMMS`, the one mapping from MMA kind (the spelling of `MoESpec.mma` and of the
arch table's `ArchLimits.mma_kinds`) to the GEMM class that runs it, and `auto_mma`, the
kind `mma="auto"` resolves to on an arch. Every class here answers the same static
questions with one call signature (`bring.GemmClass`), so nothing else names a GEMM
class or tests a kind: adding a GEMM is its class file plus one line below.
"""

from __future__ import annotations

from .arch import arch_limits
from .trellis_gemm import TrellisGemm
from .trellis_wgmma import TrellisWgmma

#: MMA kind -> GEMM class, in order of preference: "auto" takes the last one the arch
#: offers (the first, mma.sync, runs on every arch in the table).
GEMMS: dict[str, type] = {cls.kind: cls for cls in (
    TrellisGemm,
    TrellisWgmma,
)}
#: The values `MoESpec.mma` accepts.
MMA_KINDS = ("auto", *GEMMS)


def auto_mma(arch) -> str:
    """The MMA kind "auto" means on `arch`: the most preferred kind of `GEMMS` that the
    arch table lists for it (the first kind for an arch the table does not know; the
    spec's check then rejects the arch)."""
    try:
        offered = arch_limits(arch).mma_kinds
    except ValueError:
        return next(iter(GEMMS))
    return [kind for kind in GEMMS if kind in offered][-1]

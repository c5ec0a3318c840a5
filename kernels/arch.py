"""The per-SM architecture table: the one owner of each supported GPU's limits (no torch, no cutlass).

Owns :data:`ARCH_TABLE` -- one :class:`ArchLimits` per supported SM (sources: docs/formats.md, "Per-SM limits"):
opt-in shared memory per block, register file, per-thread register cap, thread cap and
the MMA instruction families -- and its lookups :func:`arch_limits` /
:func:`normalize_arch` by any common spelling (``"sm_90"``, ``"sm_90a"``, ``"90"``,
``90``, ``(9, 0)``) and the CuTe DSL target name. The kernels read it (``MoESpec``'s
``mma="auto"``, the GEMM's occupancy target) and the planners' resource check
(:mod:`planners.geometry`) reads the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = [
    "ArchLimits",
    "ARCH_TABLE",
    "arch_limits",
    "normalize_arch",
    "known_archs",
    "mma_archs",
]

ArchLike = Union[str, int, tuple]


@dataclass(frozen=True)
class ArchLimits:
    """Hardware limits of one SM generation that decide whether a kernel geometry fits.

    Attributes:
        name: canonical short name, e.g. ``"sm_90"``.
        dsl_target: CuTe DSL / ptxas target name, e.g. ``"sm_90a"`` (arch-specific features
            such as wgmma / tcgen05 need the ``a`` suffix).
        smem_per_block_optin: max dynamic shared memory per block after opt-in, bytes.
        regs_per_sm: 32-bit registers per SM (also the per-block cap on these parts).
        regs_per_thread_max: per-thread register cap of the ISA (255).
        max_threads_per_block: 1024 on every supported SM.
        reg_alloc_unit: registers are allocated per warp in units of this many (256): a kernel
            with ``r`` registers per thread takes ``ceil(32 * r / 256) * 256`` per warp.
        mma_kinds: tensor-core instruction families available, e.g. ``("sync", "wgmma")``,
            spelled as ``MoESpec.mma`` and the GEMM registry (``kernels/gemms.py``) spell
            them: ``"sync"`` is ``mma.sync``.
        cvt_e4m3: ``cvt.rn.f16x2.e4m3x2`` exists (sm_89 and later): the sqg_e4m3 decode.
    """

    name: str
    dsl_target: str
    smem_per_block_optin: int
    regs_per_sm: int = 65536
    regs_per_thread_max: int = 255
    max_threads_per_block: int = 1024
    reg_alloc_unit: int = 256
    mma_kinds: tuple[str, ...] = ("sync",)
    cvt_e4m3: bool = True

    @property
    def sm(self) -> int:
        """The SM number, e.g. 90 for ``sm_90``."""
        return int(self.name[3:])

    def max_registers_per_thread(self, threads: int) -> int:
        """Largest per-thread register count that lets one block of ``threads`` threads launch.

        Accounts for the per-warp allocation granularity and the 255 cap.
        """
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        warps = -(-threads // 32)
        per_warp_units = self.regs_per_sm // (warps * self.reg_alloc_unit)
        regs = per_warp_units * self.reg_alloc_unit // 32
        return min(regs, self.regs_per_thread_max)


_KB = 1024

#: The one per-SM table (docs/formats.md, "Per-SM limits"). Keys are canonical names ``"sm_NN"``.
ARCH_TABLE: dict[str, ArchLimits] = {
    "sm_80": ArchLimits("sm_80", "sm_80", 163 * _KB, mma_kinds=("sync",), cvt_e4m3=False),
    "sm_86": ArchLimits("sm_86", "sm_86", 99 * _KB, mma_kinds=("sync",), cvt_e4m3=False),
    "sm_89": ArchLimits("sm_89", "sm_89", 99 * _KB, mma_kinds=("sync",)),
    "sm_90": ArchLimits("sm_90", "sm_90a", 227 * _KB, mma_kinds=("sync", "wgmma")),
    "sm_100": ArchLimits("sm_100", "sm_100a", 227 * _KB, mma_kinds=("sync", "tcgen05")),
    "sm_120": ArchLimits(
        "sm_120", "sm_120a", 99 * _KB, mma_kinds=("sync", "sync.block_scale")
    ),
}


def known_archs() -> tuple[str, ...]:
    """Canonical names of the supported SMs, ascending."""
    return tuple(sorted(ARCH_TABLE, key=lambda k: ARCH_TABLE[k].sm))


def _unknown(arch: object) -> ValueError:
    names = ", ".join(known_archs())
    return ValueError(
        f"unknown GPU architecture {arch!r}; known: {names} "
        "(also spelled with an 'a' suffix, as a bare number, or as a (major, minor) tuple)"
    )


def _canonical_name(arch: ArchLike) -> str:
    """Map any accepted spelling to a canonical ``"sm_NN"`` key of :data:`ARCH_TABLE`."""
    if isinstance(arch, bool):
        raise _unknown(arch)
    if isinstance(arch, tuple):
        if len(arch) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in arch):
            raise _unknown(arch)
        sm = arch[0] * 10 + arch[1]
    elif isinstance(arch, int):
        sm = arch
    elif isinstance(arch, str):
        text = arch.strip().lower()
        for prefix in ("sm_", "sm"):
            if text.startswith(prefix):
                text = text[len(prefix):]
                break
        if text.endswith(("a", "f")):  # arch-specific / family-specific suffix
            text = text[:-1]
        if not text.isdigit():
            raise _unknown(arch)
        sm = int(text)
    else:
        raise _unknown(arch)
    name = f"sm_{sm}"
    if name not in ARCH_TABLE:
        raise _unknown(arch)
    return name


def arch_limits(arch: ArchLike) -> ArchLimits:
    """Limits of ``arch``: ``"sm_90"``, ``"sm_90a"``, ``"sm90"``, ``"90"``, ``90`` or ``(9, 0)``.

    Raises:
        ValueError: for an unknown architecture; the message lists the known ones.
    """
    return ARCH_TABLE[_canonical_name(arch)]


def normalize_arch(arch: ArchLike) -> str:
    """CuTe DSL target name for ``arch``: sm_90 -> ``"sm_90a"``, sm_100 -> ``"sm_100a"``,
    sm_120 -> ``"sm_120a"``, sm_80/86/89 unchanged (``"sm_80"``...).

    Raises:
        ValueError: for an unknown architecture; the message lists the known ones.
    """
    return arch_limits(arch).dsl_target


def mma_archs(kind: str) -> tuple[str, ...]:
    """DSL targets whose MMA families include ``kind`` (e.g. ``"wgmma"`` -> ``("sm_90a",)``)."""
    return tuple(ARCH_TABLE[k].dsl_target for k in known_archs() if kind in ARCH_TABLE[k].mma_kinds)

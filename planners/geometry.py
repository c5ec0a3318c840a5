"""Per-SM geometry limits and the one validity predicate for a compiled kernel's resources.

This module owns:

* :data:`ARCH_TABLE` -- ONE table of :class:`ArchLimits` per supported SM (BRIEF section 5):
  opt-in shared memory per block, register file, per-thread register cap, thread cap and the
  MMA instruction families available.
* :func:`arch_limits` / :func:`normalize_arch` -- lookup by any common spelling
  (``"sm_90"``, ``"sm_90a"``, ``"90"``, ``90``, ``(9, 0)``) and the CuTe DSL target name
  (``"sm_90a"``, ``"sm_100a"``, ``"sm_120a"``, ``"sm_80"``...).
* :func:`check_resources` -- decides whether measured resources (shared memory, registers,
  spills, threads per block of one compiled specialisation) fit an SM; returns ``None`` or a
  human-readable reason naming the numbers. :class:`GeometryVerdict` records one such
  decision for a route block size.

Pure Python; no torch or cutlass import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "ArchLimits",
    "ARCH_TABLE",
    "GeometryVerdict",
    "arch_limits",
    "normalize_arch",
    "known_archs",
    "check_resources",
    "geometry_verdict",
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
        mma_kinds: tensor-core instruction families available, e.g. ``("mma.sync", "wgmma")``.
    """

    name: str
    dsl_target: str
    smem_per_block_optin: int
    regs_per_sm: int = 65536
    regs_per_thread_max: int = 255
    max_threads_per_block: int = 1024
    reg_alloc_unit: int = 256
    mma_kinds: tuple[str, ...] = ("mma.sync",)

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

#: The one per-SM table (BRIEF section 5). Keys are canonical names ``"sm_NN"``.
ARCH_TABLE: dict[str, ArchLimits] = {
    "sm_80": ArchLimits("sm_80", "sm_80", 163 * _KB, mma_kinds=("mma.sync",)),
    "sm_86": ArchLimits("sm_86", "sm_86", 99 * _KB, mma_kinds=("mma.sync",)),
    "sm_89": ArchLimits("sm_89", "sm_89", 99 * _KB, mma_kinds=("mma.sync",)),
    "sm_90": ArchLimits("sm_90", "sm_90a", 227 * _KB, mma_kinds=("mma.sync", "wgmma")),
    "sm_100": ArchLimits("sm_100", "sm_100a", 227 * _KB, mma_kinds=("mma.sync", "tcgen05")),
    "sm_120": ArchLimits(
        "sm_120", "sm_120a", 99 * _KB, mma_kinds=("mma.sync", "mma.sync.block_scale")
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


@dataclass(frozen=True)
class GeometryVerdict:
    """Whether one route block size's compiled geometry fits the target SM.

    ``reason`` is ``None`` iff ``ok``. The measured numbers are ``None`` when the check that
    produced the verdict did not report them (e.g. a plain ``str | None`` predicate).
    """

    block_m: int
    ok: bool
    reason: Optional[str] = None
    registers: Optional[int] = None
    spills: Optional[int] = None
    smem_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.ok != (self.reason is None):
            raise ValueError("GeometryVerdict: reason must be None exactly when ok is True")

    def summary(self) -> str:
        """One line: ``"M=64: rejected: shared memory ..."`` or ``"M=32: ok (175 regs, ...)"``."""
        numbers = []
        if self.registers is not None:
            numbers.append(f"{self.registers} regs")
        if self.spills is not None:
            numbers.append(f"{self.spills:,} B spilled")
        if self.smem_bytes is not None:
            numbers.append(f"{self.smem_bytes:,} B smem")
        detail = f" ({', '.join(numbers)})" if numbers else ""
        if self.ok:
            return f"M={self.block_m}: ok{detail}"
        return f"M={self.block_m}: rejected: {self.reason}{detail}"


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_resources(
    limits: ArchLimits, *, smem_bytes: int, registers: int, spills: int, threads: int
) -> Optional[str]:
    """The one validity predicate for a compiled kernel's measured resources on ``limits``.

    A geometry is rejected when any of these holds (all failing conditions are reported,
    joined by ``"; "``):

    * ``threads`` per block above ``limits.max_threads_per_block``;
    * ``smem_bytes`` (static + dynamic, per block) above ``limits.smem_per_block_optin``;
    * ``registers`` per thread above ``limits.regs_per_thread_max`` (255);
    * one block does not fit the register file: ``registers`` above
      ``limits.max_registers_per_thread(threads)`` -- i.e. ``regs_per_sm / threads`` rounded
      down to the per-warp allocation granularity (for 128/256/512 threads this is exactly
      ``regs_per_sm // threads``);
    * any spill (``spills > 0``, bytes of spill stores/loads or local memory reported by ptxas).

    Returns:
        ``None`` if the kernel fits, else a reason such as
        ``"shared memory 103,424 B > 101,376 B limit of sm_120"``.

    Raises:
        ValueError: for negative / non-int measurements or ``threads < 1``.
    """
    _check_count("smem_bytes", smem_bytes, minimum=0)
    _check_count("registers", registers, minimum=0)
    _check_count("spills", spills, minimum=0)
    _check_count("threads", threads, minimum=1)
    reasons = []
    if threads > limits.max_threads_per_block:
        reasons.append(
            f"{threads:,} threads per block > {limits.max_threads_per_block:,} limit of {limits.name}"
        )
    if smem_bytes > limits.smem_per_block_optin:
        reasons.append(
            f"shared memory {smem_bytes:,} B > {limits.smem_per_block_optin:,} B limit of {limits.name}"
        )
    if registers > limits.regs_per_thread_max:
        reasons.append(
            f"{registers} registers per thread > {limits.regs_per_thread_max} limit of {limits.name}"
        )
    elif threads <= limits.max_threads_per_block and registers > limits.max_registers_per_thread(threads):
        reasons.append(
            f"{registers} registers x {threads:,} threads exceed the {limits.regs_per_sm:,}-register "
            f"file of {limits.name} (at most {limits.max_registers_per_thread(threads)} per thread "
            f"at {threads:,} threads)"
        )
    if spills > 0:
        reasons.append(f"register spills ({spills:,} B)")
    return "; ".join(reasons) if reasons else None


def geometry_verdict(
    limits: ArchLimits,
    block_m: int,
    *,
    smem_bytes: int,
    registers: int,
    spills: int,
    threads: int,
) -> GeometryVerdict:
    """:func:`check_resources` packaged as a :class:`GeometryVerdict` for route block ``block_m``."""
    reason = check_resources(
        limits, smem_bytes=smem_bytes, registers=registers, spills=spills, threads=threads
    )
    return GeometryVerdict(
        block_m=block_m,
        ok=reason is None,
        reason=reason,
        registers=registers,
        spills=spills,
        smem_bytes=smem_bytes,
    )

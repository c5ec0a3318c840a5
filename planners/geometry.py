"""Per-SM geometry limits and the one validity predicate for a compiled kernel's resources.

This module owns:

* :func:`check_resources` -- decides whether measured resources (shared memory, registers,
  spills, threads per block of one compiled specialisation) fit an SM; returns ``None`` or a
  human-readable reason naming the numbers. :class:`GeometryVerdict` records one such
  decision for a route block size.

The per-SM limits themselves (:data:`ARCH_TABLE`, :func:`arch_limits`,
:func:`normalize_arch`) are owned by ``kernels/arch.py`` and re-exported here.

Pure Python; no torch or cutlass import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The per-SM table is the kernels' (they need it to resolve the MMA kind); re-exported.
from ..kernels.arch import ARCH_TABLE, ArchLimits, arch_limits, known_archs, normalize_arch

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


@dataclass(frozen=True)
class GeometryVerdict:
    """Whether one route block size's compiled geometry fits the target SM.

    ``reason`` is ``None`` iff ``ok``. The measured numbers are ``None`` when the check that
    produced the verdict did not report them (e.g. a plain ``str | None`` predicate).
    ``measured``: ``True`` when registers / spills were read from the compiled object,
    ``False`` when they could not be (no cuobjdump): an accepted but *unmeasured*
    geometry, which :meth:`summary` says; ``None`` when not applicable.
    ``span``: 0 for the block size's own default work item; ``n > 1`` for work items of
    ``n`` route blocks that a plan asked about (``planners.plans``, the wide rule).
    """

    block_m: int
    ok: bool
    reason: Optional[str] = None
    registers: Optional[int] = None
    spills: Optional[int] = None
    smem_bytes: Optional[int] = None
    measured: Optional[bool] = None
    span: int = 0

    @property
    def label(self) -> str:
        """``"M=48"``, or ``"M=48 x 2"`` for a plan's work items of two route blocks."""
        return f"M={self.block_m}" + (f" x {self.span}" if self.span > 1 else "")

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
        if self.measured is False:
            numbers.append("unmeasured: no cuobjdump, registers and spills not checked")
        detail = f" ({', '.join(numbers)})" if numbers else ""
        if self.ok:
            return f"{self.label}: ok{detail}"
        return f"{self.label}: rejected: {self.reason}{detail}"


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
        measured=True,
    )

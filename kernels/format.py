"""Trellis weight-format constants (EXL3 3inst / mcg / mul1, QSRT sqg_e4m3); no torch, no cutlass.

The one owner of the numbers both the kernels and the reference codec need: tile and
Hadamard-block sizes, the state width, each codebook's multipliers, masks and table
facts, and the `Codebook` record of every codebook (`CODEBOOK`: its K range, ALU or
table decode, state-table bytes per K, whether byte-aligned states may arrive replicated,
whether it needs `cvt.rn.f16x2.e4m3x2`, its value RMS), which every other module asks
instead of testing codebook names. `kquant_cute.trellis` (the torch reference codec)
re-exports them; kernels import them from here, so `kernels/` never imports the API
package. Meaning of each step, with public sources: docs/formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Side of a trellis tile (weights per tile = TILE * TILE = 256).
TILE = 16
#: Weights per tile; also the length of the tail-biting ring in symbols.
TILE_WEIGHTS = TILE * TILE
#: Width of the trellis state in bits (the bitshift window).
STATE_BITS = 16
#: Size of the Sylvester Hadamard blocks applied along both weight axes.
HADAMARD_BLOCK = 128
#: Latent-axis block of the QSRT coupled transforms (normalised Sylvester H512).
COUPLED_RESIDUAL_BLOCK = 512

# 3INST: x = x * INST3_MUL + INST3_ADD (mod 2^32), then the lop3 step.
INST3_MUL = 89226354
INST3_ADD = 64248484
# MCG: x = x * MCG_MUL (mod 2^32), then the lop3 step.
MCG_MUL = 0xCBAC1FED
# lop3 step: x = (x & LOP3_MASK) ^ LOP3_XOR; value = fp16(lo16 + hi16) read as fp16.
LOP3_MASK = 0x8FFF8FFF
LOP3_XOR = 0x3B603B60
# MUL1: x = x * MUL1_MUL; s = byte sum of x; h = fp16 bits (0x6400 + s) = 1024 + s;
# value = fp16(h * k_inv + k_bias), one rounding.
MUL1_MUL = 0x83DCD12D
MUL1_H_BASE_BITS = 0x6400
MUL1_KINV_BITS = 0x1EEE
MUL1_KBIAS_BITS = 0xC931
# sqg_e4m3 (QSRT): p = SQG_MUL * m + SQG_ADD (mod 2^32) after an xorshift by SQG_XORSHIFT.
SQG_MUL = 0x3FA7D929
SQG_ADD = 0xC928FD8E
SQG_XORSHIFT = 11
#: Entries of the generated E4M3FN table T12 (one per 16 ranks of 65,536).
T12_SIZE = 4096
#: T12 is built from round_e4m3fn(T12_SCALE * Phi^-1((r + 0.5) / 65536)).
T12_SCALE = 1.5
#: SHA-256 of the 4,096 T12 bytes.
T12_SHA256 = "cca11fe5744c9c93a34f4217f342fbc0f74ecc8a007c076582424a505fc9da5e"


@dataclass(frozen=True)
class Codebook:
    """What the rest of the code needs to know about one codebook (state -> value map).

    Attributes:
        name: the codebook's name in weights, specs and flags.
        bits_range: inclusive range of bits per weight (K) it supports.
        decode: ``"alu"`` (the value is computed from the state: multiply, then lop3 or
            byte sum) or ``"table"`` (the state indexes a per-K state table that the GEMMs
            stage in shared memory and the layer passes as ``codebook_table``).
        table_bytes_per_k: shared memory of its state table for one K (0 for ALU decode).
        replicates: its first step is one multiplication of the state, so a byte-aligned
            state may arrive replicated in both 16-bit halves (kernels/decode.py,
            ``REPLICATE``); a table codebook indexes memory with the state and cannot.
        needs_cvt_e4m3: its decode needs ``cvt.rn.f16x2.e4m3x2`` (``ArchLimits.cvt_e4m3``).
        rms: root mean square of its values over all 65,536 states (the same for every
            K); the scale that maps a unit-RMS weight onto the codebook is ``1 / rms``.
        family: the storage format it comes from, ``"exl3"`` or ``"qsrt"``.
        exl3_marker: the int32 scalar an EXL3 file stores under the codebook's name to
            select it (its multiplier), or None (3inst: no marker; QSRT codebooks).
    """

    name: str
    bits_range: tuple[int, int]
    decode: str
    table_bytes_per_k: int = 0
    replicates: bool = False
    needs_cvt_e4m3: bool = False
    rms: float = 1.0
    family: str = "exl3"
    exl3_marker: int | None = None

    @property
    def table(self) -> bool:
        """Decoded through a state table (whose values, unlike ALU values, depend on K)."""
        return self.decode == "table"

    def table_bytes(self, rates: int = 1) -> int:
        """Shared memory of its state tables for `rates` distinct K (0 for ALU decode)."""
        return self.table_bytes_per_k * rates

    def supports(self, bits) -> bool:
        """`bits` is an int in `bits_range`."""
        lo, hi = self.bits_range
        return isinstance(bits, int) and not isinstance(bits, bool) and lo <= bits <= hi


#: Every supported codebook's record, by name (the one list of codebooks).
CODEBOOK: dict[str, Codebook] = {c.name: c for c in (
    Codebook("3inst", (2, 6), "alu", replicates=True, rms=1.243711),
    Codebook("mcg", (2, 6), "alu", replicates=True, rms=1.244112, exl3_marker=MCG_MUL),
    Codebook("mul1", (2, 6), "alu", replicates=True, rms=1.000312, exl3_marker=MUL1_MUL),
    Codebook("sqg_e4m3", (2, 4), "table", table_bytes_per_k=1 << STATE_BITS,
             needs_cvt_e4m3=True, rms=1.498585, family="qsrt"),
)}
#: Supported codebooks (state -> value maps), in `CODEBOOK` order.
CODEBOOKS = tuple(CODEBOOK)
#: Inclusive range of bits per weight (K) supported by each codebook.
BITS_RANGE = {name: c.bits_range for name, c in CODEBOOK.items()}
#: Codebooks decoded through a state table.
TABLE_CODEBOOKS = tuple(name for name, c in CODEBOOK.items() if c.table)


def exl3_codebook(has_tensor) -> str:
    """The codebook an EXL3 layer selects by its marker tensors: the first codebook (in
    `CODEBOOK` order) whose name `has_tensor(name)` reports present, else the EXL3 codebook
    without a marker (3inst). Only presence matters, never the marker's value."""
    for c in CODEBOOK.values():
        if c.exl3_marker is not None and has_tensor(c.name):
            return c.name
    (default,) = (c.name for c in CODEBOOK.values() if c.family == "exl3" and c.exl3_marker is None)
    return default


def codebook(name: str) -> Codebook:
    """The record of codebook `name`.

    Raises:
        ValueError: for an unknown codebook; the message lists the known ones.
    """
    try:
        return CODEBOOK[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codebook {name!r}; expected one of {CODEBOOKS}") from None

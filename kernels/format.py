"""Trellis weight-format constants (EXL3 3inst / mcg / mul1, QSRT sqg_e4m3); no torch, no cutlass.

The one owner of the numbers both the kernels and the reference codec need: tile and
Hadamard-block sizes, the state width, the codebooks and their bit ranges, and each
codebook's multipliers, masks and table facts. `kquant_cute.trellis` (the torch
reference codec) re-exports them; kernels import them from here, so `kernels/` never
imports the API package. Meaning of each step: BRIEF section 2 (EXL3) and 3 (QSRT).
"""

from __future__ import annotations

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

#: Supported codebooks (state -> value maps).
CODEBOOKS = ("3inst", "mcg", "mul1", "sqg_e4m3")
#: Inclusive range of bits per weight (K) supported by each codebook.
BITS_RANGE = {"3inst": (2, 6), "mcg": (2, 6), "mul1": (2, 6), "sqg_e4m3": (2, 4)}

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

"""Reference trellis codec (torch): decode, pack, rotate and check EXL3 / QSRT trellis weights.

This module owns everything the rest of kquant-cute needs to know about how a
trellis-coded linear layer is stored and what it means:

* the format constants (tile size, Hadamard block, codebook multipliers and masks, the
  SHA-256 of the generated sqg_e4m3 table), re-exported from ``kernels/format.py``;
* the codebooks (16-bit state -> fp16 / E4M3FN value) and their 65,536-entry tables;
* the tile bitstream (pack / unpack / states, tail-biting ring, lane-fragment positions);
* whole-layer decode, the 128-point Hadamard rotation, the dense weight and the
  four-step reference forward.

Everything is plain, vectorised torch and runs on CPU or CUDA tensors. Importing the
module does no work beyond importing torch: tables are built lazily and cached.

Format summary (docs/formats.md, with public sources): a layer ``y = x @ W`` with ``W`` of shape
``[in, out]`` stores ``trellis`` int16 ``[in/16, out/16, 16*K]``; tile ``(i, j)`` holds the
256 weights of ``W_hat[16i:16i+16, 16j:16j+16]`` as a 256*K-bit ring. Weight ``t`` reads
the 16-bit state ``x_t`` = stream bits ``[(t+1)K-16, (t+1)K)`` (mod 256K, MSB first) and
sits at ``(row, col)`` of :func:`tile_position_map`. ``W = diag(suh) H W_hat H diag(svh)``
with ``H`` the block-diagonal 128-point Sylvester Hadamard.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import threading
from typing import Optional

import torch

__all__ = [
    "TILE",
    "TILE_WEIGHTS",
    "STATE_BITS",
    "HADAMARD_BLOCK",
    "CODEBOOKS",
    "BITS_RANGE",
    "CODEBOOK",
    "Codebook",
    "codebook_record",
    "INST3_MUL",
    "INST3_ADD",
    "MCG_MUL",
    "MUL1_MUL",
    "LOP3_MASK",
    "LOP3_XOR",
    "MUL1_H_BASE_BITS",
    "MUL1_KINV_BITS",
    "MUL1_KBIAS_BITS",
    "SQG_MUL",
    "SQG_ADD",
    "SQG_XORSHIFT",
    "T12_SIZE",
    "T12_SCALE",
    "T12_SHA256",
    "check_codebook",
    "state_to_value",
    "codebook_lut",
    "t12_table",
    "sqg_state_table",
    "sqg_pair_table",
    "sqg_kernel_tables",
    "state_table",
    "kernel_tables",
    "tile_position_map",
    "tile_inverse_position_map",
    "tiles_to_matrix",
    "matrix_to_tiles",
    "pack",
    "unpack",
    "tile_states",
    "decode",
    "random_trellis",
    "hadamard_128",
    "rotate_blocks",
    "COUPLED_RESIDUAL_BLOCK",
    "rotate_h512",
    "dense_weight",
    "linear_forward",
]

# --------------------------------------------------------------------------------------
# Format constants
# --------------------------------------------------------------------------------------

# Owned by kernels/format.py (torch-free, so the kernels need not import this module);
# re-exported here as part of the codec's API.
from .kernels.format import (  # noqa: E402,F401
    TILE, TILE_WEIGHTS, STATE_BITS, HADAMARD_BLOCK, CODEBOOKS, BITS_RANGE, CODEBOOK, Codebook,
    INST3_MUL,
    INST3_ADD, MCG_MUL, LOP3_MASK, LOP3_XOR, MUL1_MUL, MUL1_H_BASE_BITS, MUL1_KINV_BITS,
    MUL1_KBIAS_BITS, SQG_MUL, SQG_ADD, SQG_XORSHIFT, T12_SIZE, T12_SCALE, T12_SHA256,
    COUPLED_RESIDUAL_BLOCK,
)
from .kernels.format import codebook as codebook_record, exl3_codebook  # noqa: E402,F401

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF

_lock = threading.Lock()
_LUT_CACHE: dict[tuple[str, int, str], torch.Tensor] = {}
_T12_CACHE: dict[str, torch.Tensor] = {}
_POS_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_HAD_CACHE: dict[tuple[torch.dtype, str], torch.Tensor] = {}


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------


def check_codebook(codebook: str, bits: int) -> None:
    """Raise ValueError unless ``codebook`` is known and ``bits`` is in its range."""
    if codebook not in BITS_RANGE:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
        raise ValueError(f"bits must be an int, got {type(bits).__name__} ({bits!r})")
    lo, hi = BITS_RANGE[codebook]
    if not lo <= bits <= hi:
        raise ValueError(
            f"codebook {codebook!r} supports {lo}..{hi} bits per weight, got bits={bits}"
        )


def _bits_of(trellis: torch.Tensor, name: str = "trellis") -> int:
    """K from the last dimension (16*K) of an int16 trellis tensor."""
    if trellis.dtype != torch.int16:
        raise ValueError(f"{name} must be int16, got {trellis.dtype}")
    if trellis.dim() < 1 or trellis.shape[-1] % TILE != 0 or trellis.shape[-1] == 0:
        raise ValueError(
            f"{name} last dimension must be 16*K (K bits per weight), got shape "
            f"{tuple(trellis.shape)}"
        )
    return trellis.shape[-1] // TILE


def _key(device: torch.device) -> str:
    return str(device)


# --------------------------------------------------------------------------------------
# Codebooks
# --------------------------------------------------------------------------------------


def _bits_to_fp16(bits16: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer values in [0, 65536) as fp16 bit patterns."""
    signed = torch.where(bits16 >= 0x8000, bits16 - 0x10000, bits16)
    return signed.to(torch.int16).view(torch.float16)


def _fp16_const(bits16: int, device: torch.device) -> torch.Tensor:
    return _bits_to_fp16(torch.tensor([bits16], dtype=torch.int64, device=device))


def _lop3_value(x: torch.Tensor) -> torch.Tensor:
    """lop3 step on uint32 values held in int64: fp16(lo + hi) as float32."""
    x = (x & LOP3_MASK) ^ LOP3_XOR
    lo = _bits_to_fp16(x & _MASK16).float()
    hi = _bits_to_fp16(x >> 16).float()
    # Both halves have exponents in [2^-3, 2): the fp32 sum is exact, so a single cast
    # to fp16 is the one round-to-nearest-even rounding of the format.
    return (lo + hi).half().float()


def _mul1_value(x: torch.Tensor) -> torch.Tensor:
    x = (x * MUL1_MUL) & _MASK32
    s = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    h = _bits_to_fp16(MUL1_H_BASE_BITS + s).float()  # == 1024 + s exactly
    k_inv = _fp16_const(MUL1_KINV_BITS, x.device).float()
    k_bias = _fp16_const(MUL1_KBIAS_BITS, x.device).float()
    # h * k_inv has <= 22 significant bits and the sum stays below 16 with ulp >= 2^-18,
    # so both fp32 operations are exact: the cast is one rounding, as a half fma.
    return (h * k_inv + k_bias).half().float()


def _sqg_byte(x: torch.Tensor, bits: int) -> torch.Tensor:
    """E4M3FN byte (int64) of each sqg_e4m3 state: T12[rank(x) >> 4]."""
    w = STATE_BITS - bits
    m_mask = (1 << w) - 1
    h = x >> bits
    b = x & ((1 << bits) - 1)
    m = h ^ (h >> SQG_XORSHIFT)
    m = m ^ ((m << SQG_XORSHIFT) & m_mask)
    p = (m * SQG_MUL + SQG_ADD) & _MASK32
    phase = p & m_mask
    rev = torch.zeros_like(b)
    for k in range(bits):
        rev |= ((b >> k) & 1) << (bits - 1 - k)
    j = rev ^ (p >> (32 - bits))
    rank = (j << w) | phase
    table = t12_table(device=x.device).long()
    return table[rank >> 4]


def _sqg_value(x: torch.Tensor, bits: int) -> torch.Tensor:
    return _sqg_byte(x, bits).to(torch.uint8).view(torch.float8_e4m3fn).float()


def state_to_value(states: torch.Tensor, codebook: str, bits: int) -> torch.Tensor:
    """Value of each 16-bit trellis state under ``codebook`` at ``bits`` per weight.

    ``states`` is an integer tensor with values in [0, 65536); an int16 tensor is read
    as the raw 16-bit pattern (negative values are states >= 0x8000). Returns float32 of
    the same shape: exact fp16 values for 3inst / mcg / mul1 (independent of ``bits``),
    the E4M3FN value for sqg_e4m3 (which depends on ``bits``).
    """
    check_codebook(codebook, bits)
    if states.dtype.is_floating_point or states.dtype.is_complex or states.dtype == torch.bool:
        raise ValueError(f"states must be an integer tensor, got {states.dtype}")
    x = states.to(torch.int64)
    if states.dtype == torch.int16:
        x = x & _MASK16
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > _MASK16):
        raise ValueError("states must lie in [0, 65536)")
    if codebook == "3inst":
        return _lop3_value((x * INST3_MUL + INST3_ADD) & _MASK32)
    if codebook == "mcg":
        return _lop3_value((x * MCG_MUL) & _MASK32)
    if codebook == "mul1":
        return _mul1_value(x)
    if codebook == "sqg_e4m3":
        return _sqg_value(x, bits)
    raise ValueError(f"codebook {codebook!r} has no reference decode")


def _cached(key: tuple, dev: torch.device, build_on_cpu) -> torch.Tensor:
    """The table under ``key + (device,)``: built once on the CPU by ``build_on_cpu()``,
    copied to other devices from the CPU table; shared by every caller."""
    full = (*key, _key(dev))
    table = _LUT_CACHE.get(full)
    if table is None:
        table = (_cached(key, torch.device("cpu"), build_on_cpu).to(dev) if dev.type != "cpu"
                 else build_on_cpu())
        with _lock:
            table = _LUT_CACHE.setdefault(full, table)
    return table


def codebook_lut(
    codebook: str, bits: int, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """float32 [65536]: value of every 16-bit state.

    Cached per codebook / bits / device; the returned tensor is shared, do not modify it.
    """
    check_codebook(codebook, bits)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    # Only a table codebook's values depend on K; share one table across K for the others.
    return _cached((codebook, bits if CODEBOOK[codebook].table else 0), dev,
                   lambda: state_to_value(torch.arange(1 << STATE_BITS), codebook, bits))


def sqg_state_table(bits: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8 [65536]: the E4M3FN byte of every 16-bit sqg_e4m3 state at ``bits`` per
    weight (``table[x] = T12[rank(x) >> 4]``), the direct table the fused kernels stage in
    shared memory. Cached per K / device; the tensor is shared, do not modify it."""
    check_codebook("sqg_e4m3", bits)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _cached(("sqg_e4m3_bytes", bits), dev,
                   lambda: _sqg_byte(torch.arange(1 << STATE_BITS), bits).to(torch.uint8))


def sqg_pair_table(bits: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8 [2^(16-K) * 2^(K+1)] (128 KiB for every K): the sqg_e4m3 pair table.

    Two consecutive states of a tile share 16 - K bits: x_{t+1} = ((x_t << K) | b) & 0xFFFF,
    so s = x_t & (2^(16-K) - 1) = x_{t+1} >> K. Entry s (2^(K+1) bytes at 2^(K+1) * s)
    holds the E4M3FN bytes of every state either neighbour can be: bytes [0, 2^K) are
    ``sqg_state_table[(a << (16-K)) | s]`` for the earlier state's top bits a, bytes
    [2^K, 2^(K+1)) are ``sqg_state_table[(s << K) | b]`` for the later state's new bits b.
    One load of the entry and one byte select per state decode a pair of weights (the K=2
    GEMM decode: an 8-byte entry, one byte permute). Cached per K / device; shared."""
    check_codebook("sqg_e4m3", bits)
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def build() -> torch.Tensor:
        direct = sqg_state_table(bits)
        w = STATE_BITS - bits
        s = torch.arange(1 << w).unsqueeze(1)
        c = torch.arange(1 << bits).unsqueeze(0)
        earlier = direct[(c << w) | s]  # [2^w, 2^K], candidate a = c
        later = direct[(s << bits) | c]  # candidate b = c
        return torch.cat([earlier, later], dim=1).reshape(-1).contiguous()

    return _cached(("sqg_e4m3_pairs", bits), dev, build)


def sqg_kernel_tables(rates: tuple, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8: the `codebook_table` argument of the fused sqg_e4m3 kernels for a layer of K in
    `rates` (ascending; one K for a uniform layer) that decodes through direct tables or T12
    (`MoESpec.table_layout()` "direct"): the direct table of each K (`sqg_state_table`,
    65,536 bytes each, in `rates` order), then T12 (4,096 bytes). A specialization stages
    the part its `MoESpec.table_decode` reads (the direct tables, or T12 at offset 65,536 x
    len(rates): `kernels/decode.py`'s `table_offset`), so every plan of a layer shares one
    tensor."""
    rates = tuple(rates)
    if not rates:
        raise ValueError("rates must name at least one K")
    return torch.cat([sqg_state_table(k, device) for k in rates] + [t12_table(device)])


def state_table(codebook: str, bits: int,
                device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8 [65536]: the direct state table of a table codebook at ``bits`` per weight
    (``format.Codebook.table``), e.g. :func:`sqg_state_table` for sqg_e4m3.

    Raises:
        ValueError: for an unknown codebook, a K outside its range, or an ALU codebook
            (which has no state table).
    """
    check_codebook(codebook, bits)
    if codebook == "sqg_e4m3":
        return sqg_state_table(bits, device)
    raise ValueError(f"codebook {codebook!r} decodes without a state table")


def kernel_tables(codebook: str, rates: tuple,
                  device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8: the ``codebook_table`` argument of the fused kernels for a layer of a table
    codebook with K in ``rates`` that decodes through direct tables or T12 (for sqg_e4m3:
    :func:`sqg_kernel_tables`).

    Raises:
        ValueError: for an unknown codebook, a K outside its range, or an ALU codebook.
    """
    for k in rates:
        check_codebook(codebook, k)
    if codebook == "sqg_e4m3":
        return sqg_kernel_tables(rates, device)
    raise ValueError(f"codebook {codebook!r} decodes without a state table")


def _generate_t12() -> torch.Tensor:
    r = torch.arange(1 << 16, dtype=torch.float64)
    y = T12_SCALE * torch.special.ndtri((r + 0.5) / float(1 << 16))
    # torch's float64 -> float8_e4m3fn conversion rounds to nearest even (the SHA-256
    # check below would catch a platform where it does not).
    byte = y.to(torch.float8_e4m3fn).view(torch.uint8).long()
    byte = torch.where(byte == 0x80, torch.zeros_like(byte), byte)  # -0 -> 0x00
    groups = byte.view(T12_SIZE, 16)
    counts = torch.zeros(T12_SIZE, 256, dtype=torch.int64)
    counts.scatter_add_(1, groups, torch.ones_like(groups))
    best = counts.max(dim=1, keepdim=True).values
    candidates = torch.arange(256).expand(T12_SIZE, 256)
    mode = torch.where(counts == best, candidates, 256).min(dim=1).values  # ties: smallest
    return mode.to(torch.uint8)


def t12_table(device: Optional[torch.device | str] = None) -> torch.Tensor:
    """uint8 [4096]: the generated sqg_e4m3 table, verified against ``T12_SHA256``.

    Built on first use and cached per device; the tensor is shared, do not
    modify it.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    table = _T12_CACHE.get(_key(dev))
    if table is not None:
        return table
    if dev.type != "cpu":
        table = t12_table().to(dev)
    else:
        table = _generate_t12()
        digest = hashlib.sha256(table.numpy().tobytes()).hexdigest()
        if digest != T12_SHA256:
            raise RuntimeError(
                f"generated T12 table has SHA-256 {digest}, expected {T12_SHA256}; "
                "the platform's ndtri or float8_e4m3fn rounding differs from the reference"
            )
    with _lock:
        return _T12_CACHE.setdefault(_key(dev), table)


# --------------------------------------------------------------------------------------
# Tile layout and bitstream
# --------------------------------------------------------------------------------------


def _position_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = _key(device)
    maps = _POS_CACHE.get(key)
    if maps is None:
        t = torch.arange(TILE_WEIGHTS, dtype=torch.int64)
        lane, i = t >> 3, t & 7
        rows = 2 * (lane % 4) + (i & 1) + 8 * ((i >> 1) & 1)
        cols = (lane >> 2) + 8 * (i >> 2)
        inverse = torch.empty_like(t)
        inverse[rows * TILE + cols] = t
        maps = (rows.to(device), cols.to(device), inverse.to(device))
        with _lock:
            maps = _POS_CACHE.setdefault(key, maps)
    return maps


def tile_position_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) int64 [256]: position of weight t inside its 16x16 tile.

    ``row`` indexes the input (reduction) axis and ``col`` the output axis; this is the
    mma.sync m16n8k16 B-fragment layout (lane L = t >> 3 owns weights 8L..8L+7).
    """
    rows, cols, _ = _position_maps(torch.device("cpu"))
    return rows.clone(), cols.clone()


def tile_inverse_position_map() -> torch.Tensor:
    """int64 [256]: ``inv[16*row + col] = t`` (inverse of :func:`tile_position_map`)."""
    return _position_maps(torch.device("cpu"))[2].clone()


def _halfwords(trellis: torch.Tensor) -> torch.Tensor:
    """Stream-ordered 16-bit halfwords (int64 in [0, 65536)) of int16 tile words.

    Halfword q holds stream bits 16q..16q+15 (MSB first). The int16 array is a view of
    little-endian uint32 words whose high half comes first in the stream, so stream
    halfword q lives at int16 index q ^ 1.
    """
    n = trellis.shape[-1]
    swap = torch.arange(n, device=trellis.device) ^ 1
    return trellis.index_select(-1, swap).to(torch.int64) & _MASK16


def tile_states(trellis: torch.Tensor) -> torch.Tensor:
    """int64 [..., 256]: the 16-bit state x_t of every weight of every tile.

    ``x_t`` = stream bits [(t+1)K - 16, (t+1)K) modulo the 256*K-bit ring, first bit MSB.
    """
    bits = _bits_of(trellis)
    n_half = trellis.shape[-1]
    ring = n_half * 16
    words = _halfwords(trellis)
    t = torch.arange(TILE_WEIGHTS, device=trellis.device, dtype=torch.int64)
    start = ((t + 1) * bits - STATE_BITS) % ring
    q0 = start >> 4
    q1 = (q0 + 1) % n_half
    off = start & 15
    lead = words.shape[:-1]
    w0 = words.index_select(-1, q0)
    w1 = words.index_select(-1, q1)
    window = (w0 << 16) | w1  # 32 stream bits starting at bit 16*q0
    states = (window >> (16 - off)) & _MASK16
    return states.reshape(*lead, TILE_WEIGHTS)


def unpack(trellis: torch.Tensor) -> torch.Tensor:
    """int64 [..., 256]: the K-bit symbols (stream bits [tK, (t+1)K)) of every tile."""
    bits = _bits_of(trellis)
    return tile_states(trellis) & ((1 << bits) - 1)


def pack(symbols: torch.Tensor, bits: int) -> torch.Tensor:
    """int16 [..., 16*bits]: pack K-bit symbols [..., 256] (weight order t) into tiles."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= STATE_BITS:
        raise ValueError(f"bits must be an int in 1..16, got {bits!r}")
    if symbols.dtype.is_floating_point or symbols.dtype.is_complex:
        raise ValueError(f"symbols must be an integer tensor, got {symbols.dtype}")
    if symbols.dim() < 1 or symbols.shape[-1] != TILE_WEIGHTS:
        raise ValueError(
            f"symbols must have last dimension 256, got shape {tuple(symbols.shape)}"
        )
    sym = symbols.to(torch.int64)
    if sym.numel() and (int(sym.min()) < 0 or int(sym.max()) >= (1 << bits)):
        raise ValueError(f"symbols must lie in [0, 2^{bits})")
    lead = sym.shape[:-1]
    k = torch.arange(bits - 1, -1, -1, device=sym.device)
    stream = ((sym.unsqueeze(-1) >> k) & 1).reshape(*lead, 16 * bits, 16)  # MSB first
    weights = 1 << torch.arange(15, -1, -1, device=sym.device)
    half = (stream * weights).sum(-1)  # stream halfword q, in [0, 65536)
    swap = torch.arange(16 * bits, device=sym.device) ^ 1
    half = half.index_select(-1, swap)
    return torch.where(half >= 0x8000, half - 0x10000, half).to(torch.int16)


# --------------------------------------------------------------------------------------
# Whole-layer decode
# --------------------------------------------------------------------------------------


def tiles_to_matrix(values: torch.Tensor) -> torch.Tensor:
    """[I, J, 256] per-tile values in weight order t -> [16I, 16J] matrix.

    Rows are the input (reduction) axis: weight t of tile (i, j) lands at
    ``[16i + row[t], 16j + col[t]]`` (see :func:`tile_position_map`).
    """
    n_in, n_out = values.shape[0], values.shape[1]
    inverse = _position_maps(values.device)[2]
    tiles = values.index_select(-1, inverse).view(n_in, n_out, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(n_in * TILE, n_out * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """[16I, 16J] matrix -> [I, J, 256] per-tile values in weight order t.

    Inverse of :func:`tiles_to_matrix`.
    """
    rows, cols = matrix.shape
    if rows % TILE or cols % TILE:
        raise ValueError(f"matrix dimensions must be multiples of 16, got {tuple(matrix.shape)}")
    tiles = matrix.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3)
    r, c, _ = _position_maps(matrix.device)
    flat = tiles.reshape(rows // TILE, cols // TILE, TILE_WEIGHTS)
    return flat.index_select(-1, r * TILE + c)


def decode(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """float32 [in, out]: ``W_hat`` of an int16 trellis [in/16, out/16, 16K]."""
    bits = _bits_of(trellis)
    if trellis.dim() != 3:
        raise ValueError(
            f"trellis must be 3-D [in/16, out/16, 16K], got shape {tuple(trellis.shape)}"
        )
    check_codebook(codebook, bits)
    lut = codebook_lut(codebook, bits, trellis.device)
    values = lut[tile_states(trellis)]
    return tiles_to_matrix(values)


def random_trellis(
    in_features: int,
    out_features: int,
    bits: int,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """int16 [in/16, out/16, 16*bits] of uniform random bits (every bitstream is valid)."""
    if bits < 1 or bits > STATE_BITS:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    if in_features % TILE or out_features % TILE or in_features <= 0 or out_features <= 0:
        raise ValueError(
            f"in_features and out_features must be positive multiples of {TILE}, got "
            f"{in_features} x {out_features}"
        )
    gen_device = generator.device if generator is not None else torch.device("cpu")
    codes = torch.randint(
        -0x8000,
        0x8000,
        (in_features // TILE, out_features // TILE, TILE * bits),
        dtype=torch.int16,
        generator=generator,
        device=gen_device,
    )
    return codes.to(device) if device is not None else codes


# --------------------------------------------------------------------------------------
# Hadamard rotations, dense weight, reference forward
# --------------------------------------------------------------------------------------


def hadamard_128(
    dtype: torch.dtype = torch.float32, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard: ``H[i][j] = (-1)^popcount(i & j) / sqrt(128)``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (dtype, _key(dev))
    h = _HAD_CACHE.get(key)
    if h is None:
        idx = torch.arange(HADAMARD_BLOCK)
        both = idx[:, None] & idx[None, :]
        parity = torch.zeros_like(both)
        for b in range(7):
            parity ^= (both >> b) & 1
        sign = 1.0 - 2.0 * parity.to(torch.float64)
        h = (sign / math.sqrt(HADAMARD_BLOCK)).to(dtype=dtype, device=dev)
        with _lock:
            h = _HAD_CACHE.setdefault(key, h)
    return h


def rotate_blocks(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Multiply every consecutive 128-block of ``x`` along ``dim`` by H128.

    Equals ``x @ H_blk`` along that dimension (H is symmetric, so also ``H_blk @ x``).
    """
    if not x.dtype.is_floating_point:
        raise ValueError(f"rotate_blocks needs a floating tensor, got {x.dtype}")
    n = x.shape[dim]
    if n % HADAMARD_BLOCK:
        raise ValueError(f"dimension {dim} has size {n}, not a multiple of {HADAMARD_BLOCK}")
    moved = x.movedim(dim, -1)
    h = hadamard_128(x.dtype, x.device)
    out = (moved.reshape(*moved.shape[:-1], n // HADAMARD_BLOCK, HADAMARD_BLOCK) @ h)
    return out.reshape(moved.shape).movedim(-1, dim)


def rotate_h512(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Multiply every consecutive 512-block of ``x`` along ``dim`` by the normalised H512.

    H512 = H4 (x) H128 (Sylvester): H128 on each 128-block, then ``0.5 * H4`` across each
    group of four consecutive blocks. Symmetric and orthogonal, so its own inverse. The QSRT
    coupled profile applies it to the latent axis before FC1 and after the top-k sum.
    """
    n = x.shape[dim]
    if n % COUPLED_RESIDUAL_BLOCK:
        raise ValueError(f"dimension {dim} has size {n}, not a multiple of {COUPLED_RESIDUAL_BLOCK}")
    moved = rotate_blocks(x, dim).movedim(dim, -1)
    g = moved.reshape(*moved.shape[:-1], n // COUPLED_RESIDUAL_BLOCK, 4, HADAMARD_BLOCK)
    a, b, c, d = g.unbind(-2)
    out = torch.stack((a + b + c + d, a - b + c - d, a + b - c - d, a - b - c + d), dim=-2) * 0.5
    return out.reshape(moved.shape).movedim(-1, dim)


def _check_layer(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> tuple[int, int]:
    _bits_of(trellis)
    if trellis.dim() != 3:
        raise ValueError(
            f"trellis must be 3-D [in/16, out/16, 16K], got shape {tuple(trellis.shape)}"
        )
    n_in, n_out = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if suh.shape != (n_in,):
        raise ValueError(f"suh must have shape ({n_in},), got {tuple(suh.shape)}")
    if svh.shape != (n_out,):
        raise ValueError(f"svh must have shape ({n_out},), got {tuple(svh.shape)}")
    if n_in % HADAMARD_BLOCK or n_out % HADAMARD_BLOCK:
        raise ValueError(
            f"in ({n_in}) and out ({n_out}) features must be multiples of {HADAMARD_BLOCK}"
        )
    return n_in, n_out


def dense_weight(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``W = diag(suh) H_blk W_hat H_blk diag(svh)`` [in, out], so ``y = x @ W``.

    Computed in float64 when ``dtype`` is float64, float32 otherwise, then cast.
    """
    _check_layer(trellis, suh, svh)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    w = decode(trellis, codebook).to(work)
    w = rotate_blocks(rotate_blocks(w, dim=0), dim=1)
    w = suh.to(work)[:, None] * w * svh.to(work)[None, :]
    return w.to(dtype)


def linear_forward(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Four-step reference forward of one trellis linear layer.

    ``x1 = x * suh``; ``x2 = x1 @ H_blk``; ``y1 = x2 @ W_hat``; ``y = (y1 @ H_blk) * svh``
    (+ ``bias``). Computes and returns float64 when ``x`` is float64, else float32.
    ``x`` has shape [..., in]; the result [..., out].
    """
    n_in, n_out = _check_layer(trellis, suh, svh)
    if x.shape[-1] != n_in:
        raise ValueError(f"x last dimension must be {n_in}, got shape {tuple(x.shape)}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"bias must have shape ({n_out},), got {tuple(bias.shape)}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x2 = rotate_blocks(x.to(work) * suh.to(work), dim=-1)
    y1 = x2 @ decode(trellis, codebook).to(work)
    y = rotate_blocks(y1, dim=-1) * svh.to(work)
    if bias is not None:
        y = y + bias.to(work)
    return y

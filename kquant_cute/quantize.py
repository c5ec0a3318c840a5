"""Viterbi trellis quantizer: dense fp weights -> EXL3-style trellis layers.

This module owns the encoder side of the format defined in :mod:`kquant_cute.trellis`:

* :func:`viterbi_tiles` -- the core: minimum-squared-error tail-biting Viterbi search
  over the 2^16-state bitshift trellis, vectorised over tiles (a Python loop runs over
  the 256 steps only), processed in memory-bounded chunks of tiles;
* :func:`quantize` -- a whole layer: random sign vectors, 128-point Hadamard rotation
  on both axes, a per-tensor scale search folded into ``svh``, then Viterbi per tile;
* :func:`distortion_report` -- measured MSE on unit Gaussian data against the
  distortion-rate bound D(R) = 2^(-2R) (``python -m kquant_cute.quantize``);
* :func:`steady_state_ratio` -- the trellis' own per-weight distortion on long sequences,
  the lower bound for any tail-biting tile (``--steady-state``).

Trellis model: weight t of a tile (in t order) reads the 16-bit state x_t; consecutive
states shift in K new bits, ``x_t = ((x_{t-1} << K) | e_t) & 0xFFFF``, and the ring is
tail-biting: the high 16-K bits of x_0 are the low 16-K bits of x_255. The search runs
two passes: an unconstrained probe over a 128-weight window centred on the wrap point
(weights 192..255, 0..63), whose survivor at weight 255 fixes the wrap-around bits, then
a full pass constrained to start and end on them. The result is always an exactly
decodable tile. Its small loss against the best of 16 wrap points (the ring rolled by
0, 16, .., 240), and its larger distance from the unconstrained-start optimum (not a valid
code: a free x_0 adds 16-K bits per tile, a rate effect rather than search loss), are
measured in docs/quantizer.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch

from . import trellis as tc

__all__ = ["viterbi_tiles", "quantize", "distortion_report", "steady_state_ratio",
           "DEFAULT_SCALE_FACTORS"]

#: Multipliers tried around the RMS-matched scale by :func:`quantize`'s scale search; they
#: bracket the optimum on Gaussian data, which grows with K (docs/quantizer.md).
DEFAULT_SCALE_FACTORS = (0.95, 1.05, 1.15, 1.25)
#: Memory budget of one chunk of tiles (bytes; back-pointers plus per-step work arrays),
#: per device type. Larger GPU chunks amortise the per-step launches.
_CHUNK_BUDGET = {"cpu": 256 << 20, "cuda": 2 << 30}
#: Per-step float32 work arrays over all 2^16 states (accumulator, its successor, slack).
_WORK_ARRAYS = 3
#: Tiles sampled by the scale search.
_SCALE_SAMPLE_TILES = 16


def _viterbi_pass(
    target: torch.Tensor, lut: torch.Tensor, bits: int, wrap: Optional[torch.Tensor]
) -> torch.Tensor:
    """Minimum-squared-error state path for a chunk of tiles.

    ``target`` float32 [C, S]; ``lut`` float32 [2^L] (L-bit states, L = 16 for the
    format; smaller L only in tests) on the same device. When ``wrap`` (int64 [C]) is
    given, the path must start in a state whose high L-K bits equal it and end in a
    state whose low L-K bits equal it. Returns int64 [C, S] states.
    """
    c, steps = target.shape
    n_states = lut.numel()
    fan = 1 << bits  # predecessors per state == symbols per step
    rows = n_states >> bits  # successor groups: x = r * fan + e
    dev = target.device
    # (v - y)^2 = v^2 - 2 y v + y^2 as one fused addcmul over all states; the y^2 term is
    # common to a step's states, so it is added on the [C, rows] survivors instead,
    # keeping the accumulator equal to the true running squared error.
    lut_sq = lut.square().view(1, rows, fan)
    lut_v = lut.view(1, rows, fan)
    minus_2y = (-2.0 * target).view(c, steps, 1, 1)
    y_sq = target.square()
    back = torch.empty(steps, c, rows, dtype=torch.uint8, device=dev)

    acc = torch.addcmul(lut_sq, minus_2y[:, 0], lut_v).view(c, n_states)
    acc.add_(y_sq[:, 0:1])
    if wrap is not None:
        allowed = (torch.arange(n_states, device=dev)[None, :] >> bits) == wrap[:, None]
        acc = acc.masked_fill(~allowed, float("inf"))
    for t in range(1, steps):
        # predecessor p = a * rows + r shifts to successor x = r * fan + e
        best, arg = acc.view(c, fan, rows).min(dim=1)
        back[t] = arg
        best.add_(y_sq[:, t : t + 1])
        acc = torch.addcmul(lut_sq, minus_2y[:, t], lut_v)
        acc.add_(best.unsqueeze(-1))
        acc = acc.view(c, n_states)
    if wrap is not None:
        ends = wrap[:, None] + rows * torch.arange(fan, device=dev)[None, :]  # [C, fan]
        last = ends.gather(1, acc.gather(1, ends).argmin(dim=1, keepdim=True)).squeeze(1)
    else:
        last = acc.argmin(dim=1)
    states = torch.empty(c, steps, dtype=torch.int64, device=dev)
    states[:, -1] = last
    x = last
    for t in range(steps - 1, 0, -1):
        r = x >> bits
        a = back[t].gather(1, r.unsqueeze(1)).squeeze(1).to(torch.int64)
        x = a * rows + r
        states[:, t - 1] = x
    return states


#: Steps on each side of the ring's wrap point searched by the probe pass.
_PROBE_HALF_WINDOW = 64


def _viterbi_chunk(target: torch.Tensor, lut: torch.Tensor, bits: int) -> torch.Tensor:
    rows_mask = (1 << (tc.STATE_BITS - bits)) - 1
    h = _PROBE_HALF_WINDOW
    # Pass 1 (probe): unconstrained search over a window centred on the ring's wrap
    # point (weights 256-h .. 255, 0 .. h-1). Its survivor at weight 255 fixes the bits
    # shared by x_255 and x_0; decisions that far from the window edges are settled.
    window = torch.cat([target[:, -h:], target[:, :h]], dim=1)
    probe = _viterbi_pass(window, lut, bits, None)
    wrap = probe[:, h - 1] & rows_mask  # low 16-K bits of x_255 == high bits of x_0
    # Pass 2: the whole ring with the wrap bits pinned at both ends.
    states = _viterbi_pass(target, lut, bits, wrap)
    return states & ((1 << bits) - 1)


def _default_chunk(bits: int, device: torch.device) -> int:
    """Tiles per chunk so that one chunk's search fits ``_CHUNK_BUDGET``."""
    budget = _CHUNK_BUDGET.get(device.type, _CHUNK_BUDGET["cpu"])
    back = tc.TILE_WEIGHTS << (tc.STATE_BITS - bits)  # uint8 per (step, survivor group)
    work = _WORK_ARRAYS * 4 << tc.STATE_BITS
    return max(1, budget // (back + work))


def viterbi_tiles(
    target: torch.Tensor,
    bits: int,
    codebook: str,
    *,
    chunk_tiles: Optional[int] = None,
) -> torch.Tensor:
    """Tail-biting Viterbi: symbols int64 [T, 256] whose decoded values approximate ``target``.

    ``target`` is float [T, 256] in weight order t (see
    :func:`kquant_cute.trellis.tile_position_map`), already in codebook units. Runs on
    ``target``'s device. ``pack(symbols, bits)`` decodes to exactly the chosen values.
    ``chunk_tiles`` bounds the tiles searched at once (default: what fits 256 MiB on the
    CPU, 2 GiB on CUDA, counting back-pointers and per-step work arrays).
    """
    tc.check_codebook(codebook, bits)
    if target.dim() != 2 or target.shape[1] != tc.TILE_WEIGHTS:
        raise ValueError(f"target must have shape [T, 256], got {tuple(target.shape)}")
    if not target.dtype.is_floating_point:
        raise ValueError(f"target must be floating point, got {target.dtype}")
    if not bool(torch.isfinite(target).all()):
        raise ValueError("target contains non-finite values")
    tiles = target.shape[0]
    out = torch.empty(tiles, tc.TILE_WEIGHTS, dtype=torch.int64, device=target.device)
    if tiles == 0:
        return out
    lut = tc.codebook_lut(codebook, bits, target.device)
    if chunk_tiles is None:
        chunk_tiles = _default_chunk(bits, target.device)
    if chunk_tiles < 1:
        raise ValueError(f"chunk_tiles must be >= 1, got {chunk_tiles}")
    work = target.to(torch.float32)
    for start in range(0, tiles, chunk_tiles):
        stop = min(tiles, start + chunk_tiles)
        out[start:stop] = _viterbi_chunk(work[start:stop].contiguous(), lut, bits)
    return out


def _random_signs(n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    dev = generator.device if generator is not None else torch.device("cpu")
    bits = torch.randint(0, 2, (n,), generator=generator, device=dev)
    return (1 - 2 * bits).to(torch.float32)


def _fp16_round(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32).half().float())


def quantize(
    w: torch.Tensor,
    bits: int,
    codebook: str = "mcg",
    *,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device | str] = None,
    scale_factors: tuple[float, ...] = DEFAULT_SCALE_FACTORS,
) -> dict[str, torch.Tensor]:
    """Quantize a dense weight ``w`` [in, out] (``y = x @ w``) to a trellis layer.

    Returns ``dict(trellis=int16 [in/16, out/16, 16*bits], suh=fp16 [in], svh=fp16 [out])``
    such that :func:`kquant_cute.trellis.dense_weight` approximates ``w``. Steps: random
    sign vectors (from ``generator``), Hadamard rotation of both axes, a per-tensor scale
    chosen among ``scale_factors`` x the RMS-matched scale by measured MSE on a sample of
    tiles (folded into ``svh``), then :func:`viterbi_tiles` on every tile. Work runs on
    ``device`` (default: ``w``'s device); results are returned there.
    """
    tc.check_codebook(codebook, bits)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [in, out], got shape {tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"w must be floating point, got {w.dtype}")
    n_in, n_out = w.shape
    if n_in % tc.HADAMARD_BLOCK or n_out % tc.HADAMARD_BLOCK or n_in == 0 or n_out == 0:
        raise ValueError(
            f"w dimensions must be positive multiples of {tc.HADAMARD_BLOCK}, got "
            f"{n_in} x {n_out}"
        )
    if not scale_factors or any(f <= 0 for f in scale_factors):
        raise ValueError("scale_factors must be a non-empty tuple of positive numbers")
    dev = torch.device(device) if device is not None else w.device
    work = w.to(device=dev, dtype=torch.float32)
    if not bool(torch.isfinite(work).all()):
        raise ValueError("w contains non-finite values")

    su = _random_signs(n_in, generator).to(dev)
    sv = _random_signs(n_out, generator).to(dev)
    rotated = tc.rotate_blocks(tc.rotate_blocks(su[:, None] * work * sv[None, :], 0), 1)
    tiles = tc.matrix_to_tiles(rotated)
    grid = tiles.shape[:2]
    flat = tiles.reshape(-1, tc.TILE_WEIGHTS)

    if not bool(flat.any()):
        # All-zero weight: any codes, zero output scale.
        symbols = torch.zeros(flat.shape, dtype=torch.int64, device=dev)
        scale = 0.0
    else:
        scale = _search_scale(flat, bits, codebook, scale_factors)
        if not 0.0 < scale < float("inf"):
            raise ValueError(
                f"w's magnitude (rms {float(flat.square().mean().sqrt()):.3g}) cannot be "
                "expressed by an fp16 output scale"
            )
        symbols = viterbi_tiles(flat / scale, bits, codebook)
    trellis = tc.pack(symbols, bits).view(*grid, tc.TILE * bits)
    suh = su.half()
    svh = (sv * scale).half()
    return {"trellis": trellis, "suh": suh, "svh": svh}


def _search_scale(
    flat: torch.Tensor, bits: int, codebook: str, factors: tuple[float, ...]
) -> float:
    """Per-tensor fp16 scale (target = weights / scale) with the least estimated MSE.

    Candidates are ``factors`` x the RMS-matched scale, then the midpoints between the
    best candidate and its neighbours. A candidate's score is the squared error of an
    unconstrained Viterbi pass (same ranking as the tail-biting search, 2/3 of the work)
    on up to ``_SCALE_SAMPLE_TILES`` evenly spaced tiles, with the sample's clipping
    error (weights beyond the codebook's largest magnitude) replaced by the whole
    tensor's: clipping comes from rare outliers that a sample misses, and it dominates
    at high K.
    """
    lut = tc.codebook_lut(codebook, bits, flat.device)
    rms_w = float(flat.square().mean().sqrt())
    base = rms_w / float(lut.square().mean().sqrt())
    if len(factors) == 1:
        return _fp16_round(base * factors[0])
    v_max = float(lut.abs().max())
    count = flat.shape[0]
    picks = torch.linspace(0, count - 1, min(count, _SCALE_SAMPLE_TILES), device=flat.device)
    sample = flat.index_select(0, picks.round().long().unique())
    mags = flat.abs().flatten()
    sample_mags = sample.abs().flatten()
    scores: dict[float, float] = {}
    chunk = _default_chunk(bits, flat.device)

    def clip_error(m: torch.Tensor, s: float) -> float:
        return float((m - v_max * s).clamp_min(0.0).square().sum())

    def score(factor: float) -> float:
        s = _fp16_round(base * factor)
        if s not in scores:
            if not 0.0 < s < float("inf"):
                scores[s] = float("inf")
            else:
                err = 0.0
                for start in range(0, sample.shape[0], chunk):
                    part = sample[start : start + chunk]
                    states = _viterbi_pass(part / s, lut, bits, None)
                    err += float((lut[states] * s - part).square().sum())
                granular = max(0.0, err - clip_error(sample_mags, s)) / sample.numel()
                scores[s] = granular + clip_error(mags, s) / mags.numel()
        return scores[s]

    grid = sorted(factors)
    errs = [score(f) for f in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    if i > 0:
        score(0.5 * (grid[i - 1] + grid[i]))
    if i + 1 < len(grid):
        score(0.5 * (grid[i] + grid[i + 1]))
    return min(scores, key=scores.__getitem__)


def distortion_report(
    bits_list: tuple[int, ...] = (2, 3, 4, 5, 6),
    codebook: str = "mcg",
    *,
    tiles: int = 64,
    seed: int = 0,
    device: Optional[torch.device | str] = None,
    verbose: bool = True,
) -> list[dict[str, float]]:
    """Measured MSE of :func:`quantize` on unit Gaussian weights vs D(R) = 2^(-2K).

    Quantizes a [128, 16*tiles/8] i.i.d. N(0, 1) matrix (``tiles`` 16x16 tiles, a multiple
    of 64) per K and prints a markdown table. Returns the rows.

    The matrix is rescaled to a mean square of exactly 1 before quantizing, so that the
    MSE is measured on the normalisation D(R) assumes (unit variance). Without it the
    ratio carries the sample's variance error, about +-sqrt(2 / weights) relative
    (docs/quantizer.md shows its size at 64 tiles).
    """
    if tiles <= 0 or tiles % 64:
        raise ValueError(f"tiles must be a positive multiple of 64, got {tiles}")
    n_out = tiles // 64 * tc.HADAMARD_BLOCK
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(tc.HADAMARD_BLOCK, n_out, generator=gen, dtype=torch.float64)
    w = w / w.square().mean().sqrt()  # unit variance exactly, as D(R) assumes
    rows = []
    if verbose:
        print(f"codebook {codebook}, {tiles} tiles of unit Gaussian data, seed {seed}")
        print("| K | MSE | D(R) = 2^(-2K) | ratio | seconds |")
        print("|---|---|---|---|---|")
    for bits in bits_list:
        t0 = time.perf_counter()
        q = quantize(w, bits, codebook, generator=torch.Generator().manual_seed(seed),
                     device=device)
        seconds = time.perf_counter() - t0
        dense = tc.dense_weight(q["trellis"], q["suh"], q["svh"], codebook, torch.float64)
        mse = float((dense.cpu() - w).square().mean())
        bound = 2.0 ** (-2 * bits)
        row = {"bits": bits, "mse": mse, "bound": bound, "ratio": mse / bound,
               "seconds": seconds}
        rows.append(row)
        if verbose:
            print(f"| {bits} | {mse:.6f} | {bound:.6f} | {mse / bound:.3f} | {seconds:.1f} |",
                  flush=True)
    return rows


def steady_state_ratio(bits: int, codebook: str, *, length: int = 2048, sequences: int = 8,
                       factors: tuple[float, ...] = (1.0, 1.05, 1.1, 1.15, 1.2),
                       seed: int = 1) -> float:
    """The trellis' own per-weight distortion / D(R): an unconstrained Viterbi over long
    unit-Gaussian sequences, MSE counted on the middle half only (no start or end effect),
    best of `factors` x the RMS-matched scale. A tail-biting tile has no ends, so no
    decodable code of this format can do better than this (up to sampling noise)."""
    lut = tc.codebook_lut(codebook, bits)
    lut = lut / lut.square().mean().sqrt()
    y = torch.randn(sequences, length, generator=torch.Generator().manual_seed(seed))
    y = y / y.square().mean().sqrt()
    best = float("inf")
    for f in factors:
        states = _viterbi_pass(y / f, lut, bits, None)
        err = (lut[states] * f - y).square()[:, length // 4: 3 * length // 4]
        best = min(best, float(err.mean()) / 2.0 ** (-2 * bits))
    return best


def _main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=distortion_report.__doc__)
    parser.add_argument("--codebook", default="mcg", choices=tc.CODEBOOKS)
    parser.add_argument("--bits", type=int, nargs="+", default=None)
    parser.add_argument("--tiles", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--steady-state", action="store_true",
                        help="print the trellis' steady-state ratio (steady_state_ratio) instead")
    args = parser.parse_args(argv)
    lo, hi = tc.BITS_RANGE[args.codebook]
    bits = tuple(args.bits) if args.bits else tuple(range(lo, hi + 1))
    if args.steady_state:
        for k in bits:
            print(f"{args.codebook} K={k}: steady-state MSE / D(R) = "
                  f"{steady_state_ratio(k, args.codebook):.3f}", flush=True)
        return
    distortion_report(bits, args.codebook, tiles=args.tiles, seed=args.seed,
                      device=args.device)


if __name__ == "__main__":
    _main()

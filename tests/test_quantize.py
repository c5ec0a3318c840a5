"""Tests for kquant_cute.quantize: Viterbi optimality, decodability, distortion bound."""

from __future__ import annotations

import itertools

import pytest
import torch

from kquant_cute import quantize as qz
from kquant_cute import trellis as tc


def _decoded(symbols: torch.Tensor, bits: int, codebook: str) -> torch.Tensor:
    """Values (t order) that the packed symbols decode to."""
    return tc.codebook_lut(codebook, bits)[tc.tile_states(tc.pack(symbols, bits))]


def _brute_force(target, lut, bits, wrap):
    """Exhaustive minimum over symbol paths of a tiny trellis (L = log2(len(lut)))."""
    n = len(lut)
    state_bits = n.bit_length() - 1
    low_mask = (1 << (state_bits - bits)) - 1
    starts = range(n) if wrap is None else [(wrap << bits) | e for e in range(1 << bits)]
    best = float("inf")
    for x0 in starts:
        for tail in itertools.product(range(1 << bits), repeat=len(target) - 1):
            x, cost = x0, (lut[x0] - target[0]) ** 2
            for e, y in zip(tail, target[1:]):
                x = ((x << bits) | e) & (n - 1)
                cost += (lut[x] - y) ** 2
            if wrap is not None and (x & low_mask) != wrap:
                continue
            best = min(best, cost)
    return best


@pytest.mark.parametrize("bits", [1, 2])
def test_viterbi_pass_is_optimal_on_tiny_trellis(bits):
    gen = torch.Generator().manual_seed(bits)
    lut = torch.randn(64, generator=gen)  # 6-bit states
    target = torch.randn(2, 6, generator=gen)
    for wrap in (None, torch.tensor([3, 9])):
        states = qz._viterbi_pass(target, lut, bits, wrap)
        # the returned path is a valid shift path ...
        for t in range(1, 6):
            assert torch.equal(states[:, t] >> bits, states[:, t - 1] & ((64 >> bits) - 1))
        cost = (lut[states] - target).square().sum(1)
        for c in range(2):
            w = None if wrap is None else int(wrap[c])
            if w is not None:
                assert int(states[c, 0]) >> bits == w
                assert int(states[c, -1]) & ((64 >> bits) - 1) == w
            # ... and the best one
            want = _brute_force(target[c].tolist(), lut.tolist(), bits, w)
            assert float(cost[c]) == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("bits", [2, 5])
def test_viterbi_recovers_an_exact_codeword(bits):
    codes = tc.random_trellis(16, 32, bits, torch.Generator().manual_seed(bits))
    target = tc.codebook_lut("mcg", bits)[tc.tile_states(codes)].reshape(2, 256)
    symbols = qz.viterbi_tiles(target, bits, "mcg")
    assert symbols.dtype == torch.int64 and symbols.shape == (2, 256)
    assert torch.equal(_decoded(symbols, bits, "mcg"), target)


def test_viterbi_result_is_decodable_and_chunking_invariant():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, 256, generator=gen)
    a = qz.viterbi_tiles(target, 3, "3inst")
    b = qz.viterbi_tiles(target, 3, "3inst", chunk_tiles=1)
    assert torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 8
    # decoding the packed tile through the whole-layer path reproduces the values
    values = _decoded(a, 3, "3inst")
    codes = tc.pack(a, 3).view(3, 1, 48)
    dense = tc.decode(codes, "3inst")
    assert torch.equal(tc.matrix_to_tiles(dense).reshape(3, 256), values)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_viterbi_mse_near_distortion_rate_bound(bits):
    """Unit-variance Gaussian, 8 tiles, best of two scales: MSE / 2^(-2K) under a bound.

    The sample is rescaled to a mean square of exactly 1 (D(R) assumes unit variance;
    unscaled, these 8-tile samples have mean square 0.90 / 1.00 / 0.94 and would read
    0.99 / 1.11 / 1.12). Normalised they measure 1.09 / 1.11 / 1.16. A flat bound would
    be <= 1.15; K=4 with mcg sits at ~1.16-1.17 on 64 tiles too (docs/quantizer.md), a
    property of the codebook and the L=16, K=4 trellis (an i.i.d. Gaussian codebook in
    the same search reaches 1.15, not less), so K=4 is held to 1.20 here.
    """
    gen = torch.Generator().manual_seed(100 + bits)
    x = torch.randn(8, 256, generator=gen)
    x = x / x.square().mean().sqrt()
    lut = tc.codebook_lut("mcg", bits)
    rms = float(lut.square().mean().sqrt())
    best = float("inf")
    for factor in (1.0, 1.1):
        scale = factor / rms  # x is unit RMS; the target matches the codebook's RMS
        symbols = qz.viterbi_tiles(x / scale, bits, "mcg")
        mse = float((_decoded(symbols, bits, "mcg") * scale - x).square().mean())
        best = min(best, mse)
    ratio = best / 2.0 ** (-2 * bits)
    assert ratio <= {2: 1.15, 3: 1.15, 4: 1.20}[bits], ratio


def test_quantize_layer_end_to_end():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(128, 128, generator=gen) * 0.02
    q = qz.quantize(w, 2, "mcg", generator=torch.Generator().manual_seed(1),
                    scale_factors=(1.0,))
    assert set(q) == {"trellis", "suh", "svh"}
    assert q["trellis"].dtype == torch.int16 and q["trellis"].shape == (8, 8, 32)
    assert q["suh"].dtype == torch.float16 and q["suh"].shape == (128,)
    assert q["svh"].dtype == torch.float16 and q["svh"].shape == (128,)
    assert set(q["suh"].abs().tolist()) == {1.0}  # signs only; the scale sits in svh
    dense = tc.dense_weight(q["trellis"], q["suh"], q["svh"], "mcg", torch.float64)
    rel = float((dense - w.double()).square().mean() / w.double().square().mean())
    assert rel < 1.25 * 2.0**-4, rel


def test_quantize_scale_search_picks_best_sampled_scale():
    gen = torch.Generator().manual_seed(6)
    flat = torch.randn(4, 256, generator=gen) * 3.0
    scale = qz._search_scale(flat, 2, "mcg", (0.5, 1.0, 2.0))
    base = 3.0 / float(tc.codebook_lut("mcg", 2).square().mean().sqrt())
    assert 0.7 * base < scale < 1.5 * base
    assert scale == float(torch.tensor(scale).half())  # an exact fp16 value


def test_quantize_zero_weight():
    q = qz.quantize(torch.zeros(128, 128), 2, scale_factors=(1.0,))
    assert not bool(q["svh"].any())
    assert not bool(tc.dense_weight(q["trellis"], q["suh"], q["svh"], "mcg").any())


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        qz.quantize(torch.randn(128, 96), 2)
    with pytest.raises(ValueError, match="2-D"):
        qz.quantize(torch.randn(128), 2)
    with pytest.raises(ValueError, match="floating"):
        qz.quantize(torch.ones(128, 128, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="2..4 bits"):
        qz.quantize(torch.randn(128, 128), 6, "sqg_e4m3")
    with pytest.raises(ValueError, match="unknown codebook"):
        qz.quantize(torch.randn(128, 128), 2, "e8p")
    with pytest.raises(ValueError, match="non-finite"):
        qz.quantize(torch.full((128, 128), float("nan")), 2)
    with pytest.raises(ValueError, match="fp16 output scale"):
        qz.quantize(torch.full((128, 128), 1e9), 2, scale_factors=(1.0,))
    with pytest.raises(ValueError, match="shape \\[T, 256\\]"):
        qz.viterbi_tiles(torch.randn(2, 128), 2, "mcg")
    with pytest.raises(ValueError, match="chunk_tiles"):
        qz.viterbi_tiles(torch.randn(2, 256), 2, "mcg", chunk_tiles=0)


@pytest.mark.gpu
def test_viterbi_cuda_matches_cpu():
    target = torch.randn(4, 256, generator=torch.Generator().manual_seed(9))
    cpu = qz.viterbi_tiles(target, 3, "mcg")
    gpu = qz.viterbi_tiles(target.cuda(), 3, "mcg").cpu()
    cost = lambda s: float((_decoded(s, 3, "mcg") - target).square().sum())  # noqa: E731
    assert cost(gpu) == pytest.approx(cost(cpu), rel=1e-4)


def test_steady_state_ratio_is_above_the_distortion_rate_bound():
    # The long-sequence (end-free) distortion of the L=16 trellis sits just above D(R):
    # ~1.10 at K=2 for mcg (docs/quantizer.md); below 1 would break the rate-distortion
    # theorem, far above would mean the search or the lookup table is wrong.
    ratio = qz.steady_state_ratio(2, "mcg", length=512, sequences=2, factors=(1.0,))
    assert 1.0 < ratio < 1.2

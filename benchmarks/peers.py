"""Side-by-side peers and floors for the fused trellis MoE benchmark (GPU only).

- `Bf16GroupedMoE`: the same layer (same routing, the trellis weights dequantized with all
  rotations into dense bf16 experts) through `torch._grouped_mm`, graph-capturable: routes
  sorted by expert on the GPU, three grouped GEMMs, router-weighted scatter-add.
- `measure_copy_bandwidth()`, `measure_bf16_matmul_rate()`: the ceilings the floors use.
"""

from __future__ import annotations

import torch


def _dense_stack(weights, proj: str, dtype=torch.bfloat16) -> torch.Tensor:
    out = []
    for e in range(weights.num_experts):
        out.append(weights.expert(e)[proj].dense(torch.float32).to(dtype))
    return torch.stack(out)


class Bf16GroupedMoE:
    """Dense bf16 experts (7.4 GB at the BRIEF geometry) through torch._grouped_mm."""

    def __init__(self, weights, *, topk: int, activation: str = "situ"):
        from kquant_cute.reference import activation_fn

        self.E = weights.num_experts
        self.topk = topk
        self.act = activation_fn(activation)
        self.w_gate = _dense_stack(weights, "gate")  # [E, H, I]
        self.w_up = _dense_stack(weights, "up")
        self.w_down = _dense_stack(weights, "down")  # [E, I, H]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_gate, self.w_up, self.w_down))

    def __call__(self, x, topk_ids, topk_weights):
        m, k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[order // k]
        g = torch._grouped_mm(xs, self.w_gate, offs=offs)
        u = torch._grouped_mm(xs, self.w_up, offs=offs)
        h = self.act(g.float(), u.float()).to(torch.bfloat16)
        y = torch._grouped_mm(h, self.w_down, offs=offs)
        y = y.float() * topk_weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, y)
        return out


def _time(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _time(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


def measure_bf16_matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)

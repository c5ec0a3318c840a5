"""Side-by-side peers and floors for the fused trellis MoE benchmark (GPU only).

- `Bf16GroupedMoE`: the same layer (same routing, the trellis weights dequantized with all
  rotations into dense bf16 experts) through `torch._grouped_mm`, graph-capturable: routes
  sorted by expert on the GPU, three grouped GEMMs, router-weighted scatter-add.
- `DecodeCeiling`: the measured decode-only ceiling: the decode-only kernel
  (`decode_probe.py`) over the touched experts of all three projections, launched as the
  layer's GEMMs are (gate and up in one launch, down in another), graph-replayed.
- `measure_copy_bandwidth()`, `measure_bf16_matmul_rate()`: the ceilings the floors use.
- `random_tokens`, `capture`, `graph_median_ms`: the benchmarks' inputs and graph timing.
"""

from __future__ import annotations

import torch


def _dense_stack(weights, proj: str, dtype=torch.bfloat16) -> torch.Tensor:
    out = []
    for e in range(weights.num_experts):
        out.append(weights.expert(e)[proj].dense(torch.float32).to(dtype))
    return torch.stack(out)


class Bf16GroupedMoE:
    """Dense bf16 experts (7.4 GB at the reference geometry) via torch._grouped_mm."""

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


class DecodeCeiling:
    """Decodes the touched experts' trellis codes of gate, up and down once each, with the
    GEMM's decode and cp.async ring, in the GEMMs' launches: gate and up in one (their
    work items interleaved as FC1's GEMM deals them), down in another.
    `fc1_launches=2`: one launch per projection (how the ceiling ran before FC1 became
    one launch; a short launch's last round then comes twice)."""

    def __init__(self, weights, *, ctas_per_sm: int = 8, mma_rows: int = 0,
                 decode: bool = True, pair_table: bool | None = None,
                 workers: int | None = None, fc1_launches: int = 1):
        from decode_probe import compile_decode

        arch = "sm_%d%da" % torch.cuda.get_device_capability()
        w = weights
        if pair_table is None:  # the table the layer's GEMMs read on this GPU
            from kquant_cute.layer import layer_spec

            pair_table = layer_spec(w, topk=1).replace(arch=arch).pair_table()
        self.pair_table = pair_table
        if fc1_launches not in (1, 2):
            raise ValueError(f"fc1_launches {fc1_launches!r} must be 1 or 2")
        fc1, down = (w.hidden, w.intermediate), (w.intermediate, w.hidden)
        # One entry per launch: (shape, operands, trellis of operand 0, of operand 1).
        if fc1_launches == 1:
            self.launches = ((fc1, 2, w.gate_trellis, w.up_trellis),
                             (down, 1, w.down_trellis, w.down_trellis))
        else:
            self.launches = ((fc1, 1, w.gate_trellis, w.gate_trellis),
                             (fc1, 1, w.up_trellis, w.up_trellis),
                             (down, 1, w.down_trellis, w.down_trellis))
        self.fns = {}
        self.resources = {}
        for (k_dim, n_dim), operands, _, _ in self.launches:
            if (k_dim, n_dim, operands) in self.fns:
                continue
            fn, res = compile_decode(k_dim=k_dim, n_dim=n_dim, bits=w.bits, codebook=w.codebook,
                                     arch=arch, min_ctas_per_sm=ctas_per_sm, mma_rows=mma_rows,
                                     decode=decode, pair_table=pair_table, workers=workers,
                                     operands=operands)
            self.fns[(k_dim, n_dim, operands)] = fn
            self.resources[(k_dim, n_dim, operands)] = res
        self.out = torch.empty(w.num_experts * max(2 * w.intermediate, w.hidden) // 128 * 128,
                               dtype=torch.int32, device="cuda")
        self.table = codebook_table(w, pair_table)
        self.sm_count = torch.cuda.get_device_properties(0).multi_processor_count

    def time(self, experts, iters=30) -> float:
        """Median ms of one graph replay that decodes each expert id in `experts` once."""
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        experts = experts.to(torch.int32).contiguous()

        def P(t, dt):
            return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

        def run():
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            for shape, operands, codes, codes1 in self.launches:
                self.fns[(*shape, operands)](
                    P(codes, cutlass.Int16), P(codes1, cutlass.Int16), P(experts, cutlass.Int32),
                    P(self.out, cutlass.Uint32), P(self.table, cutlass.Uint8),
                    cutlass.Int32(experts.numel()), cutlass.Int32(self.sm_count), stream)

        return graph_median_ms([capture(run)], iters)


def codebook_table(weights, pair_table: bool = False) -> torch.Tensor:
    """The state table the kernels read for `weights`' codebook (sqg_e4m3: 64 KiB of E4M3
    bytes, or the 128 KiB K=2 pair table; other codebooks: a 16-byte placeholder, never
    read)."""
    from kquant_cute import trellis

    if pair_table:
        return trellis.sqg_pair_table(weights.bits, "cuda")
    if weights.codebook == "sqg_e4m3":
        return trellis.sqg_state_table(weights.bits, "cuda")
    return torch.zeros(16, dtype=torch.uint8, device="cuda")


def random_tokens(m: int, hidden: int, num_experts: int, topk: int, gen):
    """m random bf16 tokens and their balanced random routing (top-k of uniform scores),
    drawn in that order from the CUDA generator `gen`."""
    x = torch.randn(m, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(m, num_experts, generator=gen, device="cuda")
    return x, scores.topk(topk, dim=1).indices.to(torch.int32).contiguous()


def capture(fn) -> "torch.cuda.CUDAGraph":
    """Run `fn` once eagerly, then capture it into a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_median_ms(graphs, iters: int) -> float:
    """Median ms of `iters` single replays, cycling through `graphs` (one event pair each)."""
    import statistics

    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graphs[i % len(graphs)].replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)

"""Checks shared by the GPU tests (imported by them; no tests here)."""

from __future__ import annotations

import torch


def check_graph_replay(layer, inputs, later_inputs, what: str = ""):
    """A forward captured in a CUDA graph and replayed on new input contents equals, bit for
    bit, an eager forward of the same inputs.

    Binds `inputs` (x, topk_ids, topk_weights) to `layer`, runs once eagerly (loads the
    object, outside capture), captures one forward, then for each (x, ids, w) of
    `later_inputs` copies it into the bound tensors, poisons the output, replays and
    compares with `layer(...)` of the same tensors. Returns the graph, the last eager
    output (a copy) and the bound input tensors, for checks that replay the graph again
    later: the graph reads those tensors' memory, so the caller must keep them alive while
    it replays (freed, the allocator hands their blocks to the next tensors made)."""
    x, ids, w = inputs
    m = x.shape[0]
    bound = layer.bind(x, ids, w)
    bound.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound.run()
    eager = None
    for i, new in enumerate(later_inputs):
        for dst, src in zip((x, ids, w), new):
            dst.copy_(src)
        layer.output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = layer.output[:m].clone()
        layer.output.fill_(float("nan"))
        eager = layer(x, ids, w).clone()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), f"{what} input {i}: replay != eager"
    return graph, eager, (x, ids, w)

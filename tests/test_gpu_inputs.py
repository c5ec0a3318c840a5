"""GPU tests of the defined input semantics and the stream rule (marker `gpu`).

The semantics are those of `kquant_cute.reference` (CPU-tested in test_reference.py): m = 0
launches nothing; NaN / Inf in a row of x reach only that token; duplicate ids in a row
each count; every route on one expert at full capacity; several global ids on one local
expert; -1 = no route with and without a map. Each is checked on mma.sync and, on sm_90,
wgmma, against the fp64 reference with NaN-poisoned outputs. Then the stream rule of one
layer's scratch arena, and two threads running two layers on two streams.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

E, H, I, TOPK = 6, 256, 128, 4


def _mmas():
    out = ["sync"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        out.append("wgmma")
    return out


def _layer(wts, *, mma, capacity=64, pin=None, **kw):
    from kquant_cute.layer import MoELayer

    env = {"KQUANT_W4A16_PREFILL_BLOCK_M": str(pin or 0), "KQUANT_W4A16_PREFILL_MIN_M": "8"}
    return MoELayer(wts, topk=TOPK, capacity=capacity, mma=mma, environ=env, **kw)


def _weights(shared=True, seed=0):
    from kquant_cute.weights import MoEWeights

    return MoEWeights.random(E, H, I, 3, "mcg", shared_hidden_vectors=shared, seed=seed,
                             device="cuda")


def _inputs(m, n_ids, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(m, n_ids, generator=g, device="cuda").topk(TOPK, dim=1).indices.to(torch.int32)
    w = torch.rand(m, TOPK, generator=g, device="cuda")
    return x, ids.contiguous(), (w / w.sum(1, keepdim=True)).float()


def _check(layer, wts, x, ids, w, emap=None, tol=1e-2):
    from kquant_cute.reference import reference_moe

    layer.output.fill_(float("nan"))
    kw = {} if emap is None else {"expert_map": emap}
    out = layer(x, ids, w, **kw).clone()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "unwritten output elements"
    ref = reference_moe(x, ids, w, wts, dtype=torch.float64, expert_map=emap)
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, err
    return out


@pytest.fixture(scope="module", params=_mmas())
def setup(request):
    wts = _weights()
    return request.param, wts, _layer(wts, mma=request.param, pin=32)


def test_zero_tokens_launch_nothing(setup):
    mma, wts, layer = setup
    x, ids, w = _inputs(0, E, 0)
    layer.output.fill_(float("nan"))
    bound = layer.bind(x, ids, w)
    calls = []
    entry = bound.plan.entry
    real, entry._fn = entry._fn, lambda *a: calls.append(a)
    try:
        out = bound.run()
    finally:
        entry._fn = real
    torch.cuda.synchronize()
    assert out.shape == (0, H) and calls == []
    assert torch.isnan(layer.output).all()  # nothing written


def test_nan_and_inf_reach_only_their_tokens(setup):
    mma, wts, layer = setup
    x, ids, w = _inputs(40, E, 1)
    clean = _check(layer, wts, x, ids, w)
    bad = x.clone()
    bad[3, 7] = float("nan")
    bad[17, 0] = float("inf")
    bad[39, 255] = float("-inf")
    layer.output.fill_(float("nan"))
    got = layer(bad, ids, w).clone()
    torch.cuda.synchronize()
    hit = torch.zeros(40, dtype=torch.bool, device="cuda")
    hit[[3, 17, 39]] = True
    assert torch.equal(got[~hit], clean[~hit])  # bit for bit: rows do not mix
    assert not torch.isfinite(got[hit]).any()


def test_duplicate_ids_and_all_routes_on_one_expert_at_capacity(setup):
    mma, wts, layer = setup
    x, ids, w = _inputs(64, E, 2)
    dup = ids.clone()
    dup[:, 1] = dup[:, 0]
    dup[5] = 2
    _check(layer, wts, x, dup.contiguous(), w)
    one = torch.full_like(ids, 4)  # 256 routes, one expert, full capacity, both plans
    for m in (8, 64):
        _check(layer, wts, x[:m].contiguous(), one[:m].contiguous(), w[:m].contiguous())


@pytest.mark.parametrize("mma", _mmas())
def test_expert_map_many_to_one_and_minus_one_ids(mma):
    wts = _weights(shared=False, seed=3)
    n_global = 16
    emap = torch.tensor([0, 0, 1, -1, 2, 2, 2, 3, -1, 4, 5, 5, 0, -1, 3, 1], dtype=torch.int32,
                        device="cuda")
    layer = _layer(wts, mma=mma, pin=16, num_global_experts=n_global)
    x, ids, w = _inputs(48, n_global, 4)
    _check(layer, wts, x, ids, w, emap)
    ids[::3, 2] = -1  # no route (the map is never read at -1)
    ids[7] = -1
    out = _check(layer, wts, x, ids, w, emap)
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    plain = _layer(wts, mma=mma, pin=16)
    ids_local = torch.where(ids >= 0, emap[ids.clamp(min=0).long()], -1).to(torch.int32)
    _check(plain, wts, x, ids_local.contiguous(), w)
    with pytest.raises(ValueError, match="or be -1"):
        plain(x, (ids_local - 1).contiguous(), w)


def test_forward_on_another_stream_while_busy_raises(setup):
    mma, wts, layer = setup
    x, ids, w = _inputs(64, E, 5)
    want = layer(x, ids, w).clone()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # bind checks ids with a host sync of its own stream
        late, ordered = layer.bind(x, ids, w), layer.bind(x, ids, w)
    bound = layer.bind(x, ids, w)
    torch.cuda._sleep(200_000_000)  # keep the default stream busy (~0.1 s)
    bound.run()  # its completion event now lies behind the sleep
    with torch.cuda.stream(other):
        with pytest.raises(RuntimeError, match="scratch arena is still in use"):
            late.run()
        torch.cuda._sleep(50_000_000)
        got = ordered.run(wait_for_previous=True).clone()  # ordered on the GPU
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # Finished work on the other stream is no obstacle.
    assert torch.equal(layer(x, ids, w), want)


def test_per_stream_arenas_run_concurrently_bitwise_equal(setup):
    mma, wts, _ = setup
    layer = _layer(wts, mma=mma, pin=32, stream_arenas=True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    inputs = [_inputs(64, E, 10 + i) for i in range(2)]
    serial = [layer(*inp).clone() for inp in inputs]
    outs = []
    for s, inp in zip(streams, inputs):
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            outs.append(layer(*inp))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, serial))
    with torch.cuda.stream(streams[0]):
        bound = layer.bind(*inputs[0])
    with pytest.raises(RuntimeError, match="bind again"):
        bound.run()


def test_two_threads_two_layers_two_streams_give_serial_bits():
    from kquant_cute.weights import MoEWeights

    mma = _mmas()[-1]
    wa, wb = _weights(seed=20), MoEWeights.random(8, 384, 256, 4, "mul1", seed=21, device="cuda")
    la = _layer(wa, mma=mma, pin=16)
    from kquant_cute.layer import MoELayer

    lb = MoELayer(wb, topk=2, capacity=96, mma=mma, environ={"KQUANT_W4A16_PREFILL_BLOCK_M": "0"})
    xa, ia, ga = _inputs(64, E, 22)
    gb = torch.Generator(device="cuda").manual_seed(23)
    xb = torch.randn(96, 384, generator=gb, device="cuda").to(torch.bfloat16)
    ib = torch.randint(0, 8, (96, 2), generator=gb, device="cuda", dtype=torch.int32)
    wgt = torch.rand(96, 2, generator=gb, device="cuda")
    serial = (la(xa, ia, ga).clone(), lb(xb, ib, wgt).clone())
    torch.cuda.synchronize()
    results, errors = {}, []

    def work(name, layer, args):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(20):
                    out = layer.bind(*args).run().clone()
                    s.synchronize()
                    results.setdefault(name, []).append(out)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=("a", la, (xa, ia, ga))),
               threading.Thread(target=work, args=("b", lb, (xb, ib, wgt)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(o, serial[0]) for o in results["a"]) and len(results["a"]) == 20
    assert all(torch.equal(o, serial[1]) for o in results["b"]) and len(results["b"]) == 20

"""The KQUANT_* environment is one configuration error at startup (CLI and library), CPU only."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

from kquant_cute import compile_cache as cc
from kquant_cute.cli import main
from kquant_cute.environment import ConfigurationError, check_environment

VARS = ("KQUANT_COMPILE_CACHE_DIR", "KQUANT_COMPILE_FREEZE", "KQUANT_W4A16_PREFILL_BLOCK_M",
        "KQUANT_W4A16_PREFILL_MIN_M")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    cc.reset_default_cache()
    yield
    cc.reset_default_cache()


def test_every_invalid_variable_is_named_in_one_error() -> None:
    env = {"KQUANT_COMPILE_FREEZE": "maybe", "KQUANT_W4A16_PREFILL_BLOCK_M": "12",
           "KQUANT_COMPILE_CACHE_DIR": ""}
    with pytest.raises(ConfigurationError) as ei:
        check_environment(env)
    msg = str(ei.value)
    assert all(var in msg for var in env) and len(ei.value.problems) == 3
    check_environment({"KQUANT_COMPILE_FREEZE": "1", "KQUANT_W4A16_PREFILL_BLOCK_M": "0"})
    # A brought cache never reads the cache variables; plan knobs may come from elsewhere.
    check_environment({"KQUANT_COMPILE_FREEZE": "maybe"}, cache=False)
    with pytest.raises(ConfigurationError, match="KQUANT_W4A16_PREFILL_MIN_M"):
        check_environment({}, plan_environ={"KQUANT_W4A16_PREFILL_MIN_M": "4"})


def test_unknown_kquant_variable_warns_with_the_closest_name() -> None:
    with pytest.warns(RuntimeWarning, match="KQUANT_COMPILE_FREZE .*did you mean KQUANT_COMPILE_FREEZE"):
        check_environment({"KQUANT_COMPILE_FREZE": "1"})


def test_library_startup_raises_a_configuration_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """MoELayer checks the environment before anything else (here: before it even notices
    the weights are not on a GPU), and plan_forward no longer turns a bad freeze value into
    "the decode specialization is not implementable: compile failed"."""
    from kquant_cute.compiler import plan_forward
    from kquant_cute.layer import MoELayer
    from kquant_cute.planners import PlanEnv
    from kquant_cute.prewarm import DEFAULT_GEOMETRY
    from kquant_cute.weights import MoEWeights

    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KQUANT_COMPILE_FREEZE", "maybe")
    wts = MoEWeights.random(4, 128, 128, 2, "mcg")
    with pytest.raises(ConfigurationError, match="KQUANT_COMPILE_FREEZE must be '0', '1' or empty"):
        MoELayer(wts, topk=2, capacity=8)
    base = DEFAULT_GEOMETRY.replace(num_experts=4, hidden=128, intermediate=128, topk=2, bits=2)
    with pytest.raises(ValueError) as ei:
        plan_forward(base, capacity=8, arch="sm_120", env=PlanEnv())
    assert "KQUANT_COMPILE_FREEZE" in str(ei.value)
    assert "compile failed" not in str(ei.value) and "not implementable" not in str(ei.value)
    assert list(tmp_path.iterdir()) == []  # nothing compiled


def test_layer_rejects_topk_above_the_experts() -> None:
    from kquant_cute.layer import MoELayer
    from kquant_cute.weights import MoEWeights

    wts = MoEWeights.random(4, 128, 128, 2, "mcg")
    with pytest.raises(ValueError, match=r"topk must be an int in 1\.\.4"):
        MoELayer(wts, topk=5, capacity=8)


def test_cli_rejects_invalid_freeze_at_startup(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KQUANT_COMPILE_FREEZE", "maybe")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        rc = main(["--sm", "120", "--experts", "8", "--hidden", "256", "--intermediate", "256",
                   "--topk", "2", "--capacity", "64", "--cache-dir", str(tmp_path)])
    assert rc == 2 and "KQUANT_COMPILE_FREEZE" in err.getvalue() and out.getvalue() == ""
    assert list(tmp_path.iterdir()) == []

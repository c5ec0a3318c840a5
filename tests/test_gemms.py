"""Tests for the GEMM registry (kernels/gemms.py), the Codebook record (kernels/format.py)
and what asks them: one spelling per MMA kind, one set of static questions per GEMM class,
no kind or codebook name tested outside their owners, and plan policy that never reaches a
compile-cache key. CPU only; nothing compiles."""

from __future__ import annotations

import ast
import inspect
import os

import pytest
from fake_build import FakeBuild

from kquant_cute import compiler
from kquant_cute import trellis as tc
from kquant_cute.compile_cache import CompileCache
from kquant_cute.kernels import format as fmt
from kquant_cute.kernels.arch import ARCH_TABLE, arch_limits, known_archs
from kquant_cute.kernels.bring import GemmClass
from kquant_cute.kernels.gemms import GEMMS, MMA_KINDS, auto_mma
from kquant_cute.kernels.moe import MoESpec
from kquant_cute.planners import PlanEnv, default_banded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = MoESpec(num_experts=8, hidden=256, intermediate=256, topk=2, bits=4, codebook="mcg",
                block_m=8, act_dtype="bfloat16", out_dtype="float32", activation="situ",
                shared_hidden_vectors=True, arch="sm_90a")


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------


def test_each_kind_has_one_spelling_shared_with_the_arch_table():
    assert MMA_KINDS == ("auto", *GEMMS)
    offered = {kind for lim in ARCH_TABLE.values() for kind in lim.mma_kinds}
    for kind, cls in GEMMS.items():
        assert cls.kind == kind and issubclass(cls, GemmClass)
        assert kind in offered, f"no arch offers {kind!r}: the arch table spells it otherwise"
    # The first kind runs everywhere ("auto"'s fallback); every arch resolves "auto" to a
    # registered kind it offers, the last one in registry order.
    first = next(iter(GEMMS))
    assert all(first in lim.mma_kinds for lim in ARCH_TABLE.values())
    for name in known_archs():
        lim = arch_limits(name)
        want = [k for k in GEMMS if k in lim.mma_kinds][-1]
        assert auto_mma(lim.dsl_target) == want == SMALL.replace(mma="auto",
                                                                 arch=lim.dsl_target).mma
    assert auto_mma("sm_75") == first  # unknown: the spec's check names the arch
    assert "not in the arch table" in SMALL.replace(arch="sm_75").check()
    # Any spelling the arch table accepts becomes the DSL target the spec compiles for, so
    # the kind "auto" picks from the table is one ptxas accepts for that target ("sm_90"
    # resolved to wgmma and compiled for --gpu-arch sm_90 was rejected by ptxas).
    for name in known_archs():
        lim = arch_limits(name)
        for spelling in (name, lim.dsl_target, (lim.sm // 10, lim.sm % 10)):
            spec = SMALL.replace(mma="auto", arch=spelling)
            assert spec.arch == lim.dsl_target and spec.mma in lim.mma_kinds, (spelling, spec)
            assert spec == SMALL.replace(mma="auto", arch=lim.dsl_target)


def test_every_gemm_answers_the_same_static_questions_with_one_signature():
    calls = {name: inspect.signature(cls.__call__) for name, cls in GEMMS.items()}
    assert len({str(s) for s in calls.values()}) == 1, calls
    inits = {name: set(inspect.signature(cls.__init__).parameters) for name, cls in GEMMS.items()}
    assert len({frozenset(p) for p in inits.values()}) == 1, inits
    for spec in (SMALL, SMALL.replace(arch="sm_120a"),
                 SMALL.replace(codebook="sqg_e4m3", bits_set=(3, 4), block_m=32)):
        cls = GEMMS[spec.mma]
        (sub,) = {s for s in spec.sub_kernels() if s.role == "gemm1"}
        assert sub.cls is cls and sub.check(arch_limits(spec.arch).smem_per_block_optin) is None
        built = sub.build()
        assert built.threads == cls.threads_for(**sub.args)
        assert built.smem_bytes == cls.smem_bytes_for(**sub.args)
        per_sm = arch_limits(spec.arch).smem_per_block_optin + 1024
        assert 1 <= cls.resident_ctas(per_sm, **sub.args) <= per_sm // built.smem_bytes
        geo = {k: v for k, v in sub.args.items() if k not in ("block_m", "span")}
        assert (cls.default_span(spec.block_m, spec.smem_limit(), **geo)
                == MoESpec(**{**spec.key_fields(), "span": 0}).span)
        assert isinstance(cls.instruction, str) and cls.instruction
    # A kind's own rules come from its class, with the same keyword arguments.
    sync, wg = GEMMS["sync"], GEMMS["wgmma"]
    args = dict(block_m=32, k_dim=256, n_dim=256, bits=4, codebook="mcg", stages=4)
    assert "one route block per work item" in sync.can_implement(**args, span=2)
    assert wg.can_implement(**args, span=2) is None
    assert "span 3 not in" in wg.can_implement(**args, span=3)


def test_nothing_outside_the_registry_tests_an_mma_kind():
    """moe.py and compiler.py ask the registry; no string test of a kind is left."""
    for path in ("kernels/moe.py", "kquant_cute/compiler.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        literals = [n.value for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [s for s in literals if s.strip("_") in GEMMS or s in ("mma.sync",)], path


# ---------------------------------------------------------------------------------------
# The Codebook record
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", fmt.CODEBOOKS)
def test_codebook_record_matches_the_codec(name):
    book = fmt.codebook(name)
    assert book is fmt.CODEBOOK[name] is tc.codebook_record(name)
    assert fmt.BITS_RANGE[name] == book.bits_range
    lo, hi = book.bits_range
    assert book.supports(lo) and book.supports(hi) and not book.supports(hi + 1)
    assert not book.supports(True) and not book.supports(float(lo))
    values = [tc.codebook_lut(name, k).double() for k in range(lo, hi + 1)]
    for v in values:  # the RMS is the same at every K, to the record's 6 decimals
        assert abs(float(v.square().mean().sqrt()) - book.rms) < 5e-7
    assert book.table == any(not v.equal(values[0]) for v in values)  # only tables vary with K
    if book.table:
        assert book.table_bytes_per_k == tc.state_table(name, lo).numel() == 1 << fmt.STATE_BITS
        assert book.table_bytes(3) == 3 * book.table_bytes_per_k and not book.replicates
    else:
        assert book.table_bytes_per_k == 0 and book.decode == "alu"
        with pytest.raises(ValueError, match="without a state table"):
            tc.state_table(name, lo)
    assert book.needs_cvt_e4m3 == (book.table and "e4m3" in name)


def test_unknown_codebooks_raise_everywhere():
    with pytest.raises(ValueError, match="unknown codebook 'q9'"):
        fmt.codebook("q9")
    with pytest.raises(ValueError, match="unknown codebook"):
        default_banded("q9")
    import torch

    with pytest.raises(ValueError, match="unknown codebook"):
        tc.state_to_value(torch.arange(4), "q9", 4)
    assert "no mma decode path" in SMALL.replace(codebook="q9").check()


def test_arch_rules_follow_the_record():
    sqg = SMALL.replace(codebook="sqg_e4m3", bits=2)
    assert "needs cvt.rn.f16x2.e4m3x2" in sqg.replace(arch="sm_80").check()
    assert sqg.replace(arch="sm_89").check() is None
    assert default_banded("mcg") and default_banded("sqg_e4m3")


def test_no_codebook_name_is_tested_outside_its_owners():
    """A comparison with a codebook name (== / in) lives only in format.py, the decode
    (kernels/decode.py, the torch codec kquant_cute/trellis.py) and the QSRT readers
    (qsrt*), where the name is a file's; EXL3 markers go through format.exl3_codebook."""
    allowed = {"kernels/format.py", "kernels/decode.py", "kquant_cute/trellis.py"}
    bad = []
    for sub in ("kernels", "planners", "kquant_cute"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, sub)):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if not f.endswith(".py") or rel in allowed or "qsrt" in rel:
                    continue
                tree = ast.parse(open(os.path.join(ROOT, rel)).read())
                for node in ast.walk(tree):
                    if not isinstance(node, ast.Compare):
                        continue
                    for side in [node.left, *node.comparators]:
                        for c in ast.walk(side):
                            if isinstance(c, ast.Constant) and c.value in fmt.CODEBOOKS:
                                bad.append(f"{rel}:{node.lineno} {c.value!r}")
    assert not bad, bad


# ---------------------------------------------------------------------------------------
# Plan policy stays out of the compile-cache key
# ---------------------------------------------------------------------------------------


def test_changing_a_planner_constant_keeps_every_kernel_key(monkeypatch, tmp_path):
    import kquant_cute.planners.plans as plans
    import kquant_cute.planners.policy as policy

    FakeBuild().install(monkeypatch)
    specs = [SMALL.replace(block_m=m, **cb) for m in (8, 32, 64)
             for cb in ({}, {"codebook": "sqg_e4m3", "bits": 2})]

    def keys():
        cache = CompileCache(tmp_path / "c")
        rebuilt = [MoESpec(**{**s.key_fields(), "mma": "auto", "span": 0}) for s in specs]
        return [compiler.get_specialization(s, cache).key for s in rebuilt]

    before = keys()
    monkeypatch.setattr(policy, "FILL_TARGET", 0.5)
    monkeypatch.setattr(plans, "DEFAULT_PREFILL_MIN_M", 64)
    monkeypatch.setattr(plans, "PAIR_PLAN_DECODES", ("alu", "table"))
    assert not default_banded("mcg")  # the policy did change ...
    assert keys() == before  # ... and no specialization's key did
    assert not any(os.path.dirname(f).endswith("planners") for f in compiler.source_files())


def test_exl3_markers_select_codebooks_by_the_record():
    """Marker tensors pick the codebook as EXL3 files do: mcg before mul1, none -> 3inst."""
    pick = fmt.exl3_codebook
    assert pick(lambda name: False) == "3inst"
    assert pick(lambda name: name == "mul1") == "mul1"
    assert pick(lambda name: name in ("mcg", "mul1")) == "mcg"
    assert pick(lambda name: name == "sqg_e4m3") == "3inst"  # QSRT names are no EXL3 markers

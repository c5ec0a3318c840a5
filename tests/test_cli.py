"""Tests of kquant-compile (kquant_cute.cli) and kquant_cute.prewarm, CPU only.

Real cross-compiles of a small geometry (8 experts, H = I = 256, top-2, capacity 512: the
plans are decode M=8 and prefill M=64) for sm_90 and sm_120, once per module into a
temporary cache directory; every other test reuses or copies that warm directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kquant_cute.cli import _Progress, main
from kquant_cute.compile_cache import KEYED_ENV_VARS, CompileCache
from kquant_cute.planners import ENV_PREFILL_BLOCK_M, ENV_PREFILL_MIN_M, PlanEnv
from kquant_cute.prewarm import (
    DEFAULT_GEOMETRY,
    PrewarmEvent,
    needed_failures,
    prewarm,
    prewarm_plans,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# --pair: the decode/prefill pair plan (decode + prefill M, two specializations per arch) keeps the
# compiles of these tests few; the default (banded) plan has its own test below.
SMALL = ["--experts", "8", "--hidden", "256", "--intermediate", "256", "--topk", "2",
         "--capacity", "512", "--pair"]
SMALL_SPEC = DEFAULT_GEOMETRY.replace(num_experts=8, hidden=256, intermediate=256, topk=2)
CLEAN_ENV = ("KQUANT_COMPILE_CACHE_DIR", "KQUANT_COMPILE_FREEZE", ENV_PREFILL_BLOCK_M,
             ENV_PREFILL_MIN_M, *KEYED_ENV_VARS)
RECORD_KEYS = {"arch", "block_m", "role", "status", "reason", "registers", "shared_bytes",
               "spill_bytes", "seconds", "kernel", "mma", "span"}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in CLEAN_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Cold run of ``--sm 90 --sm 120`` on the small geometry into a fresh cache dir."""
    cache_dir = tmp_path_factory.mktemp("kq_cache")
    with pytest.MonkeyPatch.context() as mp:
        for var in CLEAN_ENV:
            mp.delenv(var, raising=False)
        rc, out, err = run_main(["--sm", "90", "--sm", "120", *SMALL, "--cache-dir", str(cache_dir),
                                 "--describe"])
    yield {"dir": cache_dir, "rc": rc, "out": out, "err": err}


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_cold_run_compiles_decode_and_prefill(warm: dict[str, Any]) -> None:
    assert warm["rc"] == 0, warm["err"]
    rows = [line.split() for line in warm["out"].splitlines() if line.startswith("sm_")]
    table = {(r[0], int(r[1])): (r[2], r[3]) for r in rows}
    assert table == {
        ("sm_90a", 8): ("decode", "compiled"), ("sm_90a", 64): ("prefill", "compiled"),
        ("sm_120a", 8): ("decode", "compiled"), ("sm_120a", 64): ("prefill", "compiled"),
    }
    assert "totals: 4 compiled, 0 cached, 0 rejected, 0 failed (builds this run: 4)" in warm["out"]
    assert "[sm_90a] W4A16 MoE plans" in warm["out"] and "prefill M=64" in warm["out"]
    assert "GEMM: M=8 async wgmma, M=64 async wgmma" in warm["out"]
    assert "GEMM: M=8 mma.sync, M=64 mma.sync" in warm["out"]
    # describe() lists every accepted geometry, the decode's too (with its measurements).
    assert warm["out"].count("accepted geometry: M=8: ok (") == 2
    assert warm["err"].count("compiled (") == 4  # non-TTY progress: one line per spec
    assert "\r" not in warm["err"]
    assert len(list(warm["dir"].glob("*.json"))) == 4


def test_warm_subprocess_json_all_cached(warm: dict[str, Any]) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in warm["dir"].glob("*.bin")}
    proc = subprocess.run(
        [sys.executable, "-m", "kquant_cute.cli", "--sm", "90", "--sm", "120", *SMALL,
         "--cache-dir", str(warm["dir"]), "--json"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)  # stdout is pure JSON
    assert len(records) == 4
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["status"] == "cached" and r["cache"] == "disk" and r["reason"] is None
        assert r["registers"] > 0 and r["spill_bytes"] == 0
    assert {(r["arch"], r["block_m"], r["role"]) for r in records} == {
        ("sm_90a", 8, "decode"), ("sm_90a", 64, "prefill"),
        ("sm_120a", 8, "decode"), ("sm_120a", 64, "prefill")}
    # The GEMM per arch: async wgmma on sm_90a, mma.sync elsewhere (one route block each).
    assert {(r["arch"], r["mma"], r["span"]) for r in records} == {
        ("sm_90a", "wgmma", 1), ("sm_120a", "sync", 1)}
    assert all(r["kernel"].endswith(("_wgmma_sm_90a", "_s4_sm_120a")) for r in records)
    assert "0 compiled, 4 cached" in proc.stderr and "(builds this run: 0)" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in warm["dir"].glob("*.bin")} == before


def test_console_script(warm: dict[str, Any]) -> None:
    # The script installed with this interpreter (its environment need not be on PATH).
    exe = os.path.join(os.path.dirname(sys.executable), "kquant-compile")
    if not os.access(exe, os.X_OK):
        exe = shutil.which("kquant-compile")
    if exe is None:
        pytest.skip("kquant-compile console script not on PATH (pip install -e .)")
    proc = subprocess.run([exe, "--sm", "120", *SMALL, "--cache-dir", str(warm["dir"]), "-q"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "0 compiled, 2 cached" in proc.stdout and proc.stderr == ""


def test_prewarm_api_and_progress(warm: dict[str, Any]) -> None:
    cache = CompileCache(warm["dir"], frozen=True)  # frozen: proves nothing is compiled
    events: list[PrewarmEvent] = []
    records = prewarm(SMALL_SPEC, archs=("sm_90", 120, "sm_120a"), capacity=512,
                      env=PlanEnv(), cache=cache, progress=events.append, banded=False)
    assert [(r.arch, r.block_m, r.role, r.status) for r in records] == [
        ("sm_90a", 8, "decode", "cached"), ("sm_90a", 64, "prefill", "cached"),
        ("sm_120a", 8, "decode", "cached"), ("sm_120a", 64, "prefill", "cached")]
    assert needed_failures(records) == []
    assert [(e.kind, e.block_m) for e in events[:2]] == [("start", 64), ("done", 64)]
    assert all(e.bound == 10 for e in events) and events[-1].index == 4
    assert cache.cache_info().compiles == 0
    # A second prewarm on the same cache object is served from memory.
    again = prewarm(SMALL_SPEC, archs=["120"], capacity=512, env=PlanEnv(), cache=cache,
                    banded=False)
    assert {r.cache for r in again} == {"memory"}
    # The report is the planner's plan with the cache's answers: no second walk, no wrapper.
    (arch,) = prewarm_plans(SMALL_SPEC, archs=["120"], capacity=512, env=PlanEnv(), cache=cache,
                            banded=False)
    assert [(b.lo, b.hi, b.block_m) for b in arch.plan.route.bands] == [(1, 256, 8), (257, 512, 64)]
    assert [c.block_m for c in arch.plan.route.candidates] == [64, 8]
    assert [(r.block_m, r.seconds, r.key) for r in arch.records] == [
        (m, round(arch.plan.outcomes[m].seconds, 3), arch.plan.outcomes[m].result.key) for m in (8, 64)]


def test_list_and_clear(warm: dict[str, Any], tmp_path: Path) -> None:
    rc, out, _ = run_main(["--list", "--cache-dir", str(warm["dir"])])
    assert rc == 0
    assert f"{warm['dir']}: 4 entries" in out
    assert out.count("w4a16_trellis_moe") == 4 and "M=64" in out and "sm_120a" in out
    rc, out, _ = run_main(["--list", "--json", "--cache-dir", str(warm["dir"])])
    assert rc == 0 and len(json.loads(out)) == 4

    scratch = copy_cache(warm["dir"], tmp_path / "c")
    rc, out, _ = run_main(["--clear", "--cache-dir", str(scratch)])
    assert rc == 0 and "removed 4 entries" in out
    rc, out, _ = run_main(["--list", "--json", "--cache-dir", str(scratch)])
    assert rc == 0 and json.loads(out) == []
    assert run_main(["--list", "--sm", "90"])[0] == 2


@pytest.mark.parametrize(
    ("var", "value"),
    [(ENV_PREFILL_BLOCK_M, "12"), (ENV_PREFILL_BLOCK_M, "wide"), (ENV_PREFILL_MIN_M, "4")],
)
def test_bad_plan_env_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(tmp_path)])
    assert rc == 2 and out == ""
    assert var in err and "error" in err
    assert list(tmp_path.glob("*.json")) == []


def test_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rc, _, err = run_main(["--sm", "75", "--cache-dir", str(tmp_path)])
    assert rc == 2 and "unknown GPU architecture" in err
    rc, _, err = run_main(["--sm", "120", "--hidden", "200", "--cache-dir", str(tmp_path)])
    assert rc == 2 and "invalid geometry" in err and "multiple of 128" in err
    rc, _, err = run_main(["--capacity", "0"])
    assert rc == 2
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", "")
    rc, _, err = run_main(["--list"])
    assert rc == 2 and "KQUANT_COMPILE_CACHE_DIR" in err


def test_pinned_and_disabled_prefill(warm: dict[str, Any], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = copy_cache(warm["dir"], tmp_path / "c")
    monkeypatch.setenv(ENV_PREFILL_BLOCK_M, "16")
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json",
                             "--describe"])
    assert rc == 0, err
    got = [(r["block_m"], r["role"], r["status"]) for r in json.loads(out)]
    assert got == [(8, "decode", "cached"), (16, "prefill", "compiled")]
    assert f"prefill M pinned to 16 by {ENV_PREFILL_BLOCK_M}" in err  # describe -> stderr with --json

    monkeypatch.setenv(ENV_PREFILL_BLOCK_M, "0")
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json"])
    assert rc == 0, err
    assert [(r["block_m"], r["role"]) for r in json.loads(out)] == [(8, "decode")]


def test_default_prewarms_what_a_default_layer_binds(warm: dict[str, Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --pair: the default (banded) plan's sizes between the decode and the prefill
    M are compiled too (role "band"), and --describe shows the token band each one serves."""
    scratch = copy_cache(warm["dir"], tmp_path / "c")
    monkeypatch.setenv(ENV_PREFILL_MIN_M, "16")
    rc, out, err = run_main(["--sm", "120", *[f for f in SMALL if f != "--pair"],
                             "--cache-dir", str(scratch), "--json", "--describe", "-q"])
    assert rc == 0, err
    got = [(r["block_m"], r["role"], r["status"]) for r in json.loads(out)]
    assert got == [(8, "decode", "cached"), (64, "prefill", "cached"), (16, "band", "compiled"),
                   (32, "band", "compiled"), (48, "band", "compiled")]
    assert "m in [29, 57]: band M=16" in err and "m in [173, 512]: prefill M=64" in err
    assert "GEMM: M=8 mma.sync, M=16 mma.sync, M=32 mma.sync, M=48 mma.sync, M=64 mma.sync" in err


def test_rejected_fallback_is_reported_not_fatal(tmp_path: Path) -> None:
    """A real rejection: an 8-stage pipeline at M=64 needs 106,496 B of shared memory, over
    sm_120's 101,376 B per block (100,352 B beside the DSL's static 1,024 B), so the prefill falls back to M=48 (and exit status stays 0)."""
    rc, out, err = run_main(["--sm", "120", *SMALL, "--stages", "8", "--capacity", "4096",
                             "--cache-dir", str(tmp_path / "c"), "--json"])
    assert rc == 0, err
    recs = json.loads(out)
    assert [(r["block_m"], r["role"], r["status"]) for r in recs] == [
        (8, "decode", "compiled"), (64, "fallback-rejected", "rejected"), (48, "prefill", "compiled")]
    assert "shared memory 106,496 B > 100,352 B" in recs[1]["reason"]  # rejected before compiling
    assert "2 compiled, 0 cached, 1 rejected, 0 failed" in err


def test_failed_builds_are_reported_once_each(warm: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that raises is a failed candidate: one line of the error, built once, and the
    walk goes on; a failed decode build makes the plan unbindable (exit 1, the reason)."""
    from kquant_cute import compiler

    scratch = copy_cache(warm["dir"], tmp_path / "c")
    real, builds, broken = compiler.kbuild.compile_forward, [], {64}

    def compile_forward(spec):
        builds.append(spec.block_m)
        if spec.block_m in broken:
            raise RuntimeError(f"boom at M={spec.block_m}\nsecond line")
        return real(spec)

    monkeypatch.setattr(compiler.kbuild, "compile_forward", compile_forward)
    (scratch / f"{_entry_of(scratch, 'sm_120a', 64)}.json").unlink()
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json", "-q"])
    assert rc == 0, err
    got = [(r["block_m"], r["role"], r["status"], r["reason"]) for r in json.loads(out)]
    assert got == [(8, "decode", "cached", None),
                   (64, "fallback-rejected", "failed", "compile failed: RuntimeError: boom at M=64"),
                   (48, "prefill", "compiled", None)]
    assert builds == [64, 48]

    broken.add(8)
    builds.clear()
    (scratch / f"{_entry_of(scratch, 'sm_120a', 8)}.json").unlink()
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json",
                             "--describe", "-q"])
    assert rc == 1
    assert [(r["block_m"], r["status"]) for r in json.loads(out)] == [
        (8, "failed"), (64, "failed"), (48, "cached")]
    assert builds == [64, 8]
    assert ("error: sm_120a: the decode specialization M=8 failed: compile failed: "
            "RuntimeError: boom at M=8") in err
    assert "error: the decode specialization is not implementable: compile failed" in err


def test_frozen_checks_without_compiling(warm: dict[str, Any], tmp_path: Path) -> None:
    rc, out, _ = run_main(["--sm", "90", "--sm", "120", *SMALL, "--cache-dir", str(warm["dir"]),
                           "--frozen"])
    assert rc == 0 and "0 compiled, 4 cached" in out
    rc, out, err = run_main(["--sm", "90", "--sm", "120", *SMALL, "--cache-dir", str(tmp_path),
                             "--frozen"])
    assert rc == 1
    # Every planned specialization of both archs is listed, not only the first miss; the
    # prefill walk stops at the missing widest candidate (a frozen cache never silently
    # falls back to a narrower block).
    for arch in ("sm_90a", "sm_120a"):
        assert f"error: {arch}: the decode specialization M=8 failed: not in the cache" in err
        assert f"error: {arch}: the prefill specialization M=64 failed: not in the cache" in err
    assert "4 specializations are missing or unusable" in err
    assert list(tmp_path.glob("*.bin")) == []


def test_frozen_misses_name_the_wide_items_span(tmp_path: Path) -> None:
    """A frozen check of the production profile at 4,096 tokens on an empty cache lists the
    wide rule's work items as M=48 x 2, in the table and in the JSON records (span and GEMM
    as a compiled record gives them), without compiling anything."""
    argv = ["--sm", "90", "--profile", "k2_coupled_h512_h128", "--capacity", "4096",
            "--cache-dir", str(tmp_path), "--frozen", "-q"]
    rc, out, err = run_main(argv)
    assert rc == 1 and re.search(r"^sm_90a +48 x 2 +wide +failed ", out, re.M), out
    assert "error: sm_90a: the wide specialization M=48 x 2 failed: not in the cache" in err
    rc, out, _ = run_main(argv + ["--json"])
    wide = [r for r in json.loads(out) if r["role"] == "wide"]
    assert [(r["block_m"], r["span"], r["mma"], r["status"]) for r in wide] == [
        (48, 2, "wgmma", "failed")]
    assert list(tmp_path.glob("*.bin")) == []


def test_frozen_calls_a_corrupt_entry_corrupt(warm: dict[str, Any], tmp_path: Path) -> None:
    scratch = copy_cache(warm["dir"], tmp_path / "c")
    rc, out, _ = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json", "-q"])
    assert rc == 0
    decode = next(r for r in json.loads(out) if r["block_m"] == 8)
    payload = scratch / f"{decode['key']}.bin"
    payload.write_bytes(payload.read_bytes()[:100])  # truncated
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--frozen"])
    assert rc == 1
    assert (f"the decode specialization M=8 failed: corrupt cache entry {decode['key'][:16]}"
            in err), err
    assert "prefill" not in err  # the prefill entry is intact
    assert payload.stat().st_size == 100  # --frozen changes nothing on disk


def test_progress_tty_uses_carriage_returns() -> None:
    buf = io.StringIO()
    p = _Progress(buf, tty=True)
    p(PrewarmEvent("start", "sm_120a", 64, 1, 2, 0.0))
    p(PrewarmEvent("done", "sm_120a", 64, 1, 2, 1.5, "compiled", 1.5))
    p.finish()
    text = buf.getvalue()
    assert text.startswith("\r[") and text.count("\r") == 2 and text.endswith("\n")
    assert "M=64: compiled (1.50 s)" in text


# ------------------------------------------------------------- reliability
def _entry_of(cache_dir: Path, arch: str, block_m: int) -> str:
    for meta_path in cache_dir.glob("*.json"):
        meta = json.loads(meta_path.read_text())
        if meta["arch"] == arch and meta["spec"]["block_m"] == block_m:
            return meta["key"]
    raise AssertionError(f"no entry for {arch} M={block_m}")


def _plant_unloadable(cache_dir: Path, key: str) -> None:
    """Replace an entry's object by bytes that are not an object file, with metadata whose
    size and sha256 match them: a checksum cannot catch it, only loading can."""
    import hashlib

    junk = b"not an ELF object " * 64
    (cache_dir / f"{key}.bin").write_bytes(junk)
    meta_path = cache_dir / f"{key}.json"
    meta = json.loads(meta_path.read_text())
    meta["payload"].update(size=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    meta_path.write_text(json.dumps(meta))


def test_unloadable_entry_is_rebuilt_not_reported_cached(warm: dict[str, Any], tmp_path: Path) -> None:
    from kquant_cute.compiler import get_specialization

    scratch = copy_cache(warm["dir"], tmp_path / "c")
    key = _entry_of(scratch, "sm_120a", 8)
    _plant_unloadable(scratch, key)
    assert CompileCache(scratch).lookup_key(key) == "disk"  # the checksum alone vouches for it
    rc, out, err = run_main(["--sm", "120", *SMALL, "--cache-dir", str(scratch), "--json"])
    assert rc == 0, err
    status = {r["block_m"]: (r["status"], r["cache"]) for r in json.loads(out)}
    assert status == {8: ("compiled", "compiled"), 64: ("cached", "disk")}
    assert f"entry {key[:16]}" in err and "is unusable" in err and "not recognized" in err
    # The library heals the same way instead of raising at the first call.
    _plant_unloadable(scratch, key)
    spec = SMALL_SPEC.replace(block_m=8, arch="sm_120a")
    with pytest.warns(UserWarning, match="is unusable"):
        res = get_specialization(spec, CompileCache(scratch))
    assert res.status == "compiled" and res.value.function() is not None
    assert get_specialization(spec, CompileCache(scratch)).status == "disk"


def _plant_bad_cubin(cache_dir: Path, key: str) -> None:
    """Break the device image inside an entry's object (the embedded cubin's ELF magic),
    leaving its host code intact and the metadata's size and sha256 matching: the host
    link succeeds, only loading the cubin onto a GPU can tell."""
    import hashlib

    path = cache_dir / f"{key}.bin"
    blob = bytearray(path.read_bytes())
    cubin = blob.find(b"\x7fELF", 1)  # offset 0 is the host object's own header
    assert cubin > 0, "no embedded device image found in the object"
    blob[cubin:cubin + 4] = b"JUNK"
    path.write_bytes(bytes(blob))
    meta_path = cache_dir / f"{key}.json"
    meta = json.loads(meta_path.read_text())
    meta["payload"].update(size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    meta_path.write_text(json.dumps(meta))


@pytest.mark.gpu
def test_entry_whose_cubin_the_gpu_rejects_is_rebuilt(tmp_path: Path) -> None:
    """The device half of the loadability check: on a GPU of the entry's arch the cache's
    load step also loads the cubin, so a broken device image heals (warning, rebuild)
    instead of being served "disk" and failing at the first launch."""
    import torch

    from kquant_cute.compiler import get_specialization

    major, minor = torch.cuda.get_device_capability()
    spec = SMALL_SPEC.replace(block_m=8, arch=f"sm_{major}{minor}")
    cache_dir = tmp_path / "c"
    assert get_specialization(spec, CompileCache(cache_dir)).status == "compiled"
    key = next(p.stem for p in cache_dir.glob("*.json"))
    _plant_bad_cubin(cache_dir, key)
    assert CompileCache(cache_dir).lookup_key(key) == "disk"  # the checksum vouches for it
    with pytest.warns(UserWarning, match="is unusable"):
        res = get_specialization(spec, CompileCache(cache_dir))
    assert res.status == "compiled" and res.value.function() is not None
    assert get_specialization(spec, CompileCache(cache_dir)).status == "disk"


def test_stale_cubin_dirs_of_killed_compiles_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from kquant_cute import compiler
    from kquant_cute.compile_cache import store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() -> tmp_path
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    old = __import__("time").time() - 2 * store.DEAD_WRITER_GRACE_SECONDS
    for name in (f"kq_cubin_{proc.pid}_abc123", f"kq_cubin_{os.getpid()}_live99", "kq_cubin_x1y2z3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kernel.cubin").write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    too_old = old - store.STALE_TEMP_SECONDS
    os.utime(tmp_path / "kq_cubin_x1y2z3", (too_old, too_old))  # pid-less, from before
    monkeypatch.setattr(compiler.kbuild, "compile_forward", lambda spec: (b"obj", {}))
    assert compiler._build(SMALL_SPEC.replace(block_m=8)) == (b"obj", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kq_cubin_{os.getpid()}_live99"]


def test_frozen_miss_raises_like_the_docs_say(warm: dict[str, Any], tmp_path: Path) -> None:
    """A frozen miss on the prefill M raises CompileCacheMiss: no walk to a narrower M
    (the docs used to promise the walk)."""
    from kquant_cute.compile_cache import CompileCacheMiss
    from kquant_cute.compiler import plan_forward

    scratch = copy_cache(warm["dir"], tmp_path / "c")
    key = _entry_of(scratch, "sm_120a", 64)
    (scratch / f"{key}.json").unlink()
    with pytest.raises(CompileCacheMiss, match=r'"block_m":64'):
        plan_forward(SMALL_SPEC, capacity=512, arch="sm_120", env=PlanEnv(),
                     cache=CompileCache(scratch, frozen=True))
    docs = (REPO / "docs" / "compile_cache.md").read_text()
    assert "walks to the next narrower M" not in docs
    assert "a frozen miss raises `CompileCacheMiss`" in docs


def test_cli_clear_on_readonly_cache_fails(warm: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kquant_cute.compile_cache import cache as cc_cache

    scratch = copy_cache(warm["dir"], tmp_path / "c")
    before = sorted(p.name for p in scratch.iterdir())
    monkeypatch.setattr(cc_cache, "probe_directory",
                        lambda path, **kw: ("ro", f"{path} is not writable (simulated)"))
    rc, out, err = run_main(["--clear", "--cache-dir", str(scratch)])
    assert rc == 1 and "removed" not in out
    assert f"cannot clear the compile cache: {scratch} is not writable" in err
    assert err.count("not writable") == 1, err  # the reason once
    # The same read-only cache serving a warm shape: nothing to compile, nothing to warn.
    rc, out, err = run_main(["--sm", "90", "--sm", "120", *SMALL, "--cache-dir", str(scratch)])
    assert rc == 0 and "warning" not in err and "0 compiled, 4 cached" in out, err
    assert sorted(p.name for p in scratch.iterdir()) == before


def test_list_and_frozen_on_missing_dir_do_not_create_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    rc, out, _ = run_main(["--list", "--cache-dir", str(missing)])
    assert rc == 0 and "0 entries (the directory does not exist)" in out
    rc, _, err = run_main(["--sm", "120", *SMALL, "--frozen", "--cache-dir", str(missing)])
    assert rc == 1 and "the decode specialization M=8 failed: not in the cache" in err
    assert not missing.exists()


@pytest.mark.parametrize(("argv", "want"), [
    (["--capacity", "5000000"], "--capacity 5,000,000 is above 4,186,126 tokens"),
    (["--topk", "9"], "--topk 9 is above --experts 8"),
    (["--hidden", "200"], "--hidden 200 is not a positive multiple of 128"),
    (["--intermediate", "100"], "--intermediate 100 is not a positive multiple of 128"),
    (["--bits", "7"], "--bits 7 outside 2..6 for --codebook mcg"),
    (["--act-dtype", "int8"], "--act-dtype int8: not one of bf16, fp16"),
    (["--act-dtype", "fp32"], "--act-dtype fp32: not one of bf16, fp16"),
    (["--out-dtype", "FP8"], "--out-dtype FP8: not one of fp32, bf16, fp16"),
    (["--codebook", "foo"], "--codebook foo has no mma decode path (supported: mcg, 3inst"),
    (["--activation", "relu"], "--activation relu not in silu, situ"),
    (["--topk", "65", "--experts", "80"], "--topk 65 > 64"),
    (["--experts", "1" + "0" * 26], "--experts must be at most "),
    (["--hidden", "1" + "0" * 20], "--hidden must be at most "),
    (["--sm", "9.0"], "--sm 9.0: unknown GPU architecture; use one of 80, 86, 89, 90, 100, 120"),
])
def test_cli_validates_like_the_library_naming_flags(tmp_path: Path, argv: list[str], want: str) -> None:
    rc, out, err = run_main(["--sm", "120", *SMALL, *argv, "--cache-dir", str(tmp_path)])
    assert rc == 2 and out == "", err
    assert want in err
    assert "k_dim" not in err and "n_dim" not in err and "num_experts" not in err
    assert "('" not in err and "'" not in err  # no Python tuples or reprs
    # A plain bound: no absurd figure (the sizes above once gave 27-digit byte counts).
    assert not re.search(r"\d{1,3}(,\d{3}){4,}|\d{13,}", err), err
    assert list(tmp_path.glob("*.json")) == []


def test_progress_and_totals_explain_themselves(warm: dict[str, Any]) -> None:
    import time

    assert "specialization 1 of at most 10: sm_90a M=64: compiled" in warm["err"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kquant_cute.cli", "--sm", "120", *SMALL,
         "--cache-dir", str(warm["dir"])],
        capture_output=True, text=True, env=subprocess_env(), timeout=120)
    outer = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("totals:"))
    wall = float(line.split(" s wall since kquant-compile started")[0].rsplit(" ", 1)[1])
    # The CLI's real wall time (imports included: > 1 s here), not just the cache calls.
    assert 0.5 * outer <= wall <= outer + 0.05, (wall, outer, line)
    # ... counted from the CLI's own start: a shell's sleep before exec is not in it.
    t0 = time.monotonic()
    proc = subprocess.run(
        ["sh", "-c", 'sleep 2; exec "$0" -m kquant_cute.cli "$@"', sys.executable, "--sm", "120",
         *SMALL, "--cache-dir", str(warm["dir"])],
        capture_output=True, text=True, env=subprocess_env(), timeout=120)
    outer = time.monotonic() - t0
    line = next(x for x in proc.stdout.splitlines() if x.startswith("totals:"))
    wall = float(line.split(" s wall since kquant-compile started")[0].rsplit(" ", 1)[1])
    assert wall <= outer - 1.9, (wall, outer, line)


def test_profile_compiles_the_qsrt_production_layer(tmp_path: Path) -> None:
    """--profile k2_coupled_h512_h128 = sqg_e4m3 K=2 with the coupled transforms; the
    mixed-rate k3x22_k4x2 = sqg_e4m3 records at K 3 and 4 (both state tables: sm_90 yes,
    sm_120's 99 KB no, with the reason); contradicting flags are usage errors naming the
    flag."""
    geo = ["--experts", "8", "--hidden", "512", "--intermediate", "256", "--topk", "2"]
    rc, out, err = run_main(["--sm", "90", *geo, "--profile", "k2_coupled_h512_h128",
                             "--cache-dir", str(tmp_path), "--json", "-q",
                             "--capacity", "64"])
    assert rc == 0, err
    records = json.loads(out)
    assert [r["status"] for r in records] == ["compiled"]  # capacity 64: the decode plan only
    assert "_k2_sqg_e4m3_" in records[0]["kernel"] and "_cpl_" in records[0]["kernel"]
    rc, out, err = run_main(["--sm", "90", *geo, "--profile", "k3x22_k4x2",
                             "--cache-dir", str(tmp_path), "--json", "-q", "--capacity", "64"])
    assert rc == 0, err
    (record,) = json.loads(out)
    assert record["status"] == "compiled" and "_k4_sqg_e4m3_" in record["kernel"]
    assert "_r34_" in record["kernel"] and "_cpl_" not in record["kernel"]
    # sm_120 cannot hold the two state tables: its mixed layers decode through T12.
    rc, out, err = run_main(["--sm", "120", *geo, "--profile", "k3x22_k4x2", "--json", "-q",
                             "--cache-dir", str(tmp_path), "--capacity", "64"])
    assert rc == 0, err
    (record,) = json.loads(out)
    assert record["status"] == "compiled" and "_r34_t12_" in record["kernel"]
    rc, _, err = run_main(["--sm", "90", *geo, "--profile", "k3x22_k4x2", "--bits", "3",
                           "--cache-dir", str(tmp_path)])
    assert rc == 2 and "--bits 3 contradicts --profile k3x22_k4x2 (--bits 4)" in err
    rc, _, err = run_main(["--sm", "90", *geo, "--profile", "k2_coupled_h512_h128", "--bits", "3",
                           "--cache-dir", str(tmp_path)])
    assert rc == 2 and "--bits 3 contradicts --profile k2_coupled_h512_h128" in err
    rc, _, err = run_main(["--sm", "90", "--profile", "nope", "--cache-dir", str(tmp_path)])
    assert rc == 2 and "unknown QSRT profile" in err
    # A flag given with a profile counts even when it equals the flag's default value.
    for flag, value, want in (("--bits", "4", "--bits 2"), ("--codebook", "mcg", "--codebook sqg_e4m3")):
        rc, out, err = run_main(["--sm", "90", *geo, "--profile", "k2_coupled_h512_h128", flag,
                                 value, "--cache-dir", str(tmp_path)])
        assert rc == 2 and out == "" and (f"{flag} {value} contradicts --profile "
                                          f"k2_coupled_h512_h128 ({want})") in err, err


def test_help_answers_without_torch_or_cutlass() -> None:
    code = ("import sys, contextlib, io; from kquant_cute.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out: rc = main(['--help'])\n"
            "heavy = sorted(m for m in ('torch', 'cutlass', 'numpy') if m in sys.modules)\n"
            "assert rc == 0 and not heavy, (rc, heavy)\n"
            "assert '--experts' in out.getvalue() and '(default 896)' in out.getvalue()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr

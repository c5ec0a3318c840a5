"""Tests of kquant_cute.compile_cache: keys, disk entries, locking, degrade, freeze, CuTe round trip.

CPU only. Multi-process parts run tests/compile_cache_worker.py in subprocesses.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import kquant_cute.compile_cache as cc
from kquant_cute.compile_cache import (
    KEYED_ENV_VARS,
    CompileCache,
    CompileCacheMiss,
    CompileCacheWarning,
    make_key,
)
from kquant_cute.compile_cache import cache as cc_cache
from kquant_cute.compile_cache import keys as cc_keys
from kquant_cute.compile_cache import store as cc_store
from kquant_cute.compile_cache.__main__ import main as cli_main

WORKER = Path(__file__).with_name("compile_cache_worker.py")
REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch):
    for var in ("KQUANT_COMPILE_CACHE_DIR", "KQUANT_COMPILE_FREEZE", *KEYED_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    cc.reset_default_cache()
    yield
    cc.reset_default_cache()


def _run_worker(mode: str, args: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def _result(proc: subprocess.Popen, timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


class Counter:
    """A build/load pair that counts calls."""

    def __init__(self, payload: bytes = b"\x7fELF-fake-object", extra: dict | None = None) -> None:
        self.payload = payload
        # The keys kernels/build.py's compile_forward writes (resource_summary).
        self.extra = {"registers": 40, "shared_bytes": 1024, "spill_bytes": 0} if extra is None else extra
        self.builds = 0
        self.loads: list[str] = []

    def build(self) -> tuple[bytes, dict]:
        self.builds += 1
        return self.payload, self.extra

    def load(self, path: str, meta: dict) -> tuple[bytes, dict]:
        self.loads.append(path)
        with open(path, "rb") as f:
            data = f.read()
        assert meta["payload"]["size"] == len(data)
        return data, meta


def _get(cache: CompileCache, c: Counter, spec: dict | None = None, name: str = "gemm", **kw: Any):
    return cache.get_or_build_result(
        name, {"bm": 128, "bn": 64} if spec is None else spec, arch=ARCH, build=c.build, load=c.load, **kw
    )


# --------------------------------------------------------------------------- keys
def _key_args(tmp_path: Path) -> dict[str, Any]:
    src = tmp_path / "kernel_src.py"
    src.write_text("def kernel():\n    return 1\n")
    return {
        "name": "gemm",
        "spec": {"bm": 128, "bn": 64, "dtype": "bf16", "stages": [2, 3], "flags": {"swizzle": True}},
        "arch": ARCH,
        "sources": [str(src)],
        "options": "--opt-level 3",
    }


def test_key_stable_across_processes(tmp_path: Path) -> None:
    args = _key_args(tmp_path)
    here, comps = make_key(
        args["name"], args["spec"], arch=args["arch"], sources=args["sources"], options=args["options"]
    )
    there = _result(_run_worker("key", args))
    assert there["key"] == here
    assert there["components"] == json.loads(json.dumps(comps))
    assert len(here) == 64 and int(here, 16) >= 0
    # Insensitive to things that must not matter.
    reordered = dict(reversed(list(args["spec"].items())))
    reordered["stages"] = (2, 3)
    assert make_key("gemm", reordered, arch=ARCH, sources=args["sources"], options=args["options"])[0] == here
    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    copy = other_dir / "kernel_src.py"
    copy.write_bytes(Path(args["sources"][0]).read_bytes())
    assert make_key("gemm", args["spec"], arch=ARCH, sources=[str(copy)], options=args["options"])[0] == here


def test_key_sensitive_to_each_component(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _key_args(tmp_path)
    versions = cc_keys.toolchain_versions()
    base_kw = dict(
        arch=a["arch"], sources=a["sources"], options=a["options"], versions=versions, env={}, host="linux-x86_64"
    )

    def key(name: str = a["name"], spec: dict | None = None, **over: Any) -> str:
        kw = {**base_kw, **over}
        return make_key(name, a["spec"] if spec is None else spec, **kw)[0]

    base = key()
    src2 = tmp_path / "other_src.py"
    src2.write_text("x = 2\n")
    variants: dict[str, str] = {
        "name": key(name="gemm2"),
        "spec value": key(spec={**a["spec"], "bm": 64}),
        "spec extra field": key(spec={**a["spec"], "split_k": 1}),
        "spec bool vs int": key(spec={**a["spec"], "flags": {"swizzle": 1}}),
        "arch": key(arch="sm_100a"),
        "host": key(host="linux-aarch64"),
        "extra source": key(sources=[*a["sources"], str(src2)]),
        "no sources": key(sources=[]),
        "options": key(options="--opt-level 2"),
    }
    for field in versions:
        variants[f"version {field}"] = key(versions={**versions, field: versions[field] + ".post1"})
    for var in KEYED_ENV_VARS:
        variants[f"env {var}"] = key(env={var: "1"})
    # Source content change (same path, same size -> also a different mtime/ino check path).
    Path(a["sources"][0]).write_text("def kernel():\n    return 2\n")
    variants["source bytes"] = key()
    Path(a["sources"][0]).write_text("def kernel():\n    return 1\n")
    assert key() == base  # content back -> key back
    monkeypatch.setattr(cc_keys, "CACHE_FORMAT_VERSION", cc_keys.CACHE_FORMAT_VERSION + 1)
    variants["format version"] = key()
    monkeypatch.undo()

    same = [what for what, k in variants.items() if k == base]
    assert not same, f"key ignores: {same}"
    assert len(set(variants.values())) == len(variants), "two different changes collided"
    # Env that must not be keyed.
    assert key(env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_LIBS": "/tmp/x", "HOME": "/x"}) == base


def test_key_reads_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    k0 = make_key("k", {}, arch=ARCH)[0]
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # folded into arch: not keyed
    assert make_key("k", {}, arch=ARCH)[0] == k0
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert make_key("k", {}, arch=ARCH)[0] != k0


def test_key_rejects_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="spec.obj"):
        make_key("k", {"obj": object()}, arch=ARCH)
    with pytest.raises(TypeError, match="non-finite"):
        make_key("k", {"x": float("nan")}, arch=ARCH)
    with pytest.raises(ValueError, match="arch"):
        make_key("k", {}, arch="90a")
    with pytest.raises(ValueError, match="name"):
        make_key("", {}, arch=ARCH)
    with pytest.raises(FileNotFoundError):
        make_key("k", {}, arch=ARCH, sources=[str(tmp_path / "missing.py")])
    with pytest.raises(TypeError, match="sequence"):
        make_key("k", {}, arch=ARCH, sources=str(tmp_path))  # type: ignore[arg-type]


# ------------------------------------------------------------------ basic behaviour
def test_build_then_memory_then_disk(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "cc", frozen=False)
    c = Counter()
    assert cache.lookup("gemm", {"bm": 128, "bn": 64}, arch=ARCH) == "miss"
    r1 = _get(cache, c)
    assert r1.status == "compiled" and c.builds == 1
    assert r1.value[0] == c.payload
    meta = r1.meta
    assert meta["extra"] == {"registers": 40, "shared_bytes": 1024, "spill_bytes": 0}
    assert meta["name"] == "gemm" and meta["arch"] == ARCH and meta["spec"] == {"bm": 128, "bn": 64}
    assert meta["compile_seconds"] >= 0 and meta["created"] <= time.time()
    assert meta["components"]["versions"] == cc_keys.toolchain_versions()
    assert meta["key"] == r1.key and meta["format"] == cc_keys.CACHE_FORMAT_VERSION
    assert cache.lookup("gemm", {"bm": 128, "bn": 64}, arch=ARCH) == "memory"

    r2 = _get(cache, c)
    assert r2.status == "memory" and r2.value is r1.value and c.builds == 1

    fresh = CompileCache(tmp_path / "cc", frozen=False)
    assert fresh.lookup("gemm", {"bm": 128, "bn": 64}, arch=ARCH) == "disk"
    c2 = Counter()
    r3 = _get(fresh, c2)
    assert r3.status == "disk" and c2.builds == 0 and r3.value[0] == c.payload
    assert r3.meta["extra"] == meta["extra"] and r3.meta["created"] == meta["created"]
    assert fresh.get_or_build("gemm", {"bm": 128, "bn": 64}, arch=ARCH, build=c2.build, load=c2.load) is r3.value

    info = fresh.cache_info()
    assert (info.disk_loads, info.memory_hits, info.hits, info.misses, info.compiles) == (1, 1, 2, 0, 0)
    assert info.disk_entries == 1 and info.memory_entries == 1 and info.disk_bytes > len(c.payload)
    assert info.disk_mode == "rw" and not info.degraded and not info.frozen
    assert json.loads(json.dumps(info.as_dict()))["directory"] == str(tmp_path / "cc")
    # Entry files are exactly payload, metadata, lock; no temp files left behind.
    names = sorted(os.listdir(tmp_path / "cc"))
    assert names == sorted([f"{r1.key}.bin", f"{r1.key}.json", f"{r1.key}.lock"])


def test_build_result_validated(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, frozen=False)
    with pytest.raises(TypeError, match="bytes"):
        cache.get_or_build("k", {}, arch=ARCH, build=lambda: ("text", {}), load=lambda p, m: p)  # type: ignore
    with pytest.raises(TypeError, match="JSON"):
        cache.get_or_build("k", {}, arch=ARCH, build=lambda: (b"x", {"o": object()}), load=lambda p, m: p)
    assert cache.cache_info().disk_entries == 0


def test_threads_in_one_process_build_once(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, frozen=False)
    built = []

    def build() -> tuple[bytes, dict]:
        built.append(1)
        time.sleep(0.05)
        return b"obj", {}

    out: list[Any] = []

    def worker() -> None:
        out.append(cache.get_or_build("t", {"i": 1}, arch=ARCH, build=build, load=lambda p, m: object()))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(out) == 8 and all(o is out[0] for o in out)


def test_eight_processes_compile_once(tmp_path: Path) -> None:
    n = 8
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    counter = tmp_path / "builds.txt"
    args = {
        "dir": str(tmp_path / "cc"), "barrier": str(barrier), "n": n, "counter": str(counter), "sleep": 0.4, "tag": "r1"
    }
    procs = [_run_worker("race", args) for _ in range(n)]
    results = [_result(p) for p in procs]
    builders = counter.read_text().split()
    assert len(builders) == 1, f"built {len(builders)} times: {builders}"
    assert {r["value"] for r in results} == {"payload-r1"}
    assert len({r["key"] for r in results}) == 1
    statuses = sorted(r["status"] for r in results)
    assert statuses == ["compiled"] + ["disk"] * (n - 1)


# ------------------------------------------------------------------ bad entries
def _entry(tmp_path: Path) -> tuple[CompileCache, Counter, str]:
    cache = CompileCache(tmp_path, frozen=False)
    c = Counter(payload=bytes(range(256)) * 8)
    key = _get(cache, c).key
    return CompileCache(tmp_path, frozen=False), Counter(payload=c.payload), key


def _rebuild_with_one_warning(cache: CompileCache, c: Counter, match: str):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = _get(cache, c)
    msgs = [str(w.message) for w in rec if issubclass(w.category, CompileCacheWarning)]
    assert len(msgs) == 1 and match in msgs[0], msgs
    assert r.status == "compiled" and c.builds == 1 and r.value[0] == c.payload
    assert cache.cache_info().dropped_entries == 1
    assert CompileCache(cache.directory, frozen=False).lookup_key(r.key) == "disk"  # rewritten, valid
    return r


def test_truncated_payload_is_rebuilt(tmp_path: Path) -> None:
    cache, c, key = _entry(tmp_path)
    p = tmp_path / f"{key}.bin"
    p.write_bytes(p.read_bytes()[:100])
    assert cache.lookup_key(key) == "miss"
    _rebuild_with_one_warning(cache, c, "truncated")


def test_checksum_mismatch_is_rebuilt(tmp_path: Path) -> None:
    cache, c, key = _entry(tmp_path)
    p = tmp_path / f"{key}.bin"
    data = bytearray(p.read_bytes())
    data[10] ^= 0xFF
    p.write_bytes(bytes(data))
    _rebuild_with_one_warning(cache, c, "checksum mismatch")


def test_missing_payload_and_bad_metadata_are_rebuilt(tmp_path: Path) -> None:
    cache, c, key = _entry(tmp_path)
    (tmp_path / f"{key}.bin").unlink()
    _rebuild_with_one_warning(cache, c, "payload file is missing")
    cache2, c2, key2 = _entry(tmp_path / "b")
    (tmp_path / "b" / f"{key2}.json").write_text('{"format": 1, "key": "')
    _rebuild_with_one_warning(cache2, c2, "not valid JSON")


def test_orphan_payload_without_metadata_is_a_plain_miss(tmp_path: Path) -> None:
    cache, c, key = _entry(tmp_path)
    (tmp_path / f"{key}.json").unlink()  # as if the writer died between payload and metadata
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = _get(cache, c)
    assert r.status == "compiled" and c.builds == 1


def test_loader_failure_deletes_and_rebuilds(tmp_path: Path) -> None:
    cache, c, key = _entry(tmp_path)
    calls = []

    def flaky_load(path: str, meta: dict) -> str:
        calls.append(path)
        if len(calls) == 1:
            raise RuntimeError("bad object")
        return "loaded"

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = cache.get_or_build_result("gemm", {"bm": 128, "bn": 64}, arch=ARCH, build=c.build, load=flaky_load)
    assert r.status == "compiled" and r.value == "loaded" and c.builds == 1 and len(calls) == 2
    assert sum("load() raised RuntimeError: bad object" in str(w.message) for w in rec) == 1

    # A loader that also rejects the fresh build: the error propagates and no entry is kept.
    def bad_load(path: str, meta: dict) -> str:
        raise RuntimeError("cannot load")

    fresh = CompileCache(tmp_path / "x", frozen=False)
    with pytest.raises(RuntimeError, match="cannot load"):
        fresh.get_or_build("k", {}, arch=ARCH, build=c.build, load=bad_load)
    assert fresh.cache_info().disk_entries == 0 and fresh.cache_info().memory_entries == 0


# ------------------------------------------------------------------ degraded dirs
def _count_cc_warnings(fn) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in rec if issubclass(w.category, CompileCacheWarning)]


def test_uncreatable_dir_degrades_to_memory_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "sub"  # creating it fails with NotADirectoryError, even for root

    def scenario():
        cache = CompileCache(target, frozen=False)
        c = Counter()
        r1 = _get(cache, c)
        r2 = _get(cache, c)
        r3 = _get(cache, c, spec={"bm": 64})
        return cache, c, (r1, r2, r3)

    (cache, c, (r1, r2, r3)), msgs = _count_cc_warnings(scenario)
    assert len(msgs) == 1 and "memory only" in msgs[0] and str(target) in msgs[0], msgs
    assert (r1.status, r2.status, r3.status) == ("compiled", "memory", "compiled")
    assert r1.value[0] == c.payload and c.builds == 2
    info = cache.cache_info()
    assert info.degraded and info.disk_mode == "off" and info.disk_entries == 0 and info.memory_entries == 2
    assert cache.entries() == [] and cache.clear() == 0 and cache.cache_info().memory_entries == 0
    assert not target.exists()


def test_dir_that_is_a_file_degrades(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    (cache, _), msgs = _count_cc_warnings(lambda: (CompileCache(f), None))
    assert len(msgs) == 1 and "not a directory" in msgs[0]
    assert cache.disk_mode == "off"


def test_env_dir_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", "")
    with pytest.raises(ValueError, match="KQUANT_COMPILE_CACHE_DIR is set but empty"):
        CompileCache()
    with pytest.raises(ValueError):
        cc.default_cache()
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", "  ")
    with pytest.raises(ValueError):
        cc.resolve_cache_dir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", "rel/cache")
    assert cc.resolve_cache_dir() == str(tmp_path / "rel" / "cache")
    monkeypatch.delenv("KQUANT_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.resolve_cache_dir() == str(tmp_path / "xdg" / "kquant_cute")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.resolve_cache_dir() == str(tmp_path / "home" / ".cache" / "kquant_cute")


def test_readonly_dir_reads_entries_and_keeps_new_ones_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, _, key = _entry(tmp_path)
    # Root ignores chmod, so simulate a read-only directory at the probe; writes are then
    # never attempted (the store is only read), which the assertions on the listing check.
    monkeypatch.setattr(cc_cache, "probe_directory",
                        lambda path, **kw: ("ro", f"{path} is not writable (simulated)"))
    before = sorted(os.listdir(tmp_path))

    def scenario():
        ro = CompileCache(tmp_path, frozen=False)
        c = Counter(payload=bytes(range(256)) * 8)
        hit = _get(ro, c)
        new1 = _get(ro, c, spec={"bm": 1})
        new2 = _get(ro, c, spec={"bm": 2})
        return ro, c, hit, new1, new2

    (ro, c, hit, new1, new2), msgs = _count_cc_warnings(scenario)
    assert len(msgs) == 1 and "existing entries are still read" in msgs[0], msgs
    assert (hit.status, new1.status, new2.status) == ("disk", "compiled", "compiled") and c.builds == 2
    assert ro.disk_mode == "ro" and ro.degraded
    assert sorted(os.listdir(tmp_path)) == before
    # A clear that cannot remove the entries fails, naming the directory (it used to
    # answer 0 and leave them in place).
    with pytest.raises(PermissionError, match=f"cannot clear the compile cache: {tmp_path} is not writable"):
        ro.clear()
    assert sorted(os.listdir(tmp_path)) == before


def test_readonly_dir_that_serves_every_lookup_does_not_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only serving cache is normal: no warning until a compile cannot be kept."""
    _, _, _ = _entry(tmp_path)
    monkeypatch.setattr(cc_cache, "probe_directory",
                        lambda path, **kw: ("ro", f"{path} is not writable (simulated)"))
    c = Counter(payload=bytes(range(256)) * 8)
    (ro, hit), msgs = _count_cc_warnings(lambda: (r := CompileCache(tmp_path), _get(r, c)))
    assert msgs == [] and hit.status == "disk" and ro.disk_mode == "ro" and c.builds == 0
    (new, msgs) = _count_cc_warnings(lambda: _get(ro, c, spec={"bm": 1}))
    assert new.status == "compiled" and len(msgs) == 1 and "not writable" in msgs[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; covered by the simulated test")
def test_readonly_dir_for_real(tmp_path: Path) -> None:  # pragma: no cover - runs as non-root only
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        (cache, status), msgs = _count_cc_warnings(
            lambda: (c := CompileCache(d), _get(c, Counter()).status))
        assert len(msgs) == 1 and cache.disk_mode == "ro" and status == "compiled"
    finally:
        d.chmod(0o700)


def test_real_probe_detects_unwritable_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cc_store.tempfile, "mkstemp", refuse)
    mode, reason = cc_store.probe_directory(str(tmp_path))
    assert mode == "ro" and "not writable" in (reason or "")


def test_write_failure_degrades_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = CompileCache(tmp_path, frozen=False)

    def full(self: Any, key: str, payload: bytes, meta: dict) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cc_store.DiskStore, "write", full)
    c = Counter()
    (_, msgs) = _count_cc_warnings(lambda: [_get(cache, c, spec={"i": i}).status for i in range(3)])
    assert len(msgs) == 1 and "No space left" in msgs[0]
    assert cache.disk_mode == "ro" and c.builds == 3 and cache.cache_info().memory_entries == 3


# ------------------------------------------------------------------ freeze / capture
def test_freeze_env_and_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KQUANT_COMPILE_FREEZE", "1")
    cache = CompileCache(tmp_path)
    assert cache.is_frozen
    c = Counter()
    with pytest.raises(CompileCacheMiss) as ei:
        _get(cache, c, spec={"bm": 128, "dtype": "bf16"}, name="moe_gemm")
    msg = str(ei.value)
    assert "'moe_gemm'" in msg and '"bm":128' in msg and '"dtype":"bf16"' in msg and ARCH in msg and "frozen" in msg
    assert isinstance(ei.value, RuntimeError) and ei.value.reason == "frozen" and ei.value.spec["bm"] == 128
    assert c.builds == 0 and cache.cache_info().misses == 1
    again = pickle.loads(pickle.dumps(ei.value))
    assert str(again) == msg and again.name == "moe_gemm" and again.reason == "frozen"

    with cache.frozen(False):
        assert _get(cache, c).status == "compiled"
    assert cache.is_frozen
    assert _get(cache, c).status == "memory"  # hits are fine when frozen
    assert _get(CompileCache(tmp_path), c).status == "disk"
    assert cache.freeze(False) is True and not cache.is_frozen

    for bad in ("yes", "true", " 1", "2"):
        monkeypatch.setenv("KQUANT_COMPILE_FREEZE", bad)
        with pytest.raises(ValueError, match="KQUANT_COMPILE_FREEZE"):
            CompileCache(tmp_path)
    monkeypatch.setenv("KQUANT_COMPILE_FREEZE", "0")
    assert not CompileCache(tmp_path).is_frozen
    with CompileCache(tmp_path).frozen() as fz:
        assert fz.is_frozen


def test_frozen_memory_only_cache_names_spec(tmp_path: Path) -> None:
    cache = CompileCache(disk=False, frozen=True)
    with pytest.raises(CompileCacheMiss, match=r"'k'.*\"x\":1.*memory-only"):
        cache.get_or_build("k", {"x": 1}, arch=ARCH, build=Counter().build, load=lambda p, m: p)
    assert not cache.degraded and cache.disk_mode == "off"


def test_miss_during_cuda_graph_capture_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    capturing = {"on": True}
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: capturing["on"])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    cache = CompileCache(tmp_path, frozen=False)
    c = Counter()
    with pytest.raises(CompileCacheMiss, match="CUDA graph is being captured") as ei:
        _get(cache, c, spec={"bm": 7})
    assert ei.value.reason == "cuda_graph_capture" and c.builds == 0
    capturing["on"] = False
    assert _get(cache, c, spec={"bm": 7}).status == "compiled"
    capturing["on"] = True
    assert _get(cache, c, spec={"bm": 7}).status == "memory"  # hits are served during capture
    assert _get(CompileCache(tmp_path, frozen=False), c, spec={"bm": 7}).status == "disk"


# ------------------------------------------------------------------ listing / clear / default
def test_entries_clear_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = CompileCache(tmp_path, frozen=False)
    c = Counter()
    keys = [_get(cache, c, spec={"i": i}).key for i in range(3)]
    (tmp_path / "unrelated.txt").write_text("keep me")
    ents = cache.entries(verify=True)
    assert [e["key"] for e in ents] == keys and all(e["status"] == "ok" for e in ents)
    assert ents[0]["extra"]["registers"] == 40 and os.path.exists(ents[0]["payload_path"])
    (tmp_path / f"{keys[1]}.bin").write_bytes(b"junk")
    assert [e["status"] for e in cache.entries()] == ["ok", "corrupt", "ok"]

    assert cli_main(["--dir", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and "CORRUPT" in out and "gemm" in out and "regs=40" in out
    assert "smem=1,024" in out and "spill=0" in out
    # ... which are the keys the real build writes.
    from kquant_cute.kernels.build import resource_summary

    assert {"registers", "shared_bytes", "spill_bytes"} <= set(resource_summary([]))
    assert cli_main(["--dir", str(tmp_path), "--info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk_entries"] == 3

    info = cache.cache_info()
    assert (info.compiles, info.misses, info.memory_entries, info.disk_entries) == (3, 3, 3, 3)
    assert cache.clear() == 3
    info = cache.cache_info()
    assert (info.disk_entries, info.disk_bytes, info.memory_entries) == (0, 0, 0)
    assert os.listdir(tmp_path) == ["unrelated.txt"]
    assert _get(cache, c, spec={"i": 0}).status == "compiled"
    assert cli_main(["--dir", str(tmp_path), "--clear"]) == 0 and "removed 1" in capsys.readouterr().out


def test_default_cache_reads_env_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", str(tmp_path / "one"))
    d1 = cc.default_cache()
    assert d1 is cc.default_cache() and d1.directory == str(tmp_path / "one")
    monkeypatch.setenv("KQUANT_COMPILE_CACHE_DIR", str(tmp_path / "two"))
    assert cc.default_cache() is d1
    cc.reset_default_cache()
    assert cc.default_cache().directory == str(tmp_path / "two")


def test_package_imports_nothing_heavy() -> None:
    code = (
        "import sys, kquant_cute.compile_cache as c; c.make_key('k', {}, arch='sm_90a');"
        "print([m for m in ('torch', 'cutlass', 'kquant_cute.kernels', 'kquant_cute.planners') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ real CuTe DSL round trip
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_cute_dsl_object_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "kernel_src.py"
    src.write_text("# stands in for the kernel module's source\n")
    args = {"dir": str(tmp_path / "cc"), "arch": ARCH, "spec": {"dtype": "f32", "block": 128},
            "sources": [str(src)], "reference": str(tmp_path / "reference.o")}
    first = _result(_run_worker("cute", args), timeout=240)
    assert first["status"] == "compiled"
    reference = Path(args["reference"]).read_bytes()
    assert reference[:4] == b"\x7fELF" and len(reference) > 1000

    # A fresh cache object in this process (cutlass not imported here) reads it back.
    fresh = CompileCache(args["dir"], frozen=True)
    got: dict[str, Any] = {}

    def load(path: str, meta: dict) -> str:
        got["bytes"] = Path(path).read_bytes()
        got["meta"] = meta
        return path

    def no_build() -> tuple[bytes, dict]:
        raise AssertionError("must be served from disk")

    res = fresh.get_or_build_result("add_one", args["spec"], arch=ARCH, build=no_build, load=load, sources=[str(src)])
    assert res.status == "disk" and res.key == first["key"]
    assert got["bytes"] == reference
    meta = got["meta"]
    assert meta["extra"] == {"prefix": "kq_add_one", "registers": None, "smem_bytes": 0}
    assert meta["compile_seconds"] == first["meta"]["compile_seconds"] > 0
    assert meta["components"] == first["meta"]["components"]
    assert meta["components"]["versions"]["nvidia_cutlass_dsl"] not in ("absent", "unknown")
    assert meta["payload"]["size"] == len(reference)
    # A second worker run is served from disk without compiling.
    again = _result(_run_worker("cute", {**args, "reference": str(tmp_path / "unused.o")}), timeout=240)
    assert again["status"] == "disk" and not (tmp_path / "unused.o").exists()


def test_runtime_versions_recorded_but_not_keyed(tmp_path) -> None:
    """A build box (Python 3.11, torch 2.13) must fill a cache a serving host with another
    Python / torch can use: only the DSL version is keyed, the rest is metadata."""
    _, components = cc_keys.make_key("k", {"a": 1}, arch="sm_90a")
    assert set(components["versions"]) == {"nvidia_cutlass_dsl"}
    cache = CompileCache(tmp_path)
    res = cache.get_or_build_result("k", {"a": 1}, arch="sm_90a", build=lambda: (b"x", {}),
                                    load=lambda path, meta: meta)
    built = res.meta["built_with"]
    assert set(built) == {"cuda_bindings", "torch", "python"}
    assert built["python"].endswith(f"{sys.version_info.major}.{sys.version_info.minor}")


# ------------------------------------------------------------- reliability
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_of_killed_writers_are_swept(tmp_path: Path) -> None:
    key = "ab" * 32
    dead, live = _dead_pid(), os.getpid()
    old = time.time() - 2 * cc_store.DEAD_WRITER_GRACE_SECONDS
    ancient = time.time() - 2 * cc_store.STALE_TEMP_SECONDS
    files = {
        f".{key}.bin.{dead}.0badc0de.tmp": old,      # writer gone, past the grace: stale
        f".{key}.json.{dead}.0badc0df.tmp": old,
        f".{key}.bin.{dead}.00000001.tmp": None,     # writer gone, within the grace: kept
        f".{key}.bin.{live}.00000002.tmp": old,      # writer alive: kept
        f".{key}.bin.{live}.00000003.tmp": ancient,  # older than any write: stale
        "unrelated.tmp": ancient,                    # not ours: kept
    }
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"partial")
        if mtime is not None:
            os.utime(tmp_path / name, (mtime, mtime))
    CompileCache(tmp_path, frozen=False)
    assert sorted(os.listdir(tmp_path)) == sorted([
        f".{key}.bin.{dead}.00000001.tmp", f".{key}.bin.{live}.00000002.tmp", "unrelated.tmp"])


def test_clear_on_readonly_dir_fails_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _entry(tmp_path)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(cc_cache, "probe_directory",
                        lambda path, **kw: ("ro", f"{path} is not writable (simulated)"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileCacheWarning)
        assert cli_main(["--dir", str(tmp_path), "--clear"]) == 1
    err = capsys.readouterr().err
    assert f"cannot clear the compile cache: {tmp_path} is not writable" in err
    assert sorted(os.listdir(tmp_path)) == before


def test_listing_a_missing_dir_does_not_create_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no degrade warning either
        cache = CompileCache(missing, create=False)
        assert cache.entries() == [] and cache.disk_mode == "off" and not cache.degraded
        assert cache.clear() == 0
        assert cli_main(["--dir", str(missing), "--list"]) == 0
        assert cli_main(["--dir", str(missing), "--info"]) == 0
    assert "0 entries" in capsys.readouterr().out
    assert not missing.exists() and not missing.parent.exists()
    # Building still works (memory only) and still does not create the directory.
    assert _get(cache, Counter()).status == "compiled" and not missing.exists()


@pytest.mark.slow
def test_eight_processes_two_layers_compile_each_key_once(tmp_path: Path) -> None:
    """Real compiles: 8 processes each plan two layers of different geometry on one empty
    cache directory; each specialization is compiled by exactly one of them."""
    n = 8
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    geos = [dict(num_experts=4, hidden=128, intermediate=128, topk=2, bits=2),
            dict(num_experts=3, hidden=256, intermediate=128, topk=1, bits=3, codebook="mul1")]
    args = {"dir": str(tmp_path / "cc"), "barrier": str(barrier), "n": n, "arch": "sm_120",
            "geometries": geos}
    procs = [_run_worker("plans", args) for _ in range(n)]
    results = [_result(p, timeout=600) for p in procs]
    keys = {k for r in results for k in r["keys"]}
    assert len(keys) == 2 and all(len(set(r["keys"])) == 2 for r in results)
    assert sum(r["compiles"] for r in results) == 2, results  # each key once
    assert sum(r["disk_loads"] for r in results) >= 2 * n - 2
    assert len(list((tmp_path / "cc").glob("*.json"))) == 2


def test_format_entries_lines(tmp_path: Path) -> None:
    """The listing both CLIs print: a header, one line per entry (the caller's spec summary
    or the spec's JSON), CORRUPT for a bad entry, a note for a missing directory."""
    from kquant_cute.compile_cache import format_entries

    ok = {"key": "ab" * 32, "status": "ok", "name": "gemm", "arch": "sm_90a", "spec": {"bm": 64},
          "extra": {"registers": 40, "shared_bytes": 2048}, "payload": {"size": 3072},
          "compile_seconds": 1.5, "created_utc": "T"}
    bad = {"key": "cd" * 32, "status": "corrupt", "error": "checksum"}
    text = format_entries([ok, bad], str(tmp_path))
    assert text.splitlines() == [
        f"{tmp_path}: 2 entries",
        f"  {'ab' * 8}  gemm  sm_90a   {{\"bm\":64}}  regs=40 smem=2,048 spill=-  3 KiB  built in 1.50 s  T",
        f"  {'cd' * 8}  CORRUPT  checksum"]
    named = format_entries([ok], str(tmp_path), lambda spec: f"M={spec['bm']}")
    assert named.splitlines()[1].split()[3] == "M=64"
    assert format_entries([ok], str(tmp_path), lambda spec: None) == text.splitlines()[0].replace(
        "2 entries", "1 entries") + "\n" + text.splitlines()[1]
    assert format_entries([], str(tmp_path / "gone")) == (
        f"{tmp_path / 'gone'}: 0 entries (the directory does not exist)")


def test_a_wait_for_another_builder_is_reported(tmp_path: Path) -> None:
    """Two caches on one directory (as two processes): the one that waited on the other's
    file lock while it built gets the entry from disk and says how long it waited."""
    started = threading.Event()

    class Slow(Counter):
        def build(self) -> tuple[bytes, dict]:
            started.set()
            time.sleep(0.5)
            return super().build()

    builder, waiter = Slow(), Counter()
    first = {}
    t = threading.Thread(target=lambda: first.update(r=_get(CompileCache(tmp_path), builder)))
    t.start()
    assert started.wait(10)
    second = _get(CompileCache(tmp_path), waiter)
    t.join()
    assert first["r"].status == "compiled" and first["r"].waited == 0.0
    assert second.status == "disk" and second.waited > 0.2 and waiter.builds == 0

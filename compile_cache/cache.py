"""CompileCache: memory + disk cache of compiled specializations, freeze mode, default instance.

This module owns the policy: look in memory, then on disk, then build under a per-key
file lock (re-checking after the lock is acquired, so N racing processes build once),
write atomically, and memoise what the caller's ``load`` returns. It knows nothing about
kernels: ``build`` returns opaque bytes plus JSON metadata and ``load`` turns a payload
file into whatever the caller wants (for the CuTe DSL, ``cute.runtime.load_module(path)``
and then ``getattr(module, prefix)``).

Environment (read when a :class:`CompileCache` is created, i.e. for :func:`default_cache`
at its first use; call :func:`reset_default_cache` after changing them):

``KQUANT_COMPILE_CACHE_DIR``
    Cache directory. Unset: ``$XDG_CACHE_HOME/kquant_cute`` when ``XDG_CACHE_HOME`` is an
    absolute path, else ``~/.cache/kquant_cute``. ``~`` is expanded and a relative path is
    made absolute against the current directory. Set but empty (or containing a NUL
    byte): ValueError. A path that is a file, cannot be created or is not writable is not
    an error: the cache degrades with exactly one :class:`CompileCacheWarning` per cache
    object, to read-only disk + memory when the directory exists and is readable, else to
    memory only.
``KQUANT_COMPILE_FREEZE``
    ``"1"``: frozen, any miss raises :class:`CompileCacheMiss`; ``"0"`` or ``""``: not
    frozen; anything else: ValueError. :meth:`CompileCache.freeze` and
    :meth:`CompileCache.frozen` change it at run time.

A miss while the current CUDA stream is capturing a graph raises :class:`CompileCacheMiss`
even when not frozen (a compile there would be silent and break the capture); torch is
only consulted when it is already imported. Disk hits are still served during capture.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import datetime as _dt
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from . import keys as _keys
from .keys import PathLike, canonical_json, make_key, runtime_versions
from .store import CorruptEntry, DiskStore, StoredEntry, probe_directory, sweep_stale

__all__ = [
    "BuildFn",
    "CacheInfo",
    "CacheResult",
    "CompileCache",
    "CompileCacheMiss",
    "CompileCacheWarning",
    "LoadFn",
    "default_cache",
    "parse_freeze_env",
    "reset_default_cache",
    "resolve_cache_dir",
]

ENV_DIR = "KQUANT_COMPILE_CACHE_DIR"
ENV_FREEZE = "KQUANT_COMPILE_FREEZE"
#: Private temp directories of memory-only builds (``kquant_cc_<pid>_<rand>``).
#: A lock wait longer than this is reported (CacheResult.waited): another process was
#: building the entry; shorter ones are ordinary lock traffic.
_WAIT_NOTED = 0.05
_MEMORY_TMP_RE = re.compile(r"^kquant_cc_(?:(?P<pid>[0-9]+)_)?[A-Za-z0-9_]+$")

#: ``build()`` returns ``(payload bytes, extra JSON metadata such as registers/smem)``.
BuildFn = Callable[[], "tuple[bytes, Mapping[str, Any]]"]
#: ``load(payload_path, meta)``; the path is only guaranteed to exist during the call.
LoadFn = Callable[[str, "dict[str, Any]"], Any]

LookupStatus = Literal["memory", "disk", "miss"]
ResultStatus = Literal["memory", "disk", "compiled"]
DiskMode = Literal["rw", "ro", "off"]


class CompileCacheWarning(UserWarning):
    """Cache degraded (directory unusable) or a bad entry was dropped and rebuilt."""


class CompileCacheMiss(RuntimeError):
    """A specialization is neither in memory nor on disk and compiling is not allowed now."""

    def __init__(self, message: str, *, name: str, spec: Mapping[str, Any], arch: str, key: str, reason: str):
        super().__init__(message)
        self.name = name
        self.spec = dict(spec)
        self.arch = arch
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields: keep it picklable
        return (_rebuild_miss, (str(self), self.name, self.spec, self.arch, self.key, self.reason))


def _rebuild_miss(message: str, name: str, spec: dict[str, Any], arch: str, key: str, reason: str) -> CompileCacheMiss:
    return CompileCacheMiss(message, name=name, spec=spec, arch=arch, key=key, reason=reason)


@dataclass(frozen=True)
class CacheResult:
    """Outcome of one :meth:`CompileCache.get_or_build_result` call."""

    value: Any
    #: ``"memory"`` (memoised), ``"disk"`` (loaded from an entry) or ``"compiled"`` (built now).
    status: ResultStatus
    key: str
    #: The entry metadata (see :meth:`CompileCache.get_or_build`); a shallow copy.
    meta: dict[str, Any]
    #: Wall seconds this call spent (build + write + load, or load, or ~0 for memory).
    seconds: float
    #: Seconds spent waiting for another process's lock on this key (it was building it).
    waited: float = 0.0


@dataclass(frozen=True)
class CacheInfo:
    """Snapshot returned by :meth:`CompileCache.cache_info`; counters are per cache object."""

    directory: str | None
    disk_mode: DiskMode
    degraded: bool
    degraded_reason: str | None
    frozen: bool
    disk_entries: int
    disk_bytes: int
    memory_entries: int
    hits: int
    memory_hits: int
    disk_loads: int
    misses: int
    compiles: int
    compile_seconds: float
    dropped_entries: int

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-serialisable)."""
        return asdict(self)


@dataclass
class _Stats:
    memory_hits: int = 0
    disk_loads: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    dropped_entries: int = 0


@dataclass
class _Memo:
    value: Any
    meta: dict[str, Any] = field(repr=False)


def resolve_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The cache directory named by the environment (see module docstring); ValueError if invalid."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_DIR)
    if raw is not None:
        if not raw.strip():
            raise ValueError(
                f"{ENV_DIR} is set but empty; unset it to use the default "
                "(~/.cache/kquant_cute) or set it to a directory path"
            )
        return _validated_dir(raw, ENV_DIR)
    xdg = env.get("XDG_CACHE_HOME", "")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kquant_cute")


def _validated_dir(raw: PathLike, what: str) -> str:
    text = os.fspath(raw)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str path (got bytes)")
    if not text.strip():
        raise ValueError(f"{what} must not be empty")
    if "\0" in text:
        raise ValueError(f"{what} contains a NUL byte: {text!r}")
    return os.path.abspath(os.path.expanduser(text))


def parse_freeze_env(environ: Mapping[str, str] | None = None) -> bool:
    """``KQUANT_COMPILE_FREEZE`` as a bool: only ``"1"``, ``"0"`` or ``""`` (unset) are accepted."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_FREEZE, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV_FREEZE} must be '0', '1' or empty (got {raw!r})")
    return raw == "1"


def _capturing_cuda_graph() -> bool:
    """True when torch is imported, CUDA is available and the current stream is capturing."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a broken CUDA setup is "not capturing"
        return False


def _describe(name: str, spec: Mapping[str, Any], arch: str) -> str:
    try:
        spec_text = canonical_json(_keys.canonical_spec(spec))
    except TypeError:
        spec_text = repr(dict(spec))
    return f"kernel {name!r} spec {spec_text} arch {arch}"


def _check_build_result(result: Any, name: str) -> tuple[bytes, dict[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"build() for {name!r} must return (payload_bytes, extra_meta_dict), got {type(result).__name__}"
        )
    payload, extra = result
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"build() for {name!r} returned a {type(payload).__name__} payload; expected bytes")
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"build() for {name!r} returned {type(extra).__name__} metadata; expected a dict")
    try:
        extra_plain = json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"build() metadata for {name!r} is not JSON-serialisable: {exc}") from None
    return bytes(payload), extra_plain


class CompileCache:
    """Memory + disk cache of compiled specializations (thread- and process-safe).

    ``directory``: cache directory; None reads ``KQUANT_COMPILE_CACHE_DIR`` (see the
    module docstring). ``disk=False``: memory only, no warning. ``frozen``: None reads
    ``KQUANT_COMPILE_FREEZE``. ``lock_timeout``: seconds to wait for another process that
    is building the same key before building anyway. ``environ``: mapping read instead of
    ``os.environ`` for the two variables above (keys still read ``os.environ``).
    ``create=False``: a directory that does not exist is not created (for listing and
    checking: the cache is then memory only, ``disk_mode`` ``"off"``, without a warning).
    Opening a writable directory removes stale temp files of killed writers.
    """

    def __init__(
        self,
        directory: PathLike | None = None,
        *,
        disk: bool = True,
        frozen: bool | None = None,
        lock_timeout: float = 900.0,
        environ: Mapping[str, str] | None = None,
        create: bool = True,
    ) -> None:
        env = os.environ if environ is None else environ
        self._frozen = parse_freeze_env(env) if frozen is None else bool(frozen)
        self._lock_timeout = float(lock_timeout)
        self._mu = threading.RLock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._memory: dict[str, _Memo] = {}
        self._key_memo: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
        self._stats = _Stats()
        self._warned_degraded = False
        self._degraded_reason: str | None = None
        self._directory: str | None = None
        self._store: DiskStore | None = None
        self._mode: DiskMode = "off"
        if not disk:
            return
        self._directory = resolve_cache_dir(env) if directory is None else _validated_dir(directory, "directory")
        mode, reason = probe_directory(self._directory, create=create)
        if mode == "absent":
            return
        if mode == "none":
            self._degrade(reason or "directory unusable", "off")
            return
        self._store = DiskStore(self._directory, format_version=_keys.CACHE_FORMAT_VERSION)
        self._mode = "rw"
        if mode == "ro":
            # A read-only cache that serves every lookup is a normal serving setup: the
            # warning waits for a compile that could not be kept (see _build).
            self._degrade(reason or "directory not writable", "ro", warn=False)
        else:
            self._store.sweep_temps()

    # -- state -----------------------------------------------------------------------
    @property
    def directory(self) -> str | None:
        """The cache directory (None when constructed with ``disk=False``)."""
        return self._directory

    @property
    def disk_mode(self) -> DiskMode:
        """``"rw"``, ``"ro"`` (read existing entries, keep new ones in memory) or ``"off"``."""
        return self._mode

    @property
    def degraded(self) -> bool:
        """True when a disk cache was asked for but the directory is not (fully) usable."""
        return self._degraded_reason is not None

    @property
    def is_frozen(self) -> bool:
        """True when a miss raises :class:`CompileCacheMiss` instead of compiling."""
        return self._frozen

    def freeze(self, flag: bool = True) -> bool:
        """Set frozen mode; return the previous setting."""
        with self._mu:
            previous, self._frozen = self._frozen, bool(flag)
        return previous

    @contextlib.contextmanager
    def frozen(self, flag: bool = True) -> Iterator[CompileCache]:
        """Context manager: frozen (or not, with ``flag=False``) inside, restored on exit."""
        previous = self.freeze(flag)
        try:
            yield self
        finally:
            self.freeze(previous)

    def _degrade(self, reason: str, mode: DiskMode, *, warn: bool = True) -> None:
        """Drop to ``mode`` and (``warn``) emit the one CompileCacheWarning this object ever
        emits for it."""
        with self._mu:
            self._mode = mode
            if mode == "off":
                self._store = None
            self._degraded_reason = reason
        if warn:
            self._warn_degraded()

    def _warn_degraded(self) -> None:
        with self._mu:
            if self._warned_degraded or self._degraded_reason is None:
                return
            self._warned_degraded = True
            reason, mode = self._degraded_reason, self._mode
        keeps = "existing entries are still read, new compiles" if mode == "ro" else "compiled kernels"
        warnings.warn(
            f"kquant compile cache: {reason}; {keeps} are kept in memory only "
            f"(set {ENV_DIR} to a writable directory to persist them)",
            CompileCacheWarning,
            stacklevel=4,
        )

    # -- keys ------------------------------------------------------------------------
    def _resolve_key(
        self, name: str, spec: Mapping[str, Any], arch: str, sources: Sequence[PathLike], options: str
    ) -> tuple[str, dict[str, Any]]:
        """:func:`make_key`, memoised per argument tuple for the life of this object.

        A memory hit then costs a few microseconds instead of re-reading the ``CUTE_DSL_*``
        environment and re-stat-ing sources (~40 us). The snapshot is taken at the first
        use of each argument tuple, which matches what the process runs: the DSL reads its
        environment once at import, and editing a source file does not change code that is
        already imported. :meth:`clear` drops the memo.
        """
        token = (name, arch, options, tuple(os.fspath(s) for s in sources), repr(spec))
        hit = self._key_memo.get(token)
        if hit is None:
            hit = self._key_memo[token] = make_key(name, spec, arch=arch, sources=sources, options=options)
        return hit

    def make_key(
        self,
        name: str,
        spec: Mapping[str, Any],
        *,
        arch: str,
        sources: Sequence[PathLike] = (),
        options: str = "",
    ) -> tuple[str, dict[str, Any]]:
        """Same as :func:`kquant_cute.compile_cache.make_key` for this process's environment."""
        return make_key(name, spec, arch=arch, sources=sources, options=options)

    # -- main entry points -----------------------------------------------------------
    def get_or_build(
        self,
        name: str,
        spec: Mapping[str, Any],
        *,
        arch: str,
        build: BuildFn,
        load: LoadFn,
        sources: Sequence[PathLike] = (),
        options: str = "",
    ) -> Any:
        """Return the loaded specialization, building and storing it on a miss.

        ``build()`` returns ``(payload, extra)``: the payload bytes and JSON metadata
        (registers, smem, the object's function prefix, ...). ``load(path, meta)`` gets
        the payload file's path (valid only during the call) and the entry metadata:
        ``{"format", "key", "name", "spec", "arch", "options", "components",
        "compile_seconds", "created", "created_utc", "extra", "payload": {"file", "size",
        "sha256"}}``. Its return value is memoised per key. An entry that is corrupt or
        whose ``load`` raises is deleted and rebuilt with a :class:`CompileCacheWarning`;
        if ``load`` also raises on the fresh build, that exception propagates.

        Raises :class:`CompileCacheMiss` on a miss while frozen or while a CUDA graph is
        being captured.
        """
        return self.get_or_build_result(
            name, spec, arch=arch, build=build, load=load, sources=sources, options=options
        ).value

    def get_or_build_result(
        self,
        name: str,
        spec: Mapping[str, Any],
        *,
        arch: str,
        build: BuildFn,
        load: LoadFn,
        sources: Sequence[PathLike] = (),
        options: str = "",
    ) -> CacheResult:
        """:meth:`get_or_build`, returning a :class:`CacheResult` with the per-call status."""
        t0 = time.perf_counter()
        key, components = self._resolve_key(name, spec, arch, sources, options)
        hit = self._memory_hit(key, t0)
        if hit is not None:
            return hit
        with self._key_lock(key):
            hit = self._memory_hit(key, t0)
            if hit is not None:
                return hit
            bad: tuple[str, str] | None = None
            if self._mode != "off":
                got, bad = self._from_disk(key, name, load, t0, may_delete=False, known_bad=None)
                if got is not None:
                    return got
            self._check_may_compile(name, spec, arch, key)
            store = self._store
            if self._mode == "rw" and store is not None:
                t_lock = time.perf_counter()
                with store.lock(key, timeout=self._lock_timeout):
                    waited = time.perf_counter() - t_lock
                    # Re-check: another process may have built it while we waited.
                    got, _ = self._from_disk(key, name, load, t0, may_delete=True, known_bad=bad)
                    if got is not None:
                        return dataclasses.replace(got, waited=waited) if waited > _WAIT_NOTED else got
                    self._check_may_compile(name, spec, arch, key)
                    return self._build(key, components, name, spec, arch, options, build, load, t0)
            return self._build(key, components, name, spec, arch, options, build, load, t0)

    def lookup(
        self,
        name: str,
        spec: Mapping[str, Any],
        *,
        arch: str,
        sources: Sequence[PathLike] = (),
        options: str = "",
    ) -> LookupStatus:
        """``"memory"``, ``"disk"`` (a valid entry, checksum verified) or ``"miss"``; builds nothing."""
        key, _ = self._resolve_key(name, spec, arch, sources, options)
        return self.lookup_key(key)

    def lookup_key(self, key: str) -> LookupStatus:
        """:meth:`lookup` for a key from :func:`make_key`."""
        with self._mu:
            if key in self._memory:
                return "memory"
        store = self._store
        if self._mode == "off" or store is None:
            return "miss"
        try:
            return "disk" if store.read(key) is not None else "miss"
        except (CorruptEntry, OSError):
            return "miss"

    # -- internals -------------------------------------------------------------------
    def _key_lock(self, key: str) -> threading.Lock:
        with self._mu:
            lock = self._key_locks.get(key)
            if lock is None:
                lock = self._key_locks[key] = threading.Lock()
            return lock

    def _memory_hit(self, key: str, t0: float) -> CacheResult | None:
        with self._mu:
            memo = self._memory.get(key)
            if memo is None:
                return None
            self._stats.memory_hits += 1
        return CacheResult(memo.value, "memory", key, dict(memo.meta), time.perf_counter() - t0)

    def _remember(self, key: str, value: Any, meta: dict[str, Any]) -> None:
        with self._mu:
            self._memory[key] = _Memo(value, meta)

    def _check_may_compile(self, name: str, spec: Mapping[str, Any], arch: str, key: str) -> None:
        if self._frozen:
            reason = "frozen"
            why = f"the compile cache is frozen ({ENV_FREEZE}=1 or CompileCache.freeze(True))"
        elif _capturing_cuda_graph():
            reason = "cuda_graph_capture"
            why = "a CUDA graph is being captured on the current stream; compiling now would break it"
        else:
            return
        with self._mu:
            self._stats.misses += 1
        where = f"in {self._directory}" if self._mode != "off" else "(memory-only cache)"
        raise CompileCacheMiss(
            f"compile cache miss for {_describe(name, spec, arch)} (key {key[:16]}…) {where}: "
            f"{why}. Precompile this specialization (or run it once before freezing/capturing).",
            name=name,
            spec=spec,
            arch=arch,
            key=key,
            reason=reason,
        )

    def _drop(self, key: str, name: str, why: str, *, may_delete: bool) -> None:
        store = self._store
        deleted = False
        if may_delete and self._mode == "rw" and store is not None:
            try:
                store.delete(key)
                deleted = True
            except OSError:
                pass
        with self._mu:
            self._stats.dropped_entries += deleted
        action = "deleted it and rebuilding" if deleted else "ignoring it and rebuilding in memory"
        warnings.warn(
            f"kquant compile cache: entry {key[:16]}… for kernel {name!r} is unusable ({why}); {action}",
            CompileCacheWarning,
            stacklevel=4,
        )

    def _from_disk(
        self,
        key: str,
        name: str,
        load: LoadFn,
        t0: float,
        *,
        may_delete: bool,
        known_bad: tuple[str, str] | None,
    ) -> tuple[CacheResult | None, tuple[str, str] | None]:
        """Try the disk entry. Returns ``(result or None, (sha256, error) of a payload load() rejected)``.

        A bad entry is reported and deleted only when ``may_delete`` (we hold the key's
        file lock) or when the directory is read-only (nobody can fix it); otherwise the
        caller retries under the lock, where a concurrent writer has finished.
        """
        store = self._store
        if store is None:
            return None, None
        act = may_delete or self._mode != "rw"
        try:
            entry: StoredEntry | None = store.read(key)
        except CorruptEntry as exc:
            if act:
                self._drop(key, name, str(exc), may_delete=may_delete)
            return None, None
        except OSError:
            return None, None
        if entry is None:
            return None, None
        sha = entry.meta["payload"]["sha256"]
        if known_bad is not None and sha == known_bad[0]:
            # load() already rejected these exact bytes before we took the lock.
            self._drop(key, name, known_bad[1], may_delete=may_delete)
            return None, None
        try:
            value = load(entry.payload_path, dict(entry.meta))
        except Exception as exc:  # noqa: BLE001 - any loader failure means "rebuild"
            why = f"load() raised {type(exc).__name__}: {exc}"
            if act:
                self._drop(key, name, why, may_delete=may_delete)
                return None, None
            return None, (sha, why)
        self._remember(key, value, entry.meta)
        with self._mu:
            self._stats.disk_loads += 1
        return CacheResult(value, "disk", key, dict(entry.meta), time.perf_counter() - t0), None

    def _build(
        self,
        key: str,
        components: dict[str, Any],
        name: str,
        spec: Mapping[str, Any],
        arch: str,
        options: str,
        build: BuildFn,
        load: LoadFn,
        t0: float,
    ) -> CacheResult:
        with self._mu:
            self._stats.misses += 1
        tb = time.perf_counter()
        payload, extra = _check_build_result(build(), name)
        compile_seconds = time.perf_counter() - tb
        with self._mu:
            self._stats.compiles += 1
            self._stats.compile_seconds += compile_seconds
        now = time.time()
        meta: dict[str, Any] = {
            "name": name,
            "spec": copy.deepcopy(components["spec"]),
            "arch": arch,
            "options": options,
            "components": copy.deepcopy(components),  # the memoised original stays private
            "compile_seconds": round(compile_seconds, 6),
            "created": now,
            "created_utc": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds"),
            "built_with": runtime_versions(),  # informational: not part of the key
            "extra": extra,
        }
        store = self._store
        if self._mode == "rw" and store is not None:
            try:
                entry = store.write(key, payload, meta)
            except OSError as exc:
                self._degrade(f"writing to {self._directory} failed ({exc.strerror or exc})", "ro")
            else:
                try:
                    value = load(entry.payload_path, dict(entry.meta))
                except BaseException:
                    with contextlib.suppress(OSError):
                        store.delete(key)
                    raise
                self._remember(key, value, entry.meta)
                return CacheResult(value, "compiled", key, dict(entry.meta), time.perf_counter() - t0)
        self._warn_degraded()  # this compile is kept in memory only
        # Memory only: hand load() a private temp file with the same metadata layout.
        meta.update(
            format=_keys.CACHE_FORMAT_VERSION,
            key=key,
            payload={"file": None, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
        )
        sweep_stale(tempfile.gettempdir(), _MEMORY_TMP_RE)
        with tempfile.TemporaryDirectory(prefix=f"kquant_cc_{os.getpid()}_") as tmp:
            path = os.path.join(tmp, key + ".bin")
            with open(path, "wb") as f:
                f.write(payload)
            value = load(path, dict(meta))
        self._remember(key, value, meta)
        return CacheResult(value, "compiled", key, dict(meta), time.perf_counter() - t0)

    # -- inspection / maintenance ----------------------------------------------------
    def cache_info(self) -> CacheInfo:
        """Counters of this object plus what is on disk now."""
        entries = nbytes = 0
        store = self._store
        if self._mode != "off" and store is not None:
            with contextlib.suppress(OSError):
                entries, nbytes = store.usage()
        with self._mu:
            s = self._stats
            return CacheInfo(
                directory=self._directory,
                disk_mode=self._mode,
                degraded=self.degraded,
                degraded_reason=self._degraded_reason,
                frozen=self._frozen,
                disk_entries=entries,
                disk_bytes=nbytes,
                memory_entries=len(self._memory),
                hits=s.memory_hits + s.disk_loads,
                memory_hits=s.memory_hits,
                disk_loads=s.disk_loads,
                misses=s.misses,
                compiles=s.compiles,
                compile_seconds=s.compile_seconds,
                dropped_entries=s.dropped_entries,
            )

    def entries(self, *, verify: bool = False) -> list[dict[str, Any]]:
        """Metadata of every disk entry, oldest first.

        Each dict is the stored metadata plus ``"status"`` (``"ok"`` or ``"corrupt"``),
        ``"payload_path"`` and, for corrupt ones, ``"error"`` (when the metadata itself is
        unreadable only ``"key"`` is guaranteed besides those). ``verify=True`` also checks
        payload checksums (reads every payload).
        """
        store = self._store
        if self._mode == "off" or store is None:
            return []
        out: list[dict[str, Any]] = []
        for key in store.keys():
            path = store.payload_path(key)
            try:
                meta = store.read_meta(key)
            except (CorruptEntry, OSError) as exc:
                out.append({"key": key, "status": "corrupt", "error": str(exc), "payload_path": path})
                continue
            if meta is None:  # removed since listing
                continue
            try:
                entry = store.read(key, verify=verify)
            except (CorruptEntry, OSError) as exc:
                out.append(dict(meta, status="corrupt", error=str(exc), payload_path=path))
                continue
            if entry is not None:
                out.append(dict(entry.meta, status="ok", payload_path=path))
        out.sort(key=lambda m: (m.get("created") or 0.0, m["key"]))
        return out

    def clear(self) -> int:
        """Empty memory and the disk; return the number of disk entries removed.

        Raises PermissionError naming the directory when it holds entries this process
        cannot remove (a read-only or unusable cache directory): a clear that leaves the
        entries in place must not look like a successful one. A directory that does not
        exist (or a memory-only cache) has nothing to remove: 0.
        """
        with self._mu:
            self._memory.clear()
            self._key_memo.clear()
        store = self._store
        if self._directory is None or (self._mode == "off" and not os.path.lexists(self._directory)):
            return 0
        if self._mode != "rw" or store is None:
            raise PermissionError(
                errno.EACCES,
                f"cannot clear the compile cache: "
                f"{self._degraded_reason or f'{self._directory} is read-only'}; "
                "its entries were left in place",
                self._directory,
            )
        try:
            return store.clear()
        except OSError as exc:
            raise PermissionError(
                exc.errno or errno.EACCES,
                f"cannot clear the compile cache in {self._directory}: {exc.strerror or exc}",
                self._directory,
            ) from exc


_DEFAULT: CompileCache | None = None
_DEFAULT_LOCK = threading.Lock()


def default_cache() -> CompileCache:
    """The process-wide cache, created at first use from the environment at that moment.

    Later changes to ``KQUANT_COMPILE_CACHE_DIR`` / ``KQUANT_COMPILE_FREEZE`` are not seen
    until :func:`reset_default_cache` (use :meth:`CompileCache.freeze` at run time).
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = CompileCache()
        return _DEFAULT


def reset_default_cache() -> None:
    """Forget the process-wide cache (memory included); the next :func:`default_cache` re-reads env."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = None

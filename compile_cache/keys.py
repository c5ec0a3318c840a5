"""Cache keys: canonical JSON of everything that changes a compiled artifact, and its sha256.

This module owns *what* a compiled specialization depends on. A key is the sha256 of a
canonical JSON document (sorted keys, no whitespace, no NaN) holding:

``format``
    :data:`CACHE_FORMAT_VERSION`; bump it when the entry layout or key recipe changes.
``name`` / ``spec``
    The kernel name and its specialization dict (JSON values only: str, int, float,
    bool, None, lists/tuples and str-keyed dicts of those; numpy scalars are converted;
    anything else is refused so
    that no ``repr`` with a memory address can leak into a key).
``arch``
    The target, e.g. ``"sm_90a"``. ``CUTE_DSL_ARCH`` is *folded into* this component and
    deliberately not keyed separately: a CPU cross-compile with ``CUTE_DSL_ARCH=sm_90a``
    and a run on an H200 that detects ``sm_90a`` must share entries. Callers pass the arch
    the build really targets.
``host``
    ``sys.platform`` and the machine (``x86_64``/``aarch64``): the payload is a host
    object file, so an x86-64 entry must never be served on a Grace host.
``sources``
    sha256 of the bytes of caller-named source files, each with its base name (not its
    full path, so a checkout and an installed wheel with identical files agree).
``versions``
    The toolchain that produces the payload: nvidia-cutlass-dsl (its MLIR compiler, ptxas
    and runtime ABI travel with it). See :func:`toolchain_versions`. cuda-bindings, torch
    and Python are recorded in every entry's metadata (:func:`runtime_versions`) but NOT
    keyed: the payload is a relocatable object (host launch code + cubin) loaded by the
    DSL runtime, independent of them, and keying them would make a build box's prewarmed
    cache useless to a serving machine with another Python or torch (build and serving
    machines commonly differ in both). Bump
    :data:`CACHE_FORMAT_VERSION` if a kernel ever embeds something that depends on them.
``options``
    The compile options string passed to ``cute.compile``.
``env``
    The ``CUTE_DSL_*`` variables in :data:`KEYED_ENV_VARS` that are set. They are the
    ones the DSL itself marks ``affects_compile=True`` (``base_dsl/env_manager.py``), minus
    ``CUTE_DSL_ARCH`` (folded into ``arch``) and ``CUTE_DSL_LIBS`` (a machine-local path to
    the runtime library, whose identity is already pinned by the DSL version).

Not keyed, on purpose: device UUID, SM count, driver version, host name, absolute paths.
Problem sizes and grid sizes are run-time values, so one entry serves every GPU of an arch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import math
import numbers
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Union

__all__ = [
    "CACHE_FORMAT_VERSION",
    "KEYED_ENV_VARS",
    "PathLike",
    "canonical_json",
    "canonical_spec",
    "hash_sources",
    "host_component",
    "make_key",
    "runtime_versions",
    "toolchain_versions",
    "validate_arch",
]

#: Bump when the on-disk entry layout or the key recipe changes; old entries then miss.
CACHE_FORMAT_VERSION: int = 1

#: ``CUTE_DSL_*`` variables that change generated code (keyed when set).
KEYED_ENV_VARS: tuple[str, ...] = (
    "CUTE_DSL_AUTO_M2S",
    "CUTE_DSL_COMPILER_BACKEND",
    "CUTE_DSL_COMPILER_OPT",
    "CUTE_DSL_DEBUG",
    "CUTE_DSL_DRYRUN",
    "CUTE_DSL_ENABLE_ASSERTIONS",
    "CUTE_DSL_ENABLE_PYIR",
    "CUTE_DSL_ENABLE_TVM_FFI",
    "CUTE_DSL_LINEINFO",
    "CUTE_DSL_LOC_TRACEBACKS",
    "CUTE_DSL_TOLERATE_M2M",
    "CUTE_DSL_USE_EXTENSION_COMPILER",
    "CUTE_DSL_WARNINGS_AS_ERRORS",
)

PathLike = Union[str, "os.PathLike[str]"]

_ARCH_RE = re.compile(r"^sm_[0-9]{2,3}[a-z]?$")

# (distribution names tried in order, importable module used as a fallback)
_VERSIONED: dict[str, tuple[tuple[str, ...], str]] = {
    "nvidia_cutlass_dsl": (("nvidia-cutlass-dsl",), "cutlass"),
}
#: Recorded in entry metadata for diagnosis, not keyed (see the module docstring).
_RUNTIME_VERSIONED: dict[str, tuple[tuple[str, ...], str]] = {
    "cuda_bindings": (("cuda-bindings", "cuda-python"), "cuda.bindings"),
    "torch": (("torch",), "torch"),
}


def validate_arch(arch: str) -> str:
    """Return ``arch`` if it looks like ``sm_90a`` / ``sm_120a`` / ``sm_80``, else raise ValueError."""
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(
            f"arch must look like 'sm_90a' or 'sm_120a' (got {arch!r}); pass the "
            "architecture the build targets, e.g. the value of CUTE_DSL_ARCH"
        )
    return arch


def _canon(value: Any, where: str) -> Any:
    """Recursively convert ``value`` to plain JSON types or raise TypeError naming ``where``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # float, numpy floats
        as_float = float(value)
        if not math.isfinite(as_float):
            raise TypeError(f"{where}: non-finite float {value!r} cannot be part of a cache key")
        return as_float
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be str (got {k!r})")
            out[k] = _canon(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canon(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: {type(value).__name__} value {value!r} is not a JSON value; convert it "
        "to str/int/float/bool (e.g. str(dtype)) before using it in a specialization"
    )


def canonical_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``spec`` as plain JSON data (tuples become lists); TypeError on other types."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"spec must be a mapping (got {type(spec).__name__})")
    return _canon(spec, "spec")


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, compact separators, ASCII only, NaN refused."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _version_of(dists: tuple[str, ...], module: str) -> str:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    # Not installed as a distribution (e.g. the DSL bundle put on PYTHONPATH): ask the module.
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "absent"
        return "absent"
    return str(getattr(mod, "__version__", "unknown"))


@functools.lru_cache(maxsize=1)
def _toolchain_versions_cached() -> tuple[tuple[str, str], ...]:
    found = {name: _version_of(dists, module) for name, (dists, module) in _VERSIONED.items()}
    return tuple(sorted(found.items()))


def runtime_versions() -> dict[str, str]:
    """cuda-bindings, torch and Python of this process: entry metadata only, never keyed."""
    found = {name: _version_of(dists, module) for name, (dists, module) in _RUNTIME_VERSIONED.items()}
    found["python"] = f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}"
    return found


def toolchain_versions() -> dict[str, str]:
    """Versions keyed into every entry, computed once per process.

    Keys: ``nvidia_cutlass_dsl``. Package
    metadata is read first (cheap, imports nothing); only a package missing from the
    metadata is imported to read ``__version__``. A missing package reads ``"absent"``.
    """
    return dict(_toolchain_versions_cached())


def host_component() -> str:
    """``"<sys.platform>-<machine>"``, e.g. ``"linux-x86_64"``: the payload's host ABI."""
    return f"{sys.platform}-{platform.machine().lower() or 'unknown'}"


def keyed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The set members of :data:`KEYED_ENV_VARS` in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in KEYED_ENV_VARS if name in env}


# path -> ((st_ino, st_size, st_mtime_ns, st_ctime_ns), sha256 hex). A digest is reused
# only while the stat is unchanged *and* the file was already older than _RACY_SECONDS
# when hashed: file timestamps advance in coarse ticks, so a file rewritten within one
# tick of being hashed can keep its stat (git's "racy clean" problem).
_SOURCE_HASHES: dict[str, tuple[tuple[int, int, int, int], str]] = {}
_SOURCE_LOCK = threading.Lock()
_RACY_SECONDS = 2.0


def _file_sha256(path: str) -> str:
    st = os.stat(path)
    sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _SOURCE_LOCK:
        hit = _SOURCE_HASHES.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if time.time() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 > _RACY_SECONDS:
        with _SOURCE_LOCK:
            _SOURCE_HASHES[path] = (sig, digest)
    return digest


def hash_sources(sources: Sequence[PathLike]) -> dict[str, Any]:
    """Hash the bytes of each source file.

    Returns ``{"sha256": <combined>, "files": [[basename, sha256], ...]}`` with files
    sorted, so order of ``sources`` and the directory they live in do not matter.
    Raises FileNotFoundError for a missing file (a caller bug, never silently skipped).
    A file's digest is memoised per process and recomputed when its stat changes (and
    always for a file modified in the last two seconds).
    """
    if isinstance(sources, (str, bytes, os.PathLike)):
        raise TypeError("sources must be a sequence of paths, not a single path")
    files = sorted(
        (os.path.basename(os.fspath(p)), _file_sha256(os.path.abspath(os.fspath(p)))) for p in sources
    )
    combined = hashlib.sha256(canonical_json(files).encode()).hexdigest()
    return {"sha256": combined, "files": [list(f) for f in files]}


def make_key(
    name: str,
    spec: Mapping[str, Any],
    *,
    arch: str,
    sources: Sequence[PathLike] = (),
    options: str = "",
    versions: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Return ``(sha256 hex, components)`` for one compiled specialization.

    ``versions`` (default :func:`toolchain_versions`), ``env`` (default: the keyed subset
    of ``os.environ``, see :data:`KEYED_ENV_VARS`; a mapping passed here is filtered the
    same way) and ``host`` (default :func:`host_component`) can be overridden, e.g. to
    precompute keys for another environment or in tests. ``components`` is the exact
    JSON-able dict that was hashed; it is stored in each entry's metadata.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"kernel name must be a non-empty str (got {name!r})")
    if not isinstance(options, str):
        raise TypeError(f"options must be a str (got {type(options).__name__})")
    components: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION,
        "name": name,
        "spec": canonical_spec(spec),
        "arch": validate_arch(arch),
        "host": host_component() if host is None else str(host),
        "sources": hash_sources(sources),
        "versions": toolchain_versions() if versions is None else {str(k): str(v) for k, v in versions.items()},
        "options": options,
        "env": keyed_env(env),
    }
    digest = hashlib.sha256(canonical_json(components).encode("ascii")).hexdigest()
    return digest, components

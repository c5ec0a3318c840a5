"""Memory + disk cache of compiled kernel specializations; imports neither kernels nor planners.

Public API (everything else is internal):

- :class:`CompileCache` -- ``get_or_build``, ``get_or_build_result``, ``lookup``,
  ``cache_info``, ``entries``, ``clear``, ``freeze`` / ``frozen``.
- :func:`default_cache` / :func:`reset_default_cache` -- the process-wide instance.
- :func:`make_key` -- ``(sha256 hex, components)`` of one specialization.
- :class:`CompileCacheMiss` (a RuntimeError) and :class:`CompileCacheWarning`.

- :func:`format_entries` -- the human-readable listing of the disk entries.

``python -m kquant_cute.compile_cache --list`` prints the disk entries. Module layout:
``keys`` (what is keyed), ``store`` (files on disk), ``cache`` (policy), ``listing`` (the
entry listing both CLIs print), ``__main__`` (CLI).
Importing this package imports neither torch nor cutlass.
"""

from .cache import (
    CacheInfo,
    CacheResult,
    CompileCache,
    CompileCacheMiss,
    CompileCacheWarning,
    default_cache,
    parse_freeze_env,
    reset_default_cache,
    resolve_cache_dir,
)
from .keys import CACHE_FORMAT_VERSION, KEYED_ENV_VARS, hash_sources, make_key, toolchain_versions
from .listing import format_entries

__all__ = [
    "CACHE_FORMAT_VERSION",
    "KEYED_ENV_VARS",
    "CacheInfo",
    "CacheResult",
    "CompileCache",
    "CompileCacheMiss",
    "CompileCacheWarning",
    "default_cache",
    "format_entries",
    "hash_sources",
    "make_key",
    "parse_freeze_env",
    "reset_default_cache",
    "resolve_cache_dir",
    "toolchain_versions",
]

"""The KQUANT_* environment, checked once at startup: one configuration error for all of it.

Owns only the composition: each variable's rule belongs to its reader (the compile cache
reads ``KQUANT_COMPILE_CACHE_DIR`` / ``KQUANT_COMPILE_FREEZE``, the planners the
``KQUANT_W4A16_PREFILL_*`` knobs); :func:`check_environment` asks every reader and raises
one :class:`ConfigurationError` naming every invalid variable, so a serving process fails
at startup (``MoELayer``, ``kquant-compile``) instead of reporting a bad value later as,
say, a compile failure of the decode specialization. A ``KQUANT_*`` name nobody reads
(a typo such as ``KQUANT_COMPILE_FREZE``) gets one warning with the closest known name.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Optional

from .compile_cache import cache as _cache
from .planners import plans as _plans

__all__ = ["KNOWN_VARIABLES", "ConfigurationError", "check_environment"]

#: Every KQUANT_* variable something in this package (or its test suite) reads.
KNOWN_VARIABLES = (
    _cache.ENV_DIR,
    _cache.ENV_FREEZE,
    _plans.ENV_PREFILL_BLOCK_M,
    _plans.ENV_PREFILL_MIN_M,
    "KQUANT_PREWARMED_CACHE_DIR",  # tests/test_gpu_moe.py: a cache filled on a CPU machine
    "KQUANT_FUZZ_SEED",  # tests/test_gpu_fuzz.py
    "KQUANT_FUZZ_CASES",  # tests/test_gpu_fuzz.py
)


class ConfigurationError(ValueError):
    """One or more KQUANT_* environment variables are invalid (all listed in the message)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid kquant environment: " + "; ".join(self.problems))


def check_environment(environ: Optional[Mapping[str, str]] = None, *, cache: bool = True,
                      plans: bool = True, plan_environ: Optional[Mapping[str, str]] = None) -> None:
    """Validate the KQUANT_* variables of ``environ`` (default ``os.environ``).

    ``cache``: check the compile-cache variables (skip them when the caller brings its own
    :class:`~kquant_cute.compile_cache.CompileCache`, which never reads them). ``plans``:
    check the plan knobs, read from ``plan_environ`` when given (``MoELayer(environ=...)``).
    Raises :class:`ConfigurationError` listing every invalid variable.
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    if cache:
        for check in (_cache.resolve_cache_dir, _cache.parse_freeze_env):
            try:
                check(env)
            except ValueError as exc:
                problems.append(str(exc))
    if plans:
        try:
            _plans.resolve_env(env if plan_environ is None else plan_environ)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigurationError(problems)
    for name in sorted(n for n in env if n.startswith("KQUANT_") and n not in KNOWN_VARIABLES):
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(f"{name} is set but no kquant component reads it{hint}", RuntimeWarning,
                      stacklevel=2)

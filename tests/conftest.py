"""Shared pytest setup: the `gpu` marker skips with a reason when no CUDA GPU is present,
and the repository root is kept off `sys.path`.

The root holds the `kernels/`, `planners/` and `compile_cache/` directories, which the
installed package exposes only as `kquant_cute.kernels` and so on. `python -m pytest` puts
the working directory (the root) first on `sys.path`, where `kernels/` would shadow Hugging
Face's `kernels` package: transformers >= 5.25 depends on that package and imports it from
`transformers.integrations.hub_kernels`, which then fails. The tests import the installed
package, so the root is not needed there.
"""

import os
import sys

import pytest

_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))


def _is_root(entry: str) -> bool:
    return os.path.realpath(entry or os.curdir) == _ROOT


sys.path[:] = [p for p in sys.path if not _is_root(p)]


def _gpu_reason():
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a declared dependency
        return f"torch unavailable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (run with -m gpu on a GPU host)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

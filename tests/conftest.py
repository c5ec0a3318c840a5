"""Shared pytest setup: the `gpu` marker skips with a reason when no CUDA GPU is present."""

import pytest


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

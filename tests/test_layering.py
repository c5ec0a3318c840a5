"""The dependency direction of docs/CONTRIBUTING.md, checked on the source tree.

kernels/ imports nothing from the API package; planners/ asks only kernels/; the kernels'
torch-free modules (format constants, arch table, launch contract) import neither torch
nor cutlass; the cache key hashes the kernel sources only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in a file (level > 0: relative)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
    return out


@pytest.mark.parametrize("path", sorted((REPO / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_from_the_api_package(path):
    for level, module in _imports(path):
        assert not (level == 0 and module.split(".")[0] == "kquant_cute"), (path.name, module)
        assert level <= 1, (path.name, module)  # nothing above kernels/


@pytest.mark.parametrize("path", sorted((REPO / "planners").glob("*.py")), ids=lambda p: p.name)
def test_planners_ask_only_kernels(path):
    for level, module in _imports(path):
        assert not (level == 0 and module.split(".")[0] in ("kquant_cute", "torch", "cutlass")), module
        if level == 2:
            assert module.startswith("kernels."), (path.name, module)
            assert module in ("kernels.arch", "kernels.launch", "kernels.format"), module


def test_kernel_contract_modules_are_torch_and_cutlass_free():
    code = ("import sys, kquant_cute.kernels.format, kquant_cute.kernels.arch, "
            "kquant_cute.kernels.launch, kquant_cute.planners;"
            "assert not {'torch', 'cutlass'} & {m.split('.')[0] for m in sys.modules}")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_key_hashes_kernel_sources_only():
    from kquant_cute.compiler import source_files

    files = [Path(f) for f in source_files()]
    assert {f.parent.name for f in files} == {"kernels"}
    assert {f.name for f in files} >= {"moe.py", "trellis_gemm.py", "format.py", "launch.py",
                                       "build.py"}

"""The README's Python blocks run as pasted.

Every fenced ``python`` block of README.md is one of two kinds: a CPU block, which this
test runs in a fresh interpreter (its own process, an empty working directory, a compile
cache of its own) on any machine; or a GPU block, marked by an ``<!-- gpu -->`` line right
above its fence, which is compiled here and must define every name it uses, and which the
`gpu` test runs on a CUDA machine.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GPU_MARK = "<!-- gpu -->"
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def blocks() -> list[tuple[str, int, str]]:
    """(kind, line, code) of every python block: kind "gpu" when the line before the
    fence is the GPU mark, else "cpu"."""
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, m.start()) + 1
        out.append(("gpu" if before == GPU_MARK else "cpu", line, m.group(1)))
    return out


def undefined_names(code: str) -> set[str]:
    """Names a block loads that nothing in it (assignment, import, def, loop, with,
    comprehension, argument, except) binds and that are not builtins."""
    tree = ast.parse(code)
    bound: set[str] = set(dir(builtins))
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound


def _ids(items):
    return [f"line{line}" for _, line, _ in items]


CPU = [b for b in blocks() if b[0] == "cpu"]
GPU = [b for b in blocks() if b[0] == "gpu"]


def test_the_readme_has_both_kinds_of_block():
    # The quick start, CUDA graphs and the QSRT serving example need a GPU; planning,
    # the reference, EXL3 and QSRT loading run anywhere.
    assert len(CPU) >= 3 and len(GPU) >= 3, (len(CPU), len(GPU))


def test_the_name_check_catches_an_undefined_name():
    assert undefined_names("import torch\nout = layer(x, torch.ones(1))\n") == {"layer", "x"}
    assert undefined_names("import os\nfor p in os.listdir('.'):\n    print([q for q in p])\n") == set()


@pytest.mark.parametrize(("kind", "line", "code"), CPU + GPU, ids=_ids(CPU + GPU))
def test_block_compiles_and_defines_every_name(kind, line, code):
    compile(code, f"README.md:{line}", "exec")
    assert undefined_names(code) == set(), f"README.md:{line} ({kind} block)"


def _run(code: str, line: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KQUANT_")}
    env["KQUANT_COMPILE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"README.md:{line}\n{proc.stdout}\n{proc.stderr}"
    assert list(work.iterdir()) == [], f"README.md:{line} left files in its working directory"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "line", "code"), CPU, ids=_ids(CPU))
def test_cpu_block_runs_as_pasted(kind, line, code, tmp_path):
    proc = _run(code, line, tmp_path)
    assert proc.stdout.strip(), f"README.md:{line} printed nothing"


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "line", "code"), GPU, ids=_ids(GPU))
def test_gpu_block_runs_as_pasted(kind, line, code, tmp_path):
    args = []
    if "sys.argv[1]" in code:  # the QSRT example: a small synthetic checkpoint directory
        from kquant_cute import qsrt

        root = tmp_path / "checkpoint"
        qsrt.write_layer(root, qsrt.random_layer(3, qsrt.Geometry(16, 512, 1024), seed=0))
        args.append(str(root))
    _run(code, line, tmp_path, *args)

"""Size limits: no function of 80 lines or more, no module over 500 lines, in recipe/, rollout/ and megatron_workers/.

Contract: a newcomer can read any function on one screen and any module in one sitting. A function's length is
`end_lineno - lineno` of its `def` (decorators and docstring included, as the project's hook measures); a module's is
its line count. Split a long one by job (a new module with a docstring), not by cutting it anywhere.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("recipe", "rollout", "megatron_workers")
MAX_FUNCTION_LINES = 80  # end_lineno - lineno must stay below this
MAX_MODULE_LINES = 500


def oversized(paths: list[Path], root: Path = REPO) -> list[str]:
    """`path: N lines` for each module over MAX_MODULE_LINES and `path:line name(): N lines` for each function with
    end_lineno - lineno >= MAX_FUNCTION_LINES, in the .py files under `paths`."""
    found = []
    for path in sorted(f for p in paths for f in p.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root)
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{rel}: {n} lines (module, limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno) >= MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}(): {n} lines (function, limit {MAX_FUNCTION_LINES})")
    return found


def test_no_long_function_or_module():
    """Contract: every function in the packages is under 80 lines and every module at most 500 lines."""
    found = oversized([REPO / p for p in PACKAGES])
    assert not found, "split these by job:\n" + "\n".join(found)


def test_a_long_function_and_module_are_found(tmp_path):
    """Contract: the check can fail: an 80-line function and a 501-line module are reported, named."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (tmp_path / "long_fn.py").write_text(f"def long():\n{body}    return 0\n")
    (tmp_path / "long_mod.py").write_text("x = 0\n" * 501)
    assert oversized([tmp_path], root=tmp_path) == ["long_fn.py:1 long(): 80 lines (function, limit 80)",
                                                    "long_mod.py: 501 lines (module, limit 500)"]

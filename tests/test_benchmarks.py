"""Benchmarks that cannot rot: every module in benchmarks/ runs in `--smoke` mode (tiny sizes, the real
code path) and ends with one JSON line holding the keys it declares in `RESULT_KEYS`.

The modules are found by listing the folder, so a new benchmark is covered as soon as it is added.
No timing is asserted: a benchmark measures, a test only checks that it still runs end to end.
"""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRATCH_PREFIXES = ("polyturn-bench-", "async-training-", "rollout-overlap-")  # the benchmarks' temp dirs
BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")


def declared_keys(path: Path) -> tuple[str, ...]:
    """The module's `RESULT_KEYS = (...)`, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RESULT_KEYS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{path.relative_to(REPO)} declares no RESULT_KEYS; add `RESULT_KEYS = (...)`, the keys "
                         "of the JSON object its last stdout line prints")


def benchmark_scratch() -> list[Path]:
    """The temp dir's entries named like the benchmarks' scratch directories (their `mkdtemp` prefixes)."""
    return [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(SCRATCH_PREFIXES)]


def test_benchmarks_found():
    """The folder listing finds the benchmarks the docs quote (so an empty glob cannot pass silently)."""
    assert {"rollout_overlap", "train_step", "weight_sync"} <= {p.stem for p in BENCHMARKS}


@pytest.mark.integration
@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_smoke(path: Path):
    """`python -m benchmarks.<name> --smoke` exits 0 and its last stdout line is a JSON object with every
    RESULT_KEYS key, each a finite number; it leaves none of its scratch directories behind (a full-size run's
    can be gigabytes: leaked ones once filled the disk CI installs on)."""
    keys = declared_keys(path)
    scratch_before = set(benchmark_scratch())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{path.stem}", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{path.stem} --smoke exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"{path.stem} --smoke printed nothing on stdout; stderr:\n{proc.stderr[-2000:]}"
    result = json.loads(lines[-1])
    missing = [k for k in keys if k not in result]
    assert not missing, f"{path.stem}: last line lacks {missing}: {lines[-1]}"
    bad = {k: result[k] for k in keys if not (isinstance(result[k], (int, float)) and math.isfinite(result[k]))}
    assert not bad, f"{path.stem}: non-numeric or non-finite figures {bad}"
    left = sorted(set(benchmark_scratch()) - scratch_before)
    assert not left, f"{path.stem} left its scratch directories behind: {left}"

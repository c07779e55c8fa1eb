"""No dead code: vulture finds no unused function, class, method, attribute, variable or import in the packages.

Contract: every name defined in recipe/, rollout/, megatron_workers/, cpu_standins/, benchmarks/ and scripts/ is
used by the code itself (uses in tests/ do not count: code only tests call is dead) or is listed, with who reads
it, in tests/vulture_whitelist.py (Megatron, Ray, pydantic, SGLang's plug-in entry point, plug-ins loaded by dotted
path). Confidence 60, vulture's lowest: unused functions, classes, methods and attributes are only ever reported at
60% (a name may be reached dynamically), so any higher threshold would see only unused imports, variables and
unreachable code, and miss the dead methods this test exists for; the whitelist answers the dynamic reads.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("recipe", "rollout", "megatron_workers", "cpu_standins", "benchmarks", "scripts")
WHITELIST = Path(__file__).with_name("vulture_whitelist.py")
MIN_CONFIDENCE = 60


def dead_code(paths: list[Path]) -> list[str]:
    """vulture's findings over `paths` (with the whitelist) at MIN_CONFIDENCE, as `path:line: message` lines."""
    from vulture import Vulture

    v = Vulture()
    v.scavenge([str(p) for p in paths] + [str(WHITELIST)])
    return [f"{os.path.relpath(item.filename, REPO)}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)"
            for item in v.get_unused_code(min_confidence=MIN_CONFIDENCE)]


def test_no_dead_code():
    """Contract: vulture reports nothing in the packages; each finding is removed, or whitelisted naming its reader."""
    found = dead_code([REPO / p for p in PACKAGES])
    assert not found, "dead code (remove it, or add it to tests/vulture_whitelist.py saying who reads it by name):\n" + \
        "\n".join(found)


def test_an_unused_function_is_found(tmp_path):
    """Contract: the check can fail: a module with a function nobody calls is reported, naming the function."""
    (tmp_path / "mod.py").write_text("def used():\n    return 1\n\n\ndef unused():\n    return 2\n\n\nprint(used())\n")
    found = dead_code([tmp_path])
    assert len(found) == 1 and "mod.py:5: unused function 'unused'" in found[0]

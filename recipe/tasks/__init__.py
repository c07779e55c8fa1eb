"""Tasks, one file each (nanochat's `tasks/`): a task's data sources, its rows in verl's format, and its scorer.

A task module here declares `DATA_SOURCES` (the `data_source` values of its rows) and defines
`compute_score(solution_str, ground_truth, **reward_kwargs)` returning a float or a dict with
"score". The outcome reward finds the scorer of each row's data source by scanning this package
(`scorer_paths`), and loads it by dotted path through the one plug-in loader
(`rollout.plugins.import_object`): adding a task is adding a file here, nothing else to edit.
A task whose rows are scored by another task's scorer (synthetic_math: GSM8K's) declares no
`DATA_SOURCES`; one may also declare `DATA_SOURCE_PREFIXES` (verl scores every source starting with
`aime` as DAPO math), listed as `prefix*`. `VERL_ALIASES` in a task module maps verl's paths of its
parts (verl's `reward_score.<task>.compute_score`) onto them, for the plug-in YAML verl users bring
(`verl_aliases`).

The sources verl's `default_compute_score` (v0.9) scores and polyturn does not are in `NO_SCORER`, with
the reason; `missing_scorer_problems` is the one wording of "no scorer" the launch check and the
reward function both give.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any


def task_modules() -> Iterator[ModuleType]:
    """Every task module of this package, imported."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        yield importlib.import_module(f"{__name__}.{info.name}")


NO_SCORER: dict[tuple[str, ...], str] = {
    ("codecontests", "apps", "codeforces", "taco"):
        "verl runs the response's code on the row's test cases, in sandbox_fusion or with prime_code",
    ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
     "numina_olympiads"):
        "verl grades them with PRIME's symbolic checker (sympy and pylatexenc, under timeouts), not built here",
    ("hiyouga/geometry3k",):
        "verl scores them with mathruler's symbolic grader (an extra dependency) on image-and-text rows",
}
"""verl's default_compute_score sources polyturn has no scorer for -> why (said at launch)."""


def scorer_paths() -> dict[str, str]:
    """data_source (or `prefix*`) -> dotted path of the scorer of the task that declares it; a source two tasks
    could both claim (the same one, or one a prefix covers) is refused."""
    paths: dict[str, str] = {}
    for module in task_modules():
        path = f"{module.__name__}.compute_score"
        keys = [*getattr(module, "DATA_SOURCES", ()), *(f"{p}*" for p in getattr(module, "DATA_SOURCE_PREFIXES", ()))]
        for key in keys:
            clash = next((k for k in paths if _overlap(k, key)), None)
            if clash is not None:
                raise ValueError(f"data_source {key!r} of {path} overlaps {clash!r} of {paths[clash]}; keep each "
                                 "source in the DATA_SOURCES (or DATA_SOURCE_PREFIXES) of one task")
            paths[key] = path
    return paths


def _overlap(a: str, b: str) -> bool:
    """Whether some data_source matches both keys (`source` or `prefix*`)."""
    if a.endswith("*") and b.endswith("*"):
        return a[:-1].startswith(b[:-1]) or b[:-1].startswith(a[:-1])
    if b.endswith("*"):
        a, b = b, a
    return b.startswith(a[:-1]) if a.endswith("*") else a == b


def scorer_of(source: str, paths: dict[str, str]) -> str | None:
    """The scorer path `paths` (`scorer_paths()`) gives `source`: its own entry, else a `prefix*` covering it."""
    if source in paths:
        return paths[source]
    return next((p for k, p in paths.items() if k.endswith("*") and source.startswith(k[:-1])), None)


def missing_scorer_problems(sources: Iterable[str], paths: dict[str, str], where: str) -> list[str]:
    """One line per group of `sources` without a scorer: verl's (`NO_SCORER`, naming why), then the unknown ones.

    `where` names the sources' origin (e.g. "in data.train_files / data.val_files").
    """
    missing = sorted({s for s in sources if scorer_of(s, paths) is None})
    fix = "set custom_reward_function.path=<file.py> with your own compute_score"
    lines = []
    for group, why in NO_SCORER.items():
        hit = [s for s in missing if s in group]
        if hit:
            lines.append(f"data_source {hit} {where}: polyturn has no scorer for these ({why}); {fix}")
    unknown = [s for s in missing if not any(s in group for group in NO_SCORER)]
    if unknown:
        lines.append(f"data_source {unknown} {where} has no outcome scorer (known: {sorted(paths)}); {fix}, or add a "
                     "task (a module in recipe/tasks/ with the source in DATA_SOURCES)")
    return lines


def verl_aliases() -> dict[str, str]:
    """verl's dotted paths of the tasks' parts -> the tasks' own (every task's `VERL_ALIASES`)."""
    return {verl: ours for module in task_modules() for verl, ours in getattr(module, "VERL_ALIASES", {}).items()}


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write rows to a parquet file; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return len(rows)

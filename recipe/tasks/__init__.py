"""Tasks, one file each (nanochat's `tasks/`): a task's data sources, its rows in verl's format, and its scorer.

A task module here declares `DATA_SOURCES` (the `data_source` values of its rows) and defines
`compute_score(solution_str, ground_truth, **reward_kwargs)` returning a float or a dict with
"score". The outcome reward finds the scorer of each row's data source by scanning this package
(`scorer_paths`), and loads it by dotted path through the one plug-in loader
(`rollout.plugins.import_object`): adding a task is adding a file here, nothing else to edit.
A task whose rows are scored by another task's scorer (synthetic_math: GSM8K's) declares no
`DATA_SOURCES`. `VERL_ALIASES` in a task module maps verl's paths of its parts (verl's
`reward_score.<task>.compute_score`) onto them, for the plug-in YAML verl users bring
(`verl_aliases`).
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


def scorer_paths() -> dict[str, str]:
    """data_source -> dotted path of the scorer of the task that declares it; a source declared twice is refused."""
    paths: dict[str, str] = {}
    for module in task_modules():
        for source in getattr(module, "DATA_SOURCES", ()):
            path = f"{module.__name__}.compute_score"
            if source in paths:
                raise ValueError(f"data_source {source!r} is declared by {paths[source]} and {path}; keep it in the "
                                 "DATA_SOURCES of one task")
            paths[source] = path
    return paths


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

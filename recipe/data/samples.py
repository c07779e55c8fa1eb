"""verl's `data.train_max_samples` / `data.val_max_samples`: a run reads only N of a split's prompts.

verl (RLHFDataset) keeps the first N rows, or with `data.shuffle` N rows drawn without replacement by a seeded
generator. Here the draw is seeded by trainer.seed (verl's data.seed has no effect here), and it is taken from the
prompts left after the overlong ones were dropped (verl draws first, then drops: it can end with fewer than N).
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np

T = TypeVar("T")


def take_samples(items: list[T], max_samples: int, *, shuffle: bool, seed: int) -> list[T]:
    """`max_samples` of `items` (all of them when max_samples <= 0 or >= len): the first ones, or with `shuffle` a
    seeded draw without replacement, kept in the drawn order (as verl's `select(indices)`)."""
    if max_samples <= 0 or max_samples >= len(items):
        return items
    if not shuffle:
        return items[:max_samples]
    chosen = np.random.default_rng(seed).choice(len(items), size=max_samples, replace=False)
    return [items[i] for i in chosen.tolist()]

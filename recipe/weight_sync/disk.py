"""The disk path (fallback and benchmark baseline): the actor writes an HF checkpoint that every engine reloads.

The directory must be reachable from the engines' nodes. With the check on, the ranks then export their tensors
once more, shipping nothing, for the checksums the engines are compared against.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time

from megatron_workers.sync_plan import Copy, SyncPlan
from recipe.weight_sync.base import Sent, SyncPath, each_engine


class DiskSync(SyncPath):
    """`disk_dir`: where the checkpoint goes, overwritten by each sync (default: a temp dir made by `connect`)."""

    def __init__(self, group, engines, *, tensor_copies: tuple[Copy, ...] | None = None,
                 disk_dir: str | None = None) -> None:
        super().__init__(group, engines)
        self.disk_dir = disk_dir

    def connect(self) -> None:
        if self.disk_dir is None:
            self.disk_dir = tempfile.mkdtemp(prefix="polyturn-wsync-")

    def update(self, version: int, plan: SyncPlan) -> Sent:
        self.group.export_hf(self.disk_dir)
        t0 = time.perf_counter()
        each_engine(self.engines, lambda e: e.update_weights_from_disk(self.disk_dir, weight_version=version))
        results = self.group.send_weights(dataclasses.replace(plan, transport="none")) if plan.checksums else []
        return results, time.perf_counter() - t0

"""The distributed path (separate placement, or across nodes): each bucket broadcast over a process group.

`connect` makes one group per pipeline stage: the stage's sender (TP 0, DP 0) is rank 0, then every engine TP
rank (engine i's at offset 1 + the TP sizes of the engines before it). `update` ships the stages one after
another, inside one weight-update session per engine: an engine serves one update at a time, so two stages
broadcasting at once could each hold an engine the other's group waits for.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from megatron_workers.sync_plan import SyncPlan
from recipe.weight_sync.base import Sent, SyncPath, each_engine, in_session

logger = logging.getLogger(__name__)


class DistributedSync(SyncPath):
    """`groups`: {pipeline stage: process-group name} once connected, else None."""

    groups: dict[int, str] | None = None

    def connect(self) -> None:
        world = 1 + sum(e.tp_size for e in self.engines)
        offsets = [1 + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        tag = uuid.uuid4().hex[:8]
        groups = {a.stage: dataclasses.replace(a, world_size=world, group_name=f"polyturn-wsync-{tag}-stage{a.stage}")
                  for a in self.group.weight_sync_endpoints()}
        joins = [(e, g, off) for g in groups.values() for e, off in zip(self.engines, offsets)]
        pool = ThreadPoolExecutor(len(joins), thread_name_prefix="wsync-join")  # each join blocks until all joined
        try:
            joined = [pool.submit(e.init_weights_update_group, g.address, g.port, off, world, g.group_name, g.backend)
                      for e, g, off in joins]
            self.group.init_weight_sync_groups(groups)
            for j in joined:
                j.result()
        finally:
            pool.shutdown(wait=False)  # after a failure, joins still waiting end with their group's timeout
        self.groups = {s: g.group_name for s, g in groups.items()}
        logger.info("weight sync: %d process group(s) of %d ranks (%s)", len(groups), world,
                    ", ".join(f"stage {s} at {g.address}:{g.port}" for s, g in groups.items()))

    def update(self, version: int, plan: SyncPlan) -> Sent:
        def send() -> list:
            return [r for stage, name in self.groups.items()
                    for r in self.group.send_weights(dataclasses.replace(plan, transport="distributed",
                                                                         groups={stage: name}))]
        return in_session(self.engines, version, send)

    def disconnect(self, restarted: Sequence = ()) -> None:
        """Tear the groups down on the senders and on the engines still in them (not the `restarted` ones)."""
        live = [e for e in self.engines if e not in restarted]
        for name in self.groups.values():
            each_engine(live, lambda e: e.destroy_weights_update_group(name))
        self.group.destroy_weight_sync_groups()
        self.groups = None

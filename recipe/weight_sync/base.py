"""What every weight-sync path is: `SyncPath`, and the two helpers the paths share.

A path moves the actor's weights into the engines one way. It is built once, from the config
(`actor_rollout_ref.rollout.update_weights_mode`, see `recipe.weight_sync.PATHS`), and has the same
two methods as every other: `connect` (make what the path needs to reach the engines: process
groups, a directory; the facade calls it before the first sync and again after `disconnect`) and
`update` (sync one version). The driver only sends small control messages: typed calls on the
worker group (`MegatronWorkerGroup.send_weights(SyncPlan)`, ...) and on the engines (`EngineClient`);
buckets go from the training ranks straight to the engines.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_workers.sync_plan import Copy, SyncPlan

if TYPE_CHECKING:  # the driver's handles; this package imports neither Ray nor torch (the config imports it)
    from megatron_workers.worker_group import MegatronWorkerGroup
    from rollout.engines.engine_actor import EngineClient

T = TypeVar("T")

#: What `SyncPath.update` returns: every actor rank's metrics (None where it shipped nothing), and the seconds the
#: weights took to move (the path's control calls around them not counted).
Sent = tuple[list[dict[str, Any] | None], float]


class WeightSyncError(RuntimeError):
    """An engine serves weights that differ from the trainer's after a sync."""


class SyncPath:
    """One way to move the actor's weights into the engines; a subclass per path.

    `tensor_copies` and `disk_dir` are the options of the paths that read them (`TensorSync`, `DiskSync`); the
    others ignore them.
    """

    def __init__(self, group: MegatronWorkerGroup, engines: list[EngineClient], *,
                 tensor_copies: tuple[Copy, ...] | None = None, disk_dir: str | None = None) -> None:
        self.group, self.engines = group, engines

    def connect(self) -> None:
        """Make what this path needs to reach the engines (before its first sync, and after `disconnect`)."""

    def update(self, version: int, plan: SyncPlan) -> Sent:
        """Move the actor's weights into every engine, which then serves them under `version`. `plan` holds what
        every path shares (key, bucket size, dtype, checksums, engine handles); the path sets its transport."""
        raise NotImplementedError

    def disconnect(self, restarted: Sequence[EngineClient] = ()) -> None:
        """Undo `connect` (`restarted`: engines restarted since, which hold nothing of it any more)."""


def each_engine(engines: Sequence[EngineClient], call: Callable[[EngineClient], T]) -> list[T]:
    """`call(engine)` for every engine at once (each blocks on its own actor); results in engine order."""
    if len(engines) <= 1:
        return [call(e) for e in engines]
    with ThreadPoolExecutor(len(engines), thread_name_prefix="engine-call") as pool:
        return list(pool.map(call, engines))


def in_session(engines: Sequence[EngineClient], version: int, send: Callable[[], list[Any]]) -> Sent:
    """Run `send()` inside a weight-update session on every engine: opened first, closed under `version` (prefix
    cache flushed) when it returns, closed under the old version when it raises."""
    each_engine(engines, lambda e: e.begin_weight_update())
    t0 = time.perf_counter()
    try:
        results = send()
    except BaseException:
        each_engine(engines, lambda e: e.end_weight_update())
        raise
    seconds = time.perf_counter() - t0
    each_engine(engines, lambda e: e.finish_weight_update(version))
    return results, seconds

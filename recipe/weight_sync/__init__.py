"""One weight sync, Megatron actor -> every rollout engine, orchestrated from the driver with plain data.

`WeightSync` is what the trainer holds: it builds the path the config names (`PATHS`, keyed by
`actor_rollout_ref.rollout.update_weights_mode`) once, connects it before the first sync, and per sync
gives it a `megatron_workers.sync_plan.SyncPlan`; the path opens a weight-update session on every
engine, asks the actor ranks to stream their weights (buckets go straight from the training ranks to
the engine actors, see `megatron_workers.weights`), then flushes each engine's prefix cache and closes
the session under the new version. The paths, one module each:

- `tensor.TensorSync`: serialized handles per engine TP rank, made on that rank's GPU (colocated / hybrid
  placement; with PP > 1 the other stages' buckets are relayed there first);
- `distributed.DistributedSync`: a broadcast over a process group per pipeline stage that every engine
  TP rank joins (separate placement, or across nodes);
- `disk.DiskSync`: an HF checkpoint that every engine reloads (fallback and baseline).

A new path is a module with a `base.SyncPath` subclass and one line in `PATHS`.

With `check=True`, every sync ends with a probe: the senders' float64 sum / abs-sum / sum of
squares of each HF tensor they sent against the same statistics of what each engine serves
(`rollout.engines.weight_probe`); a mismatch raises `WeightSyncError` naming the engine and the
tensors, so the trainer stops before it samples from a wrong policy.

This package imports neither Ray nor torch: the config imports `MODES` from it.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_workers.sync_plan import Copy, SyncPlan
from recipe.weight_sync.base import SyncPath, WeightSyncError, each_engine
from recipe.weight_sync.disk import DiskSync
from recipe.weight_sync.distributed import DistributedSync
from recipe.weight_sync.tensor import TensorSync
from rollout.engines.weight_probe import mismatches

if TYPE_CHECKING:
    from rollout.engines.engine_actor import EngineClient

__all__ = ["MODES", "PATHS", "SyncPath", "WeightSync", "WeightSyncError"]

#: The sync paths, by `actor_rollout_ref.rollout.update_weights_mode`.
PATHS: dict[str, type[SyncPath]] = {"tensor": TensorSync, "distributed": DistributedSync, "disk": DiskSync}
MODES = tuple(PATHS)


class WeightSync:
    """Syncs `actor_group`'s weights into `engines` (EngineClient handles) by the path `mode` names."""

    def __init__(self, actor_group: Any, engines: list[EngineClient], *, mode: str, bucket_bytes: int,
                 engine_dtype: str, check: bool, tensor_copies: tuple[Copy, ...] | None = None,
                 disk_dir: str | None = None) -> None:
        """`tensor_copies` (tensor path): `PlacementPlan.tensor_copies`, see `TensorSync`; `disk_dir` (disk
        path): where the checkpoint goes (default: a temp dir made at the first sync and overwritten by each)."""
        if mode not in PATHS:
            raise ValueError(f"actor_rollout_ref.rollout.update_weights_mode={mode!r} is not one of {MODES}")
        if not engines:
            raise ValueError("WeightSync needs at least one engine; the placement plan starts one per "
                             "actor_rollout_ref.rollout.tensor_model_parallel_size GPUs of the rollout pool")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1; raise "
                             "actor_rollout_ref.rollout.update_weights_bucket_megabytes")
        self.engines, self.mode = list(engines), mode
        self.bucket_bytes, self.engine_dtype, self.check = bucket_bytes, engine_dtype, check
        self.path = PATHS[mode](actor_group, self.engines, tensor_copies=tensor_copies, disk_dir=disk_dir)
        self._connected = False
        self.expected: dict[str, list[float]] = {}  # senders' checksums of the last checked sync, by HF name

    def sync(self, version: int, *, check: bool | None = None) -> dict[str, float]:
        """Push the actor's weights into every engine under `version`; returns `weight_sync/*` metrics.

        Raises WeightSyncError (with check=True; `check` None: the constructor's) naming any engine tensor that
        differs from the sender's.
        """
        check = self.check if check is None else check
        t0 = time.perf_counter()
        if not self._connected:
            self.path.connect()
            self._connected = True
        plan = SyncPlan(transport="none", key=f"v{version}-{uuid.uuid4().hex[:8]}", bucket_bytes=self.bucket_bytes,
                        dtype=self.engine_dtype, checksums=check, engines=tuple(e.handle for e in self.engines))
        results, send_s = self.path.update(version, plan)
        each_engine(self.engines, lambda e: e.refresh())
        stale = [e.name for e in self.engines if e.weight_version != version]
        if stale:
            raise WeightSyncError(f"engines {stale} do not serve weight version {version} after the sync")
        sent = [r for r in results if r]
        metrics = {
            "weight_sync/seconds": time.perf_counter() - t0,
            "weight_sync/send_seconds": send_s,
            "weight_sync/bytes": float(sum(r["bytes"] for r in sent)),
            "weight_sync/buckets": float(sum(r["buckets"] for r in sent)),
            "weight_sync/relayed_bytes": float(sum(r.get("relayed_bytes", 0.0) for r in sent)),  # tensor path, PP>1
            "weight_sync/peak_extra_mb": max((r["peak_extra_bytes"] for r in sent), default=0.0) / 2**20,
        }
        if check:
            t_check = time.perf_counter()
            self.expected = {k: v for r in sent for k, v in r["stats"].items()}
            self.verify()
            metrics["weight_sync/check_seconds"] = time.perf_counter() - t_check
        return metrics

    def verify(self, engines: list[EngineClient] | None = None) -> None:
        """Compare what `engines` (default: all) serve with the last checked sync's checksums; raise
        WeightSyncError naming the engine and the stale or corrupted tensors."""
        if not self.expected:
            raise RuntimeError("no checksums to verify against: run sync() with check=True first")
        engines = self.engines if engines is None else engines
        for engine, served in zip(engines, each_engine(engines, lambda e: e.weight_checksums())):
            bad = mismatches(self.expected, served)
            if bad:
                raise WeightSyncError(
                    f"engine {engine.name} serves {len(bad)} tensor(s) that differ from the trainer's after the "
                    f"sync (stale or corrupted): {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; "
                    "stop and check the weight-sync path (actor_rollout_ref.rollout.update_weights_mode)")

    def forget_groups(self, restarted: Sequence[EngineClient]) -> None:
        """After `restarted` engines were restarted (fresh actors, in no process group): disconnect the path from
        the others, so that the next sync connects every engine anew."""
        if self._connected:
            self.path.disconnect(restarted)
            self._connected = False

    def close(self) -> None:
        """Disconnect the path (the distributed path's process groups, on engines and senders)."""
        self.forget_groups(())

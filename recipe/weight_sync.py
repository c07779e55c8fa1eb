"""One weight sync, Megatron actor -> every rollout engine, orchestrated from the driver with plain data.

The driver only sends small control messages: it opens a weight-update session on every
engine, asks the actor ranks to stream their weights (`MegatronActor.send_weights`; buckets go
straight from the training ranks to the engine actors, see `megatron_workers.weights`), then, in one
call per engine, flushes its prefix cache and closes the session under the new version. Paths:

- "tensor": serialized handles per engine TP rank (colocated / hybrid placement);
- "distributed": a broadcast over a process group per pipeline stage that every engine TP rank
  joins (separate placement, or across nodes); the groups are made once, on the first sync, and the
  stages ship one after another;
- "disk": the actor writes an HF checkpoint that every engine reloads (fallback and baseline;
  the directory must be reachable from the engines' nodes).

With `check=True`, every sync ends with a probe: the senders' float64 sum / abs-sum / sum of
squares of each HF tensor they sent against the same statistics of what each engine serves
(`rollout.engines.weight_probe`); a mismatch raises `WeightSyncError` naming the engine and the
tensors, so the trainer stops before it samples from a wrong policy.
"""
from __future__ import annotations

import logging
import tempfile
import time
import uuid
from typing import Any

import ray

from rollout.engines.engine_actor import EngineClient
from rollout.engines.weight_probe import mismatches

logger = logging.getLogger(__name__)

MODES = ("tensor", "distributed", "disk")


class WeightSyncError(RuntimeError):
    """An engine serves weights that differ from the trainer's after a sync."""


class WeightSync:
    """Syncs `actor_group`'s weights into `engines` (EngineClient handles)."""

    def __init__(self, actor_group: Any, engines: list[EngineClient], *, mode: str, bucket_bytes: int,
                 engine_dtype: str, check: bool, tensor_senders: list[list[int]] | None = None,
                 disk_dir: str | None = None) -> None:
        """`tensor_senders[i][r][s]`: the global Megatron rank that serializes pipeline stage s's weights for
        engine i's TP rank r (`PlacementPlan.tensor_senders`: the rank on that GPU); None: each stage's first
        rank (TP 0, DP 0) serializes every copy. `disk_dir`: where the disk path writes its checkpoint (default:
        a temp dir made at the first disk sync and overwritten by each)."""
        if mode not in MODES:
            raise ValueError(f"rollout.update_weights_mode={mode!r} is not one of {MODES}")
        if not engines:
            raise ValueError("WeightSync needs at least one engine; the placement plan starts one per "
                             "actor_rollout_ref.rollout.tensor_model_parallel_size GPUs of the rollout pool")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1; raise rollout.update_weights_bucket_megabytes")
        self.group, self.engines, self.mode = actor_group, list(engines), mode
        self.bucket_bytes, self.engine_dtype, self.check = bucket_bytes, engine_dtype, check
        self.serializers = self._serializers(tensor_senders)
        self.disk_dir = disk_dir
        self._groups: dict[int, str] | None = None  # distributed path: group name per pipeline stage
        self.expected: dict[str, list[float]] = {}  # senders' checksums of the last checked sync, by HF name

    def _serializers(self, tensor_senders: list[list[list[int]]] | None) -> dict[int, list[list[int]]]:
        """{global Megatron rank: [[engine index, engine TP rank], ...]} for the tensor path: each copy of each
        stage's weights is serialized by exactly one rank of that stage."""
        stage_of = {info.rank: info.pp_rank for info in self.group.ranks}
        stages = sorted(set(stage_of.values()))
        if tensor_senders is None:
            firsts = [min(i.rank for i in self.group.ranks if i.pp_rank == s and i.tp_rank == 0 and i.dp_rank == 0)
                      for s in stages]
            tensor_senders = [[firsts for _ in range(e.tp_size)] for e in self.engines]
        if len(tensor_senders) != len(self.engines):
            raise ValueError(f"tensor_senders has {len(tensor_senders)} entries for {len(self.engines)} engines")
        out: dict[int, list[list[int]]] = {}
        for i, (engine, per_rank) in enumerate(zip(self.engines, tensor_senders)):
            if len(per_rank) != engine.tp_size:
                raise ValueError(f"tensor_senders[{i}] lists {len(per_rank)} ranks for engine {engine.name} "
                                 f"with tp_size={engine.tp_size}")
            for r, ranks in enumerate(per_rank):
                if sorted(stage_of.get(g, -1) for g in ranks) != stages:
                    raise ValueError(f"tensor_senders[{i}][{r}]={ranks} must name one actor rank of each pipeline "
                                     f"stage {stages}")
                for g in ranks:
                    out.setdefault(g, []).append([i, r])
        return out

    def _each_engine(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([e.handle.call.remote(method, *args, **kwargs) for e in self.engines])

    def _ensure_groups(self) -> dict[int, str]:
        """Distributed path, once: one group per pipeline stage, its sender at rank 0, then the engines."""
        if self._groups is not None:
            return self._groups
        endpoints = [p for p in self.group.call_all("weight_sync_endpoint") if p]
        world = 1 + sum(e.tp_size for e in self.engines)
        offsets = [1 + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        tag = uuid.uuid4().hex[:8]
        groups = {p["stage"]: {**p, "world_size": world, "group_name": f"polyturn-wsync-{tag}-stage{p['stage']}"}
                  for p in endpoints}
        joins = [e.handle.call.remote("init_weights_update_group", g["address"], g["port"], off, world,
                                      g["group_name"], g["backend"])
                 for g in groups.values() for e, off in zip(self.engines, offsets)]
        self.group.call_all("init_weight_sync_groups", groups)
        ray.get(joins)
        self._groups = {s: g["group_name"] for s, g in groups.items()}
        logger.info("weight sync: %d process group(s) of %d ranks (%s)", len(groups), world,
                    ", ".join(f"stage {s} at {g['address']}:{g['port']}" for s, g in groups.items()))
        return self._groups

    def sync(self, version: int, *, check: bool | None = None) -> dict[str, float]:
        """Push the actor's weights into every engine under `version`; returns `weight_sync/*` metrics.

        Raises WeightSyncError (with check=True; `check` None: the constructor's) naming any engine tensor that
        differs from the sender's.
        """
        check = self.check if check is None else check
        t0 = time.perf_counter()
        plan = {"bucket_bytes": self.bucket_bytes, "dtype": self.engine_dtype, "checksums": check,
                "key": f"v{version}-{uuid.uuid4().hex[:8]}", "engines": [e.handle for e in self.engines]}
        if self.mode == "disk":
            if self.disk_dir is None:  # one directory for every sync, overwritten each time
                self.disk_dir = tempfile.mkdtemp(prefix="polyturn-wsync-")
            path = self.disk_dir
            self.group.call_all("export_hf", path)
            t_send = time.perf_counter()
            self._each_engine("update_weights_from_disk", path, weight_version=version)
            results = self.group.call_all("send_weights", {**plan, "mode": "stats"}) if check else []
            send_s = time.perf_counter() - t_send
        else:
            if self.mode == "distributed":
                plan["groups"] = self._ensure_groups()
            else:
                plan["serializers"] = self.serializers
            self._each_engine("begin_weight_update")
            t_send = time.perf_counter()
            try:
                if self.mode == "distributed":  # a stage at a time: an engine serves one update at a time, so two
                    # stages broadcasting at once can each hold an engine the other's group waits for
                    results = [r for stage, name in plan["groups"].items()
                               for r in self.group.call_all("send_weights", {**plan, "mode": self.mode,
                                                                             "groups": {stage: name}})]
                else:
                    results = self.group.call_all("send_weights", {**plan, "mode": self.mode})
            except BaseException:
                self._each_engine("end_weight_update")  # close the session; the version stays the old one
                raise
            send_s = time.perf_counter() - t_send
            self._each_engine("finish_weight_update", weight_version=version)  # flush the prefix cache, version
        for e in self.engines:
            e.refresh()
        stale = [e.name for e in self.engines if e.weight_version != version]
        if stale:
            raise WeightSyncError(f"engines {stale} do not serve weight version {version} after the sync")
        sent = [r for r in results if r]
        metrics = {
            "weight_sync/seconds": time.perf_counter() - t0,
            "weight_sync/send_seconds": send_s,
            "weight_sync/bytes": float(sum(r["bytes"] for r in sent)),
            "weight_sync/buckets": float(sum(r["buckets"] for r in sent)),
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
        for engine, served in zip(engines, ray.get([e.handle.call.remote("weight_checksums") for e in engines])):
            bad = mismatches(self.expected, served)
            if bad:
                raise WeightSyncError(
                    f"engine {engine.name} serves {len(bad)} tensor(s) that differ from the trainer's after the "
                    f"sync (stale or corrupted): {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; "
                    "stop and check the weight-sync path (rollout.update_weights_mode)")

    def forget_groups(self, restarted: list[EngineClient]) -> None:
        """After `restarted` engines were restarted (fresh actors, in no process group): tear down the distributed
        path's groups on the senders and the other engines, so that the next sync makes them anew."""
        if self._groups is None:
            return
        live = [e for e in self.engines if e not in restarted]
        for name in self._groups.values():
            ray.get([e.handle.call.remote("destroy_weights_update_group", name) for e in live])
        self.group.call_all("destroy_weight_sync_groups")
        self._groups = None

    def close(self) -> None:
        """Tear down the distributed path's process groups (engines and senders)."""
        if self._groups is None:
            return
        for name in self._groups.values():
            self._each_engine("destroy_weights_update_group", name)
        self.group.call_all("destroy_weight_sync_groups")
        self._groups = None

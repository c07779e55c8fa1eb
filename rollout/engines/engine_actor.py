"""SGLang engines as Ray actors: `EngineActor` hosts one engine, `EngineClient` is the driver's handle.

`EngineActor` is an async Ray actor: many `generate` calls run at once on its event loop (each
awaits the engine's own loop thread, see `sglang_engine.py`), and blocking control calls (weight
updates, cache flush, memory release) run in a worker thread so they never stall generation.
The actor applies SGLang's CPU adapter by the one explicit call `SGLangEngine` makes at start.

`EngineClient` satisfies `rollout.engines.base.RolloutEngine`, so the agent loop and the router
talk to it as to any engine; its typed control methods (memory, the weight-update session, process
groups, checksums) block until the actor is done. `.handle` (the Ray actor handle) is plain data:
the driver hands it to the Megatron ranks, which call the actor's receive methods (`load_payload`,
`update_weights_from_distributed`), so weight buckets go straight from the training ranks to the
engine, never through the driver.

Faults: a dead engine actor turns every call into `EngineDeadError` naming the engine (its `generate`
raises it, so the agent loop can retry elsewhere); `restart` starts a fresh actor with the same options (so on the same placement-group
bundle) and swaps it in under the same `EngineClient`, which every holder of it (router, weight sync)
then reaches. It serves weight version 0 until the trainer syncs it.

Where it departs from verl: the driver never imports SGLang; the weight version an engine serves
is read back from the actor after each sync, not tracked on the driver's side.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import ray

from rollout.engines.base import EngineDeadError, GenerateResult

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineActor:
    """Body of the Ray actor hosting one `SGLangEngine` (its scheduler in subprocesses)."""

    def __init__(self, model_path: str, name: str, weight_version: int, engine_kwargs: dict[str, Any]) -> None:
        from rollout.engines.sglang_engine import SGLangEngine

        self.engine = SGLangEngine(model_path, name=name, weight_version=weight_version, **engine_kwargs)
        self._buckets: dict[str, tuple[dict[int, bytes], asyncio.Future]] = {}  # tensor path, partly received

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        return await self.engine.generate(input_ids, sampling_params, request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def state(self) -> dict[str, int]:
        """`{"weight_version", "num_inflight", "tp_size"}`."""
        e = self.engine
        return {"weight_version": e.weight_version, "num_inflight": e.num_inflight, "tp_size": e.tp_size}

    async def _in_thread(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking `SGLangEngine` control method in a worker thread (generation keeps running)."""
        return await asyncio.to_thread(method, *args, **kwargs)

    # -- control: memory (colocated placement) -------------------------------------------------

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._in_thread(self.engine.release_memory_occupation, tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._in_thread(self.engine.resume_memory_occupation, tags)

    # -- weight sync: the session and the process groups (called by the driver, `recipe.weight_sync`) ----------

    async def begin_weight_update(self) -> None:
        await self._in_thread(self.engine.begin_weight_update)

    async def end_weight_update(self) -> None:
        """Close the session without a new version (a sync that failed)."""
        await self._in_thread(self.engine.end_weight_update)

    async def finish_weight_update(self, weight_version: int) -> None:
        await self._in_thread(self.engine.finish_weight_update, weight_version=weight_version)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        await self._in_thread(self.engine.update_weights_from_disk, path, weight_version=weight_version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        await self._in_thread(self.engine.init_weights_update_group, master_address, master_port, rank_offset,
                              world_size, group_name, backend)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._in_thread(self.engine.destroy_weights_update_group, group_name)

    async def weight_checksums(self) -> dict[str, list[float]]:
        return await self._in_thread(self.engine.weight_checksums)

    # -- weight sync: the buckets (called by the Megatron sender ranks, `megatron_workers.weights`) ------------

    async def load_payload(self, bucket_key: str, tp_rank: int, payload: bytes) -> None:
        """Tensor path: TP rank `tp_rank`'s serialized copy of bucket `bucket_key`. The bucket is loaded
        once every TP rank's copy has arrived (they may come from different sender ranks); every
        caller returns when it is loaded, so senders keep their tensors alive until then."""
        parts, done = self._buckets.setdefault(bucket_key, ({}, asyncio.get_running_loop().create_future()))
        parts[tp_rank] = payload
        if len(parts) == self.engine.tp_size:
            del self._buckets[bucket_key]
            try:
                await self._in_thread(self.engine.update_weights_from_serialized,
                                      [parts[r] for r in range(self.engine.tp_size)])
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - every waiting sender gets the engine's error
                done.set_exception(e)
        await asyncio.shield(done)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, group_name: str) -> None:
        """Distributed path: receive one flat bucket broadcast by the sender (rank 0 of `group_name`)."""
        await self._in_thread(self.engine.update_weights_from_distributed, names, dtypes, shapes,
                              group_name=group_name)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


def engine_runtime_env(ray_options: dict[str, Any]) -> dict[str, Any]:
    """`ray_options["runtime_env"]` plus what an engine process needs: the repo and this process's PYTHONPATH (the
    CPU import stand-ins, when its start applied the CPU adapter), so the actor imports them first; the actor adapts
    itself to the machine when it starts its engine (`sglang_cpu.engine_kwargs_for_this_machine`)."""
    env = dict(ray_options.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    parts = [str(_REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep), env_vars.get("PYTHONPATH", "")]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in parts if p))
    if "POLYTURN_STANDIN_LOG" in os.environ:
        env_vars.setdefault("POLYTURN_STANDIN_LOG", os.environ["POLYTURN_STANDIN_LOG"])
    env["env_vars"] = env_vars
    return env


class EngineClient:
    """Driver-side handle of one engine actor; a `RolloutEngine`."""

    def __init__(self, name: str, handle: Any, state: dict[str, int], launch_args: dict[str, Any] | None = None) -> None:
        self.name = name
        self.handle = handle  # the Ray actor handle: plain data for the Megatron sender ranks
        self.tp_size = state["tp_size"]
        self._weight_version = state["weight_version"]
        self._inflight = 0
        self._launch_args = launch_args  # `launch`'s arguments, for `restart`; None: not restartable

    @classmethod
    def launch(cls, model_path: str, *, name: str, ray_options: dict[str, Any] | None = None,
               weight_version: int = 0, ready_timeout_s: float = 600.0, **engine_kwargs: Any) -> EngineClient:
        """Start a Ray actor hosting one SGLang engine and wait until it serves.

        `ray_options` go to `.options(...)` (placement from the plan: scheduling_strategy, num_cpus,
        num_gpus, resources, runtime_env); `engine_kwargs` are `sglang.Engine` kwargs (tp_size,
        base_gpu_id, dtype, max_total_tokens, random_seed, ...).
        """
        args = {"model_path": model_path, "ray_options": dict(ray_options or {}), "weight_version": weight_version,
                "ready_timeout_s": ready_timeout_s, "engine_kwargs": engine_kwargs}
        return cls(name, *cls._start(name, **args), launch_args=args)

    @staticmethod
    def _start(name: str, *, model_path: str, ray_options: dict[str, Any], weight_version: int,
               ready_timeout_s: float, engine_kwargs: dict[str, Any]) -> tuple[Any, dict[str, int]]:
        opts = dict(ray_options)
        opts["runtime_env"] = engine_runtime_env(opts)
        opts.setdefault("num_cpus", 0)
        opts.setdefault("max_concurrency", 1000)  # concurrent generate calls on the actor's event loop
        handle = ray.remote(EngineActor).options(**opts).remote(model_path, name, weight_version, engine_kwargs)
        try:
            state = ray.get(handle.state.remote(), timeout=ready_timeout_s)
        except Exception:
            ray.kill(handle)
            raise
        logger.info("engine %s ready (tp_size=%d)", name, state["tp_size"])
        return handle, state

    def restart(self) -> None:
        """Kill this engine's actor (whatever state it is in) and start a fresh one with the same options, so on
        the same placement-group bundle; it serves the weights it was launched from (weight version as launched)
        until the caller syncs it."""
        if self._launch_args is None:
            raise RuntimeError(f"engine {self.name} was not started by EngineClient.launch and cannot be restarted")
        try:
            ray.kill(self.handle)  # frees its bundle; SGLang's subprocesses end with their parent
        except Exception:  # noqa: BLE001 - an actor already gone has nothing to kill
            logger.debug("engine %s: kill of the old actor failed", self.name, exc_info=True)
        logger.warning("engine %s: restarting on its bundle", self.name)
        self.handle, state = self._start(self.name, **self._launch_args)
        self.tp_size, self._weight_version, self._inflight = state["tp_size"], state["weight_version"], 0

    # -- the RolloutEngine seam ---------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def num_inflight(self) -> int:
        return self._inflight

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        self._inflight += 1
        try:
            return await self.handle.generate.remote(list(input_ids), dict(sampling_params), request_id)
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(self.name, f"its actor died during request {request_id} ({type(e).__name__})") from e
        finally:
            self._inflight -= 1

    async def abort(self, request_id: str) -> None:
        await self.handle.abort.remote(request_id)

    # -- control (blocking) ---------------------------------------------------------------------

    def refresh(self) -> int:
        """Read the served weight version back from the actor (after a sync driven by the senders)."""
        self._weight_version = ray.get(self.handle.state.remote())["weight_version"]
        return self._weight_version

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        ray.get(self.handle.release_memory_occupation.remote(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        ray.get(self.handle.resume_memory_occupation.remote(tags))

    def begin_weight_update(self) -> None:
        """Open a weight-update session: tensor and distributed updates load only inside one."""
        ray.get(self.handle.begin_weight_update.remote())

    def end_weight_update(self) -> None:
        """Close the session under the old version (a sync that failed midway)."""
        ray.get(self.handle.end_weight_update.remote())

    def finish_weight_update(self, weight_version: int) -> None:
        """Close a session whose weights all arrived: flush the prefix cache, serve under `weight_version` (`refresh`
        reads it back)."""
        ray.get(self.handle.finish_weight_update.remote(weight_version))

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        """Reload every weight from the HF checkpoint at `path` (its own session), serve under `weight_version`."""
        ray.get(self.handle.update_weights_from_disk.remote(path, weight_version))
        self.refresh()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """Join a sender's process group as ranks `rank_offset ..` (one per engine TP rank); blocks until every
        member has joined."""
        ray.get(self.handle.init_weights_update_group.remote(master_address, master_port, rank_offset, world_size,
                                                             group_name, backend))

    def destroy_weights_update_group(self, group_name: str) -> None:
        ray.get(self.handle.destroy_weights_update_group.remote(group_name))

    def weight_checksums(self) -> dict[str, list[float]]:
        """Per-HF-tensor [sum, abs_sum, sum_of_squares] of the served weights (see `weight_probe`)."""
        return ray.get(self.handle.weight_checksums.remote())

    def shutdown(self) -> None:
        """Stop the engine's subprocesses, then the actor."""
        try:
            ray.get(self.handle.shutdown.remote(), timeout=120)
        except Exception as e:  # noqa: BLE001 - a dead actor has nothing left to stop; kill it below
            logger.warning("engine %s did not shut down cleanly (%s); killing its actor", self.name, type(e).__name__)
        ray.kill(self.handle)

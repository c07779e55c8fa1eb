"""SGLang engine client: one in-process `sglang.Engine` behind the `RolloutEngine` seam.

The engine's tokenizer manager binds to the first asyncio loop that talks to it, so each
`SGLangEngine` owns a private loop in a daemon thread and every call (generation, abort, weight
updates) is submitted to that loop. Callers may therefore use the engine from any loop or thread:
`asyncio.run` in a test, or the Ray actor of `engine_actor.py` that hosts it in production.

This is also the weight-sync receive side, every path inside one SGLang weight-update session
(`begin_weight_update` ... `end_weight_update`, which SGLang 0.5.23 requires):

- tensor: per-engine-TP-rank serialized payloads (`update_weights_from_serialized`): one copy per
  TP rank, each rank deserializes its own (CUDA IPC handles on GPUs, shared-memory names on CPU);
- distributed: `init_weights_update_group` + `update_weights_from_distributed` (the sender
  broadcasts each bucket over a process group that the engine's TP ranks join);
- disk: `update_weights_from_disk` (an HF checkpoint directory).

`weight_checksums` is the probe behind `rollout.check_weights`: it runs `weight_probe` inside
each scheduler process (SGLang's custom-weight-loader hook) and returns per-HF-tensor sums.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import pickle
import tempfile
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import psutil
import torch

from rollout import sglang_cpu
from rollout.engines import weight_probe
from rollout.engines.base import GenerateResult

logger = logging.getLogger(__name__)


def server_arg_names() -> set[str]:
    """The argument names of SGLang's `ServerArgs` (what `sglang.Engine(**kwargs)` accepts)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return {f.name for f in record_fields(ServerArgs)}


class EngineError(RuntimeError):
    """SGLang refused a control request (weight update, cache flush, ...)."""


class SGLangEngine:
    """A real SGLang `Engine` running in this process (its scheduler in subprocesses)."""

    def __init__(self, model_path: str, *, name: str = "engine0", weight_version: int = 0, **engine_kwargs: Any):
        kwargs = sglang_cpu.engine_kwargs_for_this_machine(engine_kwargs)
        # Between rollouts (the whole training phase) the scheduler would otherwise poll its sockets at 100% of a
        # core, taken from the trainer's ranks; asleep, it still wakes the moment a request or control call arrives.
        kwargs.setdefault("sleep_on_idle", True)
        kwargs["custom_weight_loader"] = [*(kwargs.get("custom_weight_loader") or []), weight_probe.LOADER]
        self._tp_size = int(kwargs.get("tp_size", 1))
        import sglang  # after the CPU adapter: the stand-ins must be on the path first

        self.name = name
        before = {p.pid for p in psutil.Process().children()}
        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        # In this process too, SGLang logs at the engine's own `log_level` (its subprocesses already do).
        logging.getLogger("sglang").setLevel(str(kwargs.get("log_level", "info")).upper())
        self._engine = sglang.Engine(model_path=model_path, weight_version=str(weight_version), **kwargs)
        root.setLevel(level)  # the Engine re-configures the root logger (basicConfig(force=True)): undo it
        root.handlers[:] = handlers
        # The engine's own subprocesses (scheduler, detokenizer): the only processes `shutdown` stops. Python's
        # multiprocessing resource tracker may have started in the same window; it serves the whole process.
        self._procs = [p for p in psutil.Process().children()
                       if p.pid not in before and "resource_tracker" not in " ".join(_cmdline(p))]
        self._tm = self._engine.tokenizer_manager
        self._weight_version = weight_version
        self._inflight: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"sglang-{name}", daemon=True)
        self._thread.start()

    # -- the RolloutEngine seam ---------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        self._inflight.add(request_id)
        try:
            out = await asyncio.wrap_future(self._submit(self._engine.async_generate(
                input_ids=list(input_ids), sampling_params=dict(sampling_params), return_logprob=True, rid=request_id,
            )))
        finally:
            self._inflight.discard(request_id)
        return _to_result(out)

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(self._abort(request_id)))

    # -- control: memory -------------------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free GPU memory ("weights", "kv_cache"; None: both) for a colocated trainer (skipped on CPU,
        see `sglang_cpu.skips_memory_release`)."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if sglang_cpu.skips_memory_release():
            return
        self._call(self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back the memory `release_memory_occupation` freed."""
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        if sglang_cpu.skips_memory_release():
            return
        self._call(self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None))

    # -- control: weight sync ----------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size of this engine (one serialized payload per TP rank)."""
        return self._tp_size

    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23 loads tensor / distributed updates only inside one)."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        _check(self._call(self._tm.begin_weight_update(BeginWeightUpdateReqInput(), None)), "begin_weight_update")

    def end_weight_update(self, *, weight_version: int | None = None) -> None:
        """Close the session; with `weight_version`, serve under that version from now on."""
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput, UpdateWeightVersionReqInput

        _check(self._call(self._tm.end_weight_update(EndWeightUpdateReqInput(), None)), "end_weight_update")
        if weight_version is not None:
            self._call(self._tm.update_weight_version(
                UpdateWeightVersionReqInput(new_version=str(weight_version), abort_all_requests=False)))
            self._weight_version = weight_version

    def finish_weight_update(self, *, weight_version: int) -> None:
        """Close a session whose weights all arrived: drop the prefix cache of the old weights, then serve under
        `weight_version`. The flush rides on an empty tensor update, which skips the allocator cleanup that SGLang's
        own `flush_cache` adds (on a CPU a full garbage collection of the scheduler: about 0.5 s at 0.5B shapes)."""
        self.update_weights_from_serialized([pickle.dumps([])] * self._tp_size, flush_cache=True)
        self.end_weight_update(weight_version=weight_version)

    def update_weights_from_serialized(self, payloads: list[bytes], *, load_format: str | None = None,
                                       flush_cache: bool = False) -> None:
        """Load one bucket: `payloads[r]` is TP rank r's serialized `[(hf_name, tensor), ...]` (inside a session);
        `flush_cache`: then drop the prefix cache (the allocator's cache is left alone)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        if len(payloads) != self._tp_size:
            raise ValueError(f"engine {self.name} has tp_size={self._tp_size} but got {len(payloads)} payloads; "
                             "send one serialized copy per engine TP rank")
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=list(payloads), load_format=load_format,
                                              flush_cache=flush_cache, torch_empty_cache=False)
        _check(self._call(self._tm.update_weights_from_tensor(req, None)), "update_weights_from_tensor")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """Join a sender's process group: this engine's TP rank r becomes rank `rank_offset + r`
        (the sender is rank 0). Blocks until every member has joined."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        req = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size,
                                             group_name=group_name, backend=backend)
        _check(self._call(self._tm.init_weights_update_group(req, None)), "init_weights_update_group")

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave a group `init_weights_update_group` joined."""
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        _check(self._call(self._tm.destroy_weights_update_group(
            DestroyWeightsUpdateGroupReqInput(group_name=group_name), None)), "destroy_weights_update_group")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str) -> None:
        """Receive one bucket broadcast by rank 0 of `group_name` as one flat byte tensor (the tensors
        back to back, in this order) and load it (inside a session)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        req = UpdateWeightsFromDistributedReqInput(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                                   flush_cache=False, load_format="flattened_bucket")
        _check(self._call(self._tm.update_weights_from_distributed(req, None)), "update_weights_from_distributed")

    def update_weights_from_disk(self, model_path: str, *, weight_version: int) -> None:
        """Reload all weights from an HF checkpoint directory (flushes the cache)."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        req = UpdateWeightFromDiskReqInput(model_path=model_path, weight_version=str(weight_version))
        _check(self._call(self._tm.update_weights_from_disk(req, None)), "update_weights_from_disk")
        self._weight_version = weight_version

    def weight_checksums(self) -> dict[str, list[float]]:
        """`{hf_name: [sum, abs_sum, sum_of_squares]}` (float64) of the weights this engine serves,
        TP shards combined (replicated copies counted once); see `weight_probe`."""
        with tempfile.TemporaryDirectory(prefix=f"probe-{self.name}-") as out_dir:
            # The one-element placeholder goes as SGLang's own update_weights_from_tensor sends tensors (ForkingPickler:
            # a shared-memory handle, one per TP rank, each fetched once). Not by plain pickle: a CPU tensor's storage
            # pickles through whatever `torch.storage._load_from_bytes` is, and megatron-core >= 0.19 replaces it on
            # import with its own, which SGLang's safe unpickler refuses (the scheduler dies).
            from sglang.srt.utils import MultiprocessingSerializer

            placeholder = [(weight_probe.probe_dir_name(out_dir), torch.zeros(1))]
            payloads = [MultiprocessingSerializer.serialize(placeholder) for _ in range(self._tp_size)]
            self.begin_weight_update()
            try:
                self.update_weights_from_serialized(payloads, load_format=weight_probe.LOADER)
            finally:
                self.end_weight_update()
            return weight_probe.combine(out_dir, self._tp_size)

    def shutdown(self) -> None:
        """Stop this engine's subprocesses and this client's loop thread.

        `sglang.Engine.shutdown` kills every child of the calling process (Ray's, wandb's, other
        engines'), so only the processes this engine started are stopped here.
        """
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it SIGQUITs this process when an engine subprocess exits non-zero, as killed ones do
        if self._thread.is_alive():
            self._submit(_cancel_other_tasks()).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        procs: list[psutil.Process] = []
        for proc in self._procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs += [*proc.children(recursive=True), proc]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)
        atexit.unregister(self._engine.shutdown)  # the Engine's own exit hook would kill every child of this process

    # -- plumbing -----------------------------------------------------------------------------

    def _submit(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine) -> Any:
        return self._submit(coro).result()

    async def _abort(self, request_id: str) -> None:
        self._tm.abort_request(rid=request_id)



def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


async def _cancel_other_tasks() -> None:
    """Cancel the tasks SGLang's tokenizer manager left on this loop (so none is destroyed while pending)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5)


def _check(result: Any, what: str) -> None:
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise EngineError(f"SGLang {what} failed: {result[1]}")


def _to_result(out: dict[str, Any]) -> GenerateResult:
    meta = out["meta_info"]
    logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs") or []]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    version = meta.get("weight_version", "0")
    return GenerateResult(
        output_ids=list(out["output_ids"]),
        output_logprobs=logprobs,
        finish_reason=finish if finish in ("stop", "length") else "abort",
        weight_version=int(version) if str(version).isdigit() else -1,
        meta={"e2e_latency": meta.get("e2e_latency"), "cached_tokens": meta.get("cached_tokens", 0)},
    )

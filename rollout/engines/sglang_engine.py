"""SGLang engine client: one in-process `sglang.Engine` behind the `RolloutEngine` seam.

The engine's tokenizer manager binds to the first asyncio loop that talks to it, so each
`SGLangEngine` owns a private loop in a daemon thread and every call (generation, abort, weight
updates) is submitted to that loop. Callers may therefore use the engine from any loop or thread:
`asyncio.run` in a test, a Ray actor, or the trainer's synchronous step between rollouts.

This is also the weight-sync receive side: HF-named tensors handed over in process
(`update_weights_from_tensor`) or a checkpoint directory (`update_weights_from_disk`). Every update
bumps `weight_version`, which each generated turn reports. (SGLang's broadcast path,
`update_weights_from_distributed`, and memory release for colocated GPUs are not wired yet.)
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from typing import Any

import psutil
import torch

from rollout import sglang_cpu
from rollout.engines.base import GenerateResult

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """SGLang refused a control request (weight update, cache flush, ...)."""


class SGLangEngine:
    """A real SGLang `Engine` running in this process (its scheduler in subprocesses)."""

    def __init__(self, model_path: str, *, name: str = "engine0", weight_version: int = 0, **engine_kwargs: Any):
        kwargs = sglang_cpu.engine_kwargs_for_this_machine(engine_kwargs)
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

    # -- control: weight sync ----------------------------------------------------------------

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                                   weight_version: int, flush_cache: bool = True) -> None:
        """Load HF-named full tensors handed over in process (colocated sync)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        tensors = list(named_tensors)
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors)],
            flush_cache=flush_cache, weight_version=str(weight_version),
        )
        self._call(self._session(self._tm.update_weights_from_tensor(req, None), "update_weights_from_tensor"))
        self._weight_version = weight_version

    def update_weights_from_disk(self, model_path: str, *, weight_version: int) -> None:
        """Reload all weights from an HF checkpoint directory."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        req = UpdateWeightFromDiskReqInput(model_path=model_path, weight_version=str(weight_version))
        _check(self._call(self._tm.update_weights_from_disk(req, None)), "update_weights_from_disk")
        self._weight_version = weight_version

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

    async def _session(self, update: Coroutine, what: str) -> None:
        """SGLang 0.5.23 requires tensor / distributed updates between begin and end_weight_update."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        _check(await self._tm.begin_weight_update(BeginWeightUpdateReqInput(), None), "begin_weight_update")
        try:
            _check(await update, what)
        finally:
            _check(await self._tm.end_weight_update(EndWeightUpdateReqInput(), None), "end_weight_update")


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

"""The colocated memory hand-over: engines and Megatron ranks take turns on the same GPUs (hybrid placement).

Every step, in this order: rollout -> engines release their memory -> Megatron state back on the GPU (when
`actor_rollout_ref.actor.megatron.*_offload`) -> train -> offload again -> engines resume their weights -> weight
sync -> engines resume their KV cache. On a Ray cluster without GPUs there is no GPU memory to hand over
(`Workers.colocated` is false there, see recipe.main_ppo), and the engine calls are skipped; the Megatron moves
follow the offload flags everywhere. tests/test_colocate.py checks the order with recorders.

Each engine's release / resume blocks on a device synchronize and a remap of its memory (tens of GB on a GPU), so
the calls go to every engine at once, not one after another.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_MEMORY = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory tags; a release of None frees them all


def move_megatron_state(groups: list[Any], m: Any, method: str) -> None:
    """"offload" / "onload" on every group the Megatron state `m.*_offload` (a MegatronConfig) chooses. The
    workers are built offloaded (recipe.main_ppo: before the engines start and size their KV cache)."""
    if not (m.param_offload or m.grad_offload or m.optimizer_offload):
        return
    kwargs = {"params": m.param_offload, "grads": m.grad_offload, "optimizer": m.optimizer_offload} \
        if method == "offload" else {}
    for group in groups:
        group.call_all(method, **kwargs)


class GpuHandover:
    """Who holds the GPUs: the engines' memory tags released now, and the calls that move it."""

    def __init__(self, engines: list[Any], groups: list[Any], megatron: Any, colocated: bool) -> None:
        self.engines, self.groups, self.megatron, self.colocated = engines, groups, megatron, colocated
        self.released: set[str] = set()  # colocated: the engines' memory tags released now (ENGINE_MEMORY)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Megatron's turn: engines release everything and Megatron onloads; after, Megatron offloads and the engines
        take their weights back (the KV cache waits for the weight sync: `resume_kv_cache`). An error inside leaves
        the memory where it is (the run stops)."""
        self._release(None)
        move_megatron_state(self.groups, self.megatron, "onload")
        yield
        move_megatron_state(self.groups, self.megatron, "offload")
        self._resume(["weights"])

    def resume_kv_cache(self) -> None:
        """After the weight sync: the engines' KV cache and CUDA graphs back, ready to serve."""
        self._resume(["kv_cache", "cuda_graph"])

    def resume_kv_cache_of_live(self) -> None:
        """Before a health probe (which generates): the KV cache back on every engine that answers; a dead one's
        error is logged, and the probe then finds it dead (a restart brings it back with all its memory)."""
        def resume(engine: Any, tags: list[str]) -> None:
            try:
                engine.resume_memory_occupation(tags)
            except Exception as e:  # noqa: BLE001 - the probe that follows names the dead engine
                logger.warning("engine %s did not resume its memory (%s: %s)", getattr(engine, "name", "?"),
                               type(e).__name__, (str(e).splitlines() or [""])[0])
        self._resume(["kv_cache", "cuda_graph"], resume)

    def match_released(self, engine: Any) -> None:
        """A restarted engine holds all its memory: release what the others hold released now, all but the weights a
        sync then loads (SGLang refuses to resume memory it never released, killing the engine)."""
        released = sorted(self.released - {"weights"})
        if self.colocated and released:
            engine.release_memory_occupation(released)

    def _release(self, tags: list[str] | None) -> None:
        """Colocated only: every engine, at once, releases the memory of `tags` (None: all of it)."""
        if self.colocated:
            self._each(lambda engine: engine.release_memory_occupation(tags))
            self.released |= set(tags or ENGINE_MEMORY)

    def _resume(self, tags: list[str], resume: Any = None) -> None:
        """Colocated only: every engine, at once, resumes those of `tags` it released (through `resume(engine,
        tags)`, default: the engine's own call)."""
        tags = [t for t in tags if t in self.released]
        if self.colocated and tags:
            resume = resume or (lambda engine, tags: engine.resume_memory_occupation(tags))
            self._each(lambda engine: resume(engine, tags))
            self.released -= set(tags)

    def _each(self, call: Any) -> None:
        with ThreadPoolExecutor(max_workers=max(len(self.engines), 1)) as pool:
            list(pool.map(call, self.engines))

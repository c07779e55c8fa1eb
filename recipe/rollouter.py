"""Rollouts that run beside the trainer: one rollout ahead in a background thread (one_step_off), or a stream of
prompt groups on the trainer's event loop in a thread of its own (fully_async). `recipe.schedules` drives them.

Departs from verl's fully async rollouter: it shares the trainer's process and event loop (one agent loop, one
router), not a Ray actor of its own.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.agent_loop import AgentLoop
from rollout.prompt import RolloutPrompt
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)


def run_on(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Run `coro` on `loop`: here, or, while another thread runs the loop (fully_async's rollouter), there."""
    if loop.is_running():
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    return loop.run_until_complete(coro)


class RolloutAhead:
    """At most one rollout running in a background thread (one_step_off's next step) while the caller trains."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._future: Future | None = None

    @property
    def pending(self) -> bool:
        """A rollout was started and not joined yet."""
        return self._future is not None

    def start(self, collect: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run `collect(*args, **kwargs)` in the background thread."""
        assert self._future is None, "one rollout ahead at a time"
        self._future = self._pool.submit(collect, *args, **kwargs)

    def join(self) -> Any:
        """Wait for the rollout; its result (or its exception)."""
        future, self._future = self._future, None
        return future.result()

    def abort(self, agent_loop: Any, loop: asyncio.AbstractEventLoop) -> None:
        """The caller failed while the rollout runs: abort it on its event loop (tools released, interactions
        finalized) and wait for it to end."""
        if self._future is None:
            return
        if not self._future.done():
            asyncio.run_coroutine_threadsafe(agent_loop.abort(), loop)
        try:
            self.join()
        except Exception:  # noqa: BLE001 - the caller's own error is the one raised
            logger.exception("the rollout ahead failed while it was aborted")

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RolloutStopped(RuntimeError):
    """The streaming rollouter ended (its prompts ran out, or it failed) while the trainer waited for a group."""


class StreamingRollouter:
    """fully_async's rollouter: prompt groups rolled out one after another on `loop`, run by a thread of its own.

    At most `capacity` groups are started and not yet taken; `take` hands the trainer the finished groups in the
    order they finish, and frees their slots. `pause` / `resume` bracket a weight sync (the generations in flight are
    paused and continue on the new weights), `drain` / `resume` one without partial rollouts (no group starts, and
    the started ones finish, first). Prompts come from the batches `next_batch` draws, after those given to
    `requeue` (a group rolled out again, or the work in flight at a checkpoint)."""

    def __init__(self, agent_loop: AgentLoop, loop: asyncio.AbstractEventLoop,
                 next_batch: Callable[[], list[RolloutPrompt]], capacity: int, seed: int | None = None) -> None:
        self.agent_loop, self.loop, self.capacity, self.seed = agent_loop, loop, capacity, seed
        self._next_batch = next_batch
        self._drawn: deque[RolloutPrompt] = deque()  # the rest of the last batch drawn
        self._first: deque[RolloutPrompt] = deque()  # rolled out before new prompts
        self._inflight: dict[str, RolloutPrompt] = {}  # prompt uid -> prompt, started and not finished
        self._finished: queue.Queue[tuple[RolloutPrompt, list[Trajectory]]] = queue.Queue()
        self._outstanding = 0  # groups started and not taken
        self._admitting = True  # false while draining for a sync, and once stopped
        self._stopped = False
        self._wake = asyncio.Event()  # set when a slot frees, a group finishes, or the trainer asks something
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="rollouter", daemon=True)

    # ---- the trainer's side (its thread) --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def take(self, timeout_s: float | None, check: Callable[[], None] = lambda: None) -> tuple[RolloutPrompt,
                                                                                            list[Trajectory]]:
        """The next finished group (prompt, its trajectories), waiting at most `timeout_s` (None: no limit); its
        slot is freed. `check` runs while waiting (it raises to stop the wait)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            check()
            try:
                group = self._finished.get(timeout=0.2)
                break
            except queue.Empty:
                if self._error is not None or not self._thread.is_alive():
                    raise RolloutStopped(f"the rollouter stopped: {self._error!r}") from self._error
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no prompt group finished within trainer.rollout_timeout_s={timeout_s}")
        self._call_soon(self._release)
        return group

    def requeue(self, prompts: list[RolloutPrompt]) -> None:
        """Roll these prompts out (again) before any new one."""
        self._call_soon(lambda: (self._first.extend(prompts), self._wake.set()))

    def pause(self) -> None:
        """Pause the generations in flight (their trajectories keep what they sampled); returns when the engines
        are idle."""
        self._run(self.agent_loop.router.pause())

    def drain(self) -> None:
        """Start no group, and wait for the started ones to finish."""
        self._run(self._drain())

    def resume(self) -> None:
        """After `pause` or `drain`: generations continue (on the new weights) and groups start again."""
        self._call_soon(self._resume)

    def snapshot(self, read: Callable[[], Any]) -> tuple[tuple[list[tuple[RolloutPrompt, list[Trajectory]]],
                                                              list[RolloutPrompt]], Any]:
        """For a checkpoint: (the finished groups not taken yet, the prompts in flight or drawn and not started: a
        resumed run rolls them out first), and `read()`, called on the loop (where batches are drawn)."""
        return self._run(self._snapshot(read))

    def restore(self, finished: list[tuple[RolloutPrompt, list[Trajectory]]], pending: list[RolloutPrompt]) -> None:
        """Before `start`: what `snapshot` saved."""
        for group in finished:
            self._finished.put(group)
        self._outstanding = len(finished)
        self._first.extend(pending)

    def stop(self) -> None:
        """Abort the groups in flight (tools released, interactions finalized) and end the thread."""
        if self._thread.is_alive():
            self._call_soon(self._stop)
            self._thread.join()

    # ---- the loop's side ------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer by `take`
            logger.exception("the rollouter failed")
            self._error = e

    async def _main(self) -> None:
        while not self._stopped:
            while self._admitting and self._outstanding < self.capacity:
                if not self._first and not self._drawn:
                    self._drawn.extend(self._next_batch())
                prompt = (self._first or self._drawn).popleft()
                self._outstanding += 1
                self._inflight[prompt.uid] = prompt
                task = asyncio.ensure_future(self._group(prompt))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._wake.clear()
            await self._wake.wait()
        if self._tasks:
            await self.agent_loop.abort()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _group(self, prompt: RolloutPrompt) -> None:
        try:
            trajs = await self.agent_loop.generate([prompt], seed=self.seed, progress=False)
        except Exception as e:  # noqa: BLE001 - a prompt the loop refuses: handed to the trainer by `take`
            logger.exception("prompt %s could not be rolled out", prompt.uid)
            self._error = e
            return
        if self._stopped:
            return
        del self._inflight[prompt.uid]
        self._finished.put((prompt, trajs))
        self._wake.set()

    def _release(self) -> None:
        self._outstanding -= 1
        self._wake.set()

    async def _drain(self) -> None:
        self._admitting = False
        while self._inflight and not self._stopped:
            self._wake.clear()
            await self._wake.wait()

    def _resume(self) -> None:
        self.agent_loop.router.resume()
        self._admitting = True
        self._wake.set()

    async def _snapshot(self, read: Callable[[], Any]) -> Any:
        return (list(self._finished.queue), [*self._first, *self._inflight.values(), *self._drawn]), read()

    def _stop(self) -> None:
        self._stopped, self._admitting = True, False
        self.agent_loop.router.resume()  # a paused request would wait for ever
        self._wake.set()

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def _run(self, coro: Any) -> Any:
        if not self._thread.is_alive():
            coro.close()
            raise RolloutStopped(f"the rollouter stopped: {self._error!r}") from self._error
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

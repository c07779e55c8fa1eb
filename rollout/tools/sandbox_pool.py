"""A pool of warm sandboxes: the start-up cost of a run (namespaces, mounts, privilege drop, interpreter
start, ~0.25 CPU-s) is paid ahead of the call, in the background.

Each worker is a `Sandbox.start_worker()`: the very process a cold run would start, stopped where its
interpreter waits for the code. A call takes one idle worker, runs its code there and kills it: a worker
is used once, so the containment is the cold path's, unchanged (fresh namespaces, fresh /tmp, fresh uid,
nothing left from any other call), and the pool starts a replacement in the background. A worker found
dead when taken is dropped; a call that finds the pool empty starts its own sandbox (the cold path), so a
burst larger than the pool is never refused, only slower.

The pool owns its processes from one event loop in its own thread, so callers may come from any loop
(asyncio or uvloop, one `asyncio.run` after another) and cancelling a call kills its sandbox as it does on
the cold path. `close()` kills every idle worker and ends the thread. An idle worker that outlives its
owner (the host process killed) reads end-of-file for its code, runs nothing and exits.

The pool saves latency, not CPU: each call still costs one sandbox start, paid before it is needed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from pathlib import Path

from rollout.tools.sandbox import Sandbox, SandboxResult, SandboxStartError, SandboxWorker

logger = logging.getLogger(__name__)

_STARTS_AT_ONCE = 4  # sandboxes the refill starts concurrently (each is a few processes for ~0.25 CPU-s)


class SandboxPool:
    """Up to `size` warm workers of `sandbox`; `await pool.run(code)` is `sandbox.run(code)`, warm.

    Filling starts at `start()` (idempotent; the first `run` calls it too).
    """

    def __init__(self, sandbox: Sandbox, size: int):
        if size < 1:
            raise ValueError(f"sandbox pool size must be >= 1, got {size}; use the sandbox alone for no pool")
        self.sandbox = sandbox
        self.size = size
        self._idle: collections.deque[SandboxWorker] = collections.deque()
        self._calls: set[asyncio.Task] = set()  # runs in progress (cancelled by close)
        self._refill_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the pool's thread and begin filling it (no-op when started)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox pool is closed; build a new tool (and pool) to run more code")
            if self._thread is not None:
                return
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-pool", daemon=True)
            self._thread.start()
        self._loop.call_soon_threadsafe(self._refill_soon)

    async def run(self, code: str) -> SandboxResult:
        """Run `code` on a warm worker (a cold sandbox when none is idle); never raises for the code."""
        self.start()
        future = asyncio.run_coroutine_threadsafe(self._run(code), self._loop)
        return await asyncio.wrap_future(future)  # cancelling this cancels the run, which kills its sandbox

    def idle_pids(self) -> list[int]:
        """Process ids of the idle workers' group leaders (for tests and monitoring)."""
        return [w.proc.pid for w in list(self._idle)]

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until `size` workers are idle (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while len(self._idle) < self.size and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self._idle) >= self.size

    def close(self) -> None:
        """Cancel runs in progress, kill every idle worker, stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is None:
                return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    # --------------------------------------------------------------- on the pool's loop

    async def _run(self, code: str) -> SandboxResult:
        start = time.monotonic()
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            for _ in range(2):  # a worker can die between `_take` and the code reaching it: then once more
                worker = self._take()
                self._refill_soon()
                if worker is None:
                    return await self.sandbox.run(code)
                result = await self.sandbox.run_on(worker, code, start)
                result.warm = True
                if result.code_started or result.timed_out:
                    break
            return result
        finally:
            self._calls.discard(task)

    def _take(self) -> SandboxWorker | None:
        """An idle worker that is still alive; dead ones are dropped (and replaced by the refill)."""
        while self._idle:
            worker = self._idle.popleft()
            if _alive(worker):
                return worker
            logger.warning("sandbox pool: idle worker %d died; replacing it", worker.proc.pid)
            asyncio.ensure_future(self.sandbox.discard(worker))
        return None

    def _refill_soon(self) -> None:
        if not self._closed and (self._refill_task is None or self._refill_task.done()):
            self._refill_task = asyncio.ensure_future(self._refill())

    async def _refill(self) -> None:
        """Start workers until `size` are idle; stop at the first failure (the next call tries again)."""
        while not self._closed and len(self._idle) < self.size:
            n = min(self.size - len(self._idle), _STARTS_AT_ONCE)
            started = await asyncio.gather(*(self.sandbox.start_worker() for _ in range(n)), return_exceptions=True)
            failed = [s for s in started if isinstance(s, BaseException)]
            for worker in started:
                if isinstance(worker, SandboxWorker):
                    self._idle.append(worker)
            if failed:
                if not isinstance(failed[0], SandboxStartError):
                    raise failed[0]
                logger.warning("sandbox pool: %s; calls start their own sandboxes until a refill succeeds", failed[0])
                return

    async def _shutdown(self) -> None:
        if self._refill_task is not None:
            self._refill_task.cancel()
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*([self._refill_task] if self._refill_task else []), *self._calls, return_exceptions=True)
        workers = list(self._idle)
        self._idle.clear()
        await asyncio.gather(*(self.sandbox.discard(w) for w in workers))


def _alive(worker: SandboxWorker) -> bool:
    """Whether the worker's group leader still runs. Read from /proc: the loop learns of an exit only when the
    child watcher reaps it, a moment later."""
    if worker.proc.returncode is not None:
        return False
    try:
        state = Path(f"/proc/{worker.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")

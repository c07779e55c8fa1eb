"""A pool of warm sandboxes: the start-up cost of a run (namespaces, mounts, privilege drop, interpreter
start, ~0.25 CPU-s) is paid ahead of the call, in the background.

Each worker is a `Sandbox.start_worker()`: the very process a cold run would start, stopped where its
interpreter waits for the code. A call takes one idle worker and runs its code there; the result is back
when the code ends. A worker is used once, so the containment is the cold path's, unchanged (fresh
namespaces, fresh /tmp, fresh uid, nothing left from any other call). A worker found dead when taken is
dropped; a call that finds the pool empty starts its own sandbox (the cold path), so a burst larger than
the pool is never refused, only slower.

The upkeep (killing used workers, which wait blocked until then, and starting replacements,
`_STARTS_AT_ONCE` at a time) runs when no call is running, or `_QUIET_WAIT_S` after it was needed at the
latest: a burst of calls does not share the CPU with its own teardown and refill.

The pool owns its processes from one event loop in its own thread (asyncio's: the sandboxes' pipes are
watched as raw descriptors, `rollout.tools.child_process`, and uvloop measured no faster at 64 calls at once),
so callers may come from any loop (asyncio or uvloop, one `asyncio.run` after another) and cancelling a call
kills its sandbox as it does on the cold path. `close()` kills every worker and ends the thread. A
worker that outlives its owner (the host process killed) reads end-of-file on its stdin and exits: an idle
one before running anything, a used one when its code has ended.

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

_STARTS_AT_ONCE = 4  # sandboxes the upkeep starts concurrently (each is a few processes for ~0.25 CPU-s)
_QUIET_WAIT_S = 0.25  # the longest the upkeep waits for a moment with no call running


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
        self._used: list[SandboxWorker] = []  # ran their code (or died idle); wait for the upkeep to kill them
        self._calls: set[asyncio.Task] = set()  # runs in progress (cancelled by close)
        self._quiet: asyncio.Event | None = None  # set while no call runs (made on the pool's loop)
        self._upkeep_task: asyncio.Task | None = None
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
        self._loop.call_soon_threadsafe(self._upkeep_soon)

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
        self._quiet_event().clear()
        try:
            for _ in range(2):  # a worker can die between `_take` and the code reaching it: then once more
                worker = self._take()
                self._upkeep_soon()
                if worker is None:
                    return await self.sandbox.run(code)
                try:
                    result = await self.sandbox.run_on(worker, code, start, finish=False)
                finally:
                    self._used.append(worker)  # finished by the upkeep (at once when it was killed)
                result.warm = True
                if result.code_started or result.timed_out:
                    break
            return result
        finally:
            self._calls.discard(task)
            if not self._calls:
                self._quiet_event().set()

    def _quiet_event(self) -> asyncio.Event:
        if self._quiet is None:
            self._quiet = asyncio.Event()
            self._quiet.set()
        return self._quiet

    def _take(self) -> SandboxWorker | None:
        """An idle worker that is still alive; dead ones are dropped (and replaced by the upkeep)."""
        while self._idle:
            worker = self._idle.popleft()
            if _alive(worker):
                return worker
            logger.warning("sandbox pool: idle worker %d died; replacing it", worker.proc.pid)
            self._used.append(worker)  # finished by the upkeep, or by `_shutdown`: no task the closing loop could drop
        return None

    def _upkeep_soon(self) -> None:
        if not self._closed and (self._upkeep_task is None or self._upkeep_task.done()):
            self._upkeep_task = asyncio.ensure_future(self._upkeep())

    async def _upkeep(self) -> None:
        """Until every used worker is killed and `size` are idle: wait for a moment with no call running (at
        most `_QUIET_WAIT_S`), kill the used workers, start up to `_STARTS_AT_ONCE`. Stops at the first failed
        start (the next call tries again)."""
        while not self._closed and (self._used or len(self._idle) < self.size):
            try:
                await asyncio.wait_for(self._quiet_event().wait(), _QUIET_WAIT_S)
            except TimeoutError:
                pass
            used = list(self._used)  # left listed until finished: `_shutdown` finishes what a cancel cut short
            await asyncio.gather(*(self.sandbox.finish(w) for w in used))
            self._used = [w for w in self._used if w not in used]
            n = min(self.size - len(self._idle), _STARTS_AT_ONCE)
            started = await asyncio.gather(*(self._start_idle() for _ in range(n)), return_exceptions=True)
            failed = [s for s in started if isinstance(s, BaseException)]
            if failed:
                if not isinstance(failed[0], SandboxStartError):
                    raise failed[0]
                logger.warning("sandbox pool: %s; calls start their own sandboxes until a start succeeds", failed[0])
                return

    async def _start_idle(self) -> None:
        """Start a worker and make it idle at once: one the gather was cancelled after is not lost to `_shutdown`."""
        self._idle.append(await self.sandbox.start_worker())

    async def _shutdown(self) -> None:
        if self._upkeep_task is not None:
            self._upkeep_task.cancel()
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*([self._upkeep_task] if self._upkeep_task else []), *self._calls, return_exceptions=True)
        workers, used = list(self._idle), self._used
        self._idle.clear()
        self._used = []
        await asyncio.gather(*(self.sandbox.discard(w) for w in workers), *(self.sandbox.finish(w) for w in used))


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

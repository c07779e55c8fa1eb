"""Start a child process from an event loop with no Python code run between fork and exec.

The sandboxes are started from processes with many threads (Ray's, the engine clients', the pool's). uvloop's
subprocess spawn runs `PyOS_AfterFork_Child()` in the forked child before it execs, and in CPython 3.11 that
takes the runtime's thread-list lock before resetting it: when another thread held it at the fork, the child
waits forever, and so does the caller (seen in `bash run_gsm8k.sh`, three times: the pool's thread in
`uv_spawn`, its child stuck in `_PyThreadState_DeleteExcept`). `subprocess.Popen` without a `preexec_fn` forks
(or vforks) and execs in C alone, so `spawn` starts the child that way. The loop then watches raw descriptors
only: the pipes (`add_reader` / `add_writer`) and a pidfd for the exit. Where there is no pidfd, a thread
waits for the exit, as asyncio's `ThreadedChildWatcher` does (measured: it costs the pool's calls latency at
64 at once). No transport is involved: handed file objects, uvloop's pipe transports close a descriptor a
second time, which aborted the loop in an earlier attempt.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

_CHUNK = 65536  # bytes per read of a pipe
_PAUSE_AT = 1 << 20  # unread bytes at which a reader stops reading (the child then blocks on a full pipe)


class ChildProcess:
    """A child started by `spawn`, on the loop that started it.

    `pid`, `returncode` (None while it runs; -N when killed by signal N), `stdin` (`PipeWriter`), `stdout` and
    `stderr` (`PipeReader`), `await wait()`, and `close()` for its pipes.
    """

    def __init__(self, popen: subprocess.Popen, stdin: int, stdout: int, stderr: int) -> None:
        loop = asyncio.get_running_loop()
        self._popen, self._loop = popen, loop
        self.pid = popen.pid
        self.stdin, self.stdout, self.stderr = PipeWriter(stdin, loop), PipeReader(stdout, loop), PipeReader(stderr, loop)
        self._exited = loop.create_future()
        try:
            self._pidfd = os.pidfd_open(self.pid)  # readable once the child has exited
        except OSError:  # before Linux 5.3, or refused by a seccomp profile: a thread waits instead
            threading.Thread(target=self._reap_on_thread, name=f"reap-{self.pid}", daemon=True).start()
        else:
            loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self) -> None:  # on the loop: the pidfd is readable
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        _resolve(self._exited, self._popen.wait())

    def _reap_on_thread(self) -> None:
        code = self._popen.wait()
        try:
            self._loop.call_soon_threadsafe(_resolve, self._exited, code)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def wait(self) -> int:
        """The exit status, once the child has exited and been reaped."""
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        """Close the pipes to the child (idempotent); the child is neither killed nor waited for, and `wait`
        still learns of its exit (the exit's watch ends with the exit)."""
        for pipe in (self.stdin, self.stdout, self.stderr):
            pipe.close()


class PipeReader:
    """The read end of a child's pipe, watched by the loop from the start (as a transport is): `await read(n)` is up
    to `n` bytes, b"" at end-of-file or once closed. Reading pauses while `_PAUSE_AT` bytes wait unread."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._fd: int | None = fd
        self._loop = loop
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self._watching = True
        loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        if self._fd is None:  # closed after the loop saw it readable
            return
        try:
            data = os.read(self._fd, _CHUNK)
        except BlockingIOError:
            return
        if data:
            self._buffer += data
            if len(self._buffer) >= _PAUSE_AT:
                self._loop.remove_reader(self._fd)
                self._watching = False
        else:
            self.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter, None)

    async def read(self, n: int) -> bytes:
        while not self._buffer and self._fd is not None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        if not self._watching and self._fd is not None and len(self._buffer) < _PAUSE_AT:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True
        return data

    async def readexactly(self, n: int) -> bytes:
        """Exactly `n` bytes; raises asyncio.IncompleteReadError at end-of-file before them."""
        data = b""
        while len(data) < n:
            chunk = await self.read(n - len(data))
            if not chunk:
                raise asyncio.IncompleteReadError(data, n)
            data += chunk
        return data

    def close(self) -> None:
        """Stop watching and close the descriptor; what was read stays readable, then end-of-file. Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if self._watching:
                self._loop.remove_reader(fd)
            os.close(fd)
            self._wake()


class PipeWriter:
    """The write end of a child's pipe: `await write(data)` writes all of it, or raises BrokenPipeError when the
    child closed its end (or ours is closed)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._fd: int | None = fd
        self._loop = loop
        self._waiter: asyncio.Future | None = None

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._fd is None:
                raise BrokenPipeError("the pipe to the child is closed")
            try:
                view = view[os.write(self._fd, view):]
                continue
            except BlockingIOError:
                pass
            fd, self._waiter = self._fd, self._loop.create_future()  # the pipe is full: wait for room
            self._loop.add_writer(fd, _resolve, self._waiter, None)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if self._fd is not None:  # else `close` removed the watch (the number may be another's by now)
                    self._loop.remove_writer(fd)

    def close(self) -> None:
        """Close our end (the child reads end-of-file); a pending write ends with BrokenPipeError. Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._loop.remove_writer(fd)
            os.close(fd)
            if self._waiter is not None:
                _resolve(self._waiter, None)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


async def spawn(argv: list[str], *, cwd: str, env: dict[str, str]) -> ChildProcess:
    """Start `argv` in a new session (its own process group), its stdin, stdout and stderr piped to this process.
    Raises OSError when it cannot start."""
    ours: list[int] = []
    theirs: list[int] = []
    try:
        for child_reads in (True, False, False):
            r, w = os.pipe2(os.O_CLOEXEC)
            ours.append(w if child_reads else r)
            theirs.append(r if child_reads else w)
        popen = subprocess.Popen(argv, stdin=theirs[0], stdout=theirs[1], stderr=theirs[2], cwd=cwd, env=env,
                                 start_new_session=True)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    for fd in ours:
        os.set_blocking(fd, False)
    return ChildProcess(popen, *ours)

"""`rollout.tools.child_process`: a child's pipes and exit, on both event loops the sandboxes run on."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import uvloop

from rollout.tools import child_process
from rollout.tools.child_process import spawn

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
ECHO = "import sys; data = sys.stdin.buffer.read(); sys.stdout.buffer.write(data * 3); sys.stderr.write('err'); sys.exit(7)"


def run(loop_name: str, coro):
    loop = LOOPS[loop_name]()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def echo_through(size: int) -> tuple[bytes, int, int, int]:
    """(stderr, exit status, open descriptors before the spawn, after the close)."""
    fds = len(os.listdir("/proc/self/fd"))
    proc = await spawn([sys.executable, "-c", ECHO], cwd="/", env=dict(os.environ))
    try:
        data = bytes(range(256)) * (size // 256)
        await proc.stdin.write(data)
        proc.stdin.close()
        out, err = bytearray(), bytearray()
        for stream, into in ((proc.stdout, out), (proc.stderr, err)):  # stdout first, past the pause threshold
            while chunk := await stream.read(65536):
                into += chunk
        code = await asyncio.wait_for(proc.wait(), 10)
        assert proc.returncode == code
        assert out == data * 3
    finally:
        proc.close()
    return bytes(err), code, fds, len(os.listdir("/proc/self/fd"))


@pytest.mark.unit
@pytest.mark.parametrize("loop_name", LOOPS)
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "reaper-thread"])
def test_a_child_gets_all_its_input_and_returns_all_its_output_and_exit(loop_name, pidfd, monkeypatch):
    """Input larger than a pipe (the writer waits for room), output larger than a reader's pause threshold (the
    reader stops and resumes), stderr and the exit status, with the exit learnt from a pidfd or, where the kernel
    has none, from a waiting thread."""
    if not pidfd:
        def no_pidfd(pid):
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(child_process.os, "pidfd_open", no_pidfd)
    err, code, fds_before, fds_after = run(loop_name, echo_through(3 * child_process._PAUSE_AT // 2))
    assert (err, code) == (b"err", 7)
    assert fds_after == fds_before  # every pipe closed, and the pidfd with the exit


@pytest.mark.unit
@pytest.mark.parametrize("loop_name", LOOPS)
def test_closing_ends_a_pending_read_and_write_and_an_unstartable_child_raises(loop_name):
    """`close` wakes what waits on a pipe (end-of-file, broken pipe) instead of leaving it waiting forever, and
    leaves the exit to be learnt."""
    async def go():
        proc = await spawn([sys.executable, "-c", "import time; time.sleep(30)"], cwd="/", env=dict(os.environ))
        try:
            read = asyncio.ensure_future(proc.stdout.read(10))
            write = asyncio.ensure_future(proc.stdin.write(b"x" * (4 << 20)))  # more than the pipe holds
            await asyncio.sleep(0.2)
            assert not read.done() and not write.done()
            proc.close()
            assert await asyncio.wait_for(read, 5) == b""
            with pytest.raises(BrokenPipeError):
                await asyncio.wait_for(write, 5)
        finally:
            os.kill(proc.pid, 9)
        assert await asyncio.wait_for(proc.wait(), 5) == -9  # the exit is still learnt after the close
        with pytest.raises(FileNotFoundError):
            await spawn(["/nonexistent/program"], cwd="/", env={})

    run(loop_name, go())

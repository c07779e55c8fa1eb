"""Run untrusted Python in a contained subprocess.

Every run gets a fresh process with, in order of strength:

1. **Linux namespaces** (when `unshare` works, as it does for root in containers): a new network
   namespace (loopback only, down: no network at all), PID namespace (the run cannot see or
   signal host processes; when it ends every process it forked dies with it), IPC, UTS and
   mount namespaces. In the mount namespace `/tmp` and `/dev/shm` are fresh size-limited tmpfs
   (`/tmp` is the run's own working directory, gone after the run). The root directory is an
   allow-list: every top-level entry outside `visible_paths` (the system directories: `/usr`,
   `/lib*`, `/etc`, ...) is covered, directories by an empty read-only tmpfs and files by
   `/dev/null`, wherever the host keeps its checkouts and data (`/root`, `/home`, `/work`, a CI
   runner's own top-level directory, ...). The interpreter's installation prefix alone is
   bind-mounted back, read-only, when it lives outside the system directories.
2. **Dropped privileges**: when the host runs as root, each run gets a fresh unprivileged uid/gid
   drawn from `uid_range` (no passwd entry, no capabilities, `no_new_privs` via `setpriv`), so
   root-only files (`/etc/shadow`, other temp dirs made by `mkdtemp`) are unreadable,
   `RLIMIT_NPROC` is enforced (root ignores it) and counted per run, and concurrent runs cannot
   signal each other or use up each other's process quota (as they could sharing `nobody`).
3. **Resource limits**: CPU time (`RLIMIT_CPU`), address space (`RLIMIT_AS`), file size
   (`RLIMIT_FSIZE`), processes (`RLIMIT_NPROC`), open files, no core dumps.
4. **Wall-clock timeout**: the whole process group (and with it the PID namespace) is killed.
   Cancelling `Sandbox.run` (e.g. the tool runner's timeout) kills it the same way.
5. **Output caps**: stdout and stderr are kept up to `max_output_bytes` each; the rest is
   drained and dropped, and the result says it was truncated.

Namespaces are the only sandbox. Without them the run can be started only when the config says
so explicitly, `isolation: rlimits_unsafe` (a warning is logged at start): 2-5 still hold, the
working directory is a fresh host temp dir (removed after the run whatever the run did to it, see
`rollout.tools.sandbox_isolation`), and a Python audit hook refuses sockets, `ctypes` and starting
other programs, but this is NOT a sandbox: the code can read every world-readable file of the host,
leave files in /tmp, /var/tmp and /dev/shm that outlive the call, keep a process alive past the call
(`setsid` + double fork escapes the process group), and undo the audit hook from inside. There is no
silent fallback: with `isolation: namespaces` (the default) and no working `unshare`, building the
sandbox fails naming the fix.

A run is split in two: `start_worker` starts the sandbox up to an interpreter waiting for code,
`run_on` runs the code there and kills it. `run` does both; `rollout.tools.sandbox_pool` does the
first ahead of time, so a call pays only the second, with the containment unchanged. The result is
back when the code ends, marked by a random end token on both streams: a sandbox's teardown (its
processes and namespaces, a few ms of CPU) is not waited for, and the pool does it off the call.

Departs from typical RL sandboxes (SandboxFusion, E2B): no server, no container image; a run
costs one `python3` start (~30 ms) and works offline on any Linux host. The containment's command lines and host
probes are in `rollout.tools.sandbox_isolation`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field, fields

from rollout.tools.child_process import ChildProcess, PipeReader, spawn
from rollout.tools.sandbox_isolation import (
    DEFAULT_VISIBLE_PATHS,
    find_interpreter,
    limits_argv,
    make_workdir,
    namespace_argv,
    namespaces_available,
    remove_workdir,
    sweep_workdirs,
)

logger = logging.getLogger(__name__)

DEFAULT_UID_RANGE = (1_000_000, 1_000_000_000)  # uids with no passwd entry, one drawn per run
ISOLATION_MODES = ("namespaces", "rlimits_unsafe")

# Installed before user code in "rlimits_unsafe" isolation only: refuses the events that reach
# outside the process. Audit hooks cannot be removed once added.
_AUDIT_PRELUDE = """\
import sys as _s
def _polyturn_guard(event, args, _blocked=("socket.", "ctypes.", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile")):
    if event.startswith(_blocked):
        raise PermissionError(f"sandbox: {event} is not allowed")
_s.addaudithook(_polyturn_guard)
del _polyturn_guard
"""
# How every sandboxed interpreter runs the code. It warms its compiler (a process's first `compile` costs
# ~20x a later one), says it is ready (b"R", read by `Sandbox.start_worker`) and reads one header line,
# b"<token> <length>\n", then the code (nothing: the owner is gone, it exits). It keeps its stdin as a
# lifeline and gives the code /dev/null, says it starts the code (b"S", stripped by `Sandbox._run`: a sandbox
# that died before has run nothing) and runs it as `__main__` in a fresh namespace, ending as `python` would:
# SystemExit's status, or the traceback and 1; non-daemon threads joined, atexit handlers run. Then it
# writes the token to stderr, and the token and the status as 3 digits to stdout, through its own copies of
# both (the code may close or redirect fds 1 and 2): the host has the whole result there, without waiting
# for the process and its namespaces to be torn down. It then waits on the lifeline for its owner to kill
# it, or to go away. A forked child that returns from the code exits at once, writing nothing. Nothing that
# the code can forge here harms anyone but its own result.
_RUN_PRELUDE = """\
import os as _o
compile("import math\\nprint(math.sqrt(2))\\n", "<warm>", "exec")
_o.write(1, b"R")
def _polyturn_main():
    import atexit, os, sys
    header = sys.stdin.buffer.readline().split()
    if len(header) != 2:
        os._exit(0)
    token, code = header[0], sys.stdin.buffer.read(int(header[1])).decode("utf-8", "replace")
    lifeline, out, err = os.dup(0), os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    pid, status = os.getpid(), 0
    os.write(out, b"S")
    try:
        exec(compile(code, "<stdin>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # from the code's own frame on
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
    if os.getpid() != pid:  # a forked child came back from the code
        os._exit(status & 0xFF)
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        os.write(err, token)
        os.write(out, token + b"%03d" % (status & 0xFF))
        os.read(lifeline, 1)
    finally:
        os._exit(status & 0xFF)
_polyturn_main()
"""
# Bytes of the status after the end token on stdout.
_STATUS_DIGITS = 3


class SandboxStartError(RuntimeError):
    """A sandbox could not be started (the message says why); `uid` is the uid it was given."""

    def __init__(self, message: str, uid: int | None):
        super().__init__(message)
        self.uid = uid


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_timeout_s: float = 10.0  # kill the run after this much wall time
    cpu_time_s: int = 10  # RLIMIT_CPU of each process (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 1024  # RLIMIT_AS of each process (allocations beyond fail with MemoryError)
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file a run may write
    max_processes: int = 64  # RLIMIT_NPROC of the sandbox user (enforced only when privileges are dropped)
    max_open_files: int = 256  # RLIMIT_NOFILE
    disk_mb: int = 64  # size of the run's /tmp (namespaces only)
    max_output_bytes: int = 16384  # per stream (stdout, stderr)

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclass
class SandboxResult:
    """What one run did."""

    stdout: str  # decoded (utf-8, replacement on errors), capped
    stderr: str
    exit_code: int | None  # process exit status; negative: killed by that signal; None if it never ran
    timed_out: bool  # killed by the wall-clock timeout
    truncated: bool  # stdout or stderr exceeded max_output_bytes
    duration_s: float
    isolation: str  # "namespaces" or "rlimits_unsafe"
    uid: int | None = None  # uid the code ran as (None: privileges were not dropped)
    warm: bool = False  # ran on a sandbox started ahead of the call (rollout.tools.sandbox_pool)
    code_started: bool = True  # False: the sandbox died before it read the code, none of which ran
    notes: list[str] = field(default_factory=list)  # human-readable reasons (limits hit)

    def to_text(self) -> str:
        """The run as the model sees it: notes, exit code, stdout, stderr."""
        parts = [f"[{n}]" for n in self.notes]
        parts.append(f"exit_code: {self.exit_code}")
        if self.stdout:
            parts.append("stdout:\n" + self.stdout)
        if self.stderr:
            parts.append("stderr:\n" + self.stderr)
        return "\n".join(parts)


@dataclass
class SandboxWorker:
    """One started sandbox whose interpreter waits for code; used for one run, then killed."""

    proc: ChildProcess | None  # the sandbox's process (group leader); None until started
    uid: int | None  # the unprivileged uid it runs as (None: privileges not dropped)
    workdir: str | None  # its host work dir (rlimits_unsafe only), removed with it
    released: bool = False  # its uid and work dir are freed (at most once: the uid may be drawn again after)


class Sandbox:
    """Runs Python source under `SandboxLimits`; `await sandbox.run(code)`.

    `isolation`: "namespaces" (the default; error if unavailable) or "rlimits_unsafe" (resource
    limits and an audit hook only; not a sandbox, see the module docstring).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolation: str = "namespaces",
        python_executable: str | None = None,
        visible_paths: tuple[str, ...] = DEFAULT_VISIBLE_PATHS,
        uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
    ):
        self.limits = limits or SandboxLimits()
        self.as_root = os.geteuid() == 0
        self.drop_privileges = self.as_root
        self.python = find_interpreter(python_executable, self.drop_privileges)
        unshare = shutil.which("unshare")
        if isolation not in ISOLATION_MODES:
            raise ValueError(
                f"sandbox isolation {isolation!r} is not one of {ISOLATION_MODES}: 'namespaces' is the sandbox; "
                "'rlimits_unsafe' runs the code with resource limits only (it can read the host's world-readable "
                "files, leave files and processes behind) and must be chosen knowingly"
            )
        if isolation == "namespaces" and not namespaces_available(unshare, self.as_root):
            raise RuntimeError(
                "sandbox isolation 'namespaces' needs `unshare` (util-linux) able to create namespaces, which fails "
                "here; run where namespaces are allowed, or set isolation: rlimits_unsafe to run code unsandboxed"
            )
        self._prlimit, self._setpriv = shutil.which("prlimit"), shutil.which("setpriv")
        if self._prlimit is None:
            raise RuntimeError("the sandbox needs `prlimit` (util-linux) to set its resource limits")
        if self.drop_privileges and self._setpriv is None:
            raise RuntimeError("running as root needs `setpriv` (util-linux) to drop privileges inside the sandbox")
        self.isolation = isolation
        if isolation == "rlimits_unsafe":
            sweep_workdirs()  # work dirs of processes that died before removing them
            logger.warning(
                "sandbox: isolation rlimits_unsafe is NOT a sandbox: the code can read the host's world-readable "
                "files, leave files in /tmp, /var/tmp, /dev/shm and processes that outlive the call"
            )
        self.visible_paths = tuple(visible_paths)
        self._unshare = unshare
        if not (0 < uid_range[0] < uid_range[1]) or uid_range[0] < 1000:
            raise ValueError(f"sandbox uid_range must be (low, high) with 1000 <= low < high, got {uid_range}")
        self.uid_range = (int(uid_range[0]), int(uid_range[1]))
        self._uids_in_use: set[int] = set()
        self._random = random.SystemRandom()

    def _take_uid(self) -> int | None:
        if not self.drop_privileges:
            return None
        while (uid := self._random.randrange(*self.uid_range)) in self._uids_in_use:
            pass
        self._uids_in_use.add(uid)
        return uid

    async def run(self, code: str) -> SandboxResult:
        """Run `code` as a script in a sandbox started for it; never raises for anything the code does."""
        start = time.monotonic()
        try:
            worker = await self.start_worker()
        except SandboxStartError as exc:
            return self._failed_start(str(exc), start, exc.uid)
        return await self.run_on(worker, code, start)

    async def start_worker(self) -> SandboxWorker:
        """Start a sandbox up to the point where its interpreter waits for code (namespaces, mounts, limits
        and privilege drop all done). Raises `SandboxStartError` when it cannot; cancelling kills it."""
        worker = SandboxWorker(None, self._take_uid(), None)
        try:  # from here on every way out that is not a started worker releases it (uid, work dir)
            if self.isolation == "namespaces":
                argv = limits_argv(self.limits, self._prlimit, self._setpriv) + namespace_argv(
                    self._unshare, self.as_root, self.limits.disk_mb, self.visible_paths, self.python, _RUN_PRELUDE,
                    worker.uid)
                cwd = "/"
            else:
                argv = limits_argv(self.limits, self._prlimit, self._setpriv, worker.uid) + [
                    self.python, "-I", "-u", "-c", _AUDIT_PRELUDE + _RUN_PRELUDE]
                cwd = worker.workdir = make_workdir()
                if worker.uid is not None:
                    os.chown(cwd, worker.uid, worker.uid)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": worker.workdir or "/tmp"}
            worker.proc = await spawn(argv, cwd=cwd, env=env)  # no Python between fork and exec
            # The interpreter writes one byte when it is ready for code (see _RUN_PRELUDE).
            await asyncio.wait_for(worker.proc.stdout.readexactly(1), self.limits.wall_timeout_s)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            stderr = await self.discard(worker)
            raise SandboxStartError(f"could not start the sandbox: {exc!r} {stderr}".strip(), worker.uid) from None
        except BaseException:
            # Cancelled: kill now, not in a task the closing loop might never run.
            if worker.proc is not None:
                _kill_group(worker.proc.pid)
                worker.proc.stdin.close()
            self._release(worker)
            raise
        return worker

    async def discard(self, worker: SandboxWorker) -> str:
        """Kill a worker that will run no code (its whole process group) and free its uid and work dir;
        returns what it wrote to stderr, if it had exited."""
        stderr = b""
        try:
            if worker.proc is not None:
                _kill_group(worker.proc.pid)
                worker.proc.stdin.close()
                await worker.proc.wait()
                stderr, _, _ = await asyncio.wait_for(
                    _read_output(worker.proc.stderr, self.limits.max_output_bytes), 2.0)
        except TimeoutError:
            pass
        finally:
            self._release(worker)
        return stderr.decode("utf-8", "replace")

    async def finish(self, worker: SandboxWorker) -> None:
        """Kill a worker that ran its code (its whole process group, unless it is already reaped), wait for it
        and free its uid and work dir. Idempotent."""
        try:
            if worker.proc is not None and worker.proc.returncode is None:
                _kill_group(worker.proc.pid)
                await worker.proc.wait()
        finally:
            self._release(worker)

    def _release(self, worker: SandboxWorker) -> None:
        """Free the worker's pipes, work dir and uid (once). Blocks only while a hostile run's work dir resists
        removal (at most a few hundred ms; `remove_workdir`)."""
        if worker.released:
            return
        worker.released = True
        if worker.proc is not None:
            worker.proc.close()  # here, on its loop: the pipes are watched by it
        if worker.workdir:
            remove_workdir(worker.workdir, worker.uid)  # before the uid may be drawn again: it kills by uid
        self._uids_in_use.discard(worker.uid)

    def _failed_start(self, why: str, start: float, uid: int | None) -> SandboxResult:
        return SandboxResult(
            stdout="",
            stderr=why,
            exit_code=None,
            timed_out=False,
            truncated=False,
            duration_s=time.monotonic() - start,
            isolation=self.isolation,
            uid=uid,
            notes=["sandbox failed to start"],
        )

    async def run_on(self, worker: SandboxWorker, code: str, start: float, finish: bool = True) -> SandboxResult:
        """Run `code` on a started `worker`, used once; `start` is when the call began (for `duration_s`).
        The result is back as soon as the code has ended. With `finish` the worker is then killed and released
        (`finish`); without, a worker whose code ended waits, blocked, for the caller's `finish(worker)`. On
        cancellation it is killed at once. Never raises for the code."""
        ended = False
        try:
            result, ended = await self._run(worker.proc, code, start, worker.uid)
            return result
        finally:
            if finish or not ended:
                await self.finish(worker)

    async def _run(self, proc: ChildProcess, code: str, start: float,
                   uid: int | None) -> tuple[SandboxResult, bool]:
        """The result, and whether the code ended with the process left alive (True) or the process was killed
        and reaped (False: a limit, a signal, `os._exit`, the timeout, or the sandbox died)."""
        max_bytes = self.limits.max_output_bytes
        token = secrets.token_hex(16).encode()
        readers = asyncio.ensure_future(asyncio.gather(_read_output(proc.stdout, max_bytes + 1, token, _STATUS_DIGITS),
                                                       _read_output(proc.stderr, max_bytes, token)))
        exited = asyncio.ensure_future(proc.wait())
        timed_out = ended = False
        try:
            encoded = code.encode("utf-8", "surrogatepass")
            try:
                await proc.stdin.write(b"%s %d\n%s" % (token, len(encoded), encoded))
            except BrokenPipeError:
                pass
            # The wall clock counts from the call: a cold run's start is part of it.
            remaining = max(self.limits.wall_timeout_s - (time.monotonic() - start), 0.0)
            await asyncio.wait({readers, exited}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not (readers.done() or exited.done())
            ended = readers.done() and readers.result()[0][2] is not None and readers.result()[1][2] is not None
        except BaseException:
            readers.cancel()
            raise
        finally:
            if not ended:
                # Also on cancellation: the group (and with it the PID namespace) never outlives the run.
                _kill_group(proc.pid)
                await proc.wait()
            exited.cancel()
        try:
            # Processes that escaped the group could hold the pipes open: do not wait for them.
            (out, out_cut, status), (err, err_cut, _) = await asyncio.wait_for(readers, 2.0)
        except TimeoutError:
            (out, out_cut, status), (err, err_cut) = (b"", True, None), (b"", True)
        code_started = out[:1] == b"S"
        out = out[1:] if code_started else out
        if ended:
            exit_code = int(status)
        else:
            exit_code = proc.returncode
            if self.isolation == "namespaces" and exit_code is not None and exit_code > 128:
                exit_code = 128 - exit_code  # the namespace's shell reports "killed by signal N" as 128 + N
        result = SandboxResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=out_cut or err_cut,
            duration_s=time.monotonic() - start,
            isolation=self.isolation,
            uid=uid,
            code_started=code_started,
        )
        result.notes = self._notes(result)
        return result, ended

    def _notes(self, r: SandboxResult) -> list[str]:
        notes = []
        if r.timed_out:
            notes.append(f"timed out after {self.limits.wall_timeout_s:g}s; the process was killed")
        sig = -r.exit_code if r.exit_code is not None and r.exit_code < 0 else None
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and not r.timed_out):
            notes.append(f"killed: CPU time limit of {self.limits.cpu_time_s}s exceeded")
        if sig == signal.SIGXFSZ or "File too large" in r.stderr:
            notes.append(f"file size limit of {self.limits.file_size_mb} MB exceeded")
        if "MemoryError" in r.stderr:
            notes.append(f"memory limit of {self.limits.memory_mb} MB exceeded")
        if not r.code_started and not r.timed_out:
            notes.append("the sandbox died before it ran the code")
        if r.truncated:
            notes.append(f"output truncated to {self.limits.max_output_bytes} bytes per stream")
        return notes


async def _read_output(stream: PipeReader, cap: int, end: bytes = b"",
                       suffix: int = 0) -> tuple[bytes, bool, bytes | None]:
    """Read `stream` up to `end` and the `suffix` bytes after it (to end-of-file when `end` is empty or never
    comes), keeping the first `cap` bytes before it. Returns what was kept, whether more came, and the
    suffix (None: `end` never came)."""
    kept = bytearray()
    truncated = False
    pending = bytearray()  # read, not yet kept: may hold the start of `end`

    def keep(data: bytes | bytearray) -> None:
        nonlocal truncated
        room = cap - len(kept)
        kept.extend(data[:max(room, 0)])
        truncated = truncated or len(data) > room

    while chunk := await stream.read(65536):
        pending += chunk
        if not end:
            keep(pending)
            pending.clear()
            continue
        at = pending.find(end)
        if at < 0:
            cut = max(len(pending) - len(end) + 1, 0)  # a partial `end` may be at the tail
            keep(pending[:cut])
            del pending[:cut]
        elif len(pending) >= at + len(end) + suffix:
            keep(pending[:at])
            return bytes(kept), truncated, bytes(pending[at + len(end):at + len(end) + suffix])
    at = pending.find(end) if end else -1
    keep(pending[:at] if at >= 0 else pending)
    return bytes(kept), truncated, None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

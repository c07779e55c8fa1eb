"""Python sandbox containment: hostile code is contained and reported as a tool response, the host is unharmed.

Every test runs through the real `python` tool behind its `ToolRunner` (as the agent loop calls it),
in each isolation mode this machine supports: "namespaces" (unshare + privilege drop, the sandbox) and,
for the resource limits only, "rlimits_unsafe" (chosen explicitly; not a sandbox). The escapes that
"rlimits_unsafe" leaves open are tested closed in "namespaces" mode, and the weak mode is refused unless
it is named.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout.tools import ToolRegistry
from rollout.tools.sandbox import SandboxLimits, SandboxWorker
from rollout.tools.sandbox_isolation import WORKDIR_PREFIX, find_interpreter, namespaces_available, workdir_parent
from rollout.tools.sandbox_pool import SandboxPool

AS_ROOT = os.geteuid() == 0
MODES = [
    pytest.param(
        "namespaces",
        marks=pytest.mark.skipif(
            not namespaces_available(shutil.which("unshare"), AS_ROOT), reason="unshare cannot create namespaces here"
        ),
    ),
    "rlimits_unsafe",
]
HAS_NAMESPACES = namespaces_available(shutil.which("unshare"), AS_ROOT)
needs_namespaces = pytest.mark.skipif(not HAS_NAMESPACES, reason="unshare cannot create namespaces here")


@pytest.fixture(autouse=True, params=["asyncio", "uvloop", "uvloop-pool"])
def event_loop_policy(request):
    """Every sandbox test runs on both loops: SGLang installs uvloop as the asyncio policy when imported,
    so in a training run the tools execute on uvloop (whose subprocess API differs from asyncio's). The
    "-pool" run repeats them on warm sandboxes (`pool_size: 2`, filled before the first call)."""
    previous = asyncio.get_event_loop_policy()
    if request.param.startswith("uvloop"):
        uvloop = pytest.importorskip("uvloop")
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    yield request.param
    asyncio.set_event_loop_policy(previous)


@pytest.fixture
def python_runner(event_loop_policy):
    """`python_runner(isolation, **config)`: the `python` tool behind its runner; each runner draws sandbox uids
    from its own range. Its pool (when the config or the loop param asks for one) is full before the first
    call and closed after the test."""
    registries = []

    def make(isolation: str, **overrides):
        low = random.randrange(10_000_000, 900_000_000)
        config = {
            "uid_range": [low, low + 1000],
            "isolation": isolation,
            "timeout_s": 6,
            "cpu_time_s": 3,
            "memory_mb": 512,
            "file_size_mb": 4,
            "max_processes": 32,
            "max_output_bytes": 4096,
            "pool_size": 2 if event_loop_policy.endswith("-pool") else 0,
            **overrides,
        }
        registry = ToolRegistry.from_config({"tools": [{"class_name": "rollout.tools.python_tool.PythonTool",
                                                        "config": config, "tool_schema": PYTHON_SCHEMA}]})
        registries.append(registry)
        runner = registry.runner("python")
        if runner.tool.pool is not None:
            runner.tool.pool.start()
            assert runner.tool.pool.wait_ready(60), "the sandbox pool did not fill within 60 s"
        return runner

    yield make
    for registry in registries:
        asyncio.run(registry.aclose())


PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "run code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def run_code(runner, code: str):
    async def go():
        async with runner.session() as iid:
            return await runner.execute(iid, {"code": code})

    return asyncio.run(go())


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (uid, parent pid, state) of every process on the host."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (entry.stat().st_uid, int(fields[1]), fields[0])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return table


def sandbox_processes(runner, include_idle: bool = False) -> set[int]:
    """Live (not zombie) processes running as one of the runner's sandbox uids; without `include_idle`, the
    idle warm workers of the runner's pool (and everything under them) are left out."""
    low, high = runner.tool.sandbox.uid_range
    table = _proc_table()
    idle = set() if include_idle or runner.tool.pool is None else set(runner.tool.pool.idle_pids())

    def under_idle(pid: int) -> bool:
        while pid > 1 and pid in table:
            if pid in idle:
                return True
            pid = table[pid][1]
        return False

    return {pid for pid, (uid, _, state) in table.items()
            if low <= uid < high and state not in ("Z", "X") and not under_idle(pid)}


def survivors(runner, include_idle: bool = False) -> set[int]:
    """Sandbox processes still alive after a run (SIGKILLed ones get a moment to exit)."""
    deadline = time.monotonic() + 3.0
    while (left := sandbox_processes(runner, include_idle)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def assert_later_calls_work(runner) -> None:
    result = run_code(runner, "print(sum(range(10)))")
    assert result.error is None and "exit_code: 0" in result.text and "stdout:\n45" in result.text


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_reading_files_outside_the_sandbox_is_denied(isolation, tmp_path, python_runner):
    """Containment: /etc/shadow, /root and a secret in another temp dir are unreadable; the secret is intact."""
    if not AS_ROOT and isolation == "rlimits_unsafe":
        pytest.skip("without root there is no other user to drop to; only namespaces hide the caller's files")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    runner = python_runner(isolation)
    code = f"""
import os
for path in ["/etc/shadow", {str(secret)!r}]:
    try:
        print(path, "READ", open(path).read())
    except OSError as e:
        print(path, "DENIED", type(e).__name__)
try:
    print("/root", "LIST", os.listdir("/root"))
except OSError as e:
    print("/root", "DENIED", type(e).__name__)
"""
    result = run_code(runner, code)
    assert result.error is None and "exit_code: 0" in result.text
    assert "TOP-SECRET-42" not in result.text and "READ" not in result.text
    assert f"{secret} DENIED" in result.text and "/etc/shadow DENIED" in result.text
    # /root is either unreadable (rlimits) or an empty tmpfs over it (namespaces).
    assert "/root DENIED" in result.text or "/root LIST []" in result.text
    assert secret.read_text() == "TOP-SECRET-42"
    assert_later_calls_work(runner)


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_network_is_unreachable(isolation, python_runner):
    """Containment: a socket connection to a server the host is listening on fails; the server sees nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept_loop(stop):
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except (TimeoutError, OSError):
                pass

    stop = threading.Event()
    thread = threading.Thread(target=accept_loop, args=(stop,))
    thread.start()
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')"
        result = run_code(python_runner(isolation), code)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert result.error is None  # the tool ran; the *code* failed
    assert "CONNECTED" not in result.text and "exit_code: 1" in result.text
    assert ("Network is unreachable" in result.text) or ("is not allowed" in result.text)
    assert accepted == []


@pytest.mark.integration
@pytest.mark.parametrize("isolation", MODES)
def test_fork_bomb_is_limited_and_cleaned_up(isolation, python_runner):
    """Containment: forking 1000 processes stops at the process limit; no forked process outlives the run."""
    if not AS_ROOT:
        pytest.skip("RLIMIT_NPROC is enforced only when privileges are dropped to a sandbox uid")
    code = """
import os, time
n = 0
for i in range(1000):
    try:
        pid = os.fork()
    except OSError as e:
        print("FORK FAILED", type(e).__name__)
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    n += 1
print("FORKED", n)
"""
    runner = python_runner(isolation, timeout_s=4)
    result = run_code(runner, code)
    assert "FORK FAILED" in result.text
    forked = int(result.text.split("FORKED ")[1].split()[0])
    assert forked < 32
    leftovers = survivors(runner)
    assert leftovers == set(), f"sandbox processes survived the run: {leftovers}"
    assert_later_calls_work(runner)


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_allocating_4gb_fails_with_memory_error(isolation, python_runner):
    """Containment: a 4 GB allocation fails inside the sandbox (MemoryError) and is reported; the host is fine."""
    runner = python_runner(isolation)
    result = run_code(runner, "x = bytearray(4 * 1024 ** 3)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in result.text and "MemoryError" in result.text
    assert "[memory limit of 512 MB exceeded]" in result.text
    assert_later_calls_work(runner)


_FORK_HOOK_LOG: list[str] = []  # where `_after_fork_in_child` marks a child (empty: hook off)


def _after_fork_in_child() -> None:
    if _FORK_HOOK_LOG:
        os.close(os.open(f"{_FORK_HOOK_LOG[0]}.{os.getpid()}", os.O_CREAT | os.O_WRONLY, 0o600))


os.register_at_fork(after_in_child=_after_fork_in_child)  # once per process: hooks cannot be unregistered


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_limits_are_set_by_exec_and_no_python_runs_between_fork_and_exec(isolation, python_runner, tmp_path):
    """Containment without Python code in the forked child: the code sees exactly the configured limits and no
    supplementary groups, set by `prlimit` / `setpriv` in the exec chain, and no at-fork hook of this process
    ever ran in a sandbox's child. Python code run between fork and exec in this (threaded) process can wait
    forever on a lock another thread held at the fork: GSM8K runs hung so, first with a preexec function, then
    in uvloop's spawn, which runs `PyOS_AfterFork_Child` (and with it these hooks) in every child it forks."""
    _FORK_HOOK_LOG[:] = [str(tmp_path / "forked")]
    try:
        runner = python_runner(isolation, cpu_time_s=3)
        code = ("import os, resource as r\n"
                "print([r.getrlimit(getattr(r, 'RLIMIT_' + k)) for k in ('CPU', 'AS', 'FSIZE', 'NPROC', 'NOFILE', 'CORE')])\n"
                "print('GROUPS', os.getgroups())")
        result = run_code(runner, code)
    finally:
        _FORK_HOOK_LOG.clear()
    mb = 1024 * 1024
    open_files = SandboxLimits().max_open_files  # the fixture's config: CPU 3 s, 512 MB, 4 MB files, 32 processes
    expected = [(3, 4), (512 * mb,) * 2, (4 * mb,) * 2, (32,) * 2, (open_files,) * 2, (0, 0)]
    assert str([tuple(x) for x in expected]) in result.text, result.text
    if AS_ROOT:
        assert "GROUPS []" in result.text
    assert list(tmp_path.glob("forked.*")) == [], "Python ran in a forked child before its exec"


@pytest.mark.integration
@pytest.mark.parametrize("isolation", MODES)
def test_infinite_loop_is_killed_and_reported(isolation, python_runner):
    """Containment: an endless loop is killed (CPU limit or wall-clock timeout) and the model is told why.
    The wall-clock limit leaves a loaded machine time for the later call on the same runner."""
    runner = python_runner(isolation, timeout_s=10, cpu_time_s=1)
    result = run_code(runner, "while True:\n    pass")
    assert result.error is None and not result.timed_out  # the sandbox stopped it, not the runner
    assert ("CPU time limit of 1s exceeded" in result.text) or ("timed out after" in result.text)
    assert result.metrics["exit_code"] < 0
    assert_later_calls_work(runner)


@pytest.mark.integration
@pytest.mark.parametrize("isolation", MODES)
def test_runner_timeout_cancels_and_kills_the_sandbox(isolation, python_runner):
    """Cancellation: when the runner's timeout fires first, the sandbox's process group is killed, not leaked."""
    if not AS_ROOT:
        pytest.skip("processes are identified by the sandbox uid, drawn only when privileges are dropped")
    runner = python_runner(isolation, timeout_s=1, wall_timeout_s=60, cpu_time_s=60)
    result = run_code(runner, "import time\ntime.sleep(60)")
    assert result.timed_out and "timed out after 1s" in result.text
    assert survivors(runner) == set()
    assert_later_calls_work(runner)


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_huge_output_and_huge_files_are_capped(isolation, python_runner):
    """Containment: 1 MB of output is truncated (and flagged); a file beyond the size limit cannot be written."""
    runner = python_runner(isolation)
    result = run_code(runner, "print('y' * 1_000_000)")
    assert result.metrics["truncated"] and "[output truncated to 4096 bytes per stream]" in result.text
    assert len(result.text) < 6000
    result = run_code(runner, "open('big.bin', 'wb').write(b'0' * (8 * 1024 * 1024))\nprint('WROTE')")
    assert "WROTE" not in result.text and "File too large" in result.text
    assert "[file size limit of 4 MB exceeded]" in result.text


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_code_runs_in_its_own_fresh_directory(isolation, python_runner):
    """Each run starts in an empty private working directory that it may write to; nothing carries over."""
    runner = python_runner(isolation)
    first = run_code(
        runner,
        "import os\nprint(sorted(os.listdir('.')))\nopen('note.txt', 'w').write('hi')\nprint(open('note.txt').read())",
    )
    assert "stdout:\n[]\nhi" in first.text
    second = run_code(runner, "import os\nprint(sorted(os.listdir('.')))")
    assert "stdout:\n[]" in second.text


@pytest.mark.unit
def test_empty_code_argument_is_reported(python_runner):
    """A call without code gets an error message naming the argument, not a crash."""
    result = run_code(python_runner("rlimits_unsafe"), "   ")
    assert "argument 'code' must be non-empty Python code" in result.text


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_concurrent_runs_get_distinct_unprivileged_uids(isolation, python_runner):
    """Concurrent runs run as different unprivileged uids, so they cannot signal each other or share a
    process quota; each one's output is its own."""
    if not AS_ROOT:
        pytest.skip("uids are drawn only when privileges are dropped")
    runner = python_runner(isolation)

    async def go():
        async def one(k):
            async with runner.session() as iid:
                return await runner.execute(iid, {"code": f"import os\nprint(os.getuid(), os.getgid(), {k})"})

        return await asyncio.gather(*(one(k) for k in range(4)))

    results = asyncio.run(go())
    low, high = runner.tool.sandbox.uid_range
    ids = [tuple(int(x) for x in r.text.split("stdout:\n")[1].split()) for r in results]
    assert [k for _, _, k in ids] == [0, 1, 2, 3]
    uids = [uid for uid, _, _ in ids]
    assert len(set(uids)) == 4 and all(low <= u < high for u in uids)
    assert all(uid == gid for uid, gid, _ in ids)
    assert [r.metrics["uid"] for r in results] == uids


ENDINGS = {  # code -> (exit code, stdout, the end of stderr)
    "print('done')": (0, "done", ""),
    "import sys\nprint('out')\nsys.exit(3)": (3, "out", ""),
    "import sys\nsys.exit(130)": (130, "", ""),
    "import sys\nsys.exit('bad input')": (1, "", "bad input"),
    "def f():\n    raise ValueError('boom')\nf()": (1, "", 'File "<stdin>", line 3, in <module>\n  File "<stdin>", '
                                                        "line 2, in f\nValueError: boom"),
    "def f(:\n    pass": (1, "", "SyntaxError: invalid syntax"),
    "import os\nprint('kept', flush=True)\nos._exit(7)": (7, "kept", ""),
    "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()":
        (0, "joined", ""),
    "import atexit\natexit.register(print, 'at exit')\nprint('first')": (0, "first\nat exit", ""),
    "import os\nif os.fork() == 0:\n    print('child')\nelse:\n    os.wait()\n    print('parent')":
        (0, "child\nparent", ""),
    "print(input())": (1, "", "EOFError: EOF when reading a line"),
}


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_a_run_ends_as_the_interpreter_would(isolation, python_runner):
    """The result comes back when the code ends (before the sandbox is torn down) and is what `python` gives:
    SystemExit's status or message, a traceback of the code's own frames only, non-daemon threads joined,
    atexit handlers run, a forked child that returns from the code ending without cutting its parent short,
    `os._exit`'s status with the output before it, and no stdin."""
    runner = python_runner(isolation)
    # One at a time: without dropped privileges every run counts against one user's RLIMIT_NPROC.
    for (code, (exit_code, stdout, stderr_end)), result in zip(ENDINGS.items(), [run_code(runner, c) for c in ENDINGS]):
        assert result.metrics["exit_code"] == exit_code, (code, result.text)
        out = result.text.split("stdout:\n", 1)[1].split("\nstderr:\n")[0].rstrip("\n") if stdout else ""
        assert out == stdout, (code, result.text)
        err = result.text.split("stderr:\n", 1)[1].rstrip("\n") if "stderr:\n" in result.text else ""
        assert err.endswith(stderr_end) and "_polyturn" not in err and "<warm>" not in err, (code, result.text)
        assert not result.metrics.get("timed_out"), (code, result.text)
    assert survivors(runner) == set()


@pytest.mark.integration
@pytest.mark.parametrize("isolation", MODES)
def test_output_printed_before_a_kill_is_kept(isolation, python_runner):
    """Output is unbuffered: what the code printed before it was killed still reaches the model."""
    runner = python_runner(isolation, timeout_s=8, cpu_time_s=1)  # the CPU limit kills it; wall slack for a loaded machine
    result = run_code(runner, "print('step 1 done')\nwhile True:\n    pass")
    assert "stdout:\nstep 1 done" in result.text and result.metrics["exit_code"] < 0


@pytest.mark.unit
def test_shipped_python_tool_config_runs_code():
    """tool_configs/python_tool_config.yaml builds a working `python` tool in namespaces mode (the sandbox)."""
    if not HAS_NAMESPACES:
        pytest.skip("the shipped config asks for namespaces, which this machine cannot create")
    registry = ToolRegistry.from_config(
        Path(__file__).resolve().parents[1] / "tool_configs" / "python_tool_config.yaml"
    )
    runner = registry.runner("python")
    try:
        result = run_code(runner, "import math\nprint(math.factorial(10))")
    finally:
        asyncio.run(registry.aclose())
    assert result.error is None and "stdout:\n3628800" in result.text
    assert result.metrics["isolation"] == "namespaces"
    assert registry.counts() == {"python": (1, 1)}


# ---------------------------------------------------------------- the escapes rlimits mode leaves open


@pytest.mark.unit
@pytest.mark.parametrize("isolation", ["rlimits", "auto", "none"])
def test_weak_or_unknown_isolation_is_refused_unless_named_unsafe(isolation, caplog, python_runner):
    """No silent fallback: only 'namespaces' or an explicit 'rlimits_unsafe' (which warns) build a sandbox."""
    with pytest.raises(Exception, match="rlimits_unsafe"):
        python_runner(isolation)
    with caplog.at_level("WARNING", logger="rollout.tools.sandbox"):
        python_runner("rlimits_unsafe")
    assert "NOT a sandbox" in caplog.text


@pytest.mark.unit
@needs_namespaces
def test_world_readable_files_outside_the_work_dir_are_not_visible(tmp_path, top_level_dir, python_runner):
    """Escape 1 closed: a world-readable file in a world-readable directory of the host cannot be read from
    inside, wherever it lives: the test's temp dir, the repository, a top-level directory no list names (as a
    CI runner's checkout root is)."""
    paths = [tmp_path / "public" / "readable.txt", top_level_dir / "readable.txt"]
    for secret in paths:
        secret.parent.mkdir(mode=0o755, exist_ok=True)
        secret.write_text("WORLD-READABLE-7")
        secret.chmod(0o644)
    paths.append(Path(__file__).resolve())
    code = f"""
for path in {[str(p) for p in paths]!r}:
    try:
        print("READ", open(path).read()[:40])
    except OSError as e:
        print("DENIED", type(e).__name__)
"""
    result = run_code(python_runner("namespaces"), code)
    assert "WORLD-READABLE-7" not in result.text and "READ" not in result.text
    assert result.text.count("DENIED") == 3


@pytest.fixture
def top_level_dir():
    """A fresh world-readable directory directly under / (skips where / is not writable)."""
    path = Path(f"/polyturn-sandbox-probe-{random.randrange(10**9)}")
    try:
        path.mkdir(mode=0o755)
    except OSError:
        pytest.skip("/ is not writable here")
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.unit
@needs_namespaces
def test_an_interpreter_outside_the_system_dirs_runs_while_its_neighbours_stay_covered(top_level_dir, python_runner):
    """The interpreter's own prefix is bound back when it lives under a covered top-level directory; the
    rest of that directory stays covered."""
    python = top_level_dir / "py" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    shutil.copy2(os.path.realpath(find_interpreter(None, AS_ROOT)), python)
    os.chmod(top_level_dir / "py", 0o755)
    os.chmod(python.parent, 0o755)
    (top_level_dir / "neighbour.txt").write_text("NEIGHBOUR-9")
    (top_level_dir / "neighbour.txt").chmod(0o644)
    code = f"""
import os, sys
print("EXE", os.path.realpath(sys.executable))
print("TOP", sorted(os.listdir({str(top_level_dir)!r})))
"""
    result = run_code(python_runner("namespaces", python_executable=str(python)), code)
    assert "exit_code: 0" in result.text, result.text
    assert f"EXE {python}" in result.text
    assert "TOP ['py']" in result.text and "NEIGHBOUR-9" not in result.text


@pytest.mark.unit
@needs_namespaces
def test_files_left_in_tmp_var_tmp_dev_shm_do_not_outlive_the_call(python_runner):
    """Escape 2 closed: files written to /tmp, /var/tmp and /dev/shm are not on the host and not seen by the
    next call."""
    tag = f"polyturn-escape-{random.randrange(10**9)}"
    runner = python_runner("namespaces")
    code = f"""
for d in ["/tmp", "/var/tmp", "/dev/shm"]:
    try:
        open(d + "/{tag}", "w").write("x")
        print("WROTE", d)
    except OSError as e:
        print("REFUSED", d, type(e).__name__)
"""
    run_code(runner, code)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(d, tag).exists(), f"{d}/{tag} outlived the call on the host"
    later = run_code(runner, f"import os\nprint([d for d in ['/tmp', '/var/tmp', '/dev/shm'] if os.path.exists(d + '/{tag}')])")
    assert "stdout:\n[]" in later.text


@pytest.mark.integration
@needs_namespaces
def test_setsid_double_fork_does_not_outlive_the_call(tmp_path, python_runner):
    """Escape 3 closed: a grandchild detached with setsid (out of the run's process group) dies with the call."""
    runner = python_runner("namespaces")
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
print("detached")
"""
    result = run_code(runner, code)
    assert "detached" in result.text
    assert survivors(runner) == set()


@pytest.mark.unit
@needs_namespaces
def test_code_that_strips_python_guards_still_cannot_reach_the_host(python_runner):
    """Escape 4 closed: without any in-process hook to remove, code that starts programs and opens sockets
    reaches neither the host's network nor its files."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    tag = f"polyturn-escape-{random.randrange(10**9)}"
    code = f"""
import os, socket, subprocess
subprocess.run(["/bin/sh", "-c", "echo x > /tmp/{tag}"])
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("CONNECTED")
except OSError as e:
    print("NO NETWORK", type(e).__name__)
"""
    try:
        result = run_code(python_runner("namespaces"), code)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "NO NETWORK" in result.text and "CONNECTED" not in result.text
    assert not Path("/tmp", tag).exists()


# ---------------------------------------------------------------- the warm pool (rollout.tools.sandbox_pool)


@pytest.fixture
def pool_loop(event_loop_policy):
    """The pool tests run once per loop (the "-pool" param would only repeat the uvloop run)."""
    if event_loop_policy.endswith("-pool"):
        pytest.skip("pool tests set their own pool; covered by the asyncio and uvloop runs")
    return event_loop_policy


@pytest.mark.unit
@needs_namespaces
def test_a_pooled_call_never_sees_another_calls_state(pool_loop, python_runner):
    """Isolation between calls on one pool: a call that sets globals and environment, writes files, and leaves
    a thread and a child process behind; the next call (also warm) sees none of it, and the child is gone."""
    runner = python_runner("namespaces", pool_size=1)
    first = run_code(runner, """
import builtins, os, subprocess, sys, threading, time
builtins.LEAKED = sys.LEAKED = 1
os.environ["LEAKED"] = "1"
open("/tmp/leaked", "w").write("x")
open("leaked-cwd", "w").write("x")
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen(["sleep", "60"])
print("LEFT", threading.active_count(), child.pid)
""")
    assert first.metrics["warm"] and "LEFT 2" in first.text, first.text
    assert survivors(runner) == set()
    assert runner.tool.pool.wait_ready(60)
    second = run_code(runner, """
import builtins, os, sys, threading
others = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid()))
print("SEEN", hasattr(builtins, "LEAKED"), hasattr(sys, "LEAKED"), "LEAKED" in os.environ,
      os.path.exists("/tmp/leaked"), os.path.exists("leaked-cwd"), threading.active_count(), others)
""")
    assert second.metrics["warm"] and (second.metrics["uid"] != first.metrics["uid"] or not AS_ROOT)
    assert "SEEN False False False False False 1 []" in second.text, second.text


@pytest.mark.integration
@needs_namespaces
def test_pool_replaces_dead_and_timed_out_workers(pool_loop, python_runner):
    """A worker killed while idle is skipped and replaced; a call that times out is killed and replaced; the
    pool is full again after both and every later call works."""
    runner = python_runner("namespaces", pool_size=2, wall_timeout_s=2)
    pool = runner.tool.pool
    os.killpg(pool.idle_pids()[0], 9)
    assert_later_calls_work(runner)
    result = run_code(runner, "import time\ntime.sleep(60)")
    assert result.metrics["exit_code"] < 0 and "timed out after 2s" in result.text
    assert pool.wait_ready(60) and len(pool.idle_pids()) == 2
    assert survivors(runner) == set()
    assert_later_calls_work(runner)


@pytest.mark.unit
@pytest.mark.parametrize("isolation", MODES)
def test_closing_the_pool_leaves_no_process(isolation, pool_loop, python_runner):
    """Shutdown: after a call, closing the tool kills every idle worker: no sandbox process is left, and the
    closed pool refuses further runs with a message saying so."""
    if not AS_ROOT:
        pytest.skip("processes are identified by the sandbox uid, drawn only when privileges are dropped")
    runner = python_runner(isolation, pool_size=3)
    assert len(runner.tool.pool.idle_pids()) == 3
    assert_later_calls_work(runner)
    asyncio.run(runner.tool.close())
    assert survivors(runner, include_idle=True) == set()
    with pytest.raises(RuntimeError, match="pool is closed"):
        run_code(runner, "print(1)")


@pytest.mark.integration
@needs_namespaces
def test_workers_die_with_their_owner(pool_loop):
    """No orphans even without close: when the process owning a pool is killed, its workers exit on the
    end-of-file of their stdin. Killed here: a full pool's idle workers, a used worker that waits for its
    teardown (held back by a call still running; the child process its code left behind dies with it) and
    that running call's worker, once its code ends."""
    if not AS_ROOT:
        pytest.skip("processes are identified by the sandbox uid, drawn only when privileges are dropped")
    low = random.randrange(10_000_000, 900_000_000)
    owner = f"""
import asyncio, os
from rollout.tools import sandbox_pool
from rollout.tools.sandbox import Sandbox
sandbox_pool._QUIET_WAIT_S = 600  # the upkeep waits for the running call: the used worker stays
pool = sandbox_pool.SandboxPool(Sandbox(uid_range=({low}, {low + 1000})), 4)
pool.start()
assert pool.wait_ready(60)

async def main():
    busy = asyncio.ensure_future(pool.run("import time\\ntime.sleep(5)"))
    await asyncio.sleep(0.2)
    done = await pool.run("import subprocess\\nprint(subprocess.Popen(['sleep', '60']).pid)")
    assert done.exit_code == 0 and not busy.done(), done
    assert len(pool._used) == 1 and len(pool.idle_pids()) == 2, (pool._used, pool.idle_pids())
    print("READY", flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", owner], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert "READY" in proc.stdout, proc.stderr[-2000:]

    def left():
        return {pid for pid, (uid, _, state) in _proc_table().items() if low <= uid < low + 1000 and state not in "ZX"}

    assert left(), "nothing to check: the owner's workers were gone before it was killed"
    deadline = time.monotonic() + 20.0  # the busy call's code ends 5 s after it started
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == set()


@pytest.mark.unit
def test_closing_a_filling_pool_releases_the_workers_already_started(pool_loop):
    """Shutdown while filling: a worker whose start ended before `close` cancelled the others' is released (its
    process killed, its uid and work dir freed), not dropped with the cancelled batch of starts."""
    started, released = [], []

    class StubSandbox:
        async def start_worker(self):
            if started:
                await asyncio.Event().wait()  # the second start never ends: close cancels it
            started.append(SandboxWorker(None, None, None))
            return started[-1]

        async def discard(self, worker):
            released.append(worker)

        finish = discard

    pool = SandboxPool(StubSandbox(), 2)
    pool.start()
    deadline = time.monotonic() + 10
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.close()
    assert started and released == started


# ---------------------------------------------------------------- rlimits_unsafe work dirs (sandbox_isolation)

# Hostile programs for the work dir's removal. Each writes slowly (a few ms apart), and a process it leaves behind
# ends by itself within 3 s: on code that does not kill it, it must not burden the machine.
_WRITE_LOOP = """
import os, time
def write_forever(end=time.time() + 3):
    while time.time() < end:
        try:
            os.makedirs(f"w{os.getpid()}/{time.time_ns() % 20}", exist_ok=True)
        except OSError:
            pass
        time.sleep(0.002)
    os._exit(0)
"""
HOSTILE_RUNS = {
    # cancelled by the runner's timeout (as an agent loop aborting) while it and its child write
    "cancelled mid-run": (_WRITE_LOOP + "if os.fork() == 0:\n    write_forever()\ntime.sleep(60)",
                          {"timeout_s": 1, "wall_timeout_s": 60}),
    # the wall-clock timeout kills a group whose child ignores SIGTERM and SIGXCPU
    "timeout, child ignores SIGTERM/SIGXCPU": (
        _WRITE_LOOP + "import signal\nfor s in (signal.SIGTERM, signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n    write_forever()\ntime.sleep(60)", {"wall_timeout_s": 1, "cpu_time_s": 1}),
    "output flood": ("import os\nfor _ in range(64):\n    os.write(1, b'x' * 65536)", {}),
    # escapes the process group (setsid + fork, open in rlimits_unsafe) and writes on after the run ended
    "background writers": (_WRITE_LOOP + "if os.fork() == 0:\n    os.setsid()\n    for _ in range(3):\n"
                           "        if os.fork() == 0:\n            write_forever()\n    os._exit(0)\ntime.sleep(0.2)", {}),
    "permissions taken away": ("import os\nos.makedirs('a/b/c')\nopen('a/b/c/f', 'w').close()\nos.chmod('a/b/c', 0)\n"
                               "os.chmod('a/b', 0o500)\nos.chmod('a', 0)\nos.chmod('.', 0o500)", {}),
    "a tree deeper than rmtree recurses": ("import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')", {}),
}


def own_workdirs() -> set[str]:
    """The rlimits_unsafe work dirs made by this process (named after its pid)."""
    return set(glob.glob(os.path.join(workdir_parent(), f"{WORKDIR_PREFIX}{os.getpid()}-*")))


@pytest.mark.unit
@pytest.mark.parametrize("program", list(HOSTILE_RUNS))
def test_hostile_runs_leave_no_work_dir(program, event_loop_policy, python_runner):
    """Cleanup on every way out: whatever the code does to its work dir or however the run ends (cancelled, timed
    out, flooding, writers escaped from its group, permissions removed, a deep tree), once its tool is closed no
    work dir of it is left. The cold path (asyncio) and the warm one (uvloop-pool) each; the plain uvloop run
    would repeat the cold one."""
    if event_loop_policy == "uvloop":
        pytest.skip("the work dir's removal does not depend on the loop: the asyncio run covers the cold path")
    code, overrides = HOSTILE_RUNS[program]
    before = own_workdirs()  # taken before the pool (if any) makes the work dir the call runs in
    runner = python_runner("rlimits_unsafe", **overrides)
    result = run_code(runner, code)
    assert result.error is None or result.timed_out, result.error
    asyncio.run(runner.tool.close())
    assert own_workdirs() - before == set()


@pytest.mark.unit
def test_building_a_sandbox_sweeps_work_dirs_of_dead_processes_only(pool_loop, python_runner):
    """The sweep: a work dir left by a process that is gone (killed before its cleanup) is removed when an
    rlimits_unsafe sandbox is built, here by starting a pool; one of a live process (another pool on this host) is
    kept."""
    if pool_loop != "asyncio":
        pytest.skip("no loop is involved: one run is enough")
    with subprocess.Popen(["true"]) as gone, subprocess.Popen(["sleep", "30"]) as alive:
        gone.wait()
        stale, live = (Path(workdir_parent(), f"{WORKDIR_PREFIX}{p.pid}-test") for p in (gone, alive))
        try:
            for path in (stale, live):
                (path / "sub").mkdir(parents=True)
                (path / "sub" / "f").write_text("x")
            os.chmod(stale / "sub", 0)
            python_runner("rlimits_unsafe", pool_size=1)
            assert not stale.exists() and (live / "sub" / "f").exists()
        finally:
            alive.kill()
            shutil.rmtree(live, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)

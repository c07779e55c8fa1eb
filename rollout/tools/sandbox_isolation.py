"""How a sandboxed interpreter is contained (`rollout.tools.sandbox`): the host probes (an interpreter the sandbox
user can run, whether `unshare` works), the command lines that confine it: `prlimit` / `setpriv` for the resource
limits and the unprivileged uid, `unshare` for the namespaces and the allow-listed root (see sandbox.py's docstring
for what each layer holds back), and the host work dirs of "rlimits_unsafe" runs.

A work dir is named after the process that made it (`polyturn-sandbox-<pid>-...`) and is removed whatever the run
did to it: processes that escaped the run's group and keep writing into it are killed, permissions it took away
are given back, a tree too deep for `shutil.rmtree` goes to `rm -rf`. Dirs whose maker died before removing
them (killed, or exited without closing its tool) are swept when a later sandbox is built; a live maker's are not.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.tools.sandbox import SandboxLimits

logger = logging.getLogger(__name__)

WORKDIR_PREFIX = "polyturn-sandbox-"  # then the pid of the process that made it, "-", mkdtemp's random part
_REMOVE_TRIES = 5  # removals of a work dir, the n-th after a 10 * 2**n ms pause (310 ms in all)

# Top-level entries a sandboxed run sees; everything else in / is covered (see rollout.tools.sandbox).
DEFAULT_VISIBLE_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/sys", "/tmp")


def _world_executable(path: str) -> bool:
    """True when `path` (symlinks resolved) and every directory above it are usable by any user."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not os.stat(real).st_mode & 0o001:
        return False
    return all(os.stat(parent).st_mode & 0o001 for parent in real.parents)


def workdir_parent() -> str:
    """Where rlimits_unsafe work dirs go: the temp dir, unless the sandbox's unprivileged uid could not
    reach it (a private TMPDIR such as one made by `mktemp -d`); then /tmp."""
    parent = tempfile.gettempdir()
    reachable = all(os.stat(p).st_mode & 0o001 for p in (Path(parent), *Path(parent).parents))
    return parent if reachable else "/tmp"


def make_workdir() -> str:
    """A fresh rlimits_unsafe work dir, named after this process (for `sweep_workdirs`)."""
    return tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=workdir_parent())


def remove_workdir(path: str, uid: int | None) -> bool:
    """Remove a run's work dir, whatever the run left in it; True when it is gone. `uid`: the uid the run had to
    itself (None: it ran as this process's user). Never raises. After a failed try: every process that may still
    write into it is killed, and, when not root, permissions are given back (root needs none, and must not
    follow links the run made)."""
    for attempt in range(_REMOVE_TRIES):
        try:
            shutil.rmtree(path, ignore_errors=True)
        except RecursionError:  # nested deeper than Python 3.12's recursive rmtree goes
            try:
                subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                pass
        if not os.path.lexists(path):
            return True
        _kill_writers(path, uid)
        if os.geteuid() != 0:
            _restore_permissions(path)
        time.sleep(0.01 * 2**attempt)
    logger.warning("sandbox: could not remove the work dir %s", path)
    return False


def _kill_writers(workdir: str, uid: int | None) -> None:
    """SIGKILL the processes that may still write into `workdir` (the run's, dying or escaped from its process
    group): those running as `uid`, drawn for the run alone, or without one, those whose working directory is
    inside `workdir`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if uid is not None:
                status = Path(entry.path, "status").read_text()
                ours = status.split("\nUid:", 1)[1].split()[0] == str(uid)
            else:
                cwd = os.readlink(os.path.join(entry.path, "cwd"))
                ours = cwd == workdir or cwd.startswith(workdir + "/")
            if ours:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, IndexError):
            pass


def _restore_permissions(top: str) -> None:
    """Give this user rwx on every directory under `top`, each before it is listed (iteratively: any depth)."""
    stack = [top]
    while stack:
        path = stack.pop()
        try:
            os.chmod(path, 0o700)
            stack += [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass


def sweep_workdirs() -> None:
    """Remove the work dirs left by processes that are gone (named `WORKDIR_PREFIX<pid>-...`, see `make_workdir`);
    a live process's dirs, symlinks and names of another form are left alone."""
    for entry in os.scandir(workdir_parent()):
        pid, sep, _ = entry.name.removeprefix(WORKDIR_PREFIX).partition("-")
        if entry.name.startswith(WORKDIR_PREFIX) and sep and pid.isdigit() and not _pid_alive(int(pid)):
            if entry.is_dir(follow_symlinks=False):
                remove_workdir(entry.path, None)  # not by its owner's uid: anyone may make a dir so named


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def find_interpreter(preferred: str | None, drop_privileges: bool) -> str:
    """A python3 the sandbox user can run: `preferred`, else /usr/bin/python3, PATH's python3, ours."""
    candidates = [preferred] if preferred else ["/usr/bin/python3", shutil.which("python3"), sys.executable]
    for cand in candidates:
        if cand and os.path.exists(cand) and (not drop_privileges or _world_executable(cand)):
            return cand
    raise RuntimeError(
        f"no python interpreter usable by the sandbox user among {candidates}; "
        "install python3 in a world-readable location (e.g. apt-get install python3) or set python_executable"
    )


@functools.lru_cache(maxsize=8)
def namespaces_available(unshare: str | None, as_root: bool) -> bool:
    """Whether `unshare` can create the namespaces the sandbox uses (probed once per process)."""
    if unshare is None:
        return False
    argv = [unshare, *_unshare_flags(as_root), "--", "/bin/sh", "-c", "mount -t tmpfs tmpfs /tmp"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _cover_commands(visible: tuple[str, ...], keep: str) -> list[str]:
    """Shell commands (run as namespace root, after the fresh /tmp is mounted) that cover every top-level
    entry of / outside `visible`: directories with an empty read-only tmpfs, files with /dev/null. When
    `keep` (the interpreter prefix) lies under a covered directory, it is bound back read-only through a
    staging mount in the fresh /tmp."""
    q = shlex.quote
    cmds = []
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        top = "/" + entry.name
        if top in visible or entry.is_symlink() or keep == top:
            continue
        if entry.is_file():
            cmds.append(f"mount --bind /dev/null {q(top)}")
        elif not entry.is_dir():
            continue
        elif keep.startswith(top + "/"):
            cmds += [
                f"mkdir /tmp/.keep && mount --bind {q(keep)} /tmp/.keep",
                f"mount -t tmpfs -o size=16k,mode=755 tmpfs {q(top)}",
                f"mkdir -p {q(keep)} && mount --move /tmp/.keep {q(keep)} && rmdir /tmp/.keep",
                f"mount -o remount,bind,ro {q(keep)} && mount -o remount,ro {q(top)}",
            ]
        else:
            cmds.append(f"mount -t tmpfs -o size=16k,mode=755,ro tmpfs {q(top)}")
    return cmds


def _unshare_flags(as_root: bool) -> list[str]:
    flags = ["--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc"]
    return flags if as_root else ["--user", "--map-root-user", *flags]


def limits_argv(limits: SandboxLimits, prlimit: str, setpriv: str | None, uid: int | None = None) -> list[str]:
    """The command prefix that sets the resource limits (inherited by everything it starts) and, given `uid`,
    switches to that unprivileged uid/gid with no supplementary groups, then execs the rest: util-linux's
    `prlimit` and `setpriv`. Not a preexec function: Python code between fork and exec in a process with
    other threads (Ray's, the engine client's) can wait forever on a lock one of them held at the fork, and
    the call then never starts (seen in a GSM8K run: the child stuck before exec, the rollout hung)."""
    mb = 1024 * 1024
    argv = [prlimit, f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}", f"--as={limits.memory_mb * mb}",
            f"--fsize={limits.file_size_mb * mb}", f"--nproc={limits.max_processes}",
            f"--nofile={limits.max_open_files}", "--core=0", "--"]
    if uid is not None:
        argv += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return argv


def namespace_argv(unshare: str, as_root: bool, disk_mb: int, visible: tuple[str, ...], python: str, script: str,
                   uid: int | None) -> list[str]:
    """The command that starts `python -c script` in fresh namespaces: a `disk_mb` /tmp, a small /dev/shm, the
    root covered outside `visible` (the interpreter's prefix bound back) and, given `uid`, as that uid with no
    capabilities. It runs as (namespace) root first to set up mounts, then starts python as a child of the
    shell (not exec: PID 1 of a namespace ignores signals such as SIGXCPU)."""
    setup = [
        f"mount -t tmpfs -o size={disk_mb}m,mode=1777 tmpfs /tmp",
        "{ mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm 2>/dev/null || true; }",
    ]
    # The interpreter's installation prefix (`<prefix>/bin/python3`): bound back when covered.
    setup += _cover_commands(visible, str(Path(os.path.realpath(python)).parents[1]))
    drop = ""
    if uid is not None:
        drop = (
            f"setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs "
            "--inh-caps=-all --bounding-set=-all -- "
        )
    command = " && ".join(setup) + f" && cd /tmp && {drop}'{python}' -I -u -c {shlex.quote(script)}"
    return [unshare, *_unshare_flags(as_root), "--", "/bin/sh", "-c", command]

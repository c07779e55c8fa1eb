"""How a sandboxed interpreter is contained (`rollout.tools.sandbox`): the host probes (an interpreter the sandbox
user can run, whether `unshare` works) and the command lines that confine it: `prlimit` / `setpriv` for the resource
limits and the unprivileged uid, `unshare` for the namespaces and the allow-listed root (see sandbox.py's docstring
for what each layer holds back).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.tools.sandbox import SandboxLimits

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

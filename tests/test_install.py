"""scripts/install.sh: which Python 3.12 it picks, and the one-line refusals (no Python 3.12; --system over a
torch that SGLang cannot run with). Fake interpreters and tools on a PATH of their own; nothing is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# The tools install.sh uses before it installs anything; the PATH of these tests holds only these and the fakes.
TOOLS = ("bash", "sh", "cat", "sha256sum", "cut", "ls", "sort", "rm", "date", "mktemp", "dirname", "echo")


def _fake_python(path: Path, version: str, torch: str | None = None) -> Path:
    """An executable that answers like Python `version` (and, with `torch`, like one that imports that torch)."""
    major_minor = ".".join(version.split(".")[:2])
    torch_case = f'*importlib.metadata*) echo "{torch}" ;;' if torch else '*importlib.metadata*) exit 1 ;;'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/bin/sh
case "$*" in
  -V) echo "Python {version}" ;;
  *version_info*) [ "{major_minor}" = "3.12" ] ;;
  {torch_case}
  *) echo "fake python: $*" >&2; exit 3 ;;
esac
""")
    path.chmod(0o755)
    return path


@pytest.fixture
def sandbox(tmp_path):
    """A copy of install.sh and pyproject.toml, and a bin/ with only the tools it needs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return tmp_path


def _run(sandbox: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": str(sandbox / "bin"), "HOME": str(sandbox)}
    return subprocess.run(["bash", str(sandbox / "scripts" / "install.sh"), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=False, cwd=sandbox,
                          executable=shutil.which("bash"))


def test_python_is_found_in_the_documented_order(sandbox):
    """Contract: PYTHON, else python3.12 on the PATH, else pyenv's newest 3.12, else uv's; a PATH with none finds
    none."""
    assert _run(sandbox, "--which-python").stdout == ""
    uv_python = _fake_python(sandbox / "uv-pythons" / "python3.12", "3.12.3")
    (sandbox / "bin" / "uv").write_text(f'#!/bin/sh\n[ "$1 $2 $3" = "python find 3.12" ] && echo {uv_python}\n')
    (sandbox / "bin" / "uv").chmod(0o755)
    assert _run(sandbox, "--which-python").stdout.strip() == str(uv_python)
    for version in ("3.12.1", "3.12.9", "3.11.7"):
        _fake_python(sandbox / "pyenv" / "versions" / version / "bin" / f"python{version[:4]}", version)
    (sandbox / "bin" / "pyenv").write_text(f'#!/bin/sh\n[ "$1" = root ] && echo {sandbox / "pyenv"}\n')
    (sandbox / "bin" / "pyenv").chmod(0o755)
    newest = sandbox / "pyenv" / "versions" / "3.12.9" / "bin" / "python3.12"
    assert _run(sandbox, "--which-python").stdout.strip() == str(newest)
    on_path = _fake_python(sandbox / "bin" / "python3.12", "3.12.5")
    assert _run(sandbox, "--which-python").stdout.strip() == str(on_path)
    chosen = _fake_python(sandbox / "elsewhere" / "python", "3.12.7")
    assert _run(sandbox, "--which-python", PYTHON=str(chosen)).stdout.strip() == str(chosen)


def test_no_python_312_is_one_line_saying_what_to_install(sandbox):
    done = _run(sandbox)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "needs Python 3.12" in done.stderr and "pyenv install 3.12" in done.stderr
    old = _fake_python(sandbox / "old" / "python", "3.11.7")
    done = _run(sandbox, PYTHON=str(old))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"PYTHON={old} is Python 3.11.7" in done.stderr
    assert not (sandbox / ".venv").exists()


def test_system_install_refuses_a_torch_sglang_cannot_run_naming_both(sandbox):
    """Contract: `--system` over an NGC-style torch build that is not the one sglang pins stops before pip, in
    one line naming the installed torch and the one needed; a local build label of the right version passes
    that check (it reaches pip, absent from this PATH)."""
    ngc = _fake_python(sandbox / "ngc" / "python", "3.12.3", torch="2.9.0a0+50eac811a6.nv25.09")
    done = _run(sandbox, "--system", PYTHON=str(ngc))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "2.9.0a0+50eac811a6.nv25.09" in done.stderr and "needs torch 2.14.1" in done.stderr
    right = _fake_python(sandbox / "right" / "python", "3.12.3", torch="2.14.1+cu128")
    done = _run(sandbox, "--system", PYTHON=str(right))
    assert "cannot run sglang" not in done.stderr and "fake python: -m pip install" in done.stderr
    old = _fake_python(sandbox / "old" / "python", "3.11.7", torch="2.14.1+cu128")
    done = _run(sandbox, "--system", PYTHON=str(old))
    assert done.returncode == 2 and "needs Python 3.12" in done.stderr and done.stderr.count("\n") == 1


def test_the_installs_pin_sglangs_torch():
    """Contract: install.sh's TORCH_VERSION is the torch that the installed sglang requires (so --system's check
    and the venv's torch follow the sglang pin)."""
    from importlib.metadata import requires

    pins = [r for r in requires("sglang") if r.replace(" ", "").startswith("torch==")]
    assert len(pins) == 1
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert f"TORCH_VERSION={pins[0].split('==')[1].split(';')[0].strip()} " in text, pins

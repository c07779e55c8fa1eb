"""The wandb login check before Ray (`recipe.tracking.wandb_login_problem`, raised by
`recipe.preflight.check_wandb_login` from `recipe.main_ppo.prepare`).

Contract: `trainer.logger` with wandb on a machine with no wandb login and no API key is a launch mistake: one line
naming trainer.logger and the fixes, exit 2, no traceback, before Ray or any worker starts (wandb.init would
otherwise fail only after every worker and engine has started). wandb's own lookup decides: WANDB_API_KEY or a
~/.netrc entry is a login; WANDB_MODE=offline or disabled needs none. Each case runs in a fresh process with HOME
pointed at an empty directory (wandb reads its settings once per process).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.tasks import gsm8k, write_rows

REPO = Path(__file__).resolve().parents[1]
CHECK = "from recipe.tracking import wandb_login_problem; print(wandb_login_problem(['console', 'wandb']))"
FIXES = "run `wandb login`, set WANDB_API_KEY, set WANDB_MODE=offline, or drop wandb from trainer.logger"


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This session's environment with an empty HOME and none of wandb's credentials or mode."""
    drop = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "NETRC")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0", **extra}


def _check(home: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=_env(home, **extra))


@pytest.mark.unit
def test_no_login_is_refused_naming_the_key_and_fixes(tmp_path):
    """Contract: online wandb with no key anywhere is one line naming trainer.logger and every fix."""
    line = _check(tmp_path).stdout.strip().splitlines()[-1]
    assert line.startswith("trainer.logger=['console', 'wandb'] includes wandb but no wandb login") and FIXES in line


@pytest.mark.unit
def test_a_malformed_key_is_refused_naming_it(tmp_path):
    """Contract: a WANDB_API_KEY wandb would refuse (too short) is one line naming it and the fix."""
    line = _check(tmp_path, WANDB_API_KEY="short").stdout.strip().splitlines()[-1]
    assert "includes wandb but its credentials are unusable (WANDB_API_KEY invalid" in line
    assert line.endswith("run `wandb login` again or fix WANDB_API_KEY")


@pytest.mark.unit
@pytest.mark.parametrize("how", ["offline", "disabled", "api_key", "netrc"])
def test_offline_mode_or_a_login_passes(tmp_path, how):
    """Contract: WANDB_MODE=offline / disabled, WANDB_API_KEY or a ~/.netrc entry for wandb's host pass the check."""
    extra = {"offline": {"WANDB_MODE": "offline"}, "disabled": {"WANDB_MODE": "disabled"},
             "api_key": {"WANDB_API_KEY": "a" * 40}}.get(how, {})
    if how == "netrc":
        probe = "from wandb.sdk import wandb_setup; print(wandb_setup.singleton().settings.base_url)"
        url = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env=_env(tmp_path)).stdout.strip().splitlines()[-1]
        netrc = tmp_path / ".netrc"
        netrc.write_text(f"machine {url.split('://', 1)[-1]}\n  login user\n  password {'b' * 40}\n")
        netrc.chmod(0o600)
    proc = _check(tmp_path, **extra)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "None", proc.stdout + proc.stderr[-2000:]


@pytest.mark.integration
def test_the_entry_point_refuses_it_before_ray(tiny_model_dir, tmp_path):
    """Contract: `python -m recipe.main_ppo ... trainer.logger=[console,wandb]` with no login exits 2 with one
    `polyturn: error:` line for it (beside the batch larger than the data, refused in the same run) and no traceback,
    starting nothing; with WANDB_MODE=offline the same launch passes the check and is refused for the batch alone,
    still before Ray."""
    rows = [gsm8k.make_row({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}, "train", i) for i in range(4)]
    write_rows(rows, tmp_path / "train.parquet")
    home = tmp_path / "home"
    home.mkdir()
    argv = [sys.executable, "-m", "recipe.main_ppo", "--config-name", "cpu_tiny",
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"trainer.default_local_dir={tmp_path / 'out'}", "trainer.logger=[console,wandb]", "data.train_batch_size=8"]

    def run(**extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(home, **extra))
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr + proc.stdout and "ray" not in proc.stderr.lower()
        return proc, [ln for ln in proc.stderr.splitlines() if ln.startswith("polyturn: error: ")]

    _, errors = run()  # both refusals at once: the login, and the batch checked beside it
    assert len(errors) == 2 and "trainer.logger=['console', 'wandb'] includes wandb but no wandb login" in errors[0]
    assert FIXES in errors[0] and "data.train_batch_size=8 exceeds the 4 prompts" in errors[1], errors
    _, errors = run(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"))
    assert len(errors) == 1 and "data.train_batch_size=8 exceeds the 4 prompts" in errors[0], errors
    assert not (tmp_path / "out" / "metrics.jsonl").exists()

"""recipe.logs.setup_logging under a real Hydra entry point, in a fresh process: Hydra's log file keeps the whole
log, third-party import noise is dropped in the process and in the processes it starts, other warnings stay."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

APP = '''
import logging, subprocess, sys, warnings
import hydra
from recipe.logs import setup_logging

CHILD = """
import warnings
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
warnings.warn("Only CUDA, HIP and XPU support AWQ currently.")
warnings.warn("child: a warning that matters")
"""

@hydra.main(config_path=None, config_name=None, version_base="1.3")
def main(cfg) -> None:
    setup_logging()
    logging.getLogger("polyturn.test").info("first line")
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
    subprocess.run([sys.executable, "-c", CHILD], check=True)  # inherits PYTHONWARNINGS, as Ray workers do
    logging.getLogger("polyturn.test").info("last line")

main()
'''


@pytest.mark.unit
def test_hydra_log_file_gets_the_whole_log_and_import_noise_is_filtered(tmp_path):
    """Contract: after setup_logging in a Hydra job, `<run dir>/<job>.log` holds every INFO line (Hydra's file
    handler is kept, not replaced); the TransformerEngine / Apex / AWQ warnings and torch's "No CUDA runtime"
    line are gone from this process and from a child process; a child's unrelated warning still shows."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run([sys.executable, str(app), f"hydra.run.dir={tmp_path / 'run'}"], check=False,
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "run" / "app.log").read_text()
    assert "INFO polyturn.test: first line" in log and "INFO polyturn.test: last line" in log
    console = out.stdout + out.stderr
    assert "first line" in console and "last line" in console
    for noise in ("Transformer Engine", "Apex", "AWQ", "No CUDA runtime"):
        assert noise not in console + log, noise
    assert "child: a warning that matters" in console

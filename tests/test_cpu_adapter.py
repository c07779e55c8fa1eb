"""CPU adapter contract: Megatron-Core is adapted by one explicit call at a process's start
(`megatron_workers.cpu_compat.apply_cpu_compat()`), never as an import side effect; importing the
Megatron modules without it fails loudly, naming the call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_standins

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(cpu_standins.gpu_present(), reason="the adapter changes nothing with a GPU")]

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_megatron_import_before_the_call_fails_naming_it_and_one_call_adapts_the_process():
    code = ("try:\n"
            "    import megatron_workers.model\n"
            "except ImportError as e:\n"
            "    print('REFUSED' if 'cpu_compat.apply_cpu_compat()' in str(e) else 'OTHER')\n"
            "from megatron_workers import cpu_compat\n"
            "backend = cpu_compat.apply_cpu_compat()\n"
            "import torch, megatron_workers.actor, megatron.core.utils as u\n"
            "print(backend, torch.cuda.current_device(), u.torch.zeros(1, device='cuda').device,\n"
            "      cpu_compat.apply_cpu_compat())")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["REFUSED", "gloo", "cpu", "cpu", "gloo"]

"""The GPU path's guards and the one-GPU check, on a CPU.

Contracts: a node whose driver lists GPUs that torch cannot use (a driver older than the wheel's CUDA) is
refused at install time and before a run places anything, with one line naming the driver version and the
wheel's CUDA, while logical GPUs declared to Ray on a CPU machine are not (`cpu_standins.gpu_mismatch`, fed
fakes of nvidia-smi and Ray); every GPU-path import is verified after an install; `scripts/gpu_check.py
--small` runs the bf16 actor's whole check on a CPU and ends with its JSON line, ok, figures marked CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import cpu_standins
from cpu_standins import GpuProbe, gpu_mismatch, install_problems, probe_gpus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n"


def fake_nvidia_smi(args: list[str]) -> str | None:
    return LISTING if args == ["-L"] else "535.104.05\n535.104.05\n"


def test_probe_reads_the_driver_and_names_it_with_the_wheels_cuda_when_torch_sees_no_gpu():
    """Contract: the silent CPU fallback (driver lists GPUs, torch sees none) is one line naming the driver
    version and the CUDA the torch wheel was built for."""
    probe = probe_gpus(fake_nvidia_smi)
    assert (probe.driver_gpus, probe.driver_version) == (2, "535.104.05")
    assert probe.torch_gpus == 0  # this machine has no GPU
    problem = gpu_mismatch(probe)
    assert problem is not None and "\n" not in problem
    assert "535.104.05" in problem and f"CUDA {torch.version.cuda or 'none'}" in problem
    assert gpu_mismatch(probe, ray_gpus=8.0) == problem  # Ray's count does not excuse it
    assert probe_gpus(lambda args: None).driver_gpus == 0  # no nvidia-smi: no driver GPUs


@pytest.mark.parametrize("driver, torch_gpus, ray, refused", [
    (8, 8, 8.0, False),   # a GPU node as it should be
    (8, 8, None, False),  # install time: Ray not asked
    (0, 0, 8.0, False),   # logical GPUs declared to Ray on a CPU machine (placement tests)
    (0, 0, 0.0, False),   # a CPU machine
    (8, 0, 8.0, True),    # the driver is older than the wheel's CUDA: torch sees nothing
    (8, 8, 0.0, True),    # Ray started without the node's GPUs: ranks would get CPU bundles
])
def test_gpu_mismatch_decisions(driver, torch_gpus, ray, refused):
    """Contract: which disagreements between the driver, torch and Ray stop a run."""
    probe = GpuProbe(driver, "550.54.15" if driver else None, torch_gpus, "2.14.1+cu130", "13.0")
    problem = gpu_mismatch(probe, ray)
    assert (problem is not None) == refused
    if refused:
        assert "550.54.15" in problem and "CUDA 13.0" in problem


def test_a_run_stops_before_placing_anything_when_ray_and_torch_disagree(monkeypatch):
    """Contract: `check_ray_node_gpus` (called by main_ppo once Ray is up) reads this node's GPUs from Ray
    and raises with the one-line reason; logical GPUs on a driverless machine pass."""
    nodes = [{"NodeID": "other", "Resources": {"GPU": 0.0}}, {"NodeID": "mine", "Resources": {"GPU": 8.0}}]
    fake_ray = types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(get_node_id=lambda: "mine"),
                                     nodes=lambda: nodes)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(cpu_standins, "probe_gpus", lambda: GpuProbe(8, "525.60.13", 0, "2.14.1+cu130", "13.0"))
    with pytest.raises(RuntimeError, match=r"nvidia-smi lists 8 GPU\(s\) but torch sees none .*525\.60\.13.*CUDA 13\.0"):
        cpu_standins.check_ray_node_gpus()
    monkeypatch.setattr(cpu_standins, "probe_gpus", lambda: GpuProbe(0, None, 0, "2.14.1+cu130", "13.0"))
    cpu_standins.check_ray_node_gpus()


def test_install_check_verifies_each_gpu_path_import():
    """Contract: after an install on a GPU node every GPU-path module must import; each failure is named,
    and a node whose GPUs torch cannot see is reported without trying the imports."""
    ok = GpuProbe(2, "580.65.06", 2, "2.14.1+cu130", "13.0")
    assert install_problems(ok, ("json", "math")) == []
    problems = install_problems(ok, ("json", "polyturn_no_such_module"))
    assert len(problems) == 1 and "polyturn_no_such_module" in problems[0]
    blind = GpuProbe(2, "535.104.05", 0, "2.14.1+cu130", "13.0")
    assert install_problems(blind, ("polyturn_no_such_module",)) == [gpu_mismatch(blind)]


def test_install_sh_gpu_step_stops_on_a_driver_torch_cannot_use(tmp_path):
    """Contract: `python -m cpu_standins check-install` (install.sh's GPU step) exits 1 with the driver and
    the wheel's CUDA when nvidia-smi lists GPUs torch cannot see (a fake nvidia-smi on PATH here)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0)"; '
                    'else echo "470.82.01"; fi\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-m", "cpu_standins", "check-install"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    assert "470.82.01" in done.stderr and f"CUDA {torch.version.cuda}" in done.stderr
    assert "check-install" in (ROOT / "scripts" / "install.sh").read_text()


def test_gpu_check_small_runs_on_cpu_and_ends_with_its_json_line(dist_backend, capsys):
    """Contract: the one-GPU check runs on a CPU (--small): log-probs, 3 PPO updates under the host/device
    checker, offload/onload, bf16 bucket export; its last line is JSON with every key, ok=true, mfu null and
    the device marked CPU."""
    from scripts import gpu_check

    assert gpu_check.main(["--small"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(gpu_check.RESULT_KEYS) <= set(result)
    assert result["ok"] is True and result["failed"] == []
    assert result["device"].startswith("cpu") and result["mfu"] is None
    assert result["tokens_per_s"] > 0 and result["export_gbps"] > 0 and result["peak_mem_gb"] > 0
    assert 0 <= result["logprob_gap_bf16_fp32"] < gpu_check.LOGPROB_GAP_LIMIT

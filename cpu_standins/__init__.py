"""Import stand-ins for CUDA-only packages, put on the import path only when no GPU is present.

SGLang imports a handful of names from `sgl_kernel` (whose PyPI wheels are CUDA-only) on its CPU
path, and megatron-core imports `flash_mla` while catching only ImportError (the real package
raises OSError without `libcuda.so.1`). `site/` holds stand-ins for both. They are reached through
`sys.path` for this process and `PYTHONPATH` for every subprocess (SGLang's scheduler and
detokenizer, Ray workers). A stand-in function raises on any call. When `POLYTURN_STANDIN_LOG`
names a file, every import of a stand-in and every call is recorded there ('<event> <pid>' lines),
so tests can show that the stand-ins were in use and that none of them ran.

Whether the stand-ins apply is decided by `gpu_present()` alone, so a node whose GPUs torch cannot
use (a driver older than the torch wheel's CUDA) would fall back to the CPU path silently: `probe_gpus`,
`gpu_mismatch` and `check_ray_node_gpus` turn that into an error naming the driver and the wheel's CUDA,
at install time (`scripts/install.sh`) and before a run places anything (`recipe.main_ppo`).
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "site"
GPU_IMPORTS = ("torch", "sgl_kernel", "flash_mla", "sglang.srt.entrypoints.engine", "megatron.core.models.gpt", "ray")
"""What the GPU path imports that a CPU machine replaces or never loads (`install_problems`)."""


def gpu_present() -> bool:
    """True when torch sees a CUDA device (then the stand-ins are never used)."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class GpuProbe:
    """What this node's NVIDIA driver and this process's torch say about GPUs."""

    driver_gpus: int  # GPUs `nvidia-smi -L` lists (0 without nvidia-smi)
    driver_version: str | None  # nvidia-smi's driver version
    torch_gpus: int  # torch.cuda.device_count() when torch.cuda.is_available(), else 0
    torch_version: str  # torch.__version__
    torch_cuda: str | None  # torch.version.cuda: the CUDA the wheel was built for (None: a CPU-only build)

    def versions(self) -> str:
        return (f"driver {self.driver_version or 'unknown'}, torch {self.torch_version} built for CUDA "
                f"{self.torch_cuda or 'none (a CPU-only build)'}")


def _nvidia_smi(args: list[str]) -> str | None:
    """stdout of `nvidia-smi *args`, or None when it is not installed or fails (no driver)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout if done.returncode == 0 else None


def probe_gpus(nvidia_smi: Callable[[list[str]], str | None] = _nvidia_smi) -> GpuProbe:
    """Ask the driver (`nvidia_smi(args) -> stdout or None`) and torch what GPUs this node has."""
    import torch

    listing = nvidia_smi(["-L"]) or ""
    version = (nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"]) or "").split()
    return GpuProbe(driver_gpus=sum(line.startswith("GPU ") for line in listing.splitlines()),
                    driver_version=version[0] if version else None,
                    torch_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                    torch_version=torch.__version__, torch_cuda=torch.version.cuda)


def gpu_mismatch(probe: GpuProbe, ray_gpus: float | None = None) -> str | None:
    """One line saying why this node's GPUs and torch disagree (a silent CPU fallback, or GPUs Ray was not
    given), or None when they agree. `ray_gpus`: the GPUs Ray reports for this node (None: not asked).

    GPUs declared to Ray on a machine without an NVIDIA driver (`ray.init(num_gpus=8)` to test a GPU
    placement on a CPU) are logical ones, not a mismatch.
    """
    if probe.driver_gpus and not probe.torch_gpus:
        return (f"nvidia-smi lists {probe.driver_gpus} GPU(s) but torch sees none ({probe.versions()}): the driver "
                "must support the wheel's CUDA; upgrade the driver or install a torch build for its CUDA "
                "(scripts/install.sh), else polyturn would run on the CPU path")
    if ray_gpus is not None and probe.torch_gpus and not ray_gpus:
        return (f"torch sees {probe.torch_gpus} GPU(s) on this node but Ray reports none for it ({probe.versions()}); "
                "start Ray with its GPUs (ray start --num-gpus=N) or hide them (CUDA_VISIBLE_DEVICES=) to run on CPU")
    return None


def check_ray_node_gpus() -> None:
    """Refuse a run whose driver-node GPUs disagree with torch or Ray (`gpu_mismatch`); call once Ray is up,
    before anything is placed. Raises RuntimeError with the one-line reason."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    problem = gpu_mismatch(probe_gpus(), node.get("Resources", {}).get("GPU", 0.0))
    if problem:
        raise RuntimeError(problem)


def install_problems(probe: GpuProbe, modules: tuple[str, ...] = GPU_IMPORTS) -> list[str]:
    """What keeps a node whose driver lists GPUs from the GPU path after an install: torch not seeing them
    (`gpu_mismatch`; then nothing else is tried), or each GPU-path module that fails to import."""
    problem = gpu_mismatch(probe)
    if problem:
        return [problem]
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - OSError (a missing libcuda) as much as ImportError
            failed.append(f"GPU path import {name} failed: {type(e).__name__}: {e}")
    return failed


def activate() -> bool:
    """Put the stand-ins first on sys.path and PYTHONPATH when no GPU is present; idempotent.

    Returns True if the stand-ins are active. Must run before the first import of sglang or megatron. Only the two
    adapters call it, each once at the start of a process that runs its library: `megatron_workers.cpu_compat.
    apply_cpu_compat` (the driver, the Megatron rank actors) and `rollout.sglang_cpu.engine_kwargs_for_this_machine`
    (an engine's process, as it starts the engine); the processes they start inherit PYTHONPATH.
    """
    if gpu_present():
        return False
    path = str(STANDIN_DIR)
    for name in ("sgl_kernel", "flash_mla"):
        mod = sys.modules.get(name)
        if mod is not None and not str(getattr(mod, "__file__", "") or "").startswith(path):
            raise RuntimeError(
                f"{name} was imported from {mod.__file__} before cpu_standins.activate(); "
                "call activate() before importing sglang or megatron."
            )
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
    return True

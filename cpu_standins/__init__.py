"""Import stand-ins for CUDA-only packages, put on the import path only when no GPU is present.

SGLang imports a handful of names from `sgl_kernel` (whose PyPI wheels are CUDA-only) on its CPU
path, and megatron-core imports `flash_mla` while catching only ImportError (the real package
raises OSError without `libcuda.so.1`). `site/` holds stand-ins for both. They are reached through
`sys.path` for this process and `PYTHONPATH` for every subprocess (SGLang's scheduler and
detokenizer, Ray workers). A stand-in function raises on any call. When `POLYTURN_STANDIN_LOG`
names a file, every import of a stand-in and every call is recorded there ('<event> <pid>' lines),
so tests can show that the stand-ins were in use and that none of them ran.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "site"
LOG_ENV = "POLYTURN_STANDIN_LOG"


def gpu_present() -> bool:
    """True when torch sees a CUDA device (then the stand-ins are never used)."""
    import torch

    return torch.cuda.is_available()


def activate() -> bool:
    """Put the stand-ins first on sys.path and PYTHONPATH when no GPU is present; idempotent.

    Returns True if the stand-ins are active. Must run before the first import of sglang or megatron.
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


def recorded_events(log_path: str | os.PathLike) -> list[str]:
    """Events recorded in `log_path`: 'import <module> <pid>' and 'call <module.function> <pid>' lines."""
    p = Path(log_path)
    return p.read_text().splitlines() if p.exists() else []

"""CPU stand-in for `sgl_kernel` (its PyPI wheels are CUDA-only and fail to import without libcuda).

Exposes exactly the names SGLang imports on its CPU path; each is a function that raises when called
(and records the call, see POLYTURN_STANDIN_LOG in cpu_standins), because running any of them for real would need
the CPU kernels this package does not have. `sgl_kernel.scalar_type` is pure Python and is loaded
from the real package. Any other name is missing, so `from sgl_kernel import x` raises ImportError
and SGLang's own fallbacks apply.
"""
from __future__ import annotations

import os
from importlib import metadata

try:
    __version__ = metadata.version("sglang-kernel")
except metadata.PackageNotFoundError:  # pragma: no cover - only without the real distribution
    __version__ = "0.0.0+polyturn-cpu-standin"


_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _record(event: str) -> None:
    log = os.environ.get("POLYTURN_STANDIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{event} {os.getpid()}\n")


_record("import sgl_kernel")


def _standin(name: str):
    def call(*args, **kwargs):
        _record(f"call sgl_kernel.{name}")
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but this is polyturn's CPU stand-in (no CPU kernel exists here). "
            "Run on a GPU machine, or change the configuration so this kernel is not needed."
        )

    call.__name__ = name
    call.__qualname__ = name
    return call


for _name in _NAMES:
    globals()[_name] = _standin(_name)
del _name

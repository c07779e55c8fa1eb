"""The only place that adapts SGLang to a CPU-only machine.

On a GPU machine `engine_kwargs_for_this_machine` returns the caller's kwargs unchanged. Without a
GPU it puts the `cpu_standins` import stand-ins on the path (SGLang's subprocesses inherit them
through PYTHONPATH), selects SGLang's own CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `device="cpu"`,
`attention_backend="torch_native"`), and bounds the KV cache: with default sizing the CPU engine
reserves ~15 GB, so `max_total_tokens` always gets a value.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import cpu_standins

logger = logging.getLogger(__name__)

#: KV-cache size (tokens) used on CPU when the caller did not choose one.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384

_CPU_FIXED = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}


def engine_kwargs_for_this_machine(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return `sglang.Engine` kwargs adapted to this machine (a copy; the input is not changed)."""
    kwargs = dict(engine_kwargs)
    if not cpu_standins.activate():
        return kwargs
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    for key, value in _CPU_FIXED.items():
        if key in kwargs and kwargs[key] != value:
            logger.warning("sglang %s=%r is not available on CPU; using %r", key, kwargs[key], value)
        kwargs[key] = value
    if kwargs.get("max_total_tokens") is None:
        kwargs["max_total_tokens"] = CPU_DEFAULT_MAX_TOTAL_TOKENS
    logger.info("SGLang on CPU: torch_native attention, max_total_tokens=%d", kwargs["max_total_tokens"])
    return kwargs

"""verl's `SandboxFusionTool` YAML on polyturn's local sandbox (the python tool).

verl's tool sends the model's code to a SandboxFusion service (`sandbox_fusion_url`); this one
runs it in polyturn's local sandbox (`rollout/tools/sandbox.py`, through `PythonTool`), so
verl's `sandbox_fusion_tool_config.yaml` loads unchanged. verl's config keys become the python
tool's (a polyturn key written in the same config wins):

    default_timeout (s, default 30)   -> timeout_s (the runner's limit; the sandbox's wall clock 1 s less)
    memory_limit_mb (default 1024)    -> memory_mb
    num_workers (10), rate_limit (10) -> max_concurrency: verl's rate_limit is a cap on calls in flight
                                         (with enable_global_rate_limit, the default), not calls per second
    default_language                  -> must be python (refused otherwise, naming the key)
    sandbox_fusion_url                -> not used: a warning at load says the code runs locally

Departs from verl: per-call `timeout` / `language` arguments are not read (the config's hold).
"""

from __future__ import annotations

import logging
from typing import Any

from rollout.tools.python_tool import PythonTool
from rollout.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)

_VERL_KEYS = ("sandbox_fusion_url", "num_workers", "rate_limit", "enable_global_rate_limit", "default_timeout",
              "default_language", "memory_limit_mb")


def python_tool_config(config: dict[str, Any], tool_name: str) -> dict[str, Any]:
    """verl's SandboxFusionTool config as PythonTool config (see the module docstring)."""
    verl = {k: config[k] for k in _VERL_KEYS if k in config}
    ours = {k: v for k, v in config.items() if k not in verl}
    language = verl.get("default_language", "python")
    if language != "python":
        raise ValueError(f"tool {tool_name!r}: config.default_language={language!r}: the local sandbox runs python "
                         "only; set default_language: python or drop the key")
    concurrency = int(verl.get("num_workers", 10))
    if verl.get("enable_global_rate_limit", True):
        concurrency = min(concurrency, int(verl.get("rate_limit", 10)))
    ours.setdefault("timeout_s", float(verl.get("default_timeout", 30)))
    ours.setdefault("memory_mb", int(verl.get("memory_limit_mb", 1024)))
    ours.setdefault("max_concurrency", concurrency)
    return ours


class SandboxFusionTool(PythonTool):
    """verl's `SandboxFusionTool` (config keys translated), running code in the local sandbox."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema):
        name = tool_schema.function.name
        if config.get("sandbox_fusion_url"):
            logger.warning("tool %r: config.sandbox_fusion_url is not used; polyturn runs the code in its local "
                           "sandbox (rollout/tools/sandbox.py)", name)
        super().__init__(python_tool_config(dict(config or {}), name), tool_schema)

"""`python` tool: runs the model's code in the sandbox and returns its output.

The model calls `{"name": "python", "arguments": {"code": "..."}}`; the response is the run's
exit code, stdout and stderr, with a note for every limit it hit (timeout, CPU, memory, file
size, truncated output). The step reward is 0.0: this tool computes, it does not grade.

Config keys (YAML `config`): `timeout_s` is the runner's limit and, minus one second, the
sandbox's wall-clock limit; `cpu_time_s`, `memory_mb`, `file_size_mb`, `max_processes`,
`disk_mb`, `max_output_bytes` map to `SandboxLimits`; `isolation` ("namespaces", the default,
or "rlimits_unsafe", which is not a sandbox); `python_executable`; `uid_range` ([low, high): uids drawn per run when running as root);
`pool_size` (default 0: every call starts its sandbox) keeps that many sandboxes started ahead
(`rollout.tools.sandbox_pool`: same containment, each used once; filling starts at the first `create`).
"""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any

from rollout.tools.base import BaseTool
from rollout.tools.sandbox import DEFAULT_UID_RANGE, Sandbox, SandboxLimits
from rollout.tools.sandbox_pool import SandboxPool
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class PythonTool(BaseTool):
    """Runs `parameters["code"]` (name of the argument: config `code_argument`, default "code")."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        limit_names = {f.name for f in fields(SandboxLimits)}
        limits = {k: v for k, v in self.config.items() if k in limit_names}
        if "wall_timeout_s" not in limits and "timeout_s" in self.config:
            # Leave the runner a second to collect the result before its own timeout fires.
            limits["wall_timeout_s"] = max(float(self.config["timeout_s"]) - 1.0, 0.5)
        self.code_argument = self.config.get("code_argument", "code")
        self.sandbox = Sandbox(
            SandboxLimits(**limits),
            isolation=self.config.get("isolation", "namespaces"),
            python_executable=self.config.get("python_executable"),
            uid_range=tuple(self.config.get("uid_range", DEFAULT_UID_RANGE)),
        )
        pool_size = int(self.config.get("pool_size", 0))
        self.pool = SandboxPool(self.sandbox, pool_size) if pool_size > 0 else None

    async def create(self, instance_id: str | None = None, **kwargs: Any):
        if self.pool is not None:
            self.pool.start()  # not at load: data preparation builds tools for their schemas only
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        code = parameters.get(self.code_argument)
        if not isinstance(code, str) or not code.strip():
            return (
                ToolResponse(text=f"Error: argument '{self.code_argument}' must be non-empty Python code."),
                0.0,
                {"exit_code": None},
            )
        result = await (self.pool or self.sandbox).run(code)
        metrics = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "truncated": result.truncated,
            "duration_s": result.duration_s,
            "isolation": result.isolation,
            "uid": result.uid,
            "warm": result.warm,
        }
        return ToolResponse(text=result.to_text()), 0.0, metrics

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)

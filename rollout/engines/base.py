"""The engine seam: what the agent loop needs from an inference engine.

An engine takes token ids and returns token ids. Nothing above this seam ever sees text
produced by re-tokenizing: the ids an engine returns are the ids that are trained on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class GenerateResult:
    """One engine call's output for one request."""

    output_ids: list[int]  # token ids the engine sampled, in order (never re-tokenized)
    output_logprobs: list[float]  # log-prob of each sampled id under the engine's policy
    finish_reason: str  # "stop" (EOS / stop token), "length" (max_new_tokens), "abort"
    weight_version: int  # version of the weights that produced these tokens
    meta: dict[str, Any] = field(default_factory=dict)  # engine-specific extras (timings, cached tokens)


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine the agent loop can drive concurrently from one asyncio loop."""

    name: str

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        """Continue `input_ids`; `sampling_params` use SGLang's names (temperature, top_p, max_new_tokens,
        stop_token_ids, regex, json_schema, ...). Returns finish_reason "abort" if aborted."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop an in-flight request; its `generate` returns with finish_reason "abort"."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded (bumped by every weight sync)."""
        ...

    @property
    def num_inflight(self) -> int:
        """Requests currently running on this engine (for least-loaded routing)."""
        ...


class EngineDeadError(RuntimeError):
    """An engine stopped serving: its process died, or it did not answer a health probe in time.

    Raised by an engine's `generate` (and its health probe); the router marks the engine dead and the agent loop
    retries the trajectory on an engine still alive. `engine` is the engine's name.
    """

    def __init__(self, engine: str, what: str) -> None:
        super().__init__(f"engine {engine}: {what}")
        self.engine = engine
        self.what = what

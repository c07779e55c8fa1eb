"""`BaseInteraction`: the plug-in signature of simulated users (verl-compatible).

An interaction plays the user in a multi-turn rollout: after the policy's turn ends without a
tool call, the agent loop asks it for the next user message. One interaction object serves
every trajectory routed to it; per-trajectory state lives under an `instance_id`:

    iid = await interaction.start_interaction(instance_id=None, **interaction_kwargs)
    should_terminate, text, score, metadata = await interaction.generate_response(iid, messages)
    score = await interaction.calculate_score(iid)
    await interaction.finalize_interaction(iid)                # always, also on errors/cancel

Call interactions through `rollout.interactions.runner.InteractionRunner`, which guarantees
`finalize_interaction` and turns exceptions and timeouts into a terminating turn.

Subclassing is optional: the loader takes any class with these methods. Departs from verl's
base: `calculate_score` and `finalize_interaction` take the `instance_id` (verl's base takes
none, so per-instance state can leak); classes written against verl's base signatures are
called without it. `name` defaults the way verl derives it (`Gsm8kInteraction` -> `gsm8k`).
"""

from __future__ import annotations

import uuid
from typing import Any

from rollout.plugins import verl_interaction_name


class BaseInteraction:
    """Base class of simulated users; override `generate_response` (and the rest as needed)."""

    def __init__(self, config: dict[str, Any]):
        self.config = dict(config or {})
        self.name: str = self.config.get("name") or verl_interaction_name(type(self).__name__)

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start a per-trajectory instance; `kwargs` are the sample's `interaction_kwargs`."""
        return instance_id or str(uuid.uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's next turn given the chat so far: (should_terminate, text, score, metadata)."""
        raise NotImplementedError(f"{type(self).__name__}.generate_response is not implemented; override it")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's score (the interaction reward of the trajectory)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's state. Called exactly once per start, also on errors and cancellation."""

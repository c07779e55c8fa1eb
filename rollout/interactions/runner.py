"""`InteractionRunner`: calls one interaction with a timeout, and always finalizes.

Exceptions and timeouts of `generate_response` become a terminating `InteractionTurn` with
`error` set (the trajectory ends with the `error` finish reason instead of crashing the run);
`session()` calls `finalize_interaction` on every exit, cancellation included, and the runner
counts starts and finalizations so tests and metrics can assert they are equal (the shared
lifecycle is `rollout.plugins.PluginRunner`). Calls follow verl's agent loop:
`start_interaction(instance_id, **interaction_kwargs)`, `generate_response(instance_id,
messages, **interaction_kwargs)`; `calculate_score` and `finalize_interaction` get the instance
id only when their signature takes it (verl's base takes none).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rollout.plugins import PluginConfigError, PluginRunner, verl_interaction_name

logger = logging.getLogger(__name__)


@dataclass
class InteractionTurn:
    """One simulated-user turn as the agent loop records it."""

    should_terminate: bool  # the interaction ends the conversation after this turn
    text: str  # the user message to append (may be empty when terminating)
    score: float = 0.0  # the turn's score (the interaction's reward signal)
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the interaction raised or timed out (then should_terminate is True)


class InteractionRunner(PluginRunner[Any]):
    """Runs one interaction; safe to share across trajectories."""

    kind = "interaction"

    def __init__(self, interaction: Any, timeout_s: float | None = None):
        config = dict(getattr(interaction, "config", None) or {})
        name = getattr(interaction, "name", None) or config.get("name") or verl_interaction_name(
            type(interaction).__name__)
        super().__init__(interaction, name)
        self.timeout_s = float(timeout_s if timeout_s is not None else config.get("timeout_s", 60.0))
        if self.timeout_s <= 0:
            raise PluginConfigError(f"interaction {self.name!r}: config.timeout_s must be > 0, got {self.timeout_s}")

    def session(self, **interaction_kwargs: Any):
        """`async with runner.session(**interaction_kwargs) as iid:` — finalize guaranteed."""
        return self._session(lambda: self._open(self.plugin.start_interaction(None, **interaction_kwargs)),
                             "finalize_interaction", {})

    async def respond(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> InteractionTurn:
        """The next user turn; never raises (except for cancellation of the caller)."""
        try:
            out = await self._timed(self.plugin.generate_response(instance_id, messages, **kwargs))
            should_terminate, text, score, metadata = out
            return InteractionTurn(bool(should_terminate), str(text or ""), float(score), dict(metadata or {}))
        except TimeoutError:
            logger.warning("interaction %r timed out after %.1fs", self.name, self.timeout_s)
            return InteractionTurn(True, "", 0.0, {}, error=f"timeout after {self.timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - an interaction failure ends this trajectory only
            logger.warning("interaction %r raised %s: %s", self.name, type(exc).__name__, exc)
            return InteractionTurn(True, "", 0.0, {}, error=f"{type(exc).__name__}: {exc}")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's score; a failure gives 0.0 and a logged error."""
        return await self.score("calculate_score", instance_id, **kwargs)

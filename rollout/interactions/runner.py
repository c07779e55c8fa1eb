"""`InteractionRunner`: calls one interaction with a timeout, and always finalizes.

Exceptions and timeouts of `generate_response` become a terminating `InteractionTurn` with
`error` set (the trajectory ends with the `error` finish reason instead of crashing the run);
`session()` calls `finalize_interaction` on every exit, cancellation included, and the runner
counts starts and finalizations so tests and metrics can assert they are equal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from rollout.interactions.base import BaseInteraction

logger = logging.getLogger(__name__)


@dataclass
class InteractionTurn:
    """One simulated-user turn as the agent loop records it."""

    should_terminate: bool  # the interaction ends the conversation after this turn
    text: str  # the user message to append (may be empty when terminating)
    score: float = 0.0  # the turn's score (the interaction's reward signal)
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the interaction raised or timed out (then should_terminate is True)


class InteractionRunner:
    """Runs one interaction; safe to share across trajectories."""

    def __init__(self, interaction: BaseInteraction, timeout_s: float | None = None):
        self.interaction = interaction
        self.name = interaction.name
        self.timeout_s = float(timeout_s if timeout_s is not None else interaction.config.get("timeout_s", 60.0))
        if self.timeout_s <= 0:
            raise ValueError(f"interaction {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        self.num_started = 0
        self.num_finalized = 0
        self.live_instances: set[str] = set()

    async def start(self, instance_id: str | None = None, **interaction_kwargs: Any) -> str:
        """Start an instance (time-limited) and count it; prefer `session`, which also finalizes it."""
        iid = await asyncio.wait_for(
            self.interaction.start_interaction(instance_id, **interaction_kwargs), self.timeout_s
        )
        if not isinstance(iid, str) or not iid:
            raise TypeError(
                f"interaction {self.name!r}: start_interaction() returned {iid!r}; return the instance id (str)"
            )
        self.num_started += 1
        self.live_instances.add(iid)
        return iid

    async def finalize(self, instance_id: str, **kwargs: Any) -> None:
        """Finalize once; errors and timeouts are logged, never raised."""
        if instance_id not in self.live_instances:
            logger.warning(
                "interaction %r: finalize of unknown or finalized instance %r ignored", self.name, instance_id
            )
            return
        self.live_instances.discard(instance_id)
        self.num_finalized += 1
        try:
            await asyncio.wait_for(self.interaction.finalize_interaction(instance_id, **kwargs), self.timeout_s)
        except Exception:  # noqa: BLE001
            logger.exception("interaction %r: finalize_interaction(%r) failed", self.name, instance_id)

    @asynccontextmanager
    async def session(self, instance_id: str | None = None, **interaction_kwargs: Any) -> AsyncIterator[str]:
        """`async with runner.session(**interaction_kwargs) as iid:` — finalize guaranteed."""
        iid = await self.start(instance_id, **interaction_kwargs)
        try:
            yield iid
        finally:
            await asyncio.shield(self.finalize(iid))

    async def respond(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> InteractionTurn:
        """The next user turn; never raises (except for cancellation of the caller)."""
        try:
            out = await asyncio.wait_for(
                self.interaction.generate_response(instance_id, messages, **kwargs), self.timeout_s
            )
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
        try:
            return float(
                await asyncio.wait_for(self.interaction.calculate_score(instance_id, **kwargs), self.timeout_s)
            )
        except Exception:  # noqa: BLE001
            logger.exception("interaction %r: calculate_score(%r) failed; using 0.0", self.name, instance_id)
            return 0.0

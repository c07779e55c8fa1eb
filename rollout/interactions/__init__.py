"""Simulated users for multi-turn rollouts: the `BaseInteraction` plug-in API, the YAML registry
with per-sample routing, the `InteractionRunner` that guarantees finalization, and built-ins."""

from rollout.interactions.base import BaseInteraction
from rollout.interactions.registry import InteractionConfigError, InteractionRegistry
from rollout.interactions.runner import InteractionRunner, InteractionTurn

__all__ = [
    "BaseInteraction",
    "InteractionConfigError",
    "InteractionRegistry",
    "InteractionRunner",
    "InteractionTurn",
]

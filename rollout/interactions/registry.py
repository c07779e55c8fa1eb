"""Interaction registry: verl's YAML format, routing by `interaction_kwargs.name`.

    interaction:
      - name: gsm8k                                          # optional; default from the class name
        class_name: rollout.interactions.gsm8k.Gsm8kInteraction
        config: {max_user_turns: 3}

A sample picks its interaction with `extra_info.interaction_kwargs.name`; with a single
registered interaction the name may be omitted. `validate_sample` refuses an unknown name
with the list of known ones: call it when the data is loaded, so a typo fails before any
rollout starts rather than mid-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout.interactions.base import BaseInteraction
from rollout.interactions.runner import InteractionRunner
from rollout.tools.registry import ToolConfigError, import_class, read_yaml_list


class InteractionConfigError(ToolConfigError):
    """An interaction YAML entry or a sample's `interaction_kwargs` is wrong."""


def build_interactions(source: str | Path | dict[str, Any]) -> list[BaseInteraction]:
    """All interactions of an interaction config (YAML path or mapping), in file order."""
    try:
        entries, label = read_yaml_list(source, "interaction")
    except ToolConfigError as exc:
        raise InteractionConfigError(str(exc)) from None
    out: list[BaseInteraction] = []
    for i, entry in enumerate(entries):
        where = f"{label}: interaction[{i}]"
        if not isinstance(entry, dict):
            raise InteractionConfigError(f"{where}: expected a mapping with name, class_name, config")
        unknown = set(entry) - {"name", "class_name", "config"}
        if unknown:
            raise InteractionConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: name, class_name, config")
        try:
            cls = import_class(entry.get("class_name"), where, BaseInteraction)
        except ToolConfigError as exc:
            raise InteractionConfigError(str(exc)) from None
        config = dict(entry.get("config") or {})
        if entry.get("name"):
            config["name"] = entry["name"]
        try:
            out.append(cls(config))
        except Exception as exc:
            raise InteractionConfigError(
                f"{where}: building {cls.__name__} failed: {type(exc).__name__}: {exc}"
            ) from exc
    return out


class InteractionRegistry:
    """The interactions of one rollout, by name, each behind its `InteractionRunner`."""

    def __init__(self, interactions: list[BaseInteraction]):
        self.runners: dict[str, InteractionRunner] = {}
        for inter in interactions:
            if inter.name in self.runners:
                raise InteractionConfigError(
                    f"two interactions are named {inter.name!r}; give each entry a unique `name`"
                )
            self.runners[inter.name] = InteractionRunner(inter)

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any] | None) -> InteractionRegistry:
        """Registry from a YAML path or mapping (None: no interactions)."""
        return cls(build_interactions(source) if source is not None else [])

    @property
    def names(self) -> list[str]:
        """Names of the registered interactions, in config order."""
        return list(self.runners)

    def resolve_name(self, interaction_kwargs: dict[str, Any] | None) -> str:
        """The interaction a sample is routed to; InteractionConfigError if there is none."""
        name = (interaction_kwargs or {}).get("name")
        if name is None:
            if len(self.runners) == 1:
                return self.names[0]
            raise InteractionConfigError(
                f"interaction_kwargs has no 'name' and {len(self.runners)} interactions are registered; "
                f"set interaction_kwargs.name to one of {self.names}"
            )
        if name not in self.runners:
            raise InteractionConfigError(
                f"interaction_kwargs.name={name!r} is not registered; known interactions: {self.names}"
            )
        return name

    def validate_sample(self, interaction_kwargs: dict[str, Any] | None) -> None:
        """Refuse a sample routed to an unknown interaction (call at data validation)."""
        self.resolve_name(interaction_kwargs)

    def route(self, interaction_kwargs: dict[str, Any] | None) -> InteractionRunner:
        """The runner of the sample's interaction."""
        return self.runners[self.resolve_name(interaction_kwargs)]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per interaction: (instances started, instances finalized)."""
        return {n: (r.num_started, r.num_finalized) for n, r in self.runners.items()}

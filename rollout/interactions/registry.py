"""Interaction registry: interactions from verl's YAML (through `rollout.plugins`), routing by
`interaction_kwargs.name`.

    interaction:
      - name: gsm8k                                          # optional; verl's default from the class name
        class_name: rollout.interactions.gsm8k.Gsm8kInteraction
        config: {max_user_turns: 3, score_fn: pkg.task.compute_score}

A sample picks its interaction with `extra_info.interaction_kwargs.name`; with a single
registered interaction the name may be omitted. `validate_sample` refuses an unknown name
with the list of known ones: call it when the data is loaded, so a typo fails before any
rollout starts rather than mid-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout.interactions.runner import InteractionRunner
from rollout.plugins import PluginConfigError, Registry, build, check_keys, check_runner, import_class, \
    read_entries, verl_interaction_name

InteractionConfigError = PluginConfigError  # the interactions' name for it

INTERACTION_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


class InteractionRegistry(Registry[InteractionRunner]):
    """The interactions of one rollout, by name, each behind its `InteractionRunner`."""

    kind = "interaction"
    runner_cls = InteractionRunner

    @staticmethod
    def load(source: str | Path | dict[str, Any]) -> list[Any]:
        """All interactions of an interaction config (YAML path or mapping), in file order; each gets its
        name in `config["name"]` (as verl does)."""
        entries, label, _ = read_entries(source, "interaction")
        out: list[Any] = []
        for i, entry in enumerate(entries):
            where = f"{label}: interaction[{i}]"
            check_keys(entry, {"name", "class_name", "config"}, where)
            cls = import_class(entry.get("class_name"), f"{where}.class_name", INTERACTION_METHODS)
            config = dict(entry.get("config") or {})
            config["name"] = entry.get("name") or verl_interaction_name(entry["class_name"])
            interaction = build(cls, where, config=config)
            check_runner(InteractionRunner, interaction, where)
            out.append(interaction)
        return out

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

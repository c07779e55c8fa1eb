"""The prompt record: one data row as the rollout needs it, tokenized once.

`RolloutPrompt` holds what the agent loop needs of a verl data row (the chat, the sample's tool and
interaction kwargs, its data source and ground truth, its agent loop) and the prompt's token ids. A row's
`agent_name` (verl's) picks the loop: `tool_agent`, the multi-turn loop with the sample's tools and interaction, or
`single_turn_agent`, one assistant turn with no tools offered and no simulated user; a row without it gets
`actor_rollout_ref.rollout.agent.default_agent_loop`, and any other name (a custom verl agent loop) is refused. `encode_prompt`
makes those ids the one way the engine gets them: the chat template rendered with the sample's
own tool schemas (`sample_tools`) and the generation prompt (`ChatCodec.prompt_ids`). The dataset
calls it at load, where its length filter measures them, and the loop sends exactly the stored
ids; a prompt made without ids (tests, benchmarks) is encoded by the loop with the same function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout.config import AGENT_LOOPS

if TYPE_CHECKING:
    from rollout.chat_codec import ChatCodec
    from rollout.tools.registry import ToolRegistry


@dataclass
class RolloutPrompt:
    """One prompt to roll out `n` times; the fields of a verl data row the rollout needs."""

    uid: str  # unique id of the prompt (the GRPO group id)
    messages: list[dict[str, Any]]  # the chat so far (system / user messages)
    tools_kwargs: dict[str, Any] = field(default_factory=dict)  # {tool: {create_kwargs, execute_kwargs, ...}}
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)  # {"name": interaction, ...}; empty: no simulated user
    data_source: str = ""  # the row's data_source (picks the outcome scorer)
    ground_truth: Any = None  # reward_model.ground_truth
    extra_info: dict[str, Any] = field(default_factory=dict)  # the row's extra_info
    # `messages` rendered with the sample's tool schemas and the generation prompt, tokenized at load (`encode_prompt`):
    # what the length filter measured and the engine gets. None: not tokenized yet (the loop encodes it).
    prompt_ids: list[int] | None = None
    agent_name: str = "tool_agent"  # the row's agent loop (AGENT_LOOPS): tools and interaction on, or one plain turn

    @property
    def single_turn(self) -> bool:
        """One assistant turn, no tools, no simulated user (verl's single_turn_agent)."""
        return self.agent_name == "single_turn_agent"

    @classmethod
    def from_row(cls, row: dict[str, Any], uid: str, default_agent: str = "tool_agent") -> RolloutPrompt:
        """From a verl data row: `prompt`, `data_source`, `reward_model.ground_truth`, `extra_info.{tools,interaction}_kwargs`,
        `agent_name` (`default_agent` when absent or null; a single_turn_agent row's tool and interaction kwargs
        are dropped, as verl's single-turn loop ignores them)."""
        if not isinstance(row.get("prompt"), list):
            raise ValueError(f"data row {uid}: `prompt` must be a list of chat messages, got {type(row.get('prompt')).__name__}")
        agent = row.get("agent_name") or default_agent
        if agent not in AGENT_LOOPS:
            raise ValueError(f"agent_name={agent!r} is not an agent loop polyturn runs (custom verl agent loops are "
                             "not supported); use tool_agent (multi-turn, tools) or single_turn_agent (one turn, no tools)")
        extra = dict(row.get("extra_info") or {})
        one = agent == "single_turn_agent"
        return cls(
            uid=uid,
            messages=list(row["prompt"]),
            tools_kwargs={} if one else dict(extra.get("tools_kwargs") or {}),
            interaction_kwargs={} if one else dict(extra.get("interaction_kwargs") or {}),
            data_source=str(row.get("data_source") or ""),
            ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
            extra_info=extra,
            agent_name=agent,
        )


def sample_tools(prompt: RolloutPrompt, tools: ToolRegistry) -> tuple[list[str], list[dict[str, Any]] | None]:
    """The tools `prompt`'s samples may call (`ToolRegistry.select` of its tools_kwargs; none for a single-turn
    prompt) and the schemas its chat template is rendered with (None: no tools)."""
    names = [] if prompt.single_turn else tools.select(prompt.tools_kwargs)
    return names, (tools.schemas(names) if names else None)


def encode_prompt(prompt: RolloutPrompt, codec: ChatCodec, tools: ToolRegistry) -> list[int]:
    """The ids the engine gets for `prompt`: its `prompt_ids` when it has them, else its messages rendered with its
    own tool schemas and the generation prompt, tokenized."""
    if prompt.prompt_ids is not None:
        return prompt.prompt_ids
    return codec.prompt_ids(prompt.messages, sample_tools(prompt, tools)[1])

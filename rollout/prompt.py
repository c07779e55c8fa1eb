"""The prompt record: one data row as the rollout needs it, tokenized once.

`RolloutPrompt` holds what the agent loop needs of a verl data row (the chat, the sample's tool and
interaction kwargs, its data source and ground truth) and the prompt's token ids. `encode_prompt`
makes those ids the one way the engine gets them: the chat template rendered with the sample's
own tool schemas (`sample_tools`) and the generation prompt (`ChatCodec.prompt_ids`). The dataset
calls it at load, where its length filter measures them, and the loop sends exactly the stored
ids; a prompt made without ids (tests, benchmarks) is encoded by the loop with the same function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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

    @classmethod
    def from_row(cls, row: dict[str, Any], uid: str) -> RolloutPrompt:
        """From a verl data row: `prompt`, `data_source`, `reward_model.ground_truth`, `extra_info.{tools,interaction}_kwargs`."""
        if not isinstance(row.get("prompt"), list):
            raise ValueError(f"data row {uid}: `prompt` must be a list of chat messages, got {type(row.get('prompt')).__name__}")
        extra = dict(row.get("extra_info") or {})
        return cls(
            uid=uid,
            messages=list(row["prompt"]),
            tools_kwargs=dict(extra.get("tools_kwargs") or {}),
            interaction_kwargs=dict(extra.get("interaction_kwargs") or {}),
            data_source=str(row.get("data_source") or ""),
            ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
            extra_info=extra,
        )


def sample_tools(prompt: RolloutPrompt, tools: ToolRegistry) -> tuple[list[str], list[dict[str, Any]] | None]:
    """The tools `prompt`'s samples may call (`ToolRegistry.select` of its tools_kwargs) and the schemas its chat
    template is rendered with (None: no tools)."""
    names = tools.select(prompt.tools_kwargs)
    return names, (tools.schemas(names) if names else None)


def encode_prompt(prompt: RolloutPrompt, codec: ChatCodec, tools: ToolRegistry) -> list[int]:
    """The ids the engine gets for `prompt`: its `prompt_ids` when it has them, else its messages rendered with its
    own tool schemas and the generation prompt, tokenized."""
    if prompt.prompt_ids is not None:
        return prompt.prompt_ids
    return codec.prompt_ids(prompt.messages, sample_tools(prompt, tools)[1])

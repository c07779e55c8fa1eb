"""The RL dataset: verl-format parquet rows -> batches of `RolloutPrompt`s for the agent loop.

Rows are read once, validated once, at load: every row needs a chat `prompt` and a
`data_source`; a row whose `tools_kwargs` names a tool that is not in the tool registry, or
whose `interaction_kwargs` routes to an unknown interaction, is refused naming the file, the
row and the fix, so a typo in the data stops the run before the first rollout instead of
failing one sample at a time mid-run. So is a row whose `agent_name` is not an agent loop polyturn runs
(`tool_agent`, `single_turn_agent`); rows without one get `default_agent` (`agent.default_agent_loop`).

With a tokenizer, each prompt is tokenized here, once, the way the engine gets it: the chat
template with the sample's own tool schemas, the generation prompt and `chat_template_kwargs`
(verl's `data.apply_chat_template_kwargs`; `rollout.prompt.encode_prompt`, the rollout's `ChatCodec`).
The ids ride on the prompt (`RolloutPrompt.prompt_ids`) and the agent loop sends exactly them, so
prompts longer than `max_prompt_length` are dropped (verl's
`filter_overlong_prompts`) by the length of the very sequence the engine would see.

When a plug-in kind is not configured at all (no tool config / no interaction config), the
rows' `tools_kwargs` / `interaction_kwargs` are ignored (logged once), as in verl. A null
entry of `tools_kwargs` is dropped: parquet stores it as a struct over the tool names of all
rows, so a row's own dict comes back with the other rows' tools set to null.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.chat_codec import ChatCodec
from rollout.interactions.registry import InteractionRegistry
from rollout.prompt import RolloutPrompt, encode_prompt
from rollout.tools.registry import ToolRegistry

logger = logging.getLogger(__name__)


@dataclass
class PromptBatch:
    """One training step's prompts."""

    prompts: list[RolloutPrompt]  # `train_batch_size` prompts, each rolled out `n` times (data source, ground truth on each)
    epoch: int  # pass over the dataset this batch belongs to


def read_parquet_rows(files: Sequence[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """All rows of `files`, each with its `file[row]` location for error messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"data file {f} not found; preprocess the data first (e.g. python -m recipe.tasks.gsm8k)")
        try:
            table = pq.read_table(str(f))
        except pa.ArrowInvalid as err:  # a jsonl, a csv ...: verl reads parquet only, and so does polyturn
            raise ValueError(f"{f} is not a parquet file ({type(err).__name__}: no parquet footer); verl's rows are "
                             f"read from parquet: convert it, e.g. pandas.read_json('{Path(f).name}', lines=True)"
                             f".to_parquet('{Path(f).stem}.parquet')") from err
        rows.extend((f"{f}[{i}]", row) for i, row in enumerate(table.to_pylist()))
    return rows


def epoch_batches(n_items: int, batch_size: int, *, seed: int = 0,
                  shuffle: bool = True) -> Iterator[tuple[int, list[int]]]:
    """Endless `(epoch, row positions)` batches over `n_items` rows: one shuffle per epoch seeded by
    `seed + epoch`, the last partial batch of an epoch dropped."""
    if batch_size > n_items:
        raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({n_items} usable rows); "
                         "lower it or add data")
    epoch = 0
    while True:
        order = list(range(n_items))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for start in range(0, n_items - batch_size + 1, batch_size):
            yield epoch, order[start:start + batch_size]
        epoch += 1


class RLDataset:
    """Validated prompts of one or more parquet files, served as shuffled batches."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tools: ToolRegistry,
        interactions: InteractionRegistry,
        *,
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        default_agent: str = "tool_agent",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.items: list[RolloutPrompt] = []
        dropped_kinds: set[str] = set()
        overlong = 0
        codec = ChatCodec.for_tokenizer(tokenizer, chat_template_kwargs) if tokenizer is not None else None
        for where, row in read_parquet_rows(files):
            prompt = self._validate(where, row, tools, interactions, dropped_kinds, default_agent)
            if codec is not None:
                prompt.prompt_ids = encode_prompt(prompt, codec, tools)  # what the engine will get
                if max_prompt_length is not None and len(prompt.prompt_ids) > max_prompt_length:
                    overlong += 1
                    continue
            self.items.append(prompt)
        for kind in sorted(dropped_kinds):
            logger.warning("rows carry %s but none are configured; ignoring them", kind)
        if overlong:
            logger.warning("dropped %d prompts longer than data.max_prompt_length=%s", overlong, max_prompt_length)
        if overlong and not self.items:
            raise ValueError(f"all {overlong} prompts of {list(files)} are longer than data.max_prompt_length="
                             f"{max_prompt_length} tokens (chat template and tool schemas included); raise it")
        if not self.items:
            raise ValueError(f"no rows in {list(files)}; check the files")

    @staticmethod
    def _validate(where: str, row: dict[str, Any], tools: ToolRegistry, interactions: InteractionRegistry,
                  dropped_kinds: set[str], default_agent: str) -> RolloutPrompt:
        if not row.get("data_source"):
            raise ValueError(f"{where}: no data_source; each row needs one (it selects the reward scorer)")
        try:
            prompt = RolloutPrompt.from_row(row, uid=where, default_agent=default_agent)
            # parquet stores tools_kwargs as a struct over every row's tool names: null means "not this row's"
            prompt.tools_kwargs = {k: v for k, v in prompt.tools_kwargs.items() if v is not None}
            if not prompt.messages:
                raise ValueError("`prompt` is empty; it needs at least one user message")
            if prompt.tools_kwargs and not tools.names:
                dropped_kinds.add("tools_kwargs")
                prompt.tools_kwargs = {}
            if prompt.interaction_kwargs and not interactions.names:
                dropped_kinds.add("interaction_kwargs")
                prompt.interaction_kwargs = {}
            tools.validate_sample(prompt.tools_kwargs)
            if prompt.interaction_kwargs:
                interactions.validate_sample(prompt.interaction_kwargs)
        except (ValueError, KeyError) as err:
            message = str(err)
            raise ValueError(message if where in message else f"{where}: {message}") from err
        return prompt

    def __len__(self) -> int:
        return len(self.items)

    def batches(self, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> Iterator[PromptBatch]:
        """Endless batches of `batch_size` prompts: one seeded shuffle per epoch, the last partial batch dropped.

        Each prompt gets a uid unique over the run (`e<epoch>/<position>`), its GRPO group id.
        """
        for epoch, chosen in epoch_batches(len(self.items), batch_size, seed=seed, shuffle=shuffle):
            yield PromptBatch(prompts=[dataclasses.replace(self.items[pos], uid=f"e{epoch}/{pos}") for pos in chosen],
                              epoch=epoch)

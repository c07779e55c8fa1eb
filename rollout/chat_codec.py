"""The chat codec: chat messages <-> token ids through the model's chat template, the rollout's way.

`ChatCodec` renders a sample's prompt (with its own tool schemas and the generation prompt), turns
engine ids into assistant text, tokenizes what the loop inserts between assistant turns, cuts tool
outputs to a token budget and checks a finished trajectory against the template. The agent loop
builds training sequences with it, and SFT builds demonstrations with the same calls
(`recipe.data.sft_dataset`), so both train on the same tokens for the same conversation.

Where it departs from the textbook "render the chat, tokenize":
- Engine ids are never re-tokenized. Tool and user messages become tokens by rendering the
  template on a placeholder conversation plus the new messages and tokenizing only the suffix
  after the placeholder (`delta_ids`), so a sequence holds exactly what the engine sampled plus
  exactly what the template would put around new messages.
- The whole chat is re-rendered from its messages only to *check* it against the ids
  (`drift_index`); the first differing index is a metric, never a rebuild.
- Every render, the prompt's and every later turn's, passes the same extra template variables
  (`template_kwargs`: verl's `data.apply_chat_template_kwargs`).
"""
from __future__ import annotations

from typing import Any

from rollout.trajectory import Trajectory

_PLACEHOLDER = "\u2063POLYTURN_ASSISTANT_PLACEHOLDER\u2063"  # never produced by a model; marks where the delta starts


class ChatCodec:
    """Chat-template rendering for the loop (and for SFT demonstrations): prompts, assistant turns, mask-0 deltas,
    tool-output truncation, drift check."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int], template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        # extra variables of every render (verl's data.apply_chat_template_kwargs, e.g. enable_thinking=False)
        self.template_kwargs = dict(template_kwargs or {})
        self._assistant_prefix: str | None = None  # the placeholder conversation's generation prompt (assistant_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> ChatCodec:
        """The codec of a tokenizer whose eos token ends an assistant turn (the engine's stop token), rendering its
        template with `template_kwargs` as well."""
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; set eos_token (e.g. <|im_end|>) in tokenizer_config.json")
        return cls(tokenizer, [tokenizer.eos_token_id], template_kwargs)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen_prompt, tokenize=False, **self.template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The prompt with the sample's own tool schemas and the generation prompt."""
        return self.encode(self._render(messages, tools, gen_prompt=True))

    def assistant_text(self, ids: list[int]) -> str:
        """Text of engine ids for parsing and the message log (a trailing stop token dropped)."""
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def delta_ids(self, new_messages: list[dict[str, Any]], after_stop_token: int | None) -> list[int]:
        """Tokens the template puts after an assistant turn for `new_messages`, up to the next generation prompt.

        Rendered on a placeholder conversation; the text after the placeholder's content is the
        turn's closing plus the new messages plus `<|im_start|>assistant\\n`. When the engine
        already sampled the stop token that closes the turn, its text is not repeated.
        """
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        text = self._render(base + new_messages, None, gen_prompt=True)
        cut = text.index(_PLACEHOLDER) + len(_PLACEHOLDER)
        delta = text[cut:]
        if after_stop_token is not None:
            stop_text = self.tokenizer.decode([after_stop_token], skip_special_tokens=False)
            if stop_text and delta.startswith(stop_text):
                delta = delta[len(stop_text):]
        return self.encode(delta)

    def assistant_ids(self, message: dict[str, Any]) -> list[int]:
        """The ids a policy would sample for assistant `message` after the generation prompt (an SFT demonstration's turn).

        The template renders the message (content and `tool_calls`) on a placeholder conversation;
        the text between the generation prompt and the turn's stop token is tokenized and the stop
        token appended, as the engine returns it. The template's text after the stop token
        (e.g. a newline) belongs to the next `delta_ids`, as in the loop.
        """
        base = [{"role": "user", "content": "x"}]
        if self._assistant_prefix is None:
            self._assistant_prefix = self._render(base, None, gen_prompt=True)
        prefix = self._assistant_prefix
        text = self._render(base + [message], None, gen_prompt=False)
        if not text.startswith(prefix):
            raise ValueError("the chat template renders an assistant message differently from its generation prompt "
                             f"{prefix[-40:]!r}; use a template whose assistant turns start with it")
        turn = text[len(prefix):]
        ends = {sid: turn.rfind(self.tokenizer.decode([sid], skip_special_tokens=False)) for sid in self.stop_token_ids}
        sid, cut = max(ends.items(), key=lambda kv: kv[1])
        if cut < 0:
            raise ValueError(f"the chat template closes an assistant turn without a stop token {sorted(self.stop_token_ids)}"
                             f" (rendered {turn[-40:]!r}); set the tokenizer's eos_token to the turn's end token")
        return self.encode(turn[:cut]) + [sid]

    def truncate(self, text: str, max_tokens: int, side: str) -> tuple[str, bool]:
        """Cut `text` to at most `max_tokens` tokens; returns (text, was_cut).

        `side` is the part that is cut: "left" keeps the end, "right" keeps the start, "middle"
        keeps both ends. A marker shows the model where text was removed.
        """
        # Pre-cut megabyte outputs to a generous character window so tokenizing stays cheap.
        window = max_tokens * 32
        precut = len(text) > 2 * window
        if precut:
            text = {"left": text[-window:], "right": text[:window], "middle": text[: window // 2] + text[-window // 2:]}[side]
        ids = self.encode(text)
        if len(ids) <= max_tokens and not precut:
            return text, False
        marker = "...(truncated)..."
        keep = max_tokens - len(self.encode(marker))
        while True:
            keep = max(min(keep, len(ids)), 0)
            head = {"left": 0, "right": keep, "middle": keep // 2}[side]
            head_text = self.tokenizer.decode(ids[:head]) if head else ""
            tail_text = self.tokenizer.decode(ids[len(ids) - (keep - head):]) if keep - head else ""
            out = head_text + marker + tail_text
            # Re-encoding can merge or split at the cut points (or at a split UTF-8 byte): shrink until it fits.
            excess = len(self.encode(out)) - max_tokens
            if excess <= 0 or keep == 0:
                return out, True
            keep -= excess

    def drift_index(self, traj: Trajectory, tools: list[dict[str, Any]] | None) -> int | None:
        """First index where the re-rendered chat's ids differ from the trajectory's; None when they agree.

        A rendered tail made only of the closing of the last turn (stop text, whitespace) is not drift.
        """
        ends_with_assistant = bool(traj.messages) and traj.messages[-1]["role"] == "assistant"
        rendered = self.encode(self._render(traj.messages, tools, gen_prompt=not ends_with_assistant))
        ours = traj.prompt_ids + traj.response_ids
        for i, (a, b) in enumerate(zip(ours, rendered)):
            if a != b:
                return i
        if len(ours) > len(rendered):
            return len(rendered)
        tail = self.tokenizer.decode(rendered[len(ours):], skip_special_tokens=False)
        for sid in self.stop_token_ids:
            tail = tail.replace(self.tokenizer.decode([sid], skip_special_tokens=False), "")
        return None if not tail.strip() else len(ours)

"""The trajectory record: the one piece of data that crosses from `rollout` to `recipe`.

A `Trajectory` is one sampled conversation: the prompt ids, then a response built by
appending segments. Each segment is either sampled by the engine (response mask 1, with the
engine's own log-probs and weight version) or inserted by the loop (tool responses, simulated
user turns, chat-template glue: mask 0, log-prob 0). The mask is written as tokens are
appended and never reconstructed afterwards (nanochat's engine does the same), so it is 1
exactly on the ids the engine returned.

Where it departs from the textbook "prompt + completion" sample: the response is a
multi-turn sequence with turn boundaries, tool calls, interaction scores and the weight
version of every sampled token (one per assistant turn, or one per segment of a turn that a
weight update split: `TurnSpan.version_changes`), and the chat messages are kept only to *check* for tokenization
drift (the token ids are the truth, the messages are a log). Every reward the rollout sees is
recorded with the assistant turn it belongs to, when it is produced (tool step rewards on
their `ToolCallRecord`, interaction scores as `TurnScore`s), so the recipe places rewards by
those indices and re-derives nothing. The record also carries its data row's data source,
ground truth and extra info: it is the only thing that crosses the seam (the recipe pads a
list of them into tensors in `recipe.batch.collate`).
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class TrajectoryStatus(str, enum.Enum):
    """Where a trajectory is in its life: pending -> generating -> tool_calling / interacting -> done."""

    PENDING = "pending"  # created, no engine call yet
    GENERATING = "generating"  # an engine request is in flight
    TOOL_CALLING = "tool_calling"  # the turn's tool calls are running
    INTERACTING = "interacting"  # waiting for the simulated user (interaction)
    DONE = "done"  # finished; `finish_reason` says why


class FinishReason(str, enum.Enum):
    """Why a trajectory ended."""

    STOP = "stop"  # the model ended its answer (EOS / stop token) or the interaction ended the chat
    LENGTH = "length"  # the response-token or model-context budget ran out
    MAX_TURNS = "max_turns"  # it wanted another assistant or user turn past the configured limit
    ABORTED = "aborted"  # the rollout was aborted or the engine aborted the request
    OVER_SAMPLED = "over_sampled"  # among the slowest `rollout.over_sample_rate` of its batch: aborted, not trained
    ERROR = "error"  # an unexpected error (engine failure); logged, the run goes on


# Status changes the loop may make; anything else is a bug in the loop.
_ALLOWED_TRANSITIONS: dict[TrajectoryStatus, frozenset[TrajectoryStatus]] = {
    TrajectoryStatus.PENDING: frozenset({TrajectoryStatus.GENERATING, TrajectoryStatus.DONE}),
    TrajectoryStatus.GENERATING: frozenset(
        {TrajectoryStatus.TOOL_CALLING, TrajectoryStatus.INTERACTING, TrajectoryStatus.GENERATING, TrajectoryStatus.DONE}
    ),
    TrajectoryStatus.TOOL_CALLING: frozenset({TrajectoryStatus.GENERATING, TrajectoryStatus.DONE}),
    TrajectoryStatus.INTERACTING: frozenset({TrajectoryStatus.GENERATING, TrajectoryStatus.DONE}),
    TrajectoryStatus.DONE: frozenset(),
}


@dataclass
class TurnSpan:
    """One contiguous segment of the response."""

    role: str  # "assistant" (engine-sampled), "tool", "user" (interaction) or "template" (glue only)
    start: int  # index of the first token of the segment in `response_ids`
    end: int  # one past the last token (response_ids[start:end] is the segment)
    weight_version: int | None = None  # engine weight version that sampled it; None for non-policy segments
    # (response index, version) where a weight update landed mid-turn (a partial rollout paused and continued it):
    # the turn's tokens from that index on were sampled by that version. Empty: one version for the whole turn.
    version_changes: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ToolCallRecord:
    """One tool call the model made (or tried to make) and what came of it."""

    turn: int  # index of the assistant turn (0-based) that made the call
    name: str | None  # tool name as the model wrote it; None if it could not be parsed at all
    arguments: dict[str, Any] | None  # parsed arguments; None when the call was malformed
    raw: str  # the call as the model wrote it (JSON text), for debugging malformed calls
    result: str = ""  # text fed back to the model (tool output, or an error message), after truncation
    error: str | None = None  # error kind: "bad_json", "unknown_tool", "bad_arguments", "unparsed", "timeout", "exception"
    step_reward: float = 0.0  # the tool's per-call reward from `execute` (0 on errors)
    latency_s: float = 0.0  # wall time of the call
    truncated: bool = False  # whether `result` was cut to the tool-response token budget
    metrics: dict[str, Any] = field(default_factory=dict)  # the tool's own metrics from `execute`


@dataclass
class TurnScore:
    """A score earned by one assistant turn (e.g. the interaction's grade of that turn's answer)."""

    turn: int  # index (0-based) of the assistant turn the score belongs to
    score: float  # the score as the plug-in returned it (weighted later by the recipe)


@dataclass
class Trajectory:
    """One sampled multi-turn conversation, ready for training once `status` is DONE."""

    uid: str  # unique id of this sample (prompt uid + sample index)
    prompt_uid: str  # id shared by the `n` samples of one prompt (the GRPO group)
    sample_index: int  # index of this sample within its group, 0..n-1
    prompt_ids: list[int]  # chat-template-rendered prompt (with the sample's tool schemas), generation prompt included
    response_ids: list[int] = field(default_factory=list)  # everything after the prompt: sampled + inserted tokens
    response_mask: list[int] = field(default_factory=list)  # 1 exactly where the engine sampled the token, else 0
    rollout_logprobs: list[float] = field(default_factory=list)  # engine log-prob of sampled tokens; 0.0 elsewhere
    turns: list[TurnSpan] = field(default_factory=list)  # segments of the response in order, covering it exactly
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # every call attempt, malformed ones included
    interaction_scores: list[TurnScore] = field(default_factory=list)  # each interaction turn's score, with the turn it graded
    tool_rewards: dict[str, float] = field(default_factory=dict)  # each tool's final `calc_reward`, before release
    status: TrajectoryStatus = TrajectoryStatus.PENDING  # state machine, see `TrajectoryStatus`
    finish_reason: FinishReason | None = None  # set once, when the trajectory ends
    error: str | None = None  # message of the error that ended it (finish_reason ERROR), else None
    messages: list[dict[str, Any]] = field(default_factory=list)  # the chat as messages (log + drift check only)
    tool_names: list[str] = field(default_factory=list)  # tools this sample may call (its own schemas in the prompt)
    tools_kwargs: dict[str, Any] = field(default_factory=dict)  # per-tool create/execute/calc_reward/release kwargs
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)  # {"name": interaction, ...} or empty
    data_source: str = ""  # the data row's data_source (picks the outcome scorer)
    ground_truth: Any = None  # reward_model.ground_truth of the data row
    extra_info: dict[str, Any] = field(default_factory=dict)  # the data row's extra_info (index, split, ...)
    num_user_turns: int = 0  # interaction turns appended (simulated user messages)
    drift_index: int | None = None  # first index (in prompt+response) where re-rendered chat differs; None = no drift
    generation_time_s: float = 0.0  # wall time spent waiting on the engine
    tool_time_s: float = 0.0  # wall time spent in tool calls (one turn's calls overlap: counted once)
    interaction_time_s: float = 0.0  # wall time spent waiting on the interaction
    traces: list[dict[str, Any]] = field(default_factory=list)  # rollout_trace_op calls (rollout.tracing), in order

    # ---- building ----------------------------------------------------------------------

    def set_status(self, status: TrajectoryStatus) -> None:
        """Move to `status`; raises if the state machine does not allow the move."""
        if status not in _ALLOWED_TRANSITIONS[self.status]:
            raise ValueError(f"trajectory {self.uid}: illegal status change {self.status.value} -> {status.value}")
        self.status = status

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End the trajectory with `reason` (first call wins; a later call is ignored)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
        self.status = TrajectoryStatus.DONE

    def append_assistant(self, ids: list[int], logprobs: list[float], weight_version: int,
                         continues: bool = False) -> None:
        """Append engine-sampled ids (mask 1) with their log-probs as one assistant turn; `continues`: as more of the
        last assistant turn (generation paused by a weight update, then continued), its version recorded where it
        changes."""
        if len(ids) != len(logprobs):
            raise ValueError(
                f"trajectory {self.uid}: engine returned {len(ids)} ids but {len(logprobs)} log-probs; "
                "ask the engine for return_logprob"
            )
        if not continues:
            return self._append(ids, [1] * len(ids), [float(x) for x in logprobs], "assistant", weight_version)
        span = self.turns[-1]
        if span.role != "assistant":
            raise ValueError(f"trajectory {self.uid}: continues=True after a {span.role} segment")
        latest = span.version_changes[-1][1] if span.version_changes else span.weight_version
        if ids and weight_version != latest:
            span.version_changes.append((len(self.response_ids), weight_version))
        self._extend(ids, [1] * len(ids), [float(x) for x in logprobs])
        span.end = len(self.response_ids)

    def append_context(self, ids: list[int], role: str) -> None:
        """Append non-policy ids (tool / user / template tokens) with mask 0 and log-prob 0."""
        if role == "assistant":
            raise ValueError("append_context is for non-policy tokens; use append_assistant for engine output")
        self._append(ids, [0] * len(ids), [0.0] * len(ids), role, None)

    def _append(self, ids: list[int], mask: list[int], logprobs: list[float], role: str, version: int | None) -> None:
        start = len(self.response_ids)
        self._extend(ids, mask, logprobs)
        self.turns.append(TurnSpan(role=role, start=start, end=len(self.response_ids), weight_version=version))

    def _extend(self, ids: list[int], mask: list[int], logprobs: list[float]) -> None:
        self.response_ids.extend(int(i) for i in ids)
        self.response_mask.extend(mask)
        self.rollout_logprobs.extend(logprobs)

    # ---- reading -----------------------------------------------------------------------

    @property
    def num_assistant_turns(self) -> int:
        """Assistant turns generated so far."""
        return sum(1 for t in self.turns if t.role == "assistant")

    @property
    def weight_versions(self) -> list[int]:
        """Weight version of each assistant segment (a turn, or each part of a turn a weight update split), in order
        (off-policy segments show as older versions)."""
        return [v for t in self.turns if t.role == "assistant" and t.weight_version is not None
                for v in [t.weight_version, *(v for _, v in t.version_changes)]]

    @property
    def assistant_turn_ends(self) -> list[int]:
        """Response index of the last token of each assistant turn, in turn order."""
        return [max(t.end - 1, t.start) for t in self.turns if t.role == "assistant"]

    @property
    def total_length(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def tool_reward(self) -> float:
        """Sum of the step rewards of every tool call."""
        return float(sum(c.step_reward for c in self.tool_calls))

    def check_invariants(self) -> None:
        """Raise if ids, mask, log-probs and turn spans disagree (a bug in whoever built the record)."""
        n = len(self.response_ids)
        if not (len(self.response_mask) == len(self.rollout_logprobs) == n):
            raise ValueError(
                f"trajectory {self.uid}: response_ids ({n}), response_mask ({len(self.response_mask)}) and "
                f"rollout_logprobs ({len(self.rollout_logprobs)}) must have the same length"
            )
        pos = 0
        for span in self.turns:
            if span.start != pos or span.end < span.start:
                raise ValueError(f"trajectory {self.uid}: turn spans do not tile the response at index {pos}")
            expected = 1 if span.role == "assistant" else 0
            if any(m != expected for m in self.response_mask[span.start : span.end]):
                raise ValueError(f"trajectory {self.uid}: mask of a {span.role} turn at {span.start} is not {expected}")
            pos = span.end
        if pos != n:
            raise ValueError(f"trajectory {self.uid}: turn spans cover {pos} of {n} response tokens")

    # ---- serialization -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (enums as their string values)."""
        d = asdict(self)
        d["status"] = self.status.value
        d["finish_reason"] = self.finish_reason.value if self.finish_reason is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """Inverse of `to_dict`."""
        d = dict(d)
        d["status"] = TrajectoryStatus(d["status"])
        d["finish_reason"] = FinishReason(d["finish_reason"]) if d.get("finish_reason") is not None else None
        d["turns"] = [TurnSpan(**{**t, "version_changes": [tuple(c) for c in t.get("version_changes", [])]})
                      for t in d.get("turns", [])]
        d["tool_calls"] = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        d["interaction_scores"] = [TurnScore(**s) for s in d.get("interaction_scores", [])]
        return cls(**d)

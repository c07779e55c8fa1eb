"""The async multi-turn agent loop: trajectories over engines, tools and simulated users.

Every trajectory is its own asyncio task. One turn: send the token ids so far to the
trajectory's engine (least-loaded, then sticky: `EngineRouter`), append the returned ids
with mask 1, parse tool calls with SGLang's parser (`ToolCallParser`), run the turn's calls
concurrently, and append the tool messages as mask-0 tokens; when the model answers without
a call and the sample has an interaction, the simulated user's reply is appended the same
way. It stops on the model's own stop, on the interaction's say-so, or on a limit (assistant
turns, user turns, response tokens, model context).

Where it departs from the textbook "render the chat, tokenize, generate" loop:
- The engine's ids are never re-tokenized. Tool and user messages become tokens by rendering
  the chat template on a placeholder conversation plus the new messages and tokenizing only
  the suffix after the placeholder (the "delta"), so the training sequence holds exactly
  what the engine sampled plus exactly what the template would put around new messages.
- At the end the whole chat is re-rendered from `messages` only to *check* it against the
  ids; the first differing index is a metric (`rollout/drift/*`), never a rebuild.
- `max_parallel_calls` limits how many calls of one turn run at once; unlike verl, calls
  beyond it are queued, not dropped, so no call the model made goes unanswered.
- Failures are data: malformed calls, tool errors and timeouts are tool messages to the
  model and metrics; an interaction or engine failure ends that trajectory with finish
  reason `error`; `abort()` ends all of them with `aborted`. Tools are always released and
  interactions always finalized (`ToolRunner.session`, `InteractionRunner.session`).
- A weight update may land mid-turn (partial rollout: the router's `pause` aborts the requests in
  flight and holds new ones until `resume`): the paused turn keeps what it sampled and is continued
  on the new weights as the same turn, each segment with the version that sampled it. A trajectory
  waiting on a tool or a simulated user keeps its place; its next request waits for `resume`.
- `generate` may run several times at once on one loop (fully_async's rollouter starts a call per
  prompt group); `abort` ends them all.
- A trajectory whose engine dies (`EngineDeadError`) is started over on an engine still alive,
  up to `max_trajectory_retries` times: its tool instances are released and its interaction
  finalized once (leaving the failed attempt), then created afresh for the new attempt; the
  retries are counted (`fault/retried_trajectories`).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tqdm import tqdm

from rollout.config import RolloutConfig
from rollout.engines.base import EngineDeadError, GenerateResult, RolloutEngine
from rollout.engines.router import EngineRouter
from rollout.interactions.registry import InteractionRegistry
from rollout.interactions.runner import InteractionRunner
from rollout.tool_parser import MalformedCall, ParsedCall, ToolCallParser
from rollout.tools.registry import ToolRegistry
from rollout.tracing import trace_into
from rollout.trajectory import FinishReason, ToolCallRecord, Trajectory, TrajectoryStatus, TurnScore

logger = logging.getLogger(__name__)

_PLACEHOLDER = "\u2063POLYTURN_ASSISTANT_PLACEHOLDER\u2063"  # never produced by a model; marks where the delta starts


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


class ChatCodec:
    """Chat-template rendering for the loop (and for SFT demonstrations): prompts, assistant turns, mask-0 deltas,
    tool-output truncation, drift check."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self._assistant_prefix: str | None = None  # the placeholder conversation's generation prompt (assistant_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ChatCodec:
        """The codec of a tokenizer whose eos token ends an assistant turn (the engine's stop token)."""
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; set eos_token (e.g. <|im_end|>) in tokenizer_config.json")
        return cls(tokenizer, [tokenizer.eos_token_id])

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen_prompt, tokenize=False
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


class AgentLoop:
    """Rolls out prompts on engines with tools and interactions; one instance per rollout worker."""

    def __init__(
        self,
        engines: list[RolloutEngine] | EngineRouter,
        tokenizer: Any,
        config: RolloutConfig,
        tools: ToolRegistry | None = None,
        interactions: InteractionRegistry | None = None,
    ):
        self.router = engines if isinstance(engines, EngineRouter) else EngineRouter(list(engines))
        self.config = config
        self.tools = tools or ToolRegistry([])
        self.interactions = interactions or InteractionRegistry([])
        self.codec = ChatCodec.for_tokenizer(tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._parsers: dict[tuple[str, ...], ToolCallParser] = {}
        self._tasks: set[asyncio.Task] = set()  # the trajectories of every running `generate` call
        self._aborted = False
        self._over_sampled = False  # a running `generate` cut its slowest trajectories (over_sample_rate)
        self.retried = 0  # trajectories started over after an engine died, since this loop was made

    # ---- public API --------------------------------------------------------------------

    def validate(self, prompts: list[RolloutPrompt]) -> None:
        """Refuse prompts naming unknown tools or interactions before anything runs."""
        for p in prompts:
            if not p.messages:
                raise ValueError(f"prompt {p.uid}: no messages; each prompt needs at least one user message")
            self.tools.validate_sample(p.tools_kwargs)
            if p.interaction_kwargs:
                self.interactions.validate_sample(p.interaction_kwargs)

    async def generate(self, prompts: list[RolloutPrompt], *, greedy: bool = False, seed: int | None = None,
                       over_sample_rate: float = 0.0, progress: bool = True) -> list[Trajectory]:
        """Roll out every prompt `n` times concurrently; the trajectories in prompt order, `n` per prompt.

        `greedy=True` rolls out each prompt once at temperature 0 (ReMax's baseline). With a `seed`,
        each trajectory samples with its own `sampling_seed(seed, uid)` (honoured by engines started
        with SGLang's `enable_deterministic_inference`). With `over_sample_rate` r > 0, once all but a
        fraction r of the trajectories have ended, the rest are aborted with finish reason `over_sampled`
        (verl's over-sampling). Returns when every trajectory has ended, or after `abort()` with what
        was produced so far. `progress`: a progress bar (on a tty).
        """
        self.validate(prompts)
        if not self._tasks:  # no other call running
            self._aborted = self._over_sampled = False
        c = self.config
        sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1} if greedy else \
            {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k}
        trajs: list[Trajectory] = []
        jobs = []
        for p in prompts:
            tool_names = self.tools.select(p.tools_kwargs)
            schemas = self.tools.schemas(tool_names) if tool_names else None
            prompt_ids = self.codec.prompt_ids(p.messages, schemas)
            for k in range(1 if greedy else c.n):
                traj = self._new_trajectory(p, k, tool_names, prompt_ids)
                trajs.append(traj)
                jobs.append(self._run(traj, schemas, partial(self._new_trajectory, p, k, tool_names, prompt_ids),
                                      sampling, seed))
        tasks = [asyncio.ensure_future(j) for j in jobs]
        self._tasks.update(tasks)
        if progress:
            logger.info("rollout started: %d trajectories", len(tasks))  # the bar below is off in a log file
        bar = tqdm(total=len(tasks), desc="rollout", unit="traj", leave=False, disable=None if progress else True)
        for task in tasks:
            task.add_done_callback(lambda _: bar.update())
        engine_aborts: list[asyncio.Future] = []
        if over_sample_rate > 0:
            self._abort_the_rest_after(tasks, max(1, int(len(tasks) * (1.0 - over_sample_rate))), engine_aborts)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*engine_aborts)
        finally:
            self._tasks.difference_update(tasks)
            bar.close()
        for t in trajs:  # tasks cancelled before they started never ran their body
            if t.status is not TrajectoryStatus.DONE:
                t.finish(self._cancelled_reason())
        return trajs

    async def abort(self) -> None:
        """Abort the running `generate`: every engine request and every tool / interaction task.

        The trainer calls it when a rollout runs past its time limit and when it shuts down
        mid-rollout. Trajectories end with finish reason `aborted`; tools are still released and
        interactions finalized. `generate` then returns what was produced.
        """
        self._aborted = True
        tasks = list(self._tasks)
        await self.router.abort_all()
        for task in tasks:
            task.cancel()

    def _abort_the_rest_after(self, tasks: list[asyncio.Task], target: int, engine_aborts: list[asyncio.Future]) -> None:
        """Once `target` of `tasks` (one `generate` call's trajectories) have ended, cancel the others as over-sampled
        and abort their engine requests (the future lands in `engine_aborts`, for `generate` to await)."""
        ended = 0

        def on_done(_: asyncio.Future) -> None:
            nonlocal ended
            ended += 1
            if ended != target or self._aborted:
                return
            rest = [t for t in tasks if not t.done()]
            if rest:
                logger.info("over-sampling: %d of %d trajectories ended; aborting the other %d",
                            target, len(tasks), len(rest))
                self._over_sampled = True
                for t in rest:
                    t.cancel()
                engine_aborts.append(asyncio.ensure_future(self.router.abort_all()))

        for task in tasks:
            task.add_done_callback(on_done)

    def _cancelled_reason(self) -> FinishReason:
        """How a cancelled trajectory ends: over-sampled when over-sampling cut it, else aborted."""
        return FinishReason.OVER_SAMPLED if self._over_sampled and not self._aborted else FinishReason.ABORTED

    # ---- one trajectory ----------------------------------------------------------------

    def _new_trajectory(self, p: RolloutPrompt, k: int, tool_names: list[str], prompt_ids: list[int]) -> Trajectory:
        return Trajectory(
            uid=f"{p.uid}/{k}",
            prompt_uid=p.uid,
            sample_index=k,
            prompt_ids=list(prompt_ids),
            messages=[dict(m) for m in p.messages],
            tool_names=list(tool_names),
            tools_kwargs=dict(p.tools_kwargs),
            interaction_kwargs=dict(p.interaction_kwargs),
            data_source=p.data_source,
            ground_truth=p.ground_truth,
            extra_info=dict(p.extra_info),
        )

    def _parser(self, tool_names: list[str]) -> ToolCallParser:
        key = tuple(tool_names)
        if key not in self._parsers:
            schemas = [self.tools.runner(n).schema for n in tool_names]
            self._parsers[key] = ToolCallParser(schemas, self.config.multi_turn.format)
        return self._parsers[key]

    async def _run(self, traj: Trajectory, schemas: list[dict[str, Any]] | None, fresh: Callable[[], Trajectory],
                   sampling: dict[str, Any], seed: int | None) -> Trajectory:
        """Run one trajectory to its end; never raises (cancellation ends it as aborted).

        `schemas` are the tool schemas its prompt was rendered with (for the drift check); `fresh()` makes the
        trajectory anew, for a retry after its engine died; `sampling` and `seed` are its `generate` call's.
        """
        if seed is not None:
            sampling = {**sampling, "sampling_seed": sampling_seed(seed, traj.uid)}
        for attempt in range(self.config.max_trajectory_retries + 1):
            try:
                await self._attempt(traj, schemas, sampling)
                break
            except EngineDeadError as exc:  # the sessions are closed: tools released, interaction finalized
                if self._aborted or attempt == self.config.max_trajectory_retries or not self.router.has_live():
                    traj.finish(FinishReason.ERROR, f"{exc} (retried {attempt} time(s), "
                                                    "actor_rollout_ref.rollout.max_trajectory_retries)")
                    break
                logger.warning("trajectory %s: %s; retrying it on an engine still alive (retry %d of %d)",
                               traj.uid, exc, attempt + 1, self.config.max_trajectory_retries)
                self.retried += 1
                vars(traj).update(vars(fresh()))
        traj.drift_index = self.codec.drift_index(traj, schemas)
        return traj

    async def _attempt(self, traj: Trajectory, schemas: list[dict[str, Any]] | None, sampling: dict[str, Any]) -> None:
        """One attempt at `traj` with its own tool instances and interaction; raises only EngineDeadError."""
        try:
            async with AsyncExitStack() as stack:
                stack.enter_context(trace_into(traj.traces))  # rollout_trace_op calls land on this trajectory
                instances: dict[str, str] = {}
                for name in traj.tool_names:
                    kw = traj.tools_kwargs.get(name) or {}
                    runner = self.tools.runner(name)
                    instances[name] = await stack.enter_async_context(
                        runner.session(kw.get("create_kwargs") or {}, kw.get("release_kwargs") or {})
                    )
                interaction: tuple[InteractionRunner, str] | None = None
                if traj.interaction_kwargs:
                    runner_i = self.interactions.route(traj.interaction_kwargs)
                    iid = await stack.enter_async_context(runner_i.session(**traj.interaction_kwargs))
                    interaction = (runner_i, iid)
                await self._turns(traj, instances, interaction, sampling)
                await self._final_tool_rewards(traj, instances)
        except asyncio.CancelledError:
            traj.finish(self._cancelled_reason())
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken trajectory must not end the run
            logger.exception("trajectory %s failed", traj.uid)
            traj.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            self.router.release(traj.uid)
        if traj.status is not TrajectoryStatus.DONE:
            traj.finish(FinishReason.ERROR, "the loop ended without a finish reason")

    async def _final_tool_rewards(self, traj: Trajectory, instances: dict[str, str]) -> None:
        """Ask every tool instance for its `calc_reward` (verl's per-instance reward) before it is released."""
        for name, iid in instances.items():
            kw = (traj.tools_kwargs.get(name) or {}).get("calc_reward_kwargs") or {}
            traj.tool_rewards[name] = await self.tools.runner(name).calc_reward(iid, **kw)

    def _budget(self, traj: Trajectory) -> int:
        left = self.config.response_length - len(traj.response_ids)
        if self.config.max_model_len is not None:
            left = min(left, self.config.max_model_len - traj.total_length)
        return left

    async def _turns(self, traj: Trajectory, instances: dict[str, str], interaction: tuple[InteractionRunner, str] | None,
                     sampling: dict[str, Any]) -> None:
        mt = self.config.multi_turn
        parser = self._parser(traj.tool_names) if traj.tool_names else None
        while True:
            if self._aborted:
                return traj.finish(FinishReason.ABORTED)
            budget = self._budget(traj)
            if budget <= 0:
                return traj.finish(FinishReason.LENGTH)
            traj.set_status(TrajectoryStatus.GENERATING)
            res = await self._generate(traj, budget, sampling)
            traj.append_assistant(res.output_ids, res.output_logprobs, res.weight_version)
            part = 0
            while res.meta.get("paused") and not self._aborted and self._budget(traj) > 0:
                part += 1  # a weight update paused the turn: continue it on the new weights
                res = await self._generate(traj, self._budget(traj), sampling, part)
                traj.append_assistant(res.output_ids, res.output_logprobs, res.weight_version, continues=True)
            turn_ids = traj.response_ids[traj.turns[-1].start:]
            text = self.codec.assistant_text(turn_ids)
            traj.messages.append({"role": "assistant", "content": text})
            if res.meta.get("paused") and not self._aborted:  # paused with its budget spent
                return traj.finish(FinishReason.LENGTH)
            if res.finish_reason == "abort":
                return traj.finish(FinishReason.ABORTED)
            if res.finish_reason == "length":
                return traj.finish(FinishReason.LENGTH)
            stop_id = turn_ids[-1] if turn_ids and turn_ids[-1] in self.codec.stop_token_ids else None
            parsed = parser.parse(text) if parser is not None else None
            if parsed is not None and parsed.has_calls:
                if traj.num_assistant_turns >= mt.max_assistant_turns:
                    return traj.finish(FinishReason.MAX_TURNS)
                traj.set_status(TrajectoryStatus.TOOL_CALLING)
                new_messages = await self._run_calls(traj, parsed.calls, instances)
            elif interaction is not None:
                traj.set_status(TrajectoryStatus.INTERACTING)
                t0 = time.monotonic()
                runner, iid = interaction
                turn = await runner.respond(iid, list(traj.messages), **traj.interaction_kwargs)
                traj.interaction_time_s += time.monotonic() - t0
                traj.interaction_scores.append(TurnScore(turn=traj.num_assistant_turns - 1, score=turn.score))
                if turn.error is not None:
                    return traj.finish(FinishReason.ERROR, f"interaction {runner.name!r}: {turn.error}")
                if turn.should_terminate:
                    return traj.finish(FinishReason.STOP)
                if traj.num_user_turns >= mt.max_user_turns or traj.num_assistant_turns >= mt.max_assistant_turns:
                    return traj.finish(FinishReason.MAX_TURNS)
                traj.num_user_turns += 1
                new_messages = [{"role": "user", "content": turn.text}]
            else:
                return traj.finish(FinishReason.STOP)
            delta = self.codec.delta_ids(new_messages, stop_id)
            if len(delta) >= self._budget(traj):  # no room for the context and one more sampled token
                traj.messages.extend(new_messages)
                return traj.finish(FinishReason.LENGTH)
            traj.append_context(delta, role=new_messages[0]["role"])
            traj.messages.extend(new_messages)

    async def _generate(self, traj: Trajectory, budget: int, sampling: dict[str, Any], part: int = 0) -> GenerateResult:
        """One engine request for the next assistant turn (`part` > 0: the rest of the last one, after a pause)."""
        params = {**sampling, "max_new_tokens": budget, "stop_token_ids": sorted(self.codec.stop_token_ids)}
        turn = traj.num_assistant_turns - (1 if part else 0)
        request_id = f"{traj.uid}#{turn}" + (f".{part}" if part else "")
        t0 = time.monotonic()
        try:
            res = await self.router.generate(traj.uid, traj.prompt_ids + traj.response_ids, params, request_id)
        finally:
            traj.generation_time_s += time.monotonic() - t0
        if len(res.output_ids) > budget:
            raise RuntimeError(
                f"engine returned {len(res.output_ids)} tokens for max_new_tokens={budget} (request {request_id}); "
                "the engine must honour max_new_tokens"
            )
        return res

    async def _run_calls(
        self, traj: Trajectory, calls: list[ParsedCall | MalformedCall], instances: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Run one turn's calls (at most `max_parallel_calls` at once); returns the tool messages in call order."""
        mt = self.config.multi_turn
        gate = asyncio.Semaphore(mt.max_parallel_calls)
        turn = traj.num_assistant_turns - 1

        async def one(call: ParsedCall | MalformedCall) -> ToolCallRecord:
            if isinstance(call, MalformedCall):
                return ToolCallRecord(turn=turn, name=call.name, arguments=None, raw=call.raw,
                                      result=call.message, error=call.kind)
            kw = (traj.tools_kwargs.get(call.name) or {}).get("execute_kwargs") or {}
            async with gate:
                r = await self.tools.runner(call.name).execute(instances[call.name], call.arguments, **kw)
            error = None if r.error is None else ("timeout" if r.timed_out else "exception")
            return ToolCallRecord(turn=turn, name=call.name, arguments=call.arguments, raw=call.raw, result=r.text,
                                  error=error, step_reward=r.step_reward, latency_s=r.latency_s,
                                  truncated=r.truncated, metrics=r.metrics)

        t0 = time.monotonic()
        try:
            records = await asyncio.gather(*(one(c) for c in calls))
        finally:
            traj.tool_time_s += time.monotonic() - t0
        messages = []
        for rec in records:
            rec.result, cut = self.codec.truncate(rec.result, mt.max_tool_response_length, mt.tool_response_truncate_side)
            rec.truncated = rec.truncated or cut
            traj.tool_calls.append(rec)
            messages.append({"role": "tool", "content": rec.result})
        return messages

    # ---- metrics -----------------------------------------------------------------------

    def instance_metrics(self) -> dict[str, float]:
        """Tool and interaction instances still alive (created and not released / finalized); 0 after a rollout."""
        m = {f"rollout/tool/{name}/instances_live": float(created - released)
             for name, (created, released) in self.tools.counts().items()}
        m.update({f"rollout/interaction/{name}/instances_live": float(started - finalized)
                  for name, (started, finalized) in self.interactions.counts().items()})
        return m


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """`rollout/*` and `timing/rollout_*` metrics of a rollout, computed from its trajectories alone."""
    m: dict[str, float] = {"rollout/num_trajectories": float(len(trajs))}
    reasons = Counter(t.finish_reason.value for t in trajs if t.finish_reason is not None)
    for r in FinishReason:
        m[f"rollout/finish/{r.value}"] = float(reasons.get(r.value, 0))
    n = max(len(trajs), 1)
    m["rollout/turns/assistant_mean"] = sum(t.num_assistant_turns for t in trajs) / n
    m["rollout/turns/assistant_max"] = float(max((t.num_assistant_turns for t in trajs), default=0))
    m["rollout/turns/user_mean"] = sum(t.num_user_turns for t in trajs) / n
    m["rollout/response_length/mean"] = sum(len(t.response_ids) for t in trajs) / n
    m["rollout/response_length/max"] = float(max((len(t.response_ids) for t in trajs), default=0))
    m["rollout/sampled_tokens"] = float(sum(sum(t.response_mask) for t in trajs))
    m["timing/rollout_generation_s"] = sum(t.generation_time_s for t in trajs)
    m["timing/rollout_tool_s"] = sum(t.tool_time_s for t in trajs)
    m["timing/rollout_interaction_s"] = sum(t.interaction_time_s for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    m["rollout/tool/calls"] = float(len(calls))
    m["rollout/tool/call_rate"] = sum(bool(t.tool_calls) for t in trajs) / n  # share of samples with a call
    m["rollout/tool/truncations"] = float(sum(c.truncated for c in calls))
    per_tool = Counter(c.name for c in calls if c.name is not None)
    per_tool_errors = Counter(c.name for c in calls if c.name is not None and c.error is not None)
    for name in set(per_tool) | {name for t in trajs for name in t.tool_names}:
        m[f"rollout/tool/{name}/calls"] = float(per_tool.get(name, 0))
        m[f"rollout/tool/{name}/errors"] = float(per_tool_errors.get(name, 0))
    for kind, count in Counter(c.error for c in calls if c.error is not None).items():
        m[f"rollout/tool/errors/{kind}"] = float(count)
    m["rollout/tool/reward_mean"] = sum(t.tool_reward for t in trajs) / n
    scores = [s.score for t in trajs for s in t.interaction_scores]
    m["rollout/interaction/score_mean"] = sum(scores) / len(scores) if scores else 0.0
    drifted = [t.drift_index for t in trajs if t.drift_index is not None]
    m["rollout/drift/count"] = float(len(drifted))
    m["rollout/drift/first_index_min"] = float(min(drifted)) if drifted else -1.0
    return m


def sampling_seed(seed: int, uid: str) -> int:
    """The SGLang `sampling_seed` of trajectory `uid` in a rollout seeded with `seed` (stable across runs)."""
    digest = hashlib.blake2b(f"{seed}/{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int64

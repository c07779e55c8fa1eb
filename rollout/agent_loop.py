"""The async multi-turn agent loop: trajectories over engines, tools and simulated users.

Every trajectory is its own asyncio task. One turn: send the token ids so far to the
trajectory's engine (least-loaded, then sticky: `EngineRouter`), append the returned ids
with mask 1, parse tool calls with SGLang's parser (`ToolCallParser`), run the turn's calls
concurrently, and append the tool messages as mask-0 tokens; when the model answers without
a call and the sample has an interaction, the simulated user's reply is appended the same
way. It stops on the model's own stop, on the interaction's say-so, or on a limit (assistant
turns, user turns, response tokens, model context).

Where it departs from the textbook "render the chat, tokenize, generate" loop:
- The first request sends the prompt ids tokenized at load (`RolloutPrompt.prompt_ids`, the ones the
  dataset's length filter measured); the engine's ids are never re-tokenized, and what the loop
  inserts between turns is the chat template's delta (`ChatCodec.delta_ids`). At the end the chat
  is re-rendered only to *check* it (`ChatCodec.drift_index`, metric `rollout/drift/*`).
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
- A prompt's `agent_name` (verl's, `rollout.prompt`) picks its loop: `single_turn_agent` prompts get no tools
  in their chat template and no simulated user, so they end after one assistant turn.
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
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

from tqdm import tqdm

from rollout.chat_codec import ChatCodec
from rollout.config import AGENT_LOOPS, RolloutConfig
from rollout.engines.base import EngineDeadError, GenerateResult, RolloutEngine
from rollout.engines.router import EngineRouter
from rollout.interactions.registry import InteractionRegistry
from rollout.interactions.runner import InteractionRunner
from rollout.prompt import RolloutPrompt, encode_prompt, sample_tools
from rollout.tool_parser import MalformedCall, ParsedCall, ToolCallParser
from rollout.tools.registry import ToolRegistry
from rollout.tracing import trace_into
from rollout.trajectory import FinishReason, ToolCallRecord, Trajectory, TrajectoryStatus, TurnScore

logger = logging.getLogger(__name__)


class AgentLoop:
    """Rolls out prompts on engines with tools and interactions; one instance per rollout worker."""

    def __init__(
        self,
        engines: list[RolloutEngine] | EngineRouter,
        tokenizer: Any,
        config: RolloutConfig,
        tools: ToolRegistry | None = None,
        interactions: InteractionRegistry | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.router = engines if isinstance(engines, EngineRouter) else EngineRouter(list(engines))
        self.config = config
        self.tools = tools or ToolRegistry([])
        self.interactions = interactions or InteractionRegistry([])
        self.codec = ChatCodec.for_tokenizer(tokenizer, chat_template_kwargs)  # every turn renders with them
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._parsers: dict[tuple[str, ...], ToolCallParser] = {}
        if self.tools.names:  # the parser of samples with every tool, built now: SGLang's import, not mid-rollout
            self._parser(self.tools.names)
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
            if p.agent_name not in AGENT_LOOPS:
                raise ValueError(f"prompt {p.uid}: agent_name={p.agent_name!r}; polyturn runs {AGENT_LOOPS}")
            if p.single_turn:  # no tools, no simulated user: its kwargs are not used
                continue
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
            tool_names, schemas = sample_tools(p, self.tools)
            prompt_ids = encode_prompt(p, self.codec, self.tools)  # the ids the dataset measured, when it tokenized them
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
            interaction_kwargs={} if p.single_turn else dict(p.interaction_kwargs),  # single turn: no simulated user
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
                if _reached(traj.num_assistant_turns, mt.max_assistant_turns):
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
                if _reached(traj.num_user_turns, mt.max_user_turns) or _reached(traj.num_assistant_turns,
                                                                                mt.max_assistant_turns):
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


def sampling_seed(seed: int, uid: str) -> int:
    """The SGLang `sampling_seed` of trajectory `uid` in a rollout seeded with `seed` (stable across runs)."""
    digest = hashlib.blake2b(f"{seed}/{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int64


def _reached(turns: int, limit: int | None) -> bool:
    """True when `turns` has reached a turn limit (None: no limit)."""
    return limit is not None and turns >= limit

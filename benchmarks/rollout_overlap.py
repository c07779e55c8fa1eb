"""Benchmark: async per-trajectory rollout vs a turn-synchronous batch rollout, same engine, same work.

`python -m benchmarks.rollout_overlap [--trajectories 64 --turns 4 --seed 0] [--smoke]` starts one SGLang
engine (the CPU engine on a machine without GPU) on a freshly written tiny checkpoint. Each
trajectory makes one tool call per turn for `--turns` turns, then answers. Response lengths vary
per turn (seeded) and are enforced with SGLang's `regex` sampling parameter (the tiny random model
would not call tools by itself); the tool sleeps a seeded latency, 50 ms for 90% of calls and 1 s
for 10% (a long tail, like real sandboxes).

- async: `AgentLoop` — every trajectory is its own coroutine; a slow tool call stalls only its
  own trajectory.
- turn-synchronous baseline: at each turn every trajectory generates, the batch waits for the
  slowest, then every tool call runs, the batch waits for the slowest (older batch rollouts).

Last line, JSON: `{"wall_s": w, "critical_path_s": c, "turn_sync_wall_s": s}` (RESULT_KEYS) where `c` is the
longest single trajectory's own generation + tool time in the async run. Goals: `w / c <= 1.15`
(the async run is close to its limit) and `s / w >= 2`. A warm-up run first compiles the regex
grammars so neither timed run pays for them. `--smoke`: 4 trajectories of 1 tool call after the shortest
text, the same code path in seconds (the suite runs it; its figures mean nothing).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import tempfile
import time
from typing import Any

from rollout.agent_loop import AgentLoop
from rollout.config import MultiTurnConfig, RolloutConfig
from rollout.engines.base import GenerateResult
from rollout.interactions.registry import InteractionRegistry
from rollout.prompt import RolloutPrompt
from rollout.tools.base import BaseTool
from rollout.tools.registry import ToolRegistry
from rollout.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger("benchmarks.rollout_overlap")

FAST_S, SLOW_S, SLOW_FRACTION = 0.05, 1.0, 0.1
LENGTHS = (8, 32, 96)  # characters of free text before each call: few distinct regexes, varied lengths
TOOL_NAME = "wait"
RESULT_KEYS = ("wall_s", "critical_path_s", "turn_sync_wall_s")


class Workload:
    """The seeded work: per (trajectory, turn) a text length and a tool latency."""

    def __init__(self, trajectories: int, turns: int, seed: int, lengths: tuple[int, ...] = LENGTHS):
        rng = random.Random(seed)
        self.turns = turns
        self.uids = [f"t{i}" for i in range(trajectories)]
        self.length = {(u, k): rng.choice(lengths) for u in self.uids for k in range(turns + 1)}
        self.latency = {(u, k): SLOW_S if rng.random() < SLOW_FRACTION else FAST_S for u in self.uids for k in range(turns)}

    def regex(self, uid: str, turn: int) -> str:
        """The regex of an assistant turn: free text of the seeded length, then a call (or the final answer)."""
        text = f"[a-z ]{{{self.length[(uid, turn)]}}}"
        if turn < self.turns:
            return text + r'\n<tool_call>\n\{"name": "' + TOOL_NAME + r'", "arguments": \{"turn": ' + str(turn) + r'\}\}\n</tool_call>'
        return text + r"\."


class WaitTool(BaseTool):
    """Sleeps the workload's latency for (trajectory, turn) and answers "ok".

    Written against the tool API's loosest form (`**kwargs` everywhere): the runner may pass the sample's
    kwargs flat, under `create_kwargs=`, or both, so `uid` is read from either.
    """

    def __init__(self, work: Workload):
        schema = OpenAIFunctionToolSchema.from_dict({"type": "function", "function": {
            "name": TOOL_NAME, "description": "wait for a result",
            "parameters": {"type": "object", "properties": {"turn": {"type": "integer"}}, "required": ["turn"]}}})
        super().__init__({"timeout_s": 10.0, "max_concurrency": 1024}, schema)
        self.work = work

    async def create(self, instance_id: str | None = None, **kwargs: Any):
        uid = kwargs.get("uid") or (kwargs.get("create_kwargs") or {}).get("uid")
        if uid not in self.work.uids:
            raise ValueError(f"create got no known uid in its kwargs {kwargs!r}; _prompts puts it in create_kwargs")
        return f"{uid}@{random.random()}", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        await asyncio.sleep(self.work.latency[(instance_id.split("@")[0], int(parameters["turn"]))])
        return "ok", 0.0, {}


class SteeredEngine:
    """The real engine, with the workload's regex of the turn added to the sampling params."""

    def __init__(self, engine: Any, work: Workload):
        self.engine, self.work, self.name = engine, work, engine.name

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def num_inflight(self) -> int:
        return self.engine.num_inflight

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        uid, turn = request_id.rsplit("#", 1)
        params = dict(sampling_params, regex=self.work.regex(uid.split("/")[0], int(turn)))
        return await self.engine.generate(input_ids, params, request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


def _prompts(work: Workload) -> list[RolloutPrompt]:
    return [RolloutPrompt(uid=u, messages=[{"role": "user", "content": f"Task {u}: wait for the results."}],
                          tools_kwargs={TOOL_NAME: {"create_kwargs": {"uid": u}}}) for u in work.uids]


def _agent_loop(engine: SteeredEngine, tokenizer: Any, work: Workload) -> AgentLoop:
    config = RolloutConfig(n=1, response_length=1536, max_model_len=2048, temperature=1.0,
                             multi_turn=MultiTurnConfig(max_assistant_turns=work.turns + 1))
    return AgentLoop([engine], tokenizer, config, ToolRegistry([WaitTool(work)]), InteractionRegistry([]))


async def run_async(loop: AgentLoop) -> tuple[float, float]:
    """The async rollout; returns (wall_s, critical_path_s)."""
    t0 = time.monotonic()
    trajs = await loop.generate(_prompts(loop.tools.runner(TOOL_NAME).tool.work))
    wall = time.monotonic() - t0
    calls = loop.config.multi_turn.max_assistant_turns - 1
    bad = [t for t in trajs if t.finish_reason.value != "stop" or len(t.tool_calls) != calls
           or any(c.error for c in t.tool_calls)]
    if bad:
        t = bad[0]
        raise RuntimeError(
            f"async run: {len(bad)} trajectories did not do the full work, e.g. {t.uid}: finish {t.finish_reason.value} "
            f"({t.error}), calls {[(c.name, c.error, c.result[:80]) for c in t.tool_calls]}, "
            f"last message {t.messages[-1]['content'][-200:]!r}"
        )
    critical = max(t.generation_time_s + t.tool_time_s for t in trajs)
    return wall, critical


async def run_turn_sync(loop: AgentLoop) -> float:
    """The baseline: each turn, all generations then all tool calls, each phase waiting for its slowest member."""
    work: Workload = loop.tools.runner(TOOL_NAME).tool.work
    codec, engine = loop.codec, loop.router.engines[0]
    seqs = {p.uid: codec.prompt_ids(p.messages, loop.tools.schemas([TOOL_NAME])) for p in _prompts(work)}
    params = {"temperature": 1.0, "max_new_tokens": 256, "stop_token_ids": sorted(codec.stop_token_ids)}
    t0 = time.monotonic()
    for turn in range(work.turns + 1):
        results = await asyncio.gather(*(engine.generate(ids, params, f"{uid}/0#{turn}") for uid, ids in seqs.items()))
        if turn == work.turns:
            break
        await asyncio.gather(*(asyncio.sleep(work.latency[(uid, turn)]) for uid in seqs))
        for (uid, ids), res in zip(seqs.items(), results):
            delta = codec.delta_ids([{"role": "tool", "content": "ok"}], res.output_ids[-1] if res.output_ids else None)
            seqs[uid] = ids + res.output_ids + delta
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="tool calls (one per turn) before the final answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="4 trajectories, 1 call each: the code path in seconds")
    args = parser.parse_args(argv)
    lengths = LENGTHS
    if args.smoke:
        args.trajectories, args.turns, lengths = 4, 1, LENGTHS[:1]
    handler = logging.StreamHandler()  # this script's progress only; SGLang keeps its own log level
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    from transformers import AutoTokenizer

    from recipe.tiny_model import write_tiny_checkpoint
    from rollout.engines.sglang_engine import SGLangEngine

    model_dir = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="rollout-overlap-"), seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = SGLangEngine(model_dir, name="bench", dtype="float32", random_seed=args.seed,
                          max_total_tokens=262144, log_level="error")  # KV room for every request's max_new_tokens: admission never serializes trajectories
    try:
        work = Workload(args.trajectories, args.turns, args.seed, lengths)
        loop = _agent_loop(SteeredEngine(engine, work), tokenizer, work)
        warm = Workload(len(lengths), args.turns, args.seed)  # one trajectory per length: every regex compiled once
        warm.length = {(u, k): lengths[i] for i, u in enumerate(warm.uids) for k in range(args.turns + 1)}
        warm.latency = {key: 0.0 for key in warm.latency}
        asyncio.run(run_async(_agent_loop(SteeredEngine(engine, warm), tokenizer, warm)))
        logger.info("warm-up done")
        wall, critical = asyncio.run(run_async(loop))
        logger.info("async: wall %.2fs, critical path %.2fs", wall, critical)
        sync_wall = asyncio.run(run_turn_sync(loop))
        logger.info("turn-synchronous: wall %.2fs", sync_wall)
    finally:
        engine.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    result = {"wall_s": round(wall, 3), "critical_path_s": round(critical, 3), "turn_sync_wall_s": round(sync_wall, 3)}
    logger.info("w/c = %.3f (goal <= 1.15), s/w = %.3f (goal >= 2)", wall / critical, sync_wall / wall)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

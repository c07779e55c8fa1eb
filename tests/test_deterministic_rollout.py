"""Reproducible rollouts (`actor_rollout_ref.rollout.deterministic`) on the real SGLang CPU engine.

The engine runs with SGLang's `enable_deterministic_inference`; on CPU, rollout/sglang_cpu.py's SGLang plug-in
supplies the seeded sampling's hash op and computes matrix products row by row. A request with a
`sampling_seed` then samples the same tokens with the same log-probs whichever requests share its batch, and the
agent loop, given a seed, repeats its trajectories (tokens, log-probs, masks, simulated-user turns) exactly.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout.agent_loop import AgentLoop
from rollout.config import MultiTurnConfig, RolloutConfig
from rollout.interactions.registry import InteractionRegistry
from rollout.prompt import RolloutPrompt
from rollout.tools.registry import ToolRegistry
from tests.test_agent_loop_sglang import RegexSteeredEngine

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[1] / "tool_configs"
ANSWER = r"The answer is [1-9][0-9]?\."  # every turn: a short sampled answer the simulated user may reject
PROMPTS = [[1 + (7 * i + j) % 50 for j in range(5 + i % 4)] for i in range(8)]


@pytest.fixture(scope="module")
def det_engine(tiny_model_dir):
    from rollout.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine(str(tiny_model_dir), name="det-engine", dtype="float32", random_seed=0,
                          max_total_tokens=8192, log_level="error", enable_deterministic_inference=True)
    yield engine
    engine.shutdown()


def _params(seed: int | None) -> dict:
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "ignore_eos": True}
    return params if seed is None else {**params, "sampling_seed": seed}


async def _batch(engine, order: list[int], tag: str, extra: int = 0) -> dict[int, tuple[list[int], list[float]]]:
    """Requests `order` (prompt i with seed 100 + i) at once, plus `extra` unseeded requests in the same batch."""
    reqs = [engine.generate(PROMPTS[i], _params(100 + i), f"{tag}-{i}") for i in order]
    reqs += [engine.generate(PROMPTS[k % 8][::-1], _params(None), f"{tag}-x{k}") for k in range(extra)]
    res = await asyncio.gather(*reqs)
    return {i: (r.output_ids, r.output_logprobs) for i, r in zip(order, res)}


def test_a_seeded_request_samples_the_same_alone_and_in_any_batch(det_engine):
    """Contract: with a sampling_seed, a request's tokens and log-probs are bit-equal whether it runs alone, in a batch
    of 8, or reversed among 12 requests; its seed, not the engine's generator, decides what it samples."""
    async def run():
        together = await _batch(det_engine, list(range(8)), "all")
        mixed = await _batch(det_engine, list(range(8))[::-1], "mixed", extra=4)
        alone = {}
        for i in range(8):
            alone.update(await _batch(det_engine, [i], f"alone{i}"))
        other_seed = await det_engine.generate(PROMPTS[0], _params(7), "other-seed")
        return together, mixed, alone, other_seed

    together, mixed, alone, other_seed = asyncio.run(run())
    assert all(len(ids) == 16 for ids, _ in together.values())
    assert mixed == together
    assert alone == together
    assert other_seed.output_ids != together[0][0]


def _loop(engine, tokenizer) -> AgentLoop:
    """A multi-turn loop; the tiny model's turns are kept short by SGLang's regex-constrained decoding."""
    config = RolloutConfig(
        n=3, response_length=200, temperature=1.0,
        multi_turn=MultiTurnConfig(tool_config_path=str(CONFIGS / "gsm8k_tool_config.yaml"),
                                   interaction_config_path=str(CONFIGS / "gsm8k_interaction_config.yaml"),
                                   max_assistant_turns=3, max_user_turns=2))
    mt = config.multi_turn
    return AgentLoop([RegexSteeredEngine(engine, [ANSWER])], tokenizer, config, ToolRegistry.from_config(mt.tool_config_path),
                     InteractionRegistry.from_config(mt.interaction_config_path))


def _prompt(uid: str, a: int, b: int) -> RolloutPrompt:
    truth = str(a * b)
    return RolloutPrompt.from_row({
        "prompt": [{"role": "user", "content": f"What is {a} times {b}?"}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                       "interaction_kwargs": {"name": "gsm8k", "ground_truth": truth}}}, uid=uid)


def _observed(trajs) -> list[tuple]:
    return [(t.uid, t.response_ids, t.rollout_logprobs, t.response_mask, t.finish_reason, t.messages) for t in trajs]


def test_a_seeded_agent_loop_repeats_its_multi_turn_trajectories(det_engine, tiny_model_dir):
    """Contract: `generate(prompts, seed=s)` twice gives identical trajectories (ids, log-probs, masks, finish
    reasons, simulated-user turns), the second time while another loop's rollout shares the engine; the samples of
    a group differ from each other, and another seed samples differently."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    loop, other = _loop(det_engine, tokenizer), _loop(det_engine, tokenizer)
    prompts = [_prompt("p0", 3, 4), _prompt("p1", 6, 7)]

    async def run():
        first = await loop.generate(prompts, seed=7)
        again, _ = await asyncio.gather(loop.generate(prompts, seed=7),
                                        other.generate([_prompt("q0", 2, 9), _prompt("q1", 5, 5)], seed=11))
        reseeded = await loop.generate(prompts, seed=8)
        return first, again, reseeded

    first, again, reseeded = asyncio.run(run())
    assert all(t.num_user_turns >= 1 for t in first)  # multi-turn: the simulated user replied
    assert _observed(again) == _observed(first)
    assert len({tuple(t.response_ids) for t in first[:3]}) == 3  # a group's samples differ
    assert [t.response_ids for t in reseeded] != [t.response_ids for t in first]

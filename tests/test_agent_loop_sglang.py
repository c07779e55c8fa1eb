"""The agent loop on the real SGLang engine (CPU engine here) with the tiny checkpoint.

A tiny random model does not call tools on its own, so each turn is steered with SGLang's own
constrained decoding: `RegexSteeredEngine` adds a per-turn `regex` to the sampling params
(SGLang's `regex` sampling parameter, grammar-constrained sampling inside the engine). The
tokens are still sampled by the engine from the model; parsing, masking, the gsm8k tool and
the gsm8k interaction (both from `tool_configs/`), the router and the loop are the real code.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rollout.agent_loop import AgentLoop
from rollout.config import MultiTurnConfig, RolloutConfig
from rollout.engines.base import GenerateResult
from rollout.interactions.registry import InteractionRegistry
from rollout.metrics import rollout_metrics
from rollout.prompt import RolloutPrompt
from rollout.tools.registry import ToolRegistry
from rollout.trajectory import FinishReason

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[1] / "tool_configs"
TOOL_CALL = r'<tool_call>\n\{"name": "calc_gsm8k_reward", "arguments": \{"answer": "[1-9][0-9]?"\}\}\n</tool_call>'
WRONG_ANSWER = r"The answer is 1[0-9]\."  # never the ground truth 72: the simulated user replies
RIGHT_ANSWER = r"So it is #### 72\."  # GSM8K's answer format: the interaction scores strictly, as verl does


class RegexSteeredEngine:
    """Forwards to a real engine, adding SGLang's `regex` sampling parameter chosen by the turn number.

    Records what the engine returned per trajectory, to check the loop's mask against it.
    """

    def __init__(self, engine: Any, regexes: list[str | None]):
        self.engine = engine
        self.name = f"steered-{engine.name}"
        self.regexes = regexes
        self.returned: dict[str, list[GenerateResult]] = defaultdict(list)
        self.inputs: dict[str, list[list[int]]] = defaultdict(list)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def num_inflight(self) -> int:
        return self.engine.num_inflight

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        uid, turn = request_id.rsplit("#", 1)  # "<uid>#<turn>", or "<uid>#<turn>.<part>" after a pause
        params = dict(sampling_params)
        regex = self.regexes[min(int(turn.split(".")[0]), len(self.regexes) - 1)]
        if regex is not None:
            params["regex"] = regex
        self.inputs[uid].append(list(input_ids))
        res = await self.engine.generate(input_ids, params, request_id)
        self.returned[uid].append(res)
        return res

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _gsm8k_prompt(uid: str) -> RolloutPrompt:
    row = {
        "prompt": [{"role": "user", "content": "Tom has 8 boxes with 9 apples each. How many apples? "
                                                "Check your answer with the tool."}],
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"index": 0,
                       "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
                       "interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}},
    }
    return RolloutPrompt.from_row(row, uid=uid)


def _loop(engine, tokenizer, **mt: Any) -> AgentLoop:
    config = RolloutConfig(
        n=2, response_length=400, temperature=1.0,
        multi_turn=MultiTurnConfig(tool_config_path=str(CONFIGS / "gsm8k_tool_config.yaml"),
                                   interaction_config_path=str(CONFIGS / "gsm8k_interaction_config.yaml"),
                                   max_assistant_turns=4, max_user_turns=2, **mt),
    )
    mt = config.multi_turn
    return AgentLoop([engine], tokenizer, config, ToolRegistry.from_config(mt.tool_config_path),
                     InteractionRegistry.from_config(mt.interaction_config_path))


def test_tool_and_interaction_turns_on_sglang(sglang_engine, tokenizer):
    """Contract: on the real engine, response_mask is 1 exactly on the ids the engine returned (checked turn by turn
    against the engine's own output, with its log-probs), 0 on tool/user/template tokens; the decoded training
    sequence is the chat template's rendering of the messages, and the drift metric agrees with an id-level check."""
    steered = RegexSteeredEngine(sglang_engine, [TOOL_CALL, WRONG_ANSWER, RIGHT_ANSWER])
    loop = _loop(steered, tokenizer)
    out = asyncio.run(loop.generate([_gsm8k_prompt("g0")]))
    assert len(out) == 2
    for traj in out:
        assert traj.finish_reason is FinishReason.STOP, traj.error
        assert [s.role for s in traj.turns] == ["assistant", "tool", "assistant", "user", "assistant"]
        engine_out = steered.returned[traj.uid]
        # mask 1 exactly on the engine's ids, with the engine's log-probs, turn by turn
        spans = [s for s in traj.turns if s.role == "assistant"]
        assert [traj.response_ids[s.start:s.end] for s in spans] == [r.output_ids for r in engine_out]
        assert [traj.rollout_logprobs[s.start:s.end] for s in spans] == [r.output_logprobs for r in engine_out]
        for s in traj.turns:
            assert set(traj.response_mask[s.start:s.end]) == ({1} if s.role == "assistant" else {0})
        assert sum(traj.response_mask) == sum(len(r.output_ids) for r in engine_out)
        # each engine call continued exactly the training sequence built so far
        for s, ids in zip(spans, steered.inputs[traj.uid]):
            assert ids == traj.prompt_ids + traj.response_ids[: s.start]
        assert traj.weight_versions == [sglang_engine.weight_version] * 3
        # the real tool ran on the regex-forced call; the real interaction replied once, then accepted
        (call,) = traj.tool_calls
        assert call.error is None and call.name == "calc_gsm8k_reward" and call.result.startswith("Current parsed answer=")
        # each score carries the assistant turn it graded (turn 0 made the tool call)
        assert [(s.turn, s.score) for s in traj.interaction_scores] == [(1, 0.0), (2, 1.0)] and traj.num_user_turns == 1
        assert traj.messages[-1]["content"] == "So it is #### 72."
        # template consistency: the decoded ids are the template's text for the same messages
        rendered = tokenizer.apply_chat_template(traj.messages, tools=loop.tools.schemas(traj.tool_names),
                                                 add_generation_prompt=False, tokenize=False)
        decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
        assert rendered.rstrip("\n") == decoded.rstrip("\n")
        canonical = tokenizer.encode(rendered, add_special_tokens=False)
        ours = traj.prompt_ids + traj.response_ids
        same_ids = canonical[: len(ours)] == ours
        assert (traj.drift_index is None) == same_ids
    metrics = {**rollout_metrics(out), **loop.instance_metrics()}
    assert metrics["rollout/drift/count"] == sum(t.drift_index is not None for t in out)
    assert metrics["rollout/tool/calc_gsm8k_reward/instances_live"] == 0
    assert metrics["rollout/interaction/gsm8k/instances_live"] == 0
    assert metrics["rollout/sampled_tokens"] == sum(sum(t.response_mask) for t in out)


def test_abort_mid_generation_on_sglang(sglang_engine, tokenizer):
    """Contract: AgentLoop.abort stops in-flight requests on the real engine; trajectories end aborted with the
    partial engine ids kept (mask 1); tools are released and interactions finalized."""
    # No turn can end before the budget: the grammar admits a stop token only once the regex matches, and 5000
    # letters are more than the 400-token budget can hold (this tokenizer's longest letters-only token has 12).
    steered = RegexSteeredEngine(sglang_engine, [r"[a-z ]{5000,}"])
    loop = _loop(steered, tokenizer)

    async def run():
        task = asyncio.ensure_future(loop.generate([_gsm8k_prompt("a0")]))
        while sglang_engine.num_inflight < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        await loop.abort()
        return await task

    out = asyncio.run(run())
    for traj in out:
        assert traj.finish_reason is FinishReason.ABORTED
        assert traj.response_mask == [1] * len(traj.response_ids)
        assert len(traj.response_ids) < 300
    assert sglang_engine.num_inflight == 0
    metrics = {**rollout_metrics(out), **loop.instance_metrics()}
    assert metrics["rollout/tool/calc_gsm8k_reward/instances_live"] == 0
    assert metrics["rollout/interaction/gsm8k/instances_live"] == 0
    assert metrics["rollout/finish/aborted"] == 2


def test_a_weight_update_mid_turn_continues_the_turn_on_sglang(sglang_engine, tokenizer, tiny_model_dir):
    """Contract (partial rollout): the router's pause aborts the requests in flight on the real engine, which return
    what they sampled under the old version; new weights land while paused; after resume the same turn continues
    on them. The turn is one assistant span whose tokens carry the old version up to where the update landed and
    the new one after it, and the continuation was asked to extend exactly the tokens sampled so far."""
    steered = RegexSteeredEngine(sglang_engine, [r"[a-z ]{5000,}"])  # no turn ends before its 400-token budget
    loop = _loop(steered, tokenizer)
    before = sglang_engine.weight_version

    async def run():
        task = asyncio.ensure_future(loop.generate([_gsm8k_prompt("p0")]))
        while sglang_engine.num_inflight < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        await loop.router.pause()
        assert sglang_engine.num_inflight == 0
        sglang_engine.update_weights_from_disk(str(tiny_model_dir), weight_version=before + 1)
        loop.router.resume()
        return await task

    out = asyncio.run(run())
    for traj in out:
        first, rest = steered.returned[traj.uid]
        cut = len(first.output_ids)
        assert first.finish_reason == "abort" and 0 < cut < 400 and first.weight_version == before
        assert rest.weight_version == before + 1
        assert traj.finish_reason is FinishReason.LENGTH and len(traj.response_ids) == 400
        assert [s.role for s in traj.turns] == ["assistant"] and traj.turns[0].version_changes == [(cut, before + 1)]
        assert traj.weight_versions == [before, before + 1]
        assert traj.response_ids == first.output_ids + rest.output_ids and traj.response_mask == [1] * 400
        assert steered.inputs[traj.uid][1] == traj.prompt_ids + first.output_ids

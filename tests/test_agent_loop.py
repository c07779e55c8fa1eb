"""Unit tests of the async agent loop with a scripted engine at the engine seam.

`ScriptedEngine` stands in for an inference engine only: it returns pre-scripted token ids
(the tiny tokenizer's encoding of scripted assistant texts, plus the stop token) for each
call, with made-up log-probs, optional delays, hangs and aborts. Everything above the seam
is real: the chat template of the tiny checkpoint, SGLang's tool-call parser, the tool and
interaction runners and registries, the router and the loop.
"""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any, Callable

import pytest

from rollout.agent_loop import AgentLoop
from rollout.chat_codec import ChatCodec
from rollout.config import MultiTurnConfig, RolloutConfig
from rollout.engines.base import GenerateResult
from rollout.engines.router import EngineRouter
from rollout.interactions.base import BaseInteraction
from rollout.interactions.registry import InteractionRegistry
from rollout.metrics import rollout_metrics
from rollout.prompt import RolloutPrompt
from rollout.tools.base import BaseTool
from rollout.tools.registry import ToolRegistry
from rollout.tools.schemas import OpenAIFunctionToolSchema
from rollout.trajectory import FinishReason, TurnScore

pytestmark = pytest.mark.unit


# ---- the engine seam stand-in ------------------------------------------------------------


class ScriptedEngine:
    """Stand-in at the engine seam: answers each request with pre-scripted token ids.

    `policy(trajectory_uid, turn)` gives the assistant text of that turn; it is encoded with the
    real tokenizer and the stop token is appended (unless the text is `None`: then the engine
    hangs until aborted). `delay_s` delays each answer; `abort` makes a pending request return
    what it had "sampled" so far with finish reason "abort".
    """

    def __init__(self, tokenizer: Any, policy: Callable[[str, int], str | None], name: str = "scripted",
                 delay_s: float = 0.0, fail_on: set[str] | None = None):
        self.name = name
        self.tokenizer = tokenizer
        self.policy = policy
        self.delay_s = delay_s
        self.fail_on = fail_on or set()
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []  # (request_id, input_ids, params)
        self.returned: dict[str, list[list[int]]] = defaultdict(list)  # trajectory uid -> ids returned per call
        self.aborted: list[str] = []
        self._pending: dict[str, asyncio.Event] = {}
        self._inflight = 0
        self.version = 7

    @property
    def weight_version(self) -> int:
        return self.version

    @property
    def num_inflight(self) -> int:
        return self._inflight

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        uid, turn = request_id.rsplit("#", 1)
        self.calls.append((request_id, list(input_ids), dict(sampling_params)))
        if uid in self.fail_on:
            raise RuntimeError(f"engine failure on {request_id}")
        self._inflight += 1
        event = self._pending[request_id] = asyncio.Event()
        try:
            text = self.policy(uid, int(turn))
            if text is None:  # hang until aborted; the partial output is two sampled tokens
                await event.wait()
                ids = self.tokenizer.encode("Let me", add_special_tokens=False)
                finish = "abort"
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
                finish = "stop"
                max_new = sampling_params["max_new_tokens"]
                if len(ids) > max_new:
                    ids, finish = ids[:max_new], "length"
                if self.delay_s:
                    try:
                        await asyncio.wait_for(event.wait(), self.delay_s)
                        ids, finish = ids[:1], "abort"
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._inflight -= 1
            self._pending.pop(request_id, None)
        self.returned[uid].append(list(ids))
        return GenerateResult(output_ids=ids, output_logprobs=[-0.5 - 0.01 * i for i in range(len(ids))],
                              finish_reason=finish, weight_version=self.version)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self._pending:
            self._pending[request_id].set()


# ---- tools and interactions used by the tests ---------------------------------------------


def _schema(name: str, props: dict[str, Any], required: list[str]) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.from_dict(
        {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                          "parameters": {"type": "object", "properties": props, "required": required}}}
    )


class AddTool(BaseTool):
    """Adds two integers; counts concurrency; `step_reward` 0.25 per call."""

    def __init__(self, config: dict[str, Any] | None = None, delay_s: float = 0.0):
        super().__init__(config or {}, _schema("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]))
        self.delay_s = delay_s
        self.active = 0
        self.max_active = 0
        self.created: list[str] = []
        self.released: list[str] = []
        self.create_kwargs: list[dict[str, Any]] = []

    async def create(self, instance_id=None, **kwargs):
        iid, _ = await super().create(instance_id, **kwargs)
        self.created.append(iid)
        self.create_kwargs.append(kwargs)
        return iid, None

    async def execute(self, instance_id, parameters, **kwargs):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return str(parameters["a"] + parameters["b"]), 0.25, {"ok": 1}
        finally:
            self.active -= 1

    async def calc_reward(self, instance_id, **kwargs):
        return 0.5 + float(kwargs.get("bonus", 0.0)) if instance_id in self.created else -1.0

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class FaultyTool(BaseTool):
    """`mode` = "raise" | "hang" | "huge": a tool that fails, never returns, or returns 1 MB."""

    def __init__(self, name: str, mode: str, timeout_s: float = 0.3):
        super().__init__({"timeout_s": timeout_s}, _schema(name, {"q": {"type": "string"}}, []))
        self.mode = mode
        self.cancelled = 0
        self.created = 0
        self.released = 0

    async def create(self, instance_id=None, **kwargs):
        self.created += 1
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        if self.mode == "raise":
            raise ValueError("the tool broke")
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return "x" * (1 << 20), 0.0, {}

    async def release(self, instance_id, **kwargs):
        self.released += 1


class ScriptedUser(BaseInteraction):
    """Simulated user: says "try again" until the answer contains the ground truth; `raise_on_turn` raises."""

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config or {})
        self.started: list[str] = []
        self.finalized: list[str] = []
        self.raise_on_turn: int | None = self.config.get("raise_on_turn")
        self.turns: dict[str, int] = defaultdict(int)
        self.ground_truth: dict[str, str] = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        iid = await super().start_interaction(instance_id, **kwargs)
        self.started.append(iid)
        self.ground_truth[iid] = kwargs.get("answer", "")
        return iid

    async def generate_response(self, instance_id, messages, **kwargs):
        turn = self.turns[instance_id]
        self.turns[instance_id] += 1
        if self.raise_on_turn is not None and turn >= self.raise_on_turn:
            raise RuntimeError("the simulated user crashed")
        if self.ground_truth[instance_id] in messages[-1]["content"]:
            return True, "Correct!", 1.0, {}
        return False, "Not quite, try again.", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        self.finalized.append(instance_id)


# ---- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _call(name: str, **args: Any) -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'


class HungUser(ScriptedUser):
    """A simulated user that never answers (until cancelled)."""

    async def generate_response(self, instance_id, messages, **kwargs):
        await asyncio.sleep(3600)


def by_kind(uid: str, turn: int) -> str | None:
    """A policy by the prompt uid's prefix: `fast-*` answer at once, `gen-*` hang on the engine, `tool-*` call the
    hanging `sleepy` tool, `user-*` answer (then wait on the simulated user)."""
    return {"fast": "The answer is 5.", "gen": None, "tool": _call("sleepy", q="z"), "user": "hello"}[uid.split("-")[0]]


def _prompt(uid: str, text: str = "What is 2 plus 3?", **kw: Any) -> RolloutPrompt:
    return RolloutPrompt(uid=uid, messages=[{"role": "user", "content": text}], **kw)


def _loop(tokenizer, engine, tools=(), interactions=(), **cfg: Any) -> AgentLoop:
    mt = cfg.pop("multi_turn", {})
    config = RolloutConfig(response_length=cfg.pop("response_length", 256), multi_turn=MultiTurnConfig(**mt), **cfg)
    engines = engine if isinstance(engine, list) else [engine]
    return AgentLoop(engines, tokenizer, config, ToolRegistry(list(tools)), InteractionRegistry(list(interactions)))


def _assert_mask_is_engine_output(traj, engine: ScriptedEngine) -> None:
    """The mask-1 positions hold exactly the engine's returned ids, turn by turn, and nothing else."""
    sampled = [[i for i, m in zip(traj.response_ids[s.start:s.end], traj.response_mask[s.start:s.end])]
               for s in traj.turns if s.role == "assistant"]
    assert sampled == engine.returned[traj.uid]
    for s in traj.turns:
        assert set(traj.response_mask[s.start:s.end]) <= ({1} if s.role == "assistant" else {0})
    traj.check_invariants()


# ---- tests -----------------------------------------------------------------------------------


def test_tool_turn_masks_and_template_consistency(tokenizer):
    """Contract: mask is 1 exactly on engine ids; tool tokens (mask 0) equal the chat template's own rendering (no drift)."""
    policy = lambda uid, turn: [_call("add", a=2, b=3), "The answer is 5."][turn]
    engine = ScriptedEngine(tokenizer, policy)
    tool = AddTool()
    out = asyncio.run(_loop(tokenizer, engine, [tool]).generate([_prompt("q0")]))
    (traj,) = out
    assert traj.finish_reason is FinishReason.STOP
    assert [s.role for s in traj.turns] == ["assistant", "tool", "assistant"]
    _assert_mask_is_engine_output(traj, engine)
    # the second engine call saw exactly prompt + first turn + tool delta
    assert engine.calls[1][1] == traj.prompt_ids + traj.response_ids[: traj.turns[1].end]
    tool_text = tokenizer.decode(traj.response_ids[traj.turns[1].start: traj.turns[1].end])
    assert tool_text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    (call,) = traj.tool_calls
    assert (call.name, call.arguments, call.result, call.error, call.step_reward) == ("add", {"a": 2, "b": 3}, "5", None, 0.25)
    metrics = rollout_metrics(out)
    assert traj.drift_index is None and metrics["rollout/drift/count"] == 0
    assert traj.weight_versions == [7, 7]
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert tool.created == tool.released and len(tool.created) == 1
    assert sum(traj.response_mask) == metrics["rollout/sampled_tokens"] == sum(len(x) for x in engine.returned["q0/0"])
    assert metrics["rollout/tool/add/calls"] == 1 and metrics["rollout/finish/stop"] == 1


def test_drift_is_reported_not_repaired(tokenizer):
    """Contract: when the engine's ids are not the canonical tokenization, the drift index says where; ids are kept."""
    canonical = tokenizer.encode("The answer is 5.", add_special_tokens=False)

    class CharEngine(ScriptedEngine):
        async def generate(self, input_ids, sampling_params, request_id):
            res = await super().generate(input_ids, sampling_params, request_id)
            # re-spell as one token per character: same text, different ids
            chars = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in "The answer is 5."]
            res.output_ids = chars + [tokenizer.eos_token_id]
            res.output_logprobs = [-1.0] * len(res.output_ids)
            self.returned[request_id.rsplit("#", 1)[0]][-1] = res.output_ids
            return res

    engine = CharEngine(tokenizer, lambda uid, turn: "The answer is 5.")
    out = asyncio.run(_loop(tokenizer, engine).generate([_prompt("q0")]))
    (traj,) = out
    assert len(canonical) < len("The answer is 5.")  # the canonical spelling merges characters
    assert traj.drift_index is not None and traj.drift_index >= len(traj.prompt_ids)
    assert rollout_metrics(out)["rollout/drift/count"] == 1
    _assert_mask_is_engine_output(traj, engine)


def test_n_samples_per_prompt_and_per_sample_tools(tokenizer):
    """Contract: each prompt gives n trajectories in one group; the prompt lists only the sample's own tools."""
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "done")
    add, raiser = AddTool(), FaultyTool("lookup", "raise")
    prompts = [
        _prompt("a", tools_kwargs={"add": {"create_kwargs": {"seed": 1}}}),
        _prompt("b", tools_kwargs={"lookup": {}}),
        _prompt("c"),  # no tools_kwargs: every tool
    ]
    out = asyncio.run(_loop(tokenizer, engine, [add, raiser], n=3).generate(prompts))
    assert [t.uid for t in out] == [f"{p}/{k}" for p in "abc" for k in range(3)]
    assert [t.prompt_uid for t in out] == [p for p in "abc" for _ in range(3)]
    prompt_text = {t.prompt_uid: tokenizer.decode(t.prompt_ids) for t in out}
    assert '"name": "add"' in prompt_text["a"] and '"name": "lookup"' not in prompt_text["a"]
    assert '"name": "lookup"' in prompt_text["b"] and '"name": "add"' not in prompt_text["b"]
    assert '"name": "add"' in prompt_text["c"] and '"name": "lookup"' in prompt_text["c"]
    assert add.create_kwargs.count({"seed": 1, "create_kwargs": {"seed": 1}}) == 3  # **kwargs: both verl shapes
    assert len(out) == 9


def test_the_engine_gets_the_prompt_ids_the_dataset_measured(tokenizer, tmp_path):
    """Contract: a prompt is tokenized once, at load, with the sample's own tool schemas: the ids the dataset's length
    filter measures are the ids the engine receives, and the loop sends a prompt's stored ids as they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipe.data.dataset import RLDataset

    tools = ToolRegistry([AddTool(), FaultyTool("lookup", "raise")])
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    rows = [{"data_source": "d", "prompt": question, "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"a": 1}}}}},
            {"data_source": "d", "prompt": [{"role": "user", "content": "Look it up. " * 20}],
             "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"q": "x"}}}}},
            {"data_source": "d", "prompt": question, "extra_info": {"index": 2}}]  # no tools_kwargs: every tool
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer, max_prompt_length=4096)
    codec = ChatCodec.for_tokenizer(tokenizer)
    assert ds.items[0].prompt_ids == codec.prompt_ids(question, tools.schemas(["add"]))
    assert ds.items[2].prompt_ids == codec.prompt_ids(question, tools.schemas(["add", "lookup"]))
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "done")
    loop = AgentLoop([engine], tokenizer, RolloutConfig(response_length=64, n=2), tools, InteractionRegistry([]))
    trajs = asyncio.run(loop.generate(ds.items))
    sent = {request_id: ids for request_id, ids, _ in engine.calls}
    for p in ds.items:
        assert all(sent[f"{p.uid}/{k}#0"] == p.prompt_ids for k in range(2))
    assert [t.prompt_ids for t in trajs] == [p.prompt_ids for p in ds.items for _ in range(2)]
    assert all(t.drift_index is None for t in trajs)
    # the filter measures those same ids: one token under the longest drops exactly the longest
    lengths = [len(p.prompt_ids) for p in ds.items]
    kept = RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer, max_prompt_length=max(lengths) - 1)
    assert [p.uid for p in kept.items] == [p.uid for p in ds.items if len(p.prompt_ids) < max(lengths)]
    # stored ids are sent as they are, never re-encoded
    engine.calls.clear()
    asyncio.run(_loop(tokenizer, engine).generate([_prompt("s", prompt_ids=[5, 6, 7])]))
    assert engine.calls[0][1] == [5, 6, 7]


def test_importing_the_loop_and_the_trainer_loads_no_sglang():
    """Contract: importing the agent loop, the trainer or the driver's entry point imports no SGLang (the tool-call
    parser imports it when one is built), so every process applies its CPU adapter before SGLang is loaded."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, recipe.trainer, rollout.agent_loop, recipe.main_ppo\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'sgl_kernel')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_unknown_tool_or_interaction_refused_before_running(tokenizer):
    """Contract: data naming an unknown tool or interaction is refused up front, not mid-run."""
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "x")
    loop = _loop(tokenizer, engine, [AddTool()], [ScriptedUser()])
    with pytest.raises(ValueError, match="unknown tools"):
        asyncio.run(loop.generate([_prompt("a", tools_kwargs={"nope": {}})]))
    with pytest.raises(ValueError, match="not registered"):
        asyncio.run(loop.generate([_prompt("a", interaction_kwargs={"name": "nobody"})]))
    assert engine.calls == []


def test_limits_give_the_right_finish_reason(tokenizer):
    """Contract: max assistant turns -> max_turns; response budget -> length; model context -> length."""
    always_call = lambda uid, turn: _call("add", a=turn, b=1)
    engine = ScriptedEngine(tokenizer, always_call)
    tool = AddTool()
    out = asyncio.run(_loop(tokenizer, engine, [tool], multi_turn={"max_assistant_turns": 3}).generate([_prompt("t")]))
    (traj,) = out
    assert traj.finish_reason is FinishReason.MAX_TURNS and traj.num_assistant_turns == 3
    assert len(traj.tool_calls) == 2  # the calls of the last allowed turn are not run

    engine = ScriptedEngine(tokenizer, always_call)
    out = asyncio.run(_loop(tokenizer, engine, [AddTool()], response_length=40).generate([_prompt("l")]))
    (traj,) = out
    assert traj.finish_reason is FinishReason.LENGTH and len(traj.response_ids) <= 40
    assert all(p["max_new_tokens"] <= 40 for _, _, p in engine.calls)

    engine = ScriptedEngine(tokenizer, always_call)
    loop = _loop(tokenizer, engine, [AddTool()], response_length=1000, max_model_len=300)
    (traj,) = asyncio.run(loop.generate([_prompt("m")]))
    assert traj.finish_reason is FinishReason.LENGTH and traj.total_length <= 300
    for _, ids, p in engine.calls:
        assert len(ids) + p["max_new_tokens"] <= 300
    _assert_mask_is_engine_output(traj, engine)


def test_calls_of_one_turn_run_concurrently_up_to_max_parallel_calls(tokenizer):
    """Contract: one turn's calls overlap up to max_parallel_calls; none is dropped; results keep call order."""
    four_calls = "".join(_call("add", a=i, b=10) + "\n" for i in range(4))
    policy = lambda uid, turn: [four_calls, "ok"][turn]
    for parallel, expected in ((4, 4), (2, 2), (1, 1)):
        tool = AddTool(delay_s=0.05)
        engine = ScriptedEngine(tokenizer, policy)
        loop = _loop(tokenizer, engine, [tool], multi_turn={"max_parallel_calls": parallel})
        (traj,) = asyncio.run(loop.generate([_prompt("p")]))
        assert tool.max_active == expected
        assert [c.result for c in traj.tool_calls] == ["10", "11", "12", "13"]
        assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["10", "11", "12", "13"]


def test_faulty_tools_are_data_and_always_released(tokenizer):
    """Contract: a tool that raises, hangs past its timeout, or returns 1 MB yields an error / truncated message;
    the trajectory ends normally, the hung call is cancelled, every instance is released."""
    tools = [FaultyTool("boom", "raise"), FaultyTool("sleepy", "hang", timeout_s=0.2), FaultyTool("huge", "huge")]
    calls = _call("boom", q="a") + "\n" + _call("sleepy", q="b") + "\n" + _call("huge", q="c")
    engine = ScriptedEngine(tokenizer, lambda uid, turn: [calls, "giving up"][turn])
    loop = _loop(tokenizer, engine, tools, n=2,
                 multi_turn={"max_parallel_calls": 3, "max_tool_response_length": 64, "tool_response_truncate_side": "right"})
    out = asyncio.run(loop.generate([_prompt("f")]))
    for traj in out:
        assert traj.finish_reason is FinishReason.STOP
        boom, sleepy, huge = traj.tool_calls
        assert boom.error == "exception" and "the tool broke" in boom.result
        assert sleepy.error == "timeout" and "timed out" in sleepy.result
        assert huge.error is None and huge.truncated
        assert len(tokenizer.encode(huge.result, add_special_tokens=False)) <= 64
        _assert_mask_is_engine_output(traj, engine)
    assert tools[1].cancelled == 2
    for t in tools:
        assert t.created == t.released == 2
    assert rollout_metrics(out)["rollout/tool/errors/timeout"] == 2 and rollout_metrics(out)["rollout/tool/errors/exception"] == 2
    assert rollout_metrics(out)["rollout/tool/truncations"] >= 2


def test_malformed_calls_become_error_messages(tokenizer):
    """Contract: bad JSON, unknown tool and bad arguments reach the model as tool errors and count in metrics."""
    bad = ("<tool_call>\n{not json}\n</tool_call>\n" + _call("mul", a=1, b=2) + "\n" + _call("add", a="x", b=2))
    engine = ScriptedEngine(tokenizer, lambda uid, turn: [bad, "sorry"][turn])
    tool = AddTool()
    out = asyncio.run(_loop(tokenizer, engine, [tool], response_length=2048).generate([_prompt("m")]))
    (traj,) = out
    assert [c.error for c in traj.tool_calls] == ["bad_json", "unknown_tool", "bad_arguments"]
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert all(m.startswith("Error:") for m in tool_msgs) and "'mul'" in tool_msgs[1]
    assert traj.finish_reason is FinishReason.STOP and tool.max_active == 0
    assert rollout_metrics(out)["rollout/tool/errors/bad_json"] == 1 and rollout_metrics(out)["rollout/tool/add/errors"] == 1


def test_interaction_turns_scores_and_limits(tokenizer):
    """Contract: user turns are appended with mask 0 and scored; the interaction ends the chat or max_user_turns does;
    every started interaction is finalized."""
    answers = ["It is 4.", "It is 6.", "It is 5."]
    engine = ScriptedEngine(tokenizer, lambda uid, turn: answers[turn])
    user = ScriptedUser()
    loop = _loop(tokenizer, engine, interactions=[user], multi_turn={"max_user_turns": 5})
    out = asyncio.run(loop.generate([_prompt("i", interaction_kwargs={"name": "scripteduser", "answer": "5"})]))
    (traj,) = out
    assert traj.finish_reason is FinishReason.STOP
    # each score is recorded with the assistant turn it graded, when it is produced
    assert traj.interaction_scores == [TurnScore(0, 0.0), TurnScore(1, 0.0), TurnScore(2, 1.0)]
    assert traj.num_user_turns == 2
    assert [s.role for s in traj.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    assert traj.drift_index is None
    _assert_mask_is_engine_output(traj, engine)

    engine = ScriptedEngine(tokenizer, lambda uid, turn: answers[turn])
    loop = _loop(tokenizer, engine, interactions=[user], multi_turn={"max_user_turns": 1})
    (traj,) = asyncio.run(loop.generate([_prompt("j", interaction_kwargs={"name": "scripteduser", "answer": "5"})]))
    assert traj.finish_reason is FinishReason.MAX_TURNS and traj.num_user_turns == 1
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 2


def test_interaction_that_raises_ends_only_its_trajectory(tokenizer):
    """Contract: an interaction exception gives finish reason error for that trajectory, the others finish, all finalized."""
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "It is 4.")
    crashing, fine = ScriptedUser({"name": "crashing", "raise_on_turn": 0}), ScriptedUser({"name": "fine"})
    loop = _loop(tokenizer, engine, interactions=[crashing, fine], n=2, multi_turn={"max_user_turns": 1})
    out = asyncio.run(loop.generate([_prompt("a", interaction_kwargs={"name": "crashing", "answer": "5"}),
                                     _prompt("b", interaction_kwargs={"name": "fine", "answer": "4"})]))
    reasons = [t.finish_reason for t in out]
    assert reasons == [FinishReason.ERROR] * 2 + [FinishReason.STOP] * 2
    assert "crashed" in out[0].error
    for u in (crashing, fine):
        assert sorted(u.started) == sorted(u.finalized) and len(u.started) == 2


def test_engine_abort_and_failure_end_one_trajectory(tokenizer):
    """Contract: a request the engine aborts mid-generation ends that trajectory as aborted (partial ids kept, mask 1);
    an engine exception ends its trajectory with error; the run goes on."""
    engine = ScriptedEngine(tokenizer, lambda uid, turn: None if uid == "hang/0" else "fine", fail_on={"bad/0"})
    loop = _loop(tokenizer, engine)

    async def run():
        task = asyncio.ensure_future(loop.generate([_prompt("hang"), _prompt("ok"), _prompt("bad")]))
        while "hang/0#0" not in [c[0] for c in engine.calls]:
            await asyncio.sleep(0.01)
        await engine.abort("hang/0#0")  # the engine aborts this one request (e.g. a weight sync)
        return await task

    out = asyncio.run(run())
    hang, ok, bad = out
    assert hang.finish_reason is FinishReason.ABORTED and hang.response_mask == [1] * len(hang.response_ids) != []
    assert ok.finish_reason is FinishReason.STOP
    assert bad.finish_reason is FinishReason.ERROR and "engine failure" in bad.error
    _assert_mask_is_engine_output(hang, engine)


def test_abort_cancels_everything_and_still_releases(tokenizer):
    """Contract: AgentLoop.abort cancels in-flight engine requests, tool calls and interaction waits;
    every trajectory ends aborted; created == released and started == finalized."""
    slow_tool = FaultyTool("sleepy", "hang", timeout_s=60)
    user = HungUser({"name": "slow"})
    engine = ScriptedEngine(tokenizer, by_kind)
    loop = _loop(tokenizer, engine, [slow_tool], [user], n=2)
    prompts = [_prompt("gen-0", tools_kwargs={"sleepy": {}}), _prompt("tool-0", tools_kwargs={"sleepy": {}}),
               _prompt("user-0", tools_kwargs={"sleepy": {}}, interaction_kwargs={"name": "slow"})]

    async def run():
        task = asyncio.ensure_future(loop.generate(prompts))
        while len(engine.calls) < 6 or engine.num_inflight < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # let the tool and interaction waits start
        await loop.abort()
        return await task

    out = asyncio.run(run())
    assert [t.finish_reason for t in out] == [FinishReason.ABORTED] * 6
    assert {"gen-0/0#0", "gen-0/1#0"} <= set(engine.aborted)
    assert slow_tool.cancelled == 2
    assert slow_tool.created == slow_tool.released == 6
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 2
    assert rollout_metrics(out)["rollout/finish/aborted"] == 6
    assert loop.instance_metrics()["rollout/tool/sleepy/instances_live"] == 0
    for t in out:
        _assert_mask_is_engine_output(t, engine)


def test_router_is_least_loaded_and_sticky(tokenizer):
    """Contract: new trajectories go to the least-loaded engine and every turn of one trajectory stays on its engine."""
    policy = lambda uid, turn: [_call("add", a=1, b=1), "two"][turn]
    engines = [ScriptedEngine(tokenizer, policy, name=f"e{i}", delay_s=0.02) for i in range(2)]
    loop = _loop(tokenizer, engines, [AddTool()], n=4)
    out = asyncio.run(loop.generate([_prompt("r")]))
    per_engine = [{rid.rsplit("#", 1)[0] for rid, _, _ in e.calls} for e in engines]
    assert len(per_engine[0]) == len(per_engine[1]) == 2 and not per_engine[0] & per_engine[1]
    for e in engines:
        assert all(len(e.returned[uid]) == 2 for uid in {rid.rsplit("#", 1)[0] for rid, _, _ in e.calls})
    assert all(t.finish_reason is FinishReason.STOP for t in out)


def test_router_picks_least_loaded_by_inflight():
    """Contract: with one engine busy, a new trajectory is routed to the idle engine; release forgets stickiness."""
    class Idle:
        name, weight_version, num_inflight = "idle", 0, 0

    router = EngineRouter([Idle(), Idle()])
    router._inflight = [3, 0]
    assert router.engine_for("a") == 1
    router._inflight = [0, 5]
    assert router.engine_for("a") == 1  # sticky
    router.release("a")
    assert router.engine_for("a") == 0
    with pytest.raises(ValueError, match="at least one engine"):
        EngineRouter([])


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_tool_output_truncated_to_token_budget(tokenizer, side):
    """Contract: a long tool response is cut to the token budget on the configured side, keeping the other side."""
    codec = ChatCodec(tokenizer, [tokenizer.eos_token_id])
    text = " ".join(f"w{i}" for i in range(400))
    cut, was_cut = codec.truncate(text, 40, side)
    assert was_cut and len(tokenizer.encode(cut, add_special_tokens=False)) <= 40
    assert ("w0 " in cut) == (side in ("right", "middle"))
    assert ("w399" in cut) == (side in ("left", "middle"))
    short, was_cut = codec.truncate("w1 w2", 40, side)
    assert short == "w1 w2" and not was_cut
    # multi-byte characters split by the cut, and a megabyte output, still fit the budget
    for long_text in ("é漢字🙂 " * 500, "y" * (1 << 20)):
        cut, was_cut = codec.truncate(long_text, 40, side)
        assert was_cut and "...(truncated)..." in cut
        assert len(tokenizer.encode(cut, add_special_tokens=False)) <= 40


def test_config_validation_names_the_key():
    """Contract: invalid multi-turn settings are refused at construction with the verl key named."""
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        MultiTurnConfig(tool_response_truncate_side="top")
    with pytest.raises(ValueError, match="multi_turn.format"):
        MultiTurnConfig(format="no_such_format")
    with pytest.raises(ValueError, match="max_parallel_calls"):
        MultiTurnConfig(max_parallel_calls=0)
    with pytest.raises(ValueError, match="rollout.n"):
        RolloutConfig(n=0)
    cfg = RolloutConfig(multi_turn={"max_assistant_turns": 2, "format": "hermes"})
    assert cfg.multi_turn.max_assistant_turns == 2 and cfg.multi_turn.format == "hermes"


def test_prompt_from_verl_row():
    """Contract: a verl data row maps onto the rollout prompt (tools_kwargs, interaction_kwargs, ground truth)."""
    row = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule", "ground_truth": "42"},
           "extra_info": {"index": 3, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}},
                          "interaction_kwargs": {"name": "gsm8k", "query": "q", "ground_truth": "42"}}}
    p = RolloutPrompt.from_row(row, uid="r3")
    assert p.ground_truth == "42" and p.tools_kwargs["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "42"}
    assert p.interaction_kwargs["name"] == "gsm8k" and p.extra_info["index"] == 3
    with pytest.raises(ValueError, match="list of chat messages"):
        RolloutPrompt.from_row({"prompt": "q"}, uid="bad")


def test_tool_calc_reward_is_kept_for_training(tokenizer):
    """Contract: each tool instance's final `calc_reward` (with the sample's calc_reward_kwargs) is recorded before
    release, so tool rewards reach the trainer instead of being thrown away."""
    policy = lambda uid, turn: [_call("add", a=1, b=1), "2"][turn]
    tool = AddTool()
    prompt = _prompt("q0", tools_kwargs={"add": {"calc_reward_kwargs": {"bonus": 0.25}}})
    out = asyncio.run(_loop(tokenizer, ScriptedEngine(tokenizer, policy), [tool]).generate([prompt]))
    (traj,) = out
    assert traj.tool_rewards == {"add": 0.75}
    assert tool.created == tool.released


def test_rewards_carry_the_assistant_turn_they_belong_to(tokenizer):
    """Contract: tool step rewards and interaction scores are recorded with the index of the assistant turn that
    earned them, as they are produced: tool calls and graded answers interleave, nothing is left to re-derive."""
    script = [_call("add", a=1, b=1), "It is 4.", _call("add", a=2, b=3), "It is 5."]
    engine = ScriptedEngine(tokenizer, lambda uid, turn: script[turn])
    loop = _loop(tokenizer, engine, [AddTool()], [ScriptedUser()], multi_turn={"max_user_turns": 5})
    (traj,) = asyncio.run(loop.generate([_prompt("x", interaction_kwargs={"name": "scripteduser", "answer": "5"})]))
    assert traj.finish_reason is FinishReason.STOP and traj.num_assistant_turns == 4
    assert [(c.turn, c.step_reward) for c in traj.tool_calls] == [(0, 0.25), (2, 0.25)]
    assert traj.interaction_scores == [TurnScore(1, 0.0), TurnScore(3, 1.0)]
    ends = traj.assistant_turn_ends
    assert [traj.response_mask[e] for e in ends] == [1, 1, 1, 1] and ends == sorted(ends)


def test_greedy_rollout_is_one_temperature_zero_sample_per_prompt(tokenizer):
    """Contract: `generate(greedy=True)` (ReMax's baseline) samples each prompt once at temperature 0, whatever
    rollout.n and the configured temperature are; a plain call uses the configured sampling."""
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "It is 5.")
    loop = _loop(tokenizer, engine, n=3, temperature=0.7, top_p=0.9)
    greedy = asyncio.run(loop.generate([_prompt("a"), _prompt("b")], greedy=True))
    assert [t.prompt_uid for t in greedy] == ["a", "b"]
    assert all(p["temperature"] == 0.0 and p["top_p"] == 1.0 for _, _, p in engine.calls)
    sampled = asyncio.run(loop.generate([_prompt("a")]))
    assert len(sampled) == 3 and all(p["temperature"] == 0.7 and p["top_p"] == 0.9 for _, _, p in engine.calls[2:])


def test_trajectory_carries_its_data_row(tokenizer):
    """Contract: data_source, ground truth and extra info of the row ride on every trajectory of its prompt."""
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
           "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 7}}
    engine = ScriptedEngine(tokenizer, lambda uid, turn: "#### 42")
    trajs = asyncio.run(_loop(tokenizer, engine, n=2).generate([RolloutPrompt.from_row(row, uid="r7")]))
    assert [(t.data_source, t.ground_truth, t.extra_info["index"]) for t in trajs] == [("openai/gsm8k", "42", 7)] * 2


def test_over_sampling_aborts_the_slowest_and_still_releases(tokenizer):
    """Contract (verl's over_sample_rate): with rate 0.25 of 8 trajectories, once 6 have ended the other 2 (hung on
    the engine, waiting on a tool, or on a simulated user) are cancelled and their engine requests aborted; they end
    `over_sampled`, never `aborted`; tools created == released and interactions started == finalized; the trainer
    leaves them out. Without the rate the same rollout waits for every trajectory; `abort()` still means aborted."""
    from recipe.group_filter import trainable

    slow_tool = FaultyTool("sleepy", "hang", timeout_s=60)
    user = HungUser({"name": "slow"})
    engine = ScriptedEngine(tokenizer, by_kind)
    loop = _loop(tokenizer, engine, [slow_tool], [user], n=2)
    prompts = [_prompt(f"fast-{i}", tools_kwargs={"sleepy": {}}) for i in range(3)] + \
        [_prompt("gen-0", tools_kwargs={"sleepy": {}})]
    out = asyncio.run(asyncio.wait_for(loop.generate(prompts, over_sample_rate=0.25), 30))
    reasons = {t.uid: t.finish_reason for t in out}
    assert [reasons[f"fast-{i}/{k}"] for i in range(3) for k in range(2)] == [FinishReason.STOP] * 6
    assert reasons["gen-0/0"] is reasons["gen-0/1"] is FinishReason.OVER_SAMPLED
    assert {"gen-0/0#0", "gen-0/1#0"} <= set(engine.aborted)
    assert slow_tool.created == slow_tool.released == 8
    assert rollout_metrics(out)["rollout/finish/over_sampled"] == 2
    assert [t.uid for t in trainable(out, 1)] == [f"fast-{i}/{k}" for i in range(3) for k in range(2)]

    # the 2 slowest of 8 are cut wherever they wait: on a tool call or on the simulated user
    prompts = [_prompt(f"fast-{i}", tools_kwargs={"sleepy": {}}) for i in range(3)] + \
        [_prompt("tool-0", tools_kwargs={"sleepy": {}}), _prompt("user-0", interaction_kwargs={"name": "slow"})]
    loop = _loop(tokenizer, engine, [slow_tool], [user], n=2)
    out = asyncio.run(asyncio.wait_for(loop.generate(prompts[:3] + prompts[3:4], over_sample_rate=0.25), 30))
    assert [t.finish_reason for t in out[6:]] == [FinishReason.OVER_SAMPLED] * 2 and slow_tool.cancelled == 2
    out = asyncio.run(asyncio.wait_for(loop.generate(prompts[:3] + prompts[4:], over_sample_rate=0.25), 30))
    assert [t.finish_reason for t in out[6:]] == [FinishReason.OVER_SAMPLED] * 2
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 2

    # no rate: the hung trajectories are waited for until the caller aborts, and then they are aborted
    async def unlimited():
        task = asyncio.ensure_future(loop.generate(prompts[:1] + prompts[3:4]))
        await asyncio.sleep(0.5)
        assert not task.done()
        await loop.abort()
        return await task

    out = asyncio.run(unlimited())
    assert [t.finish_reason for t in out] == [FinishReason.STOP] * 2 + [FinishReason.ABORTED] * 2

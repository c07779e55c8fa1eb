"""verl v0.9's rollout-side options that change what is trained, honoured as verl does:
`actor_rollout_ref.rollout.engine_kwargs.sglang.*` reaches SGLang's ServerArgs (polyturn's own arguments and names
SGLang does not have are refused before Ray), `data.apply_chat_template_kwargs` reaches every render of the chat
template (the prompt the length filter measures and every later turn), `multi_turn.max_assistant_turns` /
`max_user_turns` default to no limit (the response budget ends a chat), and `actor_rollout_ref.model.trust_remote_code`
reaches every config and tokenizer load and the engines.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest

from recipe import launch, preflight
from recipe.config_schema import ConfigError
from recipe.tiny_tokenizer import CHAT_TEMPLATE
from rollout.agent_loop import AgentLoop
from rollout.config import SGLANG_OWNED, MultiTurnConfig, RolloutConfig
from rollout.interactions.registry import InteractionRegistry
from rollout.tools.registry import ToolRegistry
from rollout.trajectory import FinishReason
from tests.test_agent_loop import AddTool, ScriptedEngine, _call, _loop, _prompt

pytestmark = pytest.mark.unit

SG = "actor_rollout_ref.rollout.engine_kwargs.sglang"
THINK_OFF = "<think>\n\n</think>\n\n"
GEN_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny tokenizer with a Qwen3-style template: the generation prompt closes an empty think block when
    `enable_thinking` is false."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert GEN_PROMPT in CHAT_TEMPLATE
    tok.chat_template = CHAT_TEMPLATE.replace(GEN_PROMPT, GEN_PROMPT.replace(
        "{%- endif -%}", "{%- if enable_thinking is defined and enable_thinking is false -%}{{- "
        + json.dumps(THINK_OFF) + " -}}{%- endif -%}{%- endif -%}"))
    return tok


# ---- engine_kwargs.sglang ------------------------------------------------------------------


def test_sglang_pass_through_reaches_server_args():
    """Contract: a pass-through key reaches the ServerArgs every engine starts with, beside polyturn's own (layout,
    seed, trust_remote_code); a user's log_level replaces polyturn's default."""
    from sglang.srt.server_args import ServerArgs

    from recipe.main_ppo import engine_kwargs

    rollout = RolloutConfig(engine_kwargs={"sglang": {"disable_radix_cache": True, "log_level": "warning"}})
    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=rollout, model=SimpleNamespace(
        trust_remote_code=True)), trainer=SimpleNamespace(seed=7))
    args = ServerArgs(model_path="/models/m", **engine_kwargs(cfg, 1, tp=2, base_gpu_id=2, colocated=False))
    assert args.disable_radix_cache is True and args.log_level == "warning"
    assert (args.tp_size, args.base_gpu_id, args.random_seed, args.trust_remote_code) == (2, 2, 8, True)
    assert ServerArgs(model_path="/models/m").disable_radix_cache is False  # the key made the difference


def test_sglang_owned_and_unknown_keys_refused_naming_the_fix():
    """Contract: an SGLang argument polyturn sets itself is refused naming the polyturn key that sets it; a name
    SGLang's ServerArgs does not have is refused before Ray, with the near name; real ones pass. Every owned name is
    a real ServerArgs name (the table cannot drift from SGLang)."""
    from rollout.engines.sglang_engine import server_arg_names

    with pytest.raises(ValueError, match=r"tp_size from actor_rollout_ref.rollout.tensor_model_parallel_size; "
                                         r"mem_fraction_static from actor_rollout_ref.rollout.gpu_memory_utilization"):
        RolloutConfig(engine_kwargs={"sglang": {"tp_size": 2, "mem_fraction_static": 0.3, "disable_radix_cache": 1}})
    with pytest.raises(ConfigError, match=r"disable_radix_cashe \(did you mean disable_radix_cache\?\).*fix or drop"):
        preflight.check_engine_kwargs({"disable_radix_cashe": True, "enable_weights_cpu_backup": False})
    preflight.check_engine_kwargs({"disable_radix_cache": True, "enable_weights_cpu_backup": False})
    assert set(SGLANG_OWNED) <= server_arg_names()


def test_sglang_keys_on_the_command_line():
    """Contract: verl's `+...engine_kwargs.sglang.<key>=<value>` becomes a polyturn override; enable_memory_saver
    (polyturn's, by placement) is dropped with a warning, not passed."""
    plan = launch.prepare([f"+{SG}.disable_radix_cache=True", f"+{SG}.enable_memory_saver=False"])
    assert plan.overrides == [f"++{SG}.disable_radix_cache=True"]
    assert [w.split(" ")[0] for w in plan.warned] == [f"{SG}.enable_memory_saver"]


# ---- data.apply_chat_template_kwargs ---------------------------------------------------------


def test_chat_template_kwargs_reach_the_prompt_and_every_later_turn(tokenizer, tmp_path):
    """Contract: with enable_thinking=false the prompt tokenized at load carries the template's marker, the length
    filter measures those ids, the engine gets exactly them, and the turn after a tool response is rendered with the
    same option."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipe.data.dataset import RLDataset

    tools = ToolRegistry([AddTool()])
    rows = [{"data_source": "d", "prompt": [{"role": "user", "content": "What is 2 plus 3? " * 3}]},
            {"data_source": "d", "prompt": [{"role": "user", "content": "Hi"}]}]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    off = {"enable_thinking": False}
    plain = RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer)
    ds = RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer, chat_template_kwargs=off)
    assert not tokenizer.decode(plain.items[0].prompt_ids).endswith(THINK_OFF)
    assert tokenizer.decode(ds.items[0].prompt_ids).endswith("<|im_start|>assistant\n" + THINK_OFF)
    longest = len(plain.items[0].prompt_ids)
    assert len(RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer, max_prompt_length=longest)) == 2
    kept = RLDataset([path], tools, InteractionRegistry([]), tokenizer=tokenizer, max_prompt_length=longest,
                     chat_template_kwargs=off)
    assert [p.uid for p in kept.items] == [ds.items[1].uid]  # measured with the marker: one over

    engine = ScriptedEngine(tokenizer, lambda uid, turn: _call("add", a=2, b=3) if turn == 0 else "5")
    loop = AgentLoop([engine], tokenizer, RolloutConfig(response_length=256), tools, InteractionRegistry([]),
                     chat_template_kwargs=off)
    (traj,) = asyncio.run(loop.generate([ds.items[0]]))
    first, second = engine.calls[0][1], engine.calls[1][1]
    assert first == ds.items[0].prompt_ids
    assert tokenizer.decode(second[len(first):]).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"
                                                         + THINK_OFF)
    assert traj.finish_reason is FinishReason.STOP and traj.num_assistant_turns == 2


def test_chat_template_kwargs_the_rollout_sets_are_refused():
    """Contract: a template option the rollout sets on each render (tools, the generation prompt) is refused."""
    from recipe.config_schema import DataConfig

    with pytest.raises(ConfigError, match=r"data.apply_chat_template_kwargs sets \['tools'\]"):
        DataConfig(train_files=[__file__], apply_chat_template_kwargs={"tools": [], "enable_thinking": False})


# ---- max_assistant_turns / max_user_turns ------------------------------------------------------


def test_turn_limits_default_to_none_and_the_response_budget_ends_the_chat(tokenizer):
    """Contract: verl's defaults, no turn limit: a model that calls a tool every turn goes on past polyturn's old
    limit of 5 turns until the response budget ends it (finish reason length); 0 is refused (verl reads it as no
    limit), null is no limit."""
    mt = MultiTurnConfig()
    assert (mt.max_assistant_turns, mt.max_user_turns) == (None, None)
    engine = ScriptedEngine(tokenizer, lambda uid, turn: _call("add", a=turn, b=1))
    (traj,) = asyncio.run(_loop(tokenizer, engine, [AddTool()], response_length=700).generate([_prompt("t")]))
    assert traj.finish_reason is FinishReason.LENGTH and traj.num_assistant_turns > 5
    assert len(traj.response_ids) <= 700
    for key in ("max_assistant_turns", "max_user_turns"):
        with pytest.raises(ValueError, match=f"{key} is 0; use a turn count >= 1, or null for no limit"):
            MultiTurnConfig(**{key: 0})


# ---- trust_remote_code ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote_code_model(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint under a model_type transformers does not know, its config class in the checkpoint's own
    code (`auto_map`): loading it needs trust_remote_code."""
    d = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "configuration_tiny_remote.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass TinyRemoteConfig(Qwen2Config):\n"
        "    model_type = 'polyturn_tiny_remote'\n")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="polyturn_tiny_remote", auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"})
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_trust_remote_code_reaches_the_config_and_tokenizer_loads(remote_code_model, tmp_path):
    """Contract: actor_rollout_ref.model.trust_remote_code=true lets the driver (model config, tokenizer) and the
    Megatron ranks (`load_hf_checkpoint`) read a checkpoint whose config is its own code; false (verl's default)
    does not run it. verl's data.trust_remote_code and critic.model.trust_remote_code must agree with it."""
    from transformers import AutoConfig

    from megatron_workers.model import load_hf_checkpoint
    from recipe.main_ppo import prepare
    from recipe.tasks import gsm8k

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(remote_code_model)
    assert type(load_hf_checkpoint(remote_code_model, trust_remote_code=True)[0]).__name__ == "TinyRemoteConfig"
    records = [{"question": f"Tom has {i} boxes of 3 apples. How many?", "answer": f"#### {3 * i}"} for i in range(4)]
    gsm8k.write_rows([gsm8k.make_row(r, "train", i) for i, r in enumerate(records)], tmp_path / "train.parquet")
    base = ["--config-name", "cpu_tiny", f"actor_rollout_ref.model.path={remote_code_model}",
            f"data.train_files=[{tmp_path / 'train.parquet'}]", f"trainer.default_local_dir={tmp_path / 'out'}"]
    cfg = launch.load([*base, "actor_rollout_ref.model.trust_remote_code=True", "data.trust_remote_code=True"])[0]
    assert prepare(cfg).tokenizer is not None
    with pytest.raises(ConfigError, match="data.trust_remote_code=True.*actor_rollout_ref.model.trust_remote_code"):
        launch.load([*base, "data.trust_remote_code=True"])

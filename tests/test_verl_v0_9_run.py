"""End to end: a verl v0.9 user's agent-loop run, as they bring it, trains on the tiny model.

verl's agent-loop tutorial's tool_agent training cell (tests/verl_files/v0_9/) is the launch line, sized down in
place for this 2-core machine; the data rows are the ones verl v0.9's `examples/data_preprocess/
gsm8k_tool_agent_loop.py` writes (`agent_name`, the `calc_gsm8k_reward`-style `tools_kwargs`), plus rows that ask
for `single_turn_agent`; the tool YAML names a verl-recipe class path (`recipe.partial_rollout...`, a checkout on
PYTHONPATH, its module importing `verl.tools.base_tool` with no verl installed), and a function-tool file written
with verl's `@function_tool` rides along (`multi_turn.function_tool_path`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recipe.tasks import write_rows
from tests.test_function_tools import VERL_FUNCTION_TOOLS
from tests.test_plugin_imports import SCHEMA, TOOL_PATH, verl_recipe_checkout
from tests.test_verl_keys import cell_line

pytestmark = pytest.mark.integration
TOOLS = ("check", "get_weather", "calculator", "broken")  # the YAML's tool and the function-tool file's
REPO = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a math expert. Reason step by step, check your answer with the `check` tool, and put your final "
          "answer in the format of `#### <answer>`.")
KINDS = ("single_turn_agent", "tool_agent", "tool_agent")  # row i: KINDS[i % 3]; tools_kwargs only when i % 3 == 1


def v0_9_row(i: int, split: str) -> dict:
    """A row as verl v0.9's gsm8k_tool_agent_loop.py writes it (the tool's name is the YAML's, `check`), its agent
    KINDS[i % 3]; the tool_agent rows with i % 3 == 2 carry no tools_kwargs."""
    question, solution = f"Tom has {i} boxes of 3 apples. How many apples?", str(3 * i)
    kwargs = {"tools_kwargs": {"check": {"create_kwargs": {"ground_truth": solution}}}} if i % 3 == 1 else {}
    return {"data_source": "openai/gsm8k", "agent_name": KINDS[i % 3],
            "prompt": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": question + " Let's think step by step and output the final answer "
                                                              "after `####`."}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": i, "answer": f"{i} * 3 = {solution}\n#### {solution}",
                           "question": question, "need_tools_kwargs": bool(kwargs), **kwargs}}


SIZES = {"data.train_batch_size": 4, "data.max_prompt_length": 1024, "data.max_response_length": 48,
         "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
         "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
         "trainer.n_gpus_per_node": 1, "trainer.total_training_steps": 1, "trainer.val_before_train": False}


def test_verl_v0_9_agent_loop_cell_trains_with_its_rows_a_verl_recipe_tool_and_function_tools(tiny_model_dir,
                                                                                             tmp_path):
    """Contract: the tutorial cell (every key as verl writes it, the sizes above replaced in place, the model the
    tiny one) starts and trains step 1; a tool_agent row without tools_kwargs is offered the verl-recipe tool and the
    function tools (their schemas in the rendered prompt the engine got), one with tools_kwargs the tools it names,
    a single_turn_agent row none; the tensorboard logger writes the step."""
    home = tmp_path / "home"
    for split in ("train", "test"):
        rows = [v0_9_row(i, split) for i in range(2, 11)]
        write_rows(rows, home / "data" / "gsm8k" / f"{split}.parquet")
    checkout = verl_recipe_checkout(tmp_path / "verl")
    (home / "gsm8k_tool_config.yaml").write_text(yaml.safe_dump(
        {"tools": [{"class_name": TOOL_PATH, "config": {"type": "native"}, "tool_schema": SCHEMA}]}))
    functions = tmp_path / "function_tools.py"
    functions.write_text(VERL_FUNCTION_TOOLS)
    args = []
    for arg in cell_line(home):
        key = arg.split("=", 1)[0].lstrip("+")
        args.append(f"{key}={SIZES[key]}" if key in SIZES else
                    f"{key}={tiny_model_dir}" if key == "actor_rollout_ref.model.path" else arg)
    out = tmp_path / "out"
    env = {**os.environ, "WANDB_MODE": "offline", "TENSORBOARD_DIR": str(tmp_path / "tb"),
           "PYTHONPATH": os.pathsep.join([str(checkout), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "recipe.main_ppo", "--config-name", "cpu_tiny", *args,
                           f"actor_rollout_ref.rollout.multi_turn.function_tool_path={functions}",
                           "data.shuffle=False", f"trainer.default_local_dir={out}",
                           f"trainer.rollout_data_dir={out / 'rollout'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()][-1] == 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(ln) for ln in (out / "rollout" / "1.jsonl").read_text().splitlines()]
    offered: dict[int, set] = {}  # i % 3 -> the tool sets whose schemas the prompts of those rows carry
    for r in rows:
        i = int(re.search(r"Tom has (\d+) boxes", r["prompt"][-1]["content"]).group(1))
        in_prompt = frozenset(name for name in TOOLS if f'"{name}"' in tokenizer.decode(r["prompt_ids"]))
        offered.setdefault(i % 3, set()).add(in_prompt)
    # single_turn_agent: none; tools_kwargs: the tools it names (polyturn's per-sample choice); none: every tool
    assert offered == {0: {frozenset()}, 1: {frozenset({"check"})}, 2: {frozenset(TOOLS)}}, offered
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))

"""Tests of the multi-turn SFT entry (`python -m recipe.main_sft`) and its dataset (`recipe.data.sft_dataset`).

The mask test runs the real agent loop (scripted engine at the engine seam, the tiny
checkpoint's chat template, a real tool and a simulated user) and encodes the same
conversation as an SFT row: ids and loss mask must be the rollout's. The end-to-end test runs
the Hydra entry on the tiny checkpoint (Ray, one Megatron rank, HF export) and checks the
export with transformers.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recipe.batch import collate
from recipe.config_build import flat_keys
from recipe.config_schema import ConfigError, ModelConfig
from recipe.data.sft_dataset import SFT_KEYS, SFTDataset
from recipe.sft_config import SFT, SFTConfig
from rollout.chat_codec import ChatCodec
from rollout.prompt import RolloutPrompt
from rollout.tools.registry import ToolRegistry
from tests.test_agent_loop import AddTool, ScriptedEngine, ScriptedUser, _call, _loop

REPO = Path(__file__).resolve().parent.parent
SYSTEM = {"role": "system", "content": "Answer with the add tool."}
QUESTION = {"role": "user", "content": "What is 2 plus 3?"}
TURNS = [_call("add", a=2, b=3), "The answer is 6.", "The answer is 5."]  # tool call, wrong answer, right answer


@pytest.fixture(scope="module")
def codec(tiny_model_dir):
    from transformers import AutoTokenizer

    return ChatCodec.for_tokenizer(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def _write(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


@pytest.mark.unit
def test_sft_ids_and_masks_equal_the_rollouts(codec, tmp_path):
    """Contract: a conversation with a tool call, a tool response and a user turn, as an SFT row (verl's format:
    structured tool_calls, tools column), has exactly the prompt ids, response ids and loss mask of the rollout that
    produced it: loss on the assistant tokens (stop token included), none on system / user / tool tokens."""
    tok = codec.tokenizer
    engine = ScriptedEngine(tok, lambda uid, turn: TURNS[turn])
    loop = _loop(tok, engine, [AddTool()], [ScriptedUser()], multi_turn={"max_assistant_turns": 5})
    prompt = RolloutPrompt(uid="q", messages=[SYSTEM, QUESTION], interaction_kwargs={"name": "scripteduser", "answer": "5"})
    (traj,) = asyncio.run(loop.generate([prompt]))
    assert [s.role for s in traj.turns] == ["assistant", "tool", "assistant", "user", "assistant"]
    schemas = loop.tools.schemas(traj.tool_names)
    demo = [SYSTEM, QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "The answer is 6."},
            {"role": "user", "content": "Not quite, try again."},
            {"role": "assistant", "content": "The answer is 5."}]
    other_tool = {"type": "function", "function": {"name": "mul", "description": "multiplies", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}
    rows = [{"messages": demo, "tools": schemas},  # tools as a list column: parquet unifies it with row 3's structs
            {"messages": traj.messages, "tools": schemas},  # the rollout's own message log (calls as raw text)
            {"messages": [QUESTION, {"role": "assistant", "content": "5"}], "tools": [other_tool]}]
    data = SFTDataset([_write(tmp_path / "sft.parquet", rows)], codec)
    for sft in data.items[:2]:
        assert sft.prompt_ids == traj.prompt_ids
        assert sft.response_ids == traj.response_ids
        assert sft.response_mask == traj.response_mask
    assert data.items[0].response_mask.count(1) == sum(len(ids) for ids in engine.returned[traj.uid])
    batch = data.collate(data.items[:1])
    expected = collate([traj], data.pad_token_id)
    for key in SFT_KEYS:
        assert torch.equal(batch[key], expected[key]), key


@pytest.mark.unit
def test_sft_rows_refused_or_cut_by_name(codec, tmp_path):
    """Contract: a row without an assistant turn, or longer than data.max_length under truncation=error, is refused
    naming its file and row; truncation=right cuts the response end and keeps its mask; two assistant messages in a
    row get the template's glue between them (the chat as the template renders it)."""
    long = [QUESTION, {"role": "assistant", "content": "five " * 40}]
    f = _write(tmp_path / "long.parquet", [{"messages": long}])
    with pytest.raises(ValueError, match=r"long\.parquet\[0\].*data.max_length=40"):
        SFTDataset([f], codec, max_length=40)
    cut = SFTDataset([f], codec, max_length=40, truncation="right").items[0]
    full = SFTDataset([f], codec, max_length=4096).items[0]
    assert cut.total_length == 40 and cut.response_ids == full.response_ids[:len(cut.response_ids)]
    assert cut.response_mask == full.response_mask[:len(cut.response_ids)]
    cut.check_invariants()
    twice = [QUESTION, {"role": "assistant", "content": "Let me think."}, {"role": "assistant", "content": "5"}]
    both = SFTDataset([_write(tmp_path / "twice.parquet", [{"messages": twice}])], codec).items[0]
    assert [s.role for s in both.turns] == ["assistant", "template", "assistant"]
    assert codec.tokenizer.decode(both.prompt_ids + both.response_ids) == \
        codec.tokenizer.apply_chat_template(twice, tokenize=False).rstrip("\n")
    with pytest.raises(ValueError, match=r"no_assistant\.parquet\[0\]: no assistant message"):
        SFTDataset([_write(tmp_path / "no_assistant.parquet", [{"messages": [QUESTION]}])], codec)


def _config(tmp_path: Path, **over) -> dict:
    """The composed sft_trainer config (its YAML over the dataclasses' defaults) on a one-row file, `over` set."""
    from recipe import launch

    f = _write(tmp_path / "d.parquet", [{"messages": [QUESTION, {"role": "assistant", "content": "5"}]}])
    cfg = launch.compose(launch.prepare([f"data.train_files=[{f}]", f"model.partial_pretrain={tmp_path}"], SFT), SFT)
    for key, value in over.items():
        *path, leaf = key.split(".")
        node = cfg
        for p in path:
            node = node[p]
        node[leaf] = value
    return cfg


@pytest.mark.unit
def test_sft_config_surface_and_errors_name_the_key(tmp_path):
    """Contract: the composed sft_trainer config holds exactly the keys SFTConfig declares (its sections are the RL
    trainer's: one declaration per default); verl's SFT keys go through the RL entry's machinery (an unknown key gets
    "did you mean", a verl key polyturn's SFT does not take is refused naming what to use instead, trainer.seed is the
    top-level seed, gradient checkpointing is Megatron's recompute); a bad value is refused naming the key and fix."""
    from megatron_workers.config import FULL_RECOMPUTE
    from recipe import launch
    from recipe.config_schema import DataFiles, ModelSection, RunConfig

    def leaves(d, prefix=""):
        return [k for key, v in d.items()
                for k in (leaves(v, f"{prefix}{key}.") if isinstance(v, dict) and v else [prefix + key])]

    assert sorted(leaves(_config(tmp_path))) == flat_keys(SFTConfig)
    cfg = SFTConfig.from_dict(_config(tmp_path))
    assert isinstance(cfg.trainer, RunConfig) and isinstance(cfg.data, DataFiles) and isinstance(cfg.model, ModelSection)
    assert (cfg.optim.lr, cfg.trainer.logger, cfg.trainer.n_gpus_per_node) == (1e-5, ["console"], 1)  # the YAML's
    base = [f"data.train_files=[{_write(tmp_path / 'e.parquet', [{'messages': [QUESTION]}])}]",
            f"model.partial_pretrain={tmp_path}"]
    with pytest.raises(ConfigError, match=r"unknown config key data.max_lenght; did you mean data.max_length\?"):
        launch.prepare(["--config-name", "sft_trainer", "data.max_lenght=5"], SFT)
    with pytest.raises(ConfigError) as refused:
        launch.prepare(["optim.betas=[0.9,0.95]", "data.prompt_key=q"], SFT)
    assert refused.value.problems == ["optim.betas=[0.9, 0.95]: use optim.adam_beta1 and optim.adam_beta2",
                                      "data.prompt_key=q: polyturn's SFT is multi-turn only: write rows as a messages "
                                      "column (data.multiturn.messages_key)"]
    seeded = launch.load([*base, "trainer.seed=3", "model.enable_gradient_checkpointing=true"], SFT)[0]
    assert seeded.seed == 3 and seeded.megatron.override_transformer_config == FULL_RECOMPUTE
    with pytest.raises(ConfigError, match=r"data.truncation='left'"):
        SFTConfig.from_dict(_config(tmp_path, **{"data.truncation": "left"}))
    with pytest.raises(ConfigError, match=r"data.train_batch_size=3 cannot be split over 2"):
        SFTConfig.from_dict(_config(tmp_path, **{"data.train_batch_size": 3, "trainer.n_gpus_per_node": 2}))
    with pytest.raises(ConfigError, match=r"= 3 ranks is not a multiple of tensor x pipeline parallel size = 2 "
                                          r"\(megatron\); change megatron.\* or the rank count"):  # RL's own check
        SFTConfig.from_dict(_config(tmp_path, **{"trainer.n_gpus_per_node": 3, "megatron.tensor_model_parallel_size": 2}))


def _nll(model_dir: Path, batch: dict[str, torch.Tensor]) -> float:
    """Token-mean cross-entropy of the assistant tokens under transformers (the SFT loss, computed independently)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits  # (B, S, V)
    T = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -T - 1:-1].float(), dim=-1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].float()  # (B, T)
    return float(-(logp * mask).sum() / mask.sum())


@pytest.mark.integration
def test_main_sft_trains_megatron_and_exports_an_hf_dir(tiny_model_dir, codec, tmp_path):
    """Contract: `python -m recipe.main_sft` trains the Megatron actor on multi-turn rows (loss falls on a repeated
    batch), writes `<default_local_dir>/hf` that transformers loads and actor_rollout_ref.model.path accepts, holding
    the trained weights, and prints the final JSON line; the training and validation losses it reports are the masked
    loss transformers computes before and after training.
    A bad value stops the same command before Ray starts, naming the key."""
    rows = [{"messages": [SYSTEM, {"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                              "name": "add", "arguments": json.dumps({"a": a, "b": b})}}]},
                          {"role": "tool", "content": str(a + b)},
                          {"role": "assistant", "content": f"The answer is {a + b}."}],
             "tools": json.dumps(ToolRegistry([AddTool()]).schemas())} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]
    data = _write(tmp_path / "train.parquet", rows)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipe.main_sft", f"data.train_files=[{data}]",
           f"model.partial_pretrain={tiny_model_dir}", f"trainer.default_local_dir={out}",
           "trainer.total_training_steps=3", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
           "optim.lr=1e-3", "optim.weight_decay=0.0", "megatron.dtype=float32", "seed=1", "ray_init.num_cpus=2", f"hydra.run.dir={tmp_path}/hydra",
           f"data.val_files=[{data}]"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run(cmd + ["data.truncation=left"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "data.truncation='left'" in bad.stderr
    assert "Started a local Ray instance" not in bad.stderr + bad.stdout
    home = tmp_path / "home"  # wandb online with no login anywhere: refused before Ray too, in one line
    home.mkdir()
    no_login = {k: v for k, v in env.items() if not k.startswith("WANDB_")} | {"HOME": str(home)}
    bad = subprocess.run(cmd + ["trainer.logger=[console,wandb]"], cwd=REPO, env=no_login, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "includes wandb but no wandb login" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and "Started a local Ray instance" not in bad.stderr + bad.stdout
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3
    logged = [json.loads(line)["sft/sft_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 3 and logged[0] == result["sft_loss_first"] and logged[-1] == result["sft_loss_last"]
    assert logged[0] > logged[1] > logged[2]  # the same 4 rows every step
    hf = out / "hf"
    assert ModelConfig(path=str(hf)).path == str(hf)
    dataset = SFTDataset([data], codec)
    batch = dataset.collate(dataset.items)
    assert _nll(tiny_model_dir, batch) == pytest.approx(logged[0], abs=1e-4)  # same tokens, same mask, same loss
    exported = _nll(hf, batch)
    assert exported < logged[-1]  # the export holds the weights after the third step,
    assert result["val_loss"] == pytest.approx(exported, abs=1e-4)  # which the validation after it measured
